"""Never a silent pass: each run that once exited 0 (or misled) when it should not, run for real.

A gate that prints FAIL exits non-zero however the tests were selected (``-k``, node ids, ``-n``);
an interrupted run says so in its journal and summary and never leaves an old verdict beside its
partial results. The runs whose subject is the process stay real subprocesses of the command a user
types (Ctrl-C, the pytest-xdist controller); the others run the same ``pytest`` command in this
process (tests/inprocess.py), whose exit status is the one ``pytest.main`` hands the process.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
from pathlib import Path

import pytest

import probe_artifacts as pa
from bad_inputs import CASES, run_in_process
from child_signals import default_sigint
from inprocess import run_cli, run_pytest
from llamacpp_fixtures import SUITE_PYTEST
from prompt_subsets import first_of_each
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT

TESTS = REPO_ROOT / "tests"
BROKEN_LOOPS = f"{TESTS / 'broken_loops.py'}:create"
#: The noise is measured on the prompts that run: how the gate ends is the point here, not the threshold.
SELECTED = ("--calibration", "selected")


def run(*args: str, cwd: Path = REPO_ROOT, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS)}
    return subprocess.run([*args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
                          preexec_fn=default_sigint)


def pytest_cmd(*args: str) -> list[str]:
    return [*SUITE_PYTEST, *args]


def journal(report: Path) -> list[dict]:
    return [json.loads(line) for line in (report / "results.jsonl").read_text().splitlines()]


def test_deselected_policy_test_still_fails_the_run(tmp_path):
    """`-k math` deselects test_gate_policy; "speculation inactive" must still exit 1."""
    prompts = first_of_each(tmp_path / "prompts.jsonl", ("math", "code"))
    code, out = run_pytest("suites/lossless", "-k", "math", "--engine", BROKEN_LOOPS, "--engine-opt", "bug=inactive",
                           "--prompts", tmp_path / "prompts.jsonl", *SELECTED, "--max-new-tokens", "12",
                           "--report", tmp_path / "r")
    math = sum(p.category == "math" for p in prompts)
    deselected = len(prompts) - math + 1  # the other prompts and test_gate_policy
    assert re.search(rf"\b{math} passed, {deselected} deselected", out) and "failed" not in out.splitlines()[-1], out[-2000:]
    assert "specparity lossless gate: FAIL" in out and "speculation inactive" in out, out[-2000:]
    assert code == exitcodes.GATE_FAILED, out[-2000:]
    final = journal(tmp_path / "r")[-1]
    assert final["kind"] == "verdict" and final["status"] == "FAIL" and final["exit_code"] == 1
    assert any("speculation inactive" in f for f in final["failures"])


def test_node_id_selection_still_fails_the_run(tmp_path):
    code, out = run_pytest("suites/lossless/test_lossless.py::test_lossless[repeat-en-001]", "--engine", BROKEN_LOOPS,
                           "--engine-opt", "bug=inactive", *SELECTED, "--max-new-tokens", "12", "--report", tmp_path / "r")
    assert code == exitcodes.GATE_FAILED, out[-2000:]
    assert "1 passed" in out


def test_ctrl_c_in_the_speculative_phase_leaves_no_stale_verdict(tmp_path):
    report = tmp_path / "r"
    report.mkdir()
    (report / "summary.md").write_text("# specparity lossless gate: PASS\n\nfrom another engine\n")
    (report / "results.jsonl").write_text('{"kind": "run", "stale": true}\n')
    proc = run(*pytest_cmd("suites/lossless", "--engine", f"{TESTS / 'fault_engines.py'}:interrupting",
                           "--engine-opt", "interrupt_after=3", "--categories", "math", *SELECTED, "--max-new-tokens", "12",
                           "--report", str(report)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.INTERRUPTED, out[-2000:]
    summary = (report / "summary.md").read_text()
    assert summary.startswith("# specparity lossless gate: INTERRUPTED"), summary[:300]
    assert "from another engine" not in summary and "interrupted (Ctrl-C or SIGTERM)" in summary
    lines = journal(report)
    assert not any(x.get("stale") for x in lines)
    kinds = [x["kind"] for x in lines]
    assert kinds.count("prompt") == 2  # two speculative runs finished before the third was interrupted
    assert "interrupted" in kinds and lines[-1]["kind"] == "verdict" and lines[-1]["status"] == "INTERRUPTED"
    assert "specparity lossless gate: INTERRUPTED" in out


def test_run_journal_ends_with_the_verdict(tmp_path, default_prompts):
    code, out = run_pytest("suites/lossless", "--categories", "math", *SELECTED, "--max-new-tokens", "12",
                           "--report", tmp_path / "r")
    assert code == 0, out[-2000:]
    final = journal(tmp_path / "r")[-1]
    assert final == {**final, "kind": "verdict", "status": "PASS", "passed": True, "exit_code": 0,
                     "interrupted": False}
    assert final["counts"]["exact"] == sum(p.category == "math" for p in default_prompts)


@pytest.mark.slow
def test_xdist_runs_the_gate_once(tmp_path):
    """`-n 2`: one gate run on one worker, one summary, one valid journal, the verdict decides the
    exit status; the harness tests beside it are spread over both workers.

    Two controller runs, as small as they go: a passing one (two prompts, so the prompt tests can
    land on both workers, beside a harness test file) that must exit 0, and a failing one (one
    prompt, every selected test passes, the run-level rule fails) that must exit 1 with the reason.
    One run cannot show both directions of the verdict deciding the exit status. The failing one is
    also where a real `pytest suites/lossless` process under a broken loop is seen to exit 1 (the other
    broken-loop runs are nested sessions)."""
    report = tmp_path / "r"
    file = tmp_path / "prompts.jsonl"
    prompts = first_of_each(file, ("math",), per_category=2)
    proc = run(*pytest_cmd("-n", "2", "suites/lossless", "tests/test_policy.py", "--prompts", str(file), *SELECTED,
                           "--max-new-tokens", "8", "--report", str(report)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("specparity lossless gate: PASS") == 1, out[-3000:]
    lines = journal(report)  # every line parses: one writer
    kinds = [x["kind"] for x in lines]
    assert kinds.count("run") == 1 and kinds.count("prompt") == len(prompts) and kinds[-1] == "verdict"
    broken = run(*pytest_cmd("-n", "2", "suites/lossless", "--prompts", str(file), *SELECTED, "--max-new-tokens", "8",
                             "--engine", BROKEN_LOOPS, "--engine-opt", "bug=inactive", "-k", prompts[0].id,
                             "--report", str(tmp_path / "b")))
    out = broken.stdout + broken.stderr
    assert broken.returncode == exitcodes.GATE_FAILED, out[-3000:]
    assert "speculation inactive" in broken.stdout
    assert out.count("specparity lossless gate: FAIL") == 1, out[-3000:]
    assert re.search(r"\b1 passed\b", broken.stdout) and not re.search(r"\d+ failed", broken.stdout), out[-3000:]
    lines = journal(tmp_path / "b")
    kinds = [x["kind"] for x in lines]
    assert kinds.count("run") == 1 and kinds.count("prompt") == 1
    assert lines[-1]["kind"] == "verdict" and lines[-1]["status"] == "FAIL" and lines[-1]["exit_code"] == 1


def test_xdist_each_is_refused(tmp_path):
    """The whole line, remedy included (tests/test_bad_input.py checks its fragment, exit code and
    that it is one line), in this process up to the refusal, as tests/bad_inputs.py runs its cases."""
    (case,) = [c for c in CASES if c.id == "xdist-each"]
    proc = run_in_process(case, tmp_path)
    assert proc.code == exitcodes.BAD_INPUT
    assert proc.stderr.strip() == ("ERROR: specparity: --dist each would run the whole gate on every worker; "
                                   "use -n N with --dist load, loadfile or loadscope")


def test_specparity_lossless_passes_option_values_through():
    """`specparity lossless --engine hf --categories math` (no `=`) reaches pytest intact (a bad
    --engine value through the same command is the cli-lossless-engine case of tests/bad_inputs.py)."""
    code, out = run_cli("lossless", "--engine", "hf", "--categories", "math", "--collect-only", *SUITE_PYTEST[3:],
                        cwd=Path("/"))
    assert code == 0, out
    assert "test_lossless[math-en-001]" in out and "test_lossless[code-en-001]" not in out


@pytest.fixture(scope="module")
def probe_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("probe")
    return {"target": pa.dense_target(d / "t"), "draft": pa.dflash2_draft(d / "d")}


def test_probe_suite_without_probe_engine_is_a_usage_error(probe_dirs):
    code, out = run_pytest("suites/probes", "--target", probe_dirs["target"], "--draft", probe_dirs["draft"])
    assert code == exitcodes.BAD_INPUT, out[-2000:]
    assert out.strip().startswith("ERROR: specparity: suites/probes needs --probe-engine name==version"), out
    assert "\n" not in out.strip(), out


def test_probe_of_an_unread_version_is_never_ok(probe_dirs, capsys):
    from specparity.cli.commands import main

    code = main(["probe", "--target", str(probe_dirs["target"]), "--draft", str(probe_dirs["draft"]),
                 "--engine", "sglang==0.5.99", "--format", "json"])
    verdicts = json.loads(capsys.readouterr().out)
    # an unchecked question is not a pass: any unknown answer gives the probe's own code
    assert code == (exitcodes.PROBE_UNKNOWN if any(v["status"] == "unknown" for v in verdicts) else exitcodes.PASS)
    # only what follows from the checkpoint alone ("not a hybrid") may stay ok
    assert {v["status"] for v in verdicts if not v["engine_independent"]} <= {"warn", "unknown", "fail"}, verdicts
    warned = [v for v in verdicts if v["status"] == "warn"]
    assert warned and all(any("0.5.99 was not read" in e for e in v["evidence"]) for v in warned)
    code = main(["probe", "--target", str(probe_dirs["target"]), "--draft", str(probe_dirs["draft"]),
                 "--engine", "sglang==0.5.23", "--format", "json"])
    assert code == 0 and any(v["status"] == "ok" for v in json.loads(capsys.readouterr().out))


def test_registry_tests_skip_with_the_reason_when_no_registry_answers(tmp_path, monkeypatch):
    """A machine without a package registry: the wheel-reading tests skip, say why, and pytest
    passes; with SPECPARITY_REQUIRE_REGISTRY=1 (CI) the same tests fail instead. The nested session
    shares this process's tests/probe_artifacts.py, which read the cache location when first
    imported: the empty cache is set there as well as in SPECPARITY_CACHE."""
    monkeypatch.setattr(pa, "WHEEL_CACHE", tmp_path / "wheels")
    env = {"SPECPARITY_CACHE": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull,
           "SPECPARITY_REQUIRE_REGISTRY": None}
    args = ("-rs", "tests/test_probe_sglang_source.py", "-k", "real_releases")
    code, out = run_pytest(*args, env=env)
    assert code == 0, out[-2000:]
    assert "3 skipped" in out and "needs a package registry: pip download sglang==" in out
    code, out = run_pytest(*args, env={**env, "SPECPARITY_REQUIRE_REGISTRY": "1"})
    assert code == exitcodes.GATE_FAILED and "SPECPARITY_REQUIRE_REGISTRY is set" in out, out[-2000:]
