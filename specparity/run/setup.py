"""What one gate command is given, once its options are checked (:class:`GateSetup`), and the one error a bad
option raises (:class:`BadInput`): the faces (:mod:`specparity.cli.options`) build them, the run reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from specparity.engines import Factory
from specparity.engines.base import EngineOptions
from specparity.model.gate_run import GateConfig, GatePolicy
from specparity.model.prompts import Prompt
from specparity.model.shards import ShardPlan
from specparity.run.golden import Golden
from specparity.run.journal import Journal

class BadInput(ValueError):
    """An option, path, engine or prompt file the gate cannot use; the message is one line."""


@dataclass
class GateSetup:
    """Everything a gate run needs, validated: the engine (resolved, not built), its options, the
    run configuration and the selected prompts."""

    engine_spec: str
    factory: Factory
    engine_options: EngineOptions
    config: GateConfig
    prompts: list[Prompt] = field(default_factory=list)
    #: The prompts the noise is measured on (None: the selected prompts themselves).
    calibration: list[Prompt] | None = None
    #: The golden named by --golden, read and checked (None: none there yet, or no --golden).
    golden: Golden | None = None
    #: The journal --resume continues (None: a new run).
    resume: Journal | None = None
    #: Where each counter-dependent rule was set (``--require-all-paths`` or ``FILE: require_all_paths``),
    #: for the refusal :func:`check_counters` words after an engine whose counters were unknown loads.
    policy_origin: dict[str, str] = field(default_factory=dict)
    #: The engine does not declare its counters statically (a plugin): :func:`check_counters` runs
    #: once it is built, before any prompt (:func:`specparity.run.gate_command.execute`).
    counters_pending: bool = False
    #: ``--shard I/N``: the whole run's prompts and this shard's share (``prompts`` and ``calibration``
    #: then hold the share only); None for a whole run.
    plan: ShardPlan | None = None


#: Which counter kinds (engines.base.Capabilities.counters) can check each counter-dependent rule:
#: the paths a verify step took need per-step records; a mean accept length needs emitted tokens
#: and verify steps, which per-request totals and run-wide aggregates (read around the speculative
#: phase) also give; an engine that reports no counters can check neither.
COUNTERS_FOR = {
    "require_all_paths": ("steps",),
    "min_accept_length": ("steps", "request", "aggregate"),
}


COUNTER_KINDS = {"steps": "per-verify-step records", "request": "per-request totals only",
                 "aggregate": "run-wide aggregate counters only", "none": "no speculation counters"}


def check_counters(policy: GatePolicy, counters: str, engine: str, origin: Mapping[str, str]) -> None:
    """Refuse a rule the engine's counters cannot check (:data:`COUNTERS_FOR`): one line naming
    where the rule was set, what the engine reports and how to fix it. A rule that cannot be
    checked is never a warning with a pass."""
    wanted = {"require_all_paths": policy.require_paths > 0, "min_accept_length": policy.min_accept_length is not None}
    for key, kinds in COUNTERS_FOR.items():
        if wanted[key] and counters not in kinds:
            value = policy.require_paths if key == "require_all_paths" else f"{policy.min_accept_length:g}"
            where = origin.get(key) or key
            need = "per-verify-step records" if key == "require_all_paths" else "speculation counters"
            fix = ("drop it, or gate an engine that records each verify step (hf, dflash)"
                   if key == "require_all_paths" else "drop it, or gate an engine that reports draft counters")
            raise BadInput(f"{where} {value}: engine {engine!r} reports {COUNTER_KINDS.get(counters, counters)}, "
                           f"and this rule needs {need}; {fix}")


def shard_share(config: GateConfig, selected: list[Prompt],
                calibration: list[Prompt] | None) -> tuple[ShardPlan, list[Prompt], list[Prompt] | None]:
    """The shard's share of the selected and of the calibration prompts, and its plan (what the whole
    run was). A shard that holds no selected prompt, or — the noise measured on a set of its own — no
    calibration prompt, is refused: it would judge nothing, or measure no noise."""
    shard = config.shard
    assert shard is not None
    plan = ShardPlan.of(shard, [p.id for p in selected], [p.id for p in calibration] if calibration is not None else None)
    if not plan.runs:
        raise BadInput(f"--shard {shard.label}: none of the {len(selected)} selected prompt(s) falls in this shard; use "
                       f"fewer shards than prompts (a prompt's shard is a hash of its id)")
    if calibration is not None and not plan.calibrates and config.near_tie_nats is None:
        raise BadInput(f"--shard {shard.label}: none of the {len(calibration)} calibration prompt(s) of --calibration "
                       f"{config.calibration} falls in this shard, so it could measure no noise; use fewer shards or "
                       "--calibration suite")
    chosen = [p for p in selected if shard.holds(p.id)]
    share = [p for p in calibration if shard.holds(p.id)] if calibration is not None else None
    return plan, chosen, share
