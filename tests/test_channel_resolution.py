"""A tie is exact only on a channel fine enough to tell one ulp (``specparity/judge/resolution.py``).

An exact tie is "margin 0 at the reported precision", and exact-tie flips are allowed apart from the
near-tie budget. A channel that rounds its logprobs to 1e-3 reports 0 for every margin below about 1e-3,
which would make each such flip a free exact tie. So the calibration measures the channel's step (the
coarsest decimal every reported logprob is a multiple of) and the logits' ulp (the spacing of the rows at
close calls), journals them with the threshold, and a reported tie counts as exact only when the step is
at most half an ulp (float32 logits, which have no spacing: at most 1e-6). On a coarser channel the
reported ties are at risk in the flip rate and count against the budget, and the summary says why.
Constructed rows: no engine.
"""

from __future__ import annotations

import numpy as np
import pytest

from specparity.gate.decision import decide, near_tie_policy
from specparity.judge.calibration import Sample, calibrate
from specparity.judge.resolution import (CHANNEL_STEPS, MIN_CHANNEL_VALUES, TIE_NATS, channel_step, channel_values,
                                         logits_ulp, measure_resolution, resolution_words, tie_bound, ties_exact)
from specparity.model.gate_run import GateConfig, GateRun, PromptRecord
from specparity.model.prompts import Prompt
from specparity.model.threshold import ChannelResolution, NearTieThreshold
from specparity.model.types import GenerationResult, SpecStats, TokenScores
from specparity.model.verdicts import Divergence, TokenView, Verdict
from specparity.report.lines import near_tie_lines

#: Positions per calibration sample and samples: enough close calls for a measured threshold (50 near pairs).
POSITIONS, SAMPLES = 20, 10


def top_rows(ids, values) -> TokenScores:
    """Rows of a top-k: ``values[i]`` are position i's logprobs, its token (``ids[i]``) first, alternatives
    ``ids[i] * 10 + j`` after it; each row sorted as an engine's top-k is."""
    values = np.asarray(values, np.float32)
    n, k = values.shape
    cand = np.concatenate([np.asarray(ids)[:, None], np.asarray(ids)[:, None] * 10 + np.arange(1, k)], 1)
    order = np.argsort(-values, axis=1, kind="stable")
    return TokenScores(np.asarray(ids), values[:, 0], np.take_along_axis(cand, order, 1),
                       np.take_along_axis(values, order, 1))


def continuous_sample(pid: str, rng: np.random.Generator, decimals: int | None) -> Sample:
    """Float32 logits (no spacing): a close alternative 0.003–0.06 nats below the token (every fifth
    position a clear one, 5 nats), a far one 8–9 nats below; the teacher-forced pass puts the close
    alternative up to 0.04 nats further down (no flip). ``decimals``: the channel rounds every logprob."""
    ids = np.arange(POSITIONS) + 100 * int(pid[1:])
    own = -rng.uniform(0.8, 1.5, POSITIONS)
    close = np.where(np.arange(POSITIONS) % 5 == 4, 5.0, rng.uniform(0.003, 0.06, POSITIONS))
    far = 8.0 + rng.uniform(0.0, 1.0, POSITIONS)
    shift = rng.uniform(0.0, 0.04, POSITIONS)
    decode = np.stack([own, own - close, own - far], 1)
    tf = np.stack([own, own - close - shift, own - far], 1)
    if decimals is not None:
        decode, tf = np.round(decode, decimals), np.round(tf, decimals)
    return Sample(pid, ids.tolist(), top_rows(ids, decode), top_rows(ids, tf))


def calibration(decimals: int | None) -> list[Sample]:
    rng = np.random.default_rng(11)
    return [continuous_sample(f"c{i}", rng, decimals) for i in range(SAMPLES)]


def tie_flip(pid: str) -> PromptRecord:
    """A judged prompt that flipped at a reported tie (margin 0), with one more position at risk."""
    margins = [0.0, 0.02] + [5.0] * 8
    ids = np.arange(10)
    rows = top_rows(ids, np.stack([np.full(10, -0.7), -0.7 - np.asarray(margins), np.full(10, -9.0)], 1))
    base = GenerationResult(pid, ids.tolist(), "", "length", rows, SpecStats(True, 4, 2, 2))
    rec = PromptRecord(Prompt(pid, "c", "en", prompt="x"), baseline=base, spec=base)
    rec.verdict = Verdict(pid, "c", "near_tie", "", divergence=Divergence(
        0, TokenView(0, "a"), TokenView(1, "b"), 0.0, 1, 0.0, 1, "", "", "", None, tie=True,
        baseline_break="lower_id", spec_break="draft"))
    return rec


