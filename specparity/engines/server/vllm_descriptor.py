"""vLLM's own facts beyond the protocol (:class:`~specparity.engines.server.descriptor.ServerDescriptor`):
its arms' knobs and proofs, its prefix cache, its preemption counter, and how a reproducer reads its answers
(facts read in vLLM 0.26.0's source, named where they are used)."""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_sizing import (
    KV_BLOCK_TOKENS,
    LONG_PROOF,
    ArmLaunch,
    ArmSizing,
    long_context_length,
    preempt_context,
    preempt_tokens,
)
from specparity.engines.server.descriptor import ArmKnob, PrefixCache, ServerDescriptor, no_change

#: vLLM's KV cache block size (``--block-size`` default, tokens): what its prefix cache holds whole (a
#: dev-mode ``/server_info`` says ``cache_config.block_size``).
VLLM_BLOCK_TOKENS = KV_BLOCK_TOKENS
#: Speculative methods whose draft reads the target's hidden states. vLLM drops the last matched block
#: of every prefix-cache hit for them, so that the block is recomputed and its hidden states reach the
#: draft (``SpeculativeConfig.use_eagle`` in ``vllm/config/speculative.py``, the EAGLE drop in
#: ``find_longest_cache_hit``, ``vllm/v1/core/single_type_kv_cache_manager.py``; read in 0.26.0): a
#: warm prompt then finds ``floor((n - 1) / 16) * 16 - 16`` tokens cached, nothing below 33 tokens.
VLLM_HIDDEN_STATE_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
#: What every vLLM arm adds to both launches besides its own knob (with ``VLLM_SERVER_DEV_MODE=1``):
#: each answer's ``usage.prompt_tokens_details.cached_tokens``, which proves a judged request cold or warm.
VLLM_EVERY_ARM_FLAGS = ("--enable-prompt-tokens-details",)


def _dev_info(engine: Any, endpoint: Any) -> dict[str, Any]:
    info = engine.dev_server_info(endpoint) or {}
    return info if isinstance(info, dict) else {}


def _cache_config(engine: Any, endpoint: Any) -> dict[str, Any]:
    config = _dev_info(engine, endpoint).get("vllm_config")
    cache = config.get("cache_config") if isinstance(config, dict) else None
    return cache if isinstance(cache, dict) else {}


def read_kv_cache_dtype(engine: Any, endpoint: Any) -> Any:
    """A dev-mode ``/server_info`` ``vllm_config.cache_config.cache_dtype`` (every vLLM arm runs in dev mode)."""
    return _cache_config(engine, endpoint).get("cache_dtype")


def read_block_size(engine: Any, endpoint: Any) -> Any:
    return _cache_config(engine, endpoint).get("block_size")


def _reset_ok(text: str) -> bool:
    """``POST /reset_prefix_cache`` answers ``{"success": false}`` while a request holds blocks
    (``BlockPool.reset_prefix_cache``)."""
    try:
        return bool(json.loads(text).get("success"))
    except (ValueError, AttributeError):
        return False


def _units_dropped(config: Mapping[str, Any]) -> int:
    return 1 if config.get("method") in VLLM_HIDDEN_STATE_METHODS else 0


def _floor_words(config: Mapping[str, Any], unit: int) -> str | None:
    method = config.get("method")
    if method in VLLM_HIDDEN_STATE_METHODS:
        return (f"two cache units ({unit} tokens each: vLLM drops a hit's last block for "
                f"{method}, whose draft needs its hidden states) plus the recomputed last token")
    return None


def _preempt(sizing: ArmSizing, _options: EngineOptions) -> ArmLaunch:
    # the context is cut to the largest request too: a server refuses to start with a KV cache that
    # cannot hold one request of its full context length
    blocks = math.ceil(preempt_tokens(sizing) / VLLM_BLOCK_TOKENS)
    return ArmLaunch(("--num-gpu-blocks-override", str(blocks), "--max-model-len", str(preempt_context(sizing))),
                     concurrency=sizing.concurrency)


def _long(sizing: ArmSizing, options: EngineOptions) -> ArmLaunch:
    return ArmLaunch(("--max-model-len", str(long_context_length(sizing, options.target))))


