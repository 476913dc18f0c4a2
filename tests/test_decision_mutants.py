"""The gate's decision code (``specparity/gate/decision.py``) pinned where its other tests read only
fragments: the decision's JSON, the near-tie failure line of every policy word for word, which policy
that line is decided by, the per-prompt checks of a run without a threshold, and the acceptance rule's
edges (a drop exactly at ``max_accept_drop``, an interval that touches 0). Constructed runs, no engine."""

from __future__ import annotations

import pytest

from specparity.gate import exitcodes
from specparity.gate.decision import (DATA_BUDGET, decide, flip_expectation, judge_acceptance, near_tie_failure,
                                      near_tie_budget, near_tie_policy, prompt_checks, reject_share)
from specparity.judge.acceptance import MIN_PROMPTS, Comparison, Row
from specparity.judge.checks import Check
from specparity.judge.flip_budget import FlipExpectation
from specparity.model.gate_run import DEFAULT_MAX_NEAR_TIE, GateConfig, GatePolicy, GateRun, PromptRecord
from specparity.model.prompts import Prompt
from specparity.model.threshold import FlipRate, NearTieThreshold
from specparity.model.types import GenerationResult, SpecStats, StepRecord, TokenScores
from specparity.model.verdicts import Divergence, Verdict

DECLARED = "sglang /server_info enable_deterministic_inference=true"


def _divergence(tie: bool) -> Divergence:
    return Divergence(position=3, baseline_token=None, spec_token=None, baseline_margin=0.0 if tie else 0.01,
                      spec_rank_in_baseline=1, spec_margin=None, baseline_rank_in_spec=None, context_before="",
                      baseline_after="", spec_after="", remerge=None, tie=tie)


def _run(classes: list[str], *, ties: tuple[int, ...] = (), config: GateConfig | None = None) -> GateRun:
    recs = []
    for i, klass in enumerate(classes):
        p = Prompt(id=f"p-{i}", category="c", lang="en", prompt="x")
        spec = SpecStats.from_steps([StepRecord(4, 2, 3)], "t")
        res = GenerationResult(p.id, [1], "", "length", TokenScores.empty(), spec)
        div = _divergence(i in ties) if klass == "near_tie" else None
        recs.append(PromptRecord(p, spec=res, verdict=Verdict(p.id, "c", klass, "r", divergence=div)))
    run = GateRun(None, config or GateConfig(), recs)
    for r in recs:
        run.coverage.add(r.spec.spec)
    return run


def _expectation(observed: int) -> FlipExpectation:
    return FlipExpectation(observed=observed, expected=0.25, low=0, high=2, limit=1, prompts=4, at_risk_prompts=3,
                           rate=None)


# --------------------------------------------------------------------------- the decision's JSON


def test_the_decision_json_has_every_field():
    d = decide(_run(["exact", "diverged"]))
    assert d.to_json() == {"status": "FAIL", "passed": False, "exit_code": exitcodes.GATE_FAILED,
                           "failures": d.failures, "warnings": d.warnings,
                           "counts": {"exact": 1, "near_tie": 0, "drifted": 0, "diverged": 1, "error": 0}}
    assert d.failures


# --------------------------------------------------------------------------- near_tie_failure, word for word


def test_bit_exact_line_counts_zero_when_the_counts_hold_no_near_tie_key():
    run = _run(["exact"])
    line = near_tie_failure(run, {"exact": 1}, GatePolicy(bit_exact=True), None)
    assert line == "--bit-exact: 0 near-tie flip(s) where bit-exactness is required: "


def test_bit_exact_line_names_the_near_tie_prompts():
    run = _run(["near_tie", "exact", "near_tie", "diverged"])
    line = near_tie_failure(run, {"exact": 1, "near_tie": 2, "diverged": 1}, GatePolicy(bit_exact=True), None)
    assert line == "--bit-exact: 2 near-tie flip(s) where bit-exactness is required: p-0, p-2"


def test_unknown_declaration_line_under_a_policy():
    run = _run(["exact", "near_tie"])
    run.deterministic_unknown = "spec http://s: no /server_info"
    line = near_tie_failure(run, {"exact": 1, "near_tie": 1}, GatePolicy(unknown_fails=True), None)
    assert line == ("determinism declaration unknown on some servers (spec http://s: no /server_info): under a "
                    "policy an unknown is not lenient, so the run is bit-exact and 1 near-tie flip(s) fail (make "
                    "every server show its setting, or pass --allow-near-tie to allow): p-1")


def test_declared_line():
    run = _run(["exact", "near_tie", "near_tie"])
    run.deterministic = DECLARED
    line = near_tie_failure(run, {"exact": 1, "near_tie": 2}, GatePolicy(), None)
    assert line == (f"engine declares deterministic inference ({DECLARED}): 2 near-tie flip(s) are a failure — the "
                    "engine promised bit-exact output (pass --allow-near-tie to allow): p-1, p-2")


