"""``--resume``: a run killed half-way (SIGKILL: nothing written at the end) or interrupted (Ctrl-C)
finishes without regenerating what finished, and every report rebuilds from the journal alone.

The engine is the real ``hf`` engine (tests/fault_engines.py ``dying``) that logs every decode it is
asked for, so "nothing regenerated" is counted, not assumed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from child_signals import default_sigint
from specparity import exitcodes
from specparity.fixtures import REPO_ROOT
from specparity.gate import decide
from specparity.journal import load_run, read_journal

TESTS = REPO_ROOT / "tests"
DYING = f"{TESTS / 'fault_engines.py'}:dying"
INTERRUPTING = f"{TESTS / 'fault_engines.py'}:interrupting"
SELECT = ("--categories", "math,code", "--calibration", "selected")

pytestmark = pytest.mark.slow


def gate(report: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "suites/lossless", "--report", str(report),
           *SELECT, *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS), **(env or {})}
    for key in ("SPECPARITY_TEST_DIE_AFTER", "SPECPARITY_TEST_CALL_LOG"):
        if key not in (env or {}):
            full_env.pop(key, None)
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=full_env,
                          preexec_fn=default_sigint)


def calls(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(" ", 1)) for line in log.read_text().splitlines()] if log.exists() else []


def test_killed_run_resumes_without_regenerating(tmp_path):
    report, log1, log2 = tmp_path / "r", tmp_path / "calls1", tmp_path / "calls2"
    first = gate(report, "--engine", DYING, env={"SPECPARITY_TEST_DIE_AFTER": "4", "SPECPARITY_TEST_CALL_LOG": str(log1)})
    assert first.returncode == -signal.SIGKILL, first.stdout[-2000:] + first.stderr[-2000:]
    before = read_journal(report)
    judged_before = {pid for pid, line in before.judged.items() if line["verdict"]}
    assert len(judged_before) == 3, "the 4th speculative call killed the run: 3 prompts were judged"
    prompts = set(before.baselines)
    assert len(prompts) >= 8 and "verdict" not in before.segment_kinds

    second = gate(report, "--engine", DYING, "--resume", env={"SPECPARITY_TEST_CALL_LOG": str(log2)})
    assert second.returncode == exitcodes.PASS, second.stdout[-3000:]
    done = calls(log2)
    assert [c for c in done if c[0] == "base"] == [], "every baseline had finished: none may run again"
    assert {pid for kind, pid in done if kind == "spec"} == prompts - judged_before
    assert len(done) == len(prompts - judged_before), "each unfinished prompt ran exactly once"

    run = load_run(report)
    assert [r.prompt.id for r in run.records if r.verdict is None] == []
    assert {r.prompt.id for r in run.records} == prompts
    assert run.resumed_baselines == len(prompts) and run.resumed_verdicts == 3
    decision = decide(run)
    assert decision.passed and decision.counts["exact"] + decision.counts["near_tie"] == len(prompts)
    lines = [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines].count("resume") == 1 and lines[-1]["kind"] == "verdict"
    summary = (report / "summary.md").read_text()
    assert "PASS" in summary

    again = gate(report, "--engine", DYING, "--resume")
    assert again.returncode == exitcodes.BAD_INPUT and "that run finished" in again.stderr


def test_interrupted_run_resumes(tmp_path):
    report, log = tmp_path / "r", tmp_path / "calls"
    first = gate(report, "--engine", INTERRUPTING, "--engine-opt", "interrupt_after=3")
    assert first.returncode == exitcodes.INTERRUPTED, first.stdout[-2000:]
    before = read_journal(report)
    assert "interrupted" in before.segment_kinds
    judged = {pid for pid, line in before.judged.items() if line["verdict"]}
    second = gate(report, "--engine", INTERRUPTING, "--engine-opt", "interrupt_after=3", "--resume",
                  env={"SPECPARITY_TEST_CALL_LOG": str(log)})
    # the resumed run sends SIGINT again at its own 3rd speculative call only if that many remain
    remaining = set(before.baselines) - judged
    expected = exitcodes.INTERRUPTED if len(remaining) >= 3 else exitcodes.PASS
    assert second.returncode == expected, second.stdout[-3000:]
    run = load_run(report)
    assert run.resumed_verdicts == len(judged) and run.resumed_baselines == len(before.baselines)


def test_resume_refuses_other_options(tmp_path):
    report = tmp_path / "r"
    first = gate(report, "--engine", DYING, env={"SPECPARITY_TEST_DIE_AFTER": "2"})
    assert first.returncode == -signal.SIGKILL
    other = gate(report, "--engine", DYING, "--resume", "--max-new-tokens", "12")
    assert other.returncode == exitcodes.BAD_INPUT
    assert "--resume: --max-new-tokens differs from the interrupted run's (None there, 12 now)" in other.stderr
    engine = gate(report, "--engine", DYING, "--dtype", "bfloat16", "--resume")
    assert engine.returncode != exitcodes.PASS
    assert "--resume:" in engine.stdout and "was written by another engine configuration" in engine.stdout