def judged_ties(threshold: NearTieThreshold, n: int = 20) -> GateRun:
    run = GateRun(None, GateConfig(), [tie_flip(f"p{i}") for i in range(n)])
    run.threshold = threshold
    return run


# ------------------------------------------------------------------ the step, the ulp and the rule


@pytest.mark.parametrize("decimals, step", [(0, 1.0), (1, 0.1), (2, 0.01), (3, 1e-3), (4, 1e-4), (5, 1e-5), (6, 1e-6),
                                            (None, None)])
def test_the_step_is_the_coarsest_decimal_every_logprob_lies_on(decimals, step):
    rows = [s.decoded for s in calibration(decimals)]
    values = channel_values(rows)
    assert np.all(values != 0) and np.unique(values).size == values.size
    assert values.size >= MIN_CHANNEL_VALUES or decimals == 0  # whole nats: only a few distinct values
    assert channel_step(values) == step


def test_the_numbers_of_the_rule():
    assert CHANNEL_STEPS == (1.0, 0.1, 0.01, 1e-3, 1e-4, 1e-5, 1e-6)
    assert MIN_CHANNEL_VALUES == 16 and 0.1 ** MIN_CHANNEL_VALUES == pytest.approx(1e-16)  # a coarser grid by chance
    assert tie_bound(ChannelResolution(None, 1.0, 99)) == 0.5


def test_channel_values_leave_out_zeros_unreported_slots_and_repeats():
    rows = TokenScores([1, 2], [0.0, -0.5], [[1, 7], [2, -1]], [[0.0, -0.5], [-0.5, np.nan]])
    assert channel_values([rows]).tolist() == [-0.5]
    assert channel_values([]).size == 0 and channel_step(np.zeros(0)) == CHANNEL_STEPS[0]


def test_channel_values_read_every_stream_and_token_id_0():
    """An empty stream is passed over, not the end of the reading; token id 0 is a real token (-1 is an empty
    slot)."""
    empty = TokenScores([], [], np.zeros((0, 2), int), np.zeros((0, 2), np.float32))
    first = TokenScores([5], [-0.25], [[5, 0]], [[-0.25, -1.5]])
    later = TokenScores([6], [-0.75], [[6, -1]], [[-0.75, -9.0]])
    assert channel_values([first, empty, later]).tolist() == [-1.5, -0.75, -0.25]


def test_the_ulp_is_the_lower_middle_of_every_streams_close_calls():
    """The close-call rows of every stream count (a later stream does not replace an earlier one's), and the
    middle of an even count is the lower of the two middle values, not their mean."""
    rng = np.random.default_rng(5)
    ulps = logits_ulp([bf16_rows(rng, 3), *[s.decoded for s in calibration(None)[:1]]], 2.0)
    assert ulps is None  # the continuous stream's close calls outnumber the bf16 rows: no spacing
    fine = bf16_rows(rng, 2)
    coarse = top_rows(np.arange(2), 20.0 + np.stack([np.zeros(2), -np.full(2, 0.25), -0.25 * rng.integers(2, 12, 2),
                                                   -0.25 * rng.integers(12, 30, 2)], 1) - 21.5)
    assert logits_ulp([fine, coarse], 2.0) == 0.125 and logits_ulp([coarse, fine], 2.0) == 0.125


def test_the_resolution_carries_the_logits_ulp():
    rng = np.random.default_rng(3)
    rows = bf16_rows(rng)
    assert measure_resolution([rows], [rows], 2.0).ulp == 0.125


def bf16_rows(rng: np.random.Generator, n: int = 30) -> TokenScores:
    """Logits on the bf16 spacing of magnitude 16–32 (0.125), log-softmaxed in float32 by a continuous
    normaliser: within a row every difference is a whole number of ulps, one of them odd."""
    ids = np.arange(n)
    logits = 20.0 + np.stack([np.zeros(n), -np.full(n, 0.125), -0.125 * rng.integers(2, 12, n),
                              -0.125 * rng.integers(12, 30, n)], 1)
    lse = 21.0 + rng.uniform(0.0, 1.0, n)
    return top_rows(ids, logits - lse[:, None])