def test_the_policy_given_decides_not_the_runs_own():
    """--allow-near-tie in the policy handed over overrides a declaration the run's own (default) policy
    would enforce: the line is the fixed share's, not the declaration's."""
    run = _run(["exact", "near_tie"])
    run.deterministic = DECLARED
    line = near_tie_failure(run, {"exact": 1, "near_tie": 1}, GatePolicy(bit_exact=False, max_near_tie=0.25), None)
    assert line == "1/2 near-tie prompts (50%) exceed --max-near-tie 25%"


def test_fixed_budget_line_when_no_flip_rate_was_measured():
    """The fixed share counts the flips that are not exact ties, and names them; exact ties stay apart."""
    run = _run(["exact"] * 3 + ["near_tie"] * 2, ties=(3,))
    line = near_tie_failure(run, {"exact": 3, "near_tie": 2}, GatePolicy(), None)
    assert line == (f"1/5 near-tie prompts that are not exact ties (20%) exceed the fixed share "
                    f"{DEFAULT_MAX_NEAR_TIE:.0%} (no flip rate was measured): p-4")


def test_max_near_tie_line_wins_over_a_measured_flip_rate():
    run = _run(["exact"] * 3 + ["near_tie"])
    line = near_tie_failure(run, {"exact": 3, "near_tie": 1}, GatePolicy(max_near_tie=0.1), _expectation(1))
    assert line == "1/4 near-tie prompts (25%) exceed --max-near-tie 10%"


def test_budget_from_the_data_line_names_the_flips_that_are_not_exact_ties():
    run = _run(["near_tie", "exact", "near_tie", "near_tie"], ties=(2,))
    line = near_tie_failure(run, {"exact": 1, "near_tie": 3}, GatePolicy(), _expectation(2))
    assert line == ("2 near-tie flip(s) that are not exact ties, more than the 1 the baseline's own numerics explain "
                    "(expected 0.2, 95 % interval 0–2): the verify numerics flip tokens the target's own two "
                    "computations do not: p-0, p-3")


# --------------------------------------------------------------------------- per-prompt checks


def test_prompt_checks_of_a_run_without_a_threshold():
    run = _run(["exact"])
    assert run.threshold is None
    checks = prompt_checks(run.records[0].verdict, run)
    assert isinstance(checks, list)


# --------------------------------------------------------------------------- the acceptance rule's edges


def _comparison(old: float, new: float, low: float, high: float) -> Comparison:
    row = Row("all", MIN_PROMPTS, old, new, low, high)
    return Comparison("accept_length", "OLD", "NEW", [row], [row], {}, None)


def test_acceptance_rule_words():
    where = f"per category of at least {MIN_PROMPTS} prompts and overall, without the flagged prompts"
    c = judge_acceptance(_comparison(4.0, 4.0, -0.1, 0.1), max_drop=0.5)
    assert c.rule == (f"FAIL when NEW is more than max_accept_drop 0.5 below OLD and the whole interval of the "
                      f"difference lies below 0 ({where})")
    c = judge_acceptance(_comparison(4.0, 4.0, -0.1, 0.1), tolerance=0.25)
    assert c.rule == (f"FAIL when the runs differ by more than the tolerance 0.25 and the interval of the "
                      f"difference excludes 0 ({where})")


def test_a_drop_of_exactly_max_accept_drop_passes_and_more_fails():
    assert not judge_acceptance(_comparison(4.0, 3.5, -0.75, -0.25), max_drop=0.5).failures
    c = judge_acceptance(_comparison(4.0, 3.25, -1.0, -0.5), max_drop=0.5)
    assert c.failures == [f"acceptance all: 4.000 → 3.250 dropped by 0.750 > max_accept_drop 0.5 "
                          f"(interval of the difference [-1.000, -0.500], {MIN_PROMPTS} prompts)"]


def test_rows_that_cannot_be_judged_leave_the_later_rows_judged():
    """A category too small to judge, or without an interval, is passed over; the rows after it are still judged."""
    small = Row("code", MIN_PROMPTS - 1, 4.0, 1.0, -3.5, -2.5)
    unmeasured = Row("math", MIN_PROMPTS, 4.0, 1.0, None, None)
    dropped = Row("all", MIN_PROMPTS, 4.0, 3.25, -1.0, -0.5)
    rows = [small, unmeasured, dropped]
    c = judge_acceptance(Comparison("accept_length", "OLD", "NEW", rows, rows, {}, None), max_drop=0.5)
    assert [r.failed for r in rows] == [False, False, True]
    assert c.failures == [f"acceptance all: 4.000 → 3.250 dropped by 0.750 > max_accept_drop 0.5 "
                          f"(interval of the difference [-1.000, -0.500], {MIN_PROMPTS} prompts)"]


