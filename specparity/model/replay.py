"""How often a failure reproduces: a failing prompt's speculative request sent again to the same servers.

Engine bugs on servers are often intermittent: a stray token that comes only when a request meets a
particular batch, a race between the scheduler and a rollback. A failure met once says nothing about
how often it comes back; a developer triaging it needs to know whether ``repro.sh`` will show it. So
after the judged phase, each prompt that failed as a stream — ``diverged``, or ``error`` because the
speculative request itself failed — is sent again, the same request to the same speculative server,
a bounded number of times (``--replay N``, :data:`DEFAULT_SERVER_REPLAYS` for server engines, none
for in-process engines, which decode deterministically), and each answer is compared token for token
with the failing one and with the baseline's. The verdict never changes: a failure that does not
come back is still a failure, now with the rate it reproduces at, in the summary and in its
reproducer's README.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Replays of each failing prompt for server engines when ``--replay`` is not given.
DEFAULT_SERVER_REPLAYS = 3
#: At most this many failing prompts are replayed (the first in run order); the rest are not.
MAX_REPLAYED_PROMPTS = 8
#: The verdict classes whose speculative request is replayed (an ``error`` only when that request failed).
REPLAYED = ("diverged", "error")


@dataclass
class Replay:
    """The answers to ``tries`` replays of one failing speculative request: the failing stream again
    (``same``: the failure reproduced), the baseline's stream (``baseline``), another stream (``other``),
    or a failed request (``failed``, with the first error)."""

    tries: int
    same: int = 0
    baseline: int = 0
    other: int = 0
    failed: int = 0
    first_error: str = ""
    #: The judged request failed: a replay reproduces it by failing too.
    of_error: bool = False
    #: Output positions where the ``other`` streams first differ from the failing one.
    other_positions: list[int] = field(default_factory=list)

    @property
    def reproduced(self) -> int:
        return self.failed if self.of_error else self.same

    def describe(self) -> str:
        """One line: how often the failure came back, and what the other answers were."""
        what = "the request failed again" if self.of_error else "the same speculative output came again"
        parts = []
        if self.baseline:
            parts.append(f"{self.baseline} the baseline's output")
        if self.other:
            where = f" (first differing from the failing one at position(s) {', '.join(map(str, self.other_positions))})" \
                if self.other_positions else ""
            parts.append(f"{self.other} another output{where}")
        if self.failed and not self.of_error:
            parts.append(f"{self.failed} failed ({self.first_error})")
        rest = f"; otherwise {', '.join(parts)}" if parts else ""
        return (f"reproduced {self.reproduced} of {self.tries} replay(s) against the same servers ({what}){rest}; "
                "the verdict stands either way")

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Replay":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
