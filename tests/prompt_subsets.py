"""Smaller prompt files cut from ``prompts/default.jsonl`` for tests that exercise a mechanism
(selection, calibration, batching) rather than measure the whole suite: the same prompts, header
and format, so a subprocess run reads them exactly as it reads the default file."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from specparity.fixtures import REPO_ROOT
from specparity.prompts import Prompt

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"


def one_per_category(prompts: Iterable[Prompt]) -> list[Prompt]:
    """The first prompt of every category, in file order: each category still runs."""
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(p.category, p)
    return list(seen.values())


def write_subset(path: Path, keep: Callable[[str, str], bool], source: Path = DEFAULT_PROMPTS) -> list[str]:
    """Write the header and the prompt lines of ``source`` for which ``keep(id, category)`` holds
    to ``path``; returns the kept ids in file order."""
    kept, lines = [], []
    for line in source.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "id" not in row:  # the header line
            lines.append(line)
        elif keep(row["id"], row.get("category")):
            lines.append(line)
            kept.append(row["id"])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return kept
