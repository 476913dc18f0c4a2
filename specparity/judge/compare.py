"""Token-by-token comparison of a speculative run against the target's own greedy run.

Every prompt gets one class:

* ``exact``     — identical token ids and finish reason.
* ``near_tie``  — the first divergence is at a position where the *baseline's* margin between its
  own token and the speculative token is within the near-tie threshold (numeric noise), and every
  later speculative token is still the target's argmax (within the threshold) under its own
  prefix, as judged by teacher-forced scoring.
* ``diverged``  — anything else: a margin above the threshold, a speculative token outside the
  baseline's top-k, a length/finish mismatch not explained by an earlier flip, a token past a
  stop or past the limit, a later token the target would not have chosen, or a token that the
  speculative run's own verify row rejected (:func:`own_row_rejections`: the row that chose a
  token prefers another one — noise cannot do that, since a row and its argmax are one
  computation).
* ``drifted``   — the tokens are identical (or split only at a near tie), but the speculative
  run's own per-position logprobs moved away from the baseline's by more than the target's
  measured noise allows (the drift bound, :mod:`specparity.judge.noise`): the loop corrupted the
  target's computation (a KV cache cropped one short, wrong positions) and the argmax happened to
  survive. The next prompt, or the next dtype, will not be so lucky. Rows an engine did not report
  are not compared; a prompt with no comparable row says so in ``drift``.
* ``error``     — the engine failed on this prompt (kept separate so a crash is never "exact"), broke
  the protocol (a finish reason other than ``stop``/``length``, an empty finished stream), or the
  baseline itself breaks the stop rule (the stop set or limit is not the engine's: a
  configuration error, never blamed on speculation).

Verdicts compare token ids, never text: text is decoded only for display.
"""

from __future__ import annotations

import difflib
from typing import Callable, Sequence

import numpy as np

from specparity.judge.noise import position_deltas
from specparity.judge.resolution import (accepted_draft_positions, baseline_tie_break, is_tie,
                                         margin_quantum, spec_tie_break)
from specparity.model.threshold import FLOOR_NATS
from specparity.model.types import GenerationResult, TokenScores
from specparity.model.verdicts import TIE_BREAK_WORDS, Divergence, Drift, TFViolation, TokenView, Verdict

#: How many tokens of context to show around a divergence.
CONTEXT_TOKENS = 8
#: A re-merge needs this many consecutive equal tokens after the divergence.
REMERGE_MIN_RUN = 4
#: difflib is quadratic in the worst case: re-merge search looks this far after the divergence.
REMERGE_WINDOW = 4096
#: The finish reasons of a finished stream (``error`` belongs to a failed request, with its message).
FINISH_REASONS = ("stop", "length")
#: Words every verdict of a token rejected by its own verify row carries.
OWN_ROW_REJECTED = "the loop emitted a token its own verifier rejected"


