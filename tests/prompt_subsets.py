"""A few prompts of ``prompts/default.jsonl`` in a prompt file of their own.

A child ``pytest suites/lossless`` that checks how the gate ends (exit status, journal, summary)
needs prompts that take the path, not a whole category: every prompt costs a baseline and a
speculative decode, and with ``--calibration suite`` every prompt of the file costs one more. The
lines are copied verbatim, so the prompts are the suite's own, and the tests count from the file
they wrote, never from the size of ``prompts/default.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from specparity.fixtures import REPO_ROOT
from specparity.prompts import Prompt, load_prompts

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"


def write_subset(path: Path, keep: Callable[[dict], bool], limit: int | None = None) -> list[Prompt]:
    """Write the header of ``prompts/default.jsonl`` and its first ``limit`` prompt lines that
    ``keep`` accepts (each line as its JSON object) to ``path``; return the prompts as loaded."""
    header, *rows = [line for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    picked = [row for row in rows if keep(json.loads(row))][:limit]
    if not picked:
        raise ValueError(f"no prompt of {DEFAULT_PROMPTS} is kept")
    path.write_text("\n".join([header, *picked]) + "\n")
    return load_prompts(path).prompts


def first_of_each(path: Path, categories: tuple[str, ...], per_category: int = 1) -> list[Prompt]:
    """The first ``per_category`` prompts of each category, in file order."""
    seen: dict[str, int] = {}

    def keep(row: dict) -> bool:
        if row["category"] not in categories or seen.get(row["category"], 0) >= per_category:
            return False
        seen[row["category"]] = seen.get(row["category"], 0) + 1
        return True

    return write_subset(path, keep)
