"""Each configuration arm's launch knobs per server engine, and the engine facts that prove it happened,
read through the engine's :class:`~specparity.engines.server.descriptor.ServerDescriptor`.

The arms themselves are data (:mod:`specparity.model.arms`); each engine's descriptor says which it can set
up and how. This module turns one into what a server engine launches with — flags appended to both launches
the way ``--engine-opt server_args`` is (a later flag wins over the preset's own), plus the engines' existing
switches (vLLM ``batch_invariant``, SGLang ``deterministic``) — and reads back, from the engine's own
endpoints, the counter that proves the condition: preemptions on ``/metrics``, the KV cache dtype on
``/server_info``, the prefix cache's unit, and how many tokens a prompt cached whole is answered with (the
answers' own cached prompt tokens, prompt token counts and preemptions are the adapters'
:attr:`~specparity.model.types.GenerationResult.facts`). It also resets the speculative servers' prefix
caches before the judged requests. No engine is named here, and nothing here decides a verdict.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_sizing import (
    KV_BLOCK_TOKENS,
    LONG_SLACK_TOKENS,
    LOOKAHEAD_TOKENS,
    ArmLaunch,
    ArmSetupError,
    ArmSizing,
    long_context_length,
    long_prompt_tokens,
    mamba_slots_size,
    max_positions,
    preempt_context,
    preempt_tokens,
    requests_in_flight,
)
from specparity.engines.server.descriptor import ServerDescriptor
from specparity.engines.server.http import ServerError
from specparity.model.arms import ARMS, Arm, parse_arm_names
from specparity.model.packages import installed_package_dir

#: The arms' sizing (:mod:`specparity.engines.server.arm_sizing`) is read from here too, beside the knobs.
__all__ = [
    "KV_BLOCK_TOKENS", "LONG_SLACK_TOKENS", "LOOKAHEAD_TOKENS", "ArmLaunch", "ArmSetupError", "ArmSizing",
    "long_context_length", "long_prompt_tokens", "mamba_slots_size", "max_positions", "preempt_context",
    "preempt_tokens", "requests_in_flight", "descriptor_of", "supported_arms", "arm_engines", "arm_changes",
    "arm_proof", "unsupported_reason", "parse_arms", "no_prefix_cache", "cached_tokens_need", "no_preemption",
    "check_installed", "arm_launch", "preemptions", "kv_cache_dtypes", "prefix_cache_unit", "prefix_full_hit",
    "prefix_cache_floor", "reset_prefix_caches", "running_caps",
]


def descriptor_of(engine: Any) -> ServerDescriptor | None:
    """The descriptor of ``engine``: a name or spec (``vllm``, ``mypkg.mod:create``), or an engine adapter (its
    own ``descriptor``, else its name's); None for an engine without one."""
    from specparity.engines import server_descriptor

    if isinstance(engine, str):
        return server_descriptor(engine) if engine else None
    own = getattr(type(engine), "descriptor", None)
    return own if isinstance(own, ServerDescriptor) else descriptor_of(getattr(engine, "name", "") or "")


def supported_arms(engine: str) -> tuple[str, ...]:
    """The arms ``engine`` can set up, in :data:`~specparity.model.arms.ARMS` order (none for an engine without a
    descriptor: an in-process engine runs the default arm only when it is named)."""
    d = descriptor_of(engine)
    return tuple(name for name in ARMS if d is not None and d.supports(name))


def arm_engines(arm: str, engines: Sequence[str]) -> tuple[str, ...]:
    """Those of ``engines`` that can set ``arm`` up."""
    return tuple(e for e in engines if arm in supported_arms(e))


def arm_changes(engine: str, arm: str) -> str:
    """What ``arm`` changes in ``engine``'s launches, in words ("n/a" where it cannot set it up)."""
    d = descriptor_of(engine)
    return d.arms[arm].changes if d is not None and d.supports(arm) else "n/a"


def arm_proof(engine: str, arm: str) -> str:
    """What shows ``arm`` happened on ``engine``, in words ("" where it cannot set it up)."""
    d = descriptor_of(engine)
    return d.arms[arm].proof if d is not None and d.supports(arm) else ""


def unsupported_reason(engine: str, arm: str) -> str:
    """Why ``engine`` cannot set ``arm`` up, as its descriptor says ("no knob" where it says nothing)."""
    d = descriptor_of(engine)
    if d is None:
        return "it declares no arm knobs (its EngineInfo has no ServerDescriptor)"
    return d.unsupported_arms.get(arm) or "no knob"


def parse_arms(text: str | None, engine: str, *, hybrid: bool = False) -> tuple[Arm, ...]:
    """``--arms a,b``: known names, each once (None: every arm ``engine`` supports, those that need a hybrid
    target only when ``hybrid``). ValueError, one line."""
    if text is None:
        supported = supported_arms(engine)
        return tuple(a for a in ARMS.values() if a.name in supported and (hybrid or not a.hybrid))
    return parse_arm_names(text)


def no_prefix_cache(engine: Any) -> str | None:
    """Why ``engine``'s requests never read a prefix cache (None: they may)."""
    d = descriptor_of(engine)
    return d.prefix_cache.absent if d is not None else None


def cached_tokens_need(engine: Any) -> str | None:
    """What ``engine``'s servers need for their answers to carry cached prompt tokens (None: nothing)."""
    d = descriptor_of(engine)
    return d.prefix_cache.needs if d is not None else None


def no_preemption(engine: Any) -> str | None:
    """Why ``engine`` never preempts a request (None: it may)."""
    d = descriptor_of(engine)
    return d.no_preemption if d is not None else None


def check_installed(engine: str, arm: str, options: EngineOptions) -> None:
    """Refuse an arm whose engine argument the engine installed here does not declare (read from its
    source, never imported); nothing to check when the engine is not importable here (it may run from
    another environment: SGLang's ``--engine-opt python``) or the file is unreadable."""
    d = descriptor_of(engine)
    if d is None or d.package is None or not d.argument_sources or not d.source_check(options):
        return
    knob = d.arms.get(arm)
    names = [n for n in ((knob.argument if knob else None), d.every_arm_argument) if n is not None]
    pkg = installed_package_dir(d.package)
    if not names or pkg is None:
        return
    texts = []
    for source in d.argument_sources:
        try:
            texts.append((pkg / source).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    if not texts:
        return
    for name in names:
        if not any(name in text for text in texts):
            flag = "--" + name.replace("_", "-")
            where = ", ".join(str(pkg / source) for source in d.argument_sources)
            raise ArmSetupError(f"--arms {arm}: the installed {engine} ({where}) has no {flag} ({name}), which "
                                "this arm launches with; upgrade it or drop the arm")


def arm_launch(engine: str, arm: str, sizing: ArmSizing, options: EngineOptions) -> ArmLaunch:
    """What ``arm`` changes in ``engine``'s launches (:class:`ArmLaunch`): the descriptor's knob, then what every
    arm of the engine adds; ArmSetupError, one line naming the knob, when the engine cannot set it up."""
    d = descriptor_of(engine)
    if d is None or not d.supports(arm):
        raise ArmSetupError(f"--arms {arm}: engine {engine!r} cannot run it: {unsupported_reason(engine, arm)}"
                            f" (it supports: {', '.join(supported_arms(engine))})")
    check_installed(engine, arm, options)
    launch = d.arms[arm].launch(sizing, options)
    every = d.every_arm
    if every.flags or every.engine_opts:
        launch = replace(launch, flags=(*launch.flags, *every.flags), engine_opts={**launch.engine_opts,
                                                                                   **every.engine_opts})
    return launch


# --------------------------------------------------------------------------- facts that prove an arm


def _spec_endpoints(engine: Any) -> list[Any]:
    return list(engine.spec.fleet.endpoints)


def preemptions(engine: Any) -> int | None:
    """The engine's preemption counter (its descriptor's ``preemption_counter``) summed over the speculative
    servers; None when the engine has none known or a server does not expose it."""
    from prometheus_client.parser import text_string_to_metric_families

    d = descriptor_of(engine)
    if d is None or d.preemption_counter is None:
        return None
    name, witness = d.preemption_counter
    total = 0
    for endpoint in _spec_endpoints(engine):
        try:
            text = endpoint.request("GET", "/metrics", timeout_s=30.0).body.decode("utf-8", "replace")
            samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
        except (ServerError, ValueError):
            return None
        counted = [s.value for s in samples if s.name == name]
        if not counted and not any(s.name == witness for s in samples):
            return None  # metrics off, or another engine: the counter is unknown, not zero
        total += int(round(sum(counted)))
    return total


def kv_cache_dtypes(engine: Any) -> list[tuple[str, str, str | None]]:
    """(role, url, KV cache dtype as the server says it, None when it does not) for every server of both
    sides, through the descriptor's reader (vLLM's dev-mode ``/server_info``
    ``vllm_config.cache_config.cache_dtype``, SGLang's ``/server_info`` ``kv_cache_dtype``); nothing for an
    engine without one."""
    d = descriptor_of(engine)
    if d is None or d.read_kv_cache_dtype is None:
        return []
    out = []
    for role, endpoint in engine.every_server():
        dtype = d.read_kv_cache_dtype(engine, endpoint)
        out.append((role, endpoint.base_url, None if dtype is None else str(dtype)))
    return out


def prefix_cache_unit(engine: Any, engine_name: str | None = None) -> tuple[int, str]:
    """(tokens per prefix-cache unit on the speculative servers, where that figure comes from): what the servers
    say through the descriptor's reader (SGLang's ``/server_info`` ``page_size``, vLLM's dev-mode
    ``/server_info`` ``cache_config.block_size``; the largest over the servers), else the descriptor's default
    for ``engine_name`` (default: the engine's)."""
    name = engine_name or getattr(engine, "name", "")
    d = descriptor_of(engine_name) if engine_name else descriptor_of(engine)
    cache = d.prefix_cache if d is not None else None
    fleet = getattr(getattr(engine, "spec", None), "fleet", None)
    said = []
    if cache is not None and cache.read_unit is not None and fleet is not None:
        for endpoint in fleet.endpoints:
            value = cache.read_unit(engine, endpoint)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                said.append(value)
    if said:
        return max(said), cache.unit_source
    return (cache.unit if cache is not None else 1), f"{name or 'the engine'}'s default"


def prefix_full_hit(engine_name: str, prompt_tokens: int, unit: int, spec_config: dict[str, Any] | None) -> int:
    """The prompt tokens a request finds cached when its whole prompt was cached before: whole units of all
    but the last prompt token (recomputed for the first output's logits), less what the engine's cache key
    loses (SGLang's bigram keys under EAGLE: one token) and the units it recomputes of every hit (vLLM: one
    block for a draft that reads the target's hidden states). 0: nothing of such a prompt can be cached."""
    config = spec_config or {}
    d = descriptor_of(engine_name)
    cache = d.prefix_cache if d is not None else None
    usable = prompt_tokens - 1 - (cache.key_tokens_lost(config) if cache is not None else 0)
    hit = max(0, usable) // unit * unit
    hit -= unit * (cache.units_dropped(config) if cache is not None else 0)
    return max(0, hit)


def prefix_cache_floor(engine_name: str, spec_config: dict[str, Any] | None,
                       unit: int | None = None) -> tuple[int, str]:
    """The fewest prompt tokens a request can find any of cached (:func:`prefix_full_hit` above 0), and
    the reason in words. Shorter prompts neither prove nor disprove the warm path."""
    d = descriptor_of(engine_name)
    cache = d.prefix_cache if d is not None else None
    unit = unit or (cache.unit if cache is not None else 1)
    floor = next(n for n in range(1, 4 * unit + 4) if prefix_full_hit(engine_name, n, unit, spec_config) > 0)
    words = cache.floor_words(spec_config or {}, unit) if cache is not None else None
    return floor, words or f"one cache unit ({unit} tokens) plus the recomputed last token"


def reset_prefix_caches(engine: Any) -> list[tuple[str, bool, str]]:
    """Empty the speculative servers' prefix caches (the descriptor's reset route): (url, reset, what the
    server said) per server; nothing for an engine without the route."""
    d = descriptor_of(engine)
    path = d.prefix_cache.reset if d is not None else None
    if path is None:
        return []
    out = []
    for endpoint in _spec_endpoints(engine):
        try:
            body = endpoint.request("POST", path, timeout_s=60.0).body
        except ServerError as exc:
            out.append((endpoint.base_url, False, str(exc)))
            continue
        text = body.decode("utf-8", "replace").strip()
        out.append((endpoint.base_url, d.prefix_cache.reset_ok(text), text[:200]))
    return out


def running_caps(engine: Any) -> list[tuple[str, int | None, dict[str, Any]]]:
    """(url, the most requests the server runs at once, what the server said) per speculative server, through
    the descriptor's reader (SGLang's ``internal_states[0].effective_max_running_requests_per_dp``, after
    every cap it applied at start-up, the mamba state cache's included); None where the server does not say."""
    d = descriptor_of(engine)
    out = []
    for endpoint in _spec_endpoints(engine):
        cap, info = d.read_running_cap(engine, endpoint) if d is not None and d.read_running_cap else (None, {})
        ok = isinstance(cap, int) and not isinstance(cap, bool) and cap > 0
        out.append((endpoint.base_url, cap if ok else None, info))
    return out
