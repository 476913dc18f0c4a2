"""Each configuration arm's launch knobs per server engine, and the engine facts that prove it happened.

The arms themselves are data (:mod:`specparity.model.arms`); this module turns one into what a server
engine launches with — flags appended to both launches the way ``--engine-opt server_args`` is (a
later flag wins over the preset's own), plus the engines' existing switches (vLLM ``batch_invariant``,
SGLang ``deterministic``) — and reads back, from the engine's own endpoints, the counter that proves
the condition: preemptions on ``/metrics``, the KV cache dtype on ``/server_info``, the prefix cache's
unit, and how many tokens a prompt cached whole is answered with (the answers' own cached prompt tokens,
prompt token counts and preemptions are the adapters' :attr:`~specparity.model.types.GenerationResult.facts`).
It also resets the speculative servers' prefix caches before the judged requests. Nothing here decides a
verdict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from specparity.engines.base import EngineOptions
from specparity.engines.server.engine import DEFAULT_CONCURRENCY
from specparity.engines.server.http import ServerError
from specparity.model.arms import ARMS, LONG_MAX_TOKENS, LONG_MIN_TOKENS
from specparity.model.packages import installed_package_dir

#: vLLM's KV cache block size (``--block-size`` default, tokens) and the tokens of slack each request
#: needs beyond its prompt and output (speculative lookahead slots of a verify step).
VLLM_BLOCK_TOKENS = 16
#: What a prefix cache holds, in tokens, per engine, where the server does not say: vLLM caches whole KV
#: blocks (``--block-size``, 16; a dev-mode ``/server_info`` says ``cache_config.block_size``); SGLang's radix
#: cache holds whole pages (``--page-size``, 1 by default; ``/server_info`` says ``page_size``). Either
#: recomputes a prompt's last token.
PREFIX_CACHE_UNIT = {"vllm": VLLM_BLOCK_TOKENS, "sglang": 1}
#: SGLang speculative algorithms whose radix cache is keyed by token bigrams (``RadixKey(is_bigram=...)`` with
#: ``SpeculativeAlgorithm.is_eagle()``, ``mem_cache/radix_cache.py``, read in 0.5.17; NEXTN runs as EAGLE): a
#: prompt of n tokens is n - 1 bigrams, so a hit is one token shorter.
SGLANG_BIGRAM_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "FROZEN_KV_MTP"})
#: The route that empties a server's prefix cache, per engine: SGLang ``/flush_cache`` (GET or POST, any
#: server; HTTP 400 unless the scheduler is idle; it also zeroes the lifetime speculation counters behind
#: ``/server_info``'s ``avg_spec_accept_length``, which a run reads once, before any request, and leaves the
#: answers' own ``meta_info.spec_*`` and the ``/metrics`` counters alone: ``Scheduler.flush_cache``,
#: ``MetricsReporter.reset_metrics``, 0.5.17); vLLM ``POST /reset_prefix_cache`` (only on a
#: ``VLLM_SERVER_DEV_MODE=1`` server, ``serve/dev/cache/api_router.py``; ``{"success": false}`` while a
#: request holds blocks, ``BlockPool.reset_prefix_cache``, 0.26.0).
PREFIX_CACHE_RESET = {"sglang": "/flush_cache", "vllm": "/reset_prefix_cache"}
#: Engines whose requests never read a prefix cache, and why (their answers carry no cached-token count).
NO_PREFIX_CACHE = {"llamacpp": "every request sends cache_prompt: false"}
#: What a server of an engine needs for its answers to carry their cached prompt tokens.
CACHED_TOKENS_NEED = {"vllm": "vLLM answers it only with --enable-prompt-tokens-details"}
#: Engines that never preempt a request, and why.
NO_PREEMPTION = {"llamacpp": "llama-server's slots each own their context"}
#: Speculative methods whose draft reads the target's hidden states. vLLM drops the last matched block
#: of every prefix-cache hit for them, so that the block is recomputed and its hidden states reach the
#: draft (``SpeculativeConfig.use_eagle`` in ``vllm/config/speculative.py``, the EAGLE drop in
#: ``find_longest_cache_hit``, ``vllm/v1/core/single_type_kv_cache_manager.py``; read in 0.26.0): a
#: warm prompt then finds ``floor((n - 1) / 16) * 16 - 16`` tokens cached, nothing below 33 tokens.
VLLM_HIDDEN_STATE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
LOOKAHEAD_TOKENS = 16
#: Preemption counters, and a sample that shows the server's metrics are on: vLLM
#: (``vllm:num_preemptions``, a counter declared from the start; 0.26.0 counts ``Request.num_preemptions`` per
#: request, ``v1/request.py``, but no answer carries it) and
#: SGLang (``sglang:num_retracted_requests_total``, a counter that appears only at the first retraction, with
#: ``--enable-metrics``; the gauge ``sglang:num_retracted_reqs`` resets after each publish and is not read;
#: read only where the answers lack their own ``num_retractions``). The proofs take a counter's delta over the
#: judged requests alone.
PREEMPTION_COUNTERS = {"vllm": ("vllm:num_preemptions_total", "vllm:num_preemptions_total"),
                       "sglang": ("sglang:num_retracted_requests_total", "sglang:num_running_reqs")}
#: A context length the long arm asks for is the prompts' longest request plus this much.
LONG_SLACK_TOKENS = 256


#: The engine argument each arm's launch needs, and the source file of the installed engine that declares
#: its arguments: an installed version without it cannot set the arm up (checked before any launch).
#: vLLM declares engine arguments in ``engine/arg_utils.py`` and the OpenAI front end's own (such as
#: ``--enable-prompt-tokens-details``) in ``entrypoints/openai/cli_args.py`` (read in vLLM 0.26.0).
#: ``"*"``: an argument every arm launches with.
ARM_ARGUMENTS = {
    "vllm": (("engine/arg_utils.py", "entrypoints/openai/cli_args.py"),
             {"*": "enable_prompt_tokens_details", "preempt": "num_gpu_blocks_override",
              "prefix-warm": "enable_prefix_caching", "fp8-kv": "kv_cache_dtype", "long": "max_model_len"}),
    "sglang": (("srt/server_args.py",), {"preempt": "max_total_tokens", "fp8-kv": "kv_cache_dtype",
                                         "mamba-slots": "max_mamba_cache_size",
                                         "long": "context_length", "deterministic": "enable_deterministic_inference"}),
}


class ArmSetupError(ValueError):
    """An arm this engine or model cannot set up: one line naming the missing knob (bad input)."""


@dataclass(frozen=True)
class ArmSizing:
    """What the sizing of an arm's launch is computed from: each prompt's token count and output limit,
    and the requests in flight per server."""

    prompt_tokens: tuple[int, ...]
    max_new_tokens: tuple[int, ...]
    concurrency: int
    #: The mamba state slots a request of the speculative launch takes (the mamba-slots probe's prediction);
    #: None: the target is not a hybrid, or nothing was predicted.
    mamba_slots: int | None = None


@dataclass(frozen=True)
class ArmLaunch:
    """An arm's change to both launches: ``flags`` appended to each server's argv (after the preset's and
    ``--engine-opt server_args``), ``engine_opts`` other ``--engine-opt`` values, ``concurrency`` the
    requests in flight it needs (None: the run's own)."""

    flags: tuple[str, ...] = ()
    engine_opts: dict[str, Any] = field(default_factory=dict)
    concurrency: int | None = None

    def apply(self, options: EngineOptions) -> EngineOptions:
        """``options`` with this launch change (a new object; ``options`` is left as it was)."""
        extra = dict(options.extra)
        if self.flags:
            extra["server_args"] = [*(extra.get("server_args") or ()), *self.flags]
        extra.update(self.engine_opts)
        return replace(options, extra=extra)

    def describe(self) -> str:
        parts = [" ".join(self.flags)] if self.flags else []
        parts += [f"--engine-opt {k}={v}" for k, v in self.engine_opts.items()]
        if self.concurrency:
            parts.append(f"{self.concurrency} requests in flight")
        return "; ".join(parts) or "nothing"


def requests_in_flight(options: EngineOptions) -> int:
    """What a launched server is sent at once: ``--engine-opt max_concurrency``, else the default."""
    return int(options.extra.get("max_concurrency") or DEFAULT_CONCURRENCY)


def preempt_tokens(sizing: ArmSizing) -> int:
    """A KV budget (tokens) that holds the largest request and one block more, far less than what the
    ``concurrency`` requests in flight need together, so that running them preempts some mid-decode.
    (Half of their sum was measured not to preempt on vLLM 0.26.0: requests end before their limit, and
    the scheduler admits only what fits.)"""
    if sizing.concurrency < 2:
        raise ArmSetupError(f"preempt: {sizing.concurrency} request in flight cannot preempt another; raise "
                            "--engine-opt max_concurrency (at least 2)")
    sizes = sorted((p + n + LOOKAHEAD_TOKENS for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens)),
                   reverse=True)
    if len(sizes) < 2:
        raise ArmSetupError("preempt: one prompt cannot preempt another; select two or more prompts")
    return sizes[0] + VLLM_BLOCK_TOKENS


