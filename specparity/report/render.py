"""Readable reports of a gate run: ``summary.md``, the triage report (``report.html``, one
self-contained file, and ``report.md``, the same facts compactly for a PR comment) and the
terminal table.

Everything here renders from a :class:`~specparity.model.gate_run.GateRun` and its
:class:`~specparity.gate.decision.GateDecision` alone — records, threshold, fingerprint, config, coverage,
timings — so a run rebuilt from ``results.jsonl`` renders the same report, and a run with pieces
missing (no threshold, interrupted, a fatal error, prompts without a speculative result) still
renders. docs/REPORT.md describes each section.
"""

from __future__ import annotations

import functools
import html
import json
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import jinja2
from markupsafe import Markup

from specparity.judge.checks import NEVER_JUDGED, Check, source_words, token_shown
from specparity.judge.checks import rank_words as _rank
from specparity.model.verdicts import CLASSES, TIE_BREAK_WORDS
from specparity.model.coverage import PATHS
from specparity.model.locations import fixture_note
from specparity.gate.decision import (GateDecision, coarse_channel, near_tie_policy, prompt_checks, reject_share,
                                      ties_free)
from specparity.model.threshold import DRIFT_MULTIPLIER
from specparity.report.plots import AcceptBar, MarginPoint, RefLine, accept_plot, margin_plot
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS, GateRun, PromptRecord
from specparity.report.reproducers import REPRODUCERS, INDEX, Reproducers, planned, write_reproducers

_TEMPLATES = Path(__file__).parent / "templates"
SUMMARY = "summary.md"
REPORT_HTML = "report.html"
REPORT_MD = "report.md"
#: Files rendered from a run's journal: a new run removes them first (runner.ResultsWriter).
DERIVED_FILES = (SUMMARY, REPORT_HTML, REPORT_MD)


@dataclass
class CategoryRow:
    name: str
    n: int
    exact: int
    near_tie: int
    drifted: int
    diverged: int
    error: int
    proposed: int
    accepted: int
    verify_steps: int
    accept_length: str


def category_rows(run: GateRun) -> list[CategoryRow]:
    rows = []
    for cat in run.categories():
        recs = [r for r in run.records if r.prompt.category == cat]
        classes = [r.verdict.klass for r in recs if r.verdict]
        act = run.activity(cat)
        mal = act.mean_accept_length
        rows.append(
            CategoryRow(
                cat,
                len(recs),
                classes.count("exact"),
                classes.count("near_tie"),
                classes.count("drifted"),
                classes.count("diverged"),
                classes.count("error"),
                act.proposed,
                act.accepted,
                act.verify_steps,
                f"{mal:.2f}" if mal is not None else "n/a",
            )
        )
    return rows


def _tok(t: Any) -> str:
    if t is None:
        return "(end of stream)"
    return f"`{t.id}` `{_esc(t.text)}`"


def _esc(text: str) -> str:
    return (text or "").replace("\n", "\\n").replace("`", "ˋ").replace("|", "¦")


def _nats(x: float | None) -> str:
    return "n/a (outside top-k)" if x is None else f"{x:.6g}"


