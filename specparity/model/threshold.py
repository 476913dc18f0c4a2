"""The near-tie threshold a run measured, and the noise statistics behind it: plain data that runs, journals
and reports carry (:mod:`specparity.judge.noise` measures them), with the numbers that define them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from specparity.model.cross_instance import CROSS_INSTANCE, JUDGED_SIDE, CrossFigure, Source, judged_finding

#: Headroom over the margin noise observed in the baseline (its robust figure, :data:`ROBUST_RANK`).
DEFAULT_MULTIPLIER = 1.5


#: The noise figure behind the threshold is the ``ROBUST_RANK``-th largest |Δmargin|, not the largest:
#: one or two outlier pairs cannot set it (on a real bf16 model on SGLang one pair measured 0.75 nats
#: while 99 % of the pairs were under 0.375). The maximum is reported beside it, and the drift bound
#: stays on the maximum.
ROBUST_RANK = 3


#: Below this a threshold or drift bound is float32 resolution, not a measurement: a margin is the
#: difference of two float32 logprobs, each rounded to its own ulp, and top-k logprobs reach −40
#: nats (ulp 3.8e-6), so two computations of the same margin may differ by ~8e-6 even when every
#: logit is bit-identical but one elsewhere in the vocabulary moved the log-sum-exp (measured on the
#: H200: bf16 decode and teacher-forced scoring agreed exactly, noise 0, while the verify pass's rows
#: differed by 1.9e-6 nats; docs/gpu-numerics.md). 1e-6 called that drift.
FLOOR_NATS = 1e-5


#: A measured threshold above this is refused (``--near-tie-ceiling`` raises it on purpose).
DEFAULT_CEILING_NATS = 2.0


#: Latent-drift bound: this many times the largest margin noise measured on the baseline. The bound
#: never exceeds the near-tie ceiling (a row that moved that far is not numeric noise either).
DRIFT_MULTIPLIER = 4.0


#: Fewer small-margin pairs than this and their maximum is no estimate: the threshold then falls
#: back to every pair (today's rule, never looser) and the summary says so. The largest of 50
#: samples exceeds their 95th percentile with probability 0.92; the multiplier adds headroom.
MIN_NEAR_PAIRS = 50


@dataclass
class NoiseStats:
    max_abs_delta: float  # over every pair: the tail figure, and the drift bound's basis
    p99_abs_delta: float
    positions: int
    pairs: int  # (position, token) pairs compared
    #: The pairs that can flip: those whose margin is at most ``near_window`` nats on either side.
    near_window: float | None = None
    near_pairs: int = 0
    near_max_abs_delta: float = 0.0
    #: The :data:`ROBUST_RANK`-th largest |Δmargin| over every pair / over the near pairs (None: a
    #: record made before the robust figure existed, whose threshold came from the maxima).
    robust_abs_delta: float | None = None
    near_robust_abs_delta: float | None = None
    #: Pairs whose |Δmargin| is above float32 resolution (:data:`FLOOR_NATS`): how widespread the
    #: difference is, not only how large (None: a record made before it was counted).
    moved_pairs: int | None = None
    #: Where the largest |Δmargin| was, for a reader to reproduce it ("PROMPT position N"; None: not
    #: located, or a record made before it was).
    largest_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()

    @property
    def near_measured(self) -> bool:
        """Whether enough small-margin pairs were seen to measure the noise where flips live."""
        return self.near_window is not None and self.near_pairs >= MIN_NEAR_PAIRS

    @property
    def flip_noise(self) -> float:
        """The noise the near-tie threshold covers: the robust figure (:data:`ROBUST_RANK`) over the
        small-margin pairs when there are enough of them, else over every pair (never looser than that)."""
        if self.near_measured:
            return self.near_max_abs_delta if self.near_robust_abs_delta is None else self.near_robust_abs_delta
        return self.max_abs_delta if self.robust_abs_delta is None else self.robust_abs_delta

    @staticmethod
    def _robust_words(robust: float | None, top: float) -> str:
        """"3rd-largest X, max Y; " — said only for a figure measured as the robust one."""
        return "" if robust is None else f"{_ordinal(ROBUST_RANK)}-largest {robust:.3g}, max {top:.3g}; "

    def describe_flip(self) -> str:
        """Which pairs :attr:`flip_noise` was taken over, in words, with the maximum beside it."""
        if self.near_measured:
            return (f"{self.flip_noise:.3g} over the {self.near_pairs} pairs whose margin is at most "
                    f"{self.near_window:g} nats ({self._robust_words(self.near_robust_abs_delta, self.near_max_abs_delta)}"
                    f"every pair: {'max ' if self.robust_abs_delta is not None else ''}{self.max_abs_delta:.3g} over "
                    f"{self.pairs})")
        few = (f"only {self.near_pairs} pair(s) with a margin at most {self.near_window:g} nats, fewer than "
               f"{MIN_NEAR_PAIRS}: " if self.near_window is not None else "")
        robust = self._robust_words(self.robust_abs_delta, self.max_abs_delta)
        return f"{self.flip_noise:.3g} over every pair ({few}{self.pairs} pairs, the all-pairs figure{'; ' + robust[:-2] if robust else ''})"


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def wilson(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default; 0..1 for n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class ChannelResolution:
    """How finely the engine's logprob channel reports, measured per run on the reference's own rows
    (:func:`specparity.judge.resolution.measure_resolution`) and journalled with the threshold: whether a
    reported tie is an exact one (:func:`specparity.judge.resolution.ties_exact`)."""

    #: The coarsest decimal step every reported logprob is a whole multiple of (None: none is — the values
    #: are continuous at their float32 precision).
    step: float | None
    #: The logits' spacing (one ulp) read from the rows with a close call (None: the rows show none —
    #: continuous logits — or there was no such row).
    ulp: float | None
    #: Distinct nonzero logprobs the step was tested on (the fewest of the channels read).
    values: int

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "ChannelResolution | None":
        return cls(**data) if data else None


@dataclass
class FlipRate:
    """How often the baseline's two computations of its own tokens (decode, teacher-forced) chose
    different tokens where a flip would be judged a near tie (:mod:`specparity.judge.flip_budget`
    measures it and derives the near-tie budget from it). Journalled with the threshold, so a report
    rebuilt from the journal decides the same."""

    window: float  # the margins at risk: above an exact tie, at most this many nats
    positions: int  # positions at risk
    flips: float  # ... where the teacher-forced argmax was another token (a tie there: 0.5)
    ties: int  # positions whose decode row is an exact tie (their own budget)
    measured_positions: int  # every position compared
    #: Whether the reported ties were at risk too: a channel too coarse for a reported tie to be an exact
    #: one (:class:`ChannelResolution`); False in a record made before the resolution was measured.
    with_ties: bool = False

    @property
    def rate(self) -> float | None:
        return self.flips / self.positions if self.positions else None

    def bounds(self) -> tuple[float, float]:
        """The Wilson 95 % interval of the rate (0..1 when nothing was at risk)."""
        return wilson(self.flips, self.positions)

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "FlipRate | None":
        return cls(**data) if data else None

    def describe(self) -> str:
        lo, hi = self.bounds()
        r = self.rate
        rate = "no position at risk" if r is None else f"{r:.3g} (95 % interval {lo:.3g}–{hi:.3g})"
        which = (f"whose margin is within {self.window:.3g} nats, reported ties included" if self.with_ties else
                 f"whose margin is above a tie and within {self.window:.3g} nats")
        tied = "reported-tie" if self.with_ties else "exact-tie"
        return (f"the baseline's decode and teacher-forced passes chose different tokens at {self.flips:g} of "
                f"{self.positions} positions {which} (flip rate {rate}); {self.ties} {tied} position(s) among "
                f"{self.measured_positions}")


@dataclass
class NearTieThreshold:
    nats: float
    source: Literal["measured", "override"]
    noise: NoiseStats | None
    multiplier: float
    ceiling: float = DEFAULT_CEILING_NATS
    #: Which prompts the noise was measured on, in words (the summary says it).
    calibration: str = ""
    #: The noise between the two server instances (None: not measured; ``cross_note`` says why).
    cross: NoiseStats | None = None
    #: Why the cross-instance noise was not measured ("" when it was).
    cross_note: str = ""
    #: The baseline's own flip rate (None: not measured, or a record made before it existed).
    flip_rate: FlipRate | None = None
    #: The logprob channel's resolution (None: not measured, or a record made before it was: a reported
    #: tie then counts as exact, as it was judged when the record was made).
    resolution: ChannelResolution | None = None
    #: The noise measured on the side being judged, between its own decode and teacher-forced rows
    #: (``specparity compare``, the sweep): it enters the allowance as the cross-instance figure does,
    #: capped and named (None: none, as in a gate run).
    judged: NoiseStats | None = None

    def _measured(self, stats: NoiseStats | None) -> bool:
        return stats is not None and bool(stats.pairs)

    @property
    def tolerance(self) -> float:
        """How far a judged figure may sit above the reference's and still be the same: the channel's step,
        never below float32 resolution (:data:`FLOOR_NATS`)."""
        return max(FLOOR_NATS, (self.resolution.step if self.resolution is not None else None) or 0.0)

    def _figures(self, judged: NoiseStats | None, source: Source) -> list[CrossFigure]:
        if not self._measured(judged):
            return []
        within = self.noise if self._measured(self.noise) else NoiseStats(0.0, 0.0, 0, 0)
        assert judged is not None
        return [CrossFigure("near-tie figure", within.flip_noise, judged.flip_noise, self.tolerance, source),
                CrossFigure("largest over every pair", within.max_abs_delta, judged.max_abs_delta, self.tolerance,
                            source)]

    def cross_figures(self) -> list[CrossFigure]:
        """The threshold's figure and the drift bound's (the largest over every pair), each within the
        baseline's instance and between the two (empty: no cross-instance figure was measured)."""
        return self._figures(self.cross, CROSS_INSTANCE)

    def judged_figures(self) -> list[CrossFigure]:
        """The same two figures, on the reference and on the judged side (empty: none measured there)."""
        return self._figures(self.judged, JUDGED_SIDE)

    def _figure(self, within: float | None, index: int) -> float | None:
        """``within`` or a judged figure as far as the allowance takes it, whichever is larger."""
        taken = [f[index].accepted for f in (self.cross_figures(), self.judged_figures()) if f]
        values = [v for v in (within, *taken) if v is not None]
        return max(values) if values else None

    @property
    def noise_max(self) -> float | None:
        """The largest |Δmargin| over every pair, within one instance or between the two as far as the
        allowance takes it (None: nothing measured): the drift bound's basis."""
        return self._figure(self.noise.max_abs_delta if self._measured(self.noise) else None, 1)

    @property
    def flip_noise(self) -> float | None:
        """The noise the threshold covers: :attr:`NoiseStats.flip_noise`, within one instance or between
        the two as far as the allowance takes it, whichever is larger (None: nothing measured)."""
        return self._figure(self.noise.flip_noise if self._measured(self.noise) else None, 0)

    @property
    def drift_nats(self) -> float | None:
        """The latent-drift bound: from the measured noise only, never above the ceiling (None: nothing
        was measured)."""
        if not self._measured(self.noise):
            return None
        return min(max(FLOOR_NATS, DRIFT_MULTIPLIER * (self.noise_max or 0.0)), max(FLOOR_NATS, self.ceiling))

    @property
    def drift_held(self) -> bool:
        """Whether the drift bound is the ceiling rather than the multiple of the measured noise."""
        return self._measured(self.noise) and DRIFT_MULTIPLIER * (self.noise_max or 0.0) > max(FLOOR_NATS, self.ceiling)

    def _alone(self) -> tuple[float | None, float | None]:
        """The threshold and the drift bound from the reference's own figures alone (None: not measured)."""
        if not self._measured(self.noise):
            return (self.nats if self.source == "override" else None), None
        assert self.noise is not None
        nats = self.nats if self.source == "override" else max(FLOOR_NATS, self.multiplier * self.noise.flip_noise)
        drift = min(max(FLOOR_NATS, DRIFT_MULTIPLIER * self.noise.max_abs_delta), max(FLOOR_NATS, self.ceiling))
        return nats, drift

    def widened(self, base: str) -> str:
        """What the judged figures did to the allowance, in words ("" when nothing moved): the threshold
        and the drift bound, each beside its value from the reference's ``base`` figure alone."""
        nats, drift = self._alone()
        parts = []
        widened = max(FLOOR_NATS, self.multiplier * (self.flip_noise or 0.0))
        if self.source == "measured" and nats is not None and widened > nats:
            parts.append(f"the near-tie threshold {widened:.4g} nats ({nats:.4g} from the {base} figure alone)")
        if drift is not None and self.drift_nats is not None and self.drift_nats > drift:
            parts.append(f"the drift bound {self.drift_nats:.4g} nats ({drift:.4g})")
        return ", ".join(parts)

    def _finding(self, stats: NoiseStats | None, figures: list[CrossFigure], source: Source) -> str | None:
        moved = (f"{stats.moved_pairs} of {stats.pairs} pairs moved {source.moved}"
                 if stats is not None and stats.moved_pairs is not None else "")
        if stats is not None and stats.largest_at:
            moved += f"{', ' if moved else ''}the largest at {stats.largest_at}"
        return judged_finding(figures, moved, self.widened(source.base))

    def cross_finding(self) -> str | None:
        """The speculative server's target computing differently (a cross-instance figure above the
        within-instance one: :func:`specparity.model.cross_instance.judged_finding`), in one line; None
        when it does not."""
        return self._finding(self.cross, self.cross_figures(), CROSS_INSTANCE)

    def judged_finding(self) -> str | None:
        """The judged side's own noise above the reference's, in one line (the same rule); None when it is not."""
        return self._finding(self.judged, self.judged_figures(), JUDGED_SIDE)

    def describe_cross(self) -> str:
        """The cross-instance figure in words, beside the within-instance one (the summary prints it on
        its own line)."""
        if self.cross is None or not self.cross.pairs:
            return self.cross_note or "not measured"
        c = self.cross
        moved = f"; {c.moved_pairs} of {c.pairs} pairs moved" if c.moved_pairs is not None else ""
        moved += f"; the largest at {c.largest_at}" if c.largest_at else ""
        line = (f"max |Δmargin| {c.describe_flip()} between teacher-forced scoring of the baseline's tokens on the "
                f"baseline server and on the speculative server ({c.positions} positions; p99 {c.p99_abs_delta:.3g}"
                f"{moved})")
        if self._measured(self.noise):
            n = self.noise
            assert n is not None
            line += f"; within the baseline's instance: {n.flip_noise:.3g} (every pair: max {n.max_abs_delta:.3g})"
        over = [f for f in self.cross_figures() if f.excess]
        if over:
            line += "; the allowance takes " + ", ".join(f"{f.cap:.3g} of the {f.what}" for f in over)
        return line + (f"; {self.cross_note}" if self.cross_note else "")

    def describe(self) -> str:
        if self.source == "override":
            extra = ""
            if self.noise is not None:
                extra = f" (measured noise for reference: max |Δmargin| {self.noise.max_abs_delta:.3g}"
                if self.cross is not None and self.cross.pairs:
                    extra += f"; between the two server instances {self.cross.max_abs_delta:.3g}"
                if self.judged is not None and self.judged.pairs:
                    extra += f"; on the judged side {self.judged.max_abs_delta:.3g}"
                extra += ")"
            return f"{self.nats:.4g} nats, set by --near-tie-nats{extra}{self._ceiling()}{self._calibrated()}"
        assert self.noise is not None
        n = self.noise
        within = (f"between incremental decode and teacher-forced scoring of the baseline: {n.describe_flip()}, "
                  f"{n.positions} positions, p99 {n.p99_abs_delta:.3g}")
        cross = ""
        for where, stats, figures in (("between the two server instances", self.cross, self.cross_figures()),
                                      ("on the judged side, between its own decode and teacher-forced scoring",
                                       self.judged, self.judged_figures())):
            if stats is not None and stats.pairs:
                cross += f"; {where}: {stats.describe_flip()}"
                if figures[0].excess:
                    cross += f", of which the allowance takes {figures[0].cap:.3g}"
        return (f"{self.nats:.4g} nats, measured: {self.multiplier:g} × |Δmargin| {self.flip_noise:.3g} ({within}"
                f"{cross}); ceiling {self.ceiling:g}{self._calibrated()}")

    def _ceiling(self) -> str:
        """Said when the ceiling was raised: a threshold above the default is a decision, logged."""
        if self.ceiling <= DEFAULT_CEILING_NATS:
            return ""
        return (f"; --near-tie-ceiling raised to {self.ceiling:g} nats on purpose (default {DEFAULT_CEILING_NATS:g})"
                if self.source == "override" else "")

    def _calibrated(self) -> str:
        return f"; calibrated on {self.calibration}" if self.calibration else ""

    def to_json(self) -> dict[str, Any]:
        return {
            "nats": self.nats,
            "source": self.source,
            "multiplier": self.multiplier,
            "noise": self.noise.to_json() if self.noise else None,
            "ceiling": self.ceiling,
            "drift_nats": self.drift_nats,
            "calibration": self.calibration,
            "cross_instance": self.cross.to_json() if self.cross else None,
            "cross_instance_note": self.cross_note,
            "cross_instance_finding": self.cross_finding(),
            "flip_rate": self.flip_rate.to_json() if self.flip_rate else None,
            "resolution": self.resolution.to_json() if self.resolution else None,
            "judged_side": self.judged.to_json() if self.judged else None,
            "judged_side_finding": self.judged_finding(),
            "description": self.describe(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "NearTieThreshold":
        noise, cross = data.get("noise"), data.get("cross_instance")
        return cls(float(data["nats"]), data["source"], NoiseStats(**noise) if noise else None,
                   float(data["multiplier"]), float(data.get("ceiling", DEFAULT_CEILING_NATS)),
                   data.get("calibration", ""), NoiseStats(**cross) if cross else None,
                   data.get("cross_instance_note", ""), FlipRate.from_json(data.get("flip_rate")),
                   ChannelResolution.from_json(data.get("resolution")),
                   NoiseStats(**data["judged_side"]) if data.get("judged_side") else None)