def mamba_slots_size(sizing: ArmSizing) -> tuple[int, int]:
    """(``--max-mamba-cache-size``, the running-request cap it gives): state slots for half the requests in
    flight (at least one request), so that the rest wait for a slot. SGLang caps its running requests at the
    pool's size divided by the slots a request takes (``max_running_requests is capped to N by the mamba state
    cache``); the slots per request are the mamba-slots probe's prediction for the launch."""
    if sizing.concurrency < 2:
        raise ArmSetupError(f"mamba-slots: {sizing.concurrency} request in flight cannot wait for another's state "
                            "slot; raise --engine-opt max_concurrency (at least 2)")
    if not sizing.mamba_slots:
        raise ArmSetupError("mamba-slots: the target has no linear-attention layers (no mamba state slots); "
                            "the arm needs a hybrid target")
    cap = max(1, sizing.concurrency // 2)
    return sizing.mamba_slots * cap, cap


def preempt_context(sizing: ArmSizing) -> int:
    """The context length of a preempt launch: the largest request, whole blocks (never above the budget
    of :func:`preempt_tokens`, which holds it plus a block)."""
    largest = max(p + n + LOOKAHEAD_TOKENS for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens))
    return math.ceil(largest / VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS


def max_positions(target: str | None) -> int | None:
    """The target's ``max_position_embeddings`` (config.json, or its ``text_config``); None when unreadable."""
    if not target:
        return None
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (config, config.get("text_config") or {}):
        value = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(value, int):
            return value
    return None


def long_prompt_tokens(target: str | None) -> int:
    """The long arm's prompt size: :data:`LONG_MAX_TOKENS` where the target's positions allow, else
    :data:`LONG_MIN_TOKENS`; ArmSetupError when even that does not fit (or the config is unreadable)."""
    limit = max_positions(target)
    if limit is None:
        raise ArmSetupError(f"long: cannot read max_position_embeddings from --target {target!r}/config.json; "
                            f"the long arm needs a target of at least {LONG_MIN_TOKENS} positions")
    for size in (LONG_MAX_TOKENS, LONG_MIN_TOKENS):
        if size + 2 * LONG_SLACK_TOKENS <= limit:
            return size
    raise ArmSetupError(f"long: the target's max_position_embeddings is {limit}, below the "
                        f"{LONG_MIN_TOKENS + 2 * LONG_SLACK_TOKENS} tokens a {LONG_MIN_TOKENS}-token prompt and its "
                        "answer need")


def long_context_length(sizing: ArmSizing, target: str | None) -> int:
    """The context a long run is launched with: its longest request plus slack, within the target's positions."""
    need = max(p + n for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens)) + LONG_SLACK_TOKENS
    limit = max_positions(target)
    if limit is not None and need > limit:
        raise ArmSetupError(f"long: the longest prompt needs {need} tokens of context, above the target's "
                            f"max_position_embeddings {limit}")
    return need


