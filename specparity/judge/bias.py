"""The decode/prefill bias: the mean signed change of a margin between incremental decode and
teacher-forced scoring of the same tokens.

The near-tie threshold is built from the *size* of these changes (noise, :mod:`specparity.judge.noise`).
Some configurations shift them one way: with an fp8 KV cache, rows decoded against quantised keys and
values drift away from rows prefilled in one pass, systematically and growing with the KV length. A
mean of absolute changes hides the direction; this signed mean shows it, on its own line, without
changing the threshold rule (nothing measured here sets an allowance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from specparity.model.types import TokenScores


@dataclass(frozen=True)
class DecodePrefillBias:
    """``mean``: decode margin − teacher-forced margin, averaged over ``rows`` (nats; positive: decode
    is more confident); ``mean_abs`` the unsigned mean beside it, so a reader sees how much of the
    change is one-sided."""

    mean: float
    mean_abs: float
    rows: int

    def describe(self) -> str:
        return (f"decode/prefill bias: mean signed Δmargin (decode − teacher-forced) {self.mean:+.4g} nats over "
                f"{self.rows} rows (mean |Δ| {self.mean_abs:.4g})")


def _margins(scores: TokenScores) -> np.ndarray:
    top = np.asarray(scores.top_logprobs, np.float64)
    if top.ndim != 2 or top.shape[1] < 2:
        return np.full(len(top), np.nan)
    return top[:, 0] - top[:, 1]


def decode_prefill_bias(pairs: Iterable[tuple[TokenScores, TokenScores]]) -> DecodePrefillBias | None:
    """Over (decode rows, teacher-forced rows of the same tokens) pairs; None when no row has both margins."""
    deltas = []
    for decode, forced in pairs:
        a, b = _margins(decode), _margins(forced)
        n = min(len(a), len(b))
        d = a[:n] - b[:n]
        deltas.append(d[np.isfinite(d)])
    alld = np.concatenate(deltas) if deltas else np.zeros(0)
    if not len(alld):
        return None
    return DecodePrefillBias(float(alld.mean()), float(np.abs(alld).mean()), int(len(alld)))
