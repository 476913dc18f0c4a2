"""Noise between two server instances: the gate measures it and does not call it drift.

Two server instances of one model differ by a few bf16 logit steps (graph capture, batch shapes:
measured between two non-speculative vLLM servers with CUDA graphs, 0.03–0.156 nats), while each one's
decode rows and its own teacher-forced rows agree. Measured inside the baseline server alone the noise
is ~0, the drift bound falls to its floor and those prompts were called drifted. The gate now scores
the baseline's tokens teacher-forced on the speculative server too and adds that difference to the
noise, as a figure of its own. These tests run the gate end to end over two SGLang protocol emulators
backed by the fixture models; the speculative one's logits are moved by ``instance_noise_nats``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest

from fakes import SGLangServer
from fakes.backend import TARGET, shared_backend
from fakes.gate import run_lossless
from specparity.gate.decision import decide
from specparity.model.cross_instance import CROSS_INSTANCE_NATS, cross_instance_cap
from specparity.model.gate_run import GatePolicy
from specparity.run.journal import load_run
from specparity.model.threshold import NoiseStats
from specparity.report.render import render_summary_md
from specparity.model.types import TokenScores

#: One bf16 logit step for logits between 8 and 16: two instances differ by up to two of them per margin.
STEP = 0.0625


def _threshold(records: list[dict]) -> dict:
    return next(r for r in records if r["kind"] == "threshold")


def _prompts(records: list[dict]) -> list[dict]:
    return [r for r in records if r["kind"] == "prompt"]


def _gate(base: SGLangServer, spec: SGLangServer, report: Path):
    return _gate_with(base, spec, report)


def _gate_with(base: SGLangServer, spec: SGLangServer, report: Path, *extra: str):
    return run_lossless("sglang", base.url, spec.url, report, "--target", str(TARGET), "--calibration", "selected",
                        *extra, in_process=True)


def test_two_instances_a_few_bf16_steps_apart_are_not_drift(tmp_path):
    with SGLangServer() as base, SGLangServer(speculative=True, instance_noise_nats=STEP) as spec:
        proc, records = _gate(base, spec, tmp_path / "report")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    prompts = _prompts(records)
    assert prompts and all(r["verdict"]["class"] == "exact" for r in prompts), [r["verdict"] for r in prompts]
    th = _threshold(records)
    within, cross = th["noise"], th["cross_instance"]
    # the baseline server agrees with itself (fp32 on a CPU); the two servers differ by the steps put in
    assert within["max_abs_delta"] < STEP / 100
    assert cross is not None and STEP <= cross["max_abs_delta"] <= 2 * STEP + 1e-4
    assert cross["positions"] > 0 and cross["pairs"] > 0
    # the drift bound covers every pair; the threshold the pairs that can flip (noise.NoiseStats.flip_noise)
    assert th["drift_nats"] == pytest.approx(4 * cross["max_abs_delta"], rel=1e-6)
    flip = max(NoiseStats(**within).flip_noise, NoiseStats(**cross).flip_noise)
    assert th["nats"] == pytest.approx(1.5 * flip, rel=1e-6) and flip >= STEP
    # the speculative rows do move by the instance difference: measured within the baseline server
    # alone (the bound before), the same rows would have been called drifted
    worst = max(r["verdict"]["drift"]["max_nats"] for r in prompts if r["verdict"]["drift"]["max_nats"] is not None)
    assert worst > 4 * within["max_abs_delta"] and worst >= STEP
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "- Cross-instance noise: max |Δmargin|" in summary
    assert "cross-instance noise: max |Δmargin|" in proc.stdout
    # `specparity report DIR` rebuilds the same figure from the journal
    rebuilt = load_run(tmp_path / "report")
    assert rebuilt.threshold.cross is not None and rebuilt.threshold.cross.to_json() == cross
    assert rebuilt.threshold.drift_nats == pytest.approx(th["drift_nats"])
    assert render_summary_md(rebuilt, decide(rebuilt)) == summary


def test_identical_instances_stay_exact_and_measure_zero(tmp_path):
    """Two instances that agree bit for bit (eager mode): the cross figure is measured and adds nothing
    (prefill against prefill, the speculative server's scoring rows equal the baseline server's), and
    the threshold stays the within-instance one."""
    with SGLangServer() as base, SGLangServer(speculative=True) as spec:
        proc, records = _gate(base, spec, tmp_path / "report")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert all(r["verdict"]["class"] == "exact" for r in _prompts(records))
    th = _threshold(records)
    cross = th["cross_instance"]
    assert cross["pairs"] > 0 and cross["max_abs_delta"] == 0.0 and cross["moved_pairs"] == 0
    assert th["noise"]["max_abs_delta"] > 0 and th["cross_instance_finding"] is None
    assert th["nats"] == pytest.approx(max(1e-5, 1.5 * NoiseStats(**th["noise"]).flip_noise), rel=1e-6)


class VerifyRowsOff:
    """The fixture backend, but the speculative decode's own rows (its verify pass) put every
    alternative ``nats`` lower than the target does: tokens unchanged, the scoring path untouched."""

    def __init__(self, nats: float):
        self._backend = shared_backend()
        self.nats = nats

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def generate(self, prompt_ids, max_new_tokens, stop_ids, k, speculative):
        result = self._backend.generate(prompt_ids, max_new_tokens, stop_ids, k, speculative)
        if not speculative:
            return result
        s = result.scores
        lowered = np.where(s.top_ids != s.token_ids[:, None], s.top_logprobs - self.nats, s.top_logprobs)
        result = copy.copy(result)
        result.scores = TokenScores(s.token_ids, s.logprobs, s.top_ids, lowered.astype(np.float32))
        return result


def test_verify_rows_beyond_the_cross_instance_noise_are_still_drift(tmp_path):
    """The same two instances, but the speculative server's verify rows move by 1 nat — 8 bf16 steps,
    beyond 4 × the cross-instance noise: drifted, and the gate fails."""
    with SGLangServer() as base, \
            SGLangServer(speculative=True, instance_noise_nats=STEP, backend=VerifyRowsOff(1.0)) as spec:
        proc, records = _gate(base, spec, tmp_path / "report")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    th = _threshold(records)
    assert th["cross_instance"]["max_abs_delta"] <= 2 * STEP + 1e-4
    prompts = _prompts(records)
    drifted = [r for r in prompts if r["verdict"]["class"] == "drifted"]
    assert drifted and len(drifted) == sum(r["verdict"]["drift"]["checked"] > 0 for r in prompts)
    assert records[-1]["kind"] == "verdict" and records[-1]["status"] == "FAIL"


#: A speculative server whose target computes differently: every logprob of its rows moved by −0.15,
#: 0 or +0.15 nats (up to 0.3 per margin), the greedy tokens unchanged; the baseline's own decode and
#: teacher-forced rows agree (float32 on a CPU). Before the cap it set its own threshold (0.45 nats)
#: and drift bound (1.2 nats) and passed exact with no word said.
MOVED = 0.15


def test_a_speculative_target_that_computes_differently_cannot_widen_its_allowance(tmp_path):
    with SGLangServer() as base, SGLangServer(speculative=True, instance_noise_nats=MOVED) as spec:
        proc, records = _gate(base, spec, tmp_path / "report")
        policy = tmp_path / "policy.toml"
        policy.write_text('[gate]\ncalibration_findings = "fail"\n')
        strict, strict_records = _gate_with(base, spec, tmp_path / "strict", "--policy", str(policy))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert all(r["verdict"]["class"] == "exact" for r in _prompts(records))
    th = _threshold(records)
    within, cross = NoiseStats(**th["noise"]), NoiseStats(**th["cross_instance"])
    # the figure is measured and reported in full ...
    assert 2 * MOVED - 1e-4 <= cross.max_abs_delta <= 2 * MOVED + 1e-4 and cross.moved_pairs > cross.pairs // 2
    assert within.max_abs_delta < MOVED / 100
    # located, so the difference can be reproduced: a prompt of this run and a position inside its output
    where = re.fullmatch(r"(\S+) position (\d+)", cross.largest_at or "")
    baselines = {r["prompt_id"]: r["baseline"] for r in records if r["kind"] == "baseline"}
    assert where and where[1] in baselines and int(where[2]) < len(baselines[where[1]]["output_ids"]), cross.largest_at
    assert f"the largest at {cross.largest_at}" in th["cross_instance_finding"]
    # ... but the allowance takes it only up to the cap, which the within-instance figure leaves at its floor
    cap = cross_instance_cap(within.max_abs_delta)
    assert cap == CROSS_INSTANCE_NATS < cross.flip_noise
    assert th["nats"] == pytest.approx(1.5 * cap, rel=1e-6) and th["drift_nats"] == pytest.approx(4 * cap, rel=1e-6)
    finding = ("finding: the speculative server's target computes differently: cross-instance "
               f"{cross.flip_noise:.3g} nats vs within-instance {within.flip_noise:.3g}")
    assert th["cross_instance_finding"] and f"finding: {th['cross_instance_finding']}".startswith(finding)
    verdict = records[-1]
    assert verdict["status"] == "PASS" and [w for w in verdict["warnings"] if w.startswith(finding)]
    assert f"warning: {finding}" in proc.stdout
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert finding in summary and "the allowance takes 0.25 of the near-tie figure" in summary
    # `specparity report DIR` decides the same; a bit-exact policy fails on the finding alone
    rebuilt = load_run(tmp_path / "report")
    assert decide(rebuilt).warnings == verdict["warnings"]
    failed = decide(rebuilt, GatePolicy(bit_exact=True))
    assert not failed.passed and [f for f in failed.failures if f.startswith(finding)]
    # the policy key fails the run itself
    assert strict.returncode == 1, (strict.stdout + strict.stderr)[-4000:]
    assert all(r["verdict"]["class"] == "exact" for r in _prompts(strict_records))
    assert [f for f in strict_records[-1]["failures"] if f.startswith(finding)]


def test_a_verify_pass_hiding_under_a_self_measured_allowance_drifts(tmp_path):
    """The speculative server's target computes differently (0.2 nats per logprob: up to 0.4 per margin)
    and its verify rows move by 1.1 nats more. Measured in full, the 0.4 set a drift bound of 1.6 nats
    that covered the verify rows (0.7–1.5 nats away) and the run passed exact; taken only up to the cap,
    the bound is 1 nat and the verify rows drift."""
    with SGLangServer() as base, \
            SGLangServer(speculative=True, instance_noise_nats=0.2, backend=VerifyRowsOff(1.1)) as spec:
        proc, records = _gate(base, spec, tmp_path / "report")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    th = _threshold(records)
    cross = th["cross_instance"]["max_abs_delta"]
    assert cross == pytest.approx(0.4, abs=1e-4) and 4 * cross > 1.5
    assert th["drift_nats"] == pytest.approx(4 * CROSS_INSTANCE_NATS, rel=1e-6)
    prompts = _prompts(records)
    drifted = [r for r in prompts if r["verdict"]["class"] == "drifted"]
    assert drifted and all(th["drift_nats"] < r["verdict"]["drift"]["max_nats"] < 4 * cross for r in drifted)
    assert records[-1]["status"] == "FAIL"
    assert [w for w in records[-1]["warnings"] if w.startswith("finding: the speculative server's target")]
