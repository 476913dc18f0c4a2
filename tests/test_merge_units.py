"""``specparity merge`` piece by piece (:mod:`specparity.run.merge`), on journals written as the runner writes
them (``tests/test_run_state.py``'s ``_records`` and ``_write``, edited where a case needs another line):

* what is read: a report directory or its ``results.jsonl``, once; every directory that holds no shard journal
  refused on its own line, word for word;
* what must be equal for parts to be one run (:func:`merge_key`, :func:`check_parts`): each refusal word for
  word, every problem of a set at once, and the owner of every prompt (a retry takes over what it lists);
* what the merged run is made of: the first shard's run line, each shard's prompts, unfinished prompts as
  ``error`` verdicts naming how their journal ended, the calibration-only prompts, the requests the checks
  read, the run-wide state, timings and wires of every part;
* the run's threshold measured on every shard's noise exactly as :func:`~specparity.judge.calibration.calibrate`
  measures one run's (on the committed golden's real baselines), each prompt kept or judged again under it,
  and a refusal (no noise, a scorer that disagrees with the decode, a baseline that breaks the stop rule or is
  no greedy decode, a shard's constraint check) judging nothing;
* token text for the reports from the first tokenizer found, else the ids themselves;
* the merged journal, line by line;
* the run-level state (:class:`~specparity.model.run_state.RunState`) rule by rule: taken and given as copies,
  journalled and read back, combined over parts.

Time is read from a stand-in clock where a test asserts it: the merge's own seconds include reading the
journals.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import specparity.run.journal as journal_module
import specparity.run.merge as merge_module
from specparity.engines.common import load_tokenizer
from specparity.judge.calibration import Sample, calibrate, widest_difference
from specparity.model.constraints import Constraint
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS, GateConfig, GateRun, PromptRecord
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import Prompt
from specparity.model.run_state import RunState
from specparity.model.shards import Shard, ShardPlan, shard_of
from specparity.model.threshold import NearTieThreshold, NoiseStats
from specparity.model.types import (ArtifactId, Fingerprint, GenerationRequest, GenerationResult, SpecStats,
                                   TokenScores)
from specparity.model.verdicts import Verdict
from specparity.run.golden import load_golden
from specparity.run.journal import RESULTS_SCHEMA, load_run
from specparity.run.merge import (MergeRefused, _decoder, _request, _same_threshold, check_parts, merge_dirs,
                                  merge_key, merge_parts, read_part, read_parts)

from test_run_state import FINGERPRINT, THRESHOLD_NATS, _records, _write

TARGET_DIR = REPO_ROOT / "fixtures" / "models" / "target"
GOLDEN = REPO_ROOT / "golden" / "dflash-float32.jsonl"
#: Six selected prompts; of two shards, shard 0 holds p0, p2, p4, p5 and shard 1 p1, p3.
IDS = [f"p{i}" for i in range(6)]
NOT_FINISHED = "was killed or lost before it finished"


# ------------------------------------------------------------------ journals


def _plan(index: int, count: int = 2, ids=IDS, calibration=None) -> ShardPlan:
    return ShardPlan.of(Shard(index, count), list(ids), calibration)


def _recs(ids, klass: str = "exact") -> list[PromptRecord]:
    """The records ``_records`` makes for prompt ids ``p0`` … ``p11`` (their class ``klass``), those of ``ids``."""
    return [r for r in _records([klass] * 12, per_request=True) if r.prompt.id in ids]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "results.jsonl").read_text().splitlines()]


def _save(path: Path, lines: list[dict]) -> None:
    (path / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _journal(path: Path, plan: ShardPlan | None, records: list[PromptRecord] | None = None, *,
             config: GateConfig | None = None, state: RunState | None = None, head: dict | None = None,
             more: tuple = (), drop: tuple = (), before: tuple = ()) -> Path:
    """A shard's report directory as the runner leaves it (``_write``): ``records`` (default: every prompt of
    the plan's share, ``exact``); ``head`` updates its run line, ``drop`` removes lines of those kinds,
    ``before`` goes before the prompt lines (after the threshold) and ``more`` after everything."""
    config = config or GateConfig(near_tie_nats=THRESHOLD_NATS, shard=plan.shard if plan else None)
    if records is None:
        records = _recs(plan.runs)
    _write(path, config, state or RunState(), records, plan)
    lines = _lines(path)
    lines[0].update(head or {})
    lines = [x for x in lines if x["kind"] not in drop]
    at = next((i for i, x in enumerate(lines) if x["kind"] == "prompt"), len(lines))
    _save(path, lines[:at] + list(before) + lines[at:] + list(more))
    return path


def _two_shards(tmp_path: Path, **kw) -> list[str]:
    return [str(_journal(tmp_path / f"s{i}", _plan(i), **kw)) for i in (0, 1)]


def _refusal(dirs) -> list[str]:
    with pytest.raises(MergeRefused) as info:
        check_parts(read_parts([str(d) for d in dirs]))
    return info.value.problems


def _verdicts(merged) -> dict[str, tuple[str, str]]:
    return {r.prompt.id: (r.verdict.klass, r.verdict.reason) for r in merged.run.records}


class Clock:
    """``time`` for :mod:`specparity.run.merge`: each reading one second after the last."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


# ------------------------------------------------------------------ reading the parts


def test_a_refusal_holds_each_problem_and_says_all_of_them():
    refused = MergeRefused(("a: one", "b: two"))
    assert str(refused) == "a: one; b: two"
    assert refused.problems == ["a: one", "b: two"] and isinstance(refused.problems, list)


def test_a_part_is_read_from_its_report_directory_or_its_journal_and_named_by_its_directory(tmp_path):
    plan = _plan(0)
    d = _journal(tmp_path / "s0", plan)
    for given in (d, str(d), d / "results.jsonl", str(d / "results.jsonl")):
        part = read_part(given)
        assert part.path == d / "results.jsonl"
        assert part.plan == plan
        assert part.name == f"shard 0/2 ({d})"
        assert [r.prompt.id for r in part.run.records] == plan.runs
    retry = _journal(tmp_path / "r0", plan.retry(["p2"], [], "pair 0: lost"), _recs(["p2"]))
    assert read_part(retry).name == f"retry of shard 0/2 ({retry})"


def test_a_parts_journal_is_read_once(tmp_path, monkeypatch):
    """``load_run`` is given the journal ``read_part`` parsed: a shard's journal is never parsed twice."""
    d = _journal(tmp_path / "s0", _plan(0))
    again = []
    real = journal_module.read_journal
    monkeypatch.setattr(journal_module, "read_journal", lambda path: again.append(path) or real(path))
    part = read_part(d)
    assert again == [] and len(part.run.records) == 4


def test_the_seconds_reading_a_part_count_in_the_merges_own(tmp_path, monkeypatch):
    dirs = _two_shards(tmp_path)
    monkeypatch.setattr(merge_module, "time", Clock())
    assert read_part(dirs[0]).read_s == 1.0
    # each part read in one second, the merge itself in one: 3 s, reading included, journalled or not
    monkeypatch.setattr(merge_module, "time", Clock())
    assert merge_dirs(dirs, None).run.timings["merge"] == 3.0
    monkeypatch.setattr(merge_module, "time", Clock())
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    assert merged.run.timings["merge"] == 3.0
    assert _lines(tmp_path / "merged")[-1] == {"kind": "timings", "timings": {"merge": 3.0}}


def test_every_directory_that_holds_no_shard_journal_is_refused_on_its_own_line(tmp_path):
    missing = tmp_path / "missing"
    empty = tmp_path / "empty"
    empty.mkdir()
    whole = _journal(tmp_path / "whole", None, _recs(IDS))
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "results.jsonl").write_text('{"kind": "prompt"}\n')
    shard = _journal(tmp_path / "shard", _plan(0))
    bad = _journal(tmp_path / "bad", _plan(1))
    lines = _lines(bad)
    del lines[1]["prompts"]
    _save(bad, lines)
    with pytest.raises(MergeRefused) as info:
        read_parts([str(missing), str(empty), str(shard), str(whole), str(torn), str(bad / "results.jsonl")])
    assert info.value.problems == [
        f"{missing}: no results.jsonl there (expected the --report directory of a `specparity run --shard I/N`)",
        f"{empty}: no results.jsonl there (expected the --report directory of a `specparity run --shard I/N`)",
        f"{whole}: not a shard's journal (no --shard I/N): a whole run needs no merge",
        f"{torn}: {torn / 'results.jsonl'}:1: expected a 'run' line of schema {RESULTS_SCHEMA} first, got kind "
        "'prompt' schema None",
        f"{bad / 'results.jsonl'}: shard line: missing or malformed field 'prompts'",
    ]
    with pytest.raises(MergeRefused) as info:
        read_parts([])
    assert info.value.problems == ["no shard journal given: name every shard's --report directory"]
    with pytest.raises(MergeRefused) as info:
        merge_dirs([str(shard), str(missing)], None)
    assert info.value.problems == [
        f"{missing}: no results.jsonl there (expected the --report directory of a `specparity run --shard I/N`)"]
    assert [p.path.parent for p in read_parts([str(shard), str(bad.parent / "shard")])] == [shard, shard]


