"""Plugin engines that end a gate run with a given exit code, for ``tests/test_exit_codes.py``.

``unloadable``: fails while it is built (no verdict: exit 3). ``no_baseline``: the real ``hf``
engine whose baselines all fail, so no noise can be measured (exit 3). ``request_totals``: the real
``hf`` engine that, once built, says it reports per-request totals only; it does not declare that
statically, so a rule that needs per-step records is refused after it loads, before any prompt (4).
"""

from __future__ import annotations

from dataclasses import replace

from specparity.engines.base import Capabilities, EngineInfo, EngineOptions, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS, SPEC_MODES, HFEngine
from specparity.model.types import GenerationResult


def unloadable(options: EngineOptions):
    raise RuntimeError("the accelerator is gone")


class NoBaselineEngine(HFEngine):
    name = "hf-no-baseline"

    def generate(self, requests, *, speculative):
        if not speculative:
            return [GenerationResult.failed(r.request_id, "the baseline server answered HTTP 500") for r in requests]
        return super().generate(requests, speculative=speculative)


@engine_factory(EngineInfo("hf-no-baseline", spec_modes=SPEC_MODES, options=HF_OPTIONS))
def no_baseline(options: EngineOptions) -> NoBaselineEngine:
    return NoBaselineEngine(options)


class RequestTotalsEngine(HFEngine):
    name = "hf-request-totals"

    def capabilities(self) -> Capabilities:
        return replace(super().capabilities(), counters="request")


@engine_factory(EngineInfo("hf-request-totals", spec_modes=SPEC_MODES, options=HF_OPTIONS))
def request_totals(options: EngineOptions) -> RequestTotalsEngine:
    return RequestTotalsEngine(options)
