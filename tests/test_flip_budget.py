"""No allowance without evidence: the near-tie budget follows the data only where the calibration bounds
the flip rate (``specparity/judge/flip_budget.py``, ``specparity/gate/decision.py``).

The budget from the data predicts how many prompts flip from the rate at which the baseline's own two
computations flip a token at a position at risk. A calibration that saw no such position (prompts with
clear margins, a scorer that leaves its rows out at close calls) has the Wilson interval 0..1 for that
rate, and a budget at the interval's high end lets every prompt flip. So a rate whose interval is wider
than :data:`~specparity.judge.flip_budget.MAX_RATE_WIDTH` gives the fixed share instead, and so does a
threshold set by hand (``--near-tie-nats``); the summary's near-tie policy line says which budget applied
and why. Constructed rows and runs: no engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from specparity.gate.decision import DATA_BUDGET, decide, near_tie_budget, near_tie_policy
from specparity.judge.calibration import Sample, calibrate
from specparity.model.gate_run import DEFAULT_MAX_NEAR_TIE, GateConfig, GateRun, PromptRecord
from specparity.model.prompts import Prompt
from specparity.model.threshold import FlipRate, NearTieThreshold, NoiseStats, wilson
from specparity.model.types import GenerationResult, SpecStats, TokenScores
from specparity.model.verdicts import Divergence, TokenView, Verdict

#: The margin of a far alternative every row also carries (the scorer check's clear positions).
FAR = 6.0


def rows(margins, start: int = 0) -> TokenScores:
    """One row per margin: token ``start + i`` beats an alternative (id + 1000) by ``margins[i]`` nats
    (negative: the alternative is the row's argmax; NaN: a row the engine did not report) and a far one
    (id + 2000) by :data:`FAR`. The chosen token's logprob moves from row to row, as a model's does."""
    n = len(margins)
    ids = np.arange(start, start + n)
    top_ids = np.full((n, 3), -1, np.int64)
    top_lp = np.full((n, 3), np.nan, np.float32)
    own = np.full(n, np.nan, np.float32)
    for i, m in enumerate(margins):
        if m != m:
            continue
        own[i] = -1.0 - (i % 32) / 64
        row = sorted([(own[i], ids[i]), (own[i] - m, ids[i] + 1000), (own[i] - FAR, ids[i] + 2000)], reverse=True)
        top_lp[i], top_ids[i] = [lp for lp, _ in row], [t for _, t in row]
    return TokenScores(ids, own, top_ids, top_lp)


def sample(pid: str, decode_margins, tf_margins, start: int = 0) -> Sample:
    """A calibration sample whose decode rows and teacher-forced rows hold those margins."""
    decoded = rows(decode_margins, start)
    return Sample(pid, decoded.token_ids.tolist(), decoded, rows(tf_margins, start))


def record(pid: str, risky: int, klass: str, tie: bool = False, n: int = 10) -> PromptRecord:
    """A judged prompt whose baseline has ``risky`` positions with a margin of 0.1 nats (the rest clear)."""
    margins = [0.1] * risky + [5.0] * (n - risky)
    base = GenerationResult(pid, list(range(n)), "", "length", rows(margins), SpecStats(True, 4, 2, 2))
    rec = PromptRecord(Prompt(pid, "c", "en", prompt="x"), baseline=base, spec=base)
    verdict = Verdict(pid, "c", klass, "")
    if klass == "near_tie":
        verdict.divergence = Divergence(0, TokenView(0, "a"), TokenView(1000, "b"), 0.0 if tie else 0.1, 1, 0.0, 0,
                                        "", "", "", None, tie=tie)
    rec.verdict = verdict
    return rec


def judged(n: int, flips: int, risky: int = 3) -> list[PromptRecord]:
    """``n`` judged prompts, the first ``flips`` of them near-tie flips that are not exact ties."""
    return [record(f"p{i}", risky, "near_tie" if i < flips else "exact") for i in range(n)]


def gate(records, threshold: NearTieThreshold) -> GateRun:
    run = GateRun(None, GateConfig(), records)
    run.threshold = threshold
    return run


def fixed_share_failure(near: int, total: int, why: str) -> str:
    ids = ", ".join(f"p{i}" for i in range(near))
    return (f"{near}/{total} near-tie prompts that are not exact ties ({near / total:.0%}) exceed the fixed share "
            f"{DEFAULT_MAX_NEAR_TIE:.0%} ({why}): {ids}")


def fallback_policy(why: str) -> str:
    return (f"near-tie flips that are not exact ties allowed up to 25% of the prompts, exact-tie flips allowed and "
            f"counted apart ({why}, so the budget cannot follow the data)")


def no_positions(positions: int = 0, flips: float = 0.0) -> str:
    lo, hi = wilson(flips, positions)
    return (f"the calibration saw too few positions at risk to bound the flip rate: {flips:g} flip(s) at {positions} "
            f"position(s) at risk, 95 % interval {lo:.3g}–{hi:.3g}, wider than 0.25")


#: Calibrations that see no position at risk: every margin clear of the threshold, or a scorer that
#: leaves its rows out exactly where the baseline's margin is close (the noise is then measured on the
#: clear positions alone).
CLEAR = [sample(f"c{i}", [5.0] * 10, [4.9] * 10, 20 * i) for i in range(8)]
SILENT_AT_CLOSE_CALLS = [sample(f"c{i}", [0.1] * 4 + [5.0] * 6, [np.nan] * 4 + [4.9] * 6, 20 * i) for i in range(8)]


@pytest.mark.parametrize("calibration", [CLEAR, SILENT_AT_CLOSE_CALLS], ids=["clear-margins", "scorer-silent"])
def test_a_calibration_that_saw_no_position_at_risk_gives_the_fixed_share(calibration):
    """40 judged prompts, each a near-tie flip at a position at risk: a budget resting on 0 of 0 would
    let all 40 pass; the fixed share fails them and says why."""
    _check, threshold = calibrate(calibration, scorer="test")
    assert threshold.source == "measured" and threshold.flip_rate.positions == 0
    run = gate(judged(40, 40), threshold)
    decision = decide(run)
    assert decision.flip_expectation is None
    assert fixed_share_failure(40, 40, no_positions()) in decision.failures, decision.failures
    assert near_tie_policy(run) == fallback_policy(no_positions())
    assert decision.near_tie_budget.text.startswith(
        f"near-tie flips that are not exact ties are allowed up to 25% of the prompts ({no_positions()})")
    # the same prompts within the fixed share pass: it is the share, not a refusal
    assert decide(gate(judged(40, 10), threshold)).passed


def _well_measured(override: float | None):
    """A calibration whose positions at risk flip often (30 of 100) and are many: its interval is narrow."""
    at_risk = [sample(f"r{i}", [0.1] * 10 + [5.0] * 2, [-0.1] * 3 + [0.1] * 7 + [5.0] * 2, 20 * i) for i in range(10)]
    return calibrate(at_risk, scorer="test", override=override)[1]


def test_a_threshold_set_by_hand_gives_the_fixed_share_whatever_the_flip_rate():
    """12 of 40 prompts flip: within what a 30 % flip rate predicts, beyond the fixed 25 %."""
    measured = _well_measured(None)
    rate = measured.flip_rate
    assert (rate.positions, rate.flips) == (100, 30.0)
    lo, hi = rate.bounds()
    assert hi - lo <= 0.25
    assert decide(gate(judged(40, 12), measured)).passed
    assert near_tie_policy(gate([], measured)).startswith(DATA_BUDGET)

    by_hand = _well_measured(measured.nats)
    assert by_hand.source == "override" and by_hand.flip_rate == rate
    run = gate(judged(40, 12), by_hand)
    decision = decide(run)
    why = "the near-tie threshold was set by --near-tie-nats, not measured"
    assert fixed_share_failure(12, 40, why) in decision.failures, decision.failures
    assert near_tie_policy(run) == fallback_policy(why)


def _with_rate(positions: int, flips: float) -> NearTieThreshold:
    return NearTieThreshold(0.15, "measured", NoiseStats(0.1, 0.1, 100, 100), 1.5,
                            flip_rate=FlipRate(0.15, positions, flips, 0, 1000))


def test_the_rate_is_bounded_from_an_interval_at_most_a_quarter_wide():
    """0 flips at 12 positions: the interval 0–0.242, narrow enough; at 11 positions 0–0.259, too wide."""
    assert wilson(0, 12)[1] <= 0.25 < wilson(0, 11)[1]
    assert near_tie_policy(gate([], _with_rate(12, 0))).startswith(DATA_BUDGET)
    wide = gate([], _with_rate(11, 0))
    assert near_tie_policy(wide) == fallback_policy(no_positions(11))
    # a high rate measured on many positions is evidence: it keeps the budget from the data
    assert near_tie_policy(gate([], _with_rate(400, 200))).startswith(DATA_BUDGET)
    # one flip at 18 positions: 0.0099–0.258, 0.248 wide, bounded; at 17, 0.259 wide, not
    assert _width(1, 18) <= 0.25 < _width(1, 17)
    assert near_tie_policy(gate([], _with_rate(18, 1))).startswith(DATA_BUDGET)
    assert no_positions(17, 1) in near_tie_policy(gate([], _with_rate(17, 1)))


def _width(flips: float, positions: int) -> float:
    lo, hi = wilson(flips, positions)
    return hi - lo


def test_an_interval_exactly_as_wide_as_the_limit_bounds_the_rate(monkeypatch):
    from specparity.judge import flip_budget

    rate = FlipRate(0.15, 18, 1, 0, 100)
    monkeypatch.setattr(flip_budget, "MAX_RATE_WIDTH", _width(1, 18))
    assert flip_budget.rate_bounded(rate) and flip_budget.fixed_share_reason(rate, "measured") is None
    monkeypatch.setattr(flip_budget, "MAX_RATE_WIDTH", np.nextafter(_width(1, 18), 0))
    assert not flip_budget.rate_bounded(rate)


def test_the_reasons_in_their_order():
    """A hand-set threshold is named first, whatever its rate; then a missing rate; then an unbounded one."""
    from specparity.judge.flip_budget import MAX_RATE_WIDTH, fixed_share_reason

    assert MAX_RATE_WIDTH == DEFAULT_MAX_NEAR_TIE == 0.25
    bounded = FlipRate(0.15, 400, 4, 0, 1000)
    hand = "the near-tie threshold was set by --near-tie-nats, not measured"
    assert [fixed_share_reason(r, s) for r, s in ((bounded, "override"), (None, "override"), (None, "measured"),
                                                  (FlipRate(0.15, 0, 0, 0, 9), "measured"), (bounded, "measured"))] == [
        hand, hand, "no flip rate was measured", no_positions(), None]
    lo, hi = bounded.bounds()
    assert near_tie_policy(gate([], _with_rate(400, 4))) == (
        f"{DATA_BUDGET} (the calibration bounds the flip rate: 4 flip(s) at 400 position(s) at risk, 95 % interval "
        f"{lo:.3g}–{hi:.3g}, at most 0.25 wide)")


def test_the_budget_check_names_the_fixed_share_and_the_reason():
    run = gate(judged(4, 1), _with_rate(0, 0))
    check = near_tie_budget(run, {"near_tie": 1, "exact": 3})
    assert check.text == (f"near-tie flips that are not exact ties are allowed up to 25% of the prompts "
                          f"({no_positions()}): this run has 1 of 4 judged (25%)")
    assert check.state == "ok" and check.numbers["allowed"] == DEFAULT_MAX_NEAR_TIE


def test_exact_ties_keep_their_own_budget_under_the_fixed_share():
    """The fixed share stands in for the prediction of the flips that are not exact ties; exact ties were
    never predicted, so they stay allowed apart: 8 exact ties and 2 other flips of 10 prompts pass it (as a
    tie-dense target's healthy loop does), 3 other flips fail it."""
    records = [record(f"p{i}", 3, "near_tie", tie=i >= 2) for i in range(10)]
    run = gate(records, _with_rate(0, 0))
    decision = decide(run)
    assert decision.passed, decision.failures
    assert decision.near_tie_budget.text == (
        f"near-tie flips that are not exact ties are allowed up to 25% of the prompts ({no_positions()}): this run "
        f"has 2 of 10 judged (20%; 8 more at exact ties, allowed apart)")
    assert decision.near_tie_budget.numbers == {"near_tie": 10, "ties": 8, "judged": 10, "counted": 2,
                                                "fraction": 0.2, "allowed": DEFAULT_MAX_NEAR_TIE}
    records[2] = record("p2", 3, "near_tie")
    failed = decide(gate(records, _with_rate(0, 0)))
    assert fixed_share_failure(3, 10, no_positions()) in failed.failures, failed.failures