# ------------------------------------------------------------------ what must be equal


def test_the_merge_key_is_the_engine_and_its_models_never_where_they_lay_or_listened():
    fp = Fingerprint("vllm", "0.9.1", ArtifactId("/a/target", "sha256:t", "Qwen3ForCausalLM"),
                     ArtifactId("/a/draft", "sha256:d", "Eagle3"), "bfloat16", {"method": "eagle3", "k": 4},
                     {"tp": 2, "baseline_urls": ["http://a:1"], "spec_urls": ["http://a:2"], "launch": {"cmd": "x"},
                      "spec_server": "http://a:2", "attn": "flash"})
    key = merge_key(fp)
    assert key == {"engine": "vllm", "engine_version": "0.9.1",
                   "target": {"sha256": "sha256:t", "kind": "Qwen3ForCausalLM"},
                   "draft": {"sha256": "sha256:d", "kind": "Eagle3"}, "dtype": "bfloat16",
                   "spec_config": {"method": "eagle3", "k": 4}, "extra": {"attn": "flash", "tp": 2}}
    assert list(key["extra"]) == ["attn", "tp"]
    assert merge_key(dataclasses.replace(fp, draft=None))["draft"] is None
    assert merge_key(None) == {}


def test_parts_split_by_another_hash_or_into_another_number_of_shards_are_refused(tmp_path):
    s0 = _journal(tmp_path / "s0", _plan(0))
    other_hash = _journal(tmp_path / "h1", dataclasses.replace(_plan(1), hash="crc32"))
    assert _refusal([s0, other_hash]) == [
        f"shard 1/2 ({other_hash}): split into 2 shards by crc32, shard 0/2 ({s0}) into 2 by sha256-u64: not shards "
        "of one run"]
    three = _journal(tmp_path / "t1", _plan(1, 3))
    assert _refusal([s0, three]) == [
        f"shard 1/3 ({three}): split into 3 shards by sha256-u64, shard 0/2 ({s0}) into 2 by sha256-u64: not shards "
        "of one run"]


def test_parts_split_from_other_prompts_or_calibration_prompts_are_refused(tmp_path):
    s0 = _journal(tmp_path / "s0", _plan(0, calibration=["c0", "c3"]))
    more = _journal(tmp_path / "m1", _plan(1, ids=IDS + ["p6"], calibration=["c0", "c3"]))
    assert _refusal([s0, more]) == [
        f"shard 1/2 ({more}): split from another list of prompts than shard 0/2 ({s0}) (7 selected, 2 calibration "
        "prompt(s) there, 6 and 2 here): shards of one run are given the same prompt files and options"]
    fewer = _journal(tmp_path / "f1", _plan(1, calibration=["c0"]))
    assert _refusal([s0, fewer]) == [
        f"shard 1/2 ({fewer}): split from another list of prompts than shard 0/2 ({s0}) (6 selected, 1 calibration "
        "prompt(s) there, 6 and 2 here): shards of one run are given the same prompt files and options"]
    none = _journal(tmp_path / "n1", _plan(1))
    assert _refusal([s0, none]) == [
        f"shard 1/2 ({none}): split from another list of prompts than shard 0/2 ({s0}) (6 selected, 0 calibration "
        "prompt(s) there, 6 and 2 here): shards of one run are given the same prompt files and options"]


def test_parts_of_another_engine_or_run_configuration_are_refused_each_difference_on_its_own_line(tmp_path):
    s0 = _journal(tmp_path / "s0", _plan(0))
    other = dataclasses.replace(FINGERPRINT, dtype="float16", extra={"baseline_urls": ["http://elsewhere"]})
    config = GateConfig(near_tie_nats=THRESHOLD_NATS, shard=Shard(1, 2), max_new_tokens=32, scorer="engine",
                        report_dir="/elsewhere", concurrency=8)
    s1 = _journal(tmp_path / "s1", _plan(1), config=config, head={"fingerprint": other.to_json()})
    first = f"shard 0/2 ({s0})"
    assert _refusal([s0, s1]) == [
        f"shard 1/2 ({s1}): engine fingerprint differs from {first}'s (dtype 'bfloat16' → 'float16'): its prompts ran "
        "on another engine, model or speculative configuration",
        f"shard 1/2 ({s1}): --max-new-tokens differs from {first}'s (32 there, None in {first})",
        f"shard 1/2 ({s1}): --scorer differs from {first}'s ('engine' there, 'auto' in {first})",
    ]
    # where the servers listened, the report directory and the concurrency are no part of what is judged
    moved = dataclasses.replace(FINGERPRINT, target=ArtifactId("/other/disk/target", "sha256:t", "X"),
                                extra={"spec_urls": ["http://b:2"], "launch": "elsewhere"})
    s1 = _journal(tmp_path / "s1-moved", _plan(1), config=dataclasses.replace(config, max_new_tokens=None,
                                                                               scorer="auto"),
                  head={"fingerprint": moved.to_json()})
    assert sorted(check_parts(read_parts([str(s0), str(s1)]))) == sorted(IDS)


def test_a_shard_given_twice_is_refused_for_each_shard(tmp_path):
    dirs = [_journal(tmp_path / name, _plan(index)) for name, index in (("a0", 0), ("b0", 0), ("a1", 1), ("b1", 1))]
    assert _refusal(dirs) == [f"shard 0/2 given twice: {dirs[0]} and {dirs[1]}",
                              f"shard 1/2 given twice: {dirs[2]} and {dirs[3]}"]
    # a shard missing besides: the set is refused for what is given twice, not for what is missing
    assert _refusal(dirs[:2]) == [f"shard 0/2 given twice: {dirs[0]} and {dirs[1]}"]


def test_a_retry_of_another_shards_prompt_or_of_a_prompt_already_retried_is_refused(tmp_path):
    plan = _plan(0)
    s0, s1 = _journal(tmp_path / "s0", plan), _journal(tmp_path / "s1", _plan(1))
    r1 = _journal(tmp_path / "r1", plan.retry(["p4", "p1"], []), _recs(["p4", "p1"]))
    r2 = _journal(tmp_path / "r2", plan.retry(["p4"], []), _recs(["p4"]))
    assert _refusal([s0, s1, r1, r2]) == [f"retry of shard 0/2 ({r1}): prompt p1 is not of shard 0/2",
                                          f"prompt p4 is in two journals: {r1} and {r2}"]


def test_every_missing_shard_is_named_with_what_it_holds(tmp_path):
    calibration = ["p1", "c0", "c2", "c4", "c1"]  # of three shards: c0, c2 in 0, c4 in 1, c1 in 2
    assert [shard_of(pid, 3) for pid in calibration + IDS] == [0, 0, 0, 1, 2, 1, 0, 1, 1, 2, 1]
    s1 = _journal(tmp_path / "s1", _plan(1, 3, calibration=calibration))
    assert _refusal([s1]) == [
        "missing shard 0/3: no journal of it was given (1 selected and 2 calibration-only prompt(s), first p1)",
        "missing shard 2/3: no journal of it was given (1 selected and 1 calibration-only prompt(s), first p4)"]


def test_each_prompt_is_owned_by_its_shard_or_the_retry_that_lists_it(tmp_path):
    calibration = ["p0", "c3", "c0"]
    plan = _plan(0, calibration=calibration)
    s0, s1 = _journal(tmp_path / "s0", plan), _journal(tmp_path / "s1", _plan(1, calibration=calibration))
    r0 = _journal(tmp_path / "r0", plan.retry(["p4"], ["c3"]), _recs(["p4"]))
    owners = check_parts(read_parts([str(r0), str(s1), str(s0)]))
    assert {pid: part.path.parent.name for pid, part in owners.items()} == {
        "p0": "s0", "p2": "s0", "p4": "r0", "p5": "s0", "c3": "r0", "p1": "s1", "p3": "s1", "c0": "s1"}


# ------------------------------------------------------------------ the merged run


