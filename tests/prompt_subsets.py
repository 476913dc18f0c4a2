"""Smaller prompt files cut from ``prompts/default.jsonl`` for tests that exercise a mechanism
(selection, calibration, goldens, resume, policies) rather than measure the whole suite: the same
prompts, header and format, so a run reads them exactly as it reads the default file, and the fixture
models behave on them as in a full run. Callers derive every count from the prompts returned, never
from the size of the default suite."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import Prompt, load_prompts

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"
#: A short token budget (the suite's prompts ask for up to 48): still several draft blocks a prompt,
#: so speculation accepts drafts and a loop that corrupts its KV cache shows it on the math prompts.
SHORT = ("--max-new-tokens", "12")


def one_per_category(prompts: Iterable[Prompt]) -> list[Prompt]:
    """The first prompt of every category, in file order: each category still runs."""
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(p.category, p)
    return list(seen.values())


def write_subset(path: Path, keep: Callable[[dict], bool], source: Path = DEFAULT_PROMPTS) -> list[str]:
    """Write the header and the prompt lines of ``source`` whose JSON object ``keep`` accepts to
    ``path``; returns the kept ids in file order."""
    kept, lines = [], []
    for line in source.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "id" not in row:  # the header line
            lines.append(line)
        elif keep(row):
            lines.append(line)
            kept.append(row["id"])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return kept


def first_of_categories(path: Path, per_category: dict[str, int]) -> list[Prompt]:
    """Write the first ``per_category[c]`` prompts of each category ``c`` of the default suite to
    ``path``; returns the prompts as the gate will load them."""
    taken: dict[str, int] = {}

    def keep(row: dict) -> bool:
        category = row["category"]
        taken[category] = taken.get(category, 0) + 1
        return taken[category] <= per_category.get(category, 0)

    write_subset(path, keep)
    short = {c: n for c, n in per_category.items() if taken.get(c, 0) < n}
    assert not short, f"the default suite has fewer prompts than asked for in {short}"
    return load_prompts(path).prompts


def first_of_each(path: Path, categories: tuple[str, ...], per_category: int = 1) -> list[Prompt]:
    """The first ``per_category`` prompts of each of ``categories``, in file order."""
    return first_of_categories(path, {c: per_category for c in categories})


def rows_where(path: Path, keep: Callable[[dict], bool], limit: int | None = None) -> list[Prompt]:
    """The first ``limit`` prompts whose JSON line ``keep`` accepts (tags, fields), written to ``path``."""
    taken = 0

    def take(row: dict) -> bool:
        nonlocal taken
        if (limit is None or taken < limit) and keep(row):
            taken += 1
            return True
        return False

    kept = write_subset(path, take)
    if not kept:
        raise ValueError(f"no prompt of {DEFAULT_PROMPTS} is kept")
    return load_prompts(path).prompts
