"""vLLM's wire format: the ``/v1/completions`` bodies the adapter sends (and a reproducer sends again) and
the parsers of what vLLM answers — completions and their logprobs, prompt logprobs, usage and per-request
speculation counters, ``/metrics``, a dev-mode ``/server_info``'s speculative config and numerics. Pure functions
over JSON: what each field means, and the vLLM versions it was read in, is in :mod:`specparity.engines.server.vllm`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from specparity.engines.server.http import ServerError
from specparity.engines.server.wire import WireFormat
from specparity.model.constraints import Constraint
from specparity.model.types import GenerationRequest, SpecStats, TokenScores


#: The counters read around the speculative phase: our name -> exposed sample name.
SPEC_COUNTERS = {
    "proposed": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "verify_steps": "vllm:spec_decode_num_drafts_total",
}


#: What the servers served, read with the draft counters (``tests/data/vllm/metrics_after.txt``, and the
#: live 0.26.0 bodies): our name -> exposed sample name, summed over labels (``finished_reason`` too).
TRAFFIC_COUNTERS = {
    "finished": "vllm:request_success_total",
    "generated": "vllm:generation_tokens_total",
}


SPEC_FAMILY_PREFIX = "vllm:spec_decode_"


#: Words in the keys of a served ``SpeculativeConfig`` that change from launch to launch.
RUN_SPECIFIC_WORDS = ("port", "addr", "_ip", "rank", "seed", "instance")


def version_tuple(version: str | None) -> tuple[int, int] | None:
    """``"0.26.0"`` → ``(0, 26)``; None when unreadable."""
    try:
        major, minor = (int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return None
    return major, minor


def stable_spec_config(config: Any) -> dict[str, Any]:
    """The launch-independent part of a served ``SpeculativeConfig`` (dev-mode ``/server_info``):
    the scalar settings that are set (method, model, num_speculative_tokens, prompt_lookup_*,
    suffix_decoding_*, rejection/draft sampling…), without the nested target/draft model and parallel
    configs (7 KB in 0.26.0, with ports that change per launch) and without private or run-specific
    keys. Goldens and ``--resume`` compare fingerprints, so this must not change between launches."""
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for key in sorted(config):
        value = config[key]
        if key.startswith("_") or value is None or isinstance(value, (dict, list, tuple)):
            continue
        if any(word in key for word in RUN_SPECIFIC_WORDS):
            continue
        out[key] = value
    return out


def normalise_dtype(dtype: Any) -> str | None:
    """``torch.bfloat16`` (vLLM's ``model_config.dtype`` on ``/server_info``) → ``bfloat16``."""
    if dtype is None:
        return None
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


#: Where a dev-mode ``/server_info`` ``vllm_config`` says what decides how the target computes (the paths of
#: the recorded 0.26.0 body, ``tests/data/vllm-0.26.0/server_info_ngram.json``): every server of both sides
#: must report the same (:meth:`ServerEngine.check_same_target`).
NUMERICS_PATHS = ("model_config.dtype", "model_config.quantization", "cache_config.cache_dtype",
                  "attention_config.backend", "parallel_config.tensor_parallel_size",
                  "parallel_config.pipeline_parallel_size")


def reported_numerics(vllm_config: Any) -> dict[str, Any]:
    """{path: value} of :data:`NUMERICS_PATHS` that ``vllm_config`` reports (dtype without ``torch.``; a
    null quantization as "none"; a null attention backend is not a report: vLLM chose it and says no
    more); empty without a dev-mode ``/server_info``."""
    out: dict[str, Any] = {}
    for path in NUMERICS_PATHS:
        section, key = path.split(".")
        part = vllm_config.get(section) if isinstance(vllm_config, dict) else None
        if isinstance(part, dict) and part.get(key) is not None:
            out[path] = normalise_dtype(part[key]) if path == "model_config.dtype" else part[key]
        elif isinstance(part, dict) and key in part and path == "model_config.quantization":
            out[path] = "none"  # vLLM resolves it from the checkpoint: null is unquantized weights
    return out


def top_k_disabled(version: str | None) -> int:
    """The ``top_k`` value meaning "no top-k": 0 from vLLM 0.11 on (read in 0.11.0 and 0.33.0, which also
    quietly accept -1), -1 for older or unknown versions (accepted by every version read)."""
    v = version_tuple(version)
    return -1 if v is None else (0 if v >= (0, 11) else -1)


#: ``structured_outputs`` key of each prompt constraint (``StructuredOutputsParams`` in 0.26 and 0.33;
#: the old top-level ``guided_json`` / ``guided_grammar`` are gone from both).
CONSTRAINT_KEYS = {"json_schema": "json", "grammar": "grammar"}


def completion_body(model: str | None, prompt_ids: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int],
                    *, logprobs: int | None, top_k: int, prompt_logprobs: int | None = None,
                    constraint: Constraint | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` body: token-id prompt, greedy with every knob explicit, logprobs by id;
    a prompt's output constraint as ``structured_outputs`` (:data:`CONSTRAINT_KEYS`)."""
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    body.update({
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(max_tokens),
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": int(top_k),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "logprobs": logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
    })
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = int(prompt_logprobs)
    if constraint is not None:
        body["structured_outputs"] = {CONSTRAINT_KEYS[constraint.kind]: constraint.value()}
    return body


def request_body(req: GenerationRequest, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body of one generation request; ``facts``: the served ``model`` name and
    the server version's ``top_k`` value meaning "no top-k" (:meth:`VLLMEngine.request_facts`)."""
    return completion_body(facts.get("model"), req.prompt_ids, req.max_new_tokens, req.stop_token_ids,
                           logprobs=req.top_k, top_k=int(facts["top_k"]), constraint=req.constraint)


def score_body(prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int,
               facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body that scores ``continuation_ids`` teacher-forced: prompt + continuation
    as the prompt, one new token, ``prompt_logprobs`` k (:func:`parse_prompt_logprobs` reads it)."""
    return completion_body(facts.get("model"), [*prompt_ids, *continuation_ids], 1, (), logprobs=None,
                           top_k=int(facts["top_k"]), prompt_logprobs=top_k)


WIRE = WireFormat("/v1/completions", request_body, score=score_body)


def parse_token_key(key: str) -> int:
    """``"token_id:1587"`` → 1587 (ValueError for a decoded-string key: ``return_tokens_as_token_ids`` ignored)."""
    if not isinstance(key, str) or not key.startswith("token_id:"):
        raise ValueError(f"token {key!r} is not 'token_id:<id>': the server ignored return_tokens_as_token_ids")
    return int(key[len("token_id:"):])


def parse_logprobs_block(block: dict[str, Any], k: int) -> tuple[list[int], TokenScores]:
    """``choices[i].logprobs`` (with ``return_tokens_as_token_ids``) → (token ids, scores)."""
    tokens = block["tokens"]
    ids = [parse_token_key(t) for t in tokens]
    n = len(ids)
    lps, tops = block["token_logprobs"], block["top_logprobs"]
    if len(lps) != n or len(tops) != n:
        raise ValueError(f"logprobs block: {n} tokens, {len(lps)} token_logprobs, {len(tops)} top_logprobs")
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    for i in range(n):
        logprobs[i] = math.nan if lps[i] is None else float(lps[i])
        row = tops[i]
        if not row:
            continue
        # engine order: the sampled token first, then ranks 1..k; sorting is stable, so equal logprobs
        # keep that order. With the sampled token outside the top k the row has k + 1 keys.
        alts = sorted(((parse_token_key(key), float(v)) for key, v in row.items()), key=lambda t: -t[1])
        for j, (tid, lp) in enumerate(alts[:k]):
            top_ids[i, j], top_lp[i, j] = tid, lp
    return ids, TokenScores(np.asarray(ids, np.int64), logprobs, top_ids, top_lp)


def parse_completion(body: Any, k: int) -> tuple[list[int], str, TokenScores, dict[str, Any]]:
    """A ``/v1/completions`` answer for one prompt → (output ids, finish reason, scores, choice)."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise ServerError("/v1/completions answered without 'choices'")
    if len(body["choices"]) != 1:
        raise ServerError(f"/v1/completions answered {len(body['choices'])} choices for one prompt")
    choice = body["choices"][0]
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise ServerError(f"finish_reason {finish!r} (stop_reason {choice.get('stop_reason')!r}): expected 'stop' or "
                          "'length'")
    block = choice.get("logprobs")
    if not isinstance(block, dict):
        raise ServerError("choices[0].logprobs is null: the server ignored 'logprobs'")
    ids, scores = parse_logprobs_block(block, k)
    token_ids = choice.get("token_ids")
    if token_ids is not None and [int(t) for t in token_ids] != ids:
        raise ServerError(f"choices[0].token_ids {token_ids} disagree with logprobs.tokens {ids}")
    return ids, finish, scores, choice


def parse_prompt_logprobs(rows: Any, prompt_ids: Sequence[int], continuation_ids: Sequence[int],
                          k: int) -> TokenScores:
    """``choices[0].prompt_logprobs`` of ``prompt + continuation`` → the continuation's rows.

    Each position is ``{"<id>": {"logprob", "rank", "decoded_token"}}``: the actual token first (with
    its own rank, which may exceed k), then ranks 1..k."""
    L, n = len(prompt_ids), len(continuation_ids)
    if not isinstance(rows, list) or len(rows) != L + n:
        got = len(rows) if isinstance(rows, list) else rows
        raise ValueError(f"prompt_logprobs has {got} positions, expected {L + n}")
    if rows[0] is not None:
        raise ValueError("prompt_logprobs[0] is not null (the first prompt token has no logprob)")
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    for i, tok in enumerate(continuation_ids):
        row = rows[L + i]
        if not isinstance(row, dict) or str(int(tok)) not in row:
            raise ValueError(f"prompt_logprobs[{L + i}] has no entry for the actual token {tok}")
        logprobs[i] = float(row[str(int(tok))]["logprob"])
        cands = []
        for key, entry in row.items():
            rank = entry.get("rank")
            if int(key) == int(tok) and (rank is None or rank > k):
                continue  # the actual token outside the top k
            cands.append((rank if rank is not None else math.inf, -float(entry["logprob"]), int(key)))
        for j, (_, neg_lp, tid) in enumerate(sorted(cands)[:k]):
            top_ids[i, j], top_lp[i, j] = tid, -neg_lp
    return TokenScores(np.asarray(continuation_ids, np.int64), logprobs, top_ids, top_lp)


def usage_facts(body: dict[str, Any]) -> dict[str, Any]:
    """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` (the latter only from a
    server started with ``--enable-prompt-tokens-details``; None otherwise): what proves a prefix-cache
    hit and a prompt's length."""
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}


