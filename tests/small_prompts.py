"""Small prompt files cut from prompts/default.jsonl, so that the gate's end-to-end tests exercise a
feature (goldens, resume, policies) on a few prompts instead of decoding the whole suite each time.

The prompts are the suite's own (the first ones of each category asked for, in file order), so the
fixture models behave on them as they do in a full run; callers derive every count from the prompts
returned, never from the size of the default suite.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from specparity.fixtures import REPO_ROOT
from specparity.prompts import Prompt, load_prompts

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"
#: A short token budget (the suite's prompts ask for up to 48): still several draft blocks a prompt,
#: so speculation accepts drafts and a loop that corrupts its KV cache shows it on the math prompts.
SHORT = ("--max-new-tokens", "12")


def write_subset(path: Path, per_category: dict[str, int]) -> list[Prompt]:
    """Write the first ``per_category[c]`` prompts of each category ``c`` of the default suite (its
    header line kept) to ``path``; returns the prompts as the gate will load them."""
    header, *rest = [line for line in DEFAULT_PROMPTS.read_text().splitlines() if line.strip()]
    taken: Counter[str] = Counter()
    chosen = []
    for line in rest:
        category = json.loads(line)["category"]
        if taken[category] < per_category.get(category, 0):
            taken[category] += 1
            chosen.append(line)
    short = {c: n for c, n in per_category.items() if taken[c] < n}
    assert not short, f"the default suite has fewer prompts than asked for in {short}"
    path.write_text("\n".join([header, *chosen]) + "\n")
    return load_prompts(path).prompts
