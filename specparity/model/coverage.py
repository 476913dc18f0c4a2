"""Path coverage of a speculative loop: which of its code paths a run actually took.

A bug lives on one path: a rollback bug needs a partial accept, an overrun bug needs a block cut
by the token limit or a stop token, an accept-path bug needs fully accepted drafts. An exact match
on a run that never took the path proves nothing about it, so the summary names every path never
taken.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from specparity.model.types import SpecStats, StepRecord

#: Outcome of one verify step.
STEP_KINDS = ("no_draft", "none", "partial", "all")
#: The paths the summary checks, with the outcome that exercises each.
PATHS = {
    "reject": "a verify step that accepted none of its draft tokens",
    "partial": "a partial accept (rollback of the rejected tail)",
    "all": "a fully accepted draft block (bonus token path)",
    "cut_limit": "a block cut by max_new_tokens",
    "cut_stop": "a block cut by a stop token inside it",
}


def step_kind(step: StepRecord) -> str:
    if step.proposed == 0:
        return "no_draft"
    if step.accepted == 0:
        return "none"
    return "all" if step.accepted >= step.proposed else "partial"


@dataclass
class Coverage:
    steps: int = 0
    kinds: Counter = field(default_factory=Counter)
    accepted_hist: Counter = field(default_factory=Counter)  # accepted tokens per step -> count
    cut_limit: int = 0
    cut_stop: int = 0
    requests_with_steps: int = 0
    requests_without_steps: int = 0  # engine gave totals only
    #: path -> requests (prompts) that took it at least once: a bug on a path needs prompts that
    #: reach it, and a path reached by a single prompt is one prompt edit away from untested.
    prompts: Counter = field(default_factory=Counter)

    def add(self, stats: SpecStats) -> None:
        if not stats.available:
            return
        if stats.steps is None:
            self.requests_without_steps += 1
            return
        self.requests_with_steps += 1
        before = self.taken()
        for s in stats.steps:
            self.steps += 1
            self.kinds[step_kind(s)] += 1
            self.accepted_hist[s.accepted] += 1
            if s.cut == "limit":
                self.cut_limit += 1
            elif s.cut == "stop":
                self.cut_stop += 1
        for path, n in self.taken().items():
            if n > before[path]:
                self.prompts[path] += 1

    def taken(self) -> dict[str, int]:
        return {
            "reject": self.kinds["none"],
            "partial": self.kinds["partial"],
            "all": self.kinds["all"],
            "cut_limit": self.cut_limit,
            "cut_stop": self.cut_stop,
        }

    def missing(self, min_prompts: int = 1) -> list[str]:
        """Paths taken on fewer than ``min_prompts`` prompts; empty when the engine reports no
        per-step records (unknown, not missing)."""
        if self.requests_with_steps == 0:
            return []
        return [p for p in PATHS if self.prompts[p] < min_prompts]

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "kinds": dict(self.kinds),
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "cut_limit": self.cut_limit,
            "cut_stop": self.cut_stop,
            "requests_with_steps": self.requests_with_steps,
            "requests_without_steps": self.requests_without_steps,
            "prompts": {p: self.prompts[p] for p in PATHS},
            "missing": self.missing(),
        }
