"""How many near-tie flips the target's own numerics explain: a budget derived from the run itself.

A fixed share of prompts ("25 % may flip") is wrong in both directions: a real bf16 model on one
engine flips on 40 % of prompts at exact ties and single ulps and is healthy, while a fixture with
clear margins should flip on none. The baseline already holds the evidence: every baseline stream
is computed twice by the target — incrementally while decoding, and teacher-forced in one
prefill-style pass, the kind of pass that verifies a draft. Where the two disagree on the argmax,
the target's own numerics flipped a token with no speculation at all.

**The rule** (:func:`expected_flips`):

1. *Positions at risk*: positions of a baseline stream whose decode margin (the chosen token over
   its best alternative) is above an exact tie and at most the near-tie threshold — the positions
   where a flip would be judged a near tie at all. Exact ties are left out: they have their own
   budget (:mod:`specparity.judge.resolution`), since greedy decoding allows either tied token.
2. *Flip rate* ``r``: over the calibration prompts, the share of positions at risk where the
   teacher-forced pass's argmax is another token (a tie there counts one half). Measured on the
   baseline's own instance only: nothing the speculative side computes enters it.
3. *Per prompt*: a prompt with ``n`` positions at risk flips with probability ``1 − (1 − r)^n``
   (positions independent); the number of flipped prompts is a sum of such Bernoulli variables (a
   Poisson-binomial distribution, computed exactly).
4. *Interval and verdict*: ``r`` carries sampling error, so the interval uses the Wilson 95 % bounds
   of ``r``: the low end is the 2.5 % quantile of the count under the low rate, the high end the
   97.5 % quantile under the high rate. The run fails when its non-tie near-tie flips exceed the
   99 % quantile of the count under the high rate (:data:`FAIL_QUANTILE`) — flips clearly more than
   its own numerics explain.

Pure numpy: no scipy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from specparity.judge.resolution import TIE_NATS
from specparity.model.threshold import FlipRate
from specparity.model.types import TokenScores

#: The quantile of the predicted count above which a run's flips are "clearly more".
FAIL_QUANTILE = 0.99
#: The interval shown: these quantiles under the low and the high rate.
INTERVAL = (0.025, 0.975)


def decode_margins(scores: TokenScores) -> np.ndarray:
    """Per position: the chosen token's logprob over its best recorded alternative (NaN: no row)."""
    n = len(scores)
    if n == 0:
        return np.zeros(0, np.float64)
    top = np.where(scores.top_ids >= 0, scores.top_logprobs, -np.inf).astype(np.float64)
    top = np.where(scores.top_ids == scores.token_ids[:, None], -np.inf, top)
    best_alt = top.max(axis=1)
    with np.errstate(invalid="ignore"):
        m = scores.logprobs.astype(np.float64) - best_alt
    return np.where(np.isfinite(m), m, np.nan)


def at_risk(scores: TokenScores, window: float) -> np.ndarray:
    """Mask of the positions at risk: decode margin above an exact tie and at most ``window``."""
    m = decode_margins(scores)
    with np.errstate(invalid="ignore"):
        return (m > TIE_NATS) & (m <= window)


def tie_positions(scores: TokenScores) -> int:
    """Positions whose decode row ties the chosen token with an alternative."""
    m = decode_margins(scores)
    with np.errstate(invalid="ignore"):
        return int((m <= TIE_NATS).sum())


def measure_flip_rate(pairs: Iterable[tuple[TokenScores, TokenScores]], window: float) -> FlipRate:
    """:class:`FlipRate` over (decode rows, teacher-forced rows) of the same baseline tokens."""
    positions, flips, ties, measured = 0, 0.0, 0, 0
    for decoded, tf in pairs:
        n = min(len(decoded), len(tf))
        if n == 0:
            continue
        margins = decode_margins(decoded)[:n]
        with np.errstate(invalid="ignore"):
            risk = (margins > TIE_NATS) & (margins <= window)
            ties += int((margins <= TIE_NATS).sum())
        measured += n
        tf_margin = decode_margins(tf)[:n]  # the same tokens: the baseline's token over its best rival
        known = risk & np.isfinite(tf_margin)
        positions += int(known.sum())
        flips += float((tf_margin[known] < -TIE_NATS).sum()) + 0.5 * float((np.abs(tf_margin[known]) <= TIE_NATS).sum())
    return FlipRate(window, positions, flips, ties, measured)


def poisson_binomial(ps: Sequence[float]) -> np.ndarray:
    """P(K = k) for k = 0..len(ps), K the number of successes of independent Bernoulli(p_i)."""
    dist = np.zeros(len(ps) + 1)
    dist[0] = 1.0
    for i, p in enumerate(ps):
        dist[1:i + 2] = dist[1:i + 2] * (1 - p) + dist[:i + 1] * p
        dist[0] *= 1 - p
    return dist


def quantile(dist: np.ndarray, q: float) -> int:
    """The smallest k with P(K <= k) >= q."""
    return int(np.searchsorted(np.cumsum(dist), q - 1e-12))


@dataclass
class FlipExpectation:
    """The flips the run's own numerics predict, against the flips it has."""

    observed: int  # near-tie flips that are not exact ties
    expected: float
    low: int
    high: int
    limit: int  # more than this fails
    prompts: int  # judged prompts the prediction covers
    at_risk_prompts: int  # ... with at least one position at risk
    rate: FlipRate

    @property
    def passed(self) -> bool:
        return self.observed <= self.limit

    def describe(self) -> str:
        return (f"{self.observed} near-tie flip(s) that are not exact ties, against {self.expected:.1f} expected from "
                f"the baseline's own numerics (95 % interval {self.low}–{self.high}; more than {self.limit} fails) "
                f"over {self.prompts} judged prompt(s), {self.at_risk_prompts} with a position at risk")

    def to_json(self) -> dict[str, Any]:
        return {"observed": self.observed, "expected": self.expected, "low": self.low, "high": self.high,
                "limit": self.limit, "prompts": self.prompts, "at_risk_prompts": self.at_risk_prompts,
                "passed": self.passed}


def expected_flips(rate: FlipRate, risk_counts: Sequence[int], observed: int) -> FlipExpectation:
    """The rule of the module docstring: ``risk_counts`` holds, per judged prompt, its positions at risk."""
    counts = np.asarray(risk_counts, dtype=np.float64)
    r = rate.rate or 0.0
    lo_r, hi_r = rate.bounds()

    def probs(x: float) -> np.ndarray:
        return 1.0 - np.power(1.0 - x, counts)

    mid, lo_p, hi_p = probs(r), probs(lo_r), probs(hi_r)
    low = quantile(poisson_binomial(lo_p), INTERVAL[0])
    high_dist = poisson_binomial(hi_p)
    return FlipExpectation(observed, float(mid.sum()), low, quantile(high_dist, INTERVAL[1]),
                           quantile(high_dist, FAIL_QUANTILE), len(counts), int((counts > 0).sum()), rate)
