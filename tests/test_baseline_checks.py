"""The baseline is what it claims: a greedy decode under the run's stop set, or nothing is judged.

Each engine (``tests/misconfigured_engines.py``) is the real hf engine with one configuration mistake
a user can make: a stop set that is not the model's, a logit processor (not greedy), a plugin that
answers with a finish reason outside the protocol. None of them may end as a speculative prompt
"diverged" or "exact": the first two refuse the run (exit 3), the third is that prompt's error.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from inprocess import run_pytest
from misconfigured_engines import AbortsOne, ForeignStopSet, NotGreedy
from prompt_subsets import rows_where
from specparity.gate import exitcodes
from specparity.judge.baseline_checks import greedy_refusal, stop_rule_refusal
from specparity.judge.compare import FINISH_REASONS, finish_problem
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.model.gate_run import GateConfig, PromptRecord
from specparity.run.runner import conclude, run_gate
from specparity.model.types import GenerationRequest, GenerationResult, SpecStats, TokenScores


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
    run = _gate(NotGreedy(hf_options), prompts, max_new_tokens=24)
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


def test_the_command_exits_3_naming_the_stop_set(tmp_path, default_prompts):
    """The user-facing command (``pytest suites/lossless``, in this process): a misconfigured stop set
    is exit 3 (nothing judged) with the stop set named, never exit 1 with prompts "diverged"."""
    prompts = tmp_path / "stops-early.jsonl"
    rows_where(prompts, lambda row: "stops-early" in row.get("tags", []), limit=1)
    code, out = run_pytest("suites/lossless",
                           "--engine", f"{REPO_ROOT / 'tests' / 'misconfigured_engines.py'}:create",
                           "--engine-opt", "mistake=stop_set", "--prompts", prompts, "--calibration", "selected",
                           "--report", tmp_path / "r")
    assert code == exitcodes.ENGINE_ERROR, out[-3000:]
    assert "breaks the stop rule" in out and "stop set [" in out and "[diverged]" not in out, out[-3000:]


def _record(prompt, ids, finish, max_new=8, stops=(0,)):
    rec = PromptRecord(prompt, request=GenerationRequest(prompt.id, [1], max_new, stops))
    rec.baseline = GenerationResult(prompt.id, ids, "", finish, scores_for(ids), SpecStats.unavailable("test"))
    return rec


def scores_for(ids, prefers=None, by=0.0):
    """Rows in which each emitted token is the argmax, except ``prefers = {position: token}`` by ``by`` nats."""
    n, k = len(ids), 5
    top_ids = np.array([[t] + [x for x in range(50, 60) if x != t][: k - 1] for t in ids], np.int64).reshape(n, k)
    top_lp = np.tile(np.array([-0.1, -5.0, -6.0, -7.0, -8.0], np.float32), (n, 1))
    logprobs = top_lp[:, 0].copy()
    for j, t in (prefers or {}).items():
        top_ids[j, :2] = [t, ids[j]]
        top_lp[j, 1] = -0.1 - by
        logprobs[j] = -0.1 - by
    return TokenScores(np.array(ids, np.int64), logprobs, top_ids, top_lp)


def test_stop_rule_refusal_names_the_rule_the_token_and_the_fix(default_prompts):
    p = default_prompts[0]
    assert stop_rule_refusal([_record(p, [5, 0], "stop")]) is None
    assert stop_rule_refusal([_record(p, [5] * 8, "length")]) is None
    wrong = stop_rule_refusal([_record(p, [5, 3], "stop")], lambda ids: f"<{ids[0]}>")
    assert "ends with token 3 '<3>'" in wrong and "stop set [0]" in wrong and "generation_config.json" in wrong
    short = stop_rule_refusal([_record(p, [5, 6], "length")])
    assert "only 2 of max_new_tokens=8" in short and "--max-new-tokens" in short
    past = stop_rule_refusal([_record(p, [5, 0, 4, 4, 4, 4, 4, 4], "length"), _record(p, [5, 0], "stop")])
    assert past.startswith("the baseline breaks the stop rule on 1 of 2 prompt(s)") and "past stop token 0" in past


def test_greedy_refusal_counts_positions_beyond_the_threshold_and_skips_unreported_rows(default_prompts):
    p = default_prompts[0]
    ids = [5, 6, 7, 8]
    rec = _record(p, ids, "length", max_new=4)
    rec.baseline.scores = scores_for(ids, {1: 9, 3: 9}, by=0.5)
    assert greedy_refusal([rec], threshold=0.6) is None  # within the measured noise
    why = greedy_refusal([rec], threshold=0.3)
    assert "at 2 position(s) of 1 of 1 prompt(s)" in why and f"first {p.id} position 1" in why and "by 0.5 nats" in why
    rows = rec.baseline.scores
    rows.logprobs[1], rows.top_ids[1], rows.top_logprobs[1] = np.nan, -1, np.nan  # not reported: skipped
    assert "at 1 position(s)" in greedy_refusal([rec], threshold=0.3)