def measure_drift(baseline: TokenScores, spec: TokenScores, upto: int, bound: float) -> Drift:
    """Compare the two runs' rows at positions ``< upto`` (where their tokens agree)."""
    deltas = position_deltas(baseline, spec)[:upto]
    seen = np.isfinite(deltas)
    if not seen.any():
        return Drift(bound, None, None, 0, 0)
    over = np.flatnonzero(seen & (np.nan_to_num(deltas, nan=0.0) > bound))
    return Drift(bound, float(np.nanmax(deltas)), int(over[0]) if over.size else None, int(over.size), int(seen.sum()))


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing position, ``min(len)`` if one is a strict prefix, None if equal."""
    n = min(len(a), len(b))
    if n:
        x = np.asarray(a[:n], dtype=np.int64)
        y = np.asarray(b[:n], dtype=np.int64)
        diff = np.flatnonzero(x != y)
        if diff.size:
            return int(diff[0])
    return None if len(a) == len(b) else n


def tf_violations(spec_ids: Sequence[int], tf: TokenScores, start: int = 0) -> list[TFViolation]:
    """Every position >= ``start`` where the speculative token is not the teacher-forced argmax.

    ``tf`` scored the speculative tokens themselves, so their exact logprob is known even outside
    the top-k; vectorised because a broken 128K-token stream can violate at every position.
    """
    n = min(len(spec_ids), len(tf))
    if n <= start:
        return []
    ids = np.asarray(spec_ids[start:n], dtype=np.int64)
    argmax = tf.top_ids[start:n, 0]
    bad = np.flatnonzero(ids != argmax)
    if not bad.size:
        return []
    margins = tf.top_logprobs[start:n, 0][bad] - tf.logprobs[start:n][bad]
    # a row that did not score the token (id -1) or scored it as NaN gives no margin: "unknown",
    # which the caller treats as outside the top-k, never as a small margin
    scored = (tf.token_ids[start:n][bad] == ids[bad]) & np.isfinite(margins)
    return [
        TFViolation(int(j) + start, int(ids[j]), int(argmax[j]), float(m) if ok else None)
        for j, m, ok in zip(bad.tolist(), margins.tolist(), scored.tolist())
    ]


def find_remerge(base_rest: Sequence[int], spec_rest: Sequence[int]) -> tuple[int, int] | None:
    """Offsets (in each remainder) where the two streams re-align for ``REMERGE_MIN_RUN`` tokens.

    A run shorter than the minimum still counts if it reaches the end of both streams (the texts
    end together).
    """
    a = list(base_rest[:REMERGE_WINDOW])
    b = list(spec_rest[:REMERGE_WINDOW])
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for block in matcher.get_matching_blocks():
        if block.size == 0:
            continue
        ends_together = block.a + block.size == len(base_rest) and block.b + block.size == len(spec_rest)
        if block.size >= REMERGE_MIN_RUN or ends_together:
            return block.a, block.b
    return None


def own_row_rejections(ids: Sequence[int], rows: TokenScores, tolerance: float = FLOOR_NATS) -> list[TFViolation]:
    """Every position where ``rows`` — the engine's own row for each emitted token, the row that
    chose it — prefers another token than the one emitted by more than ``tolerance``.

    A greedy decoder emits its row's argmax, so for the row that chose the token the margin is 0
    whatever the dtype (an exact tie may break either way: margin 0); the default tolerance is
    float32 resolution. Rows the engine did not report (NaN, ``top_ids`` −1) are skipped, and so is
    a row that does not hold the emitted token's own logprob. ``target_argmax`` is the row's argmax."""
    n = min(len(ids), len(rows))
    if not n:
        return []
    known = np.isfinite(rows.logprobs[:n]) & (rows.top_ids[:n, 0] >= 0)
    return [v for v in tf_violations(ids[:n], rows)
            if known[v.position] and v.margin is not None and v.margin > tolerance]


def finish_problem(result: GenerationResult) -> str | None:
    """Why a finished (not failed) stream breaks the protocol's finish contract (None: it keeps it).

    A finished stream ends on a stop token, which it keeps (``stop``), or holds ``max_new_tokens``
    >= 1 tokens (``length``): any other finish reason, and an empty stream under either, is an
    engine that broke the protocol — never two empty streams that compare as exact."""
    if result.finish_reason not in FINISH_REASONS:
        return (f"the engine broke the protocol: finish_reason {result.finish_reason!r} for a finished stream "
                f"(expected 'stop' or 'length')")
    if not result.output_ids:
        return (f"the engine broke the protocol: finish_reason {result.finish_reason!r} with no token (a finished "
                f"stream holds the stop token it ended on, or max_new_tokens >= 1 tokens)")
    return None


def stop_rule_problem(result: GenerationResult, max_new_tokens: int, stop_ids: Sequence[int],
                      decode: Callable[[Sequence[int]], str] | None = None) -> str | None:
    """How a stream breaks the stop rule (None: it keeps it), naming the stop set and the token the
    stream ended with — for a *baseline*, where the break means the stop set or limit the run uses is
    not the engine's (a configuration error), never a speculation bug."""
    stops = set(stop_ids)
    problem = _stream_problem(result, max_new_tokens, stops)
    if problem is None:
        return None
    ids = result.output_ids
    last = "no token" if not ids else f"token {ids[-1]}" + (f" {decode([ids[-1]])!r}" if decode else "")
    return (f"{problem}; it ends with {last} (finish {result.finish_reason!r}, {len(ids)} of max_new_tokens="
            f"{max_new_tokens}); stop set {sorted(int(t) for t in stops)}")


def _stream_problem(result: GenerationResult, max_new_tokens: int, stop_ids: set[int]) -> str | None:
    """A stream that breaks the loop's own contract: tokens past a stop or past the limit."""
    ids = result.output_ids
    if len(ids) > max_new_tokens:
        return f"emitted {len(ids)} tokens, more than max_new_tokens={max_new_tokens}"
    for i, t in enumerate(ids[:-1]):
        if t in stop_ids:
            return f"continued past stop token {t} at position {i} ({len(ids) - i - 1} tokens after it)"
    if result.finish_reason == "stop" and (not ids or ids[-1] not in stop_ids):
        return "finish_reason is 'stop' but the last token is not a stop token"
    if result.finish_reason == "length" and len(ids) != max_new_tokens:
        return f"finish_reason is 'length' but only {len(ids)} of max_new_tokens={max_new_tokens} tokens were emitted"
    return None