@pytest.mark.parametrize("high", [0.0, 0.5])
def test_a_drop_whose_interval_reaches_zero_passes(high):
    assert not judge_acceptance(_comparison(4.0, 3.0, -2.0, high), max_drop=0.5).failures


@pytest.mark.parametrize("low, high, fails", [(0.0, 1.0, False), (0.25, 1.0, True), (-1.0, 0.0, False),
                                              (-1.0, -0.25, True)])
def test_a_tolerance_interval_touching_zero_does_not_exclude_it(low, high, fails):
    new = 4.5 if low >= 0 else 3.5
    c = judge_acceptance(_comparison(4.0, new, low, high), tolerance=0.25)
    assert bool(c.failures) == fails, c.failures


def test_a_difference_of_exactly_the_tolerance_passes_and_more_fails():
    assert not judge_acceptance(_comparison(4.0, 4.25, 0.125, 0.375), tolerance=0.25).failures
    c = judge_acceptance(_comparison(4.0, 4.5, 0.25, 0.75), tolerance=0.25)
    assert c.failures == [f"acceptance all: 4.000 → 4.500 differs by 0.500 > tolerance 0.25 "
                          f"(interval of the difference [+0.250, +0.750], {MIN_PROMPTS} prompts)"]


@pytest.mark.parametrize("row", [
    Row("all", MIN_PROMPTS - 1, 4.0, 2.0, -3.0, -1.0),   # too few prompts to judge, however large the drop
    Row("all", MIN_PROMPTS, None, 2.0, -3.0, -1.0),      # one side has no estimate
    Row("all", MIN_PROMPTS, 4.0, 2.0, None, None),       # no interval
], ids=["few-prompts", "no-old", "no-interval"])
def test_rows_the_rule_cannot_judge_are_shown_not_judged(row):
    for rule in ({"max_drop": 0.5}, {"tolerance": 0.25}):
        c = judge_acceptance(Comparison("accept_length", "OLD", "NEW", [row], [row], {}, None), **rule)
        assert not c.failures and not row.failed


# --------------------------------------------------------------------------- which near-tie policy applies


def _with_flip_rate(run: GateRun) -> GateRun:
    run.threshold = NearTieThreshold(0.01, "measured", None, 1.5,
                                     flip_rate=FlipRate(window=0.01, positions=100, flips=1.0, ties=0,
                                                        measured_positions=400))
    return run


def test_policy_line_without_a_flip_rate():
    assert near_tie_policy(_run(["exact"])) == (
        f"near-tie flips that are not exact ties allowed up to {DEFAULT_MAX_NEAR_TIE * 100:g}% of the prompts, "
        "exact-tie flips allowed and counted apart (no flip rate was measured, so the budget cannot follow the data)")


def test_policy_line_with_a_flip_rate_is_the_budget_from_the_data():
    run = _with_flip_rate(_run(["exact"]))
    evidence = ("the calibration bounds the flip rate: 1 flip(s) at 100 position(s) at risk, 95 % interval "
                "0.00177–0.0545, at most 0.25 wide")
    assert near_tie_policy(run) == f"{DATA_BUDGET} ({evidence})"
    run.deterministic_unknown = "spec http://s: no /server_info"
    assert near_tie_policy(run) == (f"{DATA_BUDGET} ({evidence}); not bit-exact without a policy, since the "
                                    "declaration is unknown on some servers: spec http://s: no /server_info")


def test_policy_line_under_bit_exact_says_whether_the_engine_declares_it_too():
    run = _run(["exact"], config=GateConfig(policy=GatePolicy(bit_exact=True)))
    assert near_tie_policy(run) == "bit-exact: --bit-exact"
    run.deterministic = DECLARED
    assert near_tie_policy(run) == f"bit-exact: --bit-exact (the engine declares it too: {DECLARED})"


def test_allow_near_tie_without_a_declaration_is_the_plain_budget():
    run = _run(["exact"], config=GateConfig(policy=GatePolicy(bit_exact=False, max_near_tie=0.5)))
    assert near_tie_policy(run) == "near ties allowed up to 50% of the prompts (--max-near-tie)"


# --------------------------------------------------------------------------- forced rejection's share


def test_reject_share_only_under_force_reject():
    assert reject_share(_run(["exact"])) is None
    share = reject_share(_run(["exact"], config=GateConfig(force_reject="all")))
    assert share is not None and share.mode == "all" and share.steps == 1 and share.partial == 1


# --------------------------------------------------------------------------- the flips the baseline predicts


