"""Is an engine's logprob channel a distribution at all?

Every number the gate judges with — the near-tie threshold, a split's margin, the drift of a speculative
row — is a difference of logprobs the engine reported. A channel that is not a log-distribution makes
those differences meaningless without looking broken: llama.cpp once reported every logprob as 0.0
under speculation (ggml-org/llama.cpp#27972), which reads as "every alternative tied"; raw logits passed
off as logprobs, or a placeholder row repeated everywhere, give margins of any size. Such rows must be
named, never calibrated on or judged with.

Two checks:

* **per stream** (:func:`stream_problem`, every side of every prompt): the reported alternatives of a
  row are exclusive events, so their probabilities sum to at most 1. Beyond
  :data:`SUM_TOLERANCE_NATS` (room for an engine that computes its log-softmax in bf16) the row is not
  a distribution — every reported logprob 0.0 with two or more alternatives is the common case;
* **per channel** (:func:`channel_problem`, the rows one side reported over a whole calibration set):
  every row the same, or every logprob 0.0 when the engine reports one alternative per row. A model's
  rows at different positions of different prompts are never all identical.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specparity.model.types import TokenScores

#: How far above 1 the probabilities of a row's reported alternatives may sum (as a log): a log-softmax
#: computed in bf16 can round a confident token's logprob a little above 0 (e^0.25 ≈ 1.28), while every
#: logprob 0.0 over k ≥ 2 alternatives sums to k (log 2 ≈ 0.69 at least).
SUM_TOLERANCE_NATS = 0.25
#: Rows needed before a whole channel is called constant (or all 0.0 with one alternative per row).
MIN_CHANNEL_ROWS = 32


def _reported(scores: TokenScores) -> tuple[np.ndarray, np.ndarray]:
    """The reported rows' alternatives: their logprobs with unreported entries (id −1, non-finite) at
    −inf, and the row positions."""
    if not len(scores):
        return np.zeros((0, scores.k), np.float64), np.zeros(0, np.int64)
    real = scores.top_ids >= 0
    rows = np.flatnonzero(real.any(axis=1))
    with np.errstate(invalid="ignore"):
        lp = np.where(real & np.isfinite(scores.top_logprobs), scores.top_logprobs, -np.inf).astype(np.float64)
    return lp[rows], rows


def stream_problem(scores: TokenScores, what: str) -> str | None:
    """Why the rows of one stream are not log-probabilities (None: every reported row is)."""
    lp, rows = _reported(scores)
    if not rows.size:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.logaddexp.reduce(lp, axis=1)
    bad = np.flatnonzero(lse > SUM_TOLERANCE_NATS)
    if not bad.size:
        return None
    zeros = bool(np.all(lp[np.isfinite(lp)] == 0.0))
    first = int(rows[bad[0]])
    return (f"the engine's {what} are not log-probabilities: the probabilities of a row's reported alternatives "
            f"sum to more than 1 at {bad.size} of {rows.size} row(s) (first at position {first}: "
            f"{_sum_text(float(lse[bad[0]]))})" + ("; every reported logprob is 0.0" if zeros else "")
            + ": margins taken from them mean nothing")


def _sum_text(lse: float) -> str:
    return f"sum {math.exp(lse):.3g}" if lse < 700 else f"log-sum {lse:.3g}"


def channel_problem(streams: Sequence[TokenScores], what: str) -> str | None:
    """Why the rows one side reported over many streams are degenerate (None: they vary like a model's)."""
    parts = [_reported(s)[0] for s in streams if len(s)]
    parts = [p for p in parts if p.size]
    if not parts or sum(p.shape[0] for p in parts) < MIN_CHANNEL_ROWS:
        return None
    k = min(p.shape[1] for p in parts)
    rows = np.concatenate([p[:, :k] for p in parts])
    finite = np.isfinite(rows)
    if finite.any() and np.all(rows[finite] == 0.0):
        return (f"every logprob the engine reported in its {what} is 0.0 ({rows.shape[0]} rows): no margin or noise "
                f"can be measured on them")
    if np.all(rows == rows[0]):
        return (f"every row of the engine's {what} is the same ({rows.shape[0]} rows, first "
                f"{', '.join(f'{x:.4g}' for x in rows[0][:4])}{', …' if k > 4 else ''}): not a model's logprobs")
    return None
