"""SGLang's own facts beyond the protocol (:class:`~specparity.engines.server.descriptor.ServerDescriptor`):
its arms' knobs and proofs, its radix cache, its retraction counter, the requests it runs at once, and how a
reproducer reads its answers (facts read in SGLang 0.5.17's source, named where they are used)."""

from __future__ import annotations

from typing import Any, Mapping

from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_sizing import (
    LONG_PROOF,
    ArmLaunch,
    ArmSizing,
    long_context_length,
    mamba_slots_size,
    preempt_context,
    preempt_tokens,
)
from specparity.engines.server.descriptor import ArmKnob, PrefixCache, ServerDescriptor, no_change
from specparity.engines.server.sglang_launch import launch_configs

#: SGLang speculative algorithms whose radix cache is keyed by token bigrams (``RadixKey(is_bigram=...)`` with
#: ``SpeculativeAlgorithm.is_eagle()``, ``mem_cache/radix_cache.py``, read in 0.5.17; NEXTN runs as EAGLE): a
#: prompt of n tokens is n - 1 bigrams, so a hit is one token shorter.
SGLANG_BIGRAM_ALGORITHMS = frozenset({"EAGLE", "EAGLE3", "NEXTN", "FROZEN_KV_MTP"})


def _info(engine: Any, endpoint: Any) -> dict[str, Any]:
    info = engine.raw_server_info(endpoint) or {}
    return info if isinstance(info, dict) else {}


def read_kv_cache_dtype(engine: Any, endpoint: Any) -> Any:
    return _info(engine, endpoint).get("kv_cache_dtype")


def read_page_size(engine: Any, endpoint: Any) -> Any:
    return _info(engine, endpoint).get("page_size")


def read_running_cap(engine: Any, endpoint: Any) -> tuple[Any, dict[str, Any]]:
    """(``internal_states[0].effective_max_running_requests_per_dp``, the whole ``/server_info``): the most requests
    the server runs at once after every cap it applied at start-up, the mamba state cache's included
    (``Scheduler.get_internal_state``)."""
    info = _info(engine, endpoint)
    states = info.get("internal_states")
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    return state.get("effective_max_running_requests_per_dp"), info


def _bigram(config: Mapping[str, Any]) -> bool:
    return str(config.get("speculative_algorithm") or "").upper() in SGLANG_BIGRAM_ALGORITHMS


def _floor_words(config: Mapping[str, Any], unit: int) -> str | None:
    if _bigram(config):
        return (f"one cache unit ({unit} tokens) plus the recomputed last token and the bigram key's "
                f"token ({config.get('speculative_algorithm')})")
    return None


def _preempt(sizing: ArmSizing, _options: EngineOptions) -> ArmLaunch:
    # the context is cut to the largest request too: a server refuses to start with a KV cache that
    # cannot hold one request of its full context length
    return ArmLaunch(("--max-total-tokens", str(preempt_tokens(sizing)), "--context-length",
                      str(preempt_context(sizing)), "--enable-metrics"), concurrency=sizing.concurrency)


def _mamba_slots(sizing: ArmSizing, _options: EngineOptions) -> ArmLaunch:
    # both launches: the baseline's answers do not depend on how many run at once
    size, _cap = mamba_slots_size(sizing)
    return ArmLaunch(("--max-mamba-cache-size", str(size), "--enable-metrics"), concurrency=sizing.concurrency)


def _long(sizing: ArmSizing, options: EngineOptions) -> ArmLaunch:
    return ArmLaunch(("--context-length", str(long_context_length(sizing, options.target))))


def spec_launch_args(options: EngineOptions) -> list[str]:
    return launch_configs(options)[1].args()