def test_the_ulp_is_read_from_the_rows_at_close_calls_and_continuous_logits_have_none():
    rng = np.random.default_rng(3)
    assert logits_ulp([bf16_rows(rng)], 2.0) == 0.125
    assert logits_ulp([s.decoded for s in calibration(None)], 2.0) is None
    assert logits_ulp([bf16_rows(rng)], 0.0) is None  # no row with a close call within the window
    # a spacing shown by fewer than half of the close-call rows is no spacing
    mixed = [bf16_rows(rng, 14), *[s.decoded for s in calibration(None)[:1]]]
    assert logits_ulp(mixed, 2.0) is None


def test_a_tie_is_exact_at_a_step_of_at_most_half_an_ulp():
    half = ChannelResolution(0.0625, 0.125, MIN_CHANNEL_VALUES)
    assert tie_bound(half) == 0.0625 and ties_exact(half)
    assert not ties_exact(ChannelResolution(float(np.nextafter(0.0625, 1)), 0.125, MIN_CHANNEL_VALUES))
    assert ties_exact(ChannelResolution(1e-3, 0.125, MIN_CHANNEL_VALUES))  # bf16 logits: 1e-3 hides no ulp
    # continuous logits: only a channel as fine as the tie itself
    assert tie_bound(ChannelResolution(1e-6, None, 99)) == TIE_NATS
    assert ties_exact(ChannelResolution(1e-6, None, 99)) and not ties_exact(ChannelResolution(1e-5, None, 99))
    assert ties_exact(ChannelResolution(None, None, 99))  # continuous values
    # too few values to tell: not known to be exact; a record without the figure: judged as it was
    assert not ties_exact(ChannelResolution(None, None, MIN_CHANNEL_VALUES - 1))
    assert ties_exact(None)


def test_the_words_name_the_step_the_ulp_and_what_a_reported_tie_is():
    assert resolution_words(ChannelResolution(1e-3, None, 400)) == (
        "the logprobs are reported in steps of 0.001 nats and the logits show no spacing (continuous): a step above "
        "1e-06 nats can hide a real margin, so a reported tie is not exact")
    assert resolution_words(ChannelResolution(None, 0.125, 400)) == (
        "the logprobs lie on no decimal step (continuous) and one ulp of the logits is 0.125 nats: a reported tie is "
        "exact")
    assert resolution_words(ChannelResolution(None, None, 3)) == (
        f"the channel's resolution is unknown: 3 distinct nonzero logprob(s) reported, fewer than "
        f"{MIN_CHANNEL_VALUES}, so a reported tie is not known to be exact")


def test_a_value_is_on_a_step_as_the_float32_it_is_stored_as():
    """A logprob written on a 1e-4 step and read back through float64 arithmetic is judged as the float32 it
    is held as: a float64 value a hair off that float32 still lies on the step."""
    from specparity.judge.resolution import on_step

    held = float(np.float32(-0.1234))
    assert on_step(np.array([held + 1e-12]), 1e-4)
    assert on_step(np.array([held]), 1e-4) and not on_step(np.array([held + 1e-6]), 1e-4)


def test_the_fewest_values_that_measure_a_channel_are_enough_for_the_words():
    at = resolution_words(ChannelResolution(None, 0.125, MIN_CHANNEL_VALUES))
    assert at.endswith("a reported tie is exact") and "unknown" not in at, at
    assert "the channel's resolution is unknown" in resolution_words(ChannelResolution(None, 0.125,
                                                                                       MIN_CHANNEL_VALUES - 1))


def test_the_coarser_channel_decides_and_the_fewest_values_count():
    fine = [s.decoded for s in calibration(None)]
    coarse = [s.teacher_forced for s in calibration(3)]
    res = measure_resolution(fine, coarse, 2.0)
    assert res.step == 1e-3 and res.ulp is None
    assert res.values == min(channel_values(fine).size, channel_values(coarse).size)
    assert measure_resolution(fine, [], 2.0).step is None
    assert measure_resolution([], [], 2.0) == ChannelResolution(None, None, 0)


