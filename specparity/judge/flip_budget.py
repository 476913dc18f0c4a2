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
   budget (:mod:`specparity.judge.resolution`), since greedy decoding allows either tied token. On a
   channel too coarse for a reported tie to be exact (:func:`specparity.judge.resolution.ties_exact`)
   the reported ties are at risk too, and a flip at one counts with the others (``with_ties``).
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

**No allowance without evidence** (:func:`fixed_share_reason`). The budget rests on the high end of the
rate's interval, so a calibration that saw too few positions at risk would allow anything: 0 flips at 0
positions has the interval 0–1, and a budget at a rate of 1 lets every judged prompt with a position at
risk flip (40 of 40 pass). The rate counts as bounded when its Wilson 95 % interval is at most
:data:`MAX_RATE_WIDTH` wide — 0.25, the fixed share itself. Why that number: the budget allows the high
end of the interval, which is the low end (what the calibration showed the target's own numerics do)
plus the width (what it could not rule out). A prompt with one position at risk then flips with a
probability at most ``low + width``: the part the data did not show is at most a quarter, the share of
prompts the fixed budget allows without any data. The least evidence that qualifies is 0 flips at 12
positions at risk (interval 0–0.242; 0 of 11 is 0–0.259); a rate of 0.25 measured on 152 positions (a
real tie-dense bf16 target: 0.185–0.321, 0.136 wide) follows the data, 0.5 flips at 10 positions
(0.005–0.345) does not. Where the rate is not bounded, or no rate was measured, or the threshold was set
by hand (``--near-tie-nats``: the positions at risk are those within the threshold, and the budget rests
on the same measurement as the threshold, which a hand-set threshold replaces), the fixed share
(``DEFAULT_MAX_NEAR_TIE``, 25 % of the judged prompts, ties included) applies and the summary says why.

Pure numpy: no scipy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from specparity.judge.resolution import TIE_NATS, decode_margins  # noqa: F401 - decode_margins: read here too
from specparity.model.gate_run import DEFAULT_MAX_NEAR_TIE
from specparity.model.threshold import FlipRate
from specparity.model.types import TokenScores

#: The quantile of the predicted count above which a run's flips are "clearly more".
FAIL_QUANTILE = 0.99
#: The widest Wilson 95 % interval of the flip rate the budget may rest on (the module docstring says
#: why it is the fixed share's 25 %); a wider one gives the fixed share.
MAX_RATE_WIDTH = DEFAULT_MAX_NEAR_TIE
#: Why the fixed share applies when the threshold was set by hand.
HAND_SET = "the near-tie threshold was set by --near-tie-nats, not measured"
#: Why the fixed share applies when no flip rate was measured (a record made before it existed, or a
#: threshold set with nothing measured).
NO_RATE = "no flip rate was measured"
#: The interval shown: these quantiles under the low and the high rate.
INTERVAL = (0.025, 0.975)


def risk_mask(margins: np.ndarray, window: float, with_ties: bool = False) -> np.ndarray:
    """Which decode margins are at risk: above an exact tie (``with_ties``: or a reported tie, on a
    channel too coarse for it to be exact) and at most ``window``."""
    with np.errstate(invalid="ignore"):
        tied = np.abs(margins) <= TIE_NATS if with_ties else np.zeros(margins.shape, bool)
        return ((margins > TIE_NATS) | tied) & (margins <= window)


def at_risk(scores: TokenScores, window: float, with_ties: bool = False) -> np.ndarray:
    """Mask of the positions at risk of one stream (:func:`risk_mask` of its decode margins)."""
    return risk_mask(decode_margins(scores), window, with_ties)


def tie_positions(scores: TokenScores) -> int:
    """Positions whose decode row ties the chosen token with an alternative."""
    m = decode_margins(scores)
    with np.errstate(invalid="ignore"):
        return int((m <= TIE_NATS).sum())


def measure_flip_rate(pairs: Iterable[tuple[TokenScores, TokenScores]], window: float,
                      with_ties: bool = False) -> FlipRate:
    """:class:`FlipRate` over (decode rows, teacher-forced rows) of the same baseline tokens; ``with_ties``:
    the reported ties are at risk too (:func:`risk_mask`)."""
    positions, flips, ties, measured = 0, 0.0, 0, 0
    for decoded, tf in pairs:
        n = min(len(decoded), len(tf))
        if n == 0:
            continue
        margins = decode_margins(decoded)[:n]
        risk = risk_mask(margins, window, with_ties)
        with np.errstate(invalid="ignore"):
            ties += int((margins <= TIE_NATS).sum())
        measured += n
        tf_margin = decode_margins(tf)[:n]  # the same tokens: the baseline's token over its best rival
        known = risk & np.isfinite(tf_margin)
        positions += int(known.sum())
        flips += float((tf_margin[known] < -TIE_NATS).sum()) + 0.5 * float((np.abs(tf_margin[known]) <= TIE_NATS).sum())
    return FlipRate(window, positions, flips, ties, measured, with_ties)


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

    observed: int  # near-tie flips that are not exact ties (reported ties included where the rate has them)
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

    def counted(self) -> str:
        """"N near-tie flip(s) that are not exact ties", or with the reported ties where the rate had them
        at risk (a channel too coarse for exact ties)."""
        if self.rate is not None and self.rate.with_ties:
            return f"{self.observed} near-tie flip(s), reported ties included"
        return f"{self.observed} near-tie flip(s) that are not exact ties"

    def describe(self) -> str:
        return (f"{self.counted()}, against {self.expected:.1f} expected from "
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


def rate_bounded(rate: FlipRate) -> bool:
    """Whether the calibration bounds the flip rate: its Wilson 95 % interval at most :data:`MAX_RATE_WIDTH` wide."""
    lo, hi = rate.bounds()
    return hi - lo <= MAX_RATE_WIDTH


def unbounded_words(rate: FlipRate) -> str:
    """Why ``rate`` bounds nothing, with its figures."""
    lo, hi = rate.bounds()
    return (f"the calibration saw too few positions at risk to bound the flip rate: {rate.flips:g} flip(s) at "
            f"{rate.positions} position(s) at risk, 95 % interval {lo:.3g}–{hi:.3g}, wider than {MAX_RATE_WIDTH:g}")


def bounded_words(rate: FlipRate) -> str:
    """Why ``rate`` bounds the budget, with its figures."""
    lo, hi = rate.bounds()
    return (f"the calibration bounds the flip rate: {rate.flips:g} flip(s) at {rate.positions} position(s) at risk, "
            f"95 % interval {lo:.3g}–{hi:.3g}, at most {MAX_RATE_WIDTH:g} wide")


def fixed_share_reason(rate: FlipRate | None, source: str) -> str | None:
    """Why the fixed share applies instead of the budget from the data (None: the data's applies): a
    threshold set by hand (``source`` "override"), no flip rate, or a rate the calibration does not bound."""
    if source == "override":
        return HAND_SET
    if rate is None:
        return NO_RATE
    if not rate_bounded(rate):
        return unbounded_words(rate)
    return None
