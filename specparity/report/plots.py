"""Inline SVG plots for the HTML triage report: no matplotlib, no JavaScript, nothing fetched.

Each function returns a :class:`markupsafe.Markup` ``<svg>`` element that the report template
places as is; every piece of text that comes from a run (prompt ids, categories) is escaped here.
The plots are deliberately plain: a reader must be able to check each number against the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from markupsafe import Markup, escape

#: One colour per class, shared with the report's CSS badges.
CLASS_COLORS = {
    "exact": "#2e7d32",
    "near_tie": "#e0a000",
    "drifted": "#8e24aa",
    "diverged": "#c62828",
    "error": "#616161",
}
_AXIS = "#444"
_GRID = "#ddd"
_FONT = "font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:11px"


@dataclass
class MarginPoint:
    """One margin to plot: the baseline's margin at a prompt's split, or a later teacher-forced
    violation's margin (``kind`` "split" / "later"); ``nats`` None: outside the top-k (unknown)."""

    prompt_id: str
    klass: str
    nats: float | None
    kind: str = "split"
    position: int | None = None


@dataclass
class RefLine:
    """A vertical reference line on the margin axis (the threshold, the measured noise)."""

    nats: float
    label: str
    color: str
    dash: str = ""  # SVG stroke-dasharray


def _e(text: object) -> str:
    return str(escape(str(text)))


def margin_plot(points: Sequence[MarginPoint], lines: Sequence[RefLine], width: int = 820) -> Markup:
    """Each flip's margin as a dot on a log axis (nats), with the reference lines.

    Two rows: the baseline's margin at the first split of each prompt, and the margins of later
    speculative tokens that are not the target's argmax under their own prefix (teacher-forced).
    A margin of exactly 0 (an exact tie) sits on the axis floor; a margin that is unknown (the other
    token outside the recorded top-k) sits in a column right of the axis.
    """
    rows = [("split", "margin at the split"), ("later", "later non-argmax tokens")]
    left, right_col, top, row_h = 170, 90, 44, 46
    plot_w = width - left - right_col - 10
    height = top + row_h * len(rows) + 44
    known = [p.nats for p in points if p.nats is not None and p.nats > 0]
    refs = [ln.nats for ln in lines if ln.nats > 0]
    vals = known + refs
    if vals:
        lo = 10 ** math.floor(math.log10(min(vals)) - 0.3)
        hi = 10 ** math.ceil(math.log10(max(vals)) + 0.3)
    else:
        lo, hi = 1e-3, 10.0
    if hi / lo < 100:
        hi = lo * 100
    llo, lhi = math.log10(lo), math.log10(hi)

    def x_of(v: float) -> float:
        v = min(max(v, lo), hi)
        return left + (math.log10(v) - llo) / (lhi - llo) * plot_w

    out = [
        f'<svg class="plot" id="margin-plot" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" style="{_FONT}">',
        "<title>Margins of all flips against the near-tie threshold and the measured noise</title>",
    ]
    y_axis = top + row_h * len(rows)
    # decades
    for d in range(int(round(llo)), int(round(lhi)) + 1):
        x = x_of(10.0 ** d)
        out.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{y_axis}" stroke="{_GRID}"/>')
        out.append(f'<text x="{x:.1f}" y="{y_axis + 14}" text-anchor="middle" fill="{_AXIS}">{_e(f"{10.0 ** d:g}")}</text>')
    out.append(f'<line x1="{left}" y1="{y_axis}" x2="{left + plot_w}" y2="{y_axis}" stroke="{_AXIS}"/>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{y_axis + 30}" text-anchor="middle" fill="{_AXIS}">'
               f"margin (nats, log scale): logprob of the baseline's token − logprob of the speculative token</text>")
    ux = left + plot_w + 10 + (right_col - 10) / 2
    out.append(f'<rect x="{left + plot_w + 10}" y="{top - 6}" width="{right_col - 10}" height="{y_axis - top + 6}" '
               f'fill="#f6f6f6"/>')
    out.append(f'<text x="{ux:.1f}" y="{y_axis + 14}" text-anchor="middle" fill="{_AXIS}">unknown</text>')
    out.append(f'<text x="{ux:.1f}" y="{y_axis + 26}" text-anchor="middle" fill="{_AXIS}">(outside top-k)</text>')
    # reference lines, labels staggered so close lines stay readable
    for j, ln in enumerate(sorted(lines, key=lambda line: line.nats)):
        if ln.nats <= 0:
            continue
        x = x_of(ln.nats)
        dash = f' stroke-dasharray="{ln.dash}"' if ln.dash else ""
        out.append(f'<line class="ref" x1="{x:.1f}" y1="{top - 8}" x2="{x:.1f}" y2="{y_axis}" stroke="{ln.color}" '
                   f'stroke-width="2"{dash}><title>{_e(ln.label)}</title></line>')
        y_lab = 12 + 13 * (j % 2)
        anchor = "end" if x > left + plot_w * 0.7 else "start"
        dx = -4 if anchor == "end" else 4
        out.append(f'<text x="{x + dx:.1f}" y="{y_lab}" text-anchor="{anchor}" fill="{ln.color}">{_e(ln.label)}</text>')
    for r, (kind, label) in enumerate(rows):
        yc = top + row_h * r + row_h / 2
        out.append(f'<text x="{left - 8}" y="{yc + 4:.1f}" text-anchor="end" fill="{_AXIS}">{_e(label)}</text>')
        out.append(f'<line x1="{left}" y1="{yc:.1f}" x2="{left + plot_w}" y2="{yc:.1f}" stroke="{_GRID}" '
                   f'stroke-dasharray="2,3"/>')
        mine = [p for p in points if p.kind == kind]
        if not mine:
            out.append(f'<text x="{left + 6}" y="{yc - 6:.1f}" fill="#888">none</text>')
        for i, p in enumerate(mine):
            jitter = ((i * 7) % 5 - 2) * 5
            if p.nats is None:
                cx = ux + ((i * 3) % 5 - 2) * 6
            else:
                cx = x_of(p.nats) if p.nats > 0 else left
            color = CLASS_COLORS.get(p.klass, "#000")
            where = f" at position {p.position}" if p.position is not None else ""
            val = "unknown (outside the top-k)" if p.nats is None else f"{p.nats:.6g} nats"
            tip = f"{p.prompt_id} ({p.klass}){where}: {val}"
            shape = (f'<circle class="dot dot-{_e(p.klass)}" cx="{cx:.1f}" cy="{yc + jitter:.1f}" r="5" fill="{color}" '
                     f'fill-opacity="0.8" stroke="#fff"' if kind == "split" else
                     f'<circle class="dot dot-{_e(p.klass)}" cx="{cx:.1f}" cy="{yc + jitter:.1f}" r="4" fill="none" '
                     f'stroke="{color}" stroke-width="1.5"')
            out.append(f"{shape}><title>{_e(tip)}</title></circle>")
    # legend
    lx = left
    for k in ("near_tie", "drifted", "diverged"):
        out.append(f'<circle cx="{lx}" cy="{height - 6}" r="4" fill="{CLASS_COLORS[k]}"/>')
        out.append(f'<text x="{lx + 8}" y="{height - 2}" fill="{_AXIS}">{k}</text>')
        lx += 80
    out.append("</svg>")
    return Markup("".join(out))


