"""Engines' offline outputs, as their own test suites hold them, turned into :class:`GenerationResult`.

A team that calls :func:`specparity.api.check_lossless` from its own tests has whatever its engine's
offline API returned, not the gate's types. The shapes read here:

* vLLM's test runner (``tests/conftest.py``, ``VllmRunner``): ``generate_greedy`` gives
  ``(token_ids, text)`` per prompt, with the *prompt's* ids and text in front of the output's;
  ``generate_greedy_logprobs`` gives ``(token_ids, text, logprobs)`` of the output alone, where
  ``logprobs[i]`` maps token id -> ``Logprob`` (an object with ``.logprob``) or a float, and holds
  the chosen token beside the top-k. A position may be ``None`` (not reported) or a bare float
  (the chosen token's logprob).
* vLLM's ``LLM.generate``: a ``RequestOutput`` (its ``outputs[0]``) or a ``CompletionOutput``
  (``token_ids``, ``text``, ``logprobs``, ``finish_reason``), read by attribute.
* SGLang's offline ``Engine.generate``: ``{"text", "output_ids", "meta_info": {"finish_reason":
  {"type": ...}, "output_token_logprobs": [[logprob, id, text], ...], "output_top_logprobs": ...}}``,
  the same ``meta_info`` as its HTTP ``/generate`` (:mod:`specparity.engines.server.sglang` reads it).
* A plain list of token ids.

Rows an output does not carry are *not reported* (NaN, top id -1), never a probability. A finish
reason an output does not state is ``stop`` when the last token is a stop token, else ``length``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specparity.engines.server.http import ServerError
from specparity.engines.server.sglang_wire import UNKNOWN, parse_finish, parse_logprobs, spec_stats
from specparity.model.types import GenerationResult, SpecStats, TokenScores


@dataclass(frozen=True)
class OutputContext:
    """What converting one output needs besides the output: how to name it in an error, the id to
    give it, the stop set and limit, (for outputs that start with their prompt) the prompt's ids, and
    whether it is the baseline (a baseline pair longer than the limit is taken for one that holds its
    prompt, and said so; a speculative one is judged as it is)."""

    label: str
    request_id: str
    stop_ids: tuple[int, ...]
    max_new_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    is_baseline: bool = False


def to_result(out: Any, ctx: OutputContext) -> GenerationResult:
    """One engine output (any shape in the module docstring) -> a :class:`GenerationResult`."""
    if isinstance(out, GenerationResult):
        return out
    if isinstance(out, Mapping):
        return _sglang(out, ctx)
    if hasattr(out, "outputs") and not isinstance(out, (str, bytes)):  # vLLM RequestOutput
        completions = list(out.outputs)
        if not completions:
            raise ValueError(f"check_lossless: {ctx.label} is a RequestOutput with no outputs")
        return to_result(completions[0], ctx)
    if hasattr(out, "token_ids") and hasattr(out, "text"):  # vLLM CompletionOutput
        return _vllm(list(out.token_ids), out.text or "", getattr(out, "logprobs", None), ctx,
                     getattr(out, "finish_reason", None), holds_prompt=False)
    if isinstance(out, tuple) and len(out) in (2, 3) and not _is_int(out[0]):
        ids, text = out[0], out[1]
        logprobs = out[2] if len(out) == 3 else None
        # generate_greedy's pairs hold the prompt; generate_greedy_logprobs' triples the output alone
        return _vllm(list(ids), text if isinstance(text, str) else "", logprobs, ctx, None,
                     holds_prompt=True if len(out) == 2 else None)
    if isinstance(out, (Sequence, np.ndarray)) and not isinstance(out, (str, bytes)):
        return _vllm(list(out), "", None, ctx, None, holds_prompt=None)
    raise TypeError(f"check_lossless: {ctx.label} is a {type(out).__name__}: expected a GenerationResult, a list of "
                    "token ids, a (token_ids, text[, logprobs]) tuple, a vLLM RequestOutput/CompletionOutput or an "
                    "SGLang output dict")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _ids(values: Sequence[Any], label: str) -> list[int]:
    if not all(_is_int(v) for v in values):
        raise TypeError(f"check_lossless: {label}: token ids must be integers")
    return [int(v) for v in values]


def _vllm(raw_ids: Sequence[Any], text: str, logprobs: Any, ctx: OutputContext, finish: str | None,
          holds_prompt: bool | None) -> GenerationResult:
    """``holds_prompt``: False for an output that never holds its prompt (a CompletionOutput), True
    for a vLLM runner tuple (``generate_greedy``'s do), None for a plain id list (the caller's own)."""
    ids = _ids(raw_ids, ctx.label)
    if holds_prompt is not False and ctx.prompt_ids is not None:
        n = len(ctx.prompt_ids)
        if tuple(ids[:n]) != ctx.prompt_ids:
            raise ValueError(f"check_lossless: {ctx.label} does not start with its prompt's {n} token ids "
                             "(prompt_token_ids): pass prompt_token_ids only for outputs that hold the prompt")
        ids = ids[n:]
    elif holds_prompt and ctx.is_baseline and len(ids) > ctx.max_new_tokens:
        raise ValueError(f"check_lossless: {ctx.label} has {len(ids)} token ids, more than max_new_tokens="
                         f"{ctx.max_new_tokens}: vLLM's runner.generate_greedy returns the prompt's ids in front of "
                         "the output's; pass prompt_token_ids=[each prompt's ids] to drop them")
    scores = unreported(ids) if logprobs is None else _vllm_scores(ids, logprobs, ctx.label)
    if finish not in ("stop", "length"):
        if finish not in (None, "abort"):
            raise ValueError(f"check_lossless: {ctx.label} finish_reason {finish!r}: expected 'stop' or 'length'")
        error = "the engine aborted the request" if finish == "abort" else None
        finish = "stop" if ids and ids[-1] in ctx.stop_ids else "length"
        if error:
            return GenerationResult(ctx.request_id, ids, text, "error", scores, _no_counters(), error=error)
    return GenerationResult(ctx.request_id, ids, text, finish, scores, _no_counters())


def _no_counters() -> SpecStats:
    return SpecStats.unavailable("offline output: no speculation counters")


def _logprob(value: Any) -> float:
    """A ``Logprob``-like object's ``.logprob``, or a number."""
    value = getattr(value, "logprob", value)
    return math.nan if value is None else float(value)


