"""A run never loses finished results: a prompt that fails, or an engine that dies, keeps the rest.

The engine is the real ``hf`` engine in float32 with nothing injected into its numerics, so every
prompt that is not made to fail must be ``exact``: the fixture target's float32 decode and verify
agree bit for bit, its measured noise is orders of magnitude below any margin on its greedy path,
and a near tie there would be a misjudged prompt, not a tolerated flip.
"""

from __future__ import annotations

import json

import numpy as np

from specparity.engines.inprocess.hf import HFEngine
from specparity.gate.decision import decide
from specparity.model.gate_run import GateConfig
from specparity.run.runner import run_gate


class FlakyEngine(HFEngine):
    """The real hf engine, except that one prompt's speculative run raises and, optionally, the
    whole engine dies after N speculative calls (a server that went away)."""

    def __init__(self, options, fail_id: str, die_after: int | None = None):
        super().__init__(options)
        self.fail_id, self.die_after, self.spec_calls = fail_id, die_after, 0

    def generate(self, requests, *, speculative):
        if speculative:
            self.spec_calls += 1
            if self.die_after is not None and self.spec_calls > self.die_after:
                raise ConnectionError("server went away")
            if any(r.request_id == self.fail_id for r in requests):
                raise RuntimeError("boom on this prompt")
        return super().generate(requests, speculative=speculative)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def assert_float32_and_no_tie_possible(run, records) -> None:
    """What makes ``exact`` the only correct class here: the run is float32, its measured near-tie
    threshold is float32 noise, and every baseline margin on the judged prompts' greedy paths (the
    chosen token over the runner-up) is above it, so no flip of a correct loop could be a near tie."""
    assert run.fingerprint.dtype == "float32", run.fingerprint.dtype
    assert run.threshold.source == "measured" and run.threshold.nats < 1e-3, run.threshold.nats
    margins = np.concatenate([r.baseline.scores.top_logprobs[:, 0] - r.baseline.scores.top_logprobs[:, 1]
                              for r in records if len(r.baseline.output_ids)])
    assert margins.size and margins.min() > run.threshold.nats, (margins.min(), run.threshold.nats)


def test_failed_prompt_is_error_and_others_are_kept(tmp_path, hf_options, default_prompts):
    prompts = default_prompts[:4]
    engine = FlakyEngine(hf_options, fail_id=prompts[1].id)
    config = GateConfig(max_new_tokens=12, report_dir=str(tmp_path))
    run = run_gate(engine, prompts, config)
    klass = {r.prompt.id: r.verdict.klass for r in run.records}
    assert klass[prompts[1].id] == "error"
    assert "boom on this prompt" in run.record(prompts[1].id).verdict.reason
    kept = [r for r in run.records if r.prompt.id != prompts[1].id]
    assert_float32_and_no_tie_possible(run, kept)
    assert all(r.verdict.klass == "exact" for r in kept), {r.prompt.id: r.verdict.klass for r in kept}
    decision = decide(run)
    assert not decision.passed and any("failed in the engine" in f for f in decision.failures)
    lines = _lines(tmp_path / "results.jsonl")
    assert [x["kind"] for x in lines].count("prompt") == len(prompts)


def test_engine_death_keeps_finished_prompts(tmp_path, hf_options, default_prompts):
    prompts = default_prompts[:4]
    die_after = 2
    engine = FlakyEngine(hf_options, fail_id="none", die_after=die_after)
    config = GateConfig(max_new_tokens=12, report_dir=str(tmp_path))
    run = run_gate(engine, prompts, config)
    finished = run.records[:die_after]  # one speculative call per prompt, in order
    assert_float32_and_no_tie_possible(run, finished)
    assert [r.verdict.klass for r in finished] == ["exact"] * die_after
    assert all(r.verdict.klass == "error" for r in run.records[die_after:])
    assert all("server went away" in r.verdict.reason for r in run.records[die_after:])
    written = [x for x in _lines(tmp_path / "results.jsonl") if x["kind"] == "prompt"]
    assert len(written) == len(prompts)
    assert [x["verdict"]["class"] for x in written[:die_after]] == ["exact"] * die_after
    assert not decide(run).passed
