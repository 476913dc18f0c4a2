"""The near-tie threshold, measured from the target's own numeric noise.

The threshold is never a guess and never derived from the speculative run (a broken loop would
inflate its own threshold and excuse its own bug). It comes from the *baseline*: the same tokens
scored two ways by the target — incrementally while decoding (single-token kernels), and
teacher-forced in one pass (prefill-style kernels, like a verify pass). What the classifier
thresholds is a *margin*, ``logprob(a) − logprob(b)``, so the noise measured is the noise of
margins: at every position, the margin between the decoded token and each alternative both sides
recorded, compared between the two passes. (Measuring single logprobs instead would add the noise
of the full-vocabulary normaliser, which cancels in a margin.) The largest such |Δmargin| is an
estimate of the true maximum from finitely many samples, hence a headroom multiplier (1.5).

**Where flips live.** The threshold decides one thing: whether a split whose baseline margin is ``m``
is a tie the noise explains. Only a pair whose margin is within the ceiling can ever be judged so,
and the noise of a margin grows with the margin itself: an alternative 10–18 nats below the chosen
token carries the largest absolute rounding, yet can never flip. Measured on the fixtures
(``prompts/default.jsonl``, each prompt's own limit, this machine's CPU): bf16 + fp8 KV (per-tensor
scales) max |Δmargin| 0.44 nats over every pair but 0.19 over the 102 pairs whose margin is under
2 nats, while every flip measured (CPU and H200) had a margin of 0–0.094 nats. So the threshold is
``multiplier`` × the max over the **near pairs** — those whose margin is at most the ceiling on
either side (:attr:`NoiseStats.flip_noise`): fp32 3.3e-5 (all pairs: 5.9e-5), bf16 0.094 (0.47),
bf16 + fp8 KV 0.28 (0.66). A maximum over too few pairs is no estimate: with fewer than
:data:`MIN_NEAR_PAIRS` near pairs the threshold falls back to every pair — the rule before, never
looser — and the summary says so. The all-pairs figure (the tail) stays in the summary.

The **drift bound** stays on every pair: latent drift compares the speculative rows with the
baseline's at every recorded pair, far alternatives included, so its bound must cover the noise of
those pairs too; on the near pairs alone a healthy bf16 loop would be called drifted.

Two more numbers come from the same measurement:

* a **ceiling** on the threshold (default 2 nats, a 7:1 probability ratio, far above any
  dtype's noise here): a larger measurement means the scorer or the target is not fit to judge
  near ties (a scorer off by one position measured 57.85 nats and excused an 8.98-nat bug), so it
  is refused unless the user raises the ceiling on purpose; ``--near-tie-nats`` above it is
  refused too (exit 4 before any model loads) unless ``--near-tie-ceiling`` is raised with it,
  which the summary logs;
* the **drift bound** for latent drift (identical tokens whose speculative rows moved): a loop
  that leaves the target's computation intact stays within the target's own noise (measured on
  the fixtures: at most 1.3 × max |Δmargin| in fp32, 0.9 × in bf16), a loop that corrupts the KV
  cache moves rows by 7–100 000 ×; the bound is 4 × the measured max over every pair (below), and
  it never follows ``--near-tie-nats``.

**Two server instances.** When the baseline and the speculative run are two servers (SGLang, vLLM,
llama.cpp), the comparison also contains whatever differs between the two instances: graph capture,
batch shapes, memory settings. On a live vLLM with CUDA graphs, one baseline server's decode and
teacher-forced rows were bit-identical (noise 0, drift bound at its floor) while two *non-speculative*
servers disagreed by 0.03–0.156 nats (one to a few bf16 logit steps) on 7 of 54 prompts, which were
then called drifted. So for such an engine the baseline's tokens are also scored teacher-forced on
the speculative server — its scoring pass runs the target alone, without the draft — and the
**cross-instance noise** (|Δmargin| of those rows against the baseline's own teacher-forced rows:
prefill against prefill, the same computation on two servers) is a figure of its own, reported
beside the within-instance one. It is measured before any speculative output is seen, on a path
that does not draft, and the scorer check holds that path to the baseline's tokens. But it is still
the speculative server's numerics: a target that computes differently there (another KV cache dtype,
a quantization, a speculative setting that reaches the target's kernels) shows in it too. So it
enters the threshold and the drift bound only up to a cap the speculative side cannot move
(:mod:`specparity.model.cross_instance`), and beyond that it is a finding; the drift bound, whatever
its basis, never exceeds the ceiling. An in-process engine is one instance: there is nothing between
two to measure, and the summary says the figure is not applicable.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from specparity.model.types import TokenScores
from specparity.model.threshold import (DEFAULT_CEILING_NATS, DEFAULT_MULTIPLIER, FLOOR_NATS, MIN_NEAR_PAIRS, ROBUST_RANK,
                                         NearTieThreshold, NoiseStats)

class CalibrationError(ValueError):
    """The measurement cannot be trusted to judge near ties (one line, naming the evidence)."""


#: Why nothing could be measured, and what setting the threshold by hand costs.
NO_NOISE = ("cannot measure the near-tie threshold: no baseline position was scored both ways (every baseline "
            "failed or produced no tokens, or its decode rows and the scorer's rows share no alternative); fix the "
            "baseline's decode or its teacher-forced scoring. --near-tie-nats would set "
            "the threshold without a measurement, but the latent-drift check is then off (identical tokens whose "
            "speculative rows moved are not judged) and the near-tie budget has no flip rate: a warning in the "
            "summary, a failure under --bit-exact or calibration_findings = \"fail\"")


def near_tie_above_ceiling(override: float, ceiling: float) -> str:
    """Why ``--near-tie-nats`` above the ceiling is refused: the ceiling bounds every threshold, set or
    measured, so going above it is a decision the user states with ``--near-tie-ceiling``."""
    return (f"--near-tie-nats {override:g}: above the near-tie ceiling {ceiling:g} nats (a flip that wide is not "
            f"numeric noise); to accept it on purpose, also pass --near-tie-ceiling {override:g} or more")


def _margin_deltas(a: TokenScores, b: TokenScores) -> tuple[np.ndarray, np.ndarray]:
    """|Δmargin| ``[n, k_a, k_b]`` between two scorings of the same tokens, and the mask of the
    (position, alternative) pairs both recorded (:func:`_pair_margins` gives their margins).

    The margin at a position is ``logprob(chosen token) − logprob(alternative)``; the chosen token
    is the same on both sides (both scored the same stream).
    """
    n = min(len(a), len(b))
    a_ids, b_ids = a.top_ids[:n], b.top_ids[:n]
    same = a_ids[:, :, None] == b_ids[:, None, :]  # [n, k_a, k_b]
    margin_a = a.logprobs[:n, None] - a.top_logprobs[:n]  # [n, k_a]
    margin_b = b.logprobs[:n, None] - b.top_logprobs[:n]  # [n, k_b]
    with np.errstate(invalid="ignore"):
        delta = np.abs(margin_a[:, :, None] - margin_b[:, None, :])
    # the chosen token against itself is 0 - 0 on both sides: drop it; so are rows an engine did
    # not report (NaN, id -1: e.g. llama.cpp's draft-accepted or byte-piece tokens)
    not_self = a_ids[:, :, None] != a.token_ids[:n, None, None]
    valid = (a_ids[:, :, None] >= 0) & np.isfinite(delta)
    return delta, same & not_self & valid


def _pair_margins(a: TokenScores, b: TokenScores) -> np.ndarray:
    """``[n, k_a, k_b]``: the smaller |margin| of each pair on the two sides (how close it is to flipping)."""
    n = min(len(a), len(b))
    with np.errstate(invalid="ignore"):
        margin_a = np.abs(a.logprobs[:n, None] - a.top_logprobs[:n])
        margin_b = np.abs(b.logprobs[:n, None] - b.top_logprobs[:n])
        return np.fmin(margin_a[:, :, None], margin_b[:, None, :])


def abs_deltas(decoded: TokenScores, teacher_forced: TokenScores) -> np.ndarray:
    """|Δmargin| for every (position, alternative) pair both passes recorded."""
    return abs_deltas_with_margins(decoded, teacher_forced)[0]


def abs_deltas_with_margins(a: TokenScores, b: TokenScores) -> tuple[np.ndarray, np.ndarray]:
    """:func:`abs_deltas` and, pair by pair, the smaller |margin| of the two sides."""
    if min(len(a), len(b)) == 0:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    delta, mask = _margin_deltas(a, b)
    return delta[mask].astype(np.float32), _pair_margins(a, b)[mask].astype(np.float32)


def position_deltas(a: TokenScores, b: TokenScores) -> np.ndarray:
    """The largest |Δmargin| at each position (NaN where the two share no reported pair)."""
    n = min(len(a), len(b))
    if n == 0:
        return np.zeros(0, np.float32)
    delta, mask = _margin_deltas(a, b)
    worst = np.where(mask, delta, -np.inf).reshape(n, -1).max(axis=1, initial=-np.inf)
    return np.where(np.isfinite(worst), worst, np.nan).astype(np.float32)


def measure_noise(pairs: Iterable[tuple[TokenScores, TokenScores]], window: float | None = None) -> NoiseStats:
    """|Δmargin| over every pair both scorings recorded; with ``window``, also over the pairs whose
    margin is at most ``window`` nats on either side (the pairs that can flip)."""
    chunks, margins, positions = [], [], 0
    for decoded, tf in pairs:
        d, m = abs_deltas_with_margins(decoded, tf)
        chunks.append(d)
        margins.append(m)
        positions += min(len(decoded), len(tf))
    allv = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if allv.size == 0:
        return NoiseStats(0.0, 0.0, positions, 0, window, moved_pairs=0)
    stats = NoiseStats(float(allv.max()), float(np.quantile(allv, 0.99)), positions, int(allv.size), window,
                       robust_abs_delta=robust_figure(allv), moved_pairs=int((allv > FLOOR_NATS).sum()))
    if window is not None:
        near = allv[np.concatenate(margins) <= window]
        stats.near_pairs, stats.near_max_abs_delta = int(near.size), float(near.max()) if near.size else 0.0
        stats.near_robust_abs_delta = robust_figure(near)
    return stats


def robust_figure(values: np.ndarray) -> float:
    """The :data:`ROBUST_RANK`-th largest value, a figure no one or two outlier pairs can set; the
    largest when there are fewer than :data:`MIN_NEAR_PAIRS` values (too few for an order statistic to
    mean more than the maximum: never looser, never tighter than before)."""
    if values.size == 0:
        return 0.0
    if values.size < MIN_NEAR_PAIRS:
        return float(values.max())
    return float(np.partition(values, values.size - ROBUST_RANK)[values.size - ROBUST_RANK])


def derive_threshold(
    noise: NoiseStats | None, override: float | None = None, multiplier: float = DEFAULT_MULTIPLIER,
    ceiling: float = DEFAULT_CEILING_NATS, calibration: str = "", cross: NoiseStats | None = None,
    cross_note: str = "", judged: NoiseStats | None = None,
) -> NearTieThreshold:
    """The near-tie threshold: ``override`` if given, else ``multiplier`` × the measured noise (the
    larger of the noise within the baseline's instance and ``cross``, the noise between the two
    server instances, or ``judged``, the judged side's own noise, as far as the allowance takes each:
    :mod:`specparity.model.cross_instance`), refused (:class:`CalibrationError`) when the measurement
    exceeds ``ceiling``."""
    if override is not None:
        if override < 0:
            raise ValueError(f"--near-tie-nats: expected a non-negative number of nats, got {override}")
        if override > ceiling:
            raise CalibrationError(near_tie_above_ceiling(override, ceiling))
        return NearTieThreshold(float(override), "override", noise, multiplier, ceiling, calibration, cross, cross_note,
                                judged=judged)
    if noise is None or noise.pairs == 0:
        raise ValueError(NO_NOISE)
    measured = NearTieThreshold(0.0, "measured", noise, multiplier, ceiling, calibration, cross, cross_note,
                                judged=judged)
    worst = measured.flip_noise or 0.0
    nats = max(FLOOR_NATS, multiplier * worst)
    if nats > ceiling:
        if worst == noise.flip_noise:
            where = f"between decode and teacher-forced scoring: {noise.describe_flip()}"
        elif cross is not None and cross.pairs and worst == measured.cross_figures()[0].accepted:
            where = f"between the two server instances: {cross.describe_flip()}"
        else:
            where = f"on the judged side: {judged.describe_flip() if judged else ''}"
        raise CalibrationError(
            f"the measured near-tie threshold {nats:.4g} nats ({multiplier:g} × |Δmargin| "
            f"{worst:.4g} {where}) "
            f"exceeds the ceiling {ceiling:g} nats: a flip that large is not numeric noise, so either the scorer "
            f"or the target is not fit to judge near ties; raise --near-tie-ceiling only if this noise is real"
        )
    measured.nats = nats
    return measured
