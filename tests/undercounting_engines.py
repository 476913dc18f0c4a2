"""Plugin engines whose counters say less than they declare, for the rules that need them.

``totals_only``: the real ``hf`` engine, declaring per-verify-step counters like ``hf`` does, whose
speculative answers carry per-request totals only (their step records dropped): a rule that needs
the steps cannot be checked on them, and must say so rather than pass.
"""

from __future__ import annotations

from specparity.engines.base import EngineInfo, EngineOptions, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS, SPEC_MODES, HFEngine
from specparity.model.types import SpecStats

#: What the engine says its totals come from (a test finds it in the refusal).
SOURCE = "totals of the assisted generation, step records dropped"


class TotalsOnly(HFEngine):
    name = "hf-totals-only"

    def generate(self, requests, *, speculative):
        out = super().generate(requests, speculative=speculative)
        for result in out:
            s = result.spec
            if s.available and s.steps is not None:
                result.spec = SpecStats(True, s.proposed, s.accepted, s.verify_steps, source=SOURCE)
        return out


@engine_factory(EngineInfo("hf-totals-only", spec_modes=SPEC_MODES, options=HF_OPTIONS, counters="steps"))
def totals_only(options: EngineOptions) -> TotalsOnly:
    return TotalsOnly(options)