@functools.lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    """One environment per process: it keeps its compiled templates (compiling them costs more than
    rendering a whole report)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # markdown, not HTML
    )
    env.filters.update(tok=_tok, esc=_esc, nats=_nats, rank=_rank)
    return env


def unreported_line(run: GateRun) -> str:
    """Rows the engine left out by the protocol (``top_ids`` all −1: allowed, never judged), counted
    per side; "" when there are none. A reported row with a non-finite number is an error instead."""
    counts = {"baseline": [0, 0], "speculative": [0, 0], "teacher-forced": [0, 0]}
    for r in run.records:
        # a speculative stream identical to the baseline's is scored once (the run reuses the baseline's rows; a
        # run rebuilt from its journal holds them twice): counted once, so the rebuilt report says the same
        same = r.spec is not None and r.baseline is not None and r.spec.output_ids == r.baseline.output_ids
        sides = (("baseline", r.baseline.scores if r.baseline is not None else None),
                 ("speculative", r.spec.scores if r.spec is not None else None),
                 ("teacher-forced", r.baseline_tf),
                 ("teacher-forced", r.spec_tf if r.spec_tf is not r.baseline_tf and not same else None))
        for side, scores in sides:
            if scores is not None and len(scores):
                counts[side][0] += int(scores.unreported_positions().size)
                counts[side][1] += len(scores)
    if not any(n for n, _ in counts.values()):
        return ""
    return ", ".join(f"{side} {n} of {total}" for side, (n, total) in counts.items() if total) + (
        " rows not reported by the engine (top_ids −1: allowed, not judged)")


def drift_line(run: GateRun) -> str:
    """How latent drift was checked, in one line (the summary and the terminal say it)."""
    bound = run.threshold.drift_nats if run.threshold else None
    if bound is None:
        return "not checked (no noise was measured)"
    judged = [r.verdict for r in run.records if r.verdict is not None and r.verdict.drift is not None]
    unchecked = sum(1 for v in judged if v.drift.checked == 0)
    worst = max((v.drift.max_nats for v in judged if v.drift.max_nats is not None), default=None)
    th = run.threshold
    figures = th.cross_figures()
    between = (f"between the two up to {figures[1].cap:.3g} nats (the allowance)" if figures and figures[1].excess
               else "between the two")
    basis = (f"{DRIFT_MULTIPLIER:g} × the measured max |Δmargin|, within the baseline's instance or {between}, "
             f"whatever --near-tie-nats says")
    if th.drift_held:
        basis = (f"held at the ceiling {th.ceiling:g} nats: {basis} is {DRIFT_MULTIPLIER * (th.noise_max or 0.0):.3g}, "
                 f"and a row that moved further than the ceiling is not numeric noise")
    line = f"bound {bound:.3g} nats ({basis}); rows compared on {len(judged) - unchecked} prompt(s)"
    if worst is not None:
        line += f", largest drift {worst:.3g} nats"
    if unchecked:
        line += (f"; not checked on {unchecked} prompt(s): the engine reported no per-position logprobs for the "
                 f"speculative run there")
    return line


#: Mantissa bits (with the implicit one) of the logit dtypes whose spacing tells the logits' magnitude.
_MANTISSA = {"bfloat16": 8, "bf16": 8, "float16": 11, "fp16": 11, "half": 11}


def _magnitude_words(quantum: float, dtype: str | None) -> str:
    """", bf16 logits of magnitude 16–32": what a row's spacing says about its logits, when the dtype
    is one whose spacing is coarse enough to read (bf16, fp16)."""
    bits = _MANTISSA.get((dtype or "").lower())
    if bits is None:
        return ""
    lo = quantum * 2 ** (bits - 1)
    return f", {dtype} logits of magnitude {lo:g}–{2 * lo:g}"


def near_tie_lines(run: GateRun, decision: GateDecision) -> list[str]:
    """What the near-tie flips were, in lines the summary and the terminal print: how many split at
    exact ties and how each side broke them, the others' margins in ulps, and the flips the
    baseline's own numerics predict. Empty when no prompt flipped and nothing was predicted."""
    flips = [r.verdict for r in run.records if r.verdict is not None and r.verdict.klass == "near_tie"
             and r.verdict.divergence is not None]
    exp = decision.flip_expectation
    lines: list[str] = []
    ties = [v.divergence for v in flips if v.divergence.tie]
    if ties:
        base = Counter(d.baseline_break for d in ties)
        spec = Counter(d.spec_break for d in ties)
        say = lambda c: "; ".join(f"{TIE_BREAK_WORDS.get(k, k)} at {n}" for k, n in c.most_common())  # noqa: E731
        head = (f"exact ties: {len(ties)} flip(s) where both tokens are the baseline row's argmax" if ties_free(run)
                else f"reported ties: {len(ties)} flip(s) at a margin of 0 at the channel's resolution, not exact ties "
                     f"and counted with the other flips ({coarse_channel(run)})")
        lines.append(f"{head} — the speculative run took {say(spec)}; the baseline's decode took {say(base)}")
    others = [v.divergence for v in flips if not v.divergence.tie]
    if others:
        dtype = run.fingerprint.dtype if run.fingerprint else None
        by_ulp = Counter((round(d.margin_ulps), d.ulp_nats) for d in others if d.margin_ulps is not None)
        parts = [f"{n} × {u:g} ulp{'s' if u != 1 else ''} of {q:g}{_magnitude_words(q, dtype)}"
                 for (u, q), n in sorted(by_ulp.items())]
        rest = [d.baseline_margin for d in others if d.margin_ulps is None and d.baseline_margin is not None]
        if rest:
            parts.append(f"{len(rest)} at {', '.join(f'{m:.3g}' for m in sorted(rest)[:8])} nats "
                         f"(no resolution: continuous logits)")
        lines.append(f"other near-tie flips: {len(others)}, margins " + "; ".join(parts))
    if exp is not None and (flips or exp.expected > 0):
        lines.append(f"flip budget: {exp.describe()}; {exp.rate.describe()}")
    return lines


def scorer_check_line(run: GateRun) -> str:
    c = run.scorer_check
    if not c:
        return "not run"
    if not c["clear_positions"]:
        return "nothing to check: no baseline position had a clear margin"
    verdict = "passed" if c["passed"] else "FAILED"
    return (f"{verdict}: the scorer's argmax is the baseline's token at {c['clear_positions'] - c['disagreements']} of "
            f"{c['clear_positions']} positions whose decode margin exceeds {c['clear_nats']:g} nats")


