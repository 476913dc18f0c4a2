"""The gate must fail every broken DFlash loop as ``diverged``, for the right reason, and pass the
correct copy (which reproduces ``dflash_generate`` token for token) and the draft-side bug that
cannot change the output."""

from __future__ import annotations

import json

import pytest

from broken_dflash import BENIGN, BUGS, MODELS_DIR, DFlashLoopEngine, model_options
from inprocess import run_pytest
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.model.gate_run import GateConfig
from specparity.model.prompts import Prompt
from specparity.run.runner import run_gate

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

MAX_NEW = 32
#: Block size per bug: losing the bonus needs fully accepted blocks, which short blocks give often.
BLOCK = {"lose_bonus": 3}


#: Raw-text (no chat template) prompts: out of distribution for the chat-trained fixture target, so
#: the draft misses often (reject and partial-accept steps) whatever the fixture build.
RAW = {"raw-once": "Once upon a", "raw-count": "1, 2, 3,", "raw-words": "Owl horse ladder sun"}


@pytest.fixture(scope="module")
def loop_prompts(default_prompts):
    """Draft-friendly suite prompts (repeat, code, list), one that stops early, and raw-text ones."""
    picked = [p for p in default_prompts if "stops-early" in p.tags][:1]
    for cat in ("repeat", "code", "list"):
        picked += [p for p in default_prompts if p.category == cat and p not in picked][:1]
    return picked + [Prompt(pid, "raw", "en", prompt=text) for pid, text in RAW.items()]


def _run(prompts, bug, block=None):
    engine = DFlashLoopEngine(model_options("dflash2", num_draft_tokens=block), bug)
    try:
        config = GateConfig(max_new_tokens=MAX_NEW)
        run = run_gate(engine, prompts, config)
    finally:
        engine.close()
    return run, decide(run)


@pytest.fixture(scope="module")
def control(loop_prompts):
    return _run(loop_prompts, None)


def test_correct_copy_reproduces_dflash_generate(loop_prompts):
    engine = DFlashLoopEngine(model_options("dflash2"), None)
    try:
        for block in (8, 3):
            engine.set_block_size(block)
            for p in loop_prompts[:3]:
                ids = engine.encode_prompt(p.prompt, p.messages_as_dicts())
                mine, _, steps = engine.loop.hand_loop(engine.target, ids, MAX_NEW, engine.stop_token_ids())
                ref, _, _ = engine.run_dflash(ids, MAX_NEW, engine.stop_token_ids())
                assert mine == ref.output_ids[0].tolist(), (p.id, block)
                assert [s.emitted for s in steps] == list(ref.acceptance_lengths), (p.id, block)
    finally:
        engine.close()


def test_correct_loop_passes_and_takes_the_paths(control):
    run, decision = control
    assert decision.passed, decision.failures
    taken = run.coverage.taken()
    for path in ("reject", "partial", "all", "cut_limit"):
        assert taken[path] > 0, f"path {path} never taken: {taken}"


def _mask_token_id() -> int:
    return int(json.loads((MODELS_DIR / "dflash2" / "config.json").read_text())["dflash_config"]["mask_token_id"])


def _first_non_full(steps):
    """Output position right after the first step that rejected a draft token, or None."""
    pos = 1
    for s in steps:
        pos += s.emitted
        if s.accepted < s.proposed:
            return pos
    return None


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_broken_loop_fails_as_diverged(loop_prompts, bug):
    run, decision = _run(loop_prompts, bug, BLOCK.get(bug))
    assert not decision.passed, f"{bug} ({BUGS[bug]}) slipped through the gate"
    bad = [r for r in run.records if r.verdict.klass == "diverged"]
    assert bad, decision.counts
    assert decision.counts["error"] == 0, [r.verdict.reason for r in run.records if r.verdict.klass == "error"]
    reasons = [r.verdict.reason for r in bad]
    if bug == "overrun_limit":
        assert any("more than max_new_tokens" in x for x in reasons), reasons
        return
    for r in bad:
        v, pos = r.verdict, r.verdict.divergence.position
        assert f"position {pos}" in v.reason, v.reason
        if bug == "accept_past_mismatch":
            # the first difference is a token the target would not choose under the spec run's own prefix
            assert pos in {t.position for t in v.tf_violations}, (v.reason, v.tf_violations)
        elif bug == "lose_bonus":
            assert v.divergence.spec_token.id == _mask_token_id(), v.reason  # the unwritten bonus slot
        elif bug == "no_target_crop":
            # the stale cache can only hurt verify steps after the first rejection
            assert pos >= _first_non_full(r.spec.spec.steps), (pos, r.spec.spec.steps)
        elif bug == "position_off_by_one":
            assert pos >= 1, "the first token comes from the prefill, which the bug does not touch"
    if bug == "lose_bonus":
        assert run.coverage.taken()["all"] > 0


@pytest.mark.parametrize("bug", sorted(BENIGN))
def test_draft_side_bug_passes_the_gate(loop_prompts, control, bug):
    """The target verifies every token, so a draft conditioned on the wrong context only costs
    acceptance: the gate must not call that a losslessness failure."""
    run, decision = _run(loop_prompts, bug)
    assert decision.passed, decision.failures
    assert decision.counts["exact"] == len(loop_prompts)
    assert run.activity().mean_accept_length < control[0].activity().mean_accept_length  # 2.59 vs 4.57


def test_pytest_exits_nonzero_with_a_reason(tmp_path):
    """`pytest suites/lossless` under a broken DFlash loop (as a nested session: the child process's
    exit status is proven for a broken loop in tests/test_no_silent_pass.py::test_xdist_runs_the_gate_once)
    fails and says why."""
    prompts = tmp_path / "raw.jsonl"
    prompts.write_text("\n".join(
        [json.dumps({"specparity_prompts": 1, "description": "raw-text prompts"})]
        + [json.dumps({"id": pid, "category": "raw", "lang": "en", "prompt": text}) for pid, text in RAW.items()]
    ) + "\n")
    code, out = run_pytest(
        "-q", "suites/lossless",
        "--engine", f"{REPO_ROOT / 'tests' / 'broken_dflash.py'}:create", "--engine-opt", "bug=accept_past_mismatch",
        "--target", str(MODELS_DIR / "target"), "--draft", str(MODELS_DIR / "dflash2"),
        "--prompts", str(prompts), "--calibration", "selected", "--max-new-tokens", str(MAX_NEW),
        "--report", str(tmp_path / "r"),
    )
    assert code == 1, out[-3000:]
    assert "[diverged]" in out and "specparity lossless gate: FAIL" in out, out[-3000:]
