"""Plugin engines that fail on purpose, for the tests that prove nothing fails silently.

``interrupting``: the real ``hf`` engine, except that the N-th speculative call sends SIGINT to
its own process — a real Ctrl-C in the middle of the speculative phase, as an operator would.
``dying``: the real ``hf`` engine that logs every decode to ``$SPECPARITY_TEST_CALL_LOG`` and
SIGKILLs its own process at the N-th speculative call when ``$SPECPARITY_TEST_DIE_AFTER`` is N — a
crash with no chance to write anything; the same engine (same fingerprint) without the variable
finishes the run (``--resume``).
:class:`RescoredEngine` wraps a real engine with a wrong teacher-forced scorer.
"""

from __future__ import annotations

import os
import signal

from specparity.engines.common import scores_from_logits
from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, parse_positive_int
from specparity.engines.inprocess.hf import HF_OPTIONS, SPEC_MODES, HFEngine


class InterruptingEngine(HFEngine):
    name = "hf-interrupting"

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.after = int(options.extra.get("interrupt_after", 2))
        self.spec_calls = 0

    def generate(self, requests, *, speculative):
        if speculative:
            self.spec_calls += 1
            if self.spec_calls == self.after:
                os.kill(os.getpid(), signal.SIGINT)
        return super().generate(requests, speculative=speculative)


@engine_factory(EngineInfo(
    "hf-interrupting",
    spec_modes=SPEC_MODES,
    options={**HF_OPTIONS, "interrupt_after": OptionSpec("speculative call that sends SIGINT", parse=parse_positive_int)},
))
def interrupting(options: EngineOptions) -> InterruptingEngine:
    return InterruptingEngine(options)


class DyingEngine(HFEngine):
    name = "hf-dying"

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.die_after = int(os.environ.get("SPECPARITY_TEST_DIE_AFTER", "0"))
        self.log = os.environ.get("SPECPARITY_TEST_CALL_LOG")
        self.spec_calls = 0

    def generate(self, requests, *, speculative):
        if self.log:
            with open(self.log, "a", encoding="utf-8") as fh:
                for r in requests:
                    fh.write(f"{'spec' if speculative else 'base'} {r.request_id}\n")
        if speculative:
            self.spec_calls += 1
            if self.spec_calls == self.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(requests, speculative=speculative)


@engine_factory(EngineInfo("hf-dying", spec_modes=SPEC_MODES, options=HF_OPTIONS))
def dying(options: EngineOptions) -> DyingEngine:
    return DyingEngine(options)


class RescoredEngine:
    """A real engine whose ``score()`` is replaced: ``shift`` reads the logits one position late
    (the prompt-logprobs off-by-one that is easy to write over HTTP); ``noise`` adds seeded noise
    of that scale to every logit (a scorer in another dtype or on other kernels)."""

    def __init__(self, inner, *, shift: int = 0, noise: float = 0.0):
        self.inner, self.shift, self.noise = inner, shift, noise
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score(self, prompt_ids, continuation_ids, top_k):
        target = self.inner.target
        torch = target.torch
        ids = torch.tensor([list(prompt_ids) + list(continuation_ids)])
        with torch.inference_mode():
            logits = target.model(input_ids=ids).logits[0]
        if self.noise:
            gen = torch.Generator().manual_seed(len(ids[0]))
            logits = logits + self.noise * torch.randn(logits.shape, generator=gen)
        n = len(prompt_ids) - 1 + self.shift
        if self.shift:  # the last row has no logits one position late: repeat the final one
            logits = torch.cat([logits, logits[-1:]])
        return scores_from_logits(logits[n : n + len(continuation_ids)], continuation_ids, top_k)
