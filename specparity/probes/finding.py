"""The one result type every probe returns, static or live: a :class:`Finding` (the gate's per-prompt
result is :class:`specparity.judge.compare.Verdict`; a probe finds facts about a deploy, it judges no tokens).

A probe answers a deploy question ("will this draft be silently rejected?") with a status, the
facts that led to it (tensor names and shapes, config keys, engine source lines) and what to do.
``unknown`` is an honest answer, not a pass: it says what could not be checked and why, and the
CLI exits zero on it so that a missing engine source never blocks a deploy by itself — unless a
policy file is given (``--policy``, as ``ci/gate.sh`` does): then an unknown fails unless the policy's
``allow_unknown`` names that probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"  # works, but with a limit the operator should know (e.g. concurrency capped to 1)
    FAIL = "fail"  # predicted failure: crash, refusal, or silent acceptance collapse
    UNKNOWN = "unknown"


@dataclass
class Finding:
    """One probe's answer.

    ``message`` is the engine's own error text when the failure is one the engine reports
    (quoted from its source), so an operator can grep logs for it. ``live_only`` says what only a
    run against the live engine can confirm.
    """

    probe: str
    status: Status
    summary: str
    evidence: list[str] = field(default_factory=list)
    action: str = ""
    message: str | None = None
    live_only: str | None = None
    #: The verdict follows from the checkpoint alone (e.g. "not a hybrid: no mamba slots"), so it
    #: holds for every engine version, read or not.
    engine_independent: bool = False

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL

    def render(self) -> str:
        """Multi-line text for pytest failure output and logs."""
        lines = [f"[{self.status.value}] {self.probe}: {self.summary}"]
        if self.message:
            lines.append(f"  engine message: {self.message}")
        lines += [f"  - {e}" for e in self.evidence]
        if self.action:
            lines.append(f"  what to do: {self.action}")
        if self.live_only:
            lines.append(f"  only a live run shows: {self.live_only}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "status": self.status.value,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "action": self.action,
            "message": self.message,
            "live_only": self.live_only,
            "engine_independent": self.engine_independent,
        }


def ok(probe: str, summary: str, evidence: list[str] | None = None, **kw: Any) -> Finding:
    return Finding(probe, Status.OK, summary, evidence or [], **kw)


def warn(probe: str, summary: str, evidence: list[str] | None = None, **kw: Any) -> Finding:
    return Finding(probe, Status.WARN, summary, evidence or [], **kw)


def fail(probe: str, summary: str, evidence: list[str] | None = None, **kw: Any) -> Finding:
    return Finding(probe, Status.FAIL, summary, evidence or [], **kw)


def unknown(probe: str, summary: str, evidence: list[str] | None = None, **kw: Any) -> Finding:
    return Finding(probe, Status.UNKNOWN, summary, evidence or [], **kw)


def worst(verdicts: list[Finding]) -> Status:
    """The status that decides an exit code: fail > warn > unknown > ok."""
    order = [Status.FAIL, Status.WARN, Status.UNKNOWN, Status.OK]
    present = {v.status for v in verdicts}
    return next((s for s in order if s in present), Status.OK)
