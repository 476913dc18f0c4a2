"""Exact ties, margins in ulps and a near-tie budget that follows the data.

A real bf16 model flips at exact ties and single ulps; the gate must say which, say how each side
broke a tie, and fail only when the speculative run flips clearly more than the target's own two
computations (decode, teacher-forced) explain. The end-to-end cases run on a tie-dense copy of the
fixture target (``tests/tie_model.py``): ties there exist by construction, on any CPU.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from broken_loops import ACCEPT_CLOSE_NATS, LoopEngine
from specparity.engines.base import EngineOptions
from specparity.gate.decision import decide, flip_expectation, tie_flips
from specparity.judge.flip_budget import expected_flips, measure_flip_rate, poisson_binomial, quantile
from specparity.judge.noise import measure_noise, robust_figure
from specparity.judge.resolution import (accepted_draft_positions, margin_quantum, row_quantum, scores_quantum,
                                         spec_tie_break, ulps)
from specparity.model.gate_run import GateConfig, GatePolicy, GateRun, PromptRecord
from specparity.model.prompts import Prompt
from specparity.model.threshold import FlipRate, NearTieThreshold, NoiseStats
from specparity.model.types import GenerationResult, SpecStats, StepRecord, TokenScores
from specparity.model.verdicts import Divergence, TokenView, Verdict
from specparity.report.lines import near_tie_lines, terminal_lines
from specparity.run.runner import run_gate
from tie_model import build_tie_model


# ------------------------------------------------------------------ resolution: ulps and ties
def test_a_bf16_row_reads_its_spacing_and_a_float32_row_has_none():
    top = 19.75  # a bf16 logit in [16, 32): spacing 0.125
    bf16 = np.array([top, top - 0.125, top - 0.375, top - 0.5, top - 4.0]) - 23.0
    assert row_quantum(bf16) == 0.125
    assert ulps(0.125, row_quantum(bf16)) == 1
    rng = np.random.default_rng(0)
    assert row_quantum(np.sort(rng.normal(size=8))[::-1] * 3) is None
    # a tie with the top and one other value: too few differences to tell
    assert row_quantum([0.0, 0.0, -0.25]) is None


def test_the_spacing_is_read_near_the_top_not_from_a_lower_binade():
    """Values far below the top sit in lower binades with a finer spacing; they must not halve the ulp."""
    row = np.array([17.0, 16.875, 16.5, 16.25, 6.03125, 5.0]) - 20.0
    assert row_quantum(row) == 0.125


def test_a_row_with_clear_margins_reads_its_spacing_from_the_nearest_values_at_any_distance():
    top = 20.0
    row = np.array([top, top, top - 6.5, top - 7.75, top - 9.0]) - 25.0  # a tie, then clear margins
    assert row_quantum(row) == 0.25
    s = TokenScores([5], [row[0]], [[5, 6, 7, 8, 9]], [row.tolist()])
    assert margin_quantum(s, 0, 0.0625) == 0.0625  # never coarser than the margin itself allows
    assert margin_quantum(s, 0, 0.5) == 0.25


def test_scores_quantum_reads_the_row_with_its_alternatives():
    s = TokenScores([5], [-1.0], [[5, 7, 9, 11, 13]], [[-1.0, -1.0, -1.25, -1.5, -1.75]])
    assert scores_quantum(s, 0) == 0.25


def test_how_the_speculative_side_broke_a_tie():
    assert spec_tie_break(10, 20, 0.0, True) == "draft"
    assert spec_tie_break(10, 20, 0.125, True) == "own_argmax"  # its row is not tied: one ulp the other way
    assert spec_tie_break(10, 5, 0.0, False) == "lower_id"
    assert spec_tie_break(10, 20, 0.0, False) == "higher_id"
    assert spec_tie_break(10, 20, None, None) == "unknown"


def test_accepted_draft_positions_follow_the_step_records():
    # prefill token, then a step accepting 2 of 3 (+ correction), then one accepting 0 (+ correction)
    spec = SpecStats.from_steps([StepRecord(3, 2, 3), StepRecord(3, 0, 1)], "test")
    assert accepted_draft_positions(spec, 5).tolist() == [False, True, True, False, False]
    assert accepted_draft_positions(spec, 9) is None  # the records do not add up to the stream
    assert accepted_draft_positions(SpecStats(True, 3, 2, 2), 5) is None  # totals only


# ------------------------------------------------------------------ the robust threshold figure
def test_one_outlier_pair_cannot_set_the_threshold():
    deltas = np.array([0.125] * 40 + [0.0625] * 200 + [0.75])
    assert robust_figure(deltas) == 0.125
    assert robust_figure(np.array([0.3, 0.1])) == 0.3  # too few values for an order statistic: the maximum


def test_the_threshold_uses_the_robust_figure_and_reports_the_max():
    n = 60
    ids = np.arange(n)
    decoded = TokenScores(ids, np.zeros(n), np.stack([ids, ids + 100], 1), np.stack([np.zeros(n), -np.full(n, 0.5)], 1))
    moved = np.full(n, -0.5)
    moved[7] = -1.25  # one pair 0.75 nats off, the others 0
    tf = TokenScores(ids, np.zeros(n), np.stack([ids, ids + 100], 1), np.stack([np.zeros(n), moved], 1))
    noise = measure_noise([(decoded, tf)], window=2.0)
    assert noise.near_max_abs_delta == pytest.approx(0.75)
    assert noise.flip_noise == 0.0
    assert "max 0.75" in noise.describe_flip()


# ------------------------------------------------------------------ the flip budget
def test_poisson_binomial_matches_enumeration():
    ps = [0.1, 0.5, 0.8, 0.3]
    brute = np.zeros(len(ps) + 1)
    for bits in itertools.product([0, 1], repeat=len(ps)):
        brute[sum(bits)] += np.prod([p if b else 1 - p for p, b in zip(ps, bits)])
    assert np.allclose(poisson_binomial(ps), brute)
    assert quantile(poisson_binomial([0.0] * 5), 0.99) == 0
    assert quantile(poisson_binomial([1.0] * 5), 0.5) == 5


def _scores(tokens, margins):
    """Rows whose chosen token beats one alternative (id + 1000) by ``margins`` (negative: the other wins)."""
    ids = np.asarray(tokens)
    m = np.asarray(margins, float)
    own, alt = np.where(m >= 0, 0.0, m), np.where(m >= 0, -m, 0.0)
    top = np.stack([np.where(m >= 0, ids, ids + 1000), np.where(m >= 0, ids + 1000, ids)], 1)
    top_lp = np.stack([np.maximum(own, alt), np.minimum(own, alt)], 1)
    return TokenScores(ids, own, top, top_lp)


def test_the_flip_rate_counts_where_the_two_computations_disagree():
    decoded = _scores(range(6), [0.1, 0.1, 0.1, 0.1, 0.0, 3.0])
    tf = _scores(range(6), [-0.05, 0.0, 0.1, 0.2, -0.1, 3.0])
    rate = measure_flip_rate([(decoded, tf)], window=0.5)
    assert (rate.positions, rate.flips, rate.ties) == (4, 1.5, 1)  # a flip, a tie (one half), two holds


def _record(pid: str, risk: int, klass: str, tie: bool = False) -> PromptRecord:
    margins = [0.1] * risk + [5.0] * (10 - risk)
    base = GenerationResult(pid, list(range(10)), "", "length", _scores(range(10), margins), SpecStats(True, 4, 2, 2))
    rec = PromptRecord(Prompt(pid, "c", "en", prompt="x"), baseline=base, spec=base)
    v = Verdict(pid, "c", klass, "")
    if klass == "near_tie":
        v.divergence = Divergence(3, TokenView(3, "a"), TokenView(1003, "b"), 0.0 if tie else 0.1, 0, 0.0, 0, "", "", "",
                                  None, tie=tie)
    rec.verdict = v
    return rec


def _run(records, rate: FlipRate, policy: GatePolicy | None = None) -> GateRun:
    noise = NoiseStats(0.1, 0.1, 100, 100)
    run = GateRun(None, GateConfig(policy=policy or GatePolicy()), records)
    run.threshold = NearTieThreshold(0.15, "measured", noise, 1.5, flip_rate=rate)
    return run


def test_flips_clearly_beyond_the_baselines_own_rate_fail_and_within_it_pass():
    rate = FlipRate(0.15, positions=400, flips=4, ties=0, measured_positions=1000)  # 1 % of risky positions flip
    few = [_record(f"p{i}", 3, "near_tie" if i < 1 else "exact") for i in range(40)]
    assert decide(_run(few, rate)).passed
    many = [_record(f"p{i}", 3, "near_tie" if i < 12 else "exact") for i in range(40)]
    d = decide(_run(many, rate))
    assert not d.passed
    exp = flip_expectation(_run(many, rate))
    assert exp.observed == 12 and exp.limit < 12 and exp.expected < 2
    assert any("more than the" in f and "baseline's own numerics explain" in f for f in d.failures), d.failures


def test_exact_ties_have_their_own_budget_and_fail_only_when_bit_exact():
    rate = FlipRate(0.15, positions=400, flips=0, ties=50, measured_positions=1000)
    records = [_record(f"p{i}", 3, "near_tie", tie=True) for i in range(20)]
    run = _run(records, rate)
    assert len(tie_flips(run)) == 20
    assert decide(run).passed  # twenty exact-tie flips, none beyond the numerics: allowed
    assert not decide(run, GatePolicy(bit_exact=True)).passed


def test_max_near_tie_is_an_explicit_fixed_budget_again():
    rate = FlipRate(0.15, positions=400, flips=200, ties=0, measured_positions=1000)
    records = [_record(f"p{i}", 3, "near_tie" if i < 20 else "exact") for i in range(40)]
    assert decide(_run(records, rate)).passed  # half the risky positions flip in the baseline itself
    d = decide(_run(records, rate, GatePolicy(max_near_tie=0.25)))
    assert not d.passed and any("exceed --max-near-tie 25%" in f for f in d.failures), d.failures


def test_a_record_without_a_flip_rate_falls_back_to_the_fixed_share_and_says_so():
    records = [_record(f"p{i}", 3, "near_tie" if i < 20 else "exact") for i in range(40)]
    run = _run(records, None)
    d = decide(run)
    assert not d.passed and any("no flip rate was measured" in f for f in d.failures), d.failures


def test_expected_flips_widen_with_the_rate():
    counts = [3] * 40
    lo = expected_flips(FlipRate(0.1, 400, 4, 0, 1000), counts, 0)
    hi = expected_flips(FlipRate(0.1, 400, 40, 0, 1000), counts, 0)
    assert lo.expected < hi.expected and lo.limit < hi.limit
    assert lo.low <= lo.expected <= lo.high


# ------------------------------------------------------------------ end to end on the tie-dense target
@pytest.fixture(scope="module")
def tie_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("ties") / "target"
    build_tie_model(path)
    return path


@pytest.fixture(scope="module")
def tie_prompts(default_prompts):
    return default_prompts[:10]


def _gate(tie_target, prompts, tie_rule: str | None):
    opts = EngineOptions(target=str(tie_target), spec_mode="draft", dtype="bfloat16")
    engine = LoopEngine(opts, tie_rule=tie_rule)
    try:
        run = run_gate(engine, prompts, GateConfig(calibration="selected", max_new_tokens=24))
    finally:
        engine.close()
    return run, decide(run)


@pytest.mark.slow
def test_a_loop_keeping_the_draft_at_exact_ties_is_reported_as_such_and_passes(tie_target, tie_prompts):
    run, decision = _gate(tie_target, tie_prompts, "draft")
    ties = tie_flips(run)
    assert ties, decision.counts
    assert {v.divergence.spec_break for v in ties} >= {"draft"}
    assert all(v.divergence.baseline_break in ("lower_id", "higher_id") for v in ties)
    assert decision.passed, decision.failures
    lines = near_tie_lines(run, decision)
    assert any(line.startswith("exact ties:") and "the draft token" in line for line in lines), lines
    assert "exact ties:" in "\n".join(terminal_lines(run, decision))


@pytest.mark.slow
def test_a_loop_accepting_drafts_several_ulps_from_the_argmax_fails(tie_target, tie_prompts):
    run, decision = _gate(tie_target, tie_prompts, "close")
    assert not decision.passed
    assert decision.counts["diverged"] >= 1, decision.counts
    threshold = run.threshold.nats
    assert threshold < ACCEPT_CLOSE_NATS
    margins = [r.verdict.divergence.baseline_margin for r in run.records
               if r.verdict.klass == "diverged" and r.verdict.divergence is not None
               and r.verdict.divergence.baseline_margin is not None]
    assert any(m > threshold for m in margins) or any(r.verdict.own_row_rejected for r in run.records), margins


# ------------------------------------------------------------------ non-finite thresholds are refused
@pytest.mark.parametrize("threshold", [float("inf"), float("nan"), -0.1])
def test_check_lossless_refuses_a_threshold_that_is_not_a_finite_number_of_nats(threshold):
    from specparity.api import check_lossless

    with pytest.raises(ValueError, match="finite non-negative number of nats"):
        check_lossless([[1, 2]], [[1, 2]], threshold=threshold, max_new_tokens=2)


@pytest.mark.parametrize("flag,value", [("--near-tie-nats", "nan"), ("--near-tie-nats", "inf"),
                                        ("--near-tie-ceiling", "nan"), ("--near-tie-ceiling", "inf")])
def test_compare_refuses_a_threshold_or_ceiling_that_is_not_finite(tmp_path, flag, value, capsys):
    """One line naming the option, exit 4, before any journal is read (the paths need not exist)."""
    from specparity.cli.commands import main

    code = main(["compare", str(tmp_path / "old"), str(tmp_path / "new"), flag, value])
    err = capsys.readouterr().err
    assert code == 4 and f"{flag} {value}: expected a finite number" in err, err
