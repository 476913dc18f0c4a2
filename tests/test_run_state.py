"""A run's run-level state (:mod:`specparity.model.run_state`) is defined once, and a merge decides what the
whole run decides.

* The rule, as a property (hypothesis): a run with any determinism declaration, skipped checks, run-wide
  counters (read, unread, not attributable to the run) and policy, split into shards and merged, reaches
  the whole run's verdict and exit code, and ``specparity report`` on the merged journal agrees with both.
* The merge rules one by one: declarations as the engine combines its servers', skipped checks once each,
  counters strict except for a lost pair's whose prompts were rerun.
* End to end on the project's fakes, the two runs a merge used to pass while the whole run failed: a
  determinism declaration unknown on the baseline under a policy (SGLang), and a skipped check (llama.cpp
  without ``/tokenize``) under a policy.
"""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import LlamaCppServer, SGLangServer
from fakes.backend import TARGET
from inprocess import run_cli
from specparity.gate import exitcodes
from specparity.gate.decision import decide
from specparity.judge.calibration import calibrate
from specparity.model.gate_run import GateConfig, GatePolicy, PromptRecord
from specparity.model.prompts import Prompt
from specparity.model.run_state import RunState
from specparity.model.shards import Shard, ShardPlan, shard_of
from specparity.model.types import ArtifactId, Fingerprint, GenerationResult, SpecStats, TokenScores
from specparity.model.verdicts import Verdict
from specparity.run.journal import RESULTS_SCHEMA, load_run
from specparity.run.merge import merge_dirs

from test_unknown_is_not_lenient import NEAR_TIE, Silent, policy_file

FINGERPRINT = Fingerprint("fake", "1", ArtifactId("/m/target", "sha256:t", "X"), None, "bfloat16", {"method": "ngram"})
THRESHOLD_NATS = 0.5
CLASSES = ("exact", "exact", "near_tie", "diverged", "drifted", "error")


# ------------------------------------------------------------------ the merge rules


def state(**kw) -> RunState:
    return RunState(**kw)


def test_a_declaration_on_every_part_is_the_runs_and_one_part_silent_makes_it_unknown_or_partial():
    on = state(deterministic="declared (b: true, s: true)")
    merged, _ = RunState.merge([("a", on), ("b", on)])
    assert merged.deterministic == on.deterministic and not merged.deterministic_unknown
    unknown = state(deterministic_unknown="declared on s; unknown on b")
    merged, _ = RunState.merge([("a", on), ("b", unknown)])
    assert merged.deterministic is None
    assert merged.deterministic_unknown == "b: declared on s; unknown on b; a: declared: declared (b: true, s: true)"
    merged, _ = RunState.merge([("a", on), ("b", state())])
    assert merged.deterministic is None and merged.deterministic_unknown is None
    assert merged.deterministic_partial == "a: declared (b: true, s: true); not declared on b"
    merged, _ = RunState.merge([("a", unknown), ("b", state())])  # one says nothing: partial, never strict
    assert merged.deterministic_unknown is None and merged.deterministic_partial.endswith("not declared on b")
    merged, _ = RunState.merge([("a", state()), ("b", state())])
    assert merged == RunState()


def test_skipped_checks_are_every_parts_once_each():
    merged, _ = RunState.merge([("a", state(skipped_checks=["x", "y"])), ("b", state(skipped_checks=["y", "z"]))])
    assert merged.skipped_checks == ["x", "y", "z"]


def test_counters_one_part_cannot_attribute_or_read_leave_the_runs_activity_unknown():
    read = state(aggregate=SpecStats(True, 10, 6, 4, source="metrics"))
    merged, notes = RunState.merge([("a", read), ("b", state(aggregate_unattributed="other traffic"))])
    assert merged.aggregate is None and merged.aggregate_unattributed == "b: other traffic"
    assert notes == ["run-wide counters of 1 part(s) were read but do not count: other traffic on b leave the run's "
                     "activity unknown"]
    merged, _ = RunState.merge([("a", read), ("b", state(counters_error="HTTP 500"))])
    assert merged.aggregate is None and merged.counters_error == "b: HTTP 500"
    # a lost pair's part, its prompts rerun elsewhere: its unread counters are named, the rest summed
    merged, notes = RunState.merge([("a", read), ("b", state(counters_error="HTTP 500")), ("c", read)],
                                   excused=frozenset({"b"}))
    assert merged.counters_error is None
    assert (merged.aggregate.proposed, merged.aggregate.accepted, merged.aggregate.verify_steps) == (20, 12, 8)
    assert notes == ["run-wide counters of b not read (its server pair was lost; its unfinished prompts were rerun "
                     "elsewhere), left out of the activity: HTTP 500"]


