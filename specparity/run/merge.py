"""``specparity merge``: the journals of a sharded run made into the run's one journal, verdict and reports.

Each shard (``--shard I/N``) judged its share of the prompts with a threshold measured on its share of
the noise. The run's threshold is the one a single unsharded run would measure: on every calibration
baseline of every shard, with :func:`specparity.judge.calibration.calibrate` (the same call the runner
makes), from the rows the journals hold exactly (:func:`specparity.model.types.exact_floats`). Every
prompt is then judged again under it with the runner's own classification
(:func:`specparity.run.runner.judge_prompt`) — unless its shard's threshold and drift bound were already
the run's, when its verdict is kept as it was — so the merged verdict is, prompt by prompt, the one an
unsharded run on the same engines reaches.

Journals that do not belong together are refused before anything is judged, each problem on its own
line (:class:`MergeRefused`, exit 4): a shard missing or given twice, a prompt in two journals, shards
split from different prompt lists or by another hash, a different engine fingerprint or run
configuration. A shard that stopped early (killed, interrupted) is no refusal: its unfinished prompts are
``error`` verdicts naming why, never dropped.

A ``retry`` part (the Ray face's rerun, on another server pair, of what a lost pair left unfinished)
takes over the prompts it lists from its shard's own journal.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.judge.baseline_checks import baseline_refusal
from specparity.judge.calibration import Sample
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS, GateRun, PromptRecord
from specparity.model.prompts import Prompt
from specparity.model.run_state import RunState
from specparity.model.shards import ShardPlan, shard_of
from specparity.model.threshold import NearTieThreshold
from specparity.model.types import Fingerprint, GenerationRequest, TokenScores
from specparity.model.verdicts import Verdict
from specparity.run.golden import VOLATILE_EXTRA, describe_difference
from specparity.run.journal import JOURNAL, RESULTS_SCHEMA, Journal, JournalError, load_run, read_journal
from specparity.run.calibrating import calibrate_run, calibration_measured, cross_failure_note
from specparity.run.runner import ResultsWriter, judge_prompt

#: Run settings every shard must share (else their prompts answer other requests, or their noise is
#: another measurement), with the flag that sets each.
SHARED_CONFIG = {"max_new_tokens": "--max-new-tokens", "top_k": "--top-k", "near_tie_nats": "--near-tie-nats",
                 "near_tie_ceiling": "--near-tie-ceiling", "scorer": "--scorer", "force_reject": "--force-reject",
                 "golden_mode": "--golden-mode", "policy": "the gate policy (--policy and its flags)"}


class MergeRefused(ValueError):
    """Journals that cannot be merged; ``problems`` holds one line per problem (the message: all of them)."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


@dataclass
class Part:
    """One shard journal: where it is, what it holds, what it was given."""

    path: Path
    journal: Journal
    run: GateRun
    plan: ShardPlan
    #: Seconds reading the journal took (part of the merge's time).
    read_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{'retry of ' if self.plan.part == 'retry' else ''}shard {self.plan.shard.label} ({self.path.parent})"


@dataclass
class MergedRun:
    """The merged run and what went into it."""

    run: GateRun
    parts: list[Part]
    #: Prompts re-judged under the run's threshold (their shard's differed), and kept as judged.
    rejudged: int = 0
    kept: int = 0
    notes: list[str] = field(default_factory=list)


def read_part(path: str | Path) -> Part:
    """One shard's report directory (or its ``results.jsonl``); :class:`MergeRefused` with one line when it
    is none."""
    t0 = time.perf_counter()
    p = Path(path)
    journal_path = p / JOURNAL if p.is_dir() else p
    if not journal_path.is_file():
        raise MergeRefused([f"{path}: no {JOURNAL} there (expected the --report directory of a `specparity run "
                            f"--shard I/N`)"])
    try:
        journal = read_journal(journal_path)
        run = load_run(journal_path, journal)
    except JournalError as exc:
        raise MergeRefused([f"{path}: {exc}"]) from None
    line = journal.last.get("shard")
    if line is None:
        raise MergeRefused([f"{path}: not a shard's journal (no --shard I/N): a whole run needs no merge"])
    try:
        plan = ShardPlan.from_json(line)
    except (KeyError, TypeError, ValueError) as exc:
        raise MergeRefused([f"{journal_path}: shard line: missing or malformed field {exc}"]) from None
    return Part(journal_path, journal, run, plan, time.perf_counter() - t0)