ARMS = {
    "default": ArmKnob(
        "nothing",
        "free of every other arm's condition: each judged speculative request's meta_info.cached_tokens at most "
        "the prefix it shares with another judged prompt (cold) and its meta_info.num_retractions 0, no fp8 KV "
        "cache, no determinism declared, no prompt of the long arm's size",
        no_change),
    "deterministic": ArmKnob(
        "--enable-deterministic-inference on both launches",
        "/server_info enable_deterministic_inference on every server of both sides",
        lambda _s, _o: ArmLaunch(engine_opts={"deterministic": True}), "enable_deterministic_inference"),
    "preempt": ArmKnob(
        "--max-total-tokens N (the same sizing, in tokens), --context-length cut to the largest request and "
        "--enable-metrics on both launches",
        "meta_info.num_retractions > 0 on a judged speculative request",
        _preempt, "max_total_tokens"),
    "prefix-warm": ArmKnob(
        "radix cache on (its default); a warm-up request per prompt",
        "every judged speculative request long enough to be cached had a warm-up that succeeded and found its "
        "whole prompt cached (meta_info.cached_tokens: whole pages of /server_info page_size of all but the last "
        "token)",
        no_change),
    "fp8-kv": ArmKnob(
        "--kv-cache-dtype fp8_e4m3 on both launches",
        "/server_info kv_cache_dtype starts with fp8 on every server",
        lambda _s, _o: ArmLaunch(("--kv-cache-dtype", "fp8_e4m3")), "kv_cache_dtype"),
    "long": ArmKnob("--context-length L on both launches", LONG_PROOF, _long, "context_length"),
    "mamba-slots": ArmKnob(
        "--max-mamba-cache-size S (S = the mamba-slots probe's state slots per request x half the requests in "
        "flight) and --enable-metrics on both launches",
        "/server_info internal_states effective_max_running_requests_per_dp below the requests in flight on every "
        "speculative server (beside what the mamba-slots probe predicted), and more judged speculative requests "
        "alive on a server at once than it runs (meta_info.request_received_ts to request_finished_ts): the rest "
        "waited for a slot",
        _mamba_slots, "max_mamba_cache_size"),
}

REPRO_PARSE = r'''
def parse(answer):
    """SGLang /generate: output_ids and meta_info.output_top_logprobs ([logprob, id, text] each)."""
    ids = [int(t) for t in answer["output_ids"]]
    tops = answer["meta_info"].get("output_top_logprobs") or [None] * len(ids)
    rows = [[(int(a[1]), float("nan") if a[0] is None else float(a[0]), a[2] if len(a) > 2 else None)
             for a in row] if row else None for row in tops]
    return ids, rows
'''

REPRO_ROW_PARSE = r"""
def row_of(kind, answer, pos, token, prompt_len):
    meta = answer["meta_info"]
    if kind == "score":  # logprob_start_len = prompt_len - 1: entry 0 is the last prompt position
        own, top = meta["input_token_logprobs"][1 + pos], (meta.get("input_top_logprobs") or [])[1 + pos]
    else:
        own, top = meta["output_token_logprobs"][pos], (meta.get("output_top_logprobs") or [])[pos]
    row = [(int(a[1]), float("nan") if a[0] is None else float(a[0]), a[2] if len(a) > 2 else None) for a in top or ()]
    return (None if own[0] is None or int(own[1]) != token else float(own[0])), row
"""

DESCRIPTOR = ServerDescriptor(
    name="sglang",
    arms=ARMS,
    package="sglang",
    argument_sources=("srt/server_args.py",),
    # servers run from another environment (--engine-opt python): the source installed here says nothing
    source_check=lambda options: not options.extra.get("python"),
    prefix_cache=PrefixCache(
        # the radix cache holds whole pages (--page-size, 1 by default; /server_info says page_size)
        unit=1, read_unit=read_page_size, unit_source="/server_info page_size",
        # GET or POST, any server; HTTP 400 unless the scheduler is idle; it also zeroes the lifetime speculation
        # counters behind /server_info's avg_spec_accept_length, which a run reads once, before any request, and
        # leaves the answers' own meta_info.spec_* and the /metrics counters alone (Scheduler.flush_cache,
        # MetricsReporter.reset_metrics)
        reset="/flush_cache",
        key_tokens_lost=lambda config: 1 if _bigram(config) else 0, floor_words=_floor_words),
    # a counter that appears only at the first retraction, with --enable-metrics; the gauge
    # sglang:num_retracted_reqs resets after each publish and is not read; read only where the answers lack
    # their own num_retractions
    preemption_counter=("sglang:num_retracted_requests_total", "sglang:num_running_reqs"),
    read_kv_cache_dtype=read_kv_cache_dtype,
    read_running_cap=read_running_cap,
    spec_launch_args=spec_launch_args,
    repro_parse=REPRO_PARSE,
    repro_row_parse=REPRO_ROW_PARSE,
)