def render_summary_md(run: GateRun, decision: GateDecision, reproducers: Reproducers | None = None) -> str:
    """``summary.md``; ``reproducers``: what :func:`write_reproducers` wrote (None: what it writes
    when every reproducer can be written, :func:`planned`)."""
    found = reproducers if reproducers is not None else planned(run)
    details = []
    for r in run.records:
        v = r.verdict
        if v is None or v.klass == "exact":
            continue
        details.append({"id": r.prompt.id, "klass": v.klass, "reason": v.reason, "div": v.divergence,
                        "tf": v.tf_violations, "drift": v.drift, "reproducer": found.link(r.prompt.id),
                        "replay": r.replay.describe() if r.replay is not None else None})
    taken = run.coverage.taken()
    fp = run.fingerprint
    return _env().get_template("summary.md.j2").render(
        decision=decision,
        fp=fp if fp is not None else _UnknownFingerprint(),
        threshold=run.threshold.describe() if run.threshold else "not measured (the run stopped early)",
        n_prompts=len(run.records),
        max_new_tokens=run.config.max_new_tokens or f"per prompt (default {DEFAULT_MAX_NEW_TOKENS})",
        categories=category_rows(run),
        paths=[(name, desc, taken[name], run.coverage.prompts[name]) for name, desc in PATHS.items()],
        classes=CLASSES,
        drift=drift_line(run),
        cross=run.threshold.describe_cross() if run.threshold else "",
        unreported=unreported_line(run),
        structured=structured_line(run.records),
        scorer_check=scorer_check_line(run),
        calibration_error=run.calibration_error,
        golden_error=run.golden_error,
        golden_notes=run.golden_notes,
        fleet_notes=run.fleet_notes,
        resumed=(run.resumed_baselines, run.resumed_verdicts),
        coverage=run.coverage,
        details=details,
        timings=sorted(run.timings.items()),
        scorer=run.scorer or "not chosen (the run stopped early)",
        concurrency=run.concurrency,
        attachments=run.attachments,
        fatal=run.fatal,
        near_tie_policy=near_tie_policy(run),
        near_tie_lines=near_tie_lines(run, decision),
        forced=reject_share(run),
        fixture_models=fixture_note(fp.target.path if fp is not None else None).get("models"),
        reproducers=found,
        reproducers_index=f"{REPRODUCERS}/{INDEX}",
    )


class _UnknownFingerprint:
    engine = engine_version = dtype = "unknown"
    spec_config: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    draft = None

    class target:  # noqa: N801 - mirrors Fingerprint.target
        path = kind = sha256 = "unknown"


def write_reports(run: GateRun, decision: GateDecision, report_dir: str | Path) -> Path:
    """Write ``summary.md``, ``report.html`` and ``report.md``; returns the summary's path.

    The summary is written first: a report that fails to render never costs the run its summary. The
    reproducers (:mod:`specparity.report.reproducers`) come before it, so every page can link them;
    writing them never raises (what fails is a warning line in the summary)."""
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    found = write_reproducers(run, out)
    path = out / SUMMARY
    path.write_text(render_summary_md(run, decision, found), encoding="utf-8")
    for name, render in ((REPORT_HTML, render_report_html), (REPORT_MD, render_report_md)):
        try:
            text = render(run, decision, found)
        except Exception:  # noqa: BLE001 - the verdict stands; the file says the report broke, and why
            tb = traceback.format_exc()
            text = (f"<!doctype html><meta charset=utf-8><title>specparity report failed</title>"
                    f"<h1>specparity: rendering this report failed</h1><p>gate: {html.escape(decision.status)}</p>"
                    f"<pre>{html.escape(tb)}</pre>") if name == REPORT_HTML else (
                    f"**specparity lossless gate: {decision.status}** (rendering the report failed)\n\n"
                    f"```\n{tb.replace('```', 'ˋˋˋ')}\n```\n")
        (out / name).write_text(text, encoding="utf-8")
    return path


def terminal_lines(run: GateRun, decision: GateDecision) -> list[str]:
    """The per-class summary pytest prints at the end of ``pytest suites/lossless``."""
    c = decision.counts
    lines = [
        f"specparity lossless gate: {decision.status} — "
        + ", ".join(f"{k} {c[k]}" for k in CLASSES) + f" ({len(run.records)} prompts)",
    ]
    if run.fingerprint:
        fp = run.fingerprint
        lines.append(f"engine {fp.engine} [{fp.dtype}] spec {fp.spec_config}")
        note = fixture_note(fp.target.path).get("models")
        if note:
            lines.append(f"models: {note}")
    lines += [f"golden: {note}" for note in getattr(run, "golden_notes", None) or []]
    lines += [f"fleet: {note}" for note in getattr(run, "fleet_notes", None) or []]
    resumed = (getattr(run, "resumed_baselines", 0) or 0, getattr(run, "resumed_verdicts", 0) or 0)
    if any(resumed):
        lines.append(f"resumed: {resumed[0]} baseline(s) and {resumed[1]} verdict(s) from the interrupted run's journal")
    if run.threshold:
        lines.append(f"near-tie threshold: {run.threshold.describe()}")
        lines.append(f"cross-instance noise: {run.threshold.describe_cross()}")
        lines.append(f"latent drift: {drift_line(run)}")
    if unreported_line(run):
        lines.append(f"unreported rows: {unreported_line(run)}")
    if structured_line(run.records):
        lines.append(f"structured output: {structured_line(run.records)}")
    if run.scorer_check:
        lines.append(f"scorer check: {scorer_check_line(run)}")
    if run.scorer:
        lines.append(f"scorer: {run.scorer}")
    if run.concurrency > 1:
        lines.append(f"concurrency: {run.concurrency} requests in flight per phase")
    lines.append(f"near-tie policy: {near_tie_policy(run)}")
    lines += near_tie_lines(run, decision)
    act = run.activity()
    if act.reported_requests:
        mal = act.mean_accept_length
        lines.append(
            f"speculation: {act.accepted}/{act.proposed} draft tokens accepted over {act.verify_steps} verify steps"
            + (f", accept length {mal:.2f}" if mal is not None else "")
        )
    forced = reject_share(run)
    if forced is not None:
        lines.append(f"forced rejection: {forced.describe()}")
    header = f"  {'category':<14}{'n':>4}{'exact':>7}{'tie':>5}{'drift':>6}{'div':>5}{'err':>5}{'accept len':>12}"
    lines.append(header)
    for row in category_rows(run):
        lines.append(
            f"  {row.name:<14}{row.n:>4}{row.exact:>7}{row.near_tie:>5}{row.drifted:>6}{row.diverged:>5}{row.error:>5}"
            f"{row.accept_length:>12}"
        )
    taken = run.coverage.taken()
    if run.coverage.requests_with_steps:
        lines.append("paths (steps/prompts): " + ", ".join(f"{k} {v}/{run.coverage.prompts[k]}" for k, v in taken.items()))
    else:
        lines.append("paths: unknown (the engine reports no per-step records)")
    lines += [f"FAIL: {f}" for f in decision.failures]
    lines += [f"warning: {w}" for w in decision.warnings]
    return lines


