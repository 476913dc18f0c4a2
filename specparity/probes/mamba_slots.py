"""Probes: mamba state slots of hybrid (GDN / linear-attention) targets.

Two things went wrong in the field on SGLang with a Qwen3.8 GDN hybrid. (1) Under speculative
decoding each request needs several mamba state slots (5 with the extra_buffer strategy and the
overlap schedule), so a small ``--max-mamba-cache-size`` silently caps concurrency to 1.
(2) When the pool runs out while a running request donates its prefix state to the radix cache,
``_alloc_mamba_slot`` asserts "Can not alloc mamba cache" and the scheduler dies. The first is
predicted from config + launch flags; the second is read from the SGLang source that will run.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from specparity.probes.checkpoints import Checkpoint
from specparity.probes.version_facts import (
    MAMBA_CAP_MESSAGE,
    MAMBA_ZERO_MESSAGE,
    EngineSpec,
    MambaSizing,
    sglang_mamba_sizing,
)
from specparity.probes.sglang_source import FoundSource, analyze_mamba_exhaustion, read_mamba_sizing, short_version
from specparity.probes.finding import Finding, fail, ok, unknown, warn

SLOTS_PROBE = "mamba-slots"
SOURCE_PROBE = "mamba-exhaustion"
_LINEAR_KINDS = {"linear_attention", "mamba", "mamba2", "conv", "gdn", "kda", "linear"}


@dataclass
class LaunchFlags:
    """The SGLang server flags that decide mamba slot sizing (everything else is ignored)."""

    disable_radix_cache: bool = False
    mamba_radix_cache_strategy: str = "auto"
    disable_overlap_schedule: bool = False
    page_size: int | None = None
    max_mamba_cache_size: int | None = None
    max_running_requests: int | None = None
    linear_attn_backend: str = "triton"
    speculative_algorithm: str | None = None

    @classmethod
    def parse(cls, argv: Sequence[str] | str | None) -> "LaunchFlags":
        """Parse ``python -m sglang.launch_server`` flags; unknown flags are ignored."""
        args = shlex.split(argv) if isinstance(argv, str) else list(argv or [])
        p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        p.add_argument("--disable-radix-cache", action="store_true")
        p.add_argument("--mamba-radix-cache-strategy", default="auto")
        p.add_argument("--disable-overlap-schedule", action="store_true")
        p.add_argument("--page-size", type=int)
        p.add_argument("--max-mamba-cache-size", type=int)
        p.add_argument("--max-running-requests", type=int)
        p.add_argument("--linear-attn-backend", default="triton")
        p.add_argument("--speculative-algorithm")
        try:
            ns, _ = p.parse_known_args(args)
        except (argparse.ArgumentError, ValueError) as exc:
            raise ValueError(f"--launch-flags: {exc}") from None
        return cls(**{k: v for k, v in vars(ns).items()})

    @classmethod
    def from_server_info(cls, info: Mapping[str, object]) -> "LaunchFlags":
        """The same flags as a running server's ``/server_info`` states them (its server arguments); a field
        it leaves out or says as null (or empty) keeps SGLang's default, and a boolean is no number."""
        def number(key: str) -> int | None:
            value = info.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        strategy = info.get("mamba_radix_cache_strategy") or cls.mamba_radix_cache_strategy
        return cls(disable_radix_cache=bool(info.get("disable_radix_cache")), mamba_radix_cache_strategy=str(strategy),
                   disable_overlap_schedule=bool(info.get("disable_overlap_schedule")),
                   page_size=number("page_size"), max_mamba_cache_size=number("max_mamba_cache_size"),
                   max_running_requests=number("max_running_requests"),
                   linear_attn_backend=str(info.get("linear_attn_backend") or cls.linear_attn_backend),
                   speculative_algorithm=info.get("speculative_algorithm"))  # type: ignore[arg-type]


