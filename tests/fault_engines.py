"""Plugin engines that fail on purpose, for the tests that prove nothing fails silently.

``interrupting``: the real ``hf`` engine, except that the N-th speculative call sends SIGINT to
its own process — a real Ctrl-C in the middle of the speculative phase, as an operator would.
"""

from __future__ import annotations

import os
import signal

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, parse_positive_int
from specparity.engines.hf import HF_OPTIONS, SPEC_MODES, HFEngine


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