def test_the_merged_run_is_the_first_shards_run_line_and_every_parts_prompts(tmp_path):
    calibration = ["p0", "c3", "c4", "c0"]  # c3, c4 in shard 0, c0 in shard 1; c4 was never measured
    plan0, plan1 = _plan(0, calibration=calibration), _plan(1, calibration=calibration)
    config = GateConfig(near_tie_nats=THRESHOLD_NATS, shard=plan0.shard, report_dir="/shards/s0", resume=True,
                        concurrency=2, categories=["math", "code"])
    cal = lambda pid, limit=None: {"kind": "calibration", "prompt_id": pid,  # noqa: E731
                                   "prompt": Prompt(pid, "math", "en", prompt=f"calibrate {pid}",
                                                    max_new_tokens=limit).to_json()}
    s0 = _journal(tmp_path / "s0", plan0, config=config, before=(cal("c3", 12),),
                  head={"attachments": [["server log", "/logs/s0.txt"]], "calibrated_apart": True,
                        "calibration_reused": ["p0", "p2", "p4"], "concurrency": 3})
    s1 = _journal(tmp_path / "s1", plan1, config=dataclasses.replace(config, shard=plan1.shard, report_dir="/s1"),
                  before=(cal("c0"),), head={"attachments": [["server log", "/logs/s1.txt"]], "calibrated_apart": True,
                                             "calibration_reused": ["p3", "p0"], "scorer": "other", "concurrency": 5})
    r0 = _journal(tmp_path / "r0", plan0.retry(["p4"], []), _recs(["p4"]),
                  head={"attachments": [["server log", "/logs/r0.txt"]], "calibration_reused": []})
    parts = read_parts([str(s0), str(s1), str(r0)])
    out = str(tmp_path / "merged")
    merged = merge_parts(parts, out)
    run = merged.run
    assert merged.parts == parts
    assert run.config == dataclasses.replace(parts[0].run.config, shard=None, report_dir=out, resume=False)
    assert run.config.shard is None and run.config.report_dir == out and run.config.resume is False
    assert (run.fingerprint, run.scorer, run.concurrency, run.calibrated_apart) == (FINGERPRINT, "fake", 3, True)
    assert run.attachments == [("server log (shard 0/2)", "/logs/s0.txt"), ("server log (shard 1/2)", "/logs/s1.txt"),
                               ("server log (shard 0/2, retry)", "/logs/r0.txt")]
    assert [r.prompt.id for r in run.records] == IDS
    assert {r.prompt.id: r for r in run.records}["p4"] is parts[2].run.records[0]
    # the calibration baselines each shard reused: only those of prompts it owns, in the run's order
    assert run.calibration_reused == ["p0", "p2", "p3"]
    assert [r.prompt.id for r in run.calibration_records] == ["c3", "c0"]
    assert [r.request for r in run.calibration_records] == [GenerationRequest("c3", [], 12, (2,)),
                                                            GenerationRequest("c0", [], DEFAULT_MAX_NEW_TOKENS, (2,))]
    assert merged.notes == [f"calibration prompt c4: not measured (shard 0/2 ({s0}) ended before it)"]
    assert run.fleet_notes == [
        "merged from 3 journal(s) of 2 shard(s) (0, 1), 1 of them rerun(s) on another server pair after a pair was "
        "lost: 6 selected prompt(s); the threshold is measured on every shard's noise; 0 prompt(s) judged again "
        "under it, 0 kept as their shard judged them",
        f"calibration prompt c4: not measured (shard 0/2 ({s0}) ended before it)"]


def test_the_first_shards_own_journal_speaks_for_the_run_even_after_its_retry(tmp_path):
    plan = _plan(0)
    r0 = _journal(tmp_path / "r0", plan.retry(["p4"], []), _recs(["p4"]),
                  head={"concurrency": 4, "scorer": "retry scorer", "stop_token_ids": [7]})
    s0 = _journal(tmp_path / "s0", plan, head={"concurrency": 2})
    s1 = _journal(tmp_path / "s1", _plan(1), head={"concurrency": 6})
    merged = merge_dirs([str(r0), str(s0), str(s1)], str(tmp_path / "merged"))
    assert (merged.run.concurrency, merged.run.scorer) == (2, "fake")
    assert {r.request.stop_token_ids for r in merged.run.records} == {(2,)}
    assert _lines(tmp_path / "merged")[0]["stop_token_ids"] == [2]
    assert merged.run.fleet_notes[0] == (
        "merged from 3 journal(s) of 2 shard(s) (0, 1), 1 of them rerun(s) on another server pair after a pair was "
        "lost: 6 selected prompt(s); the threshold is measured on every shard's noise; 0 prompt(s) judged again "
        "under it, 0 kept as their shard judged them")


def test_a_run_of_retries_alone_speaks_through_its_first_part(tmp_path):
    plan = ShardPlan.of(Shard(0, 1), ["p0", "p1", "p2"], None)
    r0 = _journal(tmp_path / "r0", plan.retry(["p0", "p1", "p2"], [], "pair 0: lost"), _recs(["p0", "p2"]),
                  head={"concurrency": 7, "fingerprint": None})
    merged = merge_dirs([str(r0)], str(tmp_path / "merged"))
    assert merged.run.concurrency == 7 and merged.run.fingerprint is None
    assert _verdicts(merged) == {
        "p0": ("exact", "exact by construction"),
        "p1": ("error", f"not finished: retry of shard 0/1 ({r0}) {NOT_FINISHED} (rerun the shard)"),
        "p2": ("exact", "exact by construction")}
    assert _lines(tmp_path / "merged")[0]["fingerprint"] is None
    assert merged.run.fleet_notes[0] == (
        "merged from 1 journal(s) of 1 shard(s) (0), 1 of them rerun(s) on another server pair after a pair was "
        "lost: 3 selected prompt(s); the threshold is measured on every shard's noise; 0 prompt(s) judged again "
        "under it, 0 kept as their shard judged them")


@pytest.mark.parametrize("ending, how", [((), NOT_FINISHED), (({"kind": "interrupted"},), "was interrupted"),
                                         (({"kind": "fatal", "error": "engine died"},), "stopped on an error"),
                                         (({"kind": "verdict", "passed": False},), "ended before it")])
def test_a_prompt_its_shard_never_finished_is_an_error_naming_how_the_shard_ended(tmp_path, ending, how):
    unjudged = _recs(["p2"])[0]
    unjudged.verdict = None  # its speculative run finished, its judging did not
    s0 = _journal(tmp_path / "s0", _plan(0), _recs(["p0"]) + [unjudged], more=ending)
    s1 = _journal(tmp_path / "s1", _plan(1))
    merged = merge_dirs([str(s0), str(s1)], None)
    fix = "rerun that shard with --resume"
    assert _verdicts(merged) == {
        "p0": ("exact", "exact by construction"), "p1": ("exact", "exact by construction"),
        "p2": ("error", f"not finished: shard 0/2 ({s0}) {how} ({fix})"), "p3": ("exact", "exact by construction"),
        "p4": ("error", f"not finished: shard 0/2 ({s0}) {how} ({fix})"),
        "p5": ("error", f"not finished: shard 0/2 ({s0}) {how} ({fix})")}
    by_id = {r.prompt.id: r for r in merged.run.records}
    assert (by_id["p2"].verdict.prompt_id, by_id["p2"].verdict.category) == ("p2", "code")
    assert by_id["p2"].spec is None  # what never was judged is no speculative result
    assert by_id["p4"].prompt == Prompt("p4", "unknown", "unknown", prompt="", source=str(s0 / "results.jsonl"))
    assert (by_id["p4"].verdict.prompt_id, by_id["p4"].verdict.category) == ("p4", "unknown")
    assert by_id["p4"].request == GenerationRequest("p4", [], DEFAULT_MAX_NEW_TOKENS, (2,))


def test_a_record_without_a_request_gets_the_runs_token_limit_else_its_prompts_else_the_default():
    def request(run_limit, prompt_limit):
        run = GateRun(fingerprint=None, config=GateConfig(max_new_tokens=run_limit), records=[])
        rec = PromptRecord(Prompt("c1", "math", "en", prompt="x", max_new_tokens=prompt_limit))
        _request(rec, run, (2, 7))
        return rec.request

    assert request(16, 8) == GenerationRequest("c1", [], 16, (2, 7))
    assert request(16, None) == GenerationRequest("c1", [], 16, (2, 7))
    assert request(None, 8) == GenerationRequest("c1", [], 8, (2, 7))
    assert request(None, None) == GenerationRequest("c1", [], DEFAULT_MAX_NEW_TOKENS, (2, 7))
    run = GateRun(fingerprint=None, config=GateConfig(max_new_tokens=16), records=[])
    rec = PromptRecord(Prompt("p1", "math", "en", prompt="x"), request=GenerationRequest("p1", [5, 6], 9, (3,)))
    _request(rec, run, (2,))
    assert rec.request == GenerationRequest("p1", [5, 6], 9, (3,))


def test_a_journal_that_names_no_stop_ids_gives_requests_without_any(tmp_path):
    dirs = _two_shards(tmp_path)
    for d in dirs:
        lines = _lines(Path(d))
        del lines[0]["stop_token_ids"]
        _save(Path(d), lines)
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    assert {r.request.stop_token_ids for r in merged.run.records} == {()}
    assert _lines(tmp_path / "merged")[0]["stop_token_ids"] == []