# ------------------------------------------------------------------------------------------------
# The triage report: report.html (self-contained) and report.md (a PR comment)
# ------------------------------------------------------------------------------------------------

#: Characters of each full output shown under a non-exact prompt (a 128K-token output stays readable).
FULL_TEXT_CHARS = 4000
#: Characters of the prompt shown under a non-exact prompt.
PROMPT_CHARS = 600
#: The margin plot shows at most this many later non-argmax tokens per prompt (the first ones).
MAX_LATER_POINTS = 50
#: report.md details at most this many non-exact prompts (GitHub caps a comment at 65,536 characters).
MD_MAX_DETAILS = 20
MD_MAX_CHARS = 60_000

def visible(text: str | None) -> str:
    """Text with line breaks and tabs made visible (the line break is kept after its mark)."""
    return (text or "").replace("\r", "␍").replace("\t", "⇥").replace("\n", "⏎\n")


def _one_line(text: str | None) -> str:
    return (text or "").replace("\r", "␍").replace("\t", "⇥").replace("\n", "⏎")


def _clip(text: str, limit: int) -> tuple[str, int]:
    return (text, 0) if len(text) <= limit else (text[:limit], len(text) - limit)


@dataclass
class FlipView:
    """A non-exact (or never judged) prompt, ready to render."""

    id: str
    category: str
    klass: str
    reason: str
    prompt_text: str
    prompt_more: int
    tags: list[str]
    baseline_len: int | None
    spec_len: int | None
    baseline_finish: str
    spec_finish: str
    div: Any  # compare.Divergence | None
    context: str = ""
    split_base: str = ""
    split_spec: str = ""
    rest_base: str = ""
    rest_spec: str = ""
    checks: list[Check] = field(default_factory=list)
    tf: list[Any] = field(default_factory=list)  # compare.TFViolation
    tf_more: int = 0
    drift: Any = None  # compare.Drift | None
    baseline_text: str = ""
    baseline_more: int = 0
    spec_text: str = ""
    spec_more: int = 0
    baseline_error: str | None = None
    spec_error: str | None = None
    accept_length: float | None = None
    threshold: float | None = None
    baseline_from: str = "run"

    @property
    def anchor(self) -> str:
        return "p-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in self.id)


def _split_rest(tok: Any, after: str) -> tuple[str, str]:
    """(the split token's text, what follows it) from the decoded window that starts at the split."""
    if tok is None:
        return "", ""
    if after.startswith(tok.text):
        return tok.text, after[len(tok.text):]
    return tok.text, after  # a token that only decodes inside its neighbours (byte pieces)


def judgement(rec: PromptRecord, run: GateRun, decision: GateDecision | None = None) -> list[Check]:
    """Why a prompt got its class, step by step: the checks the comparison made
    (:func:`specparity.gate.decision.prompt_checks`), which the reports render as they are."""
    return prompt_checks(rec.verdict, run, decision)


def _prompt_text(p: Any) -> str:
    if p.prompt is not None:
        return p.prompt
    return "\n".join(f"[{role}] {content}" for role, content in (p.messages or ()))


def flip_views(run: GateRun, decision: GateDecision | None = None) -> list[FlipView]:
    """Every prompt that is not exact (near_tie, drifted, diverged, error, never judged), in run order."""
    out = []
    for rec in run.records:
        v = rec.verdict
        if v is not None and v.klass == "exact":
            continue
        p = rec.prompt
        ptext, pmore = _clip(_prompt_text(p), PROMPT_CHARS)
        base, spec = rec.baseline, rec.spec
        btext, bmore = _clip(base.text if base else "", FULL_TEXT_CHARS)
        stext, smore = _clip(spec.text if spec else "", FULL_TEXT_CHARS)
        f = FlipView(
            id=p.id, category=p.category, klass=v.klass if v else "not run",
            reason=v.reason if v else NEVER_JUDGED,
            prompt_text=ptext, prompt_more=pmore, tags=list(p.tags),
            baseline_len=len(base.output_ids) if base else None, spec_len=len(spec.output_ids) if spec else None,
            baseline_finish=base.finish_reason if base else "-", spec_finish=spec.finish_reason if spec else "-",
            div=v.divergence if v else None, checks=judgement(rec, run, decision),
            drift=v.drift if v else None, baseline_text=btext, baseline_more=bmore, spec_text=stext,
            spec_more=smore, baseline_error=base.error if base else None, spec_error=spec.error if spec else None,
            accept_length=spec.spec.mean_accept_length if spec else None, baseline_from=_baseline_from(rec),
        )
        if v is not None:
            f.threshold = v.threshold if v.klass != "error" else None
            f.tf, f.tf_more = v.tf_violations[:20], max(0, len(v.tf_violations) - 20)
        d = f.div
        if d is not None:
            f.context = d.context_before
            f.split_base, f.rest_base = _split_rest(d.baseline_token, d.baseline_after)
            f.split_spec, f.rest_spec = _split_rest(d.spec_token, d.spec_after)
        out.append(f)
    return out