def test_the_prediction_covers_judged_prompts_with_a_baseline_only():
    """Positions at risk are counted on prompts judged (not ``error``, not unjudged) that have a
    baseline: an errored prompt's or an unjudged prompt's risky positions predict nothing."""
    import numpy as np

    risky = TokenScores(np.array([0, 0, 0]), np.array([-0.6, -0.6, -0.6], np.float32),
                        np.array([[0, 1]] * 3), np.array([[-0.6, -0.605]] * 3, np.float32))  # margins 0.005
    run = _with_flip_rate(_run(["exact", "error", "exact"]))
    for r in run.records:
        r.baseline = GenerationResult(r.prompt.id, [0, 0, 0], "", "length", risky, SpecStats.unavailable("n/a"))
    run.records[2].verdict = None
    exp = flip_expectation(run)
    assert exp is not None and exp.prompts == 1 and exp.at_risk_prompts == 1
    run.records[0].baseline = None
    assert flip_expectation(run).prompts == 0


def test_a_rate_measured_with_ties_counts_reported_ties_at_risk():
    """On a channel too coarse for exact ties the flip rate counts reported ties as positions at risk; the
    prediction then counts them on the judged prompts too, and without ``with_ties`` it does not."""
    import dataclasses

    import numpy as np

    tied = TokenScores(np.array([0, 0, 0]), np.array([-0.6, -0.6, -0.6], np.float32),
                       np.array([[0, 1]] * 3), np.array([[-0.6, -0.6]] * 3, np.float32))  # margins 0
    run = _with_flip_rate(_run(["exact", "exact"]))
    for r in run.records:
        r.baseline = GenerationResult(r.prompt.id, [0, 0, 0], "", "length", tied, SpecStats.unavailable("n/a"))
    assert flip_expectation(run).at_risk_prompts == 0
    run.threshold.flip_rate = dataclasses.replace(run.threshold.flip_rate, with_ties=True)
    exp = flip_expectation(run)
    assert exp.prompts == 2 and exp.at_risk_prompts == 2


# --------------------------------------------------------------------------- the near-tie budget as a check


def test_bit_exact_budget_check_word_for_word():
    """Under the policy handed over (not the run's own), with one exact-tie flip among two near ties;
    and a bit-exact run with no near tie is ``ok``."""
    run = _run(["near_tie", "near_tie", "exact"], ties=(1,))
    policy = GatePolicy(bit_exact=True)
    check = near_tie_budget(run, {"near_tie": 2, "exact": 1}, policy)
    assert check == Check("fail", "bit-exact run (bit-exact: --bit-exact): any near tie fails, an exact tie too; "
                                  "this run has 2 (1 at exact ties)", "near_tie_budget",
                          numbers={"near_tie": 2, "ties": 1, "judged": 3})
    clean = near_tie_budget(_run(["exact"]), {"exact": 1}, policy)
    assert clean.state == "ok" and clean.numbers == {"near_tie": 0, "ties": 0, "judged": 1}


def test_a_share_given_by_hand_on_a_run_without_ties_or_prompts():
    check = near_tie_budget(_run(["near_tie", "exact"]), {"near_tie": 1, "exact": 1}, GatePolicy(max_near_tie=0.5))
    assert check.state == "ok" and check.text.endswith("this run has 1 of 2 judged (50%)"), check
    empty = near_tie_budget(_run([]), {}, GatePolicy(max_near_tie=0.4))
    assert empty.state == "ok" and empty.numbers["fraction"] == 0.0 and empty.text.endswith("0 of 0 judged (0%)")


def test_fixed_share_budget_check_word_for_word():
    run = _run(["near_tie", "near_tie", "exact", "exact"], ties=(0,))
    check = near_tie_budget(run, {"near_tie": 2, "exact": 2}, GatePolicy(max_near_tie=0.4))
    assert check == Check("fail", "near ties are allowed up to 40% of the prompts (--max-near-tie): this run has 2 of 4 "
                                  "judged (50%; 1 at exact ties)", "near_tie_budget",
                          numbers={"near_tie": 2, "ties": 1, "judged": 4, "fraction": 0.5, "allowed": 0.4})
    check = near_tie_budget(_run(["exact"]), {"exact": 1}, GatePolicy())
    assert check == Check("ok", f"near-tie flips that are not exact ties are allowed up to {DEFAULT_MAX_NEAR_TIE:.0%} "
                                "of the prompts (no flip rate was measured): this run has 0 of 1 judged (0%)",
                          "near_tie_budget", numbers={"near_tie": 0, "ties": 0, "judged": 1, "counted": 0,
                                                      "fraction": 0.0, "allowed": DEFAULT_MAX_NEAR_TIE})
    empty = near_tie_budget(_run([]), {}, GatePolicy())
    assert empty.state == "ok" and empty.numbers["fraction"] == 0.0
    # the fallback counts the flips that are not exact ties: exactly the share passes, one more fails
    at = _run(["near_tie", "near_tie", "exact", "exact"], ties=(1,))
    check = near_tie_budget(at, {"near_tie": 2, "exact": 2}, GatePolicy())
    assert check.state == "ok" and check.numbers["counted"] == 1 and check.numbers["fraction"] == DEFAULT_MAX_NEAR_TIE
    assert check.text.endswith("this run has 1 of 4 judged (25%; 1 more at exact ties, allowed apart)")
    over = near_tie_budget(_run(["near_tie", "near_tie", "exact", "exact"]), {"near_tie": 2, "exact": 2}, GatePolicy())
    assert over.state == "fail" and over.numbers["counted"] == 2


