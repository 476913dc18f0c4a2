"""The triage report's view data (``report.html``, ``report.md``): per-class tables, each flip with its context,
speeds, acceptance bars, margin plot points, fingerprint, calibration, coverage and configuration rows — built
once from a :class:`~specparity.model.gate_run.GateRun` and its decision, handed to the templates whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


from specparity.judge.checks import NEVER_JUDGED, Check
from specparity.model.verdicts import CLASSES
from specparity.model.coverage import PATHS
from specparity.gate.decision import (GateDecision, near_tie_policy, prompt_checks)
from specparity.report.plots import AcceptBar, MarginPoint, RefLine, accept_plot, margin_plot
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS, GateRun, PromptRecord
from specparity.report.reproducers import Reproducers, planned
from specparity.report.lines import drift_line, scorer_check_line


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


def one_line(text: str | None) -> str:
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
