"""bf16: real near-tie flips from batched verification are classified near_tie, real bugs in the
same dtype still diverge, and fp32 is bit-exact on the same prompts.

prompts/near_tie.jsonl (tools/find_near_ties.py) holds out-of-distribution prompts on which the
fixture target reaches exact ties or one-bf16-step margins.
"""

from __future__ import annotations

import pytest

from broken_loops import LoopEngine
from specparity.engines.base import EngineOptions
from specparity.engines.hf import HFEngine
from specparity.fixtures import REPO_ROOT
from specparity.gate import GateConfig, decide
from specparity.prompts import load_prompts
from specparity.runner import run_gate

BF16_STEP = 0.0625  # one bf16 step of logits in [8, 16)


@pytest.fixture(scope="module")
def near_tie_prompts():
    return load_prompts(REPO_ROOT / "prompts" / "near_tie.jsonl").prompts


def _gate(engine, prompts, **cfg):
    config = GateConfig(max_near_tie=1.0, **cfg)
    try:
        run = run_gate(engine, prompts, config)
    finally:
        engine.close()
    return run, decide(run, config)


@pytest.mark.parametrize("mode", ["draft", "prompt_lookup"])
def test_bf16_flips_are_near_ties_and_fp32_is_exact(hf_options, near_tie_prompts, mode):
    opts = {**vars(hf_options), "spec_mode": mode}
    run, decision = _gate(HFEngine(EngineOptions(**{**opts, "dtype": "bfloat16"})), near_tie_prompts)
    assert decision.passed, decision.failures
    ties = [r.verdict for r in run.records if r.verdict.klass == "near_tie"]
    assert len(ties) >= 3, decision.counts
    assert decision.counts["diverged"] == 0
    for v in ties:
        assert v.divergence.baseline_margin <= BF16_STEP + 1e-6, v.reason  # exact tie or one bf16 step
        assert not [t for t in v.tf_violations if t.margin is None or t.margin > v.threshold]
    assert run.threshold.source == "measured" and run.threshold.nats < 1.0
    assert all(r.prompt.category == "bf16_flip" for r in run.records if r.verdict.klass == "near_tie")
    flips = [p for p in near_tie_prompts if p.category == "bf16_flip"]
    run32, d32 = _gate(HFEngine(EngineOptions(**opts)), flips)
    assert d32.counts["exact"] == len(flips), d32.counts
    assert run32.threshold.nats < 1e-3


def test_bf16_real_bug_still_diverges(hf_options, near_tie_prompts, default_prompts):
    """The bf16 threshold (~0.3–0.5 nats) must not excuse a loop that accepts an unverified token."""
    prompts = [p for p in near_tie_prompts if p.category == "bf16_flip"] + [
        p for p in default_prompts if p.id in ("logic-en-003", "repeat-en-003")
    ]
    engine = LoopEngine(EngineOptions(**{**vars(hf_options), "dtype": "bfloat16"}), "accept_unverified")
    run, decision = _gate(engine, prompts)
    assert not decision.passed
    assert decision.counts["diverged"] >= 2, decision.counts