def test_budget_from_the_data_check_uses_the_expectation_handed_over():
    """The expectation given is the one judged (a run with a flip rate would compute another)."""
    run = _with_flip_rate(_run(["near_tie", "near_tie", "exact"], ties=(1,)))
    exp = _expectation(2)
    check = near_tie_budget(run, {"near_tie": 2, "exact": 1}, GatePolicy(), exp)
    assert check == Check("fail", f"1 flip(s) at exact ties (allowed: greedy decoding permits either tied token); "
                                  f"{exp.describe()}", "near_tie_budget",
                          numbers={"near_tie": 2, "ties": 1, "judged": 3, **exp.to_json()})
    assert near_tie_budget(run, {"near_tie": 2, "exact": 1}, GatePolicy(), _expectation(1)).state == "ok"


def test_budget_from_the_data_is_computed_when_not_handed_over():
    run = _with_flip_rate(_run(["exact", "exact"]))
    check = near_tie_budget(run, {"exact": 2}, GatePolicy())
    assert check.text.startswith("0 flip(s) at exact ties (allowed: greedy decoding permits either tied token); "
                                 "0 near-tie flip(s) that are not exact ties"), check.text
    assert check.state == "ok" and check.numbers["observed"] == 0


# --------------------------------------------------------------------------- decide(), line by line

#: Steps that take every speculative path once: reject, partial, all, cut by the limit, cut by a stop.
ALL_PATHS = ((4, 0, 1), (4, 2, 3), (4, 4, 5), (4, 1, 2, "limit"), (4, 1, 2, "stop"))
NEVER = {"reject": "a verify step that accepted none of its draft tokens (reject)",
         "partial": "a partial accept (rollback of the rejected tail) (partial)",
         "all": "a fully accepted draft block (bonus token path) (all)",
         "cut_limit": "a block cut by max_new_tokens (cut_limit)",
         "cut_stop": "a block cut by a stop token inside it (cut_stop)"}
UNKNOWN_ACTIVITY = "speculation activity unknown: the engine reported no draft counters for any request"


def _rec(pid: str, klass: str | None = "exact", steps=ALL_PATHS, spec: SpecStats | None = None,
         constraint=None, baseline: bool = True) -> PromptRecord:
    p = Prompt(id=pid, category="c", lang="en", prompt="x")
    stats = spec if spec is not None else SpecStats.from_steps([StepRecord(*s) for s in steps], "t")
    res = GenerationResult(pid, [1], "", "length", TokenScores.empty(), stats)
    base = GenerationResult(pid, [1], "", "length", TokenScores.empty(), SpecStats(False)) if baseline else None
    verdict = Verdict(pid, "c", klass, "r", constraint=constraint) if klass else None
    return PromptRecord(p, baseline=base, spec=res, verdict=verdict)


def _gate(recs: list[PromptRecord], config: GateConfig | None = None, **kw) -> GateRun:
    run = GateRun(None, config or GateConfig(), recs, **kw)
    for r in recs:
        run.coverage.add(r.spec.spec)
    return run


def _lines(d) -> tuple[bool, bool, int, list[str], list[str]]:
    return d.passed, d.engine_error, d.exit_code, d.failures, d.warnings


def test_decide_a_run_that_takes_every_path_passes_with_nothing_to_say():
    d = decide(_gate([_rec("a")]))
    assert _lines(d) == (True, False, exitcodes.PASS, [], [])
    assert d.counts == {"exact": 1, "near_tie": 0, "drifted": 0, "diverged": 0, "error": 0} and not d.interrupted


def test_decide_names_each_failed_class_and_drift_follows_the_policy():
    run = _run(["exact", "drifted", "diverged", "error", "near_tie", "drifted"])
    drifted = ("2 prompt(s) drifted: identical tokens (or a near tie) but the speculative run's logprobs left the "
               "target's noise: p-1, p-5")
    never = [f"path never taken: {NEVER[p]}" for p in ("reject", "all", "cut_limit", "cut_stop")]
    assert _lines(decide(run)) == (False, False, exitcodes.GATE_FAILED,
                                   [drifted, "1 prompt(s) diverged: p-2", "1 prompt(s) failed in the engine: p-3"], never)
    assert _lines(decide(run, GatePolicy(drift="warn", max_near_tie=1.0))) == (
        False, False, exitcodes.GATE_FAILED, ["1 prompt(s) diverged: p-2", "1 prompt(s) failed in the engine: p-3"],
        [drifted, *never])
    assert decide(_run(["exact", "drifted"]), GatePolicy(drift="warn")).passed