def merge_key(fp: Fingerprint | None) -> dict[str, Any]:
    """What must be equal for two shards to be one run: the engine, its version, the target's and the
    draft's content, dtype, speculative settings and the numerics in ``extra`` — never where the
    servers listened or the model files lay on each machine."""
    if fp is None:
        return {}
    return {"engine": fp.engine, "engine_version": fp.engine_version,
            "target": {"sha256": fp.target.sha256, "kind": fp.target.kind},
            "draft": {"sha256": fp.draft.sha256, "kind": fp.draft.kind} if fp.draft else None,
            "dtype": fp.dtype, "spec_config": fp.spec_config,
            "extra": {k: v for k, v in sorted(fp.extra.items()) if k not in VOLATILE_EXTRA}}


def check_parts(parts: Sequence[Part]) -> dict[str, Part]:
    """Refuse parts that are not one run (:class:`MergeRefused`, every problem found); returns each
    selected and calibration prompt id's owner: the part whose lines count for it."""
    problems: list[str] = []
    first = parts[0]
    base = first.plan
    for part in parts[1:]:
        plan = part.plan
        if plan.hash != base.hash or plan.shard.count != base.shard.count:
            problems.append(f"{part.name}: split into {plan.shard.count} shards by {plan.hash}, {first.name} into "
                            f"{base.shard.count} by {base.hash}: not shards of one run")
        elif plan.prompts != base.prompts or plan.calibration != base.calibration:
            problems.append(f"{part.name}: split from another list of prompts than {first.name} ({len(plan.prompts)} "
                            f"selected, {len(plan.calibration or [])} calibration prompt(s) there, {len(base.prompts)} "
                            f"and {len(base.calibration or [])} here): shards of one run are given the same prompt "
                            "files and options")
        diff = describe_difference(merge_key(first.run.fingerprint), merge_key(part.run.fingerprint))
        if diff != "no difference":
            problems.append(f"{part.name}: engine fingerprint differs from {first.name}'s ({diff}): its prompts ran on "
                            "another engine, model or speculative configuration")
        old, new = first.run.config.to_json(), part.run.config.to_json()
        for key, flag in SHARED_CONFIG.items():
            if old.get(key) != new.get(key):
                problems.append(f"{part.name}: {flag} differs from {first.name}'s ({new.get(key)!r} there, "
                                f"{old.get(key)!r} in {first.name})")
    owners: dict[str, Part] = {}
    mains: dict[int, Part] = {}
    for part in parts:
        if part.plan.part == "shard":
            if part.plan.shard.index in mains:
                problems.append(f"shard {part.plan.shard.label} given twice: {mains[part.plan.shard.index].path.parent} "
                                f"and {part.path.parent}")
                continue
            mains[part.plan.shard.index] = part
    for part in parts:  # a shard's own part first, its retry then takes over what it lists
        if part.plan.part != "shard" or mains.get(part.plan.shard.index) is not part:
            continue
        for pid in dict.fromkeys(part.plan.runs + part.plan.calibrates):
            owners[pid] = part
    taken: dict[str, Part] = {}
    for part in parts:
        if part.plan.part != "retry":
            continue
        for pid in dict.fromkeys(part.plan.runs + part.plan.calibrates):
            if not part.plan.shard.holds(pid):
                problems.append(f"{part.name}: prompt {pid} is not of shard {part.plan.shard.label}")
            elif pid in taken:
                problems.append(f"prompt {pid} is in two journals: {taken[pid].path.parent} and {part.path.parent}")
            taken[pid] = owners[pid] = part
    wanted = list(dict.fromkeys(base.prompts + (base.calibration or [])))
    missing = [pid for pid in wanted if pid not in owners]
    if missing and not problems:
        by_shard: dict[int, list[str]] = defaultdict(list)
        for pid in missing:
            by_shard[shard_of(pid, base.shard.count)].append(pid)
        for index, ids in sorted(by_shard.items()):
            selected = sum(pid in set(base.prompts) for pid in ids)
            problems.append(f"missing shard {index}/{base.shard.count}: no journal of it was given ({selected} selected "
                            f"and {len(ids) - selected} calibration-only prompt(s), first {ids[0]})")
    if problems:
        raise MergeRefused(problems)
    return owners


