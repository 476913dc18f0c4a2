"""The invariance checks can fail: a verify pass that disagrees with decode lowers self-draft
acceptance and is called a bug; a batch that changes what a prompt means is caught."""

from __future__ import annotations

import dataclasses

import pytest

from broken_loops import LoopEngine
from specparity.model.verdicts import Verdict
from specparity.engines.inprocess.hf import HFEngine
from specparity.judge.invariance import rejection_positions, self_draft_report
from specparity.run.invariance import InvarianceError, run_batching, run_self_draft, solo_runs
from specparity.model.gate_run import GateConfig
from specparity.model.types import GenerationResult, SpecStats, StepRecord, TokenScores

import numpy as np

PROMPTS = ("math-en-004", "logic-en-003", "code-en-003", "repeat-en-003", "paths-en-002", "commonsense-en-002")


@pytest.fixture(scope="module")
def prompts(default_prompts):
    return [p for p in default_prompts if p.id in PROMPTS]


#: Tokens per prompt for the self-draft runs: six verify steps or more of width 4 on each prompt.
SELF_DRAFT_TOKENS = 24


@pytest.fixture(scope="module")
def self_options(hf_options):
    return dataclasses.replace(hf_options, draft=hf_options.target)


def _result(ids, steps, margins=None):
    n = len(ids)
    margins = margins if margins is not None else [5.0] * n
    top = np.array([[t, t + 1] for t in ids])
    lp = np.array([[-0.1, -0.1 - m] for m in margins], np.float32)
    return GenerationResult("p", list(ids), "", "length", TokenScores(np.array(ids), lp[:, 0].copy(), top, lp),
                            SpecStats.from_steps(steps, "test"))


def test_rejection_positions_follow_the_counter_contract():
    # a plain prefill token, then: 4 proposed / 4 accepted (+bonus), 4 proposed / 1 accepted (+correction)
    r = _result(range(1, 9), [StepRecord(4, 4, 5), StepRecord(4, 1, 2)])
    assert rejection_positions(r) == [1 + 5 + 1]
    # a fused prefill (transformers): the first step starts at position 0
    r = _result(range(1, 8), [StepRecord(4, 2, 3), StepRecord(4, 3, 4)])
    assert rejection_positions(r) == [2, 6]
    # a step truncated by a stop token is not a rejection
    assert rejection_positions(_result(range(1, 4), [StepRecord(4, 2, 2, "stop")])) == []


def test_report_judges_rejections_against_the_noise():
    base = _result(range(1, 9), [], margins=[5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 1e-5])
    spec = _result(range(1, 9), [StepRecord(4, 4, 5), StepRecord(4, 1, 2)])
    exact = Verdict("p", "c", "exact", "")
    rep = self_draft_report([("p", base, spec, exact)], engine="e", dtype="float32", threshold=1e-4, drift_bound=3e-4)
    assert [r.against_noise for r in rep.rejections] == ["within"] and rep.status()[0] == "warn"
    base.scores.top_logprobs[7, 1] = -3.0  # the same rejection at a 2.9-nat margin: not arithmetic
    rep = self_draft_report([("p", base, spec, exact)], engine="e", dtype="float32", threshold=1e-4, drift_bound=3e-4)
    status, why = rep.status()
    assert status == "fail" and "beyond the target's noise" in why and rep.acceptance == 5 / 8


def test_a_rejection_whose_margin_is_unknown_is_not_called_noise():
    """The baseline reported no row at the rejected position (or the output had already left it):
    nothing shows the rejection is arithmetic, and the status says the margin is unknown."""
    base = _result(range(1, 9), [], margins=[5.0] * 8)
    base.scores.logprobs[7] = np.nan  # the engine did not report that row
    spec = _result(range(1, 9), [StepRecord(4, 4, 5), StepRecord(4, 1, 2)])
    rep = self_draft_report([("p", base, spec, Verdict("p", "c", "exact", ""))], engine="e", dtype="float32",
                            threshold=1e-4, drift_bound=3e-4)
    assert [(r.position, r.against_noise, r.baseline_margin) for r in rep.rejections] == [(7, "unknown", None)]
    status, why = rep.status()
    assert status == "warn" and "within the target's noise" not in why, why
    assert why == ("1 rejection(s), margin unknown at 1 (first: p position 7: the output had already left plain "
                   "decode there, or the engine reported no row), so those are not shown to be arithmetic")