def _vllm_scores(ids: list[int], logprobs: Sequence[Any], label: str) -> TokenScores:
    rows = list(logprobs)
    if len(rows) != len(ids):
        raise ValueError(f"check_lossless: {label} has {len(rows)} logprob positions for {len(ids)} output tokens")
    k = max((len(r) for r in rows if isinstance(r, Mapping)), default=1)
    chosen = np.full(len(ids), np.nan, np.float32)
    top_ids = np.full((len(ids), k), -1, np.int64)
    top_lp = np.full((len(ids), k), np.nan, np.float32)
    for i, (tok, row) in enumerate(zip(ids, rows)):
        if row is None:
            continue
        if not isinstance(row, Mapping):  # the chosen token's logprob alone
            chosen[i] = top_lp[i, 0] = _logprob(row)
            top_ids[i, 0] = tok
            continue
        ranked = sorted(((int(t), _logprob(v)) for t, v in row.items()), key=lambda kv: -kv[1])
        chosen[i] = dict(ranked).get(tok, math.nan)
        for j, (t, lp) in enumerate(ranked[:k]):
            top_ids[i, j], top_lp[i, j] = t, lp
    return TokenScores(np.asarray(ids, np.int64), chosen, top_ids, top_lp)


def _sglang(out: Mapping[str, Any], ctx: OutputContext) -> GenerationResult:
    meta = out.get("meta_info")
    if not isinstance(meta, Mapping):
        raise ValueError(f"check_lossless: {ctx.label} is a dict without meta_info: expected SGLang's output "
                         "{'text', 'output_ids', 'meta_info'}")
    meta = dict(meta)
    token_rows = meta.get("output_token_logprobs")
    if out.get("output_ids") is not None:
        ids = _ids(out["output_ids"], ctx.label)
    elif token_rows is not None:
        ids = [int(entry[1]) for entry in token_rows]
    else:
        raise ValueError(f"check_lossless: {ctx.label} has neither output_ids nor meta_info.output_token_logprobs")
    text = out.get("text") or ""
    if token_rows is None:
        scores = unreported(ids)
    else:
        tops = meta.get("output_top_logprobs")
        k = max((len(r) for r in tops or [] if r), default=1)
        try:
            scores = parse_logprobs(token_rows, tops, ids, k)
        except ValueError as exc:
            raise ValueError(f"check_lossless: {ctx.label}: {exc}") from None
    try:
        finish = parse_finish(meta)
    except ServerError as exc:
        return GenerationResult(ctx.request_id, ids, text, "error", scores, _no_counters(), error=str(exc))
    try:
        spec = spec_stats(meta, len(ids), UNKNOWN)
    except ServerError:
        spec = _no_counters()
    return GenerationResult(ctx.request_id, ids, text, finish, scores, spec)


def unreported(ids: Sequence[int]) -> TokenScores:
    """Rows for tokens whose logprobs the output did not carry: NaN, top id -1."""
    n = len(ids)
    return TokenScores(np.asarray(ids, np.int64), np.full(n, np.nan, np.float32), np.full((n, 1), -1, np.int64),
                       np.full((n, 1), np.nan, np.float32))
