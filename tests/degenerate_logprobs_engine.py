"""A plugin engine whose logprob channel is degenerate on purpose: the real ``hf`` engine, except that
one side's rows are replaced (``--engine-opt side=``):

* ``spec-zero``: every logprob of the speculative run's rows is 0.0, top-k ids kept — what llama.cpp
  once reported under speculation (ggml-org/llama.cpp#27972);
* ``baseline-constant``: every baseline decode row is the same fixed, normalised row (ids kept), as an
  engine that returns a placeholder instead of the model's numbers;
* ``scorer-logits``: the teacher-forced scores are raw logit-like numbers (the true logprobs + 12), not
  log-probabilities.

The tokens are the model's own in every case: only the numbers the gate judges with are wrong.
"""

from __future__ import annotations

import numpy as np

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS, SPEC_MODES, HFEngine
from specparity.model.types import TokenScores

SIDES = ("spec-zero", "baseline-constant", "scorer-logits")


def zeroed(s: TokenScores) -> TokenScores:
    return TokenScores(s.token_ids, np.zeros_like(s.logprobs), s.top_ids, np.zeros_like(s.top_logprobs))


def constant(s: TokenScores) -> TokenScores:
    row = np.full(s.k, -np.log(s.k) - 0.01, np.float32)  # normalised: k alternatives at just under 1/k each
    top = np.tile(row, (len(s), 1))
    return TokenScores(s.token_ids, np.full(len(s), row[0], np.float32), s.top_ids, top)


def shifted(s: TokenScores) -> TokenScores:
    return TokenScores(s.token_ids, s.logprobs + 12.0, s.top_ids, s.top_logprobs + 12.0)


class DegenerateEngine(HFEngine):
    name = "hf-degenerate"

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.side = options.extra["side"]

    def generate(self, requests, *, speculative):
        results = super().generate(requests, speculative=speculative)
        spoil = {("spec-zero", True): zeroed, ("baseline-constant", False): constant}.get((self.side, speculative))
        if spoil is not None:
            for res in results:
                if not res.error:
                    res.scores = spoil(res.scores)
        return results

    def score(self, prompt_ids, continuation_ids, top_k):
        scores = super().score(prompt_ids, continuation_ids, top_k)
        return shifted(scores) if self.side == "scorer-logits" else scores


@engine_factory(EngineInfo("hf-degenerate", spec_modes=SPEC_MODES, options={
    **HF_OPTIONS,
    "side": OptionSpec("which side's logprob channel is degenerate", choices=SIDES),
}))
def create(options: EngineOptions) -> DegenerateEngine:
    return DegenerateEngine(options)
