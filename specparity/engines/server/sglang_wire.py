"""SGLang's wire format: the native ``/generate`` bodies the adapter sends (and a reproducer sends again), the
parsers of its answers (output and input logprobs, finish reasons, ``meta_info``'s speculation counters and
the facts the arms read) and of ``/server_info``. Pure functions over JSON; what each field means, and the
SGLang versions it was read in, is in :mod:`specparity.engines.server.sglang`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from specparity.engines.server.http import ServerError
from specparity.engines.server.wire import WireFormat
from specparity.model.constraints import Constraint
from specparity.model.types import GenerationRequest, SpecStats, TokenScores


#: ``sampling_params`` keys 0.5.23 accepts (the contract allow-list, ``sglang/api/v1/api_types.py:1256``).
SAMPLING_KEYS_0_5_23 = frozenset((
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
))


#: ``SamplingParams`` struct fields of 0.5.19 that a client may set (``sglang/srt/sampling/sampling_params.py:57-88``).
SAMPLING_KEYS_0_5_19 = frozenset((
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params",
))


#: What this adapter sends: greedy, every other knob neutral and explicit.
GREEDY_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 0.0, "frequency_penalty": 0.0,
                   "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "ignore_eos": False}


SENT_SAMPLING_KEYS = frozenset(GREEDY_SAMPLING) | {"max_new_tokens", "stop_token_ids"}


#: ``sampling_params`` key of each prompt constraint (both 0.5.19 and 0.5.23 declare them, as strings:
#: ``json_schema`` is the schema serialised as JSON; ``ebnf`` takes the GBNF dialect xgrammar reads).
CONSTRAINT_KEYS = {"json_schema": "json_schema", "grammar": "ebnf"}


#: ``--preferred-sampling-params`` keys that would change the tokens of a request that does not send
#: them (the server merges its preferred params under every ``/generate``'s own,
#: ``tokenizer_manager.py:1549-1552`` in 0.5.23).
UNSENT_HARMFUL_KEYS = ("stop", "stop_regex", "regex", "json_schema", "ebnf", "structural_tag", "logit_bias",
                       "custom_params", "n", "beam_width", "watermark", "choice")


#: Keys of ``/server_info`` kept in the fingerprint.
SUMMARY_KEYS = ("version", "model_path", "dtype", "kv_cache_dtype", "context_length", "page_size", "tp_size",
                "dp_size", "pp_size",
                "max_running_requests", "mem_fraction_static", "attention_backend", "sampling_backend",
                "enable_deterministic_inference", "disable_radix_cache", "random_seed", "launch_command")


#: The ``/server_info`` fields (recorded in ``tests/data/sglang/server_info_*.json``) that decide how the
#: target computes: every server of both sides must report the same (:meth:`ServerEngine.check_same_target`).
NUMERICS_KEYS = ("dtype", "quantization", "kv_cache_dtype", "attention_backend", "prefill_attention_backend",
                 "decode_attention_backend", "tp_size", "pp_size")


def reported_numerics(info: dict[str, Any]) -> dict[str, Any]:
    """The :data:`NUMERICS_KEYS` a ``/server_info`` body reports; a null ``quantization`` is a report too
    ("none": the weights as stored), a null backend is not (chosen by the server, which says no more)."""
    out = {k: info[k] for k in NUMERICS_KEYS if info.get(k) is not None}
    if "quantization" in info and info["quantization"] is None:
        out["quantization"] = "none"
    return out


SPEC_SOURCE = ("sglang meta_info spec_verify_ct / spec_num_correct_drafts / spec_num_proposed_drafts (per-request "
               "totals; proposed = verify_ct x (speculative_num_draft_tokens - 1); accepted counted before the "
               "finish truncation)")


def generate_body(input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int], top_k: int, *,
                  logprob_start_len: int = -1, rid: str | None = None,
                  constraint: Constraint | None = None) -> dict[str, Any]:
    """The ``/generate`` body: one prompt, greedy, logprobs on, only keys 0.5.19 and 0.5.23 both know;
    a prompt's output constraint as its ``sampling_params`` key (:data:`CONSTRAINT_KEYS`)."""
    sampling: dict[str, Any] = {"max_new_tokens": int(max_new_tokens), **GREEDY_SAMPLING}
    if stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if constraint is not None:
        sampling[CONSTRAINT_KEYS[constraint.kind]] = constraint.text
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": int(logprob_start_len),
        "top_logprobs_num": int(top_k),
    }
    if rid:
        body["rid"] = rid
    return body


