"""A plugin engine whose numbers go non-finite on purpose: the real ``hf`` engine, except that one
prompt's rows carry a NaN or an infinite logprob while their ``top_ids`` stay real — on the side
``--engine-opt side=`` names (``baseline``: its decode rows; ``spec``: the speculative run's rows;
``scorer``: the teacher-forced scores of that prompt's baseline). Such a row is a numeric failure
of the engine, not the protocol's unreported row (``top_ids`` −1), and must fail the gate.

``--engine tests/nonfinite_engine.py:create --engine-opt side=spec --engine-opt prompt=math-en-001``
"""

from __future__ import annotations

import numpy as np

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS, SPEC_MODES, HFEngine
from specparity.model.types import TokenScores

SIDES = ("baseline", "spec", "scorer")
#: ``side=unreported``: the speculative run leaves the row at NAN_AT out by the protocol instead (allowed).
UNREPORTED = "unreported"
#: The positions whose rows are spoiled: a NaN for the row's own token, +inf for an alternative.
NAN_AT, INF_AT = 1, 3


def left_out(scores: TokenScores) -> TokenScores:
    logprobs, top_ids, top_lp = scores.logprobs.copy(), scores.top_ids.copy(), scores.top_logprobs.copy()
    if len(scores) > NAN_AT:
        logprobs[NAN_AT], top_ids[NAN_AT], top_lp[NAN_AT] = np.nan, -1, np.nan
    return TokenScores(scores.token_ids, logprobs, top_ids, top_lp)


def spoiled(scores: TokenScores) -> TokenScores:
    logprobs, top_lp = scores.logprobs.copy(), scores.top_logprobs.copy()
    if len(scores) > NAN_AT:
        logprobs[NAN_AT] = np.nan
    if len(scores) > INF_AT:
        top_lp[INF_AT, 1] = np.inf
    return TokenScores(scores.token_ids, logprobs, scores.top_ids, top_lp)


class NonFiniteEngine(HFEngine):
    name = "hf-nonfinite"

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.side = options.extra["side"]
        self.prompt = options.extra["prompt"]
        self._prompt_ids: list[int] | None = None

    def generate(self, requests, *, speculative):
        results = super().generate(requests, speculative=speculative)
        if self.side in (("spec", UNREPORTED) if speculative else ("baseline",)):
            for req, res in zip(requests, results):
                if req.request_id == self.prompt and not res.error:
                    res.scores = left_out(res.scores) if self.side == UNREPORTED else spoiled(res.scores)
        if self.side == "scorer" and not speculative:
            for req in requests:
                if req.request_id == self.prompt:
                    self._prompt_ids = list(req.prompt_ids)
        return results

    def score(self, prompt_ids, continuation_ids, top_k):
        scores = super().score(prompt_ids, continuation_ids, top_k)
        return spoiled(scores) if self.side == "scorer" and list(prompt_ids) == self._prompt_ids else scores


@engine_factory(EngineInfo("hf-nonfinite", spec_modes=SPEC_MODES, options={
    **HF_OPTIONS,
    "side": OptionSpec("which rows go non-finite", choices=SIDES + (UNREPORTED,)),
    "prompt": OptionSpec("the prompt id whose rows go non-finite"),
}))
def create(options: EngineOptions) -> NonFiniteEngine:
    return NonFiniteEngine(options)