def compare(
    prompt_id: str,
    category: str,
    baseline: GenerationResult,
    spec: GenerationResult,
    spec_tf: TokenScores | None,
    *,
    threshold: float,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    decode: Callable[[Sequence[int]], str],
    baseline_tf: TokenScores | None = None,
    drift_nats: float | None = None,
) -> Verdict:
    """Classify one prompt. ``spec_tf`` is the target's teacher-forced scoring of the spec output;
    ``baseline_tf`` that of the baseline, used for the margin at the split when the engine did not
    report the baseline's own row there; ``drift_nats`` the latent-drift bound (None: not checked)."""
    v = Verdict(
        prompt_id,
        category,
        "exact",
        "",
        baseline_len=len(baseline.output_ids),
        spec_len=len(spec.output_ids),
        baseline_finish=baseline.finish_reason,
        spec_finish=spec.finish_reason,
        threshold=threshold,
        later_scored=spec_tf is not None,
    )
    if baseline.error or spec.error:
        v.klass, v.rule = "error", "failed"
        v.reason = f"baseline failed: {baseline.error}" if baseline.error else f"speculative run failed: {spec.error}"
        return v
    broken = [(side, finish_problem(r)) for side, r in (("baseline", baseline), ("speculative run", spec))]
    broken = [(side, why) for side, why in broken if why]
    if broken:
        v.klass, v.rule, v.reason = "error", "broken_finish", "; ".join(f"{side}: {why}" for side, why in broken)
        return v
    base_problem = stop_rule_problem(baseline, max_new_tokens, stop_ids, decode)
    if base_problem:
        v.klass, v.rule = "error", "baseline_stop_rule"
        v.reason = (f"not judged: the baseline breaks the stop rule ({base_problem}): the stop set or token limit "
                    f"is not the engine's, a harness/configuration error, not speculation")
        return v
    stops = set(stop_ids)
    if spec_tf is not None:
        v.tf_violations = tf_violations(spec.output_ids, spec_tf)
    base_ids, spec_ids = baseline.output_ids, spec.output_ids
    i = first_mismatch(base_ids, spec_ids)
    if drift_nats is not None:
        v.drift = measure_drift(baseline.scores, spec.scores, len(base_ids) if i is None else i, drift_nats)
    drifted = v.drift is not None and v.drift.start is not None

    problem = _stream_problem(spec, max_new_tokens, stops)
    rejected = own_row_rejections(spec_ids, spec.scores)
    if i is None:
        if baseline.finish_reason != spec.finish_reason:
            v.klass, v.rule, v.reason = "diverged", "finish_mismatch", (
                f"same tokens but finish reason {spec.finish_reason!r} vs baseline {baseline.finish_reason!r}"
            )
        elif problem:
            v.klass, v.rule, v.reason = "diverged", "stream_problem", f"speculative stream: {problem}"
        elif rejected:
            v.klass, v.rule, v.reason = "diverged", "own_row_rejected", _rejected_reason(rejected, decode)
            v.rejected_at = rejected[0].position
        elif drifted:
            v.klass, v.rule, v.reason = "drifted", "drift", f"identical token ids, but {v.drift.describe()}"
        else:
            v.klass, v.rule, v.reason = "exact", "identical", "identical token ids and finish reason"
        return v

    v.divergence = _describe_divergence(i, baseline, spec, decode, baseline_tf, spec_tf)
    d = v.divergence
    if problem:
        v.klass, v.rule = "diverged", "stream_problem"
        v.reason = f"speculative stream: {problem} (first difference at position {i})"
        return v
    if d.baseline_token is None or d.spec_token is None:
        shorter = "speculative run" if d.spec_token is None else "baseline"
        v.klass, v.rule = "diverged", "length_mismatch"
        v.reason = (
            f"length mismatch not explained by a flip: the {shorter} ends at position {i} "
            f"(baseline {len(base_ids)} tokens/{baseline.finish_reason}, spec {len(spec_ids)} tokens/{spec.finish_reason})"
        )
        return v
    if d.baseline_margin is None:
        unreported = not baseline.scores.reported(i) and (baseline_tf is None or not baseline_tf.reported(i))
        v.klass, v.rule = "diverged", "margin_unreported" if unreported else "margin_outside_top_k"
        v.reason = (
            f"position {i}: the engine reported no logprobs for the baseline there, so the margin between "
            f"{d.baseline_token.text!r} and {d.spec_token.text!r} is unknown (never assumed to be a near tie)"
            if unreported else
            f"position {i}: spec token {d.spec_token.id} {d.spec_token.text!r} is outside the baseline's "
            f"top-{baseline.scores.k} (baseline chose {d.baseline_token.id} {d.baseline_token.text!r})"
        )
        return v
    if d.baseline_margin > threshold:
        v.klass, v.rule = "diverged", "margin_over_threshold"
        v.reason = (
            f"position {i}: baseline margin {d.baseline_margin:.6g} nats between {d.baseline_token.text!r} and "
            f"{d.spec_token.text!r} exceeds the near-tie threshold {threshold:.3g}"
        )
        return v
    if rejected:  # at the split or anywhere else: not a tie the baseline's margin can excuse
        v.klass, v.rule, v.reason = "diverged", "own_row_rejected", _rejected_reason(rejected, decode, i)
        v.rejected_at = rejected[0].position
        return v
    if spec_tf is None:
        v.klass, v.rule = "diverged", "later_unscored"
        v.reason = f"position {i}: near-tie flip, but the rest of the stream could not be scored teacher-forced"
        return v
    later = [t for t in v.tf_violations if t.position > i and (t.margin is None or t.margin > threshold)]
    if later:
        t = later[0]
        m = "outside the top-k" if t.margin is None else f"margin {t.margin:.6g} nats"
        v.klass, v.rule = "diverged", "later_not_argmax"
        v.reason = (
            f"near-tie flip at {i} (margin {d.baseline_margin:.3g}), but at position {t.position} the spec token "
            f"{t.spec_token} is not the target's choice {t.target_argmax} under its own prefix ({m}); "
            f"{len(later)} such position(s)"
        )
        return v
    if drifted:
        v.klass, v.rule = "drifted", "drift_before_split"
        v.reason = (
            f"near-tie flip at position {i} (margin {d.baseline_margin:.3g}), but before it {v.drift.describe()}: "
            f"the flip follows a corrupted computation, not numeric noise"
        )
        return v
    gap = split_gap(d, spec.scores, i)
    if drift_nats is not None and gap is not None and gap > drift_nats:
        v.klass, v.rule = "drifted", "split_gap"
        v.reason = (
            f"near-tie flip at position {i} (baseline margin {d.baseline_margin:.3g} <= threshold {threshold:.3g}), "
            f"but the speculative run's own row there prefers {d.spec_token.text!r} by "
            f"{'at least ' if d.spec_margin is None else ''}{gap - d.baseline_margin:.3g} nats: the two computations of "
            f"the same position are {gap:.3g} nats apart, beyond the drift bound {drift_nats:.3g} — not a tie the "
            f"noise explains"
        )
        return v
    v.klass, v.rule = "near_tie", "near_tie"
    merged = f", re-merges at {d.remerge[0]}/{d.remerge[1]}" if d.remerge else ", does not re-merge"
    v.reason = (
        f"position {i}: {d.baseline_token.text!r} vs {d.spec_token.text!r}, baseline margin "
        f"{d.baseline_margin:.3g}{_resolution_words(d)} <= threshold {threshold:.3g}{merged}; every later spec token is "
        f"the target's argmax"
    )
    return v