def linear_layer_report(target: Checkpoint) -> tuple[bool, list[str], list[str]]:
    """(is_hybrid, evidence, disagreements) from ``layer_types`` / ``full_attention_interval``."""
    cfg = target.text_config()
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    fai = cfg.get("full_attention_interval")
    evidence, problems = [], []
    kinds = [t for t in types if isinstance(t, str)] if isinstance(types, list) else []
    hybrid = any(k in _LINEAR_KINDS for k in kinds) or (type(fai) is int and "linear_num_value_heads" in cfg)
    if kinds:
        full = [i for i, k in enumerate(kinds) if k == "full_attention"]
        evidence.append(f"config layer_types: {len(kinds)} layers, full attention at {full[:8]}{' …' if len(full) > 8 else ''}"
                        f" ({len(full)} full, {len(kinds) - len(full)} other)")
    if type(fai) is int and fai > 0 and type(n) is int:
        derived = ["full_attention" if (i + 1) % fai == 0 else "linear_attention" for i in range(n)]
        evidence.append(f"config full_attention_interval={fai}, num_hidden_layers={n}")
        if kinds:
            if len(kinds) != n:
                problems.append(f"layer_types has {len(kinds)} entries, num_hidden_layers={n}")
            diff = [i for i, (a, b) in enumerate(zip(kinds, derived)) if a != b]
            if diff:
                problems.append(
                    f"layer_types and full_attention_interval={fai} disagree at layers {diff[:8]}"
                    f"{' …' if len(diff) > 8 else ''} (e.g. layer {diff[0]}: layer_types={kinds[diff[0]]!r}, "
                    f"interval gives {derived[diff[0]]!r})"
                )
    return hybrid, evidence, problems


@dataclass
class SlotPrediction:
    strategy: str
    overlap: bool
    slots_per_request: int
    cap: int | None
    notes: list[str]


def predict_slots(target: Checkpoint, flags: LaunchFlags, sizing: MambaSizing, env: Mapping[str, str]) -> SlotPrediction:
    """Mirror SGLang's ``_calculate_mamba_ratio`` and the 'auto' strategy resolution."""
    notes: list[str] = []
    arch = (target.architectures or ["?"])[0]
    skip = str(env.get("SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK", "")).lower() in ("1", "true", "yes")
    overlap = not flags.disable_overlap_schedule
    strategy = flags.mamba_radix_cache_strategy
    if flags.disable_radix_cache:
        return SlotPrediction("none (radix cache off)", overlap, 1, _cap(flags, 1), ["--disable-radix-cache: 1 slot per request"])
    if strategy == "auto":
        wants = overlap or (flags.page_size or 1) > 1
        supported = arch in sizing.extra_buffer_archs and flags.linear_attn_backend == "triton"
        strategy = "extra_buffer" if wants and supported else "no_buffer"
        notes.append(f"'auto' strategy -> {strategy} (overlap={overlap}, page_size={flags.page_size}, "
                     f"{arch} {'in' if arch in sizing.extra_buffer_archs else 'not in'} _MAMBA_EXTRA_BUFFER_ARCHS, "
                     f"linear_attn_backend={flags.linear_attn_backend})")
        if strategy == "no_buffer":
            overlap = False
    base = sizing.base - (sizing.drop_on_skip if skip else 0)
    extra = 0
    if strategy in ("extra_buffer", "extra_buffer_lazy"):
        if overlap:
            extra = sizing.extra_lazy if strategy == "extra_buffer_lazy" else sizing.extra_overlap
        else:
            extra = sizing.extra_no_overlap
    elif skip:
        extra = sizing.extra_no_buffer_skip
    notes.append(f"slots per request = {base} base + {extra} ({strategy}, overlap={overlap}"
                 f"{', SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK' if skip else ''})")
    return SlotPrediction(strategy, overlap, base + extra, _cap(flags, base + extra), notes)


def _cap(flags: LaunchFlags, ratio: int) -> int | None:
    return None if flags.max_mamba_cache_size is None else flags.max_mamba_cache_size // ratio


def _sizing(engine: EngineSpec, source: FoundSource | None) -> MambaSizing | None:
    if source is not None and source.tree is not None:
        from_tree = read_mamba_sizing(source.tree)
        if from_tree is not None:
            return from_tree
    return sglang_mamba_sizing(engine.version)


