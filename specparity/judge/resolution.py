"""Exact ties and margins in ulps: what a flip's margin means at the precision the engine computed.

A real bf16 model flips at margins such as 0.0, 0.0625 or 0.125 nats. Those numbers are not
arbitrary: the logits are bf16 values, so every difference of two logits in one row is a whole
multiple of the bf16 spacing (the *ulp*) at the logits' magnitude — 0.125 nats for logits between
16 and 32. A margin of 0 is an **exact tie**: both tokens are the row's argmax, and greedy decoding
allows either. A margin of one ulp is the smallest difference the computation can express. Saying
"0.125 nats" hides that; "one ulp" is the honest description.

The resolution is read from the rows themselves, never assumed from a dtype: a row's *quantum* is
the largest power of two of which every difference between its reported logprobs is a whole
multiple (a log-softmax subtracts the same normaliser from every logit of the row, so differences
of logprobs are differences of logits up to float32 rounding). Rows of float32 logits have no such
quantum at any useful size (:data:`QUANTA`), and their margins are given in nats alone.

**The channel's resolution** (:func:`measure_resolution`, per run, journalled with the threshold). A
tie is "margin 0 at the reported precision" (:data:`TIE_NATS`), so it is only as exact as the channel
the engine reports through: one that rounds logprobs to 1e-3 reports 0 for every margin below about
1e-3, and would turn each such flip into a free exact tie. Two figures are read from the reference's
rows: the channel's **step**, the coarsest of :data:`CHANNEL_STEPS` (whole decimals, what an engine or
an API that prints k decimals gives) of which every reported logprob is a whole multiple within its
own float32 spacing (None: none is, the values are continuous); and the logits' **ulp**, the spacing
of the rows with a close call (:func:`logits_ulp`, None for continuous float32 logits). A reported tie
is **exact** only when the step is at most :data:`TIE_ULP_SHARE` of that ulp — each reported value is
within half a step of the computed one, so a reported margin of 0 leaves the computed one within one
step, and a step of at most half an ulp cannot hide the smallest nonzero margin such logits have —
or, where the logits show no spacing, at most :data:`TIE_NATS` itself (:func:`ties_exact`). On a
coarser channel, or one with too few values to tell (:data:`MIN_CHANNEL_VALUES`), a reported tie is
not exact: the near-tie budget counts it with the other flips, and the summary says why.

**Tie-breaking.** At an exact-tie flip each side took one of the tied tokens. The baseline's decode
took the lower or the higher id; the speculative side took the draft token (the position was an
accepted draft, per the loop's step records, and its own verify row ties the two tokens too), the
lower or higher id (its row ties them, no draft there), or its own argmax (its row does not tie
them: its computation came out one ulp the other way).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specparity.model.threshold import ChannelResolution
from specparity.model.types import SpecStats, TokenScores
from specparity.model.verdicts import TieBreak

#: A margin at most this is an exact tie: both tokens carry the same logprob at the precision the
#: engine reports (journals keep 6 decimals; two rounded copies of one value stay equal).
TIE_NATS = 1e-6

#: The spacings a row's quantum is looked for among, largest first: 1 nat down to 2**-10. A bf16
#: logit of magnitude 0.125 already has a spacing of 2**-10; below that a margin is float32 noise.
QUANTA = tuple(2.0 ** -e for e in range(0, 11))

#: How far a difference may sit from a whole multiple of the quantum: float32 rounding of the
#: log-softmax (about 2e-6 at logprobs near −20) plus the journal's 6-decimal rounding.
QUANTUM_TOLERANCE = 2e-5

#: Fewest nonzero differences in a row for its quantum to count (one difference alone is always a
#: multiple of something), and how many of the values nearest the top are read: with four, a
#: spacing twice the true one passes by chance once in 16 rows.
MIN_DIFFERENCES = 2
NEAREST = 4
#: Values further than this below the top are not read: at bf16 logits of magnitude 8 or more they
#: may already sit in a lower binade.
NEAR_NATS = 4.0

#: The steps a logprob channel is tested for, coarsest first: whole decimals (an engine or an API that
#: prints k decimals). A channel of float32 values lies on none of them.
CHANNEL_STEPS = (1.0, 0.1, 0.01, 1e-3, 1e-4, 1e-5, 1e-6)

#: Fewest distinct nonzero logprobs a channel's step is measured on: a value off a decimal grid lands on
#: one ten times coarser about one time in ten, so 16 values that all do are a grid, not chance (1e-16).
MIN_CHANNEL_VALUES = 16

#: A reported tie is exact when the channel's step is at most this share of one ulp of the logits (the
#: module docstring says why).
TIE_ULP_SHARE = 0.5

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


def row_quantum(values: Sequence[float] | np.ndarray) -> float | None:
    """The largest of :data:`QUANTA` that the differences between the top value of ``values`` (one
    row's logprobs) and the :data:`NEAREST` values closest to it (within :data:`NEAR_NATS`) are whole
    multiples of, within
    :data:`QUANTUM_TOLERANCE` (None: none is — continuous float32 logits — or too few distinct values).

    Only the values nearest the top count: they share the top's binade, so their spacing is the one
    a flip between the top tokens is made of; values further down may sit in a lower binade, whose
    finer spacing would understate it."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size < MIN_DIFFERENCES + 1:
        return None
    d = np.sort(np.abs(v - v.max()))
    d = d[d > QUANTUM_TOLERANCE]
    near = d[d <= NEAR_NATS][:NEAREST]
    # too few values near the top (a model with clear margins): the nearest ones at any distance,
    # whose spacing may be a lower binade's, finer than the top's — an understated ulp, never a coarser one
    d = near if near.size >= MIN_DIFFERENCES else d[:NEAREST]
    if d.size < MIN_DIFFERENCES:
        return None
    for q in QUANTA:
        r = d / q
        if np.all(np.abs(r - np.round(r)) * q <= QUANTUM_TOLERANCE):
            return q
    return None


def power_of_two_divisor(x: float) -> float | None:
    """The largest of :data:`QUANTA` that ``x`` is a whole multiple of (None: none, or ``x`` is 0)."""
    if not x or not np.isfinite(x):
        return None
    for q in QUANTA:
        r = abs(x) / q
        if abs(r - round(r)) * q <= QUANTUM_TOLERANCE:
            return q
    return None


def margin_quantum(scores: TokenScores, position: int, margin: float | None) -> float | None:
    """The resolution a flip's ``margin`` is measured in: the row's quantum (:func:`scores_quantum`),
    never coarser than the margin itself allows (a margin of 0.0625 cannot be made of 0.125 steps)."""
    q = scores_quantum(scores, position)
    if q is None or margin is None or is_tie(margin):
        return q
    own = power_of_two_divisor(margin)
    return None if own is None else min(q, own)


def scores_quantum(scores: TokenScores, position: int) -> float | None:
    """:func:`row_quantum` of one row: the chosen token's logprob with its top-k alternatives."""
    if position >= len(scores) or not scores.reported(position):
        return None
    row = scores.top_logprobs[position][scores.top_ids[position] >= 0]
    return row_quantum(np.append(row, scores.logprobs[position]))


def is_tie(margin: float | None) -> bool:
    """Whether a margin is an exact tie at the reported precision."""
    return margin is not None and abs(margin) <= TIE_NATS


def ulps(margin: float | None, quantum: float | None) -> float | None:
    """A margin in units of the row's quantum (None: no quantum, or no margin)."""
    if margin is None or quantum is None:
        return None
    return abs(margin) / quantum


def describe_ulps(margin: float | None, quantum: float | None) -> str:
    """"0.125 nats (1 ulp of 0.125)", "0 nats (an exact tie)", or the nats alone."""
    if margin is None:
        return "unknown"
    if is_tie(margin):
        return "0 nats (an exact tie: both tokens are the row's argmax)"
    u = ulps(margin, quantum)
    if u is None:
        return f"{margin:.4g} nats"
    n = round(u)
    return f"{margin:.4g} nats ({n:g} ulp{'s' if n != 1 else ''} of {quantum:g} at this row's resolution)"


def accepted_draft_positions(spec: SpecStats, n: int) -> np.ndarray | None:
    """Which of the ``n`` output positions were accepted draft tokens, from the step records (None:
    no per-step records, or they do not add up to the stream). The first token of a stream comes
    from the prefill unless the steps account for every token."""
    if spec is None or spec.steps is None:
        return None
    emitted = sum(s.emitted for s in spec.steps)
    if emitted + 1 == n:
        pos = 1
    elif emitted == n:
        pos = 0
    else:
        return None
    out = np.zeros(n, bool)
    for s in spec.steps:
        out[pos:pos + min(s.accepted, s.emitted)] = True
        pos += s.emitted
    return out


def baseline_tie_break(baseline_token: int, spec_token: int) -> TieBreak:
    """How the baseline broke an exact tie between its token and the speculative one."""
    return "lower_id" if baseline_token < spec_token else "higher_id"


def spec_tie_break(baseline_token: int, spec_token: int, spec_margin: float | None,
                   from_draft: bool | None) -> TieBreak:
    """How the speculative side came to take ``spec_token`` at an exact tie of the baseline's row
    (``spec_margin``: its own row's margin for its token over the baseline's; ``from_draft``: whether
    the position was an accepted draft, None when unknown)."""
    if spec_margin is not None and not is_tie(spec_margin):
        return "own_argmax"
    if from_draft:
        return "draft"
    if spec_margin is None:
        return "unknown"
    return "lower_id" if spec_token < baseline_token else "higher_id"


def channel_values(streams: Sequence[TokenScores]) -> np.ndarray:
    """The distinct nonzero finite logprobs the engine reported in ``streams`` (chosen tokens and the
    alternatives of its top-k; an unreported slot, id −1, is no value)."""
    parts = [np.zeros(0, np.float32)]
    for s in streams:
        if not len(s):
            continue
        parts.append(s.logprobs.astype(np.float32))
        parts.append(s.top_logprobs[s.top_ids >= 0].astype(np.float32))
    v = np.concatenate(parts)
    v = v[np.isfinite(v) & (v != 0.0)]
    return np.unique(v)


def on_step(values: np.ndarray, step: float) -> bool:
    """Whether every value is a whole multiple of ``step`` within its own float32 spacing (the rounding a
    value written on that step keeps once stored as a float32)."""
    v = np.asarray(values, np.float32)
    off = np.abs(v.astype(np.float64) - step * np.round(v.astype(np.float64) / step))
    return bool(np.all(off <= np.spacing(np.abs(v)).astype(np.float64)))


def channel_step(values: np.ndarray) -> float | None:
    """The coarsest of :data:`CHANNEL_STEPS` every value lies on (None: none — continuous values)."""
    for step in CHANNEL_STEPS:
        if on_step(values, step):
            return step
    return None


def logits_ulp(streams: Sequence[TokenScores], window: float) -> float | None:
    """The logits' spacing at the rows with a close call (decode margin at most ``window``): the median
    (the lower middle value) of their :func:`scores_quantum`, a row without one counting as 0 — so None
    when half of them or more show no spacing (continuous float32 logits, or a channel whose rounding
    hides it), or when there is no such row."""
    quanta = []
    for s in streams:
        with np.errstate(invalid="ignore"):
            close = np.flatnonzero(decode_margins(s) <= window)
        quanta += [scores_quantum(s, int(i)) or 0.0 for i in close]
    if not quanta:
        return None
    ulp = float(np.quantile(np.asarray(quanta), 0.5, method="lower"))
    return ulp if ulp > 0 else None


def measure_resolution(decoded: Sequence[TokenScores], teacher_forced: Sequence[TokenScores],
                       window: float) -> ChannelResolution:
    """The reference's channel resolution: the coarser step of its decode rows and its teacher-forced
    rows (each channel alone: a coarse one must not hide behind a fine one), the fewest values either
    was tested on, and the logits' ulp at the decode rows with a close call (margin at most ``window``)."""
    steps, counts = [], []
    for streams in (decoded, teacher_forced):
        values = channel_values(streams)
        if values.size:
            steps.append(channel_step(values) or 0.0)
            counts.append(int(values.size))
    step = max(steps, default=0.0)
    return ChannelResolution(step or None, logits_ulp(decoded, window), min(counts, default=0))


def tie_bound(res: ChannelResolution) -> float:
    """The coarsest step at which a reported tie is exact: :data:`TIE_ULP_SHARE` of the logits' ulp, or
    :data:`TIE_NATS` where they show none."""
    return TIE_ULP_SHARE * res.ulp if res.ulp else TIE_NATS


def ties_exact(res: ChannelResolution | None) -> bool:
    """Whether a reported tie is an exact one on this channel (None: not measured — a record made before
    the resolution was, whose ties were judged exact)."""
    if res is None:
        return True
    if res.values < MIN_CHANNEL_VALUES:
        return False
    return res.step is None or res.step <= tie_bound(res)


def resolution_words(res: ChannelResolution) -> str:
    """The channel's resolution and what it means for a reported tie, in words."""
    if res.values < MIN_CHANNEL_VALUES:
        return (f"the channel's resolution is unknown: {res.values} distinct nonzero logprob(s) reported, fewer than "
                f"{MIN_CHANNEL_VALUES}, so a reported tie is not known to be exact")
    step = ("the logprobs lie on no decimal step (continuous)" if res.step is None else
            f"the logprobs are reported in steps of {res.step:g} nats")
    ulp = (f"one ulp of the logits is {res.ulp:g} nats" if res.ulp else "the logits show no spacing (continuous)")
    if ties_exact(res):
        return f"{step} and {ulp}: a reported tie is exact"
    return (f"{step} and {ulp}: a step above {tie_bound(res):g} nats can hide a real margin, so a reported tie is "
            f"not exact")
