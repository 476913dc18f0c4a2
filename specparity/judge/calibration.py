"""Is the teacher-forced scorer fit to judge? Checked on the baseline before it judges anything.

Everything the gate concludes about a divergence — the margin at the split, whether later tokens
are the target's argmax — comes from ``score()``. A scorer that is wrong in a systematic way (off
by one position, an easy mistake with prompt logprobs over HTTP; another model; another tokenizer)
does not look broken: it inflates the measured noise, the threshold follows, and real bugs are
classed as near ties. So before the speculative phase the scorer is checked against the tokens it
scored, where the answer is known:

* it must score the tokens it was given (its row ids are the baseline's tokens);
* wherever the baseline's own decode margin (top-1 minus top-2) is clear of any acceptable noise —
  above the ceiling on the threshold — its argmax must be the baseline's token. Honest numeric
  noise cannot move an argmax by more than the noise; a shifted scorer agrees with the *next*
  token instead, and the error says so.

A failed check is a :class:`ScorerRefused` naming the evidence; the run then judges nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from specparity.judge.flip_budget import measure_flip_rate
from specparity.judge.noise import CalibrationError, derive_threshold, measure_noise, position_deltas
from specparity.judge.resolution import measure_resolution, ties_exact
from specparity.model.threshold import DEFAULT_CEILING_NATS, DEFAULT_MULTIPLIER, NearTieThreshold, NoiseStats
from specparity.judge.logprob_channel import channel_problem
from specparity.model.types import TokenScores


class ScorerRefused(CalibrationError):
    """The teacher-forced scorer disagrees with the baseline where no noise can explain it."""


class DegenerateLogprobs(CalibrationError):
    """A side's logprob channel is not a model's log-distribution (:mod:`specparity.judge.logprob_channel`)."""


def require_sound_channels(samples: Sequence["Sample"], scorer: str) -> None:
    """Refuse to calibrate on a degenerate channel: the baseline's decode rows, the scorer's rows, and the
    speculative server's scoring rows where there are some."""
    sides = [("baseline's decode logprobs", [s.decoded for s in samples]),
             (f"teacher-forced scores ({scorer})", [s.teacher_forced for s in samples]),
             (f"teacher-forced scores on the speculative server ({scorer})",
              [s.spec_side for s in samples if s.spec_side is not None])]
    for what, streams in sides:
        problem = channel_problem(streams, what)
        if problem:
            raise DegenerateLogprobs(f"refusing to calibrate: {problem}")


@dataclass
class Sample:
    """One baseline: its tokens, the engine's own rows while decoding, the scorer's rows."""

    prompt_id: str
    output_ids: Sequence[int]
    decoded: TokenScores
    teacher_forced: TokenScores
    #: The same tokens scored teacher-forced on the other server instance (the speculative one's
    #: scoring path, which runs the target alone); None for a one-instance engine.
    spec_side: TokenScores | None = None


@dataclass
class ScorerCheck:
    """What the check saw (recorded in the journal whether it passed or not)."""

    clear_positions: int  # positions whose decode margin exceeds the clear bound
    disagreements: int  # clear positions where the scorer's argmax is another token
    shifted_later: int  # ... where it is the baseline's *next* token instead
    shifted_earlier: int  # ... where it is the baseline's previous token
    wrong_ids: int  # rows whose scored token is not the baseline's token
    clear_nats: float
    first: str | None = None  # the first disagreement, in words

    @property
    def passed(self) -> bool:
        return self.disagreements == 0 and self.wrong_ids == 0

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "passed": self.passed}

    def evidence(self) -> str:
        parts = []
        if self.wrong_ids:
            parts.append(f"{self.wrong_ids} row(s) score a token other than the baseline's")
        if self.disagreements:
            shift = ""
            if max(self.shifted_later, self.shifted_earlier) * 2 > self.disagreements:
                direction = "next" if self.shifted_later >= self.shifted_earlier else "previous"
                n = max(self.shifted_later, self.shifted_earlier)
                shift = f"; at {n} of them its argmax is the baseline's {direction} token: it looks shifted by one position"
            parts.append(
                f"its argmax differs from the baseline's token at {self.disagreements} of {self.clear_positions} "
                f"positions where the baseline's own margin exceeds {self.clear_nats:g} nats{shift}"
            )
        return "; ".join(parts) + (f" (first: {self.first})" if self.first else "")


