"""Gate policy, near-tie threshold and path coverage on constructed runs (no engine needed)."""

from __future__ import annotations

import numpy as np
import pytest

from specparity.model.verdicts import Verdict
from specparity.engines.base import step_record
from specparity.gate.decision import bit_exact, decide, near_tie_policy
from specparity.judge.noise import derive_threshold, measure_noise
from specparity.model.prompts import Prompt
from specparity.model.gate_run import GateConfig, GatePolicy, GateRun, PromptRecord
from specparity.model.types import GenerationResult, SpecStats, StepRecord, TokenScores


def _run(classes, steps=None, available=True, config=None):
    recs = []
    for i, k in enumerate(classes):
        p = Prompt(id=f"p-{i}", category="c", lang="en", prompt="x")
        spec = SpecStats.from_steps(steps if steps is not None else [StepRecord(4, 2, 3)], "t") if available else SpecStats.unavailable("n/a")
        res = GenerationResult(p.id, [1], "", "length", TokenScores.empty(), spec)
        recs.append(PromptRecord(p, spec=res, verdict=Verdict(p.id, "c", k, "r")))
    run = GateRun(None, config or GateConfig(), recs)
    for r in recs:
        run.coverage.add(r.spec.spec)
    return run


def test_policy_rules():
    assert not decide(_run(["exact", "diverged"])).passed
    assert not decide(_run(["exact", "error"])).passed
    assert decide(_run(["exact"] * 3 + ["near_tie"]), GatePolicy(max_near_tie=0.25)).passed
    d = decide(_run(["exact"] * 2 + ["near_tie"] * 2), GatePolicy(max_near_tie=0.25))
    assert not d.passed and "exceed --max-near-tie" in d.failures[0]
    d = decide(_run(["exact", "near_tie"]), GatePolicy(bit_exact=True, max_near_tie=1.0))
    assert not d.passed and "--bit-exact" in d.failures[0]


def test_speculation_inactive_and_unknown():
    d = decide(_run(["exact"] * 3, steps=[StepRecord(4, 0, 1)]))
    assert not d.passed and any("speculation inactive" in f for f in d.failures)
    d = decide(_run(["exact"] * 3, available=False))
    assert not d.passed and any("activity unknown" in f for f in d.failures)
    assert decide(_run(["exact"] * 3, available=False), GatePolicy(allow_unknown_activity=True)).passed


def test_missing_paths_warn_or_fail():
    steps = [StepRecord(4, 4, 5)]  # only full accepts
    d = decide(_run(["exact"], steps=steps))
    assert d.passed and any("(partial)" in w for w in d.warnings)
    d = decide(_run(["exact"], steps=steps), GatePolicy(require_paths=1))
    assert not d.passed and any("(cut_stop)" in f for f in d.failures)


def test_require_all_paths_fails_on_answers_without_step_records():
    """An engine that declares per-step counters and answers totals (or nothing) leaves its paths
    unknown: under --require-all-paths that fails, naming the engine and what it returned, never a
    warning with a pass."""
    from specparity.model.types import ArtifactId, Fingerprint

    run = _run(["exact"] * 3, steps=[StepRecord(4, 4, 5), StepRecord(4, 1, 2, "stop")])
    run.fingerprint = Fingerprint("mine", "1", ArtifactId("t", "", ""), None, "float32", {})
    totals = run.records[1].spec.spec
    run.records[1].spec.spec = SpecStats(True, totals.proposed, totals.accepted, totals.verify_steps,
                                         source="my server's /stats")
    run.records[2].spec.spec = SpecStats.unavailable("counters off")
    run.coverage = type(run.coverage)()
    for r in run.records:
        run.coverage.add(r.spec.spec)
    assert decide(run).passed  # without the rule: reported, not judged
    d = decide(run, GatePolicy(require_paths=1, allow_unknown_activity=True))
    line = next(f for f in d.failures if f.startswith("--require-all-paths 1: "))
    n = len(run.records)
    assert (f"engine 'mine' declares per-verify-step counters but returned per-request totals without step records "
            f"for 1 (first p-1: {totals.proposed} proposed, {totals.accepted} accepted over {totals.verify_steps} "
            f"verify steps; source: my server's /stats) and no speculation counters for 1 (first p-2: counters off) "
            f"of {n} speculative answer(s)") in line
    # every answer with its steps: the rule judges the paths themselves
    full = _run(["exact"] * 3, steps=[StepRecord(4, 4, 5), StepRecord(4, 1, 2, "stop")])
    assert not any(f.startswith("--require-all-paths") for f in decide(full, GatePolicy(require_paths=1)).failures)