def keep_crash_errors(parts: Sequence[Part], owners: dict[str, Part]) -> dict[str, Part]:
    """Give back to its shard's own journal every prompt that journal judged ``error`` and that a ``keep_errors``
    retry reran (the pair was lost because one of its servers exited): the crash stays the prompt's verdict.
    Returns those prompts with the retry part whose result is shown beside the error."""
    mains = {p.plan.shard.index: p for p in parts if p.plan.part == "shard"}
    beside: dict[str, Part] = {}
    for part in parts:
        own = mains.get(part.plan.shard.index)
        if part.plan.part != "retry" or not part.plan.keep_errors or own is None:
            continue
        for pid in part.plan.runs:
            verdict = (own.journal.judged.get(pid) or {}).get("verdict") or {}
            if verdict.get("class") == "error":
                owners[pid] = own
                beside[pid] = part
    return beside


def _show_reruns(run: GateRun, beside: dict[str, Part], notes: list[str]) -> None:
    """Each kept crash error names what the rerun on another pair made of the prompt."""
    for rec in run.records:
        retry = beside.get(rec.prompt.id)
        if retry is None or rec.verdict is None:
            continue
        line = retry.journal.judged.get(rec.prompt.id) or {}
        rerun = (line.get("verdict") or {}).get("class", "not finished")
        rec.verdict.reason += (f" [kept: {retry.plan.cause or 'a server of its pair exited'}; rerun on another server "
                               f"pair ({retry.path.parent}): {rerun}]")
    if beside:
        notes.append(f"{len(beside)} prompt(s) keep the error of a pair lost to a server that exited, the rerun's "
                     f"class shown beside each: {', '.join(beside)}")


def _main(parts: Sequence[Part]) -> Part:
    """The part whose run line speaks for the run: the first shard's own journal (a retry's otherwise)."""
    return next((p for p in parts if p.plan.part == "shard"), parts[0])


def _decoder(tokenizer: str | None, fp: Fingerprint | None, config_engine: dict[str, Any] | None) -> Callable[[Any], str]:
    """Token text for the reports: ``--tokenizer``, else the engine's tokenizer or target directory when it
    is on this machine; else the ids themselves (``⟨id⟩``): the classes never depend on text."""
    from specparity.engines.common import load_tokenizer

    options = (config_engine or {}).get("options") or {}
    candidates = [tokenizer, (options.get("extra") or {}).get("tokenizer"), options.get("target"),
                  fp.target.path if fp is not None else None]
    for path in candidates:
        if path and Path(path).is_dir():
            try:
                tok = load_tokenizer(path)
            except Exception:  # noqa: BLE001 - not a tokenizer directory: try the next
                continue
            return lambda ids: tok.decode(list(ids))
    return lambda ids: "".join(f"⟨{int(i)}⟩" for i in ids)


def _unfinished(part: Part, pid: str, prompt: Prompt) -> Verdict:
    """The verdict of a prompt its journal never finished: an error naming how that journal ended."""
    run = part.run
    how = ("was interrupted" if run.interrupted else "stopped on an error" if run.fatal else
           "ended before it" if "verdict" in part.journal.segment_kinds else "was killed or lost before it finished")
    fix = "rerun that shard with --resume" if part.plan.part == "shard" else "rerun the shard"
    return Verdict(pid, prompt.category, "error", f"not finished: {part.name} {how} ({fix})")