@dataclass
class ClassRow:
    name: str
    counts: dict[str, int]
    not_run: int
    total: int


def class_table(run: GateRun) -> list[ClassRow]:
    """Prompts per class and category; the last row is the total."""
    rows = []
    for cat in run.categories() + [None]:
        recs = [r for r in run.records if cat is None or r.prompt.category == cat]
        counts = {k: sum(1 for r in recs if r.verdict is not None and r.verdict.klass == k) for k in CLASSES}
        rows.append(ClassRow(cat if cat is not None else "total", counts,
                             sum(1 for r in recs if r.verdict is None), len(recs)))
    return rows


@dataclass
class SpeedRow:
    """Decode speed without and with speculation over the prompts whose both runs succeeded and
    were timed: tokens / end-to-end request seconds (prefill included), summed over the prompts."""

    name: str
    klass: str = ""
    prompts: int = 0
    base_tokens: int = 0
    base_s: float = 0.0
    spec_tokens: int = 0
    spec_s: float = 0.0
    accept_length: float | None = None
    acceptance_rate: float | None = None
    verify_steps: int = 0

    @property
    def base_tps(self) -> float | None:
        return self.base_tokens / self.base_s if self.base_s > 0 else None

    @property
    def spec_tps(self) -> float | None:
        return self.spec_tokens / self.spec_s if self.spec_s > 0 else None

    @property
    def speedup(self) -> float | None:
        b, s = self.base_tps, self.spec_tps
        return s / b if b and s else None


def _baseline_from(rec: PromptRecord) -> str:
    return getattr(rec, "baseline_from", "run") or "run"


def _timed(rec: PromptRecord) -> bool:
    """Both runs succeeded and were timed here (a golden's baseline was timed elsewhere, at another time)."""
    b, s = rec.baseline, rec.spec
    return bool(b and s and not b.error and not s.error and b.wall_s > 0 and s.wall_s > 0
                and _baseline_from(rec) != "golden")


def speed_rows(run: GateRun) -> tuple[list[SpeedRow], list[SpeedRow]]:
    """(per category + a final total row, per prompt) speed rows."""
    cats = []
    for cat in run.categories() + [None]:
        row = SpeedRow(cat if cat is not None else "total")
        for r in run.records:
            if (cat is None or r.prompt.category == cat) and _timed(r):
                row.prompts += 1
                row.base_tokens += len(r.baseline.output_ids)
                row.base_s += r.baseline.wall_s
                row.spec_tokens += len(r.spec.output_ids)
                row.spec_s += r.spec.wall_s
        act = run.activity(cat)
        row.accept_length, row.acceptance_rate, row.verify_steps = (act.mean_accept_length, act.acceptance_rate,
                                                                    act.verify_steps)
        cats.append(row)
    prompts = []
    for r in run.records:
        if not _timed(r):
            continue
        st = r.spec.spec
        prompts.append(SpeedRow(
            r.prompt.id, r.verdict.klass if r.verdict else "not run", 1, len(r.baseline.output_ids),
            r.baseline.wall_s, len(r.spec.output_ids), r.spec.wall_s, st.mean_accept_length,
            st.accepted / st.proposed if st.available and st.proposed else None, st.verify_steps))
    return cats, prompts


def _nominal_block(run: GateRun) -> float | None:
    fp = run.fingerprint
    width = fp.spec_config.get("num_draft_tokens") if fp is not None and isinstance(fp.spec_config, dict) else None
    return float(width) + 1 if isinstance(width, (int, float)) and not isinstance(width, bool) and width > 0 else None


def accept_bars(run: GateRun) -> list[AcceptBar]:
    bars = []
    for cat in run.categories():
        pts = [(r.prompt.id, r.spec.spec.mean_accept_length) for r in run.records
               if r.prompt.category == cat and r.spec is not None and r.spec.spec.mean_accept_length is not None]
        bars.append(AcceptBar(cat, run.activity(cat).mean_accept_length, pts))
    return bars


def margin_points(run: GateRun) -> list[MarginPoint]:
    pts = []
    for r in run.records:
        v = r.verdict
        if v is None or v.divergence is None:
            continue
        d = v.divergence
        if d.baseline_token is None or d.spec_token is None:
            continue
        pts.append(MarginPoint(r.prompt.id, v.klass, d.baseline_margin, "split", d.position))
        later = [t for t in v.tf_violations if t.position > d.position][:MAX_LATER_POINTS]
        pts += [MarginPoint(r.prompt.id, v.klass, t.margin, "later", t.position) for t in later]
    return pts