def request_body(req: GenerationRequest, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/generate`` body of one generation request; ``facts["rid"]``: its request id (each request
    gets a fresh one: SGLang refuses an id already in flight)."""
    return generate_body(req.prompt_ids, req.max_new_tokens, req.stop_token_ids, req.top_k, rid=facts.get("rid"),
                         constraint=req.constraint)


def score_body(prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int,
               facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/generate`` body that scores ``continuation_ids`` teacher-forced: prompt + continuation, one
    new token, logprobs from the last prompt position (:func:`parse_score` reads it); ``facts["rid"]`` as
    in :func:`request_body`."""
    return generate_body([*prompt_ids, *continuation_ids], 1, (), top_k, logprob_start_len=len(prompt_ids) - 1,
                         rid=facts.get("rid"))


WIRE = WireFormat("/generate", request_body, per_request=("rid",), score=score_body)


def _float_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def parse_logprobs(token_rows: Sequence[Any], top_rows: Sequence[Any] | None, token_ids: Sequence[int],
                   k: int, what: str = "output") -> TokenScores:
    """``*_token_logprobs`` / ``*_top_logprobs`` → :class:`TokenScores` (ValueError on a malformed list).

    ``token_rows[i] = [logprob|null, id, text|null]`` must name ``token_ids[i]``; a ``null`` logprob
    or a ``null`` top row is *not reported* (NaN, top id -1)."""
    n = len(token_ids)
    if len(token_rows) != n:
        raise ValueError(f"{what}_token_logprobs has {len(token_rows)} entries for {n} tokens")
    if top_rows is not None and len(top_rows) != n:
        raise ValueError(f"{what}_top_logprobs has {len(top_rows)} rows for {n} tokens")
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    for i, entry in enumerate(token_rows):
        if int(entry[1]) != int(token_ids[i]):
            raise ValueError(f"{what}_token_logprobs[{i}] names token {entry[1]}, the stream has {token_ids[i]}")
        logprobs[i] = _float_or_nan(entry[0])
        row = top_rows[i] if top_rows is not None else None
        for j, alt in enumerate((row or [])[:k]):
            top_ids[i, j] = int(alt[1])
            top_lp[i, j] = _float_or_nan(alt[0])
    return TokenScores(np.asarray(token_ids, np.int64), logprobs, top_ids, top_lp)


def parse_finish(meta: dict[str, Any]) -> str:
    """``meta_info.finish_reason`` → ``stop`` / ``length``; ServerError for an abort or an unfinished answer."""
    fr = meta.get("finish_reason")
    if fr is None:
        raise ServerError("meta_info.finish_reason is null: the answer is not a finished request")
    if not isinstance(fr, dict):
        raise ServerError(f"meta_info.finish_reason {fr!r}: expected an object with 'type'")
    kind = fr.get("type")
    if kind == "stop" and isinstance(fr.get("matched"), str):
        raise ServerError(f"the server stopped on the string/regex {fr['matched']!r}, and none was sent "
                          "(a --preferred-sampling-params stop?)")
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise ServerError(f"the server aborted the request: {fr.get('message')!r} (status_code "
                          f"{fr.get('status_code')}, err_type {fr.get('err_type')})")
    raise ServerError(f"meta_info.finish_reason type {kind!r}: expected 'stop', 'length' or 'abort'")


def _first(meta: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if meta.get(key) is not None:
            return meta[key]
    return None


#: ``declared`` value for a server whose ``/server_info`` could not be read.
UNKNOWN = "<unknown>"


#: How SGLang's /server_info spells "no speculative algorithm" (None, or the enum's name as a string).
NO_ALGORITHM = ("", "none", "null")


def declared_name(value: Any) -> str | None:
    """The declared ``speculative_algorithm``, None for every spelling of "none" (SGLang prints its
    ``SpeculativeAlgorithm.NONE`` enum as ``"NONE"``)."""
    if value is None or str(value).strip().lower() in NO_ALGORITHM:
        return None
    return str(value)


def spec_stats(meta: dict[str, Any], n_out: int, declared: str | None) -> SpecStats:
    """Per-request counters of a speculative answer. ``declared``: the server's ``speculative_algorithm``
    (None: it declares none; :data:`UNKNOWN`: ``/server_info`` unreadable)."""
    verify = meta.get("spec_verify_ct")
    accepted = _first(meta, "spec_num_correct_drafts", "spec_accepted_drafts")
    proposed = _first(meta, "spec_num_proposed_drafts", "spec_proposed_drafts")
    present = [k for k, v in (("spec_verify_ct", verify), ("spec_num_correct_drafts", accepted),
                              ("spec_num_proposed_drafts", proposed)) if v is not None]
    if present and len(present) < 3:
        missing = sorted({"spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts"} - set(present))
        raise ServerError(f"meta_info has {', '.join(present)} but not {', '.join(missing)}")
    if present:
        verify, accepted, proposed = int(verify), int(accepted), int(proposed)
        if accepted > proposed or verify < 0 or accepted < 0:
            raise ServerError(f"meta_info spec counters inconsistent: spec_num_correct_drafts {accepted}, "
                              f"spec_num_proposed_drafts {proposed}, spec_verify_ct {verify}")
        return SpecStats(True, proposed=proposed, accepted=accepted, verify_steps=verify, source=SPEC_SOURCE)
    histogram = _first(meta, "spec_correct_drafts_histogram", "spec_accept_histogram")
    if histogram is not None:
        # Verify forwards but no scalar keys: speculative_num_draft_tokens <= 1, nothing drafted.
        return SpecStats(True, proposed=0, accepted=0, verify_steps=int(sum(histogram)),
                         source="sglang meta_info spec_correct_drafts_histogram only (speculative_num_draft_tokens "
                                "<= 1: no draft tokens proposed)")
    if declared is None:  # a server launched without speculation: inactive, which fails, never "unknown"
        return SpecStats(True, proposed=0, accepted=0, verify_steps=0,
                         source="the speculative server declares no speculative_algorithm in /server_info: it does "
                                "not speculate")
    if n_out < 2:
        return SpecStats(True, source="sglang: finished after the prefill token, no verify step (no spec_* keys)")
    if declared == UNKNOWN:
        return SpecStats.unavailable("no spec_* keys in meta_info and /server_info unreadable")
    raise ServerError(f"the server declares speculative_algorithm={declared} but its {n_out}-token answer carries "
                      "no spec_* keys in meta_info: cannot tell whether speculation ran")


#: ``meta_info`` keys that say how the server served a request, and the name each is journalled under
#: (:attr:`~specparity.model.types.GenerationResult.facts`): the prompt's token count, the prompt tokens its
#: radix cache held, and ``num_retractions``, the times the scheduler retracted the request to free KV cache
#: (``Req.retraction_count``, answered by ``TokenizerManager`` in 0.5.17): SGLang's preemption.
ANSWER_FACTS = {"prompt_tokens": "prompt_tokens", "cached_tokens": "cached_tokens", "num_retractions": "preemptions"}


#: ``meta_info`` times (seconds since the epoch, the server's clock) a server with ``--enable-metrics`` answers:
#: when the request reached the server and when it finished (``APIServerReqTimeStats.convert_to_output_meta_info``,
#: 0.5.17). Requests alive at once beyond what the server runs waited for a slot.
ANSWER_TIMES = {"request_received_ts": "received_ts", "request_finished_ts": "finished_ts"}


def answer_facts(meta: dict[str, Any]) -> dict[str, int | float]:
    """The :data:`ANSWER_FACTS` and :data:`ANSWER_TIMES` an answer's ``meta_info`` carries (a key it lacks is
    left out)."""
    out: dict[str, int | float] = {name: int(meta[key]) for key, name in ANSWER_FACTS.items()
                                   if isinstance(meta.get(key), int) and not isinstance(meta.get(key), bool)}
    for key, name in ANSWER_TIMES.items():
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def parse_generate(body: Any, k: int) -> tuple[list[int], str, TokenScores, dict[str, Any]]:
    """A ``/generate`` answer for one prompt → (output ids, finish reason, scores, meta_info)."""
    if isinstance(body, list):
        raise ServerError(f"/generate answered a JSON array of {len(body)} items (a batch) for one prompt")
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ServerError("/generate answered without meta_info")
    meta = body["meta_info"]
    ids = [int(t) for t in body["output_ids"]]
    finish = parse_finish(meta)
    if "output_token_logprobs" not in meta:
        raise ServerError("meta_info has no output_token_logprobs: the server ignored return_logprob")
    scores = parse_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs"), ids, k)
    return ids, finish, scores, meta


def parse_score(body: Any, prompt_ids: Sequence[int], continuation_ids: Sequence[int], k: int) -> TokenScores:
    """A ``/generate`` answer with ``logprob_start_len = len(prompt) - 1`` → the continuation's rows."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ServerError("/generate (scoring) answered without meta_info")
    meta = body["meta_info"]
    rows = meta.get("input_token_logprobs")
    tops = meta.get("input_top_logprobs")
    n = len(continuation_ids)
    if not isinstance(rows, list) or len(rows) != n + 1:
        got = len(rows) if isinstance(rows, list) else rows
        raise ServerError(f"input_token_logprobs has {got} entries, expected {n + 1} (last prompt position + "
                          "continuation)")
    if rows[0][0] is not None or int(rows[0][1]) != int(prompt_ids[-1]):
        raise ServerError(f"input_token_logprobs[0] is {rows[0]!r}, expected [null, {prompt_ids[-1]}, ...]")
    if tops is not None and (len(tops) != n + 1 or tops[0] is not None):
        raise ServerError("input_top_logprobs does not start with null at the last prompt position")
    return parse_logprobs(rows[1:], tops[1:] if tops is not None else None, continuation_ids, k, what="input")