def _request(rec: PromptRecord, run: GateRun, stops: tuple[int, ...]) -> None:
    """A request for a record that lacks one (calibration-only prompts journal none): the token limit and
    stop set the stop-rule and greedy checks read."""
    if rec.request is None:
        limit = run.config.max_new_tokens or rec.prompt.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        rec.request = GenerationRequest(rec.prompt.id, [], limit, stops)


def merge_parts(parts: Sequence[Part], out: str | None, *, tokenizer: str | None = None) -> MergedRun:
    """Merge ``parts`` (checked: :func:`check_parts`) into one run whose journal is written to ``out``
    (None: nothing written). The verdict line and the reports are written by the caller
    (:func:`specparity.run.runner.conclude`)."""
    t0 = time.perf_counter()
    owners = check_parts(parts)
    beside = keep_crash_errors(parts, owners)
    first = _main(parts)
    plan = first.plan
    config = dataclasses.replace(first.run.config, shard=None, report_dir=out, resume=False)
    run = GateRun(fingerprint=first.run.fingerprint, config=config, records=[], scorer=first.run.scorer)
    run.concurrency = first.run.concurrency
    run.calibrated_apart = first.run.calibrated_apart
    run.attachments = [(f"{label} (shard {p.plan.shard.label}{', retry' if p.plan.part == 'retry' else ''})", path)
                       for p in parts for label, path in p.run.attachments]
    stops = tuple(int(t) for t in first.journal.header.get("stop_token_ids", ()))
    merged = MergedRun(run, list(parts))

    by_part = {id(p): ({r.prompt.id: r for r in p.run.records}, {r.prompt.id: r for r in p.run.calibration_records})
               for p in parts}
    selected = set(plan.prompts)
    for pid in plan.prompts:
        part = owners[pid]
        rec = by_part[id(part)][0].get(pid)
        if rec is None:
            rec = PromptRecord(Prompt(pid, "unknown", "unknown", prompt="", source=str(part.path)))
        if rec.verdict is None:
            rec.verdict = _unfinished(part, pid, rec.prompt)
            rec.spec = None
        run.records.append(rec)
    reused = set()
    for part in parts:
        reused |= {pid for pid in part.run.calibration_reused if owners.get(pid) is part}
    run.calibration_reused = [pid for pid in plan.prompts if pid in reused]
    for pid in plan.calibration or []:
        if pid in selected:
            continue
        part = owners[pid]
        rec = by_part[id(part)][1].get(pid)
        if rec is not None:
            run.calibration_records.append(rec)
        else:
            merged.notes.append(f"calibration prompt {pid}: not measured ({part.name} ended before it)")
    for rec in run.records + run.calibration_records:
        _request(rec, run, stops)

    _recalibrate(run, parts, owners, merged)
    decode = _decoder(tokenizer, run.fingerprint, config.engine)
    if run.threshold is not None and run.calibration_error is None:
        refusal = baseline_refusal(run.records + run.calibration_records, run.threshold.nats, decode)
        refusal = refusal or next((p.journal.last["calibration_refused"]["error"] for p in parts
                                   if p.journal.last.get("calibration_refused", {}).get("check") == "constraint"), None)
        if refusal is not None:
            run.calibration_error = refusal
    if run.calibration_error is not None:
        for rec in run.records:
            if rec.verdict is None or rec.verdict.klass != "error":
                rec.verdict = Verdict(rec.prompt.id, rec.prompt.category, "error", f"not judged: {run.calibration_error}")
    else:
        _rejudge(run, parts, owners, stops, decode, merged)
    _show_reruns(run, beside, merged.notes)
    for rec in run.records:
        if rec.spec is not None:
            run.coverage.add(rec.spec.spec)
    retried = {p.plan.shard.index for p in parts if p.plan.part == "retry"}
    state, notes = RunState.merge([(p.name, RunState.of(p.run)) for p in parts],
                                  excused=frozenset(p.name for p in parts
                                                    if p.plan.part == "shard" and p.plan.shard.index in retried))
    state.apply(run)
    merged.notes += notes
    _timings(run, parts)
    _wire(run, parts, owners)
    shards = sorted({p.plan.shard.index for p in parts})
    retries = [p for p in parts if p.plan.part == "retry"]
    run.fleet_notes = [f"merged from {len(parts)} journal(s) of {plan.shard.count} shard(s) ({', '.join(str(i) for i in shards)})"
                       + (f", {len(retries)} of them rerun(s) on another server pair after a pair was lost" if retries else "")
                       + f": {len(plan.prompts)} selected prompt(s); the threshold is measured on every shard's noise; "
                       f"{merged.rejudged} prompt(s) judged again under it, {merged.kept} kept as their shard judged them"]
    run.fleet_notes += merged.notes
    started = t0 - sum(p.read_s for p in parts)
    if out:
        _write_journal(run, parts, owners, out, started)
    else:
        run.timings["merge"] = time.perf_counter() - started
    return merged