def _resolution_words(d: Divergence) -> str:
    """" (an exact tie; …)" or " (1 ulp of 0.125)": what the margin is at the row's resolution."""
    if d.tie:
        return (f" (an exact tie: the baseline took {TIE_BREAK_WORDS[d.baseline_break]}, the speculative run "
                f"{TIE_BREAK_WORDS[d.spec_break]})")
    n = d.margin_ulps
    return "" if n is None else f" ({round(n):g} ulp{'s' if round(n) != 1 else ''} of {d.ulp_nats:g})"


def _rejected_reason(rejected: list[TFViolation], decode: Callable[[Sequence[int]], str], split: int | None = None) -> str:
    t = rejected[0]
    where = "" if split is None else (" (at the first difference)" if t.position == split else
                                      f" (first difference at position {split})")
    return (f"position {t.position}{where}: the speculative run emitted {t.spec_token} {decode([t.spec_token])!r}, "
            f"but its own row there prefers {t.target_argmax} {decode([t.target_argmax])!r} by {t.margin:.4g} nats: "
            f"{OWN_ROW_REJECTED}; {len(rejected)} such position(s)")


def split_gap(d: Divergence, spec_rows: TokenScores, i: int) -> float | None:
    """How far apart the two runs' rows are at the split, on the two tokens that flipped: the
    baseline's margin for its token plus the speculative row's margin for its own (for one
    computation up to numeric noise the two cancel, so the sum is a |Δmargin| like the drift
    check's). When the baseline token is outside the speculative row's top-k, the k-th alternative
    bounds it from below. None: the speculative run reported no row there."""
    if d.baseline_margin is None or d.spec_token is None or i >= len(spec_rows) or not spec_rows.reported(i):
        return None
    if d.spec_margin is not None:
        return d.baseline_margin + d.spec_margin
    own = spec_rows.logprob_of(i, d.spec_token.id)
    floor = np.nanmin(spec_rows.top_logprobs[i]) if spec_rows.k else np.nan
    if own is None or not np.isfinite(floor):
        return None
    return d.baseline_margin + (own - float(floor))