def request_spec_stats(body: dict[str, Any]) -> SpecStats | None:
    """``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics``) → per-request totals."""
    sd = (body.get("metrics") or {}).get("speculative_decoding") if isinstance(body.get("metrics"), dict) else None
    if not isinstance(sd, dict):
        return None
    proposed, accepted = int(sd["num_draft_tokens"]), int(sd["num_accepted_draft_tokens"])
    steps = int(sd["num_spec_steps"])
    if accepted > proposed:
        raise ServerError(f"metrics.speculative_decoding: num_accepted_draft_tokens {accepted} > num_draft_tokens "
                          f"{proposed}")
    return SpecStats(True, proposed=proposed, accepted=accepted, verify_steps=steps,
                     source="vLLM response metrics.speculative_decoding (--per-request-spec-decode-metrics): "
                            "num_draft_tokens / num_accepted_draft_tokens / num_spec_steps")


def parse_metrics(text: str) -> dict[str, Any]:
    """A ``/metrics`` exposition → ``{"proposed", "accepted", "verify_steps"}`` summed over labels,
    ``{"finished", "generated"}`` (:data:`TRAFFIC_COUNTERS`; None when the exposition has no such
    sample), and ``"spec_families"``: whether any ``vllm:spec_decode_*`` family exists (only with a
    speculative config)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {key: 0 for key in SPEC_COUNTERS}
    out.update({key: None for key in TRAFFIC_COUNTERS})
    wanted = {sample: key for key, sample in {**SPEC_COUNTERS, **TRAFFIC_COUNTERS}.items()}
    families = False
    for family in text_string_to_metric_families(text):
        if family.name.startswith(SPEC_FAMILY_PREFIX):
            families = True
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] = (out[key] or 0) + int(round(sample.value))
    out["spec_families"] = families
    return out


def answer_tokens(answer: Any) -> int:
    """The tokens an answer carries (``choices[0].token_ids``), for a tally when ``usage`` is missing."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    ids = first.get("token_ids")
    return len(ids) if isinstance(ids, list) else 0


def reported_max_num_seqs(info: dict[str, Any] | None) -> int | None:
    """``vllm_config.scheduler_config.max_num_seqs`` of a dev-mode ``/server_info?config_format=json``
    answer (vLLM's ``SchedulerConfig``: the sequences one scheduler step may hold), None when absent."""
    config = (info or {}).get("vllm_config")
    scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
    n = scheduler.get("max_num_seqs") if isinstance(scheduler, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
