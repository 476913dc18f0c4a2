"""How many requests the vllm engine may put in flight: what the servers say they take.

A vLLM server schedules up to ``max_num_seqs`` sequences at once (its dev-mode ``/server_info``
shows ``vllm_config.scheduler_config.max_num_seqs``). A sweep level up to that runs without
``--engine-opt max_concurrency``; above it, or against servers that do not say, the level is
refused before any prompt runs, naming the limit. A plain run keeps the default number in flight.
Against the vLLM emulator (:mod:`fakes.vllm`), backed by the fixture models.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import VLLMServer
from fakes.backend import TARGET
from prompt_subsets import first_of_categories
from specparity.cli.commands import main
from specparity.run.sweep import LEVEL_DIR
from specparity.engines.server.engine import DEFAULT_CONCURRENCY
from specparity.gate import exitcodes

#: A level above the default the engine falls back to, as in ``--levels 1,8,32``.
HIGH = 4 * DEFAULT_CONCURRENCY


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    first_of_categories(path, {"math": 1, "code": 1})
    return path


def _servers(**knobs) -> tuple[VLLMServer, VLLMServer]:
    return VLLMServer(dev_mode=True, **knobs), VLLMServer(dev_mode=True, speculative=True, **knobs)


def _gate(base: VLLMServer, spec: VLLMServer, prompt_file: Path, report: Path) -> list[str]:
    return ["--engine", "vllm", "--baseline-url", base.url, "--spec-url", spec.url, "--target", str(TARGET),
            "--prompts", str(prompt_file), "--calibration", "selected", "--max-new-tokens", "8",
            "--report", str(report)]


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def _in_flight(report: Path) -> int:
    return json.loads((report / "results.jsonl").read_text().splitlines()[0])["concurrency"]


def _decoded(*servers: VLLMServer) -> bool:
    """Whether any prompt was decoded (a request for more than one token)."""
    return any(seen.n_predict > 1 for server in servers for seen in server.seen)


def test_a_sweep_level_up_to_max_num_seqs_runs_without_engine_opts(capsys, tmp_path, prompt_file):
    base, spec = _servers(max_num_seqs=HIGH)
    with base, spec:
        code, out = _run(capsys, "sweep", "--levels", f"1,{DEFAULT_CONCURRENCY},{HIGH}",
                         *_gate(base, spec, prompt_file, tmp_path / "sw"))
    assert code == exitcodes.PASS, out
    for level in (1, DEFAULT_CONCURRENCY, HIGH):
        assert _in_flight(tmp_path / "sw" / LEVEL_DIR.format(level=level)) == level


def test_a_level_above_max_num_seqs_is_refused_naming_it(capsys, tmp_path, prompt_file):
    serves = DEFAULT_CONCURRENCY // 2
    base, spec = _servers(max_num_seqs=serves)
    with base, spec:
        code, out = _run(capsys, "sweep", "--levels", f"1,{DEFAULT_CONCURRENCY}",
                         *_gate(base, spec, prompt_file, tmp_path / "sw"))
        assert not _decoded(base, spec)
    assert code == exitcodes.BAD_INPUT, out
    assert f"serves at most {serves} request(s) at once" in out, out


def test_servers_that_do_not_say_keep_the_default_limit(capsys, tmp_path, prompt_file):
    base, spec = _servers()
    with base, spec:
        code, out = _run(capsys, "sweep", "--levels", f"1,{HIGH}", *_gate(base, spec, prompt_file, tmp_path / "sw"))
        assert not _decoded(base, spec)
    assert code == exitcodes.BAD_INPUT, out
    assert f"serves at most {DEFAULT_CONCURRENCY} request(s) at once" in out and "max_concurrency=N" in out, out


def test_a_plain_run_keeps_the_default_in_flight(capsys, tmp_path, prompt_file):
    base, spec = _servers(max_num_seqs=HIGH)
    with base, spec:
        code, out = _run(capsys, "run", *_gate(base, spec, prompt_file, tmp_path / "run"))
    assert code == exitcodes.PASS, out
    assert _in_flight(tmp_path / "run") == DEFAULT_CONCURRENCY
