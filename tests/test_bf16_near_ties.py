"""bf16: real near-tie flips from batched verification are classified near_tie, real bugs in the
same dtype still diverge, and fp32 is bit-exact on the same prompts.

prompts/near_tie.jsonl (tools/find_near_ties.py) holds out-of-distribution prompts on which the
fixture target reaches exact ties or one-bf16-step margins. *Which* of them flip, and how many,
depends on the kernels torch picks for the CPU (AVX-512 vs AVX2, oneDNN's ISA): measured 1 to 3
flips per mode on one machine by switching kernels alone (docs/notes/findings.md, F5b). So these tests
assert only what holds on every CPU — every flip that occurs is a near tie at an exact tie or one
bf16 step with no later violation, nothing diverges, fp32 is exact — and check that under the
other kernel sets this machine can emulate. The counts are measurements (``tools/bf16_flips.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from broken_loops import LoopEngine
from specparity.engines.base import EngineOptions
from specparity.engines.inprocess.hf import HFEngine
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.model.prompts import load_prompts
from specparity.model.gate_run import GateConfig, GatePolicy
from specparity.run.runner import run_gate

BF16_STEP = 0.0625  # one bf16 step of logits in [8, 16)


@pytest.fixture(scope="module")
def near_tie_prompts():
    return load_prompts(REPO_ROOT / "prompts" / "near_tie.jsonl").prompts


def _gate(engine, prompts, **cfg):
    config = GateConfig(policy=GatePolicy(max_near_tie=1.0), **cfg)
    try:
        run = run_gate(engine, prompts, config)
    finally:
        engine.close()
    return run, decide(run)


def assert_flips_are_benign(classes: dict[str, str], flips: list[dict], threshold: float) -> None:
    """What holds on every CPU: no prompt diverges or errors; every flip is at an exact tie or one
    bf16 step, under the measured threshold, with every later token the target's own choice."""
    assert set(classes.values()) <= {"exact", "near_tie"}, classes
    assert threshold < 1.0
    for f in flips:
        assert classes[f["prompt"]] == "near_tie", f
        assert f["margin"] is not None and f["margin"] <= BF16_STEP + 1e-6, f
        assert not f["late_violations"], f


@pytest.mark.parametrize("mode", ["draft", "prompt_lookup"])
def test_bf16_flips_are_near_ties_and_fp32_is_exact(hf_options, near_tie_prompts, mode, record_property):
    opts = {**vars(hf_options), "spec_mode": mode}
    run, decision = _gate(HFEngine(EngineOptions(**{**opts, "dtype": "bfloat16"})), near_tie_prompts)
    assert decision.passed, decision.failures
    flips = [
        {"prompt": r.prompt.id, "margin": r.verdict.divergence.baseline_margin,
         "late_violations": [t.position for t in r.verdict.tf_violations if t.margin is None or t.margin > r.verdict.threshold]}
        for r in run.records if r.verdict.divergence is not None
    ]
    assert_flips_are_benign({r.prompt.id: r.verdict.klass for r in run.records}, flips, run.threshold.nats)
    assert run.threshold.source == "measured"
    record_property("bf16_flips", len(flips))  # a measurement, not an assertion (it depends on the CPU)
    flip_prompts = [p for p in near_tie_prompts if p.category == "bf16_flip"]
    run32, d32 = _gate(HFEngine(EngineOptions(**opts)), flip_prompts)
    assert d32.counts["exact"] == len(flip_prompts), d32.counts
    assert run32.threshold.nats < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [
    {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    {"ATEN_CPU_CAPABILITY": "default"},
], ids=["avx2", "no-simd"])
def test_bf16_flips_stay_benign_under_other_cpu_kernels(kernels):
    """The same invariants with the kernels an AVX2-only or a plain CPU would use (emulated here by
    capping torch's and oneDNN's instruction sets), where different prompts flip."""
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "bf16_flips.py"), "--json", "--modes", "draft"],
        capture_output=True, text=True, timeout=600, env={**os.environ, **kernels}, cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    m = data["modes"]["draft"]
    assert_flips_are_benign(m["classes"], m["flips"], m["threshold"])


def test_bf16_real_bug_still_diverges(hf_options, near_tie_prompts, default_prompts):
    """The bf16 threshold (~0.3–0.5 nats) must not excuse a loop that accepts an unverified token."""
    prompts = [p for p in near_tie_prompts if p.category == "bf16_flip"] + [
        p for p in default_prompts if p.id in ("logic-en-003", "repeat-en-003")
    ]
    engine = LoopEngine(EngineOptions(**{**vars(hf_options), "dtype": "bfloat16"}), "accept_unverified")
    run, decision = _gate(engine, prompts)
    assert not decision.passed
    assert decision.counts["diverged"] >= 2, decision.counts