def margin_lines(run: GateRun) -> list[RefLine]:
    th = run.threshold
    lines = []
    if th is not None:
        how = "--near-tie-nats" if th.source == "override" else "measured"
        lines.append(RefLine(th.nats, f"near-tie threshold {th.nats:.3g} ({how})", "#c62828"))
        if th.noise is not None and th.noise.pairs:
            lines.append(RefLine(th.noise.max_abs_delta, f"noise max {th.noise.max_abs_delta:.3g}", "#555", "6,4"))
            if th.noise.p99_abs_delta > 0 and th.noise.p99_abs_delta < th.noise.max_abs_delta * 0.8:
                lines.append(RefLine(th.noise.p99_abs_delta, f"noise p99 {th.noise.p99_abs_delta:.3g}", "#999", "2,3"))
    else:
        judged = [r.verdict.threshold for r in run.records
                  if r.verdict is not None and r.verdict.klass != "error" and r.verdict.threshold > 0]
        if judged:
            lines.append(RefLine(max(judged), f"near-tie threshold {max(judged):.3g} (from the verdicts)", "#c62828"))
    return lines


def launch_view(run: GateRun) -> tuple[str, list[tuple[str, str]]]:
    """(how the engine ran, in words; [(role, command)]) from the fingerprint."""
    fp = run.fingerprint
    if fp is None:
        return "unknown: the run stopped before the engine was fingerprinted", []
    extra = fp.extra if isinstance(fp.extra, dict) else {}
    launch = extra.get("launch")
    cmds = []
    if isinstance(launch, dict):
        for role, argvs in launch.items():
            for argv in argvs if isinstance(argvs, (list, tuple)) else [argvs]:
                cmds.append((str(role), argv if isinstance(argv, str) else " ".join(map(str, argv))))
    if cmds:
        return "servers launched by the gate", cmds
    urls = [u for key in ("baseline_urls", "spec_urls") for u in (extra.get(key) or [])]
    if launch is not None or urls:
        return ("servers already running, not launched by the gate (no launch command recorded)"
                + (f": {', '.join(map(str, urls))}" if urls else "")), []
    return "in-process engine: it ran inside the gate's own process (no launch command)", []


