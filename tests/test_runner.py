"""A run never loses finished results: a prompt that fails, or an engine that dies, keeps the rest."""

from __future__ import annotations

import json

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


def test_failed_prompt_is_error_and_others_are_kept(tmp_path, hf_options, default_prompts):
    prompts = default_prompts[:4]
    engine = FlakyEngine(hf_options, fail_id=prompts[1].id)
    config = GateConfig(max_new_tokens=12, report_dir=str(tmp_path))
    run = run_gate(engine, prompts, config)
    klass = {r.prompt.id: r.verdict.klass for r in run.records}
    assert klass[prompts[1].id] == "error"
    assert "boom on this prompt" in run.record(prompts[1].id).verdict.reason
    assert all(klass[p.id] in ("exact", "near_tie") for p in prompts if p.id != prompts[1].id)
    decision = decide(run)
    assert not decision.passed and any("failed in the engine" in f for f in decision.failures)
    lines = _lines(tmp_path / "results.jsonl")
    assert [x["kind"] for x in lines].count("prompt") == 4


def test_engine_death_keeps_finished_prompts(tmp_path, hf_options, default_prompts):
    prompts = default_prompts[:4]
    engine = FlakyEngine(hf_options, fail_id="none", die_after=2)
    config = GateConfig(max_new_tokens=12, report_dir=str(tmp_path))
    run = run_gate(engine, prompts, config)
    finished = [r for r in run.records if r.verdict and r.verdict.klass in ("exact", "near_tie")]
    assert len(finished) == 2
    assert all(r.verdict.klass == "error" for r in run.records[2:])
    assert "server went away" in run.records[3].verdict.reason
    written = [x for x in _lines(tmp_path / "results.jsonl") if x["kind"] == "prompt"]
    assert len(written) == 4 and written[0]["verdict"]["class"] in ("exact", "near_tie")
    assert not decide(run).passed