def test_the_threshold_and_the_drift_bound_are_the_runs_only_when_both_are_equal():
    noise = NoiseStats(0.01, 0.01, 10, 20)
    wider = NoiseStats(0.04, 0.01, 10, 20)
    base = NearTieThreshold(0.5, "override", noise, 3.0)
    assert base.drift_nats != NearTieThreshold(0.5, "override", wider, 3.0).drift_nats
    assert _same_threshold(NearTieThreshold(0.5, "override", noise, 3.0), base)
    assert _same_threshold(NearTieThreshold(0.5, "override", None, 3.0), NearTieThreshold(0.5, "override", None, 3.0))
    assert not _same_threshold(None, base)
    assert not _same_threshold(NearTieThreshold(0.25, "override", noise, 3.0), base)
    assert not _same_threshold(NearTieThreshold(0.5, "override", wider, 3.0), base)
    assert not _same_threshold(NearTieThreshold(0.5, "override", None, 3.0), base)


# ------------------------------------------------------------------ kept crash errors


def test_a_kept_crash_error_names_a_server_exit_and_a_rerun_that_never_finished(tmp_path):
    plan = _plan(0)
    own = _recs(plan.runs)
    for rec in own:
        if rec.prompt.id in ("p2", "p5"):
            rec.verdict.klass, rec.verdict.reason = "error", "HTTP 502: connection reset"
    s0 = _journal(tmp_path / "s0", plan, own)
    r0 = _journal(tmp_path / "r0", plan.retry(["p2", "p4", "p5"], [], keep_errors=True), _recs(["p4", "p5"]))
    s1 = _journal(tmp_path / "s1", _plan(1))
    merged = merge_dirs([str(s0), str(r0), str(s1)], None)
    verdicts = _verdicts(merged)
    assert verdicts["p2"] == ("error", "HTTP 502: connection reset [kept: a server of its pair exited; rerun on "
                                       f"another server pair ({r0}): not finished]")
    assert verdicts["p5"] == ("error", "HTTP 502: connection reset [kept: a server of its pair exited; rerun on "
                                       f"another server pair ({r0}): exact]")
    assert verdicts["p4"] == ("exact", "exact by construction")
    note = ("2 prompt(s) keep the error of a pair lost to a server that exited, the rerun's class shown beside each: "
            "p2, p5")
    assert merged.notes == [note]
    assert merged.run.fleet_notes[1:] == [note]


# ------------------------------------------------------------------ the run-wide state of every part


def test_a_lost_pairs_unread_counters_are_excused_only_for_the_shard_that_was_rerun(tmp_path):
    plan = _plan(0)
    read = SpecStats(True, 10, 6, 4, source="metrics")
    s0 = _journal(tmp_path / "s0", plan, state=RunState(counters_error="HTTP 500 from /metrics"))
    r0 = _journal(tmp_path / "r0", plan.retry(["p4"], []), _recs(["p4"]), state=RunState(aggregate=read))
    s1 = _journal(tmp_path / "s1", _plan(1), state=RunState(aggregate=read))
    merged = merge_dirs([str(s0), str(r0), str(s1)], str(tmp_path / "merged"))
    excused = (f"run-wide counters of shard 0/2 ({s0}) not read (its server pair was lost; its unfinished prompts were "
               "rerun elsewhere), left out of the activity: HTTP 500 from /metrics")
    assert merged.notes == [excused]
    assert merged.run.counters_error is None
    assert merged.run.aggregate == SpecStats(True, 20, 12, 8, source="the sum of 2 part(s)' metrics")
    assert _lines(tmp_path / "merged")[-2] == {"kind": "aggregate_counters", "available": True, "proposed": 20,
                                               "accepted": 12, "verify_steps": 8,
                                               "source": "the sum of 2 part(s)' metrics", "unattributed": None}
    # shard 1 was not rerun: its unread counters leave the run's activity unknown
    s1 = _journal(tmp_path / "s1-unread", _plan(1), state=RunState(counters_error="HTTP 503"))
    merged = merge_dirs([str(s0), str(r0), str(s1)], None)
    assert merged.run.counters_error == f"shard 1/2 ({s1}): HTTP 503"
    assert merged.run.aggregate is None
    assert merged.notes == [excused, f"run-wide counters of 1 part(s) were read but do not count: unread counters of "
                                     f"shard 1/2 ({s1}) leave the run's activity unknown"]


def test_the_run_wide_state_is_every_parts(tmp_path):
    on = RunState(deterministic="declared (b: true, s: true)", skipped_checks=["tokenizer check skipped"])
    dirs = [str(_journal(tmp_path / f"s{i}", _plan(i), state=on)) for i in (0, 1)]
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    assert RunState.of(merged.run) == on
    head = _lines(tmp_path / "merged")[0]
    assert head["capabilities"] == {"counters": "aggregate", "deterministic": "declared (b: true, s: true)",
                                    "deterministic_partial": None, "deterministic_unknown": None}
    assert head["skipped_checks"] == ["tokenizer check skipped"]


def test_timings_sum_over_the_shards_and_wall_clock_spans_take_the_longest(tmp_path, monkeypatch):
    s0 = _journal(tmp_path / "s0", _plan(0), more=({"kind": "timings", "timings": {
        "total": 10.0, "baseline_phase_wall": 3.0, "tf_scoring": 1.5, "spec_decode": 0.1234567}},))
    s1 = _journal(tmp_path / "s1", _plan(1), more=({"kind": "timings", "timings": {
        "total": 7.0, "baseline_phase_wall": 4.0, "tf_scoring": 2.0}},))
    monkeypatch.setattr(merge_module, "time", Clock())
    merged = merge_dirs([str(s0), str(s1)], str(tmp_path / "merged"))
    assert dict(merged.run.timings) == {"total": 10.0, "baseline_phase_wall": 4.0, "tf_scoring": 3.5,
                                        "spec_decode": 0.1234567, "merge": 3.0}
    assert _lines(tmp_path / "merged")[-1] == {"kind": "timings", "timings": {
        "total": 10.0, "baseline_phase_wall": 4.0, "tf_scoring": 3.5, "spec_decode": 0.123457, "merge": 3.0}}


def test_the_wire_is_the_shards_one_when_they_share_it_else_each_parts_with_the_part_of_each_prompt(tmp_path):
    same = {"baseline": ["http://b"], "spec": ["http://s"]}
    dirs = [str(_journal(tmp_path / f"s{i}", _plan(i), head={"wire": same})) for i in (0, 1)]
    merged = merge_dirs(dirs, None)
    assert merged.run.wire == same
    one = merge_dirs([str(_journal(tmp_path / "one", _plan(0, 1), _recs(IDS), head={"wire": same}))], None)
    assert one.run.wire == same
    plan = _plan(0)
    wires = [{"baseline": ["http://b0"]}, {"baseline": ["http://b1"]}, {"baseline": ["http://r0"]}]
    s0 = _journal(tmp_path / "w0", plan, head={"wire": wires[0]})
    s1 = _journal(tmp_path / "w1", _plan(1), head={"wire": wires[1]})
    r0 = _journal(tmp_path / "wr", plan.retry(["p4"], []), _recs(["p4"]), head={"wire": wires[2]})
    merged = merge_dirs([str(s0), str(s1), str(r0)], None)
    assert merged.run.wire == {"parts": wires, "part_of": {"p0": 0, "p2": 0, "p4": 2, "p5": 0, "p1": 1, "p3": 1}}


# ------------------------------------------------------------------ refusals: nothing judged


def test_a_shards_constraint_refusal_is_the_runs_and_judges_nothing(tmp_path):
    own = _recs(_plan(0).runs)
    own[1].verdict.klass, own[1].verdict.reason = "error", "HTTP 502: connection reset"  # p2
    s0 = _journal(tmp_path / "s0", _plan(0), own, more=(
        {"kind": "calibration_refused", "check": "stop_or_greedy", "error": "another shard's other refusal"},))
    refusal = "the baselines of 1 JSON-schema prompt(s) are no valid document for their schema: first p3 (not JSON)"
    s1 = _journal(tmp_path / "s1", _plan(1), more=({"kind": "calibration_refused", "check": "constraint",
                                                    "error": refusal},))
    merged = merge_dirs([str(s0), str(s1)], str(tmp_path / "merged"))
    assert merged.run.calibration_error == refusal
    assert _verdicts(merged) == {pid: ("error", "HTTP 502: connection reset") if pid == "p2" else
                                 ("error", f"not judged: {refusal}") for pid in IDS}
    check, _threshold = calibrate([], scorer="fake", override=THRESHOLD_NATS)
    assert [x for x in _lines(tmp_path / "merged") if x["kind"] in ("threshold", "calibration_refused")] == [
        {"kind": "calibration_refused", "error": refusal, "scorer_check": check.to_json(), "spot": None}]
    # a shard refused on another check: that refusal was its share's, the run's baselines are checked again
    s1 = _journal(tmp_path / "s1-other", _plan(1), more=({"kind": "calibration_refused", "check": "stop_or_greedy",
                                                          "error": refusal},))
    merged = merge_dirs([str(s0), str(s1)], None)
    assert merged.run.calibration_error is None
    assert _verdicts(merged)["p1"] == ("exact", "exact by construction")


