"""A real llama.cpp engine whose speculative side loses its grammar state, for the structured gate.

``lost_grammar_llamacpp`` (``--engine tests/structured_engines.py:lost_grammar_llamacpp``) is the
real ``llamacpp`` engine, launching both servers itself, except that a constrained speculative
request keeps its constraint for the first ``keep`` tokens only (``--engine-opt keep=N``, default
8: the first verify steps at the fixture's draft width 4) and then continues from those tokens
without it — what a speculative loop does whose grammar state is not rolled back with a rejected
draft and is dropped. Unconstrained requests and the baseline are untouched, so only a constrained
prompt can show the bug.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, parse_positive_int
from specparity.engines.server.llamacpp import INFO, OPTIONS, LlamaCppEngine, create
from specparity.model.types import GenerationRequest, GenerationResult, SpecStats, TokenScores


def _check(options: EngineOptions) -> None:
    INFO.check(dataclasses.replace(options, extra={k: v for k, v in options.extra.items() if k != "keep"}))


def lose_grammar(engine: LlamaCppEngine, keep: int) -> LlamaCppEngine:
    """Make ``engine``'s constrained speculative requests drop their constraint after ``keep`` tokens."""
    complete = engine.complete

    def losing_complete(endpoint: Any, req: GenerationRequest, speculative: bool) -> GenerationResult:
        if not speculative or req.constraint is None or req.max_new_tokens <= keep:
            return complete(endpoint, req, speculative)
        head = complete(endpoint, dataclasses.replace(req, max_new_tokens=keep), True)
        if head.finish_reason == "stop":
            return head
        tail = complete(endpoint, dataclasses.replace(req, prompt_ids=list(req.prompt_ids) + head.output_ids,
                                                      max_new_tokens=req.max_new_tokens - keep, constraint=None), True)
        ids = head.output_ids + tail.output_ids
        scores = TokenScores(*(np.concatenate([getattr(head.scores, f), getattr(tail.scores, f)])
                               for f in ("token_ids", "logprobs", "top_ids", "top_logprobs")))
        spec = SpecStats(True, head.spec.proposed + tail.spec.proposed, head.spec.accepted + tail.spec.accepted,
                         head.spec.verify_steps + tail.spec.verify_steps + 1, source=head.spec.source)
        return GenerationResult(req.request_id, ids, engine.decode(ids), tail.finish_reason, scores, spec,
                                wall_s=head.wall_s + tail.wall_s)

    engine.complete = losing_complete  # type: ignore[method-assign]
    return engine


@engine_factory(EngineInfo(
    "llamacpp-lost-grammar",
    spec_modes=INFO.spec_modes,
    options={**OPTIONS, "keep": OptionSpec("tokens decoded under the constraint before the speculative side drops it",
                                           parse=parse_positive_int)},
    dtypes=(),
    local_models=False,
    check=_check,
    server=True,
    counters=INFO.counters,
    constraints=INFO.constraints,
))
def lost_grammar_llamacpp(options: EngineOptions) -> LlamaCppEngine:
    keep = int(options.extra.get("keep", 8))
    return lose_grammar(create(dataclasses.replace(options, extra={k: v for k, v in options.extra.items()
                                                                   if k != "keep"})), keep)
