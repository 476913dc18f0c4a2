"""The checks behind a prompt's class: what :func:`specparity.judge.compare.compare` found, step by step.

A verdict's class is decided once, by ``compare()``, which records on the
:class:`~specparity.judge.compare.Verdict` which rule decided it (``Verdict.rule`` and the flags derived
from it). :func:`verdict_checks` turns that verdict into the list of :class:`Check` s a report
shows, in the order the comparison made them; the reports render the list and re-derive nothing.
What a check needs from the run (the measured noise) is passed in; the run's near-tie budget is a
check of the gate's (:func:`specparity.gate.decision.near_tie_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from specparity.judge.compare import REMERGE_MIN_RUN
from specparity.model.verdicts import TIE_BREAK_WORDS, Verdict
from specparity.model.threshold import DRIFT_MULTIPLIER, NoiseStats

State = Literal["ok", "fail", "warn", "info"]

_MARKS = {"ok": "✅", "fail": "❌", "warn": "⚠️", "info": "ℹ️"}
_SYMBOLS = {"ok": "✓", "fail": "✗", "warn": "!", "info": "i"}


@dataclass
class Check:
    """One step of the reasoning behind a prompt's class, in words: ``ok`` (passes what a near tie
    needs), ``fail`` (why it is not exact or a near tie), ``warn``, or ``info`` (context).

    ``what`` names the step (``baseline_margin``, ``later_tokens`` …), ``position`` the output
    position it is about (None: the whole stream), ``numbers`` the figures its text states."""

    state: State
    text: str
    what: str = ""
    position: int | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def mark(self) -> str:
        """An emoji for markdown (GitHub renders it)."""
        return _MARKS[self.state]

    @property
    def symbol(self) -> str:
        """A plain symbol for HTML (no emoji font needed)."""
        return _SYMBOLS[self.state]


def token_shown(text: str | None) -> str:
    """A single token for display: every whitespace visible, never empty."""
    if text is None:
        return "(end of stream)"
    if text == "":
        return "∅ (decodes to nothing)"
    return text.replace(" ", "·").replace("\r", "␍").replace("\t", "⇥").replace("\n", "⏎")


def source_words(source: str) -> str:
    """Where a baseline margin was read, in words (``Divergence.margin_source``)."""
    return {"decode": "the baseline's own decode row",
            "teacher-forced": "teacher-forced scoring of the baseline"}.get(source, source)


def rank_words(x: int | None) -> str:
    """A rank in a top-k, or that the token is not in it."""
    return "outside top-k" if x is None else str(x)


def _tokname(t: Any) -> str:
    return "the end of its stream" if t is None else f"token {t.id} “{token_shown(t.text)}”"


NEVER_JUDGED = "never judged: the run ended before this prompt finished"


def drift_check(v: Verdict, upto: int | None) -> Check:
    """Whether the speculative run's own rows stayed within the drift bound before ``upto`` (None:
    over the whole stream)."""
    dr = v.drift
    where = f"before the split (positions 0–{upto - 1})" if upto else "over the whole stream"
    if dr is None:
        return Check("info", "latent drift not checked: no drift bound (no noise was measured)", "drift")
    nums = {"max_nats": dr.max_nats, "bound": dr.bound, "over": dr.over, "checked": dr.checked}
    if dr.checked == 0:
        return Check("warn", f"latent drift not checked {where}: the engine reported no per-position logprobs for "
                             f"the speculative run there", "drift", numbers=nums)
    if dr.start is None:
        return Check("ok", f"no latent drift {where}: the speculative run's own logprobs stay within "
                           f"{dr.max_nats:.3g} nats of the baseline's (bound {dr.bound:.3g} nats = "
                           f"{DRIFT_MULTIPLIER:g} × the measured noise; {dr.checked} positions compared)",
                     "drift", numbers=nums)
    return Check("fail", f"latent drift {where}: from position {dr.start} the speculative run's own logprobs leave "
                         f"the baseline's by up to {dr.max_nats:.4g} nats, above the bound {dr.bound:.3g} "
                         f"({dr.over} of {dr.checked} positions): a corrupted computation, not numeric noise",
                 "drift", dr.start, nums)


def verdict_checks(v: Verdict | None, *, noise: NoiseStats | None = None) -> list[Check]:
    """Why a prompt got its class, step by step, from its verdict alone (what the comparison
    checked, in the order it checked it). ``noise``: the run's measured noise (None: not measured),
    which the margin checks compare against."""
    if v is None:
        return [Check("fail", NEVER_JUDGED, "never_judged")]
    if v.klass == "error":
        return [Check("fail", v.reason, "error")]
    thr = v.threshold
    measured = noise is not None and noise.pairs
    checks: list[Check] = []
    d = v.divergence
    if d is None:
        if v.baseline_finish != v.spec_finish:
            checks.append(Check("fail", f"the same {v.baseline_len} token ids, but finish reason {v.spec_finish!r} "
                                        f"against the baseline's {v.baseline_finish!r}", "finish_mismatch"))
        else:
            checks.append(Check("ok", f"identical token ids ({v.baseline_len} tokens) and finish reason "
                                      f"({v.baseline_finish})", "identical", numbers={"tokens": v.baseline_len}))
        if v.stream_problem or v.own_row_rejected:
            checks.append(Check("fail", v.reason, v.rule, v.rejected_at))
        checks.append(drift_check(v, None))
        return checks
    i = d.position
    a, b = d.baseline_token, d.spec_token
    at_split = v.own_row_rejected_at_split
    checks.append(Check("info", f"first difference at output position {i}: the baseline emitted {_tokname(a)}, "
                                f"the speculative run {_tokname(b)}", "first_difference", i))
    if v.stream_problem:
        checks.append(Check("fail", v.reason, "stream_problem", i))
    if a is None or b is None:
        shorter = "speculative run" if b is None else "baseline"
        checks.append(Check("fail", f"the {shorter} ended at position {i} while the other went on "
                                    f"(baseline {v.baseline_len} tokens/{v.baseline_finish}, speculative "
                                    f"{v.spec_len} tokens/{v.spec_finish}): a length difference without a flip "
                                    f"is never a near tie", "length_mismatch", i,
                            {"baseline_len": v.baseline_len, "spec_len": v.spec_len}))
        return checks
    m = d.baseline_margin
    margin_nums = {"margin": m, "threshold": thr}
    if m is None:
        checks.append(Check("fail", f"baseline margin unknown: {v.reason}" if v.klass == "diverged" and
                            v.margin_unknown_explained else "baseline margin unknown (the speculative token is outside "
                            "the baseline's recorded top-k, or the row was not reported): never assumed to be a near tie",
                            "baseline_margin", i, margin_nums))
    elif m <= thr and d.tie:
        text = (f"baseline margin 0 nats: an exact tie — “{token_shown(a.text)}” and “{token_shown(b.text)}” are both the "
                f"argmax of the baseline's row (margin source: {source_words(d.margin_source)}), and greedy decoding "
                f"allows either; the baseline took {TIE_BREAK_WORDS.get(d.baseline_break, d.baseline_break)}, the "
                f"speculative run {TIE_BREAK_WORDS.get(d.spec_break, d.spec_break)}")
        margin_nums.update(tie=True, baseline_break=d.baseline_break, spec_break=d.spec_break)
        checks.append(Check("ok", text, "baseline_margin", i, margin_nums))
    elif m <= thr:
        n_ulps = None if d.margin_ulps is None else round(d.margin_ulps)
        ulp = "" if n_ulps is None else (f" ({n_ulps:g} ulp{'s' if n_ulps != 1 else ''} of {d.ulp_nats:g} at this "
                                         f"row's resolution)")
        if d.margin_ulps is not None:
            margin_nums.update(ulps=round(d.margin_ulps), ulp_nats=d.ulp_nats)
        text = (f"baseline margin {m:.4g} nats{ulp} ≤ near-tie threshold {thr:.4g} nats: at this position the target "
                f"itself gave “{token_shown(b.text)}” {math.exp(-m):.3f}× the probability of “{token_shown(a.text)}” "
                f"(margin source: {source_words(d.margin_source)})")
        if measured:
            margin_nums["flip_noise"] = noise.flip_noise
            text += (f"; the target's own noise between two ways of computing the same tokens reaches "
                     f"{noise.flip_noise:.3g} nats")
            if m <= noise.flip_noise:
                text += ", so this margin is inside the measured noise itself"
        checks.append(Check("ok", text, "baseline_margin", i, margin_nums))
    else:
        checks.append(Check("fail", f"baseline margin {m:.4g} nats > near-tie threshold {thr:.4g} nats: the target "
                                    f"preferred “{token_shown(a.text)}” {math.exp(min(m, 700)):.3g}× over "
                                    f"“{token_shown(b.text)}” (margin source: {source_words(d.margin_source)}); "
                                    f"numeric noise does not explain the switch", "baseline_margin", i, margin_nums))
    sm = d.spec_margin
    spec_nums: dict[str, Any] = {"spec_margin": sm, "baseline_rank_in_spec": d.baseline_rank_in_spec}
    if sm is None:
        checks.append(Check("info", f"the speculative run's own row at {i} holds no logprob for the baseline's token "
                                    f"(rank {rank_words(d.baseline_rank_in_spec)}), so its margin is unknown",
                            "spec_margin", i, spec_nums))
    elif sm >= 0:
        text = (f"the speculative run's own row at {i} preferred “{token_shown(b.text)}” by {sm:.4g} nats (the "
                f"baseline's token at rank {rank_words(d.baseline_rank_in_spec)} there)")
        state: State = "info"
        if m is not None:
            spec_nums["gap"] = m + sm
            text += (f": the two computations' margins on this pair of tokens differ by {m + sm:.4g} nats")
            if measured:
                text += f" (measured noise max {noise.max_abs_delta:.3g})"
            bound = v.drift.bound if v.drift is not None else None
            if bound is not None and m + sm > bound:
                spec_nums["bound"] = bound
                text += f", more than the drift bound {bound:.3g}"
                if v.klass == "near_tie":
                    state = "warn"
                    text += (": at the split itself the speculative computation is outside the target's noise (the "
                             "class does not use this; a near tie here may hide a loop bug)")
                elif v.klass == "drifted":
                    state = "fail"
                    text += ": the speculative computation at the split is outside the target's noise"
        checks.append(Check(state, text, "spec_margin", i, spec_nums))
    else:
        checks.append(Check("fail" if at_split else "warn",
                            f"the speculative run's own row at {i} prefers the baseline's token by "
                            f"{-sm:.4g} nats, yet it emitted “{token_shown(b.text)}”: the emitted token was "
                            f"not its own verify pass's argmax", "spec_margin", i, spec_nums))
    if v.own_row_rejected and not (at_split and sm is not None and sm < 0):
        checks.append(Check("fail", v.reason, "own_row_rejected", v.rejected_at))
    later = [t for t in v.tf_violations if t.position > i]
    over = [t for t in later if t.margin is None or t.margin > thr]
    if v.later_unscored:
        checks.append(Check("fail", "the speculative stream after the split could not be scored teacher-forced, so "
                                    "its later tokens are unchecked", "later_tokens", i))
    elif over:
        t = over[0]
        how = "outside the top-k" if t.margin is None else f"by {t.margin:.4g} nats"
        checks.append(Check("fail", f"{len(over)} later speculative token(s) are not the target's own choice under "
                                    f"their prefix beyond the threshold (teacher-forced): first at position "
                                    f"{t.position}, token {t.spec_token} where the target picks {t.target_argmax} "
                                    f"({how})", "later_tokens", t.position,
                            {"over": len(over), "margin": t.margin, "threshold": thr}))
    elif later:
        worst = max(t.margin for t in later if t.margin is not None)
        checks.append(Check("ok", f"every later speculative token is the target's argmax under its own prefix within "
                                  f"the threshold (teacher-forced; {len(later)} position(s) differ by at most "
                                  f"{worst:.3g} nats ≤ {thr:.4g})", "later_tokens", i,
                            {"differ": len(later), "worst": worst, "threshold": thr}))
    elif not v.later_scored and v.klass != "near_tie":
        checks.append(Check("info", "later tokens: the teacher-forced scores of the speculative stream are not in "
                                    "this record", "later_tokens", i))
    else:
        n_after = max(0, v.spec_len - i - 1)
        checks.append(Check("ok", f"every later speculative token ({n_after} after the split) is the target's argmax "
                                  f"under its own prefix (teacher-forced): after “{token_shown(b.text)}” the "
                                  f"speculative run wrote exactly what the target alone would", "later_tokens", i,
                            {"after_split": n_after}))
    checks.append(drift_check(v, i))
    if d.remerge:
        r0, r1 = d.remerge
        checks.append(Check("info", f"the texts re-merge: the streams re-align at baseline position {r0} / "
                                    f"speculative position {r1} ({r0 - i} / {r1 - i} tokens after the split)",
                            "remerge", i, {"baseline_position": r0, "spec_position": r1}))
    else:
        checks.append(Check("info", "the texts do not re-merge after the split (no run of "
                                    f"{REMERGE_MIN_RUN} equal tokens, nor a common ending)", "remerge", i))
    return checks