def test_no_noise_measured_in_any_shard_judges_nothing(tmp_path):
    dirs = []
    for i in (0, 1):
        own = _recs(_plan(i).runs)
        own[0].verdict.klass, own[0].verdict.reason = "error", f"HTTP 500 on {own[0].prompt.id}"
        d = _journal(tmp_path / f"s{i}", _plan(i), own)
        lines = _lines(d)
        lines[0]["config"]["near_tie_nats"] = None
        _save(d, lines)
        dirs.append(str(d))
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    error = "no baseline could be decoded and scored in any shard, so no noise was measured"
    assert (merged.run.threshold, merged.run.calibration_error) == (None, error)
    assert _verdicts(merged) == {
        "p0": ("error", "HTTP 500 on p0"), "p1": ("error", "HTTP 500 on p1"), "p2": ("error", f"not judged: {error}"),
        "p3": ("error", f"not judged: {error}"), "p4": ("error", f"not judged: {error}"),
        "p5": ("error", f"not judged: {error}")}
    assert [(r.verdict.prompt_id, r.verdict.category) for r in merged.run.records] == [
        ("p0", "code"), ("p1", "math"), ("p2", "code"), ("p3", "math"), ("p4", "code"), ("p5", "math")]
    assert [x for x in _lines(tmp_path / "merged") if x["kind"] in ("threshold", "calibration_refused")] == [
        {"kind": "calibration_refused", "error": error, "scorer_check": None, "spot": None}]


def test_a_set_threshold_needs_no_noise_and_is_the_runs(tmp_path):
    merged = merge_dirs(_two_shards(tmp_path), None)
    assert merged.run.calibration_error is None
    assert (merged.run.threshold.nats, merged.run.threshold.source) == (THRESHOLD_NATS, "override")
    assert merged.run.threshold.cross_note == ""
    assert merged.run.threshold.calibration == ("the 0 prompt(s) that ran (the threshold depends on which prompts "
                                                "were selected)")


def _stop_rule_run(tmp_path: Path, name: str, *, config=None, fingerprint=FINGERPRINT) -> str:
    """One shard of one whose baseline of p0 ends on ``length`` two tokens short of the limit."""
    rec = _recs(["p0"])[0]
    rec.baseline = GenerationResult("p0", [5, 6], "", "length", rec.spec.scores, SpecStats.unavailable("baseline"))
    config = config or GateConfig(near_tie_nats=THRESHOLD_NATS, max_new_tokens=4, shard=Shard(0, 1))
    return str(_journal(tmp_path / name, _plan(0, 1, ["p0"]), [rec], config=config,
                        head={"fingerprint": fingerprint.to_json() if fingerprint else None}))


def _stop_rule_refusal(text: str) -> str:
    return ("the baseline breaks the stop rule on 1 of 1 prompt(s), so the stop set or token limit this run uses is "
            "not the engine's (a configuration error, not a speculation bug): first p0: finish_reason is 'length' but "
            "only 2 of max_new_tokens=4 tokens were emitted; it ends with token 6 " + repr(text) + " (finish 'length', "
            "2 of max_new_tokens=4); stop set [2]; the engine did not honour the token limit the run asked for (it "
            "stopped short of it or ran past it): check the server's own cap on new tokens and its context size "
            "against --max-new-tokens")


def test_a_baseline_that_breaks_the_stop_rule_refuses_the_merge_naming_its_token_as_text_where_a_tokenizer_is(
        tmp_path):
    text = load_tokenizer(TARGET_DIR).decode([6])
    assert text != "⟨6⟩"
    merged = merge_dirs([_stop_rule_run(tmp_path, "ids")], None)
    assert merged.run.calibration_error == _stop_rule_refusal("⟨6⟩")
    assert _verdicts(merged) == {"p0": ("error", f"not judged: {_stop_rule_refusal('⟨6⟩')}")}
    merged = merge_dirs([_stop_rule_run(tmp_path, "tokenizer")], None, tokenizer=str(TARGET_DIR))
    assert merged.run.calibration_error == _stop_rule_refusal(text)
    # else the engine's tokenizer or target directory as the run line names them, else the fingerprint's target
    engine = {"spec": "vllm", "options": {"target": str(TARGET_DIR)}}
    config = GateConfig(near_tie_nats=THRESHOLD_NATS, max_new_tokens=4, shard=Shard(0, 1), engine=engine)
    merged = merge_dirs([_stop_rule_run(tmp_path, "engine", config=config)], None)
    assert merged.run.calibration_error == _stop_rule_refusal(text)
    here = dataclasses.replace(FINGERPRINT, target=ArtifactId(str(TARGET_DIR), "sha256:t", "X"))
    merged = merge_dirs([_stop_rule_run(tmp_path, "fingerprint", fingerprint=here)], None)
    assert merged.run.calibration_error == _stop_rule_refusal(text)


def test_token_text_comes_from_the_first_tokenizer_found_else_the_ids(tmp_path):
    ids = [5, 6]
    text = load_tokenizer(TARGET_DIR).decode(ids)
    assert text != "⟨5⟩⟨6⟩"
    here = Fingerprint("fake", "1", ArtifactId(str(TARGET_DIR), "sha256:t"), None, "bfloat16", {})
    elsewhere = dataclasses.replace(here, target=ArtifactId(str(tmp_path / "absent"), "sha256:t"))
    assert _decoder(None, None, None)(ids) == "⟨5⟩⟨6⟩"
    assert _decoder(None, None, {})(np.array(ids)) == "⟨5⟩⟨6⟩"
    assert _decoder(str(tmp_path / "absent"), elsewhere, {"options": {"target": None}})(ids) == "⟨5⟩⟨6⟩"
    assert _decoder(str(TARGET_DIR), None, None)(ids) == text
    assert _decoder(str(TARGET_DIR), None, None)(np.array(ids)) == text
    assert _decoder(None, None, {"options": {"extra": {"tokenizer": str(TARGET_DIR)}}})(ids) == text
    assert _decoder(None, None, {"options": {"target": str(TARGET_DIR)}})(ids) == text
    assert _decoder(None, here, None)(ids) == text
    # a directory that holds no tokenizer is passed over for the next
    broken = tmp_path / "no-tokenizer"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert _decoder(str(broken), here, None)(ids) == text
    assert _decoder(str(broken), None, None)(ids) == "⟨5⟩⟨6⟩"


# ------------------------------------------------------------------ the run's threshold, on real baselines

#: Prompts of the committed golden (real baselines: decode rows and teacher-forced rows): of two shards,
#: code-en-001, -003, -004 and commonsense-en-002 are in shard 0, the others in shard 1.
SELECTED = ["code-en-001", "code-en-002", "code-en-003", "code-en-004", "code-zh-001", "commonsense-en-001"]
CALIBRATION_ONLY = ["commonsense-en-002", "commonsense-zh-001"]
STOPS = (0, 2)
#: What a shard recorded of code-en-003's constraint (checks that read text, which a merge cannot decode).
RECORDED = {"kind": "grammar", "baseline": {"status": "valid", "why": ""},
            "spec": {"status": "invalid", "why": "ends outside the grammar"},
            "problem": "the speculative output breaks the grammar the baseline keeps"}
CROSS_FAILED = "scoring on the speculative server failed for 1 of 8 calibration prompt(s) (first: code-en-002: HTTP 500)"
LABEL = "every prompt of the prompt files (8 measured, 2 of them run only for calibration)"


@pytest.fixture(scope="module")
def golden():
    return load_golden(GOLDEN).entries


def _golden_record(entries, pid: str) -> PromptRecord:
    """The prompt as its shard journalled it: its baseline, a speculative run that emitted the same tokens
    (except where a case changes it) and a verdict its shard reached (``near_tie``: under the run's threshold,
    a prompt judged again is not)."""
    e = entries[pid]
    b = e.baseline
    ids = list(b.output_ids)
    if pid == "code-en-001":  # the speculative run took the second choice at position 10
        ids[10] = int(b.scores.top_ids[10][1])
    spec = GenerationResult(pid, ids, "", b.finish_reason, b.scores, SpecStats(True, 8, 5, 3, source="per request"))
    prompt = e.prompt
    if pid == "code-en-003":
        prompt = dataclasses.replace(prompt, constraint=Constraint("grammar", 'root ::= "x"'))
    rec = PromptRecord(prompt, request=GenerationRequest(pid, list(e.prompt_ids), e.max_new_tokens, STOPS),
                       baseline=b, baseline_tf=e.tf, spec=spec)
    rec.verdict = Verdict(pid, prompt.category, "near_tie", "near_tie as its shard judged it", threshold=0.25)
    if pid == "code-en-002":  # an error before any comparison: no speculative result
        rec.spec = None
        rec.verdict = Verdict(pid, prompt.category, "error", "HTTP 502: the speculative server reset the connection")
    if pid == "code-en-003":
        rec.verdict.constraint = dict(RECORDED)
    if pid == "code-en-004":  # its speculative output was scored teacher-forced
        rec.spec_tf = e.tf
    return rec


