"""What the speculative servers served while their run-wide draft counters were read.

An engine that reports speculation only as server-wide counters (vLLM's ``/metrics``) cannot tell
this run's drafts from another client's: every request the server decodes moves them. So with the
draft counters it reads the server's own count of finished requests and generated tokens, and its
own count of the requests it sent those servers and the tokens their answers carried. Read before
and after the speculative phase, the two deltas agree only when nothing else was decoded there
(:func:`specparity.judge.traffic.unattributed` compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Traffic:
    """One reading, taken with the draft counters.

    ``finished`` / ``generated``: the servers' own totals of finished requests and generated tokens
    (None: a server does not expose them); ``own_finished`` / ``own_generated``: the requests this
    engine sent the same servers and got an answer to, and the tokens those answers carried;
    ``source``: which counters, where."""

    finished: int | None
    generated: int | None
    own_finished: int
    own_generated: int
    source: str = ""

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: Any) -> "Traffic | None":
        if not isinstance(data, dict):
            return None
        return cls(data.get("finished"), data.get("generated"), int(data.get("own_finished", 0)),
                   int(data.get("own_generated", 0)), str(data.get("source", "")))