def test_the_journal_holds_the_state_and_gives_it_back():
    for s in (state(deterministic="d", skipped_checks=["x"], aggregate=SpecStats(True, 3, 2, 1, source="m")),
              state(deterministic_unknown="u", counters_error="e"),
              state(deterministic_partial="p", aggregate_unattributed="t")):
        assert RunState.from_journal(s.run_line({"counters": "aggregate"}), s.counters_line()) == s
    assert state().counters_line() is None


# ------------------------------------------------------------------ the property


def _records(classes: list[str], per_request: bool) -> list[PromptRecord]:
    out = []
    for i, klass in enumerate(classes):
        pid = f"p{i}"
        prompt = Prompt(pid, "math" if i % 2 else "code", "text", prompt=f"prompt {i}")
        spec = SpecStats(True, 8, 5 if i % 3 else 0, 3, source="per request") if per_request \
            else SpecStats.unavailable("aggregate only")
        rec = PromptRecord(prompt, spec=GenerationResult(pid, [], "", "length", TokenScores.empty(), spec))
        rec.verdict = Verdict(pid, prompt.category, klass, f"{klass} by construction", threshold=THRESHOLD_NATS)
        out.append(rec)
    return out


def _write(path: Path, config: GateConfig, run_state: RunState, records: list[PromptRecord],
           plan: ShardPlan | None) -> None:
    _check, threshold = calibrate([], scorer="fake", override=config.near_tie_nats)
    lines = [{"kind": "run", "schema": RESULTS_SCHEMA, "fingerprint": FINGERPRINT.to_json(), "config": config.to_json(),
              "scorer": "fake", "concurrency": 1, **run_state.run_line({"counters": "aggregate"}),
              "stop_token_ids": [2], "calibrated_apart": False, "calibration_reused": [], "wire": {},
              "fleet_notes": []}]
    if plan is not None:
        lines.append({"kind": "shard", **plan.to_json()})
    lines.append({"kind": "threshold", **threshold.to_json(), "scorer_check": None, "spot": None})
    lines += [r.to_json() for r in records]
    counters = run_state.counters_line()
    if counters is not None:
        lines.append(counters)
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


DECLARED = st.sampled_from([{}, {"deterministic": "on (b, s)"}, {"deterministic_partial": "on s only"},
                            {"deterministic_unknown": "on s; unknown on b"}])
