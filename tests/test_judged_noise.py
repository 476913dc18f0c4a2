"""Nothing measured on the side being judged widens its allowance without a word.

``specparity compare`` and the concurrency sweep judge one recorded run (NEW: a golden's or a journal's
stream, a level's speculative output) against another (OLD, the reference). Both carry baselines scored
twice (decode, teacher-forced), and the noise between the two is what the threshold and the drift bound
cover. The reference's samples calibrate: its noise, its flip rate, its channel's resolution. The judged
side's noise is measured apart and enters the allowance only as the cross-instance figure of a gate run
does — up to the cap the reference sets (the larger of 0.25 nats and twice its own figure), and named as
a finding with both figures whenever it widens the allowance, inside the cap or beyond it
(:func:`specparity.model.cross_instance.judged_finding`, one rule for both).
Constructed sides (:func:`specparity.run.sides.judge_sides`, the function both commands call): no
engine, no journal.
"""

from __future__ import annotations

import numpy as np

from specparity.run.sides import Side, judge_sides
from specparity.judge.calibration import Sample
from specparity.judge.resolution import measure_resolution
from specparity.model.cross_instance import CROSS_INSTANCE_NATS
from specparity.model.gate_run import GatePolicy
from specparity.model.prompts import Prompt
from specparity.model.threshold import DRIFT_MULTIPLIER, FLOOR_NATS
from specparity.model.types import GenerationResult, SpecStats, TokenScores

N, PROMPTS = 20, 5


def rows(start: int, shift: float = 0.0, close: int = 0, flipped: bool = False) -> TokenScores:
    """``N`` rows: the token (id ``start + i``) at a logprob that moves from row to row, a near alternative
    1 nat below it (every fourth row 3 nats: a clear position for the scorer check) and a far one 6 nats
    below, both moved down by ``shift``. The first ``close`` rows are close calls instead: the alternative
    0.125 nats below the token, or with ``flipped`` 0.125 above it (the scorer's argmax is another token)."""
    i = np.arange(N)
    ids = start + i
    own = -1.0 - (i % 32) / 64
    near = np.where(i % 4 == 3, 3.0, 1.0)
    near[:close] = -0.125 if flipped else 0.125
    top_ids = np.stack([ids, ids + 1000, ids + 2000], 1)
    top_lp = np.stack([own, own - near - shift, own - 6.0 - shift], 1)
    order = np.argsort(-top_lp, axis=1, kind="stable")
    return TokenScores(ids, own, np.take_along_axis(top_ids, order, 1), np.take_along_axis(top_lp, order, 1))


def side(label: str, shift: float, close: int = 0, flipped: bool = False) -> Side:
    """A recorded run of ``PROMPTS`` prompts whose teacher-forced rows move every alternative by ``shift``
    against its decode rows (0: the two agree bit for bit; ``flipped``: its close calls flip there); its
    streams are the decode rows' tokens."""
    samples, streams = [], {}
    for k in range(PROMPTS):
        pid = f"p{k}"
        decoded, tf = rows(100 * k, close=close), rows(100 * k, shift, close, flipped)
        samples.append(Sample(pid, decoded.token_ids.tolist(), decoded, tf))
        result = GenerationResult(pid, decoded.token_ids.tolist(), "", "length", decoded, SpecStats.unavailable("t"))
        streams[pid] = (Prompt(pid, "c", "en", prompt="x"), result, tf, N)
    return Side(label, None, streams, samples, speculative=False)


def judged_finding(figure: float, taken: float, widened: str) -> str:
    return (f"the judged side's own two computations of its tokens differ more than the reference's: judged-side "
            f"{figure:.3g} nats vs reference 0 (near-tie figure; the allowance takes {taken:.3g}), {figure:.3g} vs 0 "
            f"(largest over every pair; {taken:.3g}); {N * PROMPTS * 2} of {N * PROMPTS * 2} pairs moved between the "
            f"judged side's decode and its teacher-forced scoring. A figure measured on the judged side widened the "
            f"allowance it is judged against: {widened}. The threshold and the drift bound take the judged-side noise "
            f"only up to the larger of 0.25 nats and 2 × the reference figure; compare what decides the two runs' "
            f"numerics (dtype, quantization, KV cache dtype, attention backend, tensor-parallel size, batch shapes)")