@pytest.mark.parametrize(
    "proposed, emitted, budget, cut, accepted",
    [
        ([5, 6, 7], [5, 9], 10, None, 1),  # partial accept + correction
        ([5, 6, 7], [5, 6, 7, 8], 10, None, 3),  # full accept + bonus
        ([5, 0, 7], [5, 0], 10, "stop", 2),  # stop token accepted inside the block
        ([5, 6, 7], [5, 6], 2, "limit", 2),  # block truncated by the limit
        ([5, 6], [5, 6, 7], 3, "limit", 2),  # proposal shortened to fit the limit, fully accepted
        ([5, 6], [5, 9], 3, None, 1),  # shortened to fit the limit, then rejected: nothing was cut
        ([5], [9], 1, None, 0),  # a 1-token budget with a rejected draft: nothing was cut
        ([5, 6, 7], [5, 6, 7], 10, None, 3),  # accepted drafts, no bonus, far from the limit: no cut to claim
        ([5, 6, 7], [5, 6, 7, 8], 4, None, 3),  # full accept at full width ends at the limit: nothing was narrowed
        ([5, 6, 7], [9], 10, None, 0),  # rejected
    ],
)
def test_step_record(proposed, emitted, budget, cut, accepted):
    s = step_record(proposed, emitted, nominal_width=3, budget_before=budget, stop_ids=[0])
    assert (s.cut, s.accepted, s.emitted, s.proposed) == (cut, accepted, len(emitted), len(proposed))


def _scores(lp):
    lp = np.asarray(lp, np.float32)
    n, k = lp.shape
    ids = np.tile(np.arange(k), (n, 1))
    return TokenScores(ids[:, 0], lp[:, 0].copy(), ids, lp)


def test_threshold_is_measured_from_baseline_margin_noise():
    # decode vs teacher-forced: token 0 chosen; the margins to tokens 1 and 2 move by 2e-4 and 3e-4,
    # while a shift common to every logprob (the normaliser) must not count.
    a = _scores([[-0.1, -2.0, -5.0, -6.0, -7.0]] * 3)
    b = _scores([[-0.3, -2.1998, -5.1997, -6.2, -7.2]] * 3)
    noise = measure_noise([(a, b)])
    assert noise.max_abs_delta == pytest.approx(3e-4, rel=1e-2)
    assert noise.pairs == 3 * 4  # the chosen token against itself is not a pair
    t = derive_threshold(noise)
    assert t.source == "measured" and t.nats == pytest.approx(4.5e-4, rel=1e-2)
    assert "measured" in t.describe()
    o = derive_threshold(noise, override=0.5)
    assert o.source == "override" and o.nats == 0.5 and "--near-tie-nats" in o.describe()
    with pytest.raises(ValueError, match="non-negative"):
        derive_threshold(noise, override=-1)
    with pytest.raises(ValueError, match="cannot measure"):
        derive_threshold(measure_noise([]))


DECLARED = "sglang /server_info enable_deterministic_inference=true (baseline http://b: true, spec http://s: true)"


def _declared(classes, bit_exact=None, deterministic=DECLARED, partial=None):
    run = _run(classes, config=GateConfig(policy=GatePolicy(bit_exact=bit_exact, max_near_tie=0.5)))
    run.deterministic, run.deterministic_partial = deterministic, partial
    return run


def test_declared_determinism_makes_a_near_tie_fail():
    """A near tie where the engine declares deterministic inference: the run's own policy (auto)
    fails it, naming the declaration and the way out; the same run without a declaration passes."""
    run = _declared(["exact"] * 3 + ["near_tie"])
    assert bit_exact(run)
    d = decide(run)
    assert not d.passed and d.failures == [
        f"engine declares deterministic inference ({DECLARED}): 1 near-tie flip(s) are a failure — the engine "
        "promised bit-exact output (pass --allow-near-tie to allow): p-3"]
    assert near_tie_policy(run) == f"bit-exact: declared by the engine ({DECLARED})"
    undeclared = _declared(["exact"] * 3 + ["near_tie"], deterministic=None)
    assert not bit_exact(undeclared) and decide(undeclared).passed
    assert near_tie_policy(undeclared) == "near ties allowed up to 50% of the prompts (--max-near-tie)"
    assert decide(_declared(["exact"] * 4)).passed  # exact output keeps the promise


def test_allow_near_tie_overrides_the_declaration_within_the_budget():
    run = _declared(["exact"] * 3 + ["near_tie"], bit_exact=False)
    assert not bit_exact(run) and decide(run).passed
    assert near_tie_policy(run) == f"near ties allowed up to 50% of the prompts: --allow-near-tie despite the " \
                                   f"declaration ({DECLARED})"
    d = decide(_declared(["exact"] + ["near_tie"] * 3, bit_exact=False))  # the budget still holds
    assert not d.passed and "exceed --max-near-tie 50%" in d.failures[0]


