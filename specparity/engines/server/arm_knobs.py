"""Each configuration arm's launch knobs per server engine, and the engine facts that prove it happened.

The arms themselves are data (:mod:`specparity.model.arms`); this module turns one into what a server
engine launches with — flags appended to both launches the way ``--engine-opt server_args`` is (a
later flag wins over the preset's own), plus the engines' existing switches (vLLM ``batch_invariant``,
SGLang ``deterministic``) — and reads back, from the engine's own endpoints, the counter that proves
the condition: preemptions on ``/metrics``, the KV cache dtype on ``/server_info``, cached prompt
tokens and prompt token counts on each answer (recorded by the adapters through
:meth:`~specparity.engines.server.engine.ServerEngine.note_request`). Nothing here decides a verdict.
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
#: What a prefix cache holds, in tokens, per engine: vLLM caches whole KV blocks; SGLang's radix cache
#: holds any prefix (page size 1). Either recomputes a prompt's last token.
PREFIX_CACHE_UNIT = {"vllm": VLLM_BLOCK_TOKENS, "sglang": 1}
#: Speculative methods whose draft reads the target's hidden states. vLLM drops the last matched block
#: of every prefix-cache hit for them, so that the block is recomputed and its hidden states reach the
#: draft (``SpeculativeConfig.use_eagle`` in ``vllm/config/speculative.py``, the EAGLE drop in
#: ``find_longest_cache_hit``, ``vllm/v1/core/single_type_kv_cache_manager.py``; read in 0.26.0): a
#: warm prompt then finds ``floor((n - 1) / 16) * 16 - 16`` tokens cached, nothing below 33 tokens.
VLLM_HIDDEN_STATE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
LOOKAHEAD_TOKENS = 16
#: Preemption counters, and a sample that shows the server's metrics are on: vLLM
#: (``vllm:num_preemptions``, a counter declared from the start) and SGLang
#: (``sglang:num_retracted_requests_total``, a counter that appears only at the first retraction, with
#: ``--enable-metrics``; the gauge ``sglang:num_retracted_reqs`` resets after each publish and is not read).
PREEMPTION_COUNTERS = {"vllm": ("vllm:num_preemptions_total", "vllm:num_preemptions_total"),
                       "sglang": ("sglang:num_retracted_requests_total", "sglang:num_running_reqs")}
#: A context length the long arm asks for is the prompts' longest request plus this much.
LONG_SLACK_TOKENS = 256


#: The engine argument each arm's launch needs, and the source file of the installed engine that declares
#: its arguments: an installed version without it cannot set the arm up (checked before any launch).
#: vLLM declares engine arguments in ``engine/arg_utils.py`` and the OpenAI front end's own (such as
#: ``--enable-prompt-tokens-details``) in ``entrypoints/openai/cli_args.py`` (read in vLLM 0.26.0).
ARM_ARGUMENTS = {
    "vllm": (("engine/arg_utils.py", "entrypoints/openai/cli_args.py"),
             {"preempt": "num_gpu_blocks_override", "prefix-warm": "enable_prompt_tokens_details",
              "fp8-kv": "kv_cache_dtype", "long": "max_model_len"}),
    "sglang": (("srt/server_args.py",), {"preempt": "max_total_tokens", "fp8-kv": "kv_cache_dtype",
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
    name = needs.get(arm)
    pkg = installed_package_dir(engine)
    if name is None or pkg is None:
        return
    texts = []
    for source in sources:
        try:
            texts.append((pkg / source).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    if not texts:
        return
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
    if arm in ("default", "prefix-warm") and not (arm == "prefix-warm" and engine == "vllm"):
        return ArmLaunch()
    if arm == "prefix-warm":  # vLLM: cached tokens are answered only with this flag
        return ArmLaunch(("--enable-prefix-caching", "--enable-prompt-tokens-details"))
    if arm == "deterministic":
        return ArmLaunch(engine_opts={"batch_invariant": True, "dev_mode": True} if engine == "vllm"
                         else {"deterministic": True})
    if arm == "fp8-kv":  # vLLM shows its cache dtype only on a dev-mode /server_info
        if engine == "vllm":
            return ArmLaunch(("--kv-cache-dtype", "fp8"), engine_opts={"dev_mode": True})
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
    ``/server_info`` ``kv_cache_dtype``."""
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


def prefix_cache_floor(engine_spec: str, spec_config: dict[str, Any] | None) -> tuple[int, str]:
    """The fewest prompt tokens for which a warm request must find part of its prompt cached, and the
    reason in words: one cache unit plus the last prompt token (always recomputed), and on vLLM one
    block more when the speculative method drafts from the target's hidden states
    (:data:`VLLM_HIDDEN_STATE_METHODS`). Shorter prompts neither prove nor disprove the warm path."""
    unit = PREFIX_CACHE_UNIT.get(engine_spec, 1)
    method = (spec_config or {}).get("method")
    if engine_spec == "vllm" and method in VLLM_HIDDEN_STATE_METHODS:
        return 2 * unit + 1, (f"two cache units ({unit} tokens each: vLLM drops a hit's last block for "
                              f"{method}, whose draft needs its hidden states) plus the recomputed last token")
    return unit + 1, f"one cache unit ({unit} tokens) plus the recomputed last token"


def request_facts(engine: Any, request_ids: Sequence[str], *, speculative: bool, key: str) -> dict[str, Any]:
    """{request id: the answer's ``key`` fact} as the adapter noted it (a missing one is None)."""
    facts = getattr(engine, "noted_request", None)
    return {rid: (facts(rid, speculative).get(key) if callable(facts) else None) for rid in request_ids}
