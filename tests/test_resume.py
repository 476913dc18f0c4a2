"""``--resume``: a run killed half-way (SIGKILL: nothing written at the end) or interrupted (Ctrl-C)
finishes without regenerating what finished, and every report rebuilds from the journal alone.

The engine is the real ``hf`` engine (tests/fault_engines.py ``dying``) that logs every decode it is
asked for, so "nothing regenerated" is counted, not assumed. The runs that are killed or interrupted
are real processes (the signal is the subject); a resume that is not interrupted again runs the same
``pytest`` command in this process (tests/inprocess.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from child_signals import default_sigint
from inprocess import run_pytest
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.run.journal import load_run, read_journal
from prompt_subsets import SHORT, first_of_categories

TESTS = REPO_ROOT / "tests"
DYING = f"{TESTS / 'fault_engines.py'}:dying"
INTERRUPTING = f"{TESTS / 'fault_engines.py'}:interrupting"
#: A few math and code prompts of the default suite (tests/prompt_subsets.py), more than either
#: engine's kill or interrupt leaves judged, so that every run below stops half-way.
SUBSET = {"math": 3, "code": 2}

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Prompts:
    file: Path
    ids: set[str]

    def options(self, max_new_tokens: str = SHORT[1]) -> tuple[str, ...]:
        return ("--prompts", str(self.file), "--calibration", "selected", "--max-new-tokens", max_new_tokens)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Prompts:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    return Prompts(path, {p.id for p in first_of_categories(path, SUBSET)})


def gate(report: Path, prompts: Prompts, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "suites/lossless", "--report", str(report),
           *prompts.options(), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS), **(env or {})}
    for key in ("SPECPARITY_TEST_DIE_AFTER", "SPECPARITY_TEST_CALL_LOG"):
        if key not in (env or {}):
            full_env.pop(key, None)
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=full_env,
                          preexec_fn=default_sigint)


def gate_here(report: Path, prompts: Prompts, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """:func:`gate` in this process (for a run no signal ends): its exit code and output."""
    unset = {key: None for key in ("SPECPARITY_TEST_DIE_AFTER", "SPECPARITY_TEST_CALL_LOG")}
    return run_pytest("-q", "suites/lossless", "--report", report, *prompts.options(), *args,
                      env={**unset, **(env or {})})


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``specparity run ARGS`` in this process (the same options and runner as the pytest gate):
    its exit code, stdout and stderr."""
    from specparity.cli import commands as cli

    code = cli.main(["run", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def calls(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()] if log.exists() else []


@dataclass(frozen=True)
class Killed:
    """A run SIGKILLed by its engine at the 4th speculative call: its report, never to be resumed in
    place (each test resumes a copy)."""

    report: Path
    result: subprocess.CompletedProcess[str]

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.report, to)
        return to


@pytest.fixture(scope="module")
def killed(tmp_path_factory, prompts) -> Killed:
    report = tmp_path_factory.mktemp("killed") / "r"
    first = gate(report, prompts, "--engine", DYING, env={"SPECPARITY_TEST_DIE_AFTER": "4"})
    return Killed(report, first)


def test_killed_run_resumes_without_regenerating(tmp_path, capsys, monkeypatch, prompts, killed):
    first = killed.result
    assert first.returncode == -signal.SIGKILL, first.stdout[-2000:] + first.stderr[-2000:]
    report, log2 = killed.copy(tmp_path / "r"), tmp_path / "calls2"
    before = read_journal(report)
    judged_before = {pid for pid, line in before.judged.items() if line["verdict"]}
    assert len(judged_before) == 3, "the 4th speculative call killed the run: 3 prompts were judged"
    assert set(before.baselines) == prompts.ids and "verdict" not in before.segment_kinds

    code, out = gate_here(report, prompts, "--engine", DYING, "--resume", env={"SPECPARITY_TEST_CALL_LOG": str(log2)})
    assert code == exitcodes.PASS, out[-3000:]
    done = calls(log2)
    assert [c for c in done if c[0] == "base"] == [], "every baseline had finished: none may run again"
    assert {pid for kind, pid in done if kind == "spec"} == prompts.ids - judged_before
    assert len(done) == len(prompts.ids - judged_before), "each unfinished prompt ran exactly once"

    run_ = load_run(report)
    assert [r.prompt.id for r in run_.records if r.verdict is None] == []
    assert {r.prompt.id for r in run_.records} == prompts.ids
    assert run_.resumed_baselines == len(prompts.ids) and run_.resumed_verdicts == 3
    decision = decide(run_)
    assert decision.passed and decision.counts["exact"] + decision.counts["near_tie"] == len(prompts.ids)
    lines = [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines].count("resume") == 1 and lines[-1]["kind"] == "verdict"
    summary = (report / "summary.md").read_text()
    assert "PASS" in summary

    monkeypatch.delenv("SPECPARITY_TEST_DIE_AFTER", raising=False)
    code, _, err = run(capsys, *prompts.options(), "--report", str(report), "--engine", DYING, "--resume")
    assert code == exitcodes.BAD_INPUT and "that run finished" in err


def test_interrupted_run_resumes(tmp_path, prompts):
    report, log = tmp_path / "r", tmp_path / "calls"
    first = gate(report, prompts, "--engine", INTERRUPTING, "--engine-opt", "interrupt_after=3")
    assert first.returncode == exitcodes.INTERRUPTED, first.stdout[-2000:]
    before = read_journal(report)
    assert "interrupted" in before.segment_kinds
    judged = {pid for pid, line in before.judged.items() if line["verdict"]}
    second = gate(report, prompts, "--engine", INTERRUPTING, "--engine-opt", "interrupt_after=3", "--resume",
                  env={"SPECPARITY_TEST_CALL_LOG": str(log)})
    # the resumed run sends SIGINT again at its own 3rd speculative call only if that many remain
    remaining = set(before.baselines) - judged
    expected = exitcodes.INTERRUPTED if len(remaining) >= 3 else exitcodes.PASS
    assert second.returncode == expected, second.stdout[-3000:]
    run_ = load_run(report)
    assert run_.resumed_verdicts == len(judged) and run_.resumed_baselines == len(before.baselines)


def test_resume_refuses_other_options(tmp_path, capsys, monkeypatch, prompts, killed):
    assert killed.result.returncode == -signal.SIGKILL
    report = killed.copy(tmp_path / "r")
    monkeypatch.delenv("SPECPARITY_TEST_DIE_AFTER", raising=False)
    code, _, err = run(capsys, *prompts.options("16"), "--report", str(report), "--engine", DYING, "--resume")
    assert code == exitcodes.BAD_INPUT
    assert f"--resume: --max-new-tokens differs from the interrupted run's ({SHORT[1]} there, 16 now)" in err
    code, out, _ = run(capsys, *prompts.options(), "--report", str(report), "--engine", DYING, "--dtype", "bfloat16",
                       "--resume")
    assert code != exitcodes.PASS
    assert "--resume:" in out and "was written by another engine configuration" in out
