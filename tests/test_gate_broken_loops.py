"""The gate must fail: every deliberately broken speculative loop is caught, with the right class.

The correct hand-written loop is the control: it passes, and it takes every path (reject,
partial accept, full accept, cut by the limit, cut by a stop token) on the prompt subset used
here, so a bug that lives on any of those paths has the chance to show.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from broken_loops import BUGS, LoopEngine
from inprocess import run_pytest
from prompt_subsets import write_subset
from specparity.judge.compare import OWN_ROW_REJECTED
from specparity.engines.base import EngineOptions
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.run.golden import load_golden
from specparity.model.prompts import load_prompts
from specparity.model.gate_run import GateConfig, GatePolicy
from specparity.report.view import judgement
from specparity.run.runner import run_gate

MAX_NEW = 32


#: Prompts on which the fixture draft gets rejected outright, partially accepted, cut by a stop
#: token inside a block (found from the hf engine's step records on prompts/default.jsonl), plus
#: prompts that run into the token limit.
LOOP_PROMPTS = ("math-en-004", "logic-en-003", "code-en-003", "repeat-en-003", "zhwriting-zh-002")


@pytest.fixture(scope="module")
def loop_prompts(default_prompts):
    limit = [p.id for p in default_prompts if "hits-limit" in p.tags][:2]
    return [p for p in default_prompts if p.id in LOOP_PROMPTS or p.id in limit]


#: The broken loop whose gate run decodes its own baselines, as the control does: the live baseline
#: path stays covered under a broken loop. It is the bug that depends on what the engine decoded
#: before (the previous request's last token), so it sees the same requests as in a run without a golden.
LIVE_BUG = "stale_context"
#: The engine name of the runs that record or read the golden.
GOLDEN_ENGINE = "hf-loop"


def _run(hf_options, prompts, bug, golden: Path | None = None, record: bool = False):
    """One gate run of the hand-written loop; with ``golden`` the baselines come from that file
    (``record``: this run decodes them and writes it). A golden is keyed by the engine's name, which
    for the loops names the bug; every loop decodes its baseline the same way (a bug lives on the
    speculative path only), so the runs that share a golden share one name, ``GOLDEN_ENGINE``."""
    engine = LoopEngine(hf_options, bug)
    if golden is not None:
        engine.name = GOLDEN_ENGINE
    try:
        if golden is None:
            run = run_gate(engine, prompts, GateConfig())
        elif record:
            run = run_gate(engine, prompts, GateConfig(golden=str(golden), update_golden="update"))
        else:
            run = run_gate(engine, prompts, GateConfig(golden=str(golden)), golden=load_golden(golden))
    finally:
        engine.close()
    assert not run.fatal and not run.golden_error, run.fatal or run.golden_error
    return run, decide(run)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> Path:
    """The golden the control records: every broken loop but ``LIVE_BUG`` reads its baselines from it
    (same target, prompts and config), instead of decoding them again."""
    return tmp_path_factory.mktemp("golden") / "loop.golden.jsonl"


@pytest.fixture(scope="module")
def control(hf_options, loop_prompts, baselines):
    return _run(hf_options, loop_prompts, None, golden=baselines, record=True)


def test_correct_loop_passes_and_takes_every_path(control):
    run, decision = control
    assert decision.passed, decision.failures
    assert {r.baseline_from for r in run.records} == {"run"}
    assert decision.counts["diverged"] == 0 and decision.counts["error"] == 0
    taken = run.coverage.taken()
    assert all(n > 0 for n in taken.values()), f"a path was never taken: {taken}"


EXPECTED = {
    "accept_unverified": "diverged",
    "drop_bonus": "diverged",
    "duplicate_bonus": "diverged",
    "short_crop": "diverged",
    "overrun_stop": "diverged",
    "overrun_limit": "diverged",
    "stale_context": "diverged",
    "noisy_verify": "diverged",
    "inactive": None,  # output stays exact: caught by the run-level rule
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_broken_loop_fails_the_gate(hf_options, loop_prompts, control, baselines, bug):
    if bug == LIVE_BUG:
        run, decision = _run(hf_options, loop_prompts, bug)
        assert {r.baseline_from for r in run.records} == {"run"}
    else:
        run, decision = _run(hf_options, loop_prompts, bug, golden=baselines)
        assert {r.baseline_from for r in run.records} == {"golden"}
    assert not decision.passed, f"{bug} ({BUGS[bug]}) slipped through the gate"
    expected = EXPECTED[bug]
    if expected is None:
        assert decision.counts["diverged"] == 0
        assert any("speculation inactive" in f for f in decision.failures), decision.failures
        return
    assert decision.counts[expected] >= 1, decision.counts
    # fp32: a broken loop's flips are never excused as near ties (the threshold is ~3e-5 nats)
    assert decision.counts["near_tie"] == 0, [r.verdict.reason for r in run.records if r.verdict.klass == "near_tie"]
    bad = [r.verdict for r in run.records if r.verdict.klass == expected]
    assert all(v.reason for v in bad)
    if bug == "overrun_stop":
        assert any("past stop token" in v.reason for v in bad), [v.reason for v in bad]
    if bug == "overrun_limit":
        assert any("more than max_new_tokens" in v.reason for v in bad), [v.reason for v in bad]
    if bug == "short_crop":  # prompts whose tokens survived the corrupted cache still show it in their rows
        drifted = [r.verdict for r in run.records if r.verdict.klass == "drifted"]
        assert drifted and all(v.drift.start is not None and v.drift.max_nats > 100 * v.drift.bound / 4 for v in drifted)
        assert any("drifted" in f for f in decision.failures)


#: Prompts on which ``accept_unverified`` fires; in bf16 the first one's rejected draft can sit within
#: the near-tie threshold of the baseline's token (measured on one CPU: margin 0.31 nats against a
#: threshold of 0.33, the loop's own verify row preferring the baseline's token by 0.375), where the
#: baseline's margin alone calls it a near tie.
UNVERIFIED_PROMPTS = ("zhwriting-zh-001", "zhwriting-zh-002", "logic-en-003")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_accepting_a_rejected_draft_is_diverged_wherever_it_fires(hf_options, default_prompts, dtype):
    """Every speculative token must be the argmax of the verify row that chose it: a loop that accepts
    one draft past the first mismatch is ``diverged`` on every prompt where it emitted such a token,
    in bf16 too, where the baseline's margin at the split may be inside the noise."""
    prompts = [p for p in default_prompts if p.id in UNVERIFIED_PROMPTS]
    near_ties = REPO_ROOT / "prompts" / "near_tie.jsonl"  # calibrated where bf16 flips live, as the suite is
    config = GateConfig(calibration=str(near_ties), policy=GatePolicy(max_near_tie=1.0))
    engine = LoopEngine(EngineOptions(**{**vars(hf_options), "dtype": dtype}), "accept_unverified")
    try:
        run = run_gate(engine, prompts, config, calibration=load_prompts(near_ties).prompts + prompts)
        fired = set(engine.loop.fired)
    finally:
        engine.close()
    assert fired, "the bug never fired on these prompts: pick prompts where the draft is rejected"
    classes = {r.prompt.id: r.verdict.klass for r in run.records}
    assert all(classes[pid] == "diverged" for pid in fired), classes
    assert not decide(run).passed
    for r in run.records:  # the report's step-by-step judgement fails the loop's own-row check too
        if r.prompt.id in fired and OWN_ROW_REJECTED in r.verdict.reason:
            checks = judgement(r, run)
            assert any(c.state == "fail" and "own" in c.text for c in checks), checks
            assert not any(c.state == "warn" and "not its own verify pass's argmax" in c.text for c in checks), checks


