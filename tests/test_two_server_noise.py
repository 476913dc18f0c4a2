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
from pathlib import Path

import numpy as np
import pytest

from fakes import SGLangServer
from fakes.backend import TARGET, shared_backend
from fakes.gate import run_lossless
from specparity.gate.decision import decide
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
    return run_lossless("sglang", base.url, spec.url, report, "--target", str(TARGET), "--calibration", "selected",
                        in_process=True)


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
