"""Shards of a gate over real llama.cpp servers (``pytest suites/lossless --engine llamacpp --preset …
--shard I/N``, each shard launching its own pair), merged with ``specparity merge``: the merged run has the
unsharded run's per-prompt classes, threshold and verdict. Skipped without a llama-server
build (failed under ``SPECPARITY_REQUIRE_LLAMACPP``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inprocess import run_cli, run_pytest
from llamacpp_fixtures import require_llamacpp

pytestmark = pytest.mark.slow

#: Three categories, a short limit, the noise measured on the prompts that run: llama.cpp scores one
#: request per baseline position, so this keeps the three runs to a few seconds each.
ARGS = ("--engine", "llamacpp", "--preset", "llamacpp-ngram-simple", "--categories", "repeat,code,zh_qa",
        "--max-new-tokens", "16", "--calibration", "selected")


def _lines(report: Path) -> list[dict]:
    return [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]


def _last(report: Path, kind: str) -> dict:
    return [x for x in _lines(report) if x["kind"] == kind][-1]


def _classes(report: Path) -> list[tuple[str, str]]:
    return [(x["prompt"]["id"], x["verdict"]["class"]) for x in _lines(report) if x["kind"] == "prompt"]


def test_llamacpp_shards_merge_to_the_unsharded_run(tmp_path):
    require_llamacpp()
    runs = {name: tmp_path / name for name in ("whole", "0", "1")}
    for name, extra in (("whole", ()), ("0", ("--shard", "0/2")), ("1", ("--shard", "1/2"))):
        code, out = run_pytest("-q", "suites/lossless", *ARGS, *extra, "--report", str(runs[name]))
        assert code in (0, 1), out[-4000:]
    shard_ids = [{pid for pid, _ in _classes(runs[i])} for i in ("0", "1")]
    assert shard_ids[0] and shard_ids[1] and not shard_ids[0] & shard_ids[1]
    assert shard_ids[0] | shard_ids[1] == {pid for pid, _ in _classes(runs["whole"])}
    code, out = run_cli("merge", runs["0"], runs["1"], "--report", tmp_path / "merged")
    whole = _last(runs["whole"], "verdict")
    assert code == whole["exit_code"], out[-4000:]
    # prompt by prompt (a server run journals prompts as they finish; the merge in prompt-file order)
    assert dict(_classes(tmp_path / "merged")) == dict(_classes(runs["whole"]))
    a, b = _last(runs["whole"], "threshold"), _last(tmp_path / "merged", "threshold")
    for key in ("nats", "drift_nats", "noise", "flip_rate", "cross_instance_note"):
        assert a[key] == b[key], key
    assert _last(tmp_path / "merged", "verdict")["status"] == whole["status"]