def _samples(entries, cross: bool = True, tfs: dict | None = None) -> list[Sample]:
    """The samples one unsharded run measures: the selected prompts', then the calibration-only ones'."""
    return [Sample(pid, entries[pid].baseline.output_ids, entries[pid].baseline.scores,
                   (tfs or {}).get(pid, entries[pid].tf),
                   entries[pid].baseline.scores if cross and pid != "code-en-002" else None)
            for pid in SELECTED + CALIBRATION_ONLY]


def _shifted(rows: TokenScores) -> TokenScores:
    """A scorer's rows one position late: each row the one of the token before."""
    return TokenScores(rows.token_ids, rows.logprobs, np.roll(rows.top_ids, 1, axis=0),
                       np.roll(rows.top_logprobs, 1, axis=0))


def _golden_shards(tmp_path: Path, entries, *, thresholds: dict[int, dict] | None = None, near_tie_nats=None,
                   ceiling: float | None = None, cross: bool = True, threshold_note: str | None = None,
                   tfs: dict | None = None) -> list[str]:
    """The two shards of a run of :data:`SELECTED` calibrated on every prompt (``--calibration suite``), as the
    runner journals them: the baselines with their teacher-forced rows, the calibration-only baselines, each
    measured baseline scored on the speculative server (``cross``; code-en-002's scoring failed), the shard's
    own threshold (``thresholds``: its line, by shard; default: its share's noise) and each prompt's line."""
    dirs = []
    for index in (0, 1):
        plan = _plan(index, ids=SELECTED, calibration=SELECTED + CALIBRATION_ONLY)
        config = GateConfig(near_tie_nats=THRESHOLD_NATS, shard=plan.shard, top_k=8,
                            **({"near_tie_ceiling": ceiling} if ceiling else {}))
        records = [_golden_record(entries, pid) for pid in plan.runs]
        own = plan.runs + [pid for pid in plan.calibrates if pid not in plan.runs]
        lines = []
        for pid in own:
            e = entries[pid]
            lines.append({"kind": "baseline" if pid in plan.runs else "calibration", "prompt_id": pid,
                          "prompt": e.prompt.to_json(), "baseline": e.baseline.to_json(),
                          "baseline_tf": (tfs or {}).get(pid, e.tf).to_json(), "tf_error": None})
        for pid in own if cross else ():
            lines.append({"kind": "cross_instance", "prompt_id": pid, "error": "HTTP 500"} if pid == "code-en-002"
                         else {"kind": "cross_instance", "prompt_id": pid,
                               "scores": entries[pid].baseline.scores.to_json()})
        if thresholds is None or index in thresholds:
            if thresholds is None:
                share = [s for s in _samples(entries, cross, tfs) if s.prompt_id in own]
                _check, mine = calibrate(share, scorer="fake", override=near_tie_nats, label="its share")
                line = mine.to_json()
            else:
                line = thresholds[index]
            if threshold_note is not None:
                line = {**line, "cross_instance_note": threshold_note}
            lines.append({"kind": "threshold", **line, "scorer_check": None, "spot": None})
        d = _journal(tmp_path / f"g{index}", plan, records, config=config, drop=("threshold",), before=tuple(lines),
                     head={"stop_token_ids": list(STOPS), "calibrated_apart": True, "calibration_reused": plan.runs})
        if near_tie_nats is None:
            lines = _lines(d)
            lines[0]["config"]["near_tie_nats"] = None
            _save(d, lines)
        dirs.append(str(d))
    return dirs


def test_a_shards_replay_lines_reach_the_merged_journal_after_the_verdicts(tmp_path, golden):
    """How often a failure came back is kept across a merge: each prompt's ``replay`` line, from the shard that
    owns the prompt, once, after the verdicts; a replay line of another shard's prompt is not taken."""
    dirs = _golden_shards(tmp_path, golden)
    firsts = []
    for d in dirs:
        lines = _lines(Path(d))
        judged = [x["prompt"]["id"] for x in lines if x["kind"] == "prompt"]
        replay = {"kind": "replay", "prompt_id": judged[0], "tries": 3, "same": 1, "baseline": 2, "other": 0,
                  "failed": 0, "first_error": "", "of_error": False, "other_positions": []}
        _save(Path(d), lines + [replay])
        firsts.append(replay)
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    lines = _lines(tmp_path / "merged")
    kinds = [x["kind"] for x in lines]
    assert [x for x in lines if x["kind"] == "replay"] == sorted(
        firsts, key=lambda x: [r.prompt.id for r in merged.run.records].index(x["prompt_id"]))
    assert kinds.index("replay") > max(i for i, k in enumerate(kinds) if k == "prompt")
    back = {r.prompt.id: r.replay for r in load_run(tmp_path / "merged").records if r.replay is not None}
    assert sorted(back) == sorted(x["prompt_id"] for x in firsts) and all(r.tries == 3 and r.same == 1
                                                                           for r in back.values())


def test_the_runs_threshold_is_measured_on_every_shards_noise_as_one_run_measures_it(tmp_path, golden):
    dirs = _golden_shards(tmp_path, golden)
    check, expected = calibrate(_samples(golden), scorer="fake", label=LABEL, cross_note=CROSS_FAILED)
    assert expected.source == "measured" and expected.cross is not None
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    run = merged.run
    assert run.calibration_error is None
    assert run.threshold.to_json() == expected.to_json()
    assert run.scorer_check == check.to_json()
    assert run.calibration_spot is None
    measured = {r.prompt.id: r for r in run.records + run.calibration_records}
    assert [pid for pid, r in measured.items() if r.cross_tf is not None] == [
        pid for pid in SELECTED + CALIBRATION_ONLY if pid != "code-en-002"]
    assert np.array_equal(measured["code-zh-001"].cross_tf.logprobs, golden["code-zh-001"].baseline.scores.logprobs)
    # a prompt line holds the cross-instance rows only through its own line: the merged journal as read back
    assert load_run(tmp_path / "merged").threshold.to_json() == expected.to_json()


def test_a_set_threshold_is_the_runs_with_the_noise_every_shard_measured(tmp_path, golden):
    dirs = _golden_shards(tmp_path, golden, near_tie_nats=THRESHOLD_NATS, ceiling=2.0)
    _check, expected = calibrate(_samples(golden), scorer="fake", ceiling=2.0, override=THRESHOLD_NATS, label=LABEL,
                                 cross_note=CROSS_FAILED)
    merged = merge_dirs(dirs, None)
    assert merged.run.threshold.to_json() == expected.to_json()
    assert (merged.run.threshold.nats, merged.run.threshold.source, merged.run.threshold.ceiling) == (
        THRESHOLD_NATS, "override", 2.0)


def test_without_cross_instance_lines_the_note_is_the_one_the_shards_journalled(tmp_path, golden):
    note = "the engine scores nothing on the speculative server"
    dirs = _golden_shards(tmp_path, golden, cross=False, threshold_note=note, thresholds={1: {}})
    _check, expected = calibrate(_samples(golden, cross=False), scorer="fake", label=LABEL, cross_note=note)
    merged = merge_dirs(dirs, None)
    assert merged.run.threshold.to_json() == expected.to_json()
    assert merged.run.threshold.cross_note == note
    # a shard whose threshold line has no note, and shards with no threshold line at all: no note
    for thresholds in ({1: {}}, {}):
        dirs = _golden_shards(tmp_path / f"t{len(thresholds)}", golden, cross=False, thresholds=thresholds)
        merged = merge_dirs(dirs, None)
        assert merged.run.threshold.cross_note == ""
        assert merged.run.threshold.to_json() == calibrate(_samples(golden, cross=False), scorer="fake",
                                                           label=LABEL)[1].to_json()


def test_a_refused_calibration_is_the_runs_with_where_the_two_scorings_differ_most(tmp_path, golden):
    dirs = _golden_shards(tmp_path, golden, ceiling=1e-9)
    with pytest.raises(ValueError) as expected:
        calibrate(_samples(golden), scorer="fake", ceiling=1e-9, label=LABEL, cross_note=CROSS_FAILED)
    chosen = [s for s in _samples(golden) if s.prompt_id in SELECTED]
    spot = widest_difference(chosen)
    assert spot is not None
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    run = merged.run
    assert run.calibration_error == str(expected.value) and run.calibration_error
    assert run.calibration_spot == spot
    assert _verdicts(merged) == {pid: ("error", "HTTP 502: the speculative server reset the connection")
                                 if pid == "code-en-002" else ("error", f"not judged: {expected.value}")
                                 for pid in SELECTED}
    assert [x for x in _lines(tmp_path / "merged") if x["kind"] in ("threshold", "calibration_refused")] == [
        {"kind": "calibration_refused", "error": str(expected.value), "scorer_check": None, "spot": spot}]