def _describe_divergence(
    i: int, baseline: GenerationResult, spec: GenerationResult, decode: Callable[[Sequence[int]], str],
    baseline_tf: TokenScores | None = None, spec_tf: TokenScores | None = None,
) -> Divergence:
    base_ids, spec_ids = baseline.output_ids, spec.output_ids
    a = base_ids[i] if i < len(base_ids) else None
    b = spec_ids[i] if i < len(spec_ids) else None
    base_margin = spec_rank = spec_margin = base_rank = quantum = None
    margin_source = "decode"
    if a is not None and b is not None:
        scores = baseline.scores
        if (i >= len(scores) or not scores.reported(i)) and baseline_tf is not None and i < len(baseline_tf) \
                and baseline_tf.reported(i):
            scores, margin_source = baseline_tf, "teacher-forced"
        if i < len(scores) and scores.reported(i):
            lp_b = scores.logprob_of(i, b)
            spec_rank = scores.rank_of(i, b)
            if lp_b is not None:
                base_margin = float(scores.logprobs[i]) - lp_b
                quantum = margin_quantum(scores, i, base_margin)
        if (base_margin is None and spec_tf is not None and i < len(spec_tf) and spec_tf.reported(i)
                and int(spec_tf.top_ids[i, 0]) == a):
            # Up to position i both streams share the prefix, so the teacher-forced row that scored
            # the speculative token there is the baseline's row too (its argmax is the baseline's
            # token), and it holds b's exact logprob even when b is outside every top-k.
            lp_b = spec_tf.logprob_of(i, b)
            if lp_b is not None:
                base_margin = float(spec_tf.top_logprobs[i, 0]) - lp_b
                margin_source = "teacher-forced (the speculative stream's row at the split: same prefix)"
                quantum = margin_quantum(spec_tf, i, base_margin)
        if i < len(spec.scores):
            lp_a = spec.scores.logprob_of(i, a)
            base_rank = spec.scores.rank_of(i, a)
            if lp_a is not None and spec.scores.reported(i):
                spec_margin = float(spec.scores.logprobs[i]) - lp_a
    tie = a is not None and b is not None and is_tie(base_margin)
    base_break = spec_break = ""
    if tie:
        drafts = accepted_draft_positions(spec.spec, len(spec_ids))
        base_break = baseline_tie_break(a, b)
        spec_break = spec_tie_break(a, b, spec_margin, None if drafts is None else bool(drafts[i]))
    lo = max(0, i - CONTEXT_TOKENS)
    return Divergence(
        position=i,
        baseline_token=TokenView(a, decode([a])) if a is not None else None,
        spec_token=TokenView(b, decode([b])) if b is not None else None,
        baseline_margin=base_margin,
        spec_rank_in_baseline=spec_rank,
        spec_margin=spec_margin,
        baseline_rank_in_spec=base_rank,
        context_before=decode(base_ids[lo:i]),
        baseline_after=decode(base_ids[i : i + CONTEXT_TOKENS]),
        spec_after=decode(spec_ids[i : i + CONTEXT_TOKENS]),
        remerge=_absolute(find_remerge(base_ids[i + 1 :], spec_ids[i + 1 :]), i + 1) if a is not None and b is not None else None,
        margin_source=margin_source,
        tie=tie,
        ulp_nats=quantum,
        baseline_break=base_break,
        spec_break=spec_break,
    )


def _absolute(offsets: tuple[int, int] | None, base: int) -> tuple[int, int] | None:
    return None if offsets is None else (offsets[0] + base, offsets[1] + base)
