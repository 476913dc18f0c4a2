"""Readable reports of a gate run: ``summary.md`` and the triage report (``report.html``, one
self-contained file, and ``report.md``, the same facts compactly for a PR comment), written from the
templates with the sentences of :mod:`specparity.report.lines` (which also holds the terminal table) and the
view data of :mod:`specparity.report.view`.

Everything here renders from a :class:`~specparity.model.gate_run.GateRun` and its
:class:`~specparity.gate.decision.GateDecision` alone — records, threshold, fingerprint, config, coverage,
timings — so a run rebuilt from ``results.jsonl`` renders the same report, and a run with pieces
missing (no threshold, interrupted, a fatal error, prompts without a speculative result) still
renders. docs/REPORT.md describes each section.
"""

from __future__ import annotations

import functools
import html
import traceback
from pathlib import Path
from typing import Any, Callable

import jinja2
from markupsafe import Markup

from specparity.judge.checks import source_words, token_shown
from specparity.judge.checks import rank_words as _rank
from specparity.model.verdicts import CLASSES
from specparity.model.coverage import PATHS
from specparity.model.locations import fixture_note
from specparity.gate.decision import (GateDecision, near_tie_policy, reject_share)
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS, GateRun
from specparity.report.reproducers import REPRODUCERS, INDEX, Reproducers, planned, write_reproducers
from specparity.report.lines import (category_rows, drift_line, near_tie_lines, scorer_check_line, structured_line,
                                     unreported_line)
from specparity.report.view import MAX_LATER_POINTS, MD_MAX_CHARS, MD_MAX_DETAILS, one_line, report_model, visible

_TEMPLATES = Path(__file__).parent / "templates"


SUMMARY = "summary.md"


REPORT_HTML = "report.html"


REPORT_MD = "report.md"


#: Files rendered from a run's journal: a new run removes them first (runner.ResultsWriter).
DERIVED_FILES = (SUMMARY, REPORT_HTML, REPORT_MD)


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


def _fmt_num(x: float | None, spec: str = ".1f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _md(text: Any) -> str:
    """Inline markdown text: HTML-escaped (GitHub renders raw HTML), table pipes and code ticks safe,
    one line."""
    s = html.escape(str(text if text is not None else ""), quote=False)
    return one_line(s).replace("|", "\\|").replace("`", "ˋ").replace("*", "\\*").replace("_", "\\_")


def _codespan(text: Any) -> str:
    """Text for an inline code span (literal: only a backtick could close it)."""
    return one_line(str(text if text is not None else "")).replace("`", "ˋ")


def _h(text: Any) -> str:
    """Text inside raw HTML in markdown (``<summary>``): escaped, one line."""
    return html.escape(one_line(str(text if text is not None else "")))


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
        "visible": visible, "token_shown": token_shown, "one_line": one_line, "num": _fmt_num,
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