def test_a_prompt_is_kept_where_its_shards_threshold_was_the_runs_and_judged_again_where_not(tmp_path, golden):
    _check, expected = calibrate(_samples(golden), scorer="fake", override=THRESHOLD_NATS, label=LABEL,
                                 cross_note=CROSS_FAILED)
    _check, narrower = calibrate(_samples(golden), scorer="fake", override=0.25, label="shard 0's")
    dirs = _golden_shards(tmp_path, golden, near_tie_nats=THRESHOLD_NATS,
                          thresholds={0: narrower.to_json(), 1: expected.to_json()})
    merged = merge_dirs(dirs, str(tmp_path / "merged"))
    assert (merged.rejudged, merged.kept) == (3, 2)
    verdicts = {r.prompt.id: r.verdict for r in merged.run.records}
    # shard 1's threshold and drift bound were the run's: its verdicts stand as it reached them
    for pid in ("code-zh-001", "commonsense-en-001"):
        assert (verdicts[pid].klass, verdicts[pid].reason) == ("near_tie", "near_tie as its shard judged it")
    assert (verdicts["code-en-002"].klass, verdicts["code-en-002"].reason) == (
        "error", "HTTP 502: the speculative server reset the connection")
    # shard 0's were not: judged again under the run's, the token text the ids themselves (no tokenizer here)
    assert (verdicts["code-en-001"].klass, verdicts["code-en-001"].reason) == (
        "diverged", "position 10: baseline margin 16.3981 nats between '⟨21⟩' and '⟨2823⟩' exceeds the near-tie "
                    "threshold 0.5")
    assert verdicts["code-en-001"].divergence.spec_token.text == "⟨2823⟩"
    assert verdicts["code-en-004"].klass == "exact" and verdicts["code-en-004"].threshold == THRESHOLD_NATS
    assert (verdicts["code-en-004"].later_scored, verdicts["code-en-001"].later_scored) == (True, False)
    # the constraint checks its shard recorded are applied as they were (a merge reads no text)
    assert verdicts["code-en-003"].constraint == RECORDED
    assert (verdicts["code-en-003"].klass, verdicts["code-en-003"].reason) == (
        "diverged", f"{RECORDED['problem']}; {verdicts['code-en-004'].reason}")
    assert merged.run.fleet_notes[0] == (
        "merged from 2 journal(s) of 2 shard(s) (0, 1): 6 selected prompt(s); the threshold is measured on every "
        "shard's noise; 3 prompt(s) judged again under it, 2 kept as their shard judged them")


def test_the_merged_journal_holds_each_shards_lines_and_the_runs_verdicts_and_reads_back_as_the_run(
        tmp_path, golden, monkeypatch):
    check, expected = calibrate(_samples(golden), scorer="fake", override=THRESHOLD_NATS, label=LABEL,
                                cross_note=CROSS_FAILED)
    _check, narrower = calibrate(_samples(golden), scorer="fake", override=0.25, label="shard 0's")
    dirs = _golden_shards(tmp_path, golden, near_tie_nats=THRESHOLD_NATS,
                          thresholds={0: narrower.to_json(), 1: expected.to_json()})
    out = tmp_path / "merged"
    monkeypatch.setattr(merge_module, "time", Clock())
    merge_dirs(dirs, str(out))
    monkeypatch.setattr(merge_module, "time", Clock())
    merged = merge_dirs(dirs, str(out))  # merged again into the same directory: the journal is this merge's alone
    run = merged.run
    shards = [_lines(Path(d)) for d in dirs]

    def lines(kind: str) -> dict[str, dict]:
        return {x["prompt_id"]: x for journal in shards for x in journal if x["kind"] == kind}

    baselines, calibration, cross = lines("baseline"), lines("calibration"), lines("cross_instance")
    assert run.fleet_notes == [
        "merged from 2 journal(s) of 2 shard(s) (0, 1): 6 selected prompt(s); the threshold is measured on every "
        "shard's noise; 3 prompt(s) judged again under it, 2 kept as their shard judged them"]
    want = [
        {"kind": "run", "schema": RESULTS_SCHEMA, "fingerprint": FINGERPRINT.to_json(), "config": run.config.to_json(),
         "scorer": "fake", "concurrency": 1,
         "capabilities": {"counters": "aggregate", "deterministic": None, "deterministic_partial": None,
                          "deterministic_unknown": None},
         "skipped_checks": [], "attachments": [], "stop_token_ids": [0, 2], "calibrated_apart": True,
         "calibration_reused": SELECTED, "resumed_baselines": 0, "resumed_verdicts": 0, "wire": {},
         "fleet_notes": run.fleet_notes,
         "merged_from": [{"path": str(Path(d) / "results.jsonl"), "shard": {"index": i, "count": 2}, "part": "shard"}
                         for i, d in enumerate(dirs)]},
        *[baselines[pid] for pid in SELECTED], *[calibration[pid] for pid in CALIBRATION_ONLY],
        *[cross[pid] for pid in SELECTED + CALIBRATION_ONLY],
        {"kind": "threshold", **expected.to_json(), "scorer_check": check.to_json(), "spot": None},
        *[r.to_json() for r in run.records],
        {"kind": "timings", "timings": {"merge": 3.0}},
    ]
    assert run.config.report_dir == str(out)
    assert _lines(out) == json.loads(json.dumps(want))
    back = load_run(out)
    assert [(r.prompt.id, r.verdict.to_json()) for r in back.records] == [
        (r.prompt.id, r.verdict.to_json()) for r in run.records]
    assert back.threshold.to_json() == expected.to_json()


# ------------------------------------------------------------------ the run-level state, rule by rule


def test_a_runs_state_is_taken_and_given_as_copies():
    run = GateRun(fingerprint=None, config=GateConfig(), records=[])
    run.deterministic, run.skipped_checks = "declared", ["check A skipped"]
    run.aggregate = SpecStats(True, 3, 2, 1, source="m")
    state = RunState.of(run)
    assert state == RunState(deterministic="declared", skipped_checks=["check A skipped"],
                             aggregate=SpecStats(True, 3, 2, 1, source="m"))
    run.skipped_checks.append("check B skipped")
    assert state.skipped_checks == ["check A skipped"]
    other = GateRun(fingerprint=None, config=GateConfig(), records=[])
    state.apply(other)
    assert RunState.of(other) == state
    state.skipped_checks.append("check C skipped")
    assert other.skipped_checks == ["check A skipped"]
    assert RunState.names() == ("deterministic", "deterministic_partial", "deterministic_unknown", "skipped_checks",
                                "aggregate", "counters_error", "aggregate_unattributed")


def test_the_run_line_holds_the_engines_capabilities_with_the_states_declarations():
    state = RunState(deterministic="on", deterministic_unknown="u", skipped_checks=["x"])
    assert state.declarations() == {"deterministic": "on", "deterministic_partial": None, "deterministic_unknown": "u"}
    line = state.run_line({"counters": "aggregate", "deterministic": "as the engine said"})
    assert line == {"capabilities": {"counters": "aggregate", "deterministic": "on", "deterministic_partial": None,
                                     "deterministic_unknown": "u"}, "skipped_checks": ["x"]}
    assert RunState().run_line() == {"capabilities": {"deterministic": None, "deterministic_partial": None,
                                                      "deterministic_unknown": None}, "skipped_checks": []}
    line["skipped_checks"].append("y")
    assert state.skipped_checks == ["x"]


def test_the_counters_line_says_why_the_counters_do_not_count_or_what_they_counted():
    counted = SpecStats(True, 9, 4, 3, source="metrics")
    assert RunState(counters_error="HTTP 500").counters_line(counted, before=1) == {
        "kind": "aggregate_counters", "error": "HTTP 500"}
    assert RunState(aggregate_unattributed="other traffic").counters_line(counted, before=1) == {
        "kind": "aggregate_counters", **counted.to_json(), "unattributed": "other traffic", "before": 1}
    assert RunState(aggregate_unattributed="other traffic").counters_line() == {
        "kind": "aggregate_counters", "unattributed": "other traffic"}
    assert RunState(aggregate=counted).counters_line(before=1) == {
        "kind": "aggregate_counters", **counted.to_json(), "unattributed": None, "before": 1}
    assert RunState().counters_line(counted) is None