def test_decide_a_broken_constraint_fails_whatever_the_class():
    recs = [_rec("a", "diverged", constraint={"problem": "x"}), _rec("b", constraint={"kind": "json_schema"}),
            _rec("c", constraint={"problem": "y"}), _rec("d", constraint={"problem": ""})]
    assert _lines(decide(_gate(recs))) == (False, False, exitcodes.GATE_FAILED, [
        "1 prompt(s) diverged: a",
        "2 prompt(s) broke their output constraint under speculation (the baseline's output kept it): a, c"], [])


def test_decide_calibration_and_golden_errors_judge_nothing():
    empty = GateRun(None, GateConfig(), [])
    empty.calibration_error, empty.golden_error = "scorer refused", "golden missing"
    assert _lines(decide(empty)) == (False, True, exitcodes.ENGINE_ERROR, [
        "the gate could not be calibrated, so nothing was judged: scorer refused",
        "the golden could not be used, so nothing was judged: golden missing",
        "nothing judged: no prompt was selected or in common, and a run that judges nothing never passes"], [])
    nothing = decide(GateRun(None, GateConfig(), []))
    assert nothing.failures == [
        "nothing judged: no prompt was selected or in common, and a run that judges nothing never passes"]
    assert not nothing.engine_error
    cal = _gate([_rec("a", "error", spec=SpecStats(False))])
    cal.calibration_error = "c"
    assert _lines(decide(cal)) == (False, True, exitcodes.ENGINE_ERROR,
                                   ["the gate could not be calibrated, so nothing was judged: c"], [])
    gold = _gate([_rec("a", "error")])
    gold.golden_error = "g"
    assert _lines(decide(gold)) == (False, False, exitcodes.GATE_FAILED,
                                    ["the golden could not be used, so nothing was judged: g"], [])
    # a prompt judged despite the golden's failure: its activity is still checked
    judged = _gate([_rec("a", spec=SpecStats(False)), _rec("b", "error", spec=SpecStats(False))])
    judged.golden_error = "g"
    assert decide(judged).failures == ["the golden could not be used, so nothing was judged: g", UNKNOWN_ACTIVITY]
    errors = _gate([_rec("a", "error", spec=SpecStats(False))])
    assert decide(errors).failures == ["1 prompt(s) failed in the engine: a", UNKNOWN_ACTIVITY]


def test_decide_speculation_activity_unknown_unattributed_and_inactive():
    config = GateConfig(golden="g", golden_mode="baseline", policy=GatePolicy(min_accept_length=9, require_paths=2))
    assert _lines(decide(_gate([_rec("a", spec=SpecStats(False))], config))) == (True, False, 0, [], [])
    assert decide(_gate([_rec("a", spec=SpecStats(False))], GateConfig(golden="g"))).failures == [UNKNOWN_ACTIVITY]
    unattributed = _gate([_rec("a", spec=SpecStats(False))], aggregate_unattributed="counters read, other traffic: x")
    assert _lines(decide(unattributed)) == (False, False, 1, ["speculation counters read, other traffic: x"], [])
    assert _lines(decide(unattributed, GatePolicy(allow_unknown_activity=True))) == (
        True, False, 0, [], ["speculation counters read, other traffic: x"])
    failed_read = _gate([_rec("a", spec=SpecStats(False))], counters_error="timeout")
    assert decide(failed_read).failures == [
        f"{UNKNOWN_ACTIVITY} (reading its aggregate counters after the speculative phase failed: timeout)"]
    assert _lines(decide(_gate([_rec("a", spec=SpecStats(False))]), GatePolicy(allow_unknown_activity=True))) == (
        True, False, 0, [], [UNKNOWN_ACTIVITY])
    idle = _gate([_rec("a", steps=((4, 0, 1), (3, 0, 1)))])
    assert _lines(decide(idle)) == (False, False, 1, [
        "speculation inactive: 7 draft tokens proposed over 2 verify steps and none accepted; an exact match proves "
        "nothing if the draft never ran"], [f"path never taken: {NEVER[p]}" for p in ("partial", "all", "cut_limit",
                                                                                      "cut_stop")])
    forced = _gate([_rec("a", steps=((4, 0, 1), (3, 0, 1)))], GateConfig(force_reject="all"))
    assert _lines(decide(forced)) == (True, False, 0, [], [f"path never taken: {NEVER[p]}"
                                                          for p in ("cut_limit", "cut_stop")])
    totals = _gate([_rec("a", spec=SpecStats(True, proposed=10, accepted=5, verify_steps=4))])
    assert _lines(decide(totals)) == (
        True, False, 0, [], ["path coverage unknown: the engine reports totals only, no per-step records"])


