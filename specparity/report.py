"""Readable summaries of a gate run: ``summary.md`` and the terminal table.

The full HTML triage report is a later piece; it will read the same ``results.jsonl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from specparity.compare import CLASSES
from specparity.coverage import PATHS
from specparity.gate import GateDecision, near_tie_policy
from specparity.noise import DRIFT_MULTIPLIER
from specparity.records import DEFAULT_MAX_NEW_TOKENS, GateRun

_TEMPLATES = Path(__file__).parent / "templates"
SUMMARY = "summary.md"
#: Files rendered from a run's journal: a new run removes them first (runner.ResultsWriter).
DERIVED_FILES = (SUMMARY,)


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


def _rank(x: int | None) -> str:
    return "outside top-k" if x is None else str(x)


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # markdown, not HTML
    )
    env.filters.update(tok=_tok, esc=_esc, nats=_nats, rank=_rank)
    return env


def drift_line(run: GateRun) -> str:
    """How latent drift was checked, in one line (the summary and the terminal say it)."""
    bound = run.threshold.drift_nats if run.threshold else None
    if bound is None:
        return "not checked (no noise was measured)"
    judged = [r.verdict for r in run.records if r.verdict is not None and r.verdict.drift is not None]
    unchecked = sum(1 for v in judged if v.drift.checked == 0)
    worst = max((v.drift.max_nats for v in judged if v.drift.max_nats is not None), default=None)
    line = (f"bound {bound:.3g} nats ({DRIFT_MULTIPLIER:g} × the measured max |Δmargin|, whatever --near-tie-nats says); "
            f"rows compared on {len(judged) - unchecked} prompt(s)")
    if worst is not None:
        line += f", largest drift {worst:.3g} nats"
    if unchecked:
        line += (f"; not checked on {unchecked} prompt(s): the engine reported no per-position logprobs for the "
                 f"speculative run there")
    return line


def scorer_check_line(run: GateRun) -> str:
    c = run.scorer_check
    if not c:
        return "not run"
    if not c["clear_positions"]:
        return "nothing to check: no baseline position had a clear margin"
    verdict = "passed" if c["passed"] else "FAILED"
    return (f"{verdict}: the scorer's argmax is the baseline's token at {c['clear_positions'] - c['disagreements']} of "
            f"{c['clear_positions']} positions whose decode margin exceeds {c['clear_nats']:g} nats")


def render_summary_md(run: GateRun, decision: GateDecision) -> str:
    details = []
    for r in run.records:
        v = r.verdict
        if v is None or v.klass == "exact":
            continue
        details.append({"id": r.prompt.id, "klass": v.klass, "reason": v.reason, "div": v.divergence,
                        "tf": v.tf_violations, "drift": v.drift})
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
        scorer_check=scorer_check_line(run),
        calibration_error=run.calibration_error,
        coverage=run.coverage,
        details=details,
        timings=sorted(run.timings.items()),
        scorer=run.scorer or "not chosen (the run stopped early)",
        concurrency=run.concurrency,
        attachments=run.attachments,
        fatal=run.fatal,
        near_tie_policy=near_tie_policy(run),
    )


class _UnknownFingerprint:
    engine = engine_version = dtype = "unknown"
    spec_config: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    draft = None

    class target:  # noqa: N801 - mirrors Fingerprint.target
        path = kind = sha256 = "unknown"


def write_reports(run: GateRun, decision: GateDecision, report_dir: str | Path) -> Path:
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SUMMARY
    path.write_text(render_summary_md(run, decision), encoding="utf-8")
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
    if run.threshold:
        lines.append(f"near-tie threshold: {run.threshold.describe()}")
        lines.append(f"latent drift: {drift_line(run)}")
    if run.scorer_check:
        lines.append(f"scorer check: {scorer_check_line(run)}")
    if run.scorer:
        lines.append(f"scorer: {run.scorer}")
    if run.concurrency > 1:
        lines.append(f"concurrency: {run.concurrency} requests in flight per phase")
    lines.append(f"near-tie policy: {near_tie_policy(run)}")
    act = run.activity()
    if act.reported_requests:
        mal = act.mean_accept_length
        lines.append(
            f"speculation: {act.accepted}/{act.proposed} draft tokens accepted over {act.verify_steps} verify steps"
            + (f", accept length {mal:.2f}" if mal is not None else "")
        )
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
