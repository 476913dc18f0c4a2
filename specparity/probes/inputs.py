"""Assemble the static probes from command-line style inputs; shared by the CLI and the suite.

Inputs are parsed once (checkpoint headers, engine spec, launch flags); the SGLang source is
looked up only when a probe needs it (a hybrid target on SGLang), so probing a dense model never
scans a 40 MB wheel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Mapping

from specparity.model.cache import wheel_cache_dir
from specparity.probes.checkpoints import Checkpoint, load_checkpoint
from specparity.probes import draft_format, lm_head, mamba_slots
from specparity.probes.version_facts import EngineSpec, unread_version_note
from specparity.probes.sglang_source import FoundSource, find_source, open_source
from specparity.probes.finding import Status, Finding

#: Cached sglang-<version>-*.whl files (outside the checkout).
DEFAULT_WHEEL_CACHE = str(wheel_cache_dir())


@dataclass
class ProbeInputs:
    """What the operator passes: paths and strings, validated by :func:`prepare`."""

    target: str
    draft: str | None
    engine: str
    launch_flags: str | None = None
    sglang_source: str | None = None
    wheel_cache: str | None = DEFAULT_WHEEL_CACHE
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


@dataclass
class ProbeContext:
    """Parsed inputs; raises at construction for bad input so probes never see it."""

    target: Checkpoint
    draft: Checkpoint | None
    engine: EngineSpec
    flags: mamba_slots.LaunchFlags
    sglang_source: str | None
    wheel_cache: str | None
    env: Mapping[str, str]

    @cached_property
    def source(self) -> FoundSource | None:
        if self.engine.name != "sglang":
            return None
        return find_source(self.engine.version_text, self.sglang_source, self.wheel_cache)


def prepare(inputs: ProbeInputs) -> ProbeContext:
    """Parse everything up front (raises CheckpointError / EngineSpecError / SourceError / ValueError)."""
    engine = EngineSpec.parse(inputs.engine)
    target = load_checkpoint(inputs.target)
    draft = load_checkpoint(inputs.draft) if inputs.draft else None
    flags = mamba_slots.LaunchFlags.parse(inputs.launch_flags)
    if inputs.sglang_source:
        open_source(inputs.sglang_source)  # refuse a path that is no SGLang source now, not mid-run
    return ProbeContext(target, draft, engine, flags, inputs.sglang_source, inputs.wheel_cache, inputs.env)


def _mamba_source(ctx: ProbeContext) -> FoundSource | None:
    hybrid, _, _ = mamba_slots.linear_layer_report(ctx.target)
    return ctx.source if hybrid else None


def cap_unread(verdict: Finding, engine: EngineSpec) -> Finding:
    """An ``ok`` for an engine version whose source was never read becomes ``warn``, saying so:
    "0.5.99 was not read; rule taken from 0.5.23" is a prediction, not a pass."""
    note = unread_version_note(engine)
    if note is None or verdict.status is not Status.OK or verdict.engine_independent:
        return verdict
    return Finding(verdict.probe, Status.WARN, f"{verdict.summary} [unverified for {engine}]",
                   [*verdict.evidence, note], action=verdict.action or f"read {engine}'s own source to confirm "
                   "(specparity probe --sglang-source WHEEL_OR_TREE) or run the live probes against it",
                   message=verdict.message, live_only=verdict.live_only)


_PROBES: dict[str, Callable[[ProbeContext], Finding]] = {
    lm_head.PROBE: lambda c: lm_head.probe_lm_head(c.target, c.draft, c.engine),
    draft_format.FP8_PROBE: lambda c: draft_format.probe_fp8_scales(c.draft, c.engine),
    draft_format.DFLASH2_PROBE: lambda c: draft_format.probe_dflash2_format(c.draft, c.engine, c.target),
    mamba_slots.SLOTS_PROBE: lambda c: mamba_slots.probe_mamba_slots(c.target, c.engine, c.flags, _mamba_source(c), c.env),
    mamba_slots.SOURCE_PROBE: lambda c: mamba_slots.probe_mamba_exhaustion(c.target, c.engine, c.flags, _mamba_source(c)),
}
#: Every static probe, each capped by :func:`cap_unread`.
STATIC_PROBES: dict[str, Callable[[ProbeContext], Finding]] = {
    name: (lambda c, fn=fn: cap_unread(fn(c), c.engine)) for name, fn in _PROBES.items()
}


def run_static(ctx: ProbeContext, only: list[str] | None = None) -> list[Finding]:
    return [probe(ctx) for name, probe in STATIC_PROBES.items() if only is None or name in only]