def test_decide_the_acceptance_floor_below_at_and_under_force_reject():
    def floor(value, force=None):
        return decide(_gate([_rec("a")], GateConfig(force_reject=force, policy=GatePolicy(min_accept_length=value))))

    assert floor(2.7).failures == ["acceptance floor: mean accept length 2.60 is below the policy's min_accept_length "
                                   "2.7 (lossless, but speculation collapsed)"]
    assert _lines(floor(2.6)) == (True, False, 0, [], [])  # 13 tokens over 5 steps: exactly the floor
    assert _lines(floor(2.5, "random")) == (True, False, 0, [], [
        "acceptance floor min_accept_length 2.5 not applied: --force-reject random rejects drafts on purpose"])


def test_decide_force_reject_that_rejected_too_little_is_a_configuration_error_unless_a_prompt_failed():
    problem = ("--force-reject all: only 1/5 verify steps (20%) rejected every draft token, fewer than 90%: the mode "
               "did not do its job (a configuration error: the run's output was compared, but the reject path was not "
               "exercised as asked)")
    assert _lines(decide(_gate([_rec("a")], GateConfig(force_reject="all")))) == (
        False, True, exitcodes.ENGINE_ERROR, [problem], [])
    for klass, line in (("diverged", "1 prompt(s) diverged: a"), ("error", "1 prompt(s) failed in the engine: a")):
        d = decide(_gate([_rec("a", klass)], GateConfig(force_reject="all")))
        assert _lines(d) == (False, False, exitcodes.GATE_FAILED, [line, problem], [])
    drift = decide(_gate([_rec("a", "drifted")], GateConfig(force_reject="all")), GatePolicy(drift="warn"))
    assert not drift.engine_error and drift.failures == [problem]
    silent = _gate([_rec("a", spec=SpecStats(False))], GateConfig(force_reject="all", policy=GatePolicy(
        allow_unknown_activity=True)))
    assert decide(silent).failures == []  # no counters: nothing to count the rejections with


def test_decide_require_all_paths_counts_prompts_per_path():
    run = _gate([_rec("a"), _rec("b", steps=((4, 0, 1),))], GateConfig(policy=GatePolicy(require_paths=2)))
    assert _lines(decide(run)) == (False, False, 1, [
        f"path taken on 1 prompt(s), fewer than --require-all-paths 2: {NEVER[p]}"
        for p in ("partial", "all", "cut_limit", "cut_stop")], [])
    forced = _gate([_rec("a", steps=((4, 0, 1),)), _rec("b", steps=((4, 0, 1),))],
                   GateConfig(force_reject="all", policy=GatePolicy(require_paths=1)))
    assert decide(forced).failures == [f"path taken on 0 prompt(s), fewer than --require-all-paths 1: {NEVER[p]}"
                                       for p in ("cut_limit", "cut_stop")]


def test_decide_calibration_prompts_skipped_checks_and_findings():
    measured = _rec("k1")
    not_run = PromptRecord(Prompt(id="k2", category="c", lang="en", prompt="x"))
    failed = _rec("k3")
    failed.baseline.error = "boom"
    unscored = _rec("k4")
    unscored.tf_error = "scorer down"
    run = _gate([_rec("a")], calibration_records=[measured, not_run, failed, unscored],
                skipped_checks=["could not ask /metrics"])
    unmeasured = ["calibration prompt k2 could not be measured: not run",
                  "calibration prompt k3 could not be measured: boom",
                  "calibration prompt k4 could not be measured: scorer down"]
    assert _lines(decide(run)) == (True, False, 0, [], [*unmeasured, "could not ask /metrics"])
    assert _lines(decide(run, GatePolicy(unknown_fails=True))) == (
        False, False, 1, ["could not ask /metrics; under a policy a check that could not be made fails"], unmeasured)
    run.golden_error = "g"
    assert _lines(decide(run)) == (False, False, 1, ["the golden could not be used, so nothing was judged: g"],
                                   ["could not ask /metrics"])
    run.golden_error, run.skipped_checks, run.calibration_records = None, [], []
    run.threshold = NearTieThreshold(0.5, "override", None, 1.5)
    finding = decide(run).warnings
    assert len(finding) == 1 and finding[0].startswith("no noise measured: the near-tie threshold 0.5 nats")
    strict = decide(run, GatePolicy(calibration_findings="fail", max_near_tie=1.0))
    assert strict.failures == [f'{finding[0]} — a failure under the policy\'s calibration_findings = "fail"']
    assert strict.warnings == []


def test_decide_a_run_that_stopped_early_or_was_interrupted():
    stopped = _gate([_rec("a"), _rec("b", None)], fatal="engine died\ntraceback ...")
    assert _lines(decide(stopped)) == (False, False, 1, ["the run stopped early: engine died",
                                                         "1 prompt(s) never finished: b"], [])
    nothing = _gate([_rec("a", None, baseline=False)], fatal="engine died")
    assert _lines(decide(nothing)) == (False, True, exitcodes.ENGINE_ERROR, ["the run stopped early: engine died",
                                                                            "1 prompt(s) never finished: a"], [])
    baseline_only = _gate([_rec("a", None)], fatal="engine died")
    assert decide(baseline_only).engine_error is False
    interrupted = _gate([_rec("a")], interrupted=True)
    d = decide(interrupted)
    assert _lines(d) == (False, False, exitcodes.INTERRUPTED, [
        "the run was interrupted (Ctrl-C or SIGTERM); the verdicts below are of the prompts that finished"], [])
    assert d.interrupted is True
    empty = GateRun(None, GateConfig(), [], interrupted=True)
    assert decide(empty).failures == [
        "the run was interrupted (Ctrl-C or SIGTERM); the verdicts below are of the prompts that finished"]


