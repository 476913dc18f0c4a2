"""Path coverage of a speculative loop: which of its code paths a run actually took.

A bug lives on one path: a rollback bug needs a partial accept, an overrun bug needs a block cut
by the token limit or a stop token, an accept-path bug needs fully accepted drafts. An exact match
on a run that never took the path proves nothing about it, so the summary names every path never
taken.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specparity.types import SpecStats, StepRecord

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


def classify_step(
    proposed_ids: Sequence[int],
    emitted_ids: Sequence[int],
    *,
    nominal_width: int,
    budget_before: int,
    stop_ids: Iterable[int],
) -> StepRecord:
    """Build a :class:`StepRecord` from what a loop proposed and what it appended.

    ``accepted`` counts leading draft tokens that made it into the output. The step is cut by the
    limit when the nominal block (draft width + bonus) did not fit in the tokens left, and cut by a
    stop token when a *drafted and accepted* token was a stop token (so the block ended inside).
    """
    stops = set(stop_ids)
    accepted = 0
    for p, e in zip(proposed_ids, emitted_ids):
        if p != e:
            break
        accepted += 1
    # In a correct loop the token after the accepted drafts is the target's own (bonus or
    # correction) and differs from the draft at that position, so the matching prefix is exactly
    # the accepted count. When every emitted token is an accepted draft, the block was truncated.
    cut = None
    if emitted_ids and accepted == len(emitted_ids):
        cut = "stop" if emitted_ids[-1] in stops else "limit"
    elif nominal_width + 1 > budget_before:
        cut = "limit"
    return StepRecord(len(proposed_ids), accepted, len(emitted_ids), cut)


@dataclass
class Coverage:
    steps: int = 0
    kinds: Counter = field(default_factory=Counter)
    accepted_hist: Counter = field(default_factory=Counter)  # accepted tokens per step -> count
    cut_limit: int = 0
    cut_stop: int = 0
    requests_with_steps: int = 0
    requests_without_steps: int = 0  # engine gave totals only

    def add(self, stats: SpecStats) -> None:
        if not stats.available:
            return
        if stats.steps is None:
            self.requests_without_steps += 1
            return
        self.requests_with_steps += 1
        for s in stats.steps:
            self.steps += 1
            self.kinds[step_kind(s)] += 1
            self.accepted_hist[s.accepted] += 1
            if s.cut == "limit":
                self.cut_limit += 1
            elif s.cut == "stop":
                self.cut_stop += 1

    def taken(self) -> dict[str, int]:
        return {
            "reject": self.kinds["none"],
            "partial": self.kinds["partial"],
            "all": self.kinds["all"],
            "cut_limit": self.cut_limit,
            "cut_stop": self.cut_stop,
        }

    def missing(self) -> list[str]:
        """Paths never taken; empty when the engine reports no per-step records (unknown, not missing)."""
        if self.requests_with_steps == 0:
            return []
        return [p for p, n in self.taken().items() if n == 0]

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "kinds": dict(self.kinds),
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "cut_limit": self.cut_limit,
            "cut_stop": self.cut_stop,
            "requests_with_steps": self.requests_with_steps,
            "requests_without_steps": self.requests_without_steps,
            "missing": self.missing(),
        }