ARMS = {
    "default": ArmKnob(
        "nothing the engine computes (every vLLM arm: --enable-prompt-tokens-details and VLLM_SERVER_DEV_MODE=1, "
        "for each answer's cached tokens and /reset_prefix_cache)",
        "free of every other arm's condition: each judged speculative request's "
        "usage.prompt_tokens_details.cached_tokens at most the prefix it shares with another judged prompt (cold), "
        "no preemption on the speculative servers during the judged requests, no fp8 KV cache, no determinism "
        "declared, no prompt of the long arm's size",
        no_change),
    "deterministic": ArmKnob(
        "VLLM_BATCH_INVARIANT=1 in both servers' environment",
        "the determinism declaration (both launches set it, or every dev-mode /server_info shows "
        "vllm_env.VLLM_BATCH_INVARIANT)",
        lambda _s, _o: ArmLaunch(engine_opts={"batch_invariant": True})),
    "preempt": ArmKnob(
        "--num-gpu-blocks-override N (N from the prompts' lengths and the concurrency) and --max-model-len cut to "
        "the largest request, on both launches",
        "/metrics vllm:num_preemptions_total delta on the speculative servers over the judged requests alone > 0 "
        "(vLLM answers no per-request count)",
        _preempt, "num_gpu_blocks_override"),
    "prefix-warm": ArmKnob(
        "prefix caching on (its default) and --enable-prompt-tokens-details on both launches; a warm-up request "
        "per prompt",
        "every judged speculative request long enough to be cached had a warm-up that succeeded and found its whole "
        "prompt cached (usage.prompt_tokens_details.cached_tokens: whole blocks of all but the last token, one block "
        "less for a hidden-state draft)",
        lambda _s, _o: ArmLaunch(("--enable-prefix-caching",)), "enable_prefix_caching"),
    "fp8-kv": ArmKnob(
        "--kv-cache-dtype fp8 on both launches",
        "dev-mode /server_info vllm_config.cache_config.cache_dtype starts with fp8 on every server",
        lambda _s, _o: ArmLaunch(("--kv-cache-dtype", "fp8")), "kv_cache_dtype"),
    "long": ArmKnob("--max-model-len L on both launches", LONG_PROOF, _long, "max_model_len"),
}

REPRO_PARSE = r'''
def parse(answer):
    """vLLM /v1/completions with return_tokens_as_token_ids: "token_id:N" keys, rows sorted by logprob."""
    block = answer["choices"][0]["logprobs"]
    ids = [int(t.split(":", 1)[1]) for t in block["tokens"]]
    rows = [sorted(((int(k.split(":", 1)[1]), float(v), None) for k, v in row.items()), key=lambda t: -t[1])
            if row else None for row in block["top_logprobs"]]
    return ids, rows
'''

REPRO_ROW_PARSE = r"""
def row_of(kind, answer, pos, token, prompt_len):
    choice = answer["choices"][0]
    if kind == "score":  # prompt_logprobs of prompt + continuation: {"<id>": {"logprob", "rank", ...}}
        entries = choice["prompt_logprobs"][prompt_len + pos] or {}
        ranked = sorted(entries.items(), key=lambda kv: (kv[1].get("rank") or 1e9, -kv[1]["logprob"]))
        row = [(int(k), float(v["logprob"]), v.get("decoded_token")) for k, v in ranked]
        own = entries.get(str(token))
        return (None if own is None else float(own["logprob"])), row
    block = choice["logprobs"]
    ids = [int(t.split(":", 1)[1]) for t in block["tokens"]]
    row = sorted(((int(k.split(":", 1)[1]), float(v), None) for k, v in (block["top_logprobs"][pos] or {}).items()),
                 key=lambda t: -t[1])
    own = block["token_logprobs"][pos] if ids[pos] == token else None
    return (None if own is None else float(own)), row
"""

DESCRIPTOR = ServerDescriptor(
    name="vllm",
    arms=ARMS,
    unsupported_arms={"mamba-slots": "not wired: vLLM allocates a hybrid's recurrent state with its KV cache blocks, "
                                     "with no separate slot count to set (the preempt arm bounds both)"},
    every_arm=ArmLaunch(VLLM_EVERY_ARM_FLAGS, engine_opts={"dev_mode": True}),
    every_arm_argument="enable_prompt_tokens_details",
    package="vllm",
    # engine arguments in engine/arg_utils.py, the OpenAI front end's own (--enable-prompt-tokens-details) in
    # entrypoints/openai/cli_args.py
    argument_sources=("engine/arg_utils.py", "entrypoints/openai/cli_args.py"),
    prefix_cache=PrefixCache(
        unit=VLLM_BLOCK_TOKENS, read_unit=read_block_size, unit_source="/server_info cache_config.block_size",
        # only on a VLLM_SERVER_DEV_MODE=1 server (serve/dev/cache/api_router.py)
        reset="/reset_prefix_cache", reset_ok=_reset_ok,
        needs="vLLM answers it only with --enable-prompt-tokens-details",
        units_dropped=_units_dropped, floor_words=_floor_words),
    # a counter declared from the start; 0.26.0 counts Request.num_preemptions per request (v1/request.py),
    # but no answer carries it
    preemption_counter=("vllm:num_preemptions_total", "vllm:num_preemptions_total"),
    read_kv_cache_dtype=read_kv_cache_dtype,
    repro_parse=REPRO_PARSE,
    repro_row_parse=REPRO_ROW_PARSE,
)
