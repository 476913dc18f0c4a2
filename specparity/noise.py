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

Measured on the fixtures (``prompts/default.jsonl``, 1,024 positions): fp32 max |Δmargin|
≈ 4e-5 nats; bf16 ≈ 0.31 nats (one to two bf16 steps of logits around 16–32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import numpy as np

from specparity.types import TokenScores

#: Headroom over the largest margin noise observed in the baseline.
DEFAULT_MULTIPLIER = 1.5
#: Below this the threshold is float32 resolution of a logprob near 0, not a measurement.
FLOOR_NATS = 1e-6


@dataclass
class NoiseStats:
    max_abs_delta: float
    p99_abs_delta: float
    positions: int
    pairs: int  # (position, token) pairs compared

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass
class NearTieThreshold:
    nats: float
    source: Literal["measured", "override"]
    noise: NoiseStats | None
    multiplier: float

    def describe(self) -> str:
        if self.source == "override":
            extra = ""
            if self.noise is not None:
                extra = f" (measured noise for reference: max |Δmargin| {self.noise.max_abs_delta:.3g})"
            return f"{self.nats:.4g} nats, set by --near-tie-nats{extra}"
        assert self.noise is not None
        return (
            f"{self.nats:.4g} nats, measured: {self.multiplier:g} × max |Δmargin| "
            f"{self.noise.max_abs_delta:.3g} between incremental decode and teacher-forced scoring "
            f"of the baseline ({self.noise.pairs} token pairs over {self.noise.positions} positions; "
            f"p99 {self.noise.p99_abs_delta:.3g})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "nats": self.nats,
            "source": self.source,
            "multiplier": self.multiplier,
            "noise": self.noise.to_json() if self.noise else None,
            "description": self.describe(),
        }


def abs_deltas(decoded: TokenScores, teacher_forced: TokenScores) -> np.ndarray:
    """|Δmargin| for every (position, alternative) pair both passes recorded.

    The margin at a position is ``logprob(decoded token) − logprob(alternative)``; the decoded
    token is the same in both passes (teacher forcing scores exactly the decoded tokens).
    """
    n = min(len(decoded), len(teacher_forced))
    if n == 0:
        return np.zeros(0, np.float32)
    a_ids, b_ids = decoded.top_ids[:n], teacher_forced.top_ids[:n]
    same = a_ids[:, :, None] == b_ids[:, None, :]  # [n, k_a, k_b]
    margin_a = decoded.logprobs[:n, None] - decoded.top_logprobs[:n]  # [n, k_a]
    margin_b = teacher_forced.logprobs[:n, None] - teacher_forced.top_logprobs[:n]  # [n, k_b]
    delta = np.abs(margin_a[:, :, None] - margin_b[:, None, :])
    # the decoded token against itself is 0 - 0 on both sides: drop it; so are rows an engine did
    # not report (NaN, id -1: e.g. llama.cpp's draft-accepted or byte-piece tokens)
    not_self = a_ids[:, :, None] != decoded.token_ids[:n, None, None]
    valid = (a_ids[:, :, None] >= 0) & np.isfinite(delta)
    return delta[same & not_self & valid].astype(np.float32)


def measure_noise(pairs: Iterable[tuple[TokenScores, TokenScores]]) -> NoiseStats:
    chunks, positions = [], 0
    for decoded, tf in pairs:
        chunks.append(abs_deltas(decoded, tf))
        positions += min(len(decoded), len(tf))
    allv = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if allv.size == 0:
        return NoiseStats(0.0, 0.0, positions, 0)
    return NoiseStats(float(allv.max()), float(np.quantile(allv, 0.99)), positions, int(allv.size))


def derive_threshold(
    noise: NoiseStats | None, override: float | None = None, multiplier: float = DEFAULT_MULTIPLIER
) -> NearTieThreshold:
    if override is not None:
        if override < 0:
            raise ValueError(f"--near-tie-nats: expected a non-negative number of nats, got {override}")
        return NearTieThreshold(float(override), "override", noise, multiplier)
    if noise is None or noise.pairs == 0:
        raise ValueError(
            "cannot measure the near-tie threshold: no baseline positions were scored "
            "(every baseline failed or produced no tokens); pass --near-tie-nats to set it"
        )
    return NearTieThreshold(max(FLOOR_NATS, multiplier * noise.max_abs_delta), "measured", noise, multiplier)