def test_a_journal_gives_its_state_back():
    header = {"capabilities": {"counters": "aggregate", "deterministic": "on", "deterministic_partial": "p",
                               "deterministic_unknown": "u"}, "skipped_checks": ["x", "y"]}
    base = RunState(deterministic="on", deterministic_partial="p", deterministic_unknown="u", skipped_checks=["x", "y"])
    assert RunState.from_journal(header, None) == base
    assert RunState.from_journal({}, None) == RunState()
    assert RunState.from_journal({"capabilities": None, "skipped_checks": None}, None) == RunState()
    counted = SpecStats(True, 9, 4, 3, source="metrics")
    assert RunState.from_journal(header, {"kind": "aggregate_counters", "error": "HTTP 500"}) == dataclasses.replace(
        base, counters_error="HTTP 500")
    assert RunState.from_journal(header, {"kind": "aggregate_counters", **counted.to_json(),
                                          "unattributed": "other traffic"}) == dataclasses.replace(
        base, aggregate_unattributed="other traffic")
    assert RunState.from_journal(header, {"kind": "aggregate_counters", **counted.to_json(), "unattributed": None,
                                          "error": ""}) == dataclasses.replace(base, aggregate=counted)


def test_counters_of_parts_are_summed_only_when_every_part_read_its_own():
    a, b = SpecStats(True, 10, 6, 4, source="metrics a"), SpecStats(True, 5, 1, 2, source="metrics b")
    merged, notes = RunState.merge([("a", RunState(aggregate=a))])
    assert merged == RunState(aggregate=a) and notes == []
    merged, notes = RunState.merge([("a", RunState(aggregate=a)), ("b", RunState(aggregate=b))])
    assert merged.aggregate == SpecStats(True, 15, 7, 6, source="the sum of 2 part(s)' metrics a") and notes == []
    merged, notes = RunState.merge([("a", RunState(aggregate=a)), ("b", RunState()), ("c", RunState(aggregate=b))])
    assert merged.aggregate == SpecStats(True, 15, 7, 6, source="the sum of 2 part(s)' metrics a") and notes == []
    assert RunState.merge([("a", RunState()), ("b", RunState())]) == (RunState(), [])
    # one part's words as they are; several, each after its name
    assert RunState.merge([("a", RunState(counters_error="HTTP 500"))]) == (RunState(counters_error="HTTP 500"), [])
    assert RunState.merge([("a", RunState(aggregate_unattributed="other traffic"))]) == (
        RunState(aggregate_unattributed="other traffic"), [])
    merged, notes = RunState.merge([("a", RunState(counters_error="HTTP 500")), ("b", RunState(counters_error="gone")),
                                    ("c", RunState())])
    assert merged == RunState(counters_error="a: HTTP 500; b: gone") and notes == []
    # other traffic outranks an unread part, and the parts that read theirs are named
    merged, notes = RunState.merge([("a", RunState(counters_error="HTTP 500")), ("b", RunState(aggregate=a)),
                                    ("c", RunState(aggregate_unattributed="traffic")),
                                    ("d", RunState(aggregate_unattributed="more traffic"))])
    assert merged == RunState(aggregate_unattributed="c: traffic; d: more traffic")
    assert notes == ["run-wide counters of 1 part(s) were read but do not count: other traffic on c, d leave the "
                     "run's activity unknown"]
    merged, notes = RunState.merge([("a", RunState(counters_error="HTTP 500")), ("b", RunState(counters_error="gone")),
                                    ("c", RunState(aggregate=a)), ("d", RunState(aggregate=b))])
    assert merged == RunState(counters_error="a: HTTP 500; b: gone")
    assert notes == ["run-wide counters of 2 part(s) were read but do not count: unread counters of a, b leave the "
                     "run's activity unknown"]
    # an excused part's unread counters are left out, named; another part's still count
    merged, notes = RunState.merge([("a", RunState(counters_error="HTTP 500")), ("b", RunState(counters_error="gone")),
                                    ("c", RunState(aggregate=a))], excused=frozenset({"a"}))
    assert merged == RunState(counters_error="b: gone")
    assert notes == ["run-wide counters of a not read (its server pair was lost; its unfinished prompts were rerun "
                     "elsewhere), left out of the activity: HTTP 500",
                     "run-wide counters of 1 part(s) were read but do not count: unread counters of b leave the run's "
                     "activity unknown"]


DECLARES = {"on": RunState(deterministic="on (b, s)"), "on2": RunState(deterministic="on (s, b)"),
            "unknown": RunState(deterministic_unknown="on s; unknown on b"),
            "partial": RunState(deterministic_partial="on s only"), "off": RunState(),
            "on+unknown": RunState(deterministic="on (b, s)", deterministic_unknown="stale"),
            "unknown+partial": RunState(deterministic_unknown="on s; unknown on b", deterministic_partial="stale")}


@pytest.mark.parametrize("parts, field, text", [
    (["on"], "deterministic", "on (b, s)"),
    (["on", "on"], "deterministic", "on (b, s)"),
    (["on", "on2"], "deterministic", "a: on (b, s); b: on (s, b)"),
    (["on+unknown", "on"], "deterministic", "on (b, s)"),
    (["unknown"], "deterministic_unknown", "on s; unknown on b"),
    (["unknown", "unknown"], "deterministic_unknown", "on s; unknown on b"),
    (["on", "unknown"], "deterministic_unknown", "b: on s; unknown on b; a: declared: on (b, s)"),
    (["unknown+partial", "on"], "deterministic_unknown", "a: on s; unknown on b; b: declared: on (b, s)"),
    (["partial"], "deterministic_partial", "on s only"),
    (["partial", "partial"], "deterministic_partial", "on s only"),
    (["on", "off"], "deterministic_partial", "a: on (b, s); not declared on b"),
    (["unknown", "off"], "deterministic_partial", "a: on s; unknown on b; not declared on b"),
    (["off", "partial"], "deterministic_partial", "b: on s only; not declared on a"),
    (["on", "partial"], "deterministic_partial", "a: on (b, s); b: on s only"),
    (["partial", "unknown", "on", "off", "off"], "deterministic_partial",
     "c: on (b, s); b: on s; unknown on b; a: on s only; not declared on d, e"),
    (["off", "off"], None, None),
])
def test_declarations_combine_over_parts_as_the_engine_combines_its_servers(parts, field, text):
    names = "abcde"
    merged, _notes = RunState.merge([(names[i], DECLARES[p]) for i, p in enumerate(parts)])
    want = {"deterministic": None, "deterministic_partial": None, "deterministic_unknown": None}
    if field:
        want[field] = text
    assert merged.declarations() == want


def test_a_baseline_that_is_no_greedy_decode_under_the_runs_threshold_refuses_the_merge(tmp_path, golden):
    """code-en-001's baseline emitted its row's second choice at position 10: 16.4 nats below the first, far
    beyond the run's near-tie threshold — the engine samples; nothing is judged."""
    rec = _golden_record(golden, "code-en-001")
    rows = copy.deepcopy(rec.baseline.scores)
    rows.token_ids[10], rows.logprobs[10] = rows.top_ids[10][1], rows.top_logprobs[10][1]
    rec.baseline = dataclasses.replace(rec.baseline, output_ids=list(rec.spec.output_ids), scores=rows)
    rec.baseline_tf = None
    d = _journal(tmp_path / "s0", _plan(0, 1, ["code-en-001"]), [rec], head={"stop_token_ids": list(STOPS)})
    merged = merge_dirs([str(d)], None)
    refusal = ("the baseline is not a greedy decode: at 1 position(s) of 1 of 1 prompt(s) the emitted token is not the "
               "argmax of its own decode row beyond the near-tie threshold 0.5 nats (first code-en-001 position 10: "
               "emitted 2823 '⟨2823⟩', its row prefers 21 '⟨21⟩' by 16.4 nats): the engine samples, applies a penalty "
               "or a logit processor; configure greedy decoding (temperature 0, no repetition/presence/frequency "
               "penalty, no logit processor or bias)")
    assert merged.run.calibration_error == refusal
    assert _verdicts(merged) == {"code-en-001": ("error", f"not judged: {refusal}")}


def test_a_scorer_that_disagrees_with_the_decode_refuses_the_merge_naming_the_scorer(tmp_path, golden):
    tfs = {"commonsense-zh-001": _shifted(golden["commonsense-zh-001"].tf)}
    dirs = _golden_shards(tmp_path, golden, near_tie_nats=THRESHOLD_NATS, tfs=tfs, thresholds={})
    with pytest.raises(ValueError) as expected:
        calibrate(_samples(golden, tfs=tfs), scorer="fake", override=THRESHOLD_NATS, label=LABEL,
                  cross_note=CROSS_FAILED)
    assert str(expected.value).startswith("teacher-forced scorer refused (fake): its argmax differs from the baseline's "
                                          "token at 17 of ")
    merged = merge_dirs(dirs, None)
    assert merged.run.calibration_error == str(expected.value)
    assert merged.run.threshold is None