def test_correct_self_draft_accepts_everything(self_options, prompts):
    engine = LoopEngine(self_options, None)
    try:
        report, _ = run_self_draft(engine, prompts, GateConfig(max_new_tokens=SELF_DRAFT_TOKENS), width=4)
    finally:
        engine.close()
    assert report.acceptance == 1.0 and not report.rejections and report.status()[0] == "ok"


def test_perturbed_verify_lowers_acceptance_and_fails(self_options, prompts):
    engine = LoopEngine(self_options, "noisy_verify")
    try:
        report, _ = run_self_draft(engine, prompts, GateConfig(max_new_tokens=SELF_DRAFT_TOKENS), width=4)
    finally:
        engine.close()
    assert report.acceptance is not None and report.acceptance < 0.99, report.to_json()
    status, why = report.status()
    assert status == "fail" and ("beyond the target's noise" in why or "not lossless" in why), why
    assert any(r.against_noise == "beyond" for r in report.rejections)


def test_self_draft_needs_the_target_as_draft(hf_options, prompts):
    engine = LoopEngine(hf_options, None)
    try:
        with pytest.raises(InvarianceError, match="is not the target"):
            run_self_draft(engine, prompts, GateConfig())
    finally:
        engine.close()


class UnmaskedBatchEngine(HFEngine):
    """Batches without an attention mask: the padding becomes part of every shorter prompt."""

    def generate_batch(self, requests):
        target = self.target
        original = target.model.generate

        def unmasked(ids, attention_mask=None, **kw):
            return original(ids, attention_mask=None if attention_mask is None else attention_mask * 0 + 1, **kw)

        target.model.generate = unmasked
        try:
            return target.greedy_batch(requests)
        finally:
            del target.model.generate


def test_batching_is_invariant_and_a_broken_batch_is_caught(hf_options, prompts):
    engine = HFEngine(hf_options)
    try:
        report = run_batching(engine, prompts, GateConfig(max_new_tokens=16), batch_size=3)
    finally:
        engine.close()
    assert report.status()[0] in ("ok", "warn") and len(report.verdicts) == len(prompts)
    assert "left-padded" in report.how
    engine = UnmaskedBatchEngine(hf_options)
    try:
        report = run_batching(engine, prompts, GateConfig(max_new_tokens=16), batch_size=3)
    finally:
        engine.close()
    status, why = report.status()
    assert status == "fail" and "change beyond a near tie when batched" in why, report.classes


class CountingEngine(HFEngine):
    """The hf engine, counting its plain decodes (to see whether solo runs were made again)."""

    plain_decodes = 0

    def generate(self, requests, speculative=True):
        self.plain_decodes += 0 if speculative else len(requests)
        return super().generate(requests, speculative=speculative)


def test_batching_reuses_a_self_draft_runs_baselines(self_options, hf_options, prompts):
    """A self-draft gate run's baselines serve as the batching run's solo runs: the report is the one a
    fresh computation gives; requests that differ (another token limit) are decoded again."""
    config = GateConfig(max_new_tokens=12)
    engine = HFEngine(self_options)
    try:
        _, run = run_self_draft(engine, prompts, config, width=4)
    finally:
        engine.close()
    solo = solo_runs(run)
    assert solo is not None and len(solo.runs) == len(prompts)
    batch_options = dataclasses.replace(hf_options, draft=None, spec_mode="prompt_lookup")
    engine = CountingEngine(batch_options)
    try:
        fresh = run_batching(engine, prompts, config, batch_size=3)
        assert engine.plain_decodes == len(prompts)
        reused = run_batching(engine, prompts, config, batch_size=3, precomputed=solo)
        assert engine.plain_decodes == len(prompts)  # no solo run was made again
        other = GateConfig(max_new_tokens=10)
        ignored = run_batching(engine, prompts, other, batch_size=3, precomputed=solo)
        assert engine.plain_decodes == 2 * len(prompts)
        fresh_other = run_batching(engine, prompts, other, batch_size=3)
    finally:
        engine.close()
    assert reused.to_json() == fresh.to_json()
    assert ignored.to_json() == fresh_other.to_json()


def test_live_probe(self_options, hf_options):
    """The same measurement as a live probe, through the engine protocol only."""
    from specparity.probes import live
    from specparity.probes.finding import Status

    for options, bug, status in ((self_options, None, Status.OK), (self_options, "noisy_verify", Status.FAIL),
                                 (hf_options, None, Status.UNKNOWN)):
        engine = LoopEngine(options, bug)
        try:
            finding = live.self_draft(engine, max_new_tokens=32)
        finally:
            engine.close()
        assert finding.status is status, finding.render()