# ------------------------------------------------------------------ the calibration and the budget


def test_a_channel_rounded_to_a_thousandth_makes_reported_ties_count_against_the_budget():
    """20 prompts flip at reported ties. On the float32 channel they are exact ties, allowed apart; on
    the same logprobs rounded to 1e-3 a reported tie may hide a margin below 1e-3 nats, so the flips
    count against the budget, which the calibration's flip rate (0 of its positions at risk) does not
    allow."""
    _c, fine = calibrate(calibration(None), scorer="test")
    assert fine.resolution.step is None and ties_exact(fine.resolution)
    assert decide(judged_ties(fine)).passed

    _c, coarse = calibrate(calibration(3), scorer="test")
    assert coarse.resolution == ChannelResolution(1e-3, None, coarse.resolution.values)
    assert coarse.resolution.values >= MIN_CHANNEL_VALUES and not ties_exact(coarse.resolution)
    rate = coarse.flip_rate
    assert rate.with_ties and rate.flips == 0 and rate.positions >= 12
    run = judged_ties(coarse)
    decision = decide(run)
    assert not decision.passed
    why = resolution_words(coarse.resolution)
    assert decision.flip_expectation.observed == 20 and decision.flip_expectation.limit < 20
    assert decision.near_tie_budget.text.startswith(f"20 flip(s) at reported ties, counted with the others ({why}); "
                                                    f"20 near-tie flip(s), reported ties included, against ")
    assert any(f.startswith("20 near-tie flip(s), reported ties included, more than the ") for f in decision.failures)
    assert f"{why})" in near_tie_policy(run) and "every flip, reported ties included" in near_tie_policy(run)
    lines = near_tie_lines(run, decision)
    assert lines[0].startswith(f"reported ties: 20 flip(s) at a margin of 0 at the channel's resolution, not exact "
                               f"ties and counted with the other flips ({why}) — the speculative run took ")
    # the journal keeps the resolution with the threshold, and a threshold read back decides the same
    data = coarse.to_json()
    assert data["resolution"] == {"step": 1e-3, "ulp": None, "values": coarse.resolution.values}
    assert data["flip_rate"]["with_ties"] is True
    again = NearTieThreshold.from_json(data)
    assert again == coarse and decide(judged_ties(again)).failures == decision.failures


def test_a_record_made_before_the_resolution_was_measured_judges_its_ties_as_it_did():
    _c, coarse = calibrate(calibration(3), scorer="test")
    data = coarse.to_json()
    del data["resolution"]
    del data["flip_rate"]["with_ties"]
    old = NearTieThreshold.from_json(data)
    assert old.resolution is None and not old.flip_rate.with_ties
    decision = decide(judged_ties(old))
    assert decision.passed and decision.flip_expectation.observed == 0
    assert near_tie_lines(judged_ties(old), decision)[0].startswith("exact ties: 20 flip(s)")


def test_a_coarse_channel_under_the_fixed_share_counts_the_reported_ties_too():
    """A threshold set by hand: the fixed share, and on the rounded channel the reported ties are in it."""
    _c, by_hand = calibrate(calibration(3), scorer="test", override=0.06)
    run = judged_ties(by_hand, 4)
    run.records += [PromptRecord(Prompt(f"e{i}", "c", "en", prompt="x"), verdict=Verdict(f"e{i}", "c", "exact", ""))
                    for i in range(6)]
    decision = decide(run)
    why = resolution_words(by_hand.resolution)
    assert decision.near_tie_budget.text == (
        f"near-tie flips, reported ties included, are allowed up to 25% of the prompts (the near-tie threshold was "
        f"set by --near-tie-nats, not measured; {why}): this run has 4 of 10 judged (40%)")
    assert decision.near_tie_failure == (
        "4/10 near-tie prompts, reported ties included, (40%) exceed the fixed share 25% (the near-tie threshold was "
        "set by --near-tie-nats, not measured): p0, p1, p2, p3")
    _c, fine_by_hand = calibrate(calibration(None), scorer="test", override=0.06)
    run.threshold = fine_by_hand
    assert decide(run).passed  # the same flips are exact ties on the float32 channel