def _jsonish(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return str(value)


def fingerprint_rows(run: GateRun) -> list[tuple[str, str]]:
    fp = run.fingerprint
    if fp is None:
        return [("engine", "unknown (the run stopped before the engine was fingerprinted)")]
    rows = [("engine", f"{fp.engine} ({fp.engine_version})"), ("dtype", str(fp.dtype)),
            ("target", f"{fp.target.path} [{fp.target.kind or '-'}] sha256 {fp.target.sha256}")]
    if fp.draft is not None:
        rows.append(("draft", f"{fp.draft.path or '-'} [{fp.draft.kind or '-'}]"
                              + (f" sha256 {fp.draft.sha256}" if fp.draft.sha256 else "")))
    else:
        rows.append(("draft", "none (no separate draft model)"))
    rows.append(("spec config", _jsonish(fp.spec_config)))
    for k, val in sorted((fp.extra or {}).items()):
        if k != "launch":
            rows.append((f"extra: {k}", _jsonish(val)))
    return rows


def calibration_rows(run: GateRun) -> list[tuple[str, str]]:
    th = run.threshold
    rows = [("near-tie threshold", th.describe() if th else "not measured (the run stopped before calibration "
                                                                "ended, or nothing could be measured)")]
    if th is not None:
        rows.append(("source", "set by --near-tie-nats" if th.source == "override" else
                     f"measured: {th.multiplier:g} × the largest |Δmargin| between incremental decode and "
                     f"teacher-forced scoring of the baseline (and between the two server instances, up to what "
                     f"the allowance takes), over the pairs that can flip"))
        if th.noise is not None:
            n = th.noise
            rows.append(("within-instance noise", f"max |Δmargin| {n.max_abs_delta:.4g} nats, p99 {n.p99_abs_delta:.4g} "
                                           f"over {n.pairs} token pairs at {n.positions} positions"))
            rows.append(("noise on the pairs that can flip", n.describe_flip()))
        rows.append(("cross-instance noise", th.describe_cross()))
        rows.append(("ceiling", f"{th.ceiling:g} nats (a measured threshold above it is refused)"))
        if th.calibration:
            rows.append(("calibrated on", th.calibration))
    rows.append(("latent drift", drift_line(run)))
    rows.append(("teacher-forced scorer", run.scorer or "not chosen (the run stopped early)"))
    rows.append(("scorer check", scorer_check_line(run)))
    if run.calibration_records:
        bad = [r.prompt.id for r in run.calibration_records
               if r.baseline is None or r.baseline.error or r.tf_error]
        rows.append(("calibration-only prompts", f"{len(run.calibration_records)} run as baselines only"
                                                 + (f"; not measured: {', '.join(bad)}" if bad else "")))
    if run.calibration_error:
        rows.append(("calibration refused", run.calibration_error))
    return rows


def coverage_rows(run: GateRun) -> list[tuple[str, str, int, int, bool]]:
    taken = run.coverage.taken()
    known = run.coverage.requests_with_steps > 0
    return [(name, desc, taken[name], run.coverage.prompts[name], known and run.coverage.prompts[name] == 0)
            for name, desc in PATHS.items()]


def config_rows(run: GateRun) -> list[tuple[str, str]]:
    c = run.config
    return [
        ("prompts", f"{len(run.records)} judged" + (f" ({len(run.calibration_records)} more for calibration only)"
                                                   if run.calibration_records else "")),
        ("max_new_tokens", str(c.max_new_tokens or f"per prompt (default {DEFAULT_MAX_NEW_TOKENS})")),
        ("top-k recorded per position", str(c.top_k)),
        ("requests in flight per phase", str(run.concurrency)),
        ("calibration set", c.calibration + (" (--near-tie-nats set)" if c.near_tie_nats is not None else "")),
        ("policy", _jsonish(c.policy.to_json())),
    ]


def _counts_line(decision: GateDecision, n: int) -> str:
    return ", ".join(f"{k} {decision.counts.get(k, 0)}" for k in CLASSES) + f" ({n} prompts)"


def report_model(run: GateRun, decision: GateDecision, reproducers: Reproducers | None = None) -> dict[str, Any]:
    """Everything both triage templates show, computed once (``reproducers``: what was written, for
    the links; None: :func:`planned`)."""
    flips = flip_views(run, decision)
    speed, speed_prompts = speed_rows(run)
    how, launches = launch_view(run)
    act = run.activity()
    fp = run.fingerprint
    points = margin_points(run)
    return {
        "decision": decision,
        "status": decision.status,
        "counts_line": _counts_line(decision, len(run.records)),
        "near_tie_policy": near_tie_policy(run),
        "budget": decision.near_tie_budget,
        "fatal": run.fatal,
        "interrupted": run.interrupted,
        "calibration_error": run.calibration_error,
        "classes": CLASSES,
        "class_rows": class_table(run),
        "any_not_run": any(r.verdict is None for r in run.records),
        "flips": flips,
        "points": points,
        "margin_svg": margin_plot(points, margin_lines(run)) if points else None,
        "accept_svg": (accept_plot(accept_bars(run), nominal=_nominal_block(run))
                       if any(b.value is not None or b.prompts for b in accept_bars(run)) else None),
        "activity": act,
        "aggregate": run.aggregate,
        "counters_error": run.counters_error,
        "speed": speed,
        "speed_prompts": speed_prompts,
        "concurrency": run.concurrency,
        "engine": f"{fp.engine} [{fp.dtype}]" if fp is not None else "unknown engine",
        "fingerprint": fingerprint_rows(run),
        "launch_how": how,
        "launches": launches,
        "attachments": list(run.attachments),
        "calibration": calibration_rows(run),
        "threshold": run.threshold,
        "coverage": coverage_rows(run),
        "coverage_known": run.coverage.requests_with_steps > 0,
        "cov": run.coverage,
        "hist": sorted(run.coverage.accepted_hist.items()),
        "config": config_rows(run),
        "timings": sorted(run.timings.items()),
        "deterministic": run.deterministic,
        "golden_error": getattr(run, "golden_error", None),
        "golden_notes": list(getattr(run, "golden_notes", None) or []),
        "fleet_notes": list(getattr(run, "fleet_notes", None) or []),
        "resumed": (getattr(run, "resumed_baselines", 0) or 0, getattr(run, "resumed_verdicts", 0) or 0),
        "golden_baselines": sum(1 for r in run.records if _baseline_from(r) == "golden"),
        "no_speculation": bool(getattr(run.config, "golden", None))
        and getattr(run.config, "golden_mode", "spec") == "baseline",
        "reproducers": (reproducers if reproducers is not None else planned(run)).links(),
    }


def _fmt_num(x: float | None, spec: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _md(text: Any) -> str:
    """Inline markdown text: HTML-escaped (GitHub renders raw HTML), table pipes and code ticks safe,
    one line."""
    s = html.escape(str(text if text is not None else ""), quote=False)
    return _one_line(s).replace("|", "\\|").replace("`", "ˋ").replace("*", "\\*").replace("_", "\\_")


def _codespan(text: Any) -> str:
    """Text for an inline code span (literal: only a backtick could close it)."""
    return _one_line(str(text if text is not None else "")).replace("`", "ˋ")


def _h(text: Any) -> str:
    """Text inside raw HTML in markdown (``<summary>``): escaped, one line."""
    return html.escape(_one_line(str(text if text is not None else "")))


def _code(text: Any) -> str:
    """Text for a fenced code block: literal, so only a closing fence could escape it."""
    return str(text or "").replace("```", "ˋˋˋ")


@functools.lru_cache(maxsize=None)
def _report_env(autoescape: bool) -> jinja2.Environment:
    """One environment per escaping mode and process, for the compiled-template cache (see ``_env``)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=autoescape,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    filters: dict[str, Callable[..., Any]] = {
        "visible": visible, "token_shown": token_shown, "one_line": _one_line, "num": _fmt_num,
        "nats": _nats, "rank": _rank, "source": source_words, "md": _md, "code": _code, "cs": _codespan, "h": _h,
    }
    env.filters.update(filters)
    return env


def render_report_html(run: GateRun, decision: GateDecision, reproducers: Reproducers | None = None) -> str:
    """``report.html``: one self-contained page (inline CSS and SVG, nothing fetched)."""
    return _report_env(True).get_template("report.html.j2").render(
        css=Markup(_CSS), max_later=MAX_LATER_POINTS, **report_model(run, decision, reproducers))


def render_report_md(run: GateRun, decision: GateDecision, reproducers: Reproducers | None = None) -> str:
    """``report.md``: the triage report compactly, as GitHub markdown for a PR comment."""
    m = report_model(run, decision, reproducers)
    shown = m["flips"][:MD_MAX_DETAILS]
    text = _report_env(False).get_template("report.md.j2").render(
        shown=shown, hidden=len(m["flips"]) - len(shown), **m)
    while len(text) > MD_MAX_CHARS and shown:
        shown = shown[: len(shown) // 2]
        text = _report_env(False).get_template("report.md.j2").render(
            shown=shown, hidden=len(m["flips"]) - len(shown), **m)
    return text


_CSS = """
:root{--ok:#2e7d32;--tie:#e0a000;--drift:#8e24aa;--div:#c62828;--err:#616161;--fg:#1b1b1b;--muted:#666;
--line:#ddd;--bg2:#f6f7f9}
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",sans-serif;color:var(--fg);
margin:0;padding:0 24px 48px;line-height:1.45;font-size:14px;max-width:1240px}
h1{font-size:22px;margin:18px 0 6px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid var(--line);
padding-bottom:4px}h3{font-size:15px;margin:0}
code,pre,.mono{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12.5px}
pre{white-space:pre-wrap;word-break:break-word;background:var(--bg2);padding:8px;border-radius:4px;margin:4px 0}
table{border-collapse:collapse;margin:6px 0 10px}th,td{border:1px solid var(--line);padding:3px 8px;text-align:left;
vertical-align:top}th{background:var(--bg2);font-weight:600}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
tr.total td{font-weight:600;background:#fafafa}
.status{display:inline-block;padding:2px 12px;border-radius:4px;color:#fff;font-weight:700;letter-spacing:.5px}
.status-PASS{background:var(--ok)}.status-FAIL{background:var(--div)}.status-INTERRUPTED{background:#ef6c00}
.badge{display:inline-block;padding:0 7px;border-radius:9px;color:#fff;font-size:12px;font-weight:600}
.k-exact{background:var(--ok)}.k-near_tie{background:var(--tie)}.k-drifted{background:var(--drift)}
.k-diverged{background:var(--div)}.k-error{background:var(--err)}.k-not_run{background:#999}
td.zero{color:#bbb}
#flip-index code{white-space:nowrap}
nav{font-size:13px;margin:4px 0 8px;color:var(--muted)}nav a{margin-right:10px}
ul.why{margin:4px 0;padding-left:20px}ul.checks{list-style:none;padding-left:0;margin:6px 0}
ul.checks li{margin:3px 0;padding-left:22px;text-indent:-22px}
.card{border:1px solid var(--line);border-left:5px solid #999;border-radius:4px;padding:10px 12px;margin:12px 0}
.card.near_tie{border-left-color:var(--tie)}.card.diverged{border-left-color:var(--div)}
.card.drifted{border-left-color:var(--drift)}.card.error{border-left-color:var(--err)}
.reason{margin:6px 0}
table.streams{width:100%;table-layout:fixed}table.streams td{white-space:pre-wrap;word-break:break-word;
font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12.5px}
.ctx{color:#777}mark.split{background:#ffe082;outline:2px solid #e0a000;border-radius:2px;padding:0 1px;color:#000;
font-weight:700}mark.split.spec{background:#ffcdd2;outline-color:#c62828}
.note{color:var(--muted);font-size:12.5px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:10px}
details>summary{cursor:pointer;color:#1565c0}
svg.plot{max-width:100%;height:auto;background:#fff;border:1px solid var(--line);border-radius:4px}
.fail{color:var(--div)}.warn{color:#ef6c00}
.mark{display:inline-block;width:16px;height:16px;border-radius:8px;color:#fff;text-align:center;font-size:11px;
line-height:16px;font-weight:700;text-indent:0;margin-right:6px;font-family:"DejaVu Sans",sans-serif}
.mark-ok{background:var(--ok)}.mark-fail{background:var(--div)}.mark-warn{background:#ef6c00}.mark-info{background:#90a4ae}
"""


def structured_line(records: Sequence[PromptRecord]) -> str:
    """One line on the constrained prompts of a run for the terminal and the summary ("" when none):
    how many of each kind, and the JSON-schema outputs' checks on each side."""
    checked = [r.verdict.constraint for r in records if r.verdict is not None and r.verdict.constraint]
    if not checked:
        return ""
    parts = []
    schema = [c for c in checked if c["kind"] == "json_schema"]
    if schema:
        def tally(side: str) -> str:
            counts: dict[str, int] = {}
            for c in schema:
                status = (c.get(side) or {}).get("status", "not run")
                counts[status] = counts.get(status, 0) + 1
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))

        broken = sum(1 for c in schema if c.get("problem"))
        parts.append(f"{len(schema)} JSON-schema prompt(s): baseline {tally('baseline')}; speculative {tally('spec')}"
                     + (f"; {broken} broke their schema under speculation" if broken else ""))
    grammar = len(checked) - len(schema)
    if grammar:
        parts.append(f"{grammar} grammar prompt(s): constrained (judged by token identity)")
    return "; ".join(parts) + "; rows the constraint chose over the argmax are not judged on"