@dataclass
class AcceptBar:
    """A category's accept length (bar) and its prompts' own (dots)."""

    category: str
    value: float | None
    prompts: list[tuple[str, float]]


def accept_plot(bars: Sequence[AcceptBar], width: int = 820, nominal: float | None = None) -> Markup:
    """Accept length per category (bars) with each prompt's own accept length (dots).

    ``nominal``: the draft width + 1 (the most one verify step can emit), drawn as a line when known.
    """
    left, top, row_h, right = 150, 24, 26, 60
    plot_w = width - left - right
    height = top + row_h * max(1, len(bars)) + 40
    vals = [b.value for b in bars if b.value is not None] + [v for b in bars for _, v in b.prompts]
    hi = max(vals + ([nominal] if nominal else []) + [1.0])
    hi = math.ceil(hi + 0.25)

    def x_of(v: float) -> float:
        return left + v / hi * plot_w

    out = [
        f'<svg class="plot" id="accept-plot" role="img" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" style="{_FONT}">',
        "<title>Accept length per category (bars) and per prompt (dots)</title>",
    ]
    y_axis = top + row_h * max(1, len(bars))
    for t in range(0, hi + 1):
        x = x_of(t)
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{y_axis}" stroke="{_GRID}"/>')
        out.append(f'<text x="{x:.1f}" y="{y_axis + 14}" text-anchor="middle" fill="{_AXIS}">{t}</text>')
    out.append(f'<line x1="{left}" y1="{y_axis}" x2="{left + plot_w}" y2="{y_axis}" stroke="{_AXIS}"/>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{y_axis + 30}" text-anchor="middle" fill="{_AXIS}">accept length: '
               f"tokens emitted per verify step (bonus included)</text>")
    if nominal:
        x = x_of(nominal)
        out.append(f'<line x1="{x:.1f}" y1="{top - 10}" x2="{x:.1f}" y2="{y_axis}" stroke="#1565c0" stroke-width="1.5" '
                   f'stroke-dasharray="5,3"/>')
        out.append(f'<text x="{x - 4:.1f}" y="{top - 12}" text-anchor="end" fill="#1565c0">'
                   f"{_e(f'draft width + 1 = {nominal:g}')}</text>")
    for r, b in enumerate(bars):
        y = top + row_h * r
        out.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end" fill="{_AXIS}">'
                   f"{_e(b.category)}</text>")
        if b.value is not None:
            out.append(f'<rect class="bar" x="{left}" y="{y + 5}" width="{max(0.0, x_of(b.value) - left):.1f}" '
                       f'height="{row_h - 10}" fill="#90caf9"><title>{_e(b.category)}: {b.value:.3f}</title></rect>')
            out.append(f'<text x="{x_of(b.value) + 4:.1f}" y="{y + row_h / 2 + 4:.1f}" fill="#0d47a1">'
                       f"{b.value:.2f}</text>")
        else:
            out.append(f'<text x="{left + 4}" y="{y + row_h / 2 + 4:.1f}" fill="#888">no counters</text>')
        for i, (pid, v) in enumerate(b.prompts):
            jitter = ((i * 7) % 5 - 2) * 2
            out.append(f'<circle class="dot" cx="{x_of(v):.1f}" cy="{y + row_h / 2 + jitter:.1f}" r="3" fill="#0d47a1" '
                       f'fill-opacity="0.6"><title>{_e(pid)}: {v:.3f}</title></circle>')
    out.append("</svg>")
    return Markup("".join(out))
