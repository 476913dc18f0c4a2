"""Non-finite numbers are a failure of the engine, never an unreported row.

A row whose logprob is NaN or ±inf while its ``top_ids`` are real ids did not come from the protocol's
"not reported" convention (``top_ids`` −1): the engine computed garbage. The comparison skips
non-finite numbers, so such rows used to pass unseen on every side; now the prompt is an error that
names the positions, and the gate fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from nonfinite_engine import INF_AT, NAN_AT, SIDES, UNREPORTED
from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.model.gate_run import GateConfig
from specparity.run.runner import conclude, rows_problem, run_gate
from specparity.model.types import TokenScores

PLUGIN = f"{REPO_ROOT / 'tests' / 'nonfinite_engine.py'}:create"


def _scores(n: int = 5, k: int = 5) -> TokenScores:
    top_ids = np.arange(n * k).reshape(n, k)
    row = -np.arange(k, dtype=np.float32)
    top_lp = np.tile(row - np.log(np.exp(row).sum()), (n, 1))  # log-probabilities: the k sum to 1
    return TokenScores(top_ids[:, 0], top_lp[:, 0], top_ids, top_lp)


def _run_plugin(hf_options, prompts, tmp_path, side: str, prompt_id: str):
    """The gate over ``prompts`` with the plugin corrupting ``side`` of ``prompt_id``'s rows."""
    engine = load_engine(PLUGIN, EngineOptions(**{**vars(hf_options), "extra": {"side": side, "prompt": prompt_id}}))
    try:
        return run_gate(engine, prompts, GateConfig(max_new_tokens=12, report_dir=str(tmp_path),
                                                    calibration="selected"))
    finally:
        engine.close()


def test_nonfinite_reported_rows_are_named_and_unreported_rows_allowed():
    s = _scores()
    assert s.nonfinite_positions().size == 0 and rows_problem(s, 5, 5, "rows") is None
    # the protocol's unreported row: NaN with every alternative -1 (llama.cpp's accepted drafts)
    s.logprobs[0], s.top_ids[0], s.top_logprobs[0] = np.nan, -1, np.nan
    # a token scored outside the top-k: its id is -1, its logprob NaN, the alternatives real
    s.token_ids[1], s.logprobs[1] = -1, np.nan
    assert s.nonfinite_positions().size == 0 and s.unreported_positions().tolist() == [0]
    assert rows_problem(s, 5, 5, "rows") is None
    s.logprobs[2] = np.nan
    s.top_logprobs[4, 3] = -np.inf
    assert s.nonfinite_positions().tolist() == [2, 4]
    problem = rows_problem(s, 5, 5, "teacher-forced scores")
    assert problem == ("numeric failure: 2 row(s) of teacher-forced scores with a NaN or infinite logprob although "
                       "the engine reported them (real top_ids), at position(s) 2, 4")


@pytest.mark.parametrize("side", SIDES)
def test_nonfinite_rows_fail_the_gate_on_every_side(side, hf_options, default_prompts, tmp_path):
    prompts = [p for p in default_prompts if p.category == "math"][:3]
    bad = prompts[1].id
    run = _run_plugin(hf_options, prompts, tmp_path, side, bad)
    decision = decide(run)
    verdicts = {r.prompt.id: r.verdict for r in run.records}
    assert verdicts[bad].klass == "error", verdicts[bad]
    reason = verdicts[bad].reason
    assert "numeric failure: 2 row(s)" in reason and f"position(s) {NAN_AT}, {INF_AT}" in reason, reason
    assert all(v.klass == "exact" for pid, v in verdicts.items() if pid != bad), verdicts
    assert not decision.passed and any(bad in f for f in decision.failures), decision.failures


def test_an_unreported_row_is_allowed_and_counted(hf_options, default_prompts, tmp_path):
    """The protocol's unreported row (top_ids -1) is not a failure: the gate passes and the summary
    counts it."""
    prompts = [p for p in default_prompts if p.category == "math"][:2]
    run = _run_plugin(hf_options, prompts, tmp_path, UNREPORTED, prompts[0].id)
    decision = conclude(run)
    assert decision.passed and decision.counts["exact"] == len(prompts), decision.failures
    spec_rows = sum(len(r.spec.scores) for r in run.records)
    line = f"speculative 1 of {spec_rows}"
    assert "- Unreported rows: baseline 0 of " in (tmp_path / "summary.md").read_text()
    assert line in (tmp_path / "summary.md").read_text()
