"""A logprob channel that is not a model's log-distribution is named, never judged or calibrated on.

The broken engines (``tests/degenerate_logprobs_engine.py``) decode the model's own tokens; only the
numbers are wrong. Without these checks an all-0.0 speculative channel reads as "every alternative tied"
and a constant baseline channel measures a noise of zero; with them the speculative run's prompts are
errors naming the channel (exit 1) and a degenerate baseline or scorer channel refuses the calibration
(nothing judged, exit 3).
"""

from __future__ import annotations

import numpy as np
import pytest

from degenerate_logprobs_engine import SIDES
from specparity.judge.calibration import DegenerateLogprobs, Sample, require_sound_channels
from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.gate.exitcodes import GATE_FAILED, ENGINE_ERROR
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.judge.logprob_channel import MIN_CHANNEL_ROWS, channel_problem, stream_problem
from specparity.model.gate_run import GateConfig
from specparity.run.runner import run_gate
from specparity.model.types import TokenScores

PLUGIN = f"{REPO_ROOT / 'tests' / 'degenerate_logprobs_engine.py'}:create"


def rows(n: int, k: int = 4, seed: int = 0) -> TokenScores:
    """n rows of a real log-softmax over 64 ids, top-k kept."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (n, 64))
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    top = np.argsort(-lp, axis=1)[:, :k]
    top_lp = np.take_along_axis(lp, top, 1).astype(np.float32)
    return TokenScores(top[:, 0], top_lp[:, 0], top, top_lp)


def test_a_models_rows_pass_and_broken_ones_are_named():
    good = rows(40)
    assert stream_problem(good, "rows") is None and channel_problem([good], "rows") is None
    # bf16 log-softmax rounding may put a confident logprob a little above 0: allowed
    nudged = TokenScores(good.token_ids, good.logprobs, good.top_ids, good.top_logprobs.copy())
    nudged.top_logprobs[:, 0] = 0.1
    nudged.top_logprobs[:, 1:] = -9.0
    assert stream_problem(nudged, "rows") is None
    zero = TokenScores(good.token_ids, np.zeros(40), good.top_ids, np.zeros_like(good.top_logprobs))
    problem = stream_problem(zero, "per-position logprobs")
    assert problem.startswith("the engine's per-position logprobs are not log-probabilities")
    assert "at 40 of 40 row(s) (first at position 0: sum 4)" in problem and "every reported logprob is 0.0" in problem
    logits = TokenScores(good.token_ids, good.logprobs + 12, good.top_ids, good.top_logprobs + 12)
    assert "every reported logprob is 0.0" not in stream_problem(logits, "rows")
    # unreported rows (top_ids all -1) are the protocol's, never judged
    gap = TokenScores(zero.token_ids, zero.logprobs, np.full_like(zero.top_ids, -1), zero.top_logprobs)
    assert stream_problem(gap, "rows") is None


def test_a_channel_that_never_changes_is_named():
    const = rows(MIN_CHANNEL_ROWS)
    const.top_logprobs[:] = const.top_logprobs[0]
    assert "every row of the engine's rows is the same" in channel_problem([const], "rows")
    assert channel_problem([rows(MIN_CHANNEL_ROWS - 1)], "rows") is None
    one = rows(MIN_CHANNEL_ROWS, k=1)
    flat = TokenScores(one.token_ids, np.zeros(len(one)), one.top_ids, np.zeros_like(one.top_logprobs))
    assert stream_problem(flat, "rows") is None  # one alternative at 0.0 is a certain token
    assert "every logprob the engine reported in its rows is 0.0" in channel_problem([flat], "rows")
    sample = Sample("p", list(one.token_ids), flat, one)
    with pytest.raises(DegenerateLogprobs, match="refusing to calibrate: every logprob .* baseline's decode logprobs"):
        require_sound_channels([sample], "s")


def _run(hf_options, prompts, tmp_path, side: str):
    engine = load_engine(PLUGIN, EngineOptions(**{**vars(hf_options), "extra": {"side": side}}))
    try:
        return run_gate(engine, prompts, GateConfig(max_new_tokens=12, report_dir=str(tmp_path),
                                                    calibration="selected"))
    finally:
        engine.close()


@pytest.mark.parametrize("side", SIDES)
def test_degenerate_channels_fail_the_gate(side, hf_options, default_prompts, tmp_path):
    prompts = [p for p in default_prompts if p.category == "math"][:3]
    run = _run(hf_options, prompts, tmp_path, side)
    decision = decide(run)
    assert not decision.passed
    if side == "spec-zero":  # the speculative run's own rows: each prompt an error naming them
        assert decision.exit_code == GATE_FAILED and run.calibration_error is None
        for rec in run.records:
            assert rec.verdict.klass == "error", rec.verdict
            assert "per-position logprobs are not log-probabilities" in rec.verdict.reason
            assert "every reported logprob is 0.0" in rec.verdict.reason
    else:  # calibration input: nothing judged, one line that names the channel
        assert decision.exit_code == ENGINE_ERROR, decision
        error = run.calibration_error
        assert "\n" not in error
        if side == "baseline-constant":
            assert error.startswith("refusing to calibrate: every row of the engine's baseline's decode logprobs"), error
        else:
            assert "teacher-forced scores" in error and "not log-probabilities" in error, error