def probe_mamba_slots(
    target: Checkpoint,
    engine: EngineSpec,
    flags: LaunchFlags,
    source: FoundSource | None = None,
    env: Mapping[str, str] | None = None,
) -> Finding:
    """Layer-kind consistency, slots per request and the ``max_running_requests`` cap."""
    hybrid, evidence, problems = linear_layer_report(target)
    if not hybrid:
        return ok(SLOTS_PROBE, "target is not a hybrid (no linear-attention layers): no mamba state slots", evidence,
                  engine_independent=True)
    if problems:
        sglang = engine.name == "sglang"
        how = ("SGLang derives layer kinds from full_attention_interval alone "
               "(srt/configs/qwen3_next.py:260 layers_block_type, 0.5.17-0.5.23), so it builds different layers "
               "than the checkpoint was trained with") if sglang else "engines disagree on which key wins"
        return (fail if sglang else warn)(
            SLOTS_PROBE, "layer_types disagrees with full_attention_interval", evidence + problems + [how],
            action="make the two keys agree (or drop full_attention_interval if layer_types is authoritative)")
    if engine.name != "sglang":
        return unknown(SLOTS_PROBE, f"slot prediction is implemented for SGLang only, not {engine.name}", evidence)
    sizing = _sizing(engine, source)
    if sizing is None:
        return unknown(SLOTS_PROBE, f"no slot-sizing data for {engine}", evidence)
    pred = predict_slots(target, flags, sizing, env or {})
    evidence += pred.notes + list(sizing.sources)
    if pred.cap is None:
        return unknown(
            SLOTS_PROBE,
            f"{pred.slots_per_request} mamba state slots per request; pool auto-sized from GPU memory, cap unknown",
            evidence,
            live_only="the startup log line 'max_running_requests is capped to N by the mamba state cache'",
            action="pass the launch flags (incl. --max-mamba-cache-size) to predict the cap",
        )
    evidence.append(f"--max-mamba-cache-size={flags.max_mamba_cache_size} // {pred.slots_per_request} = {pred.cap}")
    action = (f"raise --max-mamba-cache-size to at least {pred.slots_per_request * 2} for 2 concurrent requests "
              "(or use --mamba-ssm-dtype bfloat16 / --mamba-radix-cache-strategy extra_buffer_lazy to free memory)")
    if pred.cap <= 0:
        return fail(SLOTS_PROBE, "mamba state cache cannot hold one request: startup fails", evidence,
                    message=MAMBA_ZERO_MESSAGE, action=action)
    message = MAMBA_CAP_MESSAGE % (pred.cap, flags.max_mamba_cache_size, pred.slots_per_request)
    if pred.cap == 1:
        return warn(SLOTS_PROBE, "max_running_requests will be capped to 1 by the mamba state cache", evidence,
                    message=message, action=action)
    if flags.max_running_requests and flags.max_running_requests > pred.cap:
        return warn(SLOTS_PROBE, f"--max-running-requests {flags.max_running_requests} will be capped to {pred.cap}",
                    evidence, message=message, action=action)
    return ok(SLOTS_PROBE, f"{pred.slots_per_request} slots per request, up to {pred.cap} concurrent requests", evidence)


def probe_mamba_exhaustion(
    target: Checkpoint, engine: EngineSpec, flags: LaunchFlags, source: FoundSource | None
) -> Finding:
    """Does the SGLang that will run survive an empty mamba pool during prefix donation?"""
    hybrid, evidence, _ = linear_layer_report(target)
    if not hybrid:
        return ok(SOURCE_PROBE, "target is not a hybrid: no mamba state pool to exhaust", evidence,
                  engine_independent=True)
    if engine.name != "sglang":
        return unknown(SOURCE_PROBE, f"source check is implemented for SGLang only, not {engine.name}", evidence)
    if flags.disable_radix_cache:
        return ok(SOURCE_PROBE, "--disable-radix-cache: no prefix donation, 1 slot per request", evidence)
    if source is None or source.tree is None:
        return unknown(SOURCE_PROBE, f"no sglang {engine.version_text} source to read",
                       evidence + (source.notes if source else []),
                       action=f"pass --sglang-source PATH (installed package, unpacked tree or wheel), or put "
                       f"sglang-{engine.version_text}-*.whl in the wheel cache")
    report = analyze_mamba_exhaustion(source.tree)
    evidence += source.notes + [f"read {report.label} (sglang {short_version(report.version)}), not imported"]
    evidence += report.evidence()
    outcome = report.outcome
    action = ("skip donation instead of asserting: make the allocator return None on an empty pool and return 0 "
              "from prepare_for_caching_req at every donation site (upstream PRs #36770/#40128 were open), or run "
              "with --disable-radix-cache, or size --max-mamba-cache-size with headroom above the cap")
    if outcome == "asserts":
        return fail(SOURCE_PROBE, "slot exhaustion during prefix donation asserts and kills the scheduler", evidence,
                    message="AssertionError: Can not alloc mamba cache", action=action,
                    live_only="the crash itself: run the mamba-stress probe against the server")
    if outcome == "unguarded":
        return fail(SOURCE_PROBE, "allocator may return None but a donation site does not check it", evidence,
                    action=action, live_only="the crash itself: run the mamba-stress probe against the server")
    if outcome == "skips":
        return ok(SOURCE_PROBE, f"prefix donation skips on an empty pool at all {len(report.sites)} sites", evidence,
                  live_only="that the server stays healthy under load: run the mamba-stress probe")
    return unknown(SOURCE_PROBE, "no mamba prefix-donation code found in this source", evidence)