def check_installed(engine: str, arm: str, options: EngineOptions) -> None:
    """Refuse an arm whose engine argument the engine installed here does not declare (read from its
    source, never imported); nothing to check when the engine is not importable here (it may run from
    another environment: SGLang's ``--engine-opt python``) or the file is unreadable."""
    if engine not in ARM_ARGUMENTS or (engine == "sglang" and options.extra.get("python")):
        return
    sources, needs = ARM_ARGUMENTS[engine]
    names = [n for n in (needs.get(arm), needs.get("*")) if n is not None]
    pkg = installed_package_dir(engine)
    if not names or pkg is None:
        return
    texts = []
    for source in sources:
        try:
            texts.append((pkg / source).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    if not texts:
        return
    for name in names:
        if not any(name in text for text in texts):
            flag = "--" + name.replace("_", "-")
            where = ", ".join(str(pkg / source) for source in sources)
            raise ArmSetupError(f"--arms {arm}: the installed {engine} ({where}) has no {flag} ({name}), which "
                                "this arm launches with; upgrade it or drop the arm")


def arm_launch(engine: str, arm: str, sizing: ArmSizing, options: EngineOptions) -> ArmLaunch:
    """What ``arm`` changes in ``engine``'s launches (:class:`ArmLaunch`); ArmSetupError, one line
    naming the knob, when the engine cannot set it up."""
    spec = ARMS[arm]
    if engine not in spec.engines:
        raise ArmSetupError(f"--arms {arm}: engine {engine!r} cannot run it: {spec.unsupported.get(engine, 'no knob')}"
                            f" (it supports: {', '.join(a.name for a in ARMS.values() if engine in a.engines)})")
    check_installed(engine, arm, options)
    launch = _arm_launch(engine, arm, sizing, options)
    if engine == "vllm":  # every arm: each answer's cached prompt tokens, and /reset_prefix_cache (dev mode)
        launch = replace(launch, flags=(*launch.flags, *VLLM_EVERY_ARM_FLAGS),
                         engine_opts={**launch.engine_opts, "dev_mode": True})
    return launch


#: What every vLLM arm adds to both launches besides its own knob (with ``VLLM_SERVER_DEV_MODE=1``):
#: each answer's ``usage.prompt_tokens_details.cached_tokens``, which proves a judged request cold or warm.
VLLM_EVERY_ARM_FLAGS = ("--enable-prompt-tokens-details",)


def _arm_launch(engine: str, arm: str, sizing: ArmSizing, options: EngineOptions) -> ArmLaunch:
    if arm == "default":
        return ArmLaunch()
    if arm == "prefix-warm":  # SGLang's radix cache is on by default; so is vLLM's prefix cache, said anyway
        return ArmLaunch(("--enable-prefix-caching",) if engine == "vllm" else ())
    if arm == "deterministic":
        return ArmLaunch(engine_opts={"batch_invariant": True} if engine == "vllm" else {"deterministic": True})
    if arm == "fp8-kv":  # vLLM shows its cache dtype only on a dev-mode /server_info (every vLLM arm has it)
        if engine == "vllm":
            return ArmLaunch(("--kv-cache-dtype", "fp8"))
        return ArmLaunch(("--kv-cache-dtype", "fp8_e4m3"))
    if arm == "preempt":
        # the context is cut to the largest request too: a server refuses to start with a KV cache that
        # cannot hold one request of its full context length
        tokens, context = preempt_tokens(sizing), preempt_context(sizing)
        if engine == "vllm":
            return ArmLaunch(("--num-gpu-blocks-override", str(math.ceil(tokens / VLLM_BLOCK_TOKENS)),
                              "--max-model-len", str(context)), concurrency=sizing.concurrency)
        return ArmLaunch(("--max-total-tokens", str(tokens), "--context-length", str(context), "--enable-metrics"),
                         concurrency=sizing.concurrency)
    if arm == "mamba-slots":  # both launches: the baseline's answers do not depend on how many run at once
        size, _cap = mamba_slots_size(sizing)
        return ArmLaunch(("--max-mamba-cache-size", str(size), "--enable-metrics"), concurrency=sizing.concurrency)
    if arm == "long":
        length = long_context_length(sizing, options.target)
        flag = {"vllm": "--max-model-len", "sglang": "--context-length", "llamacpp": "--ctx-size"}[engine]
        return ArmLaunch((flag, str(length)))
    raise ArmSetupError(f"--arms {arm}: no launch knobs for engine {engine!r}")


# --------------------------------------------------------------------------- facts that prove an arm


def _spec_endpoints(engine: Any) -> list[Any]:
    return list(engine.spec.fleet.endpoints)


def preemptions(engine: Any) -> int | None:
    """The preemption counter summed over the speculative servers (:data:`PREEMPTION_COUNTERS`); None
    when the engine has none known or a server does not expose it."""
    from prometheus_client.parser import text_string_to_metric_families

    names = PREEMPTION_COUNTERS.get(getattr(engine, "name", ""))
    if names is None:
        return None
    name, witness = names
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
    sides: vLLM's dev-mode ``/server_info`` ``vllm_config.cache_config.cache_dtype``, SGLang's
    ``/server_info`` ``kv_cache_dtype``; nothing for another engine (none of them has an fp8 KV cache)."""
    if engine.name not in ("vllm", "sglang"):
        return []
    out = []
    for role, endpoint in engine.every_server():
        dtype = None
        if engine.name == "vllm":
            info = engine.dev_server_info(endpoint) or {}
            cache = (info.get("vllm_config") or {}).get("cache_config") if isinstance(info.get("vllm_config"), dict) else None
            dtype = cache.get("cache_dtype") if isinstance(cache, dict) else None
        elif engine.name == "sglang":
            dtype = (engine.raw_server_info(endpoint) or {}).get("kv_cache_dtype")
        out.append((role, endpoint.base_url, None if dtype is None else str(dtype)))
    return out


def prefix_cache_unit(engine: Any, engine_name: str | None = None) -> tuple[int, str]:
    """(tokens per prefix-cache unit on the speculative servers, where that figure comes from): SGLang's
    ``/server_info`` ``page_size``, vLLM's dev-mode ``/server_info`` ``cache_config.block_size`` (the
    largest over the servers), else :data:`PREFIX_CACHE_UNIT` of ``engine_name`` (default: the engine's)."""
    name = engine_name or getattr(engine, "name", "")
    fleet = getattr(getattr(engine, "spec", None), "fleet", None)
    said = []
    for endpoint in fleet.endpoints if fleet is not None and name in ("sglang", "vllm") else ():
        value = None
        if name == "sglang":
            value = (engine.raw_server_info(endpoint) or {}).get("page_size")
        else:
            config = (engine.dev_server_info(endpoint) or {}).get("vllm_config")
            cache = config.get("cache_config") if isinstance(config, dict) else None
            value = cache.get("block_size") if isinstance(cache, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            said.append(value)
    if said:
        where = "/server_info page_size" if name == "sglang" else "/server_info cache_config.block_size"
        return max(said), where
    return PREFIX_CACHE_UNIT.get(name, 1), f"{name or 'the engine'}'s default"


def prefix_full_hit(engine_name: str, prompt_tokens: int, unit: int, spec_config: dict[str, Any] | None) -> int:
    """The prompt tokens a request finds cached when its whole prompt was cached before: whole units of all
    but the last prompt token (recomputed for the first output's logits); on vLLM one block less for a
    draft that reads the target's hidden states (:data:`VLLM_HIDDEN_STATE_METHODS`: vLLM recomputes a hit's
    last block for it), on SGLang one token less where the radix cache is keyed by bigrams
    (:data:`SGLANG_BIGRAM_ALGORITHMS`). 0: nothing of such a prompt can be cached."""
    config = spec_config or {}
    usable = prompt_tokens - 1
    if engine_name == "sglang" and str(config.get("speculative_algorithm") or "").upper() in SGLANG_BIGRAM_ALGORITHMS:
        usable -= 1
    hit = max(0, usable) // unit * unit
    if engine_name == "vllm" and config.get("method") in VLLM_HIDDEN_STATE_METHODS:
        hit -= unit
    return max(0, hit)


def prefix_cache_floor(engine_name: str, spec_config: dict[str, Any] | None,
                       unit: int | None = None) -> tuple[int, str]:
    """The fewest prompt tokens a request can find any of cached (:func:`prefix_full_hit` above 0), and
    the reason in words. Shorter prompts neither prove nor disprove the warm path."""
    unit = unit or PREFIX_CACHE_UNIT.get(engine_name, 1)
    floor = next(n for n in range(1, 4 * unit + 4) if prefix_full_hit(engine_name, n, unit, spec_config) > 0)
    config = spec_config or {}
    method = config.get("method")
    if engine_name == "vllm" and method in VLLM_HIDDEN_STATE_METHODS:
        return floor, (f"two cache units ({unit} tokens each: vLLM drops a hit's last block for "
                       f"{method}, whose draft needs its hidden states) plus the recomputed last token")
    if floor > unit + 1:
        return floor, (f"one cache unit ({unit} tokens) plus the recomputed last token and the bigram key's "
                       f"token ({config.get('speculative_algorithm')})")
    return floor, f"one cache unit ({unit} tokens) plus the recomputed last token"


def reset_prefix_caches(engine: Any) -> list[tuple[str, bool, str]]:
    """Empty the speculative servers' prefix caches (:data:`PREFIX_CACHE_RESET`): (url, reset, what the
    server said) per server; nothing for an engine without the route."""
    path = PREFIX_CACHE_RESET.get(getattr(engine, "name", ""))
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
        ok = True
        if engine.name == "vllm":
            try:
                ok = bool(json.loads(text).get("success"))
            except (ValueError, AttributeError):
                ok = False
        out.append((endpoint.base_url, ok, text[:200]))
    return out


def running_caps(engine: Any) -> list[tuple[str, int | None, dict[str, Any]]]:
    """(url, the most requests the server runs at once, its ``/server_info``) per speculative server: SGLang's
    ``internal_states[0].effective_max_running_requests_per_dp`` (after every cap it applied at start-up, the
    mamba state cache's included; ``Scheduler.get_internal_state``, 0.5.17), None where the server does not say."""
    out = []
    for endpoint in _spec_endpoints(engine):
        info = (engine.raw_server_info(endpoint) or {}) if getattr(engine, "name", "") == "sglang" else {}
        states = info.get("internal_states")
        state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        cap = state.get("effective_max_running_requests_per_dp")
        ok = isinstance(cap, int) and not isinstance(cap, bool) and cap > 0
        out.append((endpoint.base_url, cap if ok else None, info))
    return out
