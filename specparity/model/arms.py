"""Configuration arms: the one list of the run configurations ``specparity arms`` knows.

An arm is a named change to an engine's launch or requests (prefix caching warmed, KV cache too small
to hold every request at once, fp8 KV cache, deterministic kernels, very long prompts) plus the proof,
read from the judged requests or the engine, that the change happened — and that the other arms'
conditions did not: the default arm is shown free of all of them. Speculative-decoding bugs cluster in these
configurations, which engine CIs rarely run; a lossless gate run on the default configuration passes
them. Each arm is data here; the launch knobs per engine live in
:mod:`specparity.engines.server.arm_knobs`, the orchestration in :mod:`specparity.run.arm_runs`, and
every other module reads this registry (one place for the list).

An arm whose proof is missing ends ``not exercised``, which fails: a condition the judged requests and the
engine do not show never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Engines whose servers the arms can configure; each arm names the ones it supports.
SERVER_ENGINES = ("vllm", "sglang", "llamacpp")

#: A long arm's prompts are at least this many tokens (the failures it looks for start past 16K).
LONG_MIN_TOKENS = 32768
#: A long arm's prompts where the target's ``max_position_embeddings`` allows.
LONG_MAX_TOKENS = 131072


@dataclass(frozen=True)
class Arm:
    """One configuration arm.

    ``changes`` says what the arm changes, per engine (words for the table and docs: the knobs
    themselves are in :mod:`specparity.engines.server.arm_knobs`); ``proof`` names the facts that show the
    condition happened on the judged requests; ``launch``: the arm changes how servers are launched (with
    ``--baseline-url`` / ``--spec-url`` it runs only under ``--prelaunched``); ``engines``: the
    engines that can set it up, and ``unsupported`` why each other one cannot; ``hybrid``: the arm needs a
    hybrid target (linear-attention layers with a recurrent state per request), and is run without ``--arms``
    only for one."""

    name: str
    description: str
    changes: dict[str, str]
    proof: dict[str, str]
    launch: bool
    engines: tuple[str, ...]
    unsupported: dict[str, str]
    hybrid: bool = False


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("default", "the preset as it is; its judged requests start from an empty prefix cache",
            changes={"vllm": "nothing the engine computes (every vLLM arm: --enable-prompt-tokens-details and "
                             "VLLM_SERVER_DEV_MODE=1, for each answer's cached tokens and /reset_prefix_cache)",
                     "sglang": "nothing", "llamacpp": "nothing"},
            proof={"vllm": "free of every other arm's condition: each judged speculative request's "
                           "usage.prompt_tokens_details.cached_tokens at most the prefix it shares with another "
                           "judged prompt (cold), no preemption on the speculative servers during the judged "
                           "requests, no fp8 KV cache, no determinism declared, no prompt of the long arm's size",
                   "sglang": "free of every other arm's condition: each judged speculative request's "
                             "meta_info.cached_tokens at most the prefix it shares with another judged prompt "
                             "(cold) and its meta_info.num_retractions 0, no fp8 KV cache, no determinism "
                             "declared, no prompt of the long arm's size",
                   "llamacpp": "free of every other arm's condition: cold and never preempted by construction "
                               "(cache_prompt false; slots do not preempt), no prompt of the long arm's size"},
            launch=False, engines=SERVER_ENGINES, unsupported={}),
        Arm("deterministic", "the engine's deterministic / batch-invariant switch on both sides; the run is "
            "bit-exact (a near tie fails)",
            changes={"vllm": "VLLM_BATCH_INVARIANT=1 in both servers' environment",
                     "sglang": "--enable-deterministic-inference on both launches"},
            proof={"vllm": "the determinism declaration (both launches set it, or every dev-mode /server_info "
                           "shows vllm_env.VLLM_BATCH_INVARIANT)",
                   "sglang": "/server_info enable_deterministic_inference on every server of both sides"},
            launch=True, engines=("vllm", "sglang"),
            unsupported={"llamacpp": "llama-server has no deterministic / batch-invariant switch"}),
        Arm("preempt", "a KV cache too small for every request in flight, so requests are preempted "
            "mid-speculation; concurrency raised to what the engine serves",
            changes={"vllm": "--num-gpu-blocks-override N (N from the prompts' lengths and the concurrency) "
                             "and --max-model-len cut to the largest request, on both launches",
                     "sglang": "--max-total-tokens N (the same sizing, in tokens), --context-length cut to the "
                               "largest request and --enable-metrics on both launches"},
            proof={"vllm": "/metrics vllm:num_preemptions_total delta on the speculative servers over the judged "
                           "requests alone > 0 (vLLM answers no per-request count)",
                   "sglang": "meta_info.num_retractions > 0 on a judged speculative request"},
            launch=True, engines=("vllm", "sglang"),
            unsupported={"llamacpp": "llama-server's slots each own their context; it does not preempt"}),
        Arm("prefix-warm", "every prompt sent once to the speculative server (max_tokens 1) before the judged "
            "request, so the judged one is a prefix-cache hit; judged against the cold baseline",
            changes={"vllm": "prefix caching on (its default) and --enable-prompt-tokens-details on both launches; "
                             "a warm-up request per prompt",
                     "sglang": "radix cache on (its default); a warm-up request per prompt"},
            proof={"vllm": "every judged speculative request long enough to be cached had a warm-up that succeeded "
                           "and found its whole prompt cached (usage.prompt_tokens_details.cached_tokens: whole "
                           "blocks of all but the last token, one block less for a hidden-state draft)",
                   "sglang": "every judged speculative request long enough to be cached had a warm-up that "
                             "succeeded and found its whole prompt cached (meta_info.cached_tokens: whole pages of "
                             "/server_info page_size of all but the last token)"},
            launch=False, engines=("vllm", "sglang"),
            unsupported={"llamacpp": "not wired: llama-server's cache_prompt reuse is not read back (timings.cache_n)"}),
        Arm("fp8-kv", "fp8 KV cache on both sides; the summary states the decode/prefill bias on its own line",
            changes={"vllm": "--kv-cache-dtype fp8 on both launches",
                     "sglang": "--kv-cache-dtype fp8_e4m3 on both launches"},
            proof={"vllm": "dev-mode /server_info vllm_config.cache_config.cache_dtype starts with fp8 on every server",
                   "sglang": "/server_info kv_cache_dtype starts with fp8 on every server"},
            launch=True, engines=("vllm", "sglang"),
            unsupported={"llamacpp": "llama-server's KV cache types (--cache-type-k/v) have no fp8"}),
        Arm("long", f"prompts of >= {LONG_MIN_TOKENS} tokens (needle in a haystack), the context raised to fit; "
            f"{LONG_MAX_TOKENS} where the target's max_position_embeddings allows",
            changes={"vllm": "--max-model-len L on both launches", "sglang": "--context-length L on both launches",
                     "llamacpp": "--ctx-size L on both launches"},
            proof={e: f"every judged prompt is >= {LONG_MIN_TOKENS} tokens (the engine's own prompt token count "
                      "where it reports one)" for e in SERVER_ENGINES},
            launch=True, engines=SERVER_ENGINES, unsupported={}),
        Arm("mamba-slots", "a hybrid target's mamba state cache sized below the requests in flight: the server "
            "caps its running requests under the run's concurrency, so judged requests wait (or are retracted) for "
            "a state slot; concurrency raised to what the engine serves",
            changes={"sglang": "--max-mamba-cache-size S (S = the mamba-slots probe's state slots per request x half "
                               "the requests in flight) and --enable-metrics on both launches"},
            proof={"sglang": "/server_info internal_states effective_max_running_requests_per_dp below the requests "
                             "in flight on every speculative server (beside what the mamba-slots probe predicted), "
                             "and more judged speculative requests alive on a server at once than it runs "
                             "(meta_info.request_received_ts to request_finished_ts): the rest waited for a slot"},
            launch=True, engines=("sglang",),
            hybrid=True,
            unsupported={"vllm": "not wired: vLLM allocates a hybrid's recurrent state with its KV cache blocks, "
                                 "with no separate slot count to set (the preempt arm bounds both)",
                         "llamacpp": "llama-server's slots each hold their own recurrent state; no slot pool to "
                                     "exhaust"}),
    )
}

#: Arms' verdicts beyond the gate's: the condition was not proven by the engine's counters.
NOT_EXERCISED = "NOT EXERCISED"


def arm_names() -> tuple[str, ...]:
    return tuple(ARMS)


def parse_arms(text: str | None, engine: str, *, hybrid: bool = False) -> tuple[Arm, ...]:
    """``--arms a,b``: known names, each once (None: every arm ``engine`` supports, those that need a hybrid
    target only when ``hybrid``). ValueError, one line."""
    if text is None:
        return tuple(a for a in ARMS.values() if engine in a.engines and (hybrid or not a.hybrid))
    names = [n.strip() for n in str(text).split(",")]
    if not str(text).strip() or any(not n for n in names):
        raise ValueError(f"--arms {text!r}: expected arm names separated by commas (known: {', '.join(ARMS)})")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"--arms {text}: unknown arm {unknown[0]!r} (known: {', '.join(ARMS)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--arms {text}: {', '.join(twice)} given twice")
    return tuple(ARMS[n] for n in names)
