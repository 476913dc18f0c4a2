"""Render verdicts as one table (probe, verdict, evidence, what to do).

``rich`` draws it; on a terminal with colour, otherwise as plain ASCII so CI logs and pipes stay
readable. Without ``rich`` a hand-made text table is printed instead.
"""

from __future__ import annotations

import io
import json
import shutil
from typing import Sequence, TextIO

from specparity.probes.finding import Status, Finding

_STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.UNKNOWN: "cyan"}


def _verdict_cell(v: Finding) -> str:
    text = f"{v.status.value.upper()}: {v.summary}"
    if v.message:
        text += f"\nengine says: {v.message}"
    return text


def _action_cell(v: Finding) -> str:
    parts = [v.action] if v.action else []
    if v.live_only:
        parts.append(f"live only: {v.live_only}")
    return "\n".join(parts) or "-"


def render_table(verdicts: Sequence[Finding], *, color: bool = False, width: int | None = None) -> str:
    """The table as a string; ``color`` only when writing to a terminal."""
    try:
        from rich import box
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency; keep a floor anyway
        return render_plain(verdicts)
    table = Table(box=box.ROUNDED if color else box.ASCII, show_lines=True, expand=False)
    for col, ratio in (("probe", 1), ("verdict", 3), ("evidence", 5), ("what to do", 3)):
        table.add_column(col, ratio=ratio, overflow="fold")
    for v in verdicts:
        table.add_row(  # evidence quotes source text: "[...]" must not be read as rich markup
            escape(v.probe),
            escape(_verdict_cell(v)),
            escape("\n".join(f"- {e}" for e in v.evidence) or "-"),
            escape(_action_cell(v)),
            style=_STYLE[v.status] if color else None,
        )
    width = width or max(shutil.get_terminal_size((160, 40)).columns, 100)
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, color_system="standard" if color else None,
                      highlight=False, soft_wrap=False)
    console.print(table)
    return buf.getvalue()


def render_plain(verdicts: Sequence[Finding]) -> str:
    """A dependency-free fallback: one block per probe."""
    return "\n\n".join(v.render() for v in verdicts) + "\n"


def render_json(verdicts: Sequence[Finding]) -> str:
    return json.dumps([v.to_json() for v in verdicts], indent=2) + "\n"


def print_report(verdicts: Sequence[Finding], out: TextIO, fmt: str = "table") -> None:
    if fmt == "json":
        out.write(render_json(verdicts))
        return
    is_tty = bool(getattr(out, "isatty", lambda: False)())
    out.write(render_table(verdicts, color=is_tty))