def _decode_margins(decoded: TokenScores, n: int) -> np.ndarray:
    """Top-1 minus top-2 logprob of the baseline's own decode rows (NaN: not reported)."""
    if decoded.k < 2:
        return np.full(n, np.nan, np.float32)
    top = decoded.top_logprobs[:n]
    return (top[:, 0] - top[:, 1]).astype(np.float32)


def check_scorer(samples: Iterable[Sample], clear_nats: float) -> ScorerCheck:
    """Check a scorer against the baselines it scored (see the module docstring)."""
    check = ScorerCheck(0, 0, 0, 0, 0, clear_nats)
    for s in samples:
        n = min(len(s.output_ids), len(s.decoded), len(s.teacher_forced))
        if n == 0:
            continue
        ids = np.asarray(s.output_ids[:n], np.int64)
        tf = s.teacher_forced
        tf_rows = np.isfinite(tf.logprobs[:n])
        wrong = tf_rows & (tf.token_ids[:n] != ids)
        check.wrong_ids += int(wrong.sum())
        margins = _decode_margins(s.decoded, n)
        with np.errstate(invalid="ignore"):
            clear = tf_rows & np.isfinite(margins) & (margins > clear_nats) & (s.decoded.top_ids[:n, 0] == ids)
        argmax = tf.top_ids[:n, 0]
        bad = clear & (argmax != ids)
        check.clear_positions += int(clear.sum())
        check.disagreements += int(bad.sum())
        later = np.zeros(n, bool)
        later[:-1] = argmax[:-1] == ids[1:]
        earlier = np.zeros(n, bool)
        earlier[1:] = argmax[1:] == ids[:-1]
        check.shifted_later += int((bad & later).sum())
        check.shifted_earlier += int((bad & earlier).sum())
        if check.first is None and (bad.any() or wrong.any()):
            i = int(np.flatnonzero(bad | wrong)[0])
            check.first = (
                f"{s.prompt_id} position {i}: baseline token {int(ids[i])} with decode margin {float(margins[i]):.4g} nats, "
                f"scorer row for token {int(tf.token_ids[i])} with argmax {int(argmax[i])}"
            )
    return check


def require_fit_scorer(samples: Iterable[Sample], clear_nats: float, scorer: str) -> ScorerCheck:
    """:func:`check_scorer`, raising :class:`ScorerRefused` with the evidence when it fails."""
    check = check_scorer(samples, clear_nats)
    if not check.passed:
        raise ScorerRefused(f"teacher-forced scorer refused ({scorer}): {check.evidence()}")
    return check


def cross_instance_noise(samples: Sequence[Sample], window: float | None = None) -> NoiseStats | None:
    """|Δmargin| between the two server instances: the speculative side's teacher-forced rows against the
    baseline's teacher-forced rows — prefill against prefill, the same computation on two servers, so the
    figure holds what differs between the instances and not the decode-versus-prefill noise the
    within-instance figure already measures (None: no sample was scored there)."""
    scored = [s for s in samples if s.spec_side is not None]
    if not scored:
        return None
    stats = measure_noise([(s.teacher_forced, s.spec_side) for s in scored], window)
    stats.largest_at = largest_at(scored)
    return stats


def widest_difference(samples: Sequence[Sample], between: Sequence[str] = ("cross", "within")) -> dict[str, Any] | None:
    """Where two scorings of the same tokens differ most, in the comparisons ``between`` (keys of
    :data:`specparity.model.cross_instance.COMPARISONS`): ``{"prompt_id", "position", "delta_nats", "between"}`` of the largest
    |Δmargin|; of equal ones the first prompt by id, then the first position (None: no position was
    scored twice). A reproducer of a calibration problem sends the two scorings of that spot again."""
    best: tuple[float, str, int, str] | None = None
    for s in sorted(samples, key=lambda s: s.prompt_id):
        pairs = {"cross": (s.teacher_forced, s.spec_side), "within": (s.decoded, s.teacher_forced)}
        for name in between:
            a, b = pairs[name]
            if b is None:
                continue
            deltas = position_deltas(a, b)
            if deltas.size == 0 or not np.isfinite(deltas).any():
                continue
            i = int(np.nanargmax(deltas))
            if best is None or float(deltas[i]) > best[0]:
                best = (float(deltas[i]), s.prompt_id, i, name)
    if best is None:
        return None
    return {"prompt_id": best[1], "position": best[2], "delta_nats": best[0], "between": best[3]}


