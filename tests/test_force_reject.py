"""Forced rejection (``--force-reject``): the reject path on purpose, the output still the target's.

The point of the mode is a rollback bug that the default run cannot see: ``reject_streak_crop``
(tests/broken_loops.py) crops the target KV cache short only after a streak of fully rejected
verify steps that the fixture draft never reaches on the default prompts (checked here on the
data), so the default run passes it and ``--force-reject all`` fails it. A correct loop passes
both modes, with the reject share counted from its own step records.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from broken_loops import REJECT_STREAK, LoopEngine
from llamacpp_fixtures import require_llamacpp
from prompt_subsets import write_subset
from specparity.gate import exitcodes
from specparity.model.coverage import step_kind
from specparity.engines.base import EngineOptions
from specparity.model.locations import fixture_dir
from specparity.model.force_reject import MIN_REJECT_SHARE, ForceReject, RejectShare
from specparity.gate.decision import decide, reject_share
from specparity.model.prompts import load_prompts
from specparity.model.gate_run import GateConfig
from specparity.run.runner import request_for, run_gate

SHORT_MAX_NEW = 16


# ---------------------------------------------------------------------------------------- no models
def test_all_corrupts_depth_zero_with_a_token_other_than_the_draft():
    spec = ForceReject("all", (4, 3, 1))
    c = spec.for_request("p")
    assert c.corrupt([7, 8, 9]) == [4, 8, 9]
    assert c.corrupt([4, 8]) == [3, 8], "the substitute must differ from the draft's own token"
    assert c.corrupt([]) == []


def test_random_depths_are_seeded_per_request_and_vary():
    spec = ForceReject("random", (4, 3))
    block = list(range(10, 18))

    def depths(request_id: str) -> list[int]:
        c = spec.for_request(request_id)
        return [next(i for i, (a, b) in enumerate(zip(block, c.corrupt(block))) if a != b) for _ in range(40)]

    assert depths("math-en-001") == depths("math-en-001"), "a rerun (or a resume) must corrupt the same depths"
    assert len(set(depths("math-en-001"))) > 1 and max(depths("math-en-001")) > 0
    assert depths("math-en-001") != depths("code-en-001")


def test_substitutes_are_tokens_that_end_nothing():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixture_dir("target")), local_files_only=True)
    stops = (tok.eos_token_id,)
    spec = ForceReject.for_tokenizer("all", tok, len(tok), stops)
    assert len(spec.substitutes) >= 2 and not set(spec.substitutes) & set(stops)
    assert tok.pad_token_id in spec.substitutes


def test_the_all_rule_is_judged_from_steps_or_from_totals():
    enough = math.ceil(MIN_REJECT_SHARE * 20)
    assert RejectShare("all", steps=20, rejected=enough).problem() is None
    assert "did not do its job" in RejectShare("all", steps=20, rejected=enough - 1).problem()
    assert RejectShare("random", steps=20, rejected=1, partial=5).problem() is None
    assert RejectShare("all", proposed=40, accepted=0, per_step=False).problem() is None
    assert "1 of 40 draft tokens were accepted" in RejectShare("all", proposed=40, accepted=1, per_step=False).problem()
    assert "no draft token" in RejectShare("all", proposed=0, accepted=0, per_step=False).problem()


# ---------------------------------------------------------------------------------- the hand loop
def _streaks(engine, prompts, config) -> dict[str, int]:
    """Per prompt: the longest run of fully rejected verify steps in a default (unforced) decode."""
    out = {}
    stops = engine.stop_token_ids()
    for p in prompts:
        result = engine.generate([request_for(engine, p, config, stops)], speculative=True)[0]
        longest = run = 0
        for step in result.spec.steps:
            run = run + 1 if step_kind(step) == "none" else 0
            longest = max(longest, run)
        out[p.id] = longest
    return out


@dataclasses.dataclass
class StreakCase:
    """The prompts ``reject_streak_crop`` is gated on, and the streak that triggers it."""

    prompts: list
    trigger: int


@pytest.fixture(scope="module")
def streak_case(hf_options, default_prompts, tmp_path_factory) -> StreakCase:
    """The data behind ``reject_streak_crop``: the correct loop's longest streak of full rejects on
    every default prompt (at its own token limit); the bug then fires one step beyond it, so the
    default run cannot reach it whatever the prompt file holds, and the gate runs on the prompts
    that come closest."""
    engine = LoopEngine(hf_options, None)
    try:
        streaks = _streaks(engine, default_prompts, GateConfig())
    finally:
        engine.close()
    assert max(streaks.values()) > 0, "the fixture draft is never rejected outright: the check proves nothing"
    closest = sorted(streaks, key=lambda pid: -streaks[pid])[:3]
    path = tmp_path_factory.mktemp("streak") / "streak.jsonl"
    write_subset(path, lambda row: row["id"] in closest)
    return StreakCase(load_prompts(path).prompts, max(streaks.values()) + 1)


def _gate(options, prompts, bug, force_reject, reject_streak=REJECT_STREAK, **config):
    engine = LoopEngine(dataclasses.replace(options, force_reject=force_reject), bug, reject_streak)
    try:
        run = run_gate(engine, prompts, GateConfig(force_reject=force_reject, **config))
    finally:
        engine.close()
    return run, decide(run), engine.loop


def test_reject_streak_bug_passes_the_default_run(hf_options, streak_case):
    run, decision, loop = _gate(hf_options, streak_case.prompts, "reject_streak_crop", None, streak_case.trigger)
    assert decision.passed, decision.failures
    assert not loop.streak_fired
    assert run.coverage.taken()["reject"] > 0, "the default run took no full reject: the prompts prove nothing"


def test_reject_streak_bug_fails_under_force_reject_all(hf_options, streak_case):
    run, decision, loop = _gate(hf_options, streak_case.prompts, "reject_streak_crop", "all", streak_case.trigger)
    assert not decision.passed and decision.exit_code == exitcodes.GATE_FAILED
    assert decision.counts["diverged"] >= 1, decision.counts
    assert decision.counts["exact"] == 0, decision.counts
    assert loop.streak_fired == {p.id for p in streak_case.prompts}
    share = reject_share(run)
    assert share.problem() is None and share.share >= MIN_REJECT_SHARE


@pytest.fixture(scope="module")
def short_prompts(tmp_path_factory):
    """One prompt of each of a few categories: enough verify steps for both modes to show."""
    path = tmp_path_factory.mktemp("short") / "short.jsonl"
    seen: set[str] = set()

    def keep(row: dict) -> bool:
        if row["category"] in ("math", "code", "paths") and row["category"] not in seen:
            seen.add(row["category"])
            return True
        return False

    write_subset(path, keep)
    return load_prompts(path).prompts


def test_correct_loop_passes_force_reject_all(hf_options, short_prompts):
    run, decision, _ = _gate(hf_options, short_prompts, None, "all", max_new_tokens=SHORT_MAX_NEW)
    assert decision.passed, decision.failures
    assert decision.counts["exact"] == len(short_prompts)
    assert run.activity().accepted == 0 and run.activity().proposed > 0
    assert reject_share(run).share >= MIN_REJECT_SHARE


def test_correct_loop_passes_force_reject_random_with_partial_accepts(hf_options, short_prompts):
    run, decision, _ = _gate(hf_options, short_prompts, None, "random", max_new_tokens=SHORT_MAX_NEW)
    assert decision.passed, decision.failures
    share = reject_share(run)
    assert share.rejected > 0 and share.partial > 0, share
    assert run.coverage.kinds["all"] == 0, "a random depth inside every block leaves no block fully accepted"


def test_a_loop_that_ignores_the_mode_is_a_configuration_error(hf_options, short_prompts):
    """The run asks for forced rejects, but the loop is given none (it never calls the corruptor):
    its ordinary acceptance shows, and the gate refuses the run with exit 3."""
    engine = LoopEngine(hf_options, None)
    try:
        run = run_gate(engine, short_prompts, GateConfig(force_reject="all", max_new_tokens=SHORT_MAX_NEW))
    finally:
        engine.close()
    decision = decide(run)
    assert decision.counts["exact"] == len(short_prompts)
    assert not decision.passed and decision.exit_code == exitcodes.ENGINE_ERROR
    assert any("did not do its job" in f for f in decision.failures), decision.failures


# ------------------------------------------------------------------------------- built-in engines
@pytest.mark.parametrize("mode", ["all", "random"])
@pytest.mark.parametrize("engine_name", ["dflash", "hf"])
def test_builtin_engines_pass_under_forced_rejection(engine_name, mode, short_prompts):
    if engine_name == "dflash":
        from specparity.engines.inprocess.dflash import DFlashEngine as make
    else:
        from specparity.engines.inprocess.hf import HFEngine as make
    engine = make(EngineOptions(force_reject=mode))
    try:
        run = run_gate(engine, short_prompts, GateConfig(force_reject=mode, max_new_tokens=SHORT_MAX_NEW))
    finally:
        engine.close()
    decision = decide(run)
    assert decision.passed, decision.failures
    share = reject_share(run)
    if mode == "all":
        assert share.share >= MIN_REJECT_SHARE and run.activity().accepted == 0
    else:
        assert share.rejected > 0 and share.partial > 0, share


def test_the_summary_says_what_was_forced(tmp_path, short_prompts, capsys):
    """Through the command line's entry point: exit 0 and the share on the terminal and in the summary."""
    from specparity.cli.commands import main

    prompts = tmp_path / "p.jsonl"
    write_subset(prompts, lambda row: row["id"] == short_prompts[0].id)
    report = tmp_path / "r"
    rc = main(["run", "--force-reject", "random", "--prompts", str(prompts), "--max-new-tokens", str(SHORT_MAX_NEW),
               "--report", str(report)])
    out = capsys.readouterr().out
    assert rc == exitcodes.PASS, out[-2000:]
    assert "forced rejection: --force-reject random:" in out
    assert "- Forced rejection: --force-reject random:" in (report / "summary.md").read_text()


# ------------------------------------------------------------------------------------ llama.cpp
def test_llamacpp_forces_every_reject(short_prompts):
    require_llamacpp()
    from specparity.engines.server.llamacpp import create

    engine = create(EngineOptions(force_reject="all"))
    try:
        run = run_gate(engine, short_prompts, GateConfig(force_reject="all", max_new_tokens=SHORT_MAX_NEW))
    finally:
        engine.close()
    decision = decide(run)
    assert decision.passed, decision.failures
    act = run.activity()
    assert act.proposed > 0 and act.accepted == 0
    assert "--spec-synth-len" in str(run.fingerprint.extra.get("launch")), run.fingerprint.extra.get("launch")
    assert decision.counts["exact"] == len(short_prompts)
