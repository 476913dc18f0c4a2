"""A run's run-level state: what the servers declared, which checks they could not make, and the run-wide
counters — defined once, for every face that writes, reads or combines a run.

The per-prompt verdicts are not all a run decides by. :func:`specparity.gate.decision.decide` also reads
facts about the run as a whole: the determinism declarations (bit-exact or not, and whether an unknown is
strict under a policy), the checks the engine had to skip (failures under a policy), and the run-wide
draft counters with their attribution (the activity of an engine that counts only in aggregate). A run
that is split (``--shard I/N``, the Ray face) and merged must carry every one of them, or the merge decides
something the whole run would not: a declaration unknown on one side makes the whole run strict under a
policy and a merge that forgot it passes.

:class:`RunState` is that state. The runner fills it from the engine, the journal holds it (the ``run``
line's ``capabilities`` and ``skipped_checks``, the ``aggregate_counters`` line), :func:`RunState.from_journal`
reads it back for ``specparity report`` and ``merge``, and :meth:`RunState.merge` combines the states of the
parts of one run. :class:`~specparity.model.gate_run.GateRun` keeps the fields themselves (the gate and the
reports read ``run.deterministic``); :meth:`RunState.of` and :meth:`RunState.apply` move all of them at once,
so no command copies them one by one.

**Merging** is the rule the engine applies to its servers, applied to the parts' states, so that any
split of a run decides what the whole run decides (``tests/test_run_state.py`` holds it as a property):

* declarations: deterministic only when every part declares it for both its sides; declared on some parts
  and unknown on the others (none saying it is off) is *unknown* — strict under a policy; declared
  anywhere and not everywhere otherwise is *partial* — reported, never strict;
* skipped checks: every part's, once each;
* counters: counters that one part could not attribute to the run (other traffic on its servers) make the
  run's unattributed; counters one part could not read make the run's activity unknown — except for a
  part whose server pair was lost and whose unfinished prompts were rerun elsewhere (``excused``), whose
  missing reading is named in a note; otherwise the sum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from specparity.model.types import SpecStats

#: The declaration fields, as the engine's capabilities name them (``specparity.engines.base.Capabilities``).
DECLARATIONS = ("deterministic", "deterministic_partial", "deterministic_unknown")
#: The kind of the journal line that holds the run-wide counters.
COUNTERS_KIND = "aggregate_counters"


@dataclass
class RunState:
    """The run-level facts :func:`~specparity.gate.decision.decide` reads besides the verdicts (see the
    module docstring for what each means and how parts combine)."""

    #: Deterministic / batch-invariant inference declared for both sides, with where it was read.
    deterministic: str | None = None
    #: A declaration that does not cover both sides: reported, never strict.
    deterministic_partial: str | None = None
    #: Declared on some servers, unknown on the others: strict under a policy.
    deterministic_unknown: str | None = None
    #: Checks the engine had to skip, in words.
    skipped_checks: list[str] = field(default_factory=list)
    #: The run-wide counters (engines that count only in aggregate), when read and this run's alone.
    aggregate: SpecStats | None = None
    #: Why the run-wide counters could not be read.
    counters_error: str | None = None
    #: Why the run-wide counters, read, are not this run's alone.
    aggregate_unattributed: str | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, run: Any) -> "RunState":
        """The state a :class:`~specparity.model.gate_run.GateRun` holds."""
        values = {name: getattr(run, name) for name in cls.names()}
        values["skipped_checks"] = list(values["skipped_checks"])
        return cls(**values)

    def apply(self, run: Any) -> None:
        """Set every run-level field of ``run`` from this state."""
        for name in self.names():
            value = getattr(self, name)
            setattr(run, name, list(value) if isinstance(value, list) else value)

    # ------------------------------------------------------------------ the journal
    def declarations(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in DECLARATIONS}

    def run_line(self, capabilities: dict[str, Any] | None = None) -> dict[str, Any]:
        """The fields of the journal's ``run`` line this state owns: the engine's ``capabilities`` (as the
        engine declared them; the declarations replaced by this state's) and the skipped checks."""
        return {"capabilities": {**(capabilities or {}), **self.declarations()},
                "skipped_checks": list(self.skipped_checks)}

    def counters_line(self, counted: SpecStats | None = None, **extra: Any) -> dict[str, Any] | None:
        """The ``aggregate_counters`` line (None: no counters were read or tried). ``counted``: what the
        counters said when they do not count for the run (unattributed), kept for the reader; ``extra``:
        what the runner adds (the traffic snapshots)."""
        if self.counters_error:
            return {"kind": COUNTERS_KIND, "error": self.counters_error}
        if self.aggregate_unattributed:
            return {"kind": COUNTERS_KIND, **(counted.to_json() if counted is not None else {}),
                    "unattributed": self.aggregate_unattributed, **extra}
        if self.aggregate is not None:
            return {"kind": COUNTERS_KIND, **self.aggregate.to_json(), "unattributed": None, **extra}
        return None

    @classmethod
    def from_journal(cls, header: dict[str, Any], counters: dict[str, Any] | None) -> "RunState":
        """The state a journal holds: its ``run`` line (``header``, merged over resumed segments) and its
        last ``aggregate_counters`` line (None: none)."""
        caps = header.get("capabilities") or {}
        state = cls(**{name: caps.get(name) for name in DECLARATIONS},
                    skipped_checks=list(header.get("skipped_checks") or []))
        if counters is not None:
            if counters.get("error"):
                state.counters_error = counters["error"]
            elif counters.get("unattributed"):
                state.aggregate_unattributed = counters["unattributed"]
            else:
                state.aggregate = SpecStats.from_json(counters)
        return state

    # ------------------------------------------------------------------ parts of one run
    @classmethod
    def merge(cls, parts: Sequence[tuple[str, "RunState"]],
              excused: frozenset[str] = frozenset()) -> tuple["RunState", list[str]]:
        """The state of the run the ``parts`` (``(name, state)``) are a split of, and notes on what was left
        out (a lost pair's unread counters, ``excused`` by name)."""
        notes: list[str] = []
        merged = cls(skipped_checks=list(dict.fromkeys(c for _, s in parts for c in s.skipped_checks)))
        _merge_declarations(merged, parts)
        unattributed = [(n, s.aggregate_unattributed) for n, s in parts if s.aggregate_unattributed]
        unread = [(n, s.counters_error) for n, s in parts if s.counters_error and n not in excused]
        notes += [f"run-wide counters of {n} not read (its server pair was lost; its unfinished prompts were rerun "
                  f"elsewhere), left out of the activity: {s.counters_error}"
                  for n, s in parts if s.counters_error and n in excused]
        read = [s.aggregate for _, s in parts if s.aggregate is not None]
        if unattributed:
            merged.aggregate_unattributed = _joined(unattributed, len(parts))
        elif unread:
            merged.counters_error = _joined(unread, len(parts))
        elif read:
            merged.aggregate = SpecStats(available=True, proposed=sum(a.proposed for a in read),
                                         accepted=sum(a.accepted for a in read),
                                         verify_steps=sum(a.verify_steps for a in read),
                                         source=read[0].source if len(parts) == 1 else
                                         f"the sum of {len(read)} part(s)' {read[0].source}")
        if (unattributed or unread) and read:
            notes.append(f"run-wide counters of {len(read)} part(s) were read but do not count: "
                         + ("other traffic on " if unattributed else "unread counters of ")
                         + ", ".join(n for n, _ in (unattributed or unread))
                         + " leave the run's activity unknown")
        return merged, notes


def _joined(named: Sequence[tuple[str, str]], parts: int) -> str:
    """One part's words as they are (a split into one part is the run); several, each after its name."""
    if parts == 1:
        return named[0][1]
    return "; ".join(f"{name}: {text}" for name, text in named)


def _merge_declarations(merged: RunState, parts: Sequence[tuple[str, RunState]]) -> None:
    """The engine's rule over its servers (``specparity.engines.server.engine.declared_on_every_server`` and
    ``declaration_unknown``), over the parts: each part is "on" (declared for both its sides), "unknown",
    "partial" or off."""
    on = [(n, s.deterministic) for n, s in parts if s.deterministic]
    unknown = [(n, s.deterministic_unknown) for n, s in parts if not s.deterministic and s.deterministic_unknown]
    partial = [(n, s.deterministic_partial) for n, s in parts
               if not s.deterministic and not s.deterministic_unknown and s.deterministic_partial]
    if len(on) == len(parts):
        merged.deterministic = _unique(on, len(parts))
    elif (on or unknown) and len(on) + len(unknown) == len(parts):
        merged.deterministic_unknown = _unique(unknown + [(n, f"declared: {t}") for n, t in on], len(parts))
    elif on or unknown or partial:
        off = [n for n, s in parts if not (s.deterministic or s.deterministic_unknown or s.deterministic_partial)]
        said = on + unknown + partial
        merged.deterministic_partial = (_unique(said, len(parts))
                                        + (f"; not declared on {', '.join(off)}" if off else ""))


def _unique(named: Sequence[tuple[str, str]], parts: int) -> str:
    """The parts' words once when they all say the same (one run's servers), else each after its name."""
    texts = list(dict.fromkeys(text for _, text in named))
    if len(texts) == 1 and len(named) == parts:
        return texts[0]
    return _joined(named, parts)