def test_the_judged_sides_noise_is_capped_and_named_not_taken_whole():
    """OLD's baselines agree with their own scoring bit for bit; NEW's differ by 0.375 nats in every pair.
    Before, both sides' samples were pooled: the threshold became 0.5625 and the drift bound 1.5 without a
    word. Now OLD calibrates, NEW's figure enters only up to the cap 0.25, and the finding names both."""
    run, decision = judge_sides(side("OLD", 0.0), side("NEW", 0.375), "old")
    th = run.threshold
    assert th.noise.max_abs_delta == 0.0 and th.judged.max_abs_delta == th.judged.flip_noise == 0.375
    assert th.nats == 1.5 * CROSS_INSTANCE_NATS and th.drift_nats == DRIFT_MULTIPLIER * CROSS_INSTANCE_NATS
    finding = judged_finding(0.375, 0.25, f"the near-tie threshold 0.375 nats ({FLOOR_NATS:g} from the reference "
                                        f"figure alone), the drift bound 1 nats ({FLOOR_NATS:g})")
    assert th.judged_finding() == finding
    assert f"finding: {finding}" in decision.warnings and decision.passed
    strict = judge_sides(side("OLD", 0.0), side("NEW", 0.375), "old", bit_exact=True)[1]
    assert f"finding: {finding} — a failure under --bit-exact (or near_tie in the policy's fail_on)" in strict.failures


def test_inside_the_cap_the_judged_sides_noise_still_widens_nothing_silently():
    run, decision = judge_sides(side("OLD", 0.0), side("NEW", 0.125), "old")
    th = run.threshold
    assert th.nats == 1.5 * 0.125 and th.drift_nats == DRIFT_MULTIPLIER * 0.125
    assert not any(f.excess for f in th.judged_figures())
    finding = judged_finding(0.125, 0.125, f"the near-tie threshold 0.1875 nats ({FLOOR_NATS:g} from the reference "
                                           f"figure alone), the drift bound 0.5 nats ({FLOOR_NATS:g})")
    assert f"finding: {finding}" in decision.warnings
    # the same noise on the reference's side is the reference's own: it calibrates, and nothing is found
    run, decision = judge_sides(side("OLD", 0.125), side("NEW", 0.125), "old")
    assert run.threshold.nats == 1.5 * 0.125 and run.threshold.judged_finding() is None
    assert not [w for w in decision.warnings if w.startswith("finding:")]


def test_the_flip_rate_and_the_resolution_come_from_the_reference_alone():
    """Both sides have two close calls per prompt; NEW's scorer flips them, OLD's holds them. The flip rate
    the budget follows is the reference's: 0 of OLD's 10 positions at risk (pooled: 10 flips of 20). Taken
    the other way round, NEW is the reference and its own flips count."""
    old, new = side("OLD", 0.0, close=2), side("NEW", 0.0, close=2, flipped=True)
    run, _decision = judge_sides(old, new, "old")
    assert (run.threshold.flip_rate.positions, run.threshold.flip_rate.flips) == (2 * PROMPTS, 0.0)
    assert run.threshold.resolution == measure_resolution([s.decoded for s in old.samples],
                                                          [s.teacher_forced for s in old.samples], 2.0)
    swapped, _ = judge_sides(new, old, "new")
    assert (swapped.threshold.flip_rate.positions, swapped.threshold.flip_rate.flips) == (2 * PROMPTS, 2 * PROMPTS)


def test_a_hand_set_threshold_keeps_the_judged_sides_figure_apart_from_the_drift_bound():
    run, decision = judge_sides(side("OLD", 0.0), side("NEW", 0.375), "old", near_tie_nats=0.5)
    th = run.threshold
    assert th.source == "override" and th.nats == 0.5 and th.drift_nats == DRIFT_MULTIPLIER * CROSS_INSTANCE_NATS
    assert th.judged_finding() == judged_finding(0.375, 0.25, f"the drift bound 1 nats ({FLOOR_NATS:g})")
    assert decision.passed and GatePolicy().calibration_findings != "fail"