def test_correct_loop_rows_stay_within_the_noise(control):
    """The drift bound is no false alarm: a correct loop's rows match the baseline's within it."""
    run, _ = control
    drifts = [r.verdict.drift for r in run.records]
    assert all(d is not None and d.checked > 0 and d.start is None for d in drifts)


#: Where ``drop_bonus`` shows in the suite run below: a repeat prompt (full accepts, so bonus tokens).
SUITE_PROMPTS = ("repeat-en-003",)


def test_pytest_exits_nonzero_with_a_reason(tmp_path):
    """The user-facing command, `pytest suites/lossless` under a broken loop, fails and says which
    prompt diverged and why (as a nested session: a real `pytest` process exiting 1 under a broken loop
    is tests/test_no_silent_pass.py::test_xdist_runs_the_gate_once)."""
    prompts = tmp_path / "repeat.jsonl"
    assert write_subset(prompts, lambda row: row["id"] in SUITE_PROMPTS) == list(SUITE_PROMPTS)
    code, out = run_pytest(
        "suites/lossless",
        "--engine", f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create", "--engine-opt", "bug=drop_bonus",
        "--prompts", str(prompts), "--calibration", "selected", "--max-new-tokens", str(MAX_NEW),
        "--report", str(tmp_path / "r"),
    )
    assert code == 1, out[-3000:]
    assert "[diverged]" in out and "specparity lossless gate: FAIL" in out, out[-3000:]
    assert (tmp_path / "r" / "summary.md").read_text().startswith("# specparity lossless gate: FAIL")
    assert (tmp_path / "r" / "results.jsonl").stat().st_size > 0
