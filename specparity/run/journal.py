"""The run journal (``results.jsonl``): written line by line as work finishes, read back whole.

The runner appends one JSON object per finished unit of work (a baseline, a judged prompt, the
threshold …) and flushes it, so a crash, a Ctrl-C or a dead server never loses what finished. This
module reads a journal back into a :class:`~specparity.model.gate_run.GateRun`: every report can be
rebuilt from the journal alone (``specparity report DIR``), and ``--resume`` continues an
interrupted run from it without regenerating what finished.

A journal may hold several segments: the first starts with a ``run`` line, each resumed run appends
a ``resume`` line and its own lines after it. A later line about a prompt replaces an earlier one.

Line kinds (``kind``): ``run`` / ``resume`` (fingerprint, config, scorer, concurrency,
capabilities), ``shard`` (what a shard of a sharded run was given: :class:`~specparity.model.shards.ShardPlan`),
``golden`` (what a golden contributed), ``baseline`` / ``calibration`` (a prompt's baseline and its
teacher-forced scores), ``cross_instance`` (a calibration baseline scored on the speculative server,
or why it could not be), ``threshold`` or ``calibration_refused``, ``prompt`` (a
judged prompt: baseline, speculative result, its scores, the verdict), ``aggregate_counters``,
``replay`` (a failing prompt's speculative request sent again: :mod:`specparity.model.replay`),
``timings``, ``fatal``, ``interrupted``, ``verdict`` (the decision).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from specparity.model.verdicts import Verdict
from specparity.model.jsonl import JsonlError, read_jsonl
from specparity.model.threshold import NearTieThreshold
from specparity.model.prompts import Prompt, PromptFileError
from specparity.model.gate_run import GateConfig, GateRun, PromptRecord
from specparity.model.replay import Replay
from specparity.model.run_state import COUNTERS_KIND, RunState
from specparity.model.types import Fingerprint, GenerationRequest, GenerationResult, TokenScores

RESULTS_SCHEMA = "specparity.results/1"
JOURNAL = "results.jsonl"
#: Kinds a journal may hold; anything else is a journal this version cannot read.
KINDS = frozenset({"run", "resume", "shard", "golden", "baseline", "calibration", "cross_instance", "threshold",
                   "calibration_refused", "prompt", "aggregate_counters", "replay", "timings", "fatal", "interrupted",
                   "verdict"})


#: Kinds a run that never started may write without a ``run`` line first.
ENDINGS = frozenset({"fatal", "timings", "interrupted", "verdict"})


class JournalError(ValueError):
    """A journal that cannot be read back; the message is ``file:line: what is wrong``."""


@dataclass
class Journal:
    """What a journal holds, per prompt the latest line, in the order prompts first appeared."""

    path: Path
    header: dict[str, Any]
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)
    calibration: dict[str, dict[str, Any]] = field(default_factory=dict)
    judged: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Per calibration prompt, its ``cross_instance`` line (scores on the speculative server, or the error).
    cross_instance: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Per replayed prompt, its ``replay`` line.
    replays: dict[str, dict[str, Any]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    last: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> latest line of that kind
    #: Lines of the last segment (after the last run/resume line), by kind.
    segment_kinds: set[str] = field(default_factory=set)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    golden_notes: list[str] = field(default_factory=list)
    segments: int = 0


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        jsonl = read_jsonl(path)
    except OSError as exc:
        raise JournalError(f"{path}: cannot read the journal ({exc.strerror or exc})") from None
    except JsonlError as exc:
        raise JournalError(str(exc)) from None
    # the last line of a run killed mid-write (torn_tail): what came before it is intact
    for lineno, obj in jsonl.records(torn_tail=True, error=lambda exc: JournalError(str(exc))):
        if not isinstance(obj, dict) or obj.get("kind") not in KINDS:
            kind = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
            raise JournalError(f"{path}:{lineno}: kind {kind!r}: expected one of {', '.join(sorted(KINDS))}")
        yield lineno, obj


def read_journal(path: str | Path) -> Journal:
    """Read ``path`` (a ``results.jsonl``, or the report directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / JOURNAL
    journal: Journal | None = None
    for lineno, obj in _lines(p):
        kind = obj["kind"]
        if journal is None and kind in ENDINGS:
            # the engine never started (a failed health check): the run wrote only how it ended
            journal = Journal(p, {"schema": RESULTS_SCHEMA})
        if journal is None:
            if kind != "run" or obj.get("schema") != RESULTS_SCHEMA:
                raise JournalError(f"{p}:{lineno}: expected a 'run' line of schema {RESULTS_SCHEMA} first, "
                                   f"got kind {kind!r} schema {obj.get('schema')!r}")
            journal = Journal(p, obj)
        try:
            _take(journal, kind, obj)
        except (KeyError, TypeError) as exc:
            raise JournalError(f"{p}:{lineno}: {kind} line: missing or malformed field {exc}") from None
    if journal is None:
        raise JournalError(f"{p}: empty journal (no 'run' line): the run wrote nothing")
    return journal


def _take(journal: Journal, kind: str, obj: dict[str, Any]) -> None:
    if kind in ("run", "resume"):
        journal.segments += 1
        journal.segment_kinds = set()
        journal.header = {**journal.header, **{k: v for k, v in obj.items() if k != "kind"}}
    journal.segment_kinds.add(kind)
    journal.last[kind] = obj
    if kind in ("baseline", "calibration", "prompt"):
        pid = obj["prompt_id"] if kind != "prompt" else obj["prompt"]["id"]
        target = {"baseline": journal.baselines, "calibration": journal.calibration, "prompt": journal.judged}[kind]
        target[pid] = obj
        if kind != "calibration" and pid not in journal.order:
            journal.order.append(pid)
    elif kind == "cross_instance":
        journal.cross_instance[obj["prompt_id"]] = obj
    elif kind == "replay":
        journal.replays[obj["prompt_id"]] = obj
    elif kind == "timings":
        for key, value in obj["timings"].items():
            journal.timings[key] += float(value)
    elif kind == "golden":
        journal.golden_notes.extend(obj.get("notes", []))


def _prompt(journal: Journal, obj: dict[str, Any], pid: str) -> Prompt:
    data = obj.get("prompt")
    if data is None:
        return Prompt(pid, "unknown", "unknown", prompt="", source=f"{journal.path}")
    try:
        return Prompt.from_json(data, f"{journal.path}: prompt {pid}")
    except PromptFileError as exc:
        raise JournalError(str(exc)) from None


def _scores(data: dict[str, Any] | None) -> TokenScores | None:
    return TokenScores.from_json(data) if data is not None else None


def baseline_record(journal: Journal, pid: str, line: dict[str, Any]) -> PromptRecord:
    """A record holding a journalled baseline (and its teacher-forced scores) of prompt ``pid``."""
    rec = PromptRecord(_prompt(journal, line, pid))
    rec.baseline = GenerationResult.from_json(line["baseline"]) if line.get("baseline") else None
    rec.baseline_tf = _scores(line.get("baseline_tf"))
    rec.tf_error = line.get("tf_error")
    return rec


def judged_record(journal: Journal, line: dict[str, Any]) -> PromptRecord:
    """A record of a judged prompt, with its verdict, both results and their scores."""
    pid = line["prompt"]["id"]
    base_line = journal.baselines.get(pid, {})
    rec = PromptRecord(_prompt(journal, line, pid))
    rec.baseline = GenerationResult.from_json(line["baseline"]) if line.get("baseline") else None
    rec.baseline_tf = _scores(line.get("baseline_tf") or base_line.get("baseline_tf"))
    rec.tf_error = base_line.get("tf_error")
    rec.spec = GenerationResult.from_json(line["spec"]) if line.get("spec") else None
    rec.spec_tf = _scores(line.get("spec_tf"))
    rec.spec_tf_error = line.get("spec_tf_error")
    rec.verdict = Verdict.from_json(line["verdict"]) if line.get("verdict") else None
    if rec.verdict is not None:  # not journalled: the journal holds the scores themselves
        rec.verdict.later_scored = rec.spec_tf is not None
    if line.get("prompt_ids") is not None and line.get("max_new_tokens"):
        stops = tuple(journal.header.get("stop_token_ids", ()))
        rec.request = GenerationRequest(pid, list(line["prompt_ids"]), int(line["max_new_tokens"]), stops)
    return rec


def load_run(path: str | Path, journal: Journal | None = None) -> GateRun:
    """Rebuild the :class:`GateRun` a journal records: records, threshold, coverage, timings,
    counters and how the run ended — enough for every report and for :func:`specparity.gate.decision.decide`.
    ``journal``: that journal already read (:func:`read_journal`), so it is not read twice."""
    journal = journal if journal is not None else read_journal(path)
    head = journal.header
    try:
        config = GateConfig.from_json(head.get("config", {}))
        fingerprint = Fingerprint.from_json(head["fingerprint"]) if head.get("fingerprint") else None
    except (KeyError, TypeError, ValueError) as exc:
        raise JournalError(f"{journal.path}:1: run line: unreadable config or fingerprint ({exc})") from None
    run = GateRun(fingerprint=fingerprint, config=config, records=[])
    run.scorer = head.get("scorer", "")
    run.concurrency = int(head.get("concurrency", 1))
    RunState.from_journal(head, journal.last.get(COUNTERS_KIND)).apply(run)
    run.attachments = [tuple(a) for a in head.get("attachments", [])]
    run.calibrated_apart = bool(head.get("calibrated_apart", False))
    run.calibration_reused = list(head.get("calibration_reused", []))
    for pid in journal.order:
        line = journal.judged.get(pid)
        rec = judged_record(journal, line) if line else baseline_record(journal, pid, journal.baselines[pid])
        run.records.append(rec)
        if rec.spec is not None:
            run.coverage.add(rec.spec.spec)
    run.calibration_records = [baseline_record(journal, pid, line) for pid, line in journal.calibration.items()
                               if pid not in journal.order]
    for rec in (*run.records, *run.calibration_records):
        rec.cross_tf = _scores((journal.cross_instance.get(rec.prompt.id) or {}).get("scores"))
    for rec in run.records:
        line = journal.replays.get(rec.prompt.id)
        rec.replay = Replay.from_json(line) if line is not None and rec.verdict is not None else None
    if "threshold" in journal.last and journal.last["threshold"].get("nats") is not None:
        run.threshold = NearTieThreshold.from_json(journal.last["threshold"])
        run.scorer_check = journal.last["threshold"].get("scorer_check")
        run.calibration_spot = journal.last["threshold"].get("spot")
    if "calibration_refused" in journal.segment_kinds:
        run.calibration_error = journal.last["calibration_refused"]["error"]
        run.scorer_check = journal.last["calibration_refused"].get("scorer_check")
        run.calibration_spot = journal.last["calibration_refused"].get("spot")
    run.timings.update(journal.timings)
    run.interrupted = "interrupted" in journal.segment_kinds
    if "fatal" in journal.segment_kinds:
        run.fatal = journal.last["fatal"]["error"]
    golden = journal.last.get("golden")
    if golden is not None and golden.get("error") and "golden" in journal.segment_kinds:
        run.golden_error = golden["error"]
    run.golden_notes = list(dict.fromkeys(journal.golden_notes))
    run.resumed_baselines = int(head.get("resumed_baselines", 0))
    run.resumed_verdicts = int(head.get("resumed_verdicts", 0))
    run.wire = dict(head.get("wire") or {})
    run.fleet_notes = list(head.get("fleet_notes") or [])
    return run