def _samples(run: GateRun, parts: Sequence[Part], owners: dict[str, Part]) -> tuple[list[Sample], str]:
    """The calibration samples of the merged run, as the runner's ``_calibrate`` takes them, with the
    cross-instance scores the shards journalled, and the note on what those lack."""
    measured = calibration_measured(run)
    cross_lines = {pid: line for p in parts for pid, line in p.journal.cross_instance.items() if owners.get(pid) is p}
    samples, failed = [], []
    for r in measured:
        line = cross_lines.get(r.prompt.id)
        other = TokenScores.from_json(line["scores"]) if line is not None and line.get("scores") is not None else None
        if line is not None and line.get("scores") is None:
            failed.append(f"{r.prompt.id}: {line.get('error')}")
        r.cross_tf = other
        samples.append(Sample(r.prompt.id, r.baseline.output_ids, r.baseline.scores, r.baseline_tf, other))
    if cross_lines:
        note = cross_failure_note(failed, len(measured))
    else:  # an engine that scores nothing on the speculative server says why, the same in every shard
        note = next((p.journal.last["threshold"].get("cross_instance_note", "") for p in parts
                     if p.journal.last.get("threshold")), "")
    return samples, note


def _recalibrate(run: GateRun, parts: Sequence[Part], owners: dict[str, Part], merged: MergedRun) -> None:
    config = run.config
    samples, note = _samples(run, parts, owners)
    if not samples and config.near_tie_nats is None:
        run.calibration_error = "no baseline could be decoded and scored in any shard, so no noise was measured"
        return
    calibrate_run(run, samples, note)


def _same_threshold(a: NearTieThreshold | None, b: NearTieThreshold) -> bool:
    return a is not None and a.nats == b.nats and a.drift_nats == b.drift_nats


def _rejudge(run: GateRun, parts: Sequence[Part], owners: dict[str, Part], stops: tuple[int, ...],
             decode: Callable[[Any], str], merged: MergedRun) -> None:
    """Every prompt its shard judged, under the run's threshold: kept where its shard's threshold and drift
    bound were the run's, else judged again (a recorded constraint check applied as it was)."""
    assert run.threshold is not None
    for rec in run.records:
        part = owners[rec.prompt.id]
        if rec.spec is None or rec.baseline is None:
            continue  # an error before any comparison: nothing the threshold changes
        if _same_threshold(part.run.threshold, run.threshold):
            merged.kept += 1
            continue
        recorded = rec.verdict.constraint if rec.verdict is not None else None
        rec.verdict = judge_prompt(rec, run.threshold, stops, decode, constraint=recorded)
        rec.verdict.later_scored = rec.spec_tf is not None
        merged.rejudged += 1


def _timings(run: GateRun, parts: Sequence[Part]) -> None:
    """Seconds spent: summed over the shards, except wall-clock spans (``total``, ``*_wall``), whose
    longest is the run's (the shards ran side by side)."""
    for part in parts:
        for key, value in part.run.timings.items():
            if key == "total" or key.endswith("_wall"):
                run.timings[key] = max(run.timings[key], value)
            else:
                run.timings[key] += value