def largest_at(samples: Sequence[Sample]) -> str | None:
    """"PROMPT position N" of the largest |Δmargin| between a sample's teacher-forced rows on the two
    servers: where a reader reproduces the difference (both servers scoring that prompt's baseline)."""
    best: tuple[float, str, int] | None = None
    for s in samples:
        if s.spec_side is None:
            continue
        per_position = position_deltas(s.teacher_forced, s.spec_side)
        if per_position.size and np.isfinite(per_position).any():
            i = int(np.nanargmax(per_position))
            if best is None or float(per_position[i]) > best[0]:
                best = (float(per_position[i]), s.prompt_id, i)
    return None if best is None else f"{best[1]} position {best[2]}"


def calibrate(
    samples: Sequence[Sample], *, scorer: str, ceiling: float = DEFAULT_CEILING_NATS, override: float | None = None,
    multiplier: float = DEFAULT_MULTIPLIER, label: str = "", cross_note: str = "", judged: Sequence[Sample] = (),
) -> tuple[ScorerCheck, NearTieThreshold]:
    """The one way every caller calibrates (the gate, the invariance checks, the live self-draft probe,
    ``api.measure_threshold``): check the scorer on the baselines, then measure the noise between
    their decode rows and the scorer's and derive the threshold (``override`` if given), refusing a
    measurement above ``ceiling``. Samples scored on the speculative server too (``spec_side``) add the
    cross-instance noise, after the same scorer check on that side; ``cross_note`` says why there is
    none otherwise. ``judged``: baselines of the side being judged (``specparity compare``, the sweep),
    checked as the others are; their own noise is measured apart and enters the allowance only as the
    cross-instance figure does (:mod:`specparity.model.cross_instance`), never the flip rate or the
    resolution. Raises :class:`CalibrationError` (:class:`ScorerRefused` for the scorer), or
    ``ValueError`` when no position was scored both ways."""
    samples, judged = list(samples), list(judged)
    require_sound_channels(samples + judged, scorer)
    check = require_fit_scorer(samples + judged, ceiling, scorer)
    other = [Sample(s.prompt_id, s.output_ids, s.decoded, s.spec_side) for s in samples if s.spec_side is not None]
    if other:
        require_fit_scorer(other, ceiling, f"{scorer}, on the speculative server")
    # the threshold is never above the ceiling, so only pairs within it can be judged near ties:
    # the noise that sets the threshold is measured on them (noise.MIN_NEAR_PAIRS for the fallback)
    noise = measure_noise(((s.decoded, s.teacher_forced) for s in samples), window=ceiling)
    cross = cross_instance_noise(samples, window=ceiling)
    judged_noise = measure_noise(((s.decoded, s.teacher_forced) for s in judged), window=ceiling) if judged else None
    threshold = derive_threshold(noise, override, multiplier, ceiling, label, cross, cross_note, judged=judged_noise)
    # how finely the baseline's channel reports: whether a reported tie is an exact one
    threshold.resolution = measure_resolution([s.decoded for s in samples], [s.teacher_forced for s in samples],
                                              ceiling)
    # the flips the target's own numerics make where a flip would be judged a near tie: measured on
    # the baseline's instance alone (never on the speculative server), for the near-tie budget; the
    # reported ties among them where the channel is too coarse for a tie to be exact
    threshold.flip_rate = measure_flip_rate(((s.decoded, s.teacher_forced) for s in samples), threshold.nats,
                                            with_ties=not ties_exact(threshold.resolution))
    return check, threshold

