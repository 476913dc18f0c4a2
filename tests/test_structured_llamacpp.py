"""Structured output under speculation against real llama.cpp servers (docs/STRUCTURED.md).

Live: ``pytest suites/lossless --engine llamacpp --prompts prompts/structured.jsonl`` — both servers
get each prompt's ``json_schema`` / ``grammar``; every output is exact and valid for its schema,
with drafting active. A speculative side that drops its grammar state after the first verify steps
(:mod:`structured_engines`) fails on the constrained prompts with the constraint reason, and passes
an unconstrained run. Skips without a llama-server build (fails under
``SPECPARITY_REQUIRE_LLAMACPP=1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inprocess import run_pytest
from llamacpp_fixtures import require_llamacpp
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import load_prompts

pytestmark = pytest.mark.slow

STRUCTURED = "prompts/structured.jsonl"
LOST = "tests/structured_engines.py:lost_grammar_llamacpp"


@pytest.fixture(scope="module")
def llamacpp():
    return require_llamacpp()


def gate(*args: str, report: Path) -> tuple[int, str, list[dict]]:
    """``pytest suites/lossless ARGS`` in this process (the llama-servers it launches are real
    child processes): (exit status, its output, the lines of results.jsonl)."""
    code, out = run_pytest("-q", "suites/lossless", "--report", str(report), *args)
    path = report / "results.jsonl"
    return code, out, [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_structured_prompts_pass_exact_and_valid_with_drafting_active(llamacpp, tmp_path):
    code, out, lines = gate("--engine", "llamacpp", "--prompts", STRUCTURED, report=tmp_path)
    assert code == 0, out[-4000:]
    judged = [x for x in lines if x["kind"] == "prompt"]
    assert len(judged) == len(load_prompts(REPO_ROOT / STRUCTURED).prompts)
    for rec in judged:
        v = rec["verdict"]
        assert v["class"] == "exact", (v["prompt_id"], v["reason"])
        expected = "valid" if v["constraint"]["kind"] == "json_schema" else "constrained"
        # valid, not truncated: the prompts' limits let every document close
        assert v["constraint"]["baseline"]["status"] == v["constraint"]["spec"]["status"] == expected, v
    assert sum(x["spec"]["spec"]["accepted"] for x in judged) > 0


def test_a_lost_grammar_state_fails_constrained_prompts_and_passes_an_unconstrained_run(llamacpp, tmp_path):
    schema_ids = {"json-person-001", "json-math-004"}
    code, out, lines = gate("--engine", LOST, "--prompts", STRUCTURED, "--calibration", "selected",
                            "-k", " or ".join(sorted(schema_ids)), report=tmp_path / "structured")
    assert code == 1, out[-4000:]
    judged = {x["prompt"]["id"]: x["verdict"] for x in lines if x["kind"] == "prompt"}
    assert set(judged) == schema_ids
    for pid, v in judged.items():
        assert v["class"] == "diverged" and v["reason"].startswith("constraint broken under speculation"), (pid, v)
        assert v["constraint"]["baseline"]["status"] == "valid" and v["constraint"]["spec"]["status"] == "invalid"
    assert "prompt(s) broke their output constraint under speculation" in out
    # unconstrained prompts need no grammar state: a few tokens show the same engine passing them
    plain, plain_out, plain_lines = gate("--engine", LOST, "--categories", "math", "--calibration", "selected",
                                         "--max-new-tokens", "16", report=tmp_path / "plain")
    assert plain == 0, plain_out[-4000:]
    judged = [x for x in plain_lines if x["kind"] == "prompt"]
    assert judged and all(x["verdict"]["class"] == "exact" for x in judged)
    assert sum(x["spec"]["spec"]["accepted"] for x in judged) > 0