def _wire(run: GateRun, parts: Sequence[Part], owners: dict[str, Part]) -> None:
    """Which servers each prompt was sent to: every shard's, and the shard of each prompt (reproducers)."""
    wires = [p.run.wire for p in parts]
    if all(w == wires[0] for w in wires):
        run.wire = dict(wires[0])
        return
    index = {id(p): i for i, p in enumerate(parts)}
    run.wire = {"parts": wires, "part_of": {pid: index[id(p)] for pid, p in owners.items()}}


def _write_journal(run: GateRun, parts: Sequence[Part], owners: dict[str, Part], out: str, started: float) -> None:
    """The merged journal: the run line, then each prompt's lines as its shard wrote them (baseline,
    calibration, cross-instance), the run's threshold, each prompt's verdict, the counters and timings
    (``merge``: the seconds since ``started``, reading the shards' journals included)."""
    head = _main(parts).journal.header
    writer = ResultsWriter(out, mode="new")
    try:
        writer.write({"kind": "run", "schema": RESULTS_SCHEMA,
                      "fingerprint": run.fingerprint.to_json() if run.fingerprint else None,
                      "config": run.config.to_json(), "scorer": run.scorer, "concurrency": run.concurrency,
                      **RunState.of(run).run_line(head.get("capabilities")), "attachments": run.attachments,
                      "stop_token_ids": head.get("stop_token_ids", []), "calibrated_apart": run.calibrated_apart,
                      "calibration_reused": run.calibration_reused, "resumed_baselines": 0, "resumed_verdicts": 0,
                      "wire": run.wire, "fleet_notes": run.fleet_notes,
                      "merged_from": [{"path": str(p.path), "shard": p.plan.shard.to_json(), "part": p.plan.part}
                                      for p in parts]})
        for rec in run.records + run.calibration_records:
            part = owners[rec.prompt.id]
            line = part.journal.baselines.get(rec.prompt.id) or part.journal.calibration.get(rec.prompt.id)
            if line is not None:
                writer.write(line)
        for rec in run.records + run.calibration_records:
            line = owners[rec.prompt.id].journal.cross_instance.get(rec.prompt.id)
            if line is not None:
                writer.write(line)
        if run.threshold is not None and run.calibration_error is None:
            writer.write({"kind": "threshold", **run.threshold.to_json(), "scorer_check": run.scorer_check,
                          "spot": run.calibration_spot})
        else:
            writer.write({"kind": "calibration_refused", "error": run.calibration_error, "scorer_check": run.scorer_check,
                          "spot": run.calibration_spot})
        for rec in run.records:
            writer.write(rec.to_json())
        for rec in run.records:
            line = owners[rec.prompt.id].journal.replays.get(rec.prompt.id)
            if line is not None:
                writer.write(line)
        counters = RunState.of(run).counters_line()
        if counters is not None:
            writer.write(counters)
        run.timings["merge"] = time.perf_counter() - started
        writer.write({"kind": "timings", "timings": {k: round(v, 6) for k, v in run.timings.items()}})
    finally:
        writer.close()


def merge_dirs(dirs: Sequence[str], out: str | None, *, tokenizer: str | None = None) -> MergedRun:
    """Read every shard's report directory and merge them (:class:`MergeRefused` lists every unreadable
    one, or every problem of the set)."""
    return merge_parts(read_parts(dirs), out, tokenizer=tokenizer)


def read_parts(dirs: Sequence[str]) -> list[Part]:
    """Every shard's journal (:class:`MergeRefused` listing each directory that holds none)."""
    parts, problems = [], []
    for d in dirs:
        try:
            parts.append(read_part(d))
        except MergeRefused as exc:
            problems += exc.problems
    if problems:
        raise MergeRefused(problems)
    if not parts:
        raise MergeRefused(["no shard journal given: name every shard's --report directory"])
    return parts