def test_decide_hands_over_the_near_tie_budget_its_failure_line_and_the_policy_given():
    run = _run(["exact"] * 2 + ["near_tie"] * 2)
    d = decide(run)
    line = (f"2/4 near-tie prompts that are not exact ties (50%) exceed the fixed share {DEFAULT_MAX_NEAR_TIE:.0%} "
            "(no flip rate was measured): p-2, p-3")
    assert d.failures == [line] and d.near_tie_failure == line and d.flip_expectation is None
    assert d.near_tie_budget == near_tie_budget(run, {"exact": 2, "near_tie": 2}, GatePolicy(), None)
    assert d.near_tie_budget.state == "fail" and d.near_tie_budget.numbers["near_tie"] == 2
    lenient = decide(run, GatePolicy(max_near_tie=0.5))
    assert lenient.passed and lenient.near_tie_failure is None and lenient.near_tie_budget.state == "ok"
    assert lenient.near_tie_budget.numbers["allowed"] == 0.5
    strict = decide(run, GatePolicy(bit_exact=True))
    assert strict.failures == ["--bit-exact: 2 near-tie flip(s) where bit-exactness is required: p-2, p-3"]
    # the run's own policy when none is handed over
    own = _run(["exact"] * 2 + ["near_tie"] * 2, config=GateConfig(policy=GatePolicy(max_near_tie=0.5)))
    assert decide(own).passed and not decide(own, GatePolicy(max_near_tie=0.25)).passed


# --------------------------------------------------------------------------- a channel too coarse for exact ties


def test_a_coarse_channel_counts_reported_ties_in_every_budget_word_for_word():
    from specparity.gate.decision import DATA_BUDGET_WITH_TIES, coarse_channel, counted_flips, free_ties, ties_free
    from specparity.judge.resolution import resolution_words
    from specparity.model.threshold import ChannelResolution

    coarse = ChannelResolution(1e-3, None, 100)
    words = resolution_words(coarse)
    run = _run(["near_tie", "near_tie", "exact", "exact"], ties=(0,))
    assert ties_free(run) and coarse_channel(run) == ""  # no threshold: judged as before
    run.threshold = NearTieThreshold(0.01, "measured", None, 1.5, resolution=coarse,
                                     flip_rate=FlipRate(window=0.01, positions=100, flips=1.0, ties=0,
                                                        measured_positions=400, with_ties=True))
    assert not ties_free(run) and coarse_channel(run) == words
    assert free_ties(run) == [] and [v.prompt_id for v in counted_flips(run)] == ["p-0", "p-1"]
    evidence = ("the calibration bounds the flip rate: 1 flip(s) at 100 position(s) at risk, 95 % interval "
                "0.00177–0.0545, at most 0.25 wide")
    assert near_tie_policy(run) == f"{DATA_BUDGET_WITH_TIES} ({evidence}; {words})"
    check = near_tie_budget(run, {"near_tie": 2, "exact": 2}, GatePolicy())
    assert check.text.startswith(f"1 flip(s) at reported ties, counted with the others ({words}); 2 near-tie flip(s), "
                                 f"reported ties included, against ")
    run.threshold.flip_rate = FlipRate(window=0.01, positions=0, flips=0.0, ties=0, measured_positions=400,
                                       with_ties=True)
    why = ("the calibration saw too few positions at risk to bound the flip rate: 0 flip(s) at 0 position(s) at risk, "
           "95 % interval 0–1, wider than 0.25")
    assert near_tie_policy(run) == (f"near-tie flips allowed up to 25% of the prompts, reported ties included ({why}, "
                                    f"so the budget cannot follow the data; {words})")
    check = near_tie_budget(run, {"near_tie": 2, "exact": 2}, GatePolicy())
    assert check == Check("fail", f"near-tie flips, reported ties included, are allowed up to 25% of the prompts "
                                  f"({why}; {words}): this run has 2 of 4 judged (50%)", "near_tie_budget",
                          numbers={"near_tie": 2, "ties": 1, "judged": 4, "counted": 2, "fraction": 0.5,
                                   "allowed": DEFAULT_MAX_NEAR_TIE})
    assert near_tie_failure(run, {"near_tie": 2, "exact": 2}, GatePolicy(), None) == (
        f"2/4 near-tie prompts, reported ties included, (50%) exceed the fixed share 25% ({why}): p-0, p-1")