def test_bit_exact_flag_and_partial_declaration():
    run = _declared(["exact", "near_tie"], bit_exact=True, deterministic=None)
    assert bit_exact(run) and near_tie_policy(run) == "bit-exact: --bit-exact"
    assert not decide(run).passed and decide(run).failures[0].startswith("--bit-exact: 1 near-tie flip(s)")
    assert decide(run, GatePolicy(bit_exact=False, max_near_tie=0.5)).passed  # an explicit policy wins
    partial = "sglang … but not on every server of both sides (baseline http://b: false, spec http://s: true)"
    run = _declared(["exact"] * 3 + ["near_tie"], deterministic=None, partial=partial)
    assert not bit_exact(run) and decide(run).passed
    assert near_tie_policy(run) == ("near ties allowed up to 50% of the prompts (--max-near-tie); not bit-exact, "
                                    f"since a declaration counts only when it covers both sides: {partial}")


def test_a_declaration_unknown_on_some_servers_is_strict_under_a_policy():
    """Declared on one server, unknown on the other: reported without a policy; under a policy an
    unknown is not lenient, so a near tie fails (and --allow-near-tie still allows it)."""
    unknown = ("sglang /server_info enable_deterministic_inference=true on spec http://s; unknown on baseline "
               "http://b (unknown (/server_info unreadable or without the key))")
    run = _declared(["exact"] * 3 + ["near_tie"], deterministic=None, partial="sglang … but not on every server")
    run.deterministic_unknown = unknown
    assert not bit_exact(run) and decide(run).passed
    assert near_tie_policy(run).endswith(f"; not bit-exact without a policy, since the declaration is unknown on "
                                         f"some servers: {unknown}")
    strict = GatePolicy(max_near_tie=0.5, unknown_fails=True)
    assert bit_exact(run, strict)
    d = decide(run, strict)
    assert not d.passed and d.failures == [
        f"determinism declaration unknown on some servers ({unknown}): under a policy an unknown is not lenient, so "
        "the run is bit-exact and 1 near-tie flip(s) fail (make every server show its setting, or pass "
        "--allow-near-tie to allow): p-3"]
    assert near_tie_policy(run, strict).startswith("bit-exact: the engine's determinism declaration is unknown")
    assert decide(run, GatePolicy(max_near_tie=0.5, unknown_fails=True, bit_exact=False)).passed
    run.deterministic_unknown = None  # a partial declaration that is known: never strict
    assert decide(run, strict).passed


def test_skipped_checks_warn_and_fail_under_a_policy():
    run = _run(["exact"] * 2)
    run.skipped_checks = ["tokenizer check skipped: http://b/tokenize failed (HTTP 404)"]
    d = decide(run)
    assert d.passed and run.skipped_checks[0] in d.warnings
    d = decide(run, GatePolicy(unknown_fails=True))
    assert not d.passed and d.failures == [f"{run.skipped_checks[0]}; under a policy a check that could not be made fails"]


def test_drifted_keeps_its_own_policy_under_a_declaration():
    run = _declared(["exact", "drifted"], bit_exact=False)
    assert not decide(run).passed
    assert decide(run, GatePolicy(bit_exact=False, drift="warn", max_near_tie=0.5)).passed


def test_an_empty_run_is_never_a_pass():
    """No prompt judged (an empty selection, nothing in common): a failure, not a vacuous pass."""
    decision = decide(_run([]))
    assert not decision.passed and decision.exit_code == 1
    assert decision.failures == ["nothing judged: no prompt was selected or in common, and a run that judges "
                                 "nothing never passes"]  # and no "activity unknown" on top


@pytest.mark.parametrize("counters, paths_ok, floor_ok", [
    ("steps", True, True), ("request", False, True), ("aggregate", False, True), ("none", False, False)])
def test_counter_rules_are_refused_where_the_counters_cannot_check_them(counters, paths_ok, floor_ok):
    """Path coverage needs per-step records; a mean accept length needs any counters (request totals
    and aggregates give emitted tokens and verify steps too)."""
    from specparity.run.setup import BadInput, check_counters

    origin = {"require_all_paths": "--require-all-paths", "min_accept_length": "ci/policy.toml:5: min_accept_length"}
    for policy, ok in ((GatePolicy(require_paths=2), paths_ok), (GatePolicy(min_accept_length=1.5), floor_ok),
                       (GatePolicy(), True)):
        if ok:
            check_counters(policy, counters, "e", origin)
            continue
        with pytest.raises(BadInput) as exc:
            check_counters(policy, counters, "e", origin)
        line = str(exc.value)
        assert "\n" not in line and "engine 'e' reports " in line
        assert line.startswith("--require-all-paths 2: " if policy.require_paths else
                               "ci/policy.toml:5: min_accept_length 1.5: ")


def test_every_built_in_engine_declares_its_counters():
    """Declared statically, so a policy they cannot check is refused before anything loads; the values
    are those each engine's capabilities() reports once built."""
    from specparity.engines import engine_info, resolve_factory

    declared = {name: engine_info(resolve_factory(name, "--engine")).counters
                for name in ("hf", "dflash", "llamacpp", "sglang", "vllm")}
    assert declared == {"hf": "steps", "dflash": "steps", "llamacpp": "request", "sglang": "request",
                        "vllm": "aggregate"}
