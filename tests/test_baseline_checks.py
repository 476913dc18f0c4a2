"""The baseline is what it claims: a greedy decode under the run's stop set, or nothing is judged.

Each engine here is the real hf engine with one configuration mistake a user can make: a stop set
that is not the model's (the model still ends its turns with its own end token, as a server does
whatever the client believes), a logit processor that bans repeated n-grams (not greedy), a plugin that
answers with a finish reason outside the protocol. None of them may end as a speculative prompt
"diverged" or "exact": the first two refuse the run (exit 3), the third is that prompt's error.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from specparity import exitcodes
from specparity.compare import FINISH_REASONS, finish_problem
from specparity.engines.hf import HFEngine
from specparity.gate import decide
from specparity.records import GateConfig
from specparity.runner import conclude, run_gate
from specparity.types import GenerationResult, SpecStats, TokenScores


class ForeignStopSet(HFEngine):
    """Tells the harness a stop set that is not the model's, while decoding stops at the model's own
    end tokens (a server's EOG set, or a tokenizer-only directory's ``eos_token_id``)."""

    def __init__(self, options):
        super().__init__(options)
        self.real_stops = super().stop_token_ids()
        self.wrong = (min(set(range(16)) - set(self.real_stops)),)

    def stop_token_ids(self):
        return self.wrong

    def generate(self, requests, *, speculative):
        return super().generate([replace(r, stop_token_ids=self.real_stops) for r in requests], speculative=speculative)


class PenalisedDecode(HFEngine):
    """Decodes with a logit processor that bans repeated 3-grams (transformers' ``no_repeat_ngram_size``,
    as a server's penalties would), reporting the model's own rows."""

    def __init__(self, options):
        super().__init__(options)
        plain = self.target.generation_config

        def penalised(req):
            config = plain(req)
            config.no_repeat_ngram_size = 3
            return config

        self.target.generation_config = penalised


class AbortsOne(HFEngine):
    """Answers one prompt, on both sides, with an empty stream and finish reason "abort"."""

    def __init__(self, options, prompt_id: str):
        super().__init__(options)
        self.prompt_id = prompt_id

    def generate(self, requests, *, speculative):
        out = super().generate(requests, speculative=speculative)
        return [replace(r, output_ids=[], text="", finish_reason="abort", scores=TokenScores.empty(r.scores.k))
                if r.request_id == self.prompt_id else r for r in out]


def _gate(engine, prompts, **config):
    try:
        return run_gate(engine, prompts, GateConfig(**config))
    finally:
        engine.close()


def test_a_stop_set_that_is_not_the_models_refuses_the_run_naming_it(hf_options, default_prompts, tmp_path):
    prompts = [p for p in default_prompts if "stops-early" in p.tags][:2]
    engine = ForeignStopSet(hf_options)
    wrong, real = engine.wrong, engine.real_stops
    run = _gate(engine, prompts, report_dir=str(tmp_path))
    decision = conclude(run)
    assert decision.exit_code == exitcodes.ENGINE_ERROR and not decision.passed
    assert all(r.spec is None for r in run.records), "nothing speculative may run on a refused baseline"
    assert all(r.verdict.klass == "error" and r.verdict.reason.startswith("not judged:") for r in run.records)
    ended = {r.baseline.output_ids[-1] for r in run.records if r.baseline.finish_reason == "stop"}
    assert ended and ended <= set(real), "the fixture prompts chosen must end on the model's own end token"
    failure = " ".join(decision.failures)
    assert "breaks the stop rule" in failure and f"stop set {sorted(wrong)}" in failure
    assert any(f"ends with token {t}" in failure for t in ended), failure
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert any(x["kind"] == "calibration_refused" and "stop set" in x["error"] for x in lines)
    assert "breaks the stop rule" in (tmp_path / "summary.md").read_text()


def test_a_baseline_that_is_not_greedy_refuses_the_run(hf_options, default_prompts):
    prompts = [p for p in default_prompts if p.category == "repeat"][:2]
    run = _gate(PenalisedDecode(hf_options), prompts, max_new_tokens=24)
    decision = decide(run)
    assert decision.exit_code == exitcodes.ENGINE_ERROR, decision.failures
    assert all(r.spec is None for r in run.records)
    failure = " ".join(decision.failures)
    assert "not a greedy decode" in failure and "its row prefers" in failure, failure
    first = next(r for r in run.records if r.prompt.id in failure)
    assert f"first {first.prompt.id} position" in failure


def test_a_finish_reason_outside_the_protocol_is_that_prompts_error(hf_options, default_prompts):
    prompts = [p for p in default_prompts if "stops-early" in p.tags][:2]
    run = _gate(AbortsOne(hf_options, prompts[0].id), prompts)
    verdicts = {r.prompt.id: r.verdict for r in run.records}
    bad = verdicts[prompts[0].id]
    assert bad.klass == "error" and "finish_reason 'abort'" in bad.reason, bad.reason
    assert verdicts[prompts[1].id].klass in ("exact", "near_tie")
    decision = decide(run)
    assert not decision.passed and decision.exit_code == exitcodes.GATE_FAILED
    assert "abort" not in FINISH_REASONS


@pytest.mark.parametrize("finish", FINISH_REASONS)
def test_an_empty_finished_stream_breaks_the_protocol(finish):
    empty = GenerationResult("p", [], "", finish, TokenScores.empty(), SpecStats.unavailable("test"))
    assert "with no token" in finish_problem(empty)
