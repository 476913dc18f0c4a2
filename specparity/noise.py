"""The near-tie threshold, measured from the target's own numeric noise.

The threshold is never a guess and never derived from the speculative run (a broken loop would
inflate its own threshold and excuse its own bug). It comes from the *baseline*: the same tokens
scored two ways by the target — incrementally while decoding, and teacher-forced in one pass. The
largest |Δlogprob| between the two over every alternative both sides recorded is the noise of one
logprob; a margin between two tokens carries the noise of two, hence the default multiplier 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import numpy as np

from specparity.types import TokenScores

#: A margin is a difference of two noisy logprobs.
DEFAULT_MULTIPLIER = 2.0
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
                extra = f" (measured noise for reference: max |Δlogprob| {self.noise.max_abs_delta:.3g})"
            return f"{self.nats:.4g} nats, set by --near-tie-nats{extra}"
        assert self.noise is not None
        return (
            f"{self.nats:.4g} nats, measured: {self.multiplier:g} × max |Δlogprob| "
            f"{self.noise.max_abs_delta:.3g} between incremental decode and teacher-forced scoring "
            f"of the baseline ({self.noise.pairs} token/position pairs over {self.noise.positions} positions; "
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
    """|Δlogprob| for every token present in both top-k lists at the same position."""
    n = min(len(decoded), len(teacher_forced))
    if n == 0:
        return np.zeros(0, np.float32)
    a_ids, b_ids = decoded.top_ids[:n], teacher_forced.top_ids[:n]
    same = a_ids[:, :, None] == b_ids[:, None, :]
    delta = np.abs(decoded.top_logprobs[:n, :, None] - teacher_forced.top_logprobs[:n, None, :])
    return delta[same].astype(np.float32)


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