COUNTERS = st.sampled_from(["none", "read", "unread", "unattributed"])
POLICIES = st.builds(GatePolicy, max_near_tie=st.sampled_from([None, 0.0, 0.5, 1.0]),
                     bit_exact=st.sampled_from([None, True, False]), drift=st.sampled_from(["fail", "warn"]),
                     unknown_fails=st.booleans(), allow_unknown_activity=st.booleans(),
                     min_accept_length=st.sampled_from([None, 1.5]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(classes=st.lists(st.sampled_from(CLASSES), min_size=2, max_size=8), per_request=st.booleans(),
       declared=DECLARED, skipped=st.lists(st.sampled_from(["check A skipped", "check B skipped"]), max_size=2,
                                           unique=True),
       counters=COUNTERS, proposed=st.integers(0, 40), accepted=st.integers(0, 40), count=st.integers(1, 3),
       spoiled=st.data(), policy=POLICIES)
def test_any_split_merged_decides_what_the_whole_run_decides(tmp_path_factory, classes, per_request, declared, skipped,
                                                             counters, proposed, accepted, count, spoiled, policy):
    root = tmp_path_factory.mktemp("split")
    config = GateConfig(near_tie_nats=THRESHOLD_NATS, policy=policy)
    records = _records(classes, per_request)
    accepted = min(accepted, proposed)
    whole = RunState(**declared, skipped_checks=list(skipped))
    if counters == "read":
        whole.aggregate = SpecStats(True, proposed, accepted, max(1, proposed // 2), source="metrics")
    elif counters == "unread":
        whole.counters_error = "HTTP 500 from /metrics"
    elif counters == "unattributed":
        whole.aggregate_unattributed = "activity unknown: other traffic on the server"
    _write(root / "whole", config, whole, records, None)

    ids = [r.prompt.id for r in records]
    shards = [i for i in range(count) if any(shard_of(pid, count) == i for pid in ids)]
    # the counters a shard saw: the run's split (each shard its share), or, where the run's could not be read or
    # attributed, at least one shard's not (the others read theirs)
    bad = set(spoiled.draw(st.sets(st.sampled_from(shards), min_size=1))) if counters in ("unread", "unattributed") \
        else set()
    dirs = []
    for n, index in enumerate(shards):
        part = RunState(**declared, skipped_checks=list(skipped))
        if index in bad:
            part.counters_error, part.aggregate_unattributed = whole.counters_error, whole.aggregate_unattributed
        elif counters != "none":
            share = proposed // len(shards) + (proposed % len(shards) if n == 0 else 0)
            got = accepted // len(shards) + (accepted % len(shards) if n == 0 else 0)
            part.aggregate = SpecStats(True, share, min(got, share), max(1, share // 2), source="metrics")
        plan = ShardPlan.of(Shard(index, count), ids, None)
        mine = [r for r in records if r.prompt.id in plan.runs]
        _write(root / f"s{index}", GateConfig(**{**vars(config), "shard": plan.shard}), part, mine, plan)
        dirs.append(str(root / f"s{index}"))

    expected = decide(load_run(root / "whole"))
    merged = merge_dirs(dirs, str(root / "merged"))
    got = decide(merged.run)
    assert (got.passed, got.exit_code, got.counts) == (expected.passed, expected.exit_code, expected.counts), \
        (expected.failures, got.failures)
    reread = decide(load_run(root / "merged"))
    assert (reread.passed, reread.exit_code) == (got.passed, got.exit_code), (got.failures, reread.failures)
    assert RunState.of(load_run(root / "merged")) == RunState.of(merged.run)


# ------------------------------------------------------------------ end to end on the fakes


def _whole_shards_merged(tmp_path: Path, run_args: tuple, before_shard=lambda index: None) -> dict[str, int]:
    """Exit codes of the whole run, each of its two shards, their merge and ``specparity report`` on it."""
    codes = {}
    code, out = run_cli(*run_args, "--report", tmp_path / "whole", "-q")
    codes["whole"] = code
    for index in (0, 1):
        before_shard(index)
        codes[f"shard {index}"], out = run_cli(*run_args, "--shard", f"{index}/2", "--report", tmp_path / f"s{index}",
                                               "-q")
    codes["merged"], out = run_cli("merge", tmp_path / "s0", tmp_path / "s1", "--report", tmp_path / "merged")
    codes["report"], _ = run_cli("report", tmp_path / "merged")
    return codes


def test_a_merge_keeps_a_declaration_unknown_on_the_baseline_under_a_policy(tmp_path):
    """The baseline server says nothing about determinism, the speculative one declares it: under a policy the
    run is bit-exact and its one near-tie flip fails it — the whole run, the shard holding the flip, and the
    merge, which used to drop the unknown and pass."""
    policy = policy_file(tmp_path / "policy.toml")
    with Silent() as base, SGLangServer(speculative=True, declares_deterministic=True) as spec:
        args = ("run", "--engine", "sglang", "--baseline-url", base.url, "--spec-url", spec.url, "--target", TARGET,
                "--categories", "math", "--max-new-tokens", "16", "--calibration", "selected", *NEAR_TIE,
                "--policy", policy)
        spec.near_tie_flips = 1

        def one_flip_in_shard_0(index: int) -> None:
            spec.near_tie_flips = 1 if index == 0 else 0

        codes = _whole_shards_merged(tmp_path, args, one_flip_in_shard_0)
    assert len(spec.flipped) == 2  # once in the whole run, once in shard 0
    fail, ok = exitcodes.GATE_FAILED, exitcodes.PASS
    assert codes == {"whole": fail, "shard 0": fail, "shard 1": ok, "merged": fail, "report": fail}, codes
    head = json.loads((tmp_path / "merged" / "results.jsonl").read_text().splitlines()[0])
    whole = json.loads((tmp_path / "whole" / "results.jsonl").read_text().splitlines()[0])
    assert head["capabilities"]["deterministic_unknown"] == whole["capabilities"]["deterministic_unknown"] is not None
    assert "determinism declaration unknown on some servers" in (tmp_path / "merged" / "summary.md").read_text()


def test_a_merge_keeps_a_check_the_servers_could_not_make_under_a_policy(tmp_path):
    """llama.cpp servers without ``/tokenize``: the named tokenizer cannot be checked; under a policy that fails
    the whole run and each shard, and now the merge too, whose header says what was skipped."""
    policy = policy_file(tmp_path / "policy.toml")
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        args = ("run", "--engine", "llamacpp", "--baseline-url", base.url, "--spec-url", spec.url, "--engine-opt",
                f"tokenizer={TARGET}", "--categories", "math", "--max-new-tokens", "16", "--calibration", "selected",
                "--policy", policy)
        codes = _whole_shards_merged(tmp_path, args)
    assert set(codes.values()) == {exitcodes.GATE_FAILED}, codes
    head = json.loads((tmp_path / "merged" / "results.jsonl").read_text().splitlines()[0])
    assert len(head["skipped_checks"]) == 1 and head["skipped_checks"][0].startswith("tokenizer check skipped")
