"""Runs a prompt suite through an engine and classifies every prompt.

Two phases, so the near-tie threshold is fixed before any speculative output is seen:

1. every prompt greedily without speculation, then teacher-forced scoring of the same tokens —
   the difference is the target's own numeric noise, from which the threshold (and the drift
   bound) is derived. The noise is measured on a calibration set that does not depend on which
   prompts were selected (by default every prompt of the prompt files: the unselected ones run a
   baseline only), and the scorer is checked against the baselines before it judges anything
   (:mod:`specparity.judge.calibration`); a scorer that fails, or a threshold above its ceiling, stops
   the run before phase 2;
2. every prompt with speculation, teacher-forced scoring of the speculative output under its own
   prefix, and the comparison.

Each finished prompt is written to ``results.jsonl`` at once, so a later failure (an engine
crash, a dead server) never loses finished results, and ``--resume`` continues from it
(:mod:`specparity.run.journal`). With a golden (:mod:`specparity.run.golden`) phase 1 reads the baselines
from it instead of running them (``--update-golden`` runs them and records them); with
``--golden-mode baseline`` phase 2 runs a new baseline, not the speculative decoder.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from functools import partial
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator, Sequence, TypeVar

from specparity.judge.calibration import Sample
from specparity.judge.baseline_checks import baseline_refusal
from specparity.judge.compare import compare, finish_problem, first_mismatch
from specparity.model.verdicts import Verdict
from specparity.engines.base import Engine, capabilities_of
from specparity.gate.decision import GateDecision, decide
from specparity.run.calibrating import calibrate_run, calibration_measured, cross_failure_note
from specparity.run.golden import Golden, GoldenError, Recorded, baseline_fields, baseline_key, describe_difference, write_golden
from specparity.run.journal import JOURNAL, RESULTS_SCHEMA, Journal, baseline_record, judged_record
from specparity.judge.logprob_channel import stream_problem
from specparity.model.prompts import Prompt
from specparity.model.shards import ShardPlan
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS, GateConfig, GateRun, PromptRecord
from specparity.model.replay import MAX_REPLAYED_PROMPTS, REPLAYED, Replay
from specparity.model.run_state import DECLARATIONS, RunState
from specparity.model.threshold import NearTieThreshold
from specparity.report.render import DERIVED_FILES, write_reports
from specparity.report.reproducers import REPRODUCERS
from specparity.run.scoring import Scorer, choose_scorer
from specparity.judge.structured import apply_constraint_checks, hide_forced_rows, judge_constraint, unconstrained_baselines
from specparity.judge.traffic import unattributed
from specparity.model.traffic import Traffic
from specparity.model.types import GenerationRequest, GenerationResult, SpecStats, TokenScores

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["JOURNAL", "RESULTS_SCHEMA", "GateInterrupted", "ResultsWriter", "run_gate", "conclude", "request_for"]


class GateInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: carries the partial run so the face can conclude it before exiting."""

    def __init__(self, run: GateRun):
        super().__init__("interrupted")
        self.run = run


class ResultsWriter:
    """Appends one JSON line per finished unit of work and flushes it immediately.

    Opening it for a new run (``mode`` "new") truncates the journal; for a resumed one ("resume")
    it appends. Both remove every file derived from a previous run (``summary.md`` …): a report
    directory never shows a verdict that is not this run's, even when this run is killed before it
    writes its own. "append" only appends (the final verdict line).
    """

    def __init__(self, report_dir: str | None, *, mode: str = "new"):
        self._fh: IO[str] | None = None
        if report_dir:
            out = Path(report_dir)
            out.mkdir(parents=True, exist_ok=True)
            if mode != "append":
                for name in DERIVED_FILES:
                    (out / name).unlink(missing_ok=True)
                shutil.rmtree(out / REPRODUCERS, ignore_errors=True)
            self._fh = open(out / JOURNAL, "w" if mode == "new" else "a", encoding="utf-8")

    def write(self, obj: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _timed(timings: dict[str, float], key: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        timings[key] += time.perf_counter() - t0


def request_for(engine: Engine, p: Prompt, config: GateConfig, stop_ids: tuple[int, ...]) -> GenerationRequest:
    """The request a run sends for ``p``: its encoding, ``--max-new-tokens`` or the prompt's own limit
    (else the default), the engine's stop tokens, ``--top-k``. Raises when encoding fails."""
    ids = engine.encode_prompt(p.prompt, p.messages_as_dicts())
    max_new = config.max_new_tokens or p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    return GenerationRequest(p.id, ids, max_new, stop_ids, config.top_k, constraint=p.constraint)


def _generate_one(engine: Engine, req: GenerationRequest, speculative: bool) -> GenerationResult:
    """An engine that raises instead of returning ``failed`` still yields a result for this prompt;
    one that breaks the protocol's row contract gets this prompt's error, naming what it broke."""
    try:
        results = engine.generate([req], speculative=speculative)
        if len(results) != 1:
            return GenerationResult.failed(req.request_id, f"engine returned {len(results)} results for 1 request")
        result = results[0]
    except Exception as exc:  # noqa: BLE001
        return GenerationResult.failed(req.request_id, f"{type(exc).__name__}: {exc}")
    if not result.error:
        result.error = finish_problem(result) or rows_problem(
            result.scores, len(result.output_ids), req.top_k, "per-position logprobs")
    return result


def rows_problem(scores: TokenScores, n: int, top_k: int, what: str) -> str | None:
    """Why ``scores`` cannot serve as ``n`` rows of ``top_k`` alternatives (None: they can).

    Fewer alternatives than asked would make every "outside the top-k" verdict a guess. A reported
    row with a NaN or ±inf logprob is a numeric failure, never an unreported row: the comparison
    skips non-finite numbers, so such rows would otherwise pass unseen (the protocol's unreported
    row — ``top_ids`` all −1 — stays allowed, :meth:`TokenScores.unreported_positions`). Rows that are
    not log-probabilities at all (:func:`specparity.judge.logprob_channel.stream_problem`) are refused too."""
    if len(scores) != n:
        return f"the engine returned {len(scores)} rows of {what} for {n} tokens"
    if n and scores.k < top_k:
        return (f"the engine returned {scores.k} alternatives per position in its {what}, fewer than the "
                f"--top-k {top_k} asked")
    bad = scores.nonfinite_positions()
    if bad.size:
        shown = ", ".join(str(int(i)) for i in bad[:10]) + (", …" if bad.size > 10 else "")
        return (f"numeric failure: {bad.size} row(s) of {what} with a NaN or infinite logprob although the engine "
                f"reported them (real top_ids), at position(s) {shown}")
    return stream_problem(scores, what)


def _score(scorer: Scorer, req: GenerationRequest, result: GenerationResult) -> tuple[TokenScores | None, str | None]:
    if result.error:
        return None, None
    try:
        scores = scorer.score(list(req.prompt_ids), result.output_ids, req.top_k)
    except Exception as exc:  # noqa: BLE001
        return None, f"teacher-forced scoring failed: {type(exc).__name__}: {exc}"
    problem = rows_problem(scores, len(result.output_ids), req.top_k, "teacher-forced scores")
    return (None, f"teacher-forced scoring failed: {problem}") if problem else (scores, None)


Decoded = tuple[GenerationResult, TokenScores | None, str | None, float, float]


def _decode_and_score(engine: Engine, scorer: Scorer, speculative: bool, rec: PromptRecord) -> Decoded:
    """One request and its teacher-forced scores: (result, scores, scoring error, decode s, scoring s).

    A speculative output identical to the baseline reuses the baseline's scores: the same tokens
    under the same prefix score the same."""
    t0 = time.perf_counter()
    result = _generate_one(engine, rec.request, speculative)
    t1 = time.perf_counter()
    if (not result.error and rec.baseline_tf is not None and rec.baseline_from != "golden"
            and result.output_ids == rec.baseline.output_ids):
        tf, err = rec.baseline_tf, None
    else:
        tf, err = _score(scorer, rec.request, result)
    if rec.request.constraint is not None:  # rows the constraint, not the argmax, chose: not judged on
        result.scores = hide_forced_rows(result.scores)
        tf = hide_forced_rows(tf) if tf is not None else None
    return result, tf, err, t1 - t0, time.perf_counter() - t1


def dispatch(items: Iterable[T], work: Callable[[T], R], concurrency: int) -> Iterator[tuple[T, R]]:
    """Run ``work`` on every item with at most ``concurrency`` in flight; yield (item, result) in
    completion order. ``work`` must not raise. With ``concurrency`` 1 it runs inline (in-process
    engines: no threads). On Ctrl-C nothing new starts; requests in flight end by their timeouts."""
    if concurrency <= 1:
        for item in items:
            yield item, work(item)
        return
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="specparity")
    try:
        futures = {pool.submit(work, item): item for item in items}
        for fut in as_completed(futures):
            yield futures[fut], fut.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def run_gate(
    engine: Engine,
    prompts: Sequence[Prompt],
    config: GateConfig,
    *,
    calibration: Sequence[Prompt] | None = None,
    progress: Callable[[str], None] | None = None,
    golden: Golden | None = None,
    resume: Journal | None = None,
    baselines_only: bool = False,
    plan: ShardPlan | None = None,
) -> GateRun:
    """Run both phases over ``prompts``; never raises for a per-prompt failure.

    ``calibration``: the prompts the noise is measured on (the selected ones among them are
    reused, the others run a baseline only); None measures on ``prompts`` themselves, so the
    threshold then depends on the selection, and the summary says so.

    ``golden``: the golden named by ``config.golden`` (None: none recorded there yet). ``resume``:
    the journal of an interrupted run of the same engine and prompts (``config.report_dir``): what
    it finished is kept, the rest runs, and the journal is appended to. ``baselines_only``: stop
    after phase 1 (``specparity record``: the golden is written, nothing is judged).

    Ctrl-C ends the run with :class:`GateInterrupted` (a ``KeyboardInterrupt``) carrying the
    partial run, after the journal has recorded the interruption.

    ``plan``: what a shard of a sharded run was given (``--shard I/N``); journalled on a ``shard``
    line after the ``run`` line, so ``specparity merge`` can check the shards cover the run once.
    """
    say = progress or (lambda _msg: None)
    writer = ResultsWriter(config.report_dir, mode="resume" if resume is not None else "new")
    run = GateRun(fingerprint=None, config=config, records=[PromptRecord(p) for p in prompts])
    if calibration is not None and config.calibration != "selected":
        # a selected prompt's baseline is reused only for the same prompt, not merely the same id
        wanted, chosen = {_content(p) for p in calibration}, {_content(p) for p in prompts}
        run.calibrated_apart = True
        run.calibration_reused = [p.id for p in prompts if _content(p) in wanted]
        run.calibration_records = [PromptRecord(p) for p in calibration if _content(p) not in chosen]
    t_start = time.perf_counter()
    try:
        _run_phases(engine, run, writer, say, golden, resume, baselines_only, plan)
    except KeyboardInterrupt:
        run.interrupted = True
        writer.write({"kind": "interrupted", "finished_prompts": sum(r.verdict is not None for r in run.records)})
        raise GateInterrupted(run) from None
    except Exception as exc:  # noqa: BLE001 - keep what finished, report the rest as not run
        run.fatal = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
        writer.write({"kind": "fatal", "error": run.fatal})
    finally:
        run.timings["total"] = time.perf_counter() - t_start
        writer.write({"kind": "timings", "timings": {k: round(v, 6) for k, v in run.timings.items()}})
        writer.close()
    return run


def _content(p: Prompt) -> tuple[Any, ...]:
    return p.id, p.prompt, p.messages, p.max_new_tokens, p.constraint


def _run_phases(engine: Engine, run: GateRun, writer: ResultsWriter, say: Callable[[str], None],
                golden: Golden | None, resume: Journal | None, baselines_only: bool = False,
                plan: ShardPlan | None = None) -> None:
    config = run.config
    health = getattr(engine, "health", None)
    if callable(health):
        health()
    # read once the servers are ready: what a server still starting cannot say would read as "unknown"
    caps = capabilities_of(engine)
    run.concurrency = max(1, min(config.concurrency or caps.default_concurrency or caps.max_concurrency,
                                 caps.max_concurrency) if caps.max_concurrency > 1 else 1)
    run.fingerprint = engine.fingerprint()
    logs = getattr(engine, "server_logs", None)
    run.attachments = list(logs()) if callable(logs) else []
    skipped = getattr(engine, "skipped_checks", None)
    state = RunState(**{name: getattr(caps, name) for name in DECLARATIONS},
                     skipped_checks=list(skipped()) if callable(skipped) else [])
    state.apply(run)
    wire = getattr(engine, "wire_record", None)
    run.wire = wire() if callable(wire) else {}
    if resume is not None:
        problem = _restore(run, resume)
        if problem:
            run.fatal = problem
            writer.write({"kind": "resume", "schema": RESULTS_SCHEMA, "error": problem})
            writer.write({"kind": "fatal", "error": problem})
            return
    scorer = choose_scorer(engine, config.scorer, config.scorer_model)
    run.scorer = scorer.description
    run.fleet_notes = [plan.describe()] if plan is not None else []
    writer.write({"kind": "resume" if resume is not None else "run", "schema": RESULTS_SCHEMA,
                  "fingerprint": run.fingerprint.to_json(), "config": config.to_json(), "scorer": run.scorer,
                  "concurrency": run.concurrency, **state.run_line(vars(caps)), "attachments": run.attachments,
                  "stop_token_ids": [int(t) for t in engine.stop_token_ids()],
                  "calibrated_apart": run.calibrated_apart, "calibration_reused": run.calibration_reused,
                  "resumed_baselines": run.resumed_baselines, "resumed_verdicts": run.resumed_verdicts,
                  "wire": run.wire, "fleet_notes": run.fleet_notes})
    if plan is not None:
        writer.write({"kind": "shard", **plan.to_json()})
    try:
        if config.golden and not _use_golden(run, golden, writer, say):
            return
        if not _baselines(engine, run, scorer, writer, say):
            return
        if not _check_baselines(run, engine.decode, writer, say):
            return
        if config.update_golden:
            _record_golden(run, golden, writer, say)
        if baselines_only:
            return
        counters_before = _aggregate_counters(engine, caps.counters)
        _speculative(engine, run, scorer, writer, say, golden)
        if config.update_golden and not run.golden_error:
            _record_golden(run, golden, writer, say, acceptance=True)
        if counters_before is not None:
            try:
                counters_after = _aggregate_counters(engine, caps.counters)
                delta = _aggregate_delta(counters_before, counters_after)
            except Exception as exc:  # noqa: BLE001 - the verdicts are written; only the activity is unknown
                run.counters_error = f"{type(exc).__name__}: {exc}"
                writer.write(RunState.of(run).counters_line())
            else:
                # server-wide counters count every client's drafts: this run's only when the servers
                # served this run's requests alone
                problem = unattributed(Traffic.from_json(counters_before.get("traffic")),
                                       Traffic.from_json(counters_after.get("traffic")))
                if problem:
                    run.aggregate_unattributed = problem
                else:
                    run.aggregate = delta
                writer.write(RunState.of(run).counters_line(
                    counted=delta, traffic=[counters_before.get("traffic"), counters_after.get("traffic")]))
        # after the counters: the replays are no part of the judged traffic
        _replay_failures(engine, run, writer, say)
    finally:
        scorer.close()


def _baselines(engine: Engine, run: GateRun, scorer: Scorer, writer: ResultsWriter, say: Callable[[str], None]) -> bool:
    """Phase 1: every prompt without speculation, scored teacher-forced; then the threshold.

    Returns False when no baseline could be measured at all (every one failed or could not be
    scored): each prompt is then an ``error`` with its own cause and there is nothing to compare."""
    config = run.config
    stop_ids = tuple(engine.stop_token_ids())
    for rec in run.records + run.calibration_records:
        p = rec.prompt
        try:
            rec.request = request_for(engine, p, config, stop_ids)
        except Exception as exc:  # noqa: BLE001
            rec.baseline = GenerationResult.failed(p.id, f"encoding the prompt failed: {type(exc).__name__}: {exc}")
        else:
            _check_reused(rec)

    work = partial(_decode_and_score, engine, scorer, False)
    t_phase = time.perf_counter()
    calibration_only = {id(r) for r in run.calibration_records}
    todo = [r for r in run.records + run.calibration_records if r.request and r.baseline is None]
    for rec, (result, tf, err, t_gen, t_tf) in dispatch(todo, work, run.concurrency):
        rec.baseline, rec.baseline_tf, rec.tf_error = result, tf, err
        run.timings["baseline_decode"] += t_gen
        run.timings["tf_scoring"] += t_tf
        writer.write({"kind": "calibration" if id(rec) in calibration_only else "baseline", "prompt_id": rec.prompt.id,
                      "prompt": rec.prompt.to_json(), "baseline": result.to_json(),
                      "baseline_tf": tf.to_json() if tf is not None else None, "tf_error": err})
        say(f"baseline {rec.prompt.id}: {len(result.output_ids)} tokens" + (f" ERROR {result.error}" if result.error else ""))
    run.timings["baseline_phase_wall"] = time.perf_counter() - t_phase
    return _calibrate(run, scorer, writer, say)


def _reuse(rec: PromptRecord, baseline: GenerationResult, tf: TokenScores | None, source: str,
           request: tuple[list[int], int] | None, tf_error: str | None = None) -> None:
    rec.baseline, rec.baseline_tf, rec.tf_error = baseline, tf, tf_error
    rec.baseline_from, rec.reused_request = source, request


def _check_reused(rec: PromptRecord) -> None:
    """A reused baseline (golden, journal) must answer this run's very request: the same prompt ids
    (the engine may tokenize differently since) and the same token limit; else the prompt is an
    error naming what differs, never a comparison of two different requests."""
    if rec.reused_request is None or rec.request is None or rec.baseline is None:
        return
    ids, limit = rec.reused_request
    where = "the golden" if rec.baseline_from == "golden" else "the resumed journal"
    problem = None
    if list(ids) != list(rec.request.prompt_ids):
        problem = (f"the engine encodes this prompt differently from {where} ({len(rec.request.prompt_ids)} ids now, "
                   f"{len(ids)} recorded; first difference at id {first_mismatch(ids, rec.request.prompt_ids)})")
    elif limit != rec.request.max_new_tokens:
        problem = f"{where} holds this prompt's baseline for max_new_tokens {limit}, this run asks {rec.request.max_new_tokens}"
    if problem:
        rec.baseline, rec.baseline_tf = GenerationResult.failed(rec.prompt.id, problem), None


def _restore(run: GateRun, journal: Journal) -> str | None:
    """Take from an interrupted run's journal what it finished: baselines (and calibration
    baselines) of the same prompts, and judged prompts. Returns why it cannot resume (None: it can)."""
    old = journal.header.get("fingerprint")
    if old != run.fingerprint.to_json():
        from specparity.model.types import Fingerprint

        theirs = Fingerprint.from_json(old) if old else None
        diff = describe_difference(baseline_fields(theirs), baseline_fields(run.fingerprint)) if theirs else "none recorded"
        if theirs is not None and diff == "no difference":
            diff = (f"speculative config {theirs.spec_config} → {run.fingerprint.spec_config}, draft "
                    f"{theirs.draft} → {run.fingerprint.draft}")
        return (f"--resume: {journal.path} was written by another engine configuration ({diff}); "
                f"start a new run without --resume")
    unknown = run.fingerprint.unknown_spec_config()
    if unknown:
        return (f"--resume: {journal.path}: the speculative configuration is unknown ({'; '.join(unknown)}), so "
                f"nothing shows that the servers speculate as they did for the interrupted run; start a new run "
                f"without --resume, or gate servers that show their configuration")
    by_id = {r.prompt.id: r for r in run.records + run.calibration_records}
    for pid, line in {**journal.calibration, **journal.baselines}.items():
        rec = by_id.get(pid)
        if rec is None or not line.get("baseline"):
            continue
        old_rec = baseline_record(journal, pid, line)
        if old_rec.prompt.to_json() != rec.prompt.to_json():
            continue  # the same id, another prompt: run it again
        base = old_rec.baseline
        if base.error or (old_rec.baseline_tf is None and not old_rec.tf_error):
            continue  # a failed baseline is retried
        _reuse(rec, base, old_rec.baseline_tf, "journal", None, old_rec.tf_error)
        run.resumed_baselines += 1
    for pid, line in journal.judged.items():
        rec = by_id.get(pid)
        if rec is None or not line.get("verdict") or rec not in run.records:
            continue
        old_rec = judged_record(journal, line)
        if old_rec.prompt.to_json() != rec.prompt.to_json() or old_rec.verdict.klass == "error":
            continue  # an error is retried: the engine or server may have died mid-run
        rec.spec, rec.spec_tf, rec.verdict = old_rec.spec, old_rec.spec_tf, old_rec.verdict
        if rec.baseline is None:
            _reuse(rec, old_rec.baseline, old_rec.baseline_tf, "journal", None)
        run.resumed_verdicts += 1
    return None


def _use_golden(run: GateRun, golden: Golden | None, writer: ResultsWriter, say: Callable[[str], None]) -> bool:
    """Check the golden against this engine and take its baselines. Returns False when the golden
    cannot be used (``run.golden_error``: nothing is judged and the gate fails)."""
    config = run.config
    key, fields_ = baseline_key(run.fingerprint), baseline_fields(run.fingerprint)
    error = None
    if config.update_golden:
        if golden is not None and golden.key != key and config.update_golden != "force":
            error = (f"--update-golden: {golden.path} was recorded under another engine fingerprint "
                     f"({describe_difference(golden.fields, fields_)}); it is not overwritten: pass "
                     f"--update-golden=force to replace it, or name another --golden file")
        elif golden is not None and golden.key == key:
            run.golden_notes.append(f"rewrote {golden.describe()} from this run's baselines")
        else:
            run.golden_notes.append(f"recorded {config.golden} from this run's baselines")
    elif golden is None:
        error = (f"--golden {config.golden}: no golden recorded there (a missing golden is a failure, never a pass); "
                 f"record it with --update-golden")
    elif golden.key != key and config.golden_mode == "spec":
        error = (f"--golden {golden.path}: recorded under another engine fingerprint "
                 f"({describe_difference(golden.fields, fields_)}); a speculative run is compared with a golden of "
                 f"its own baseline: re-record with --update-golden, or judge the engine change with --golden-mode baseline")
    if error:
        run.golden_error = error
        writer.write({"kind": "golden", "path": config.golden, "mode": config.golden_mode, "error": error})
        for rec in run.records:
            rec.verdict = Verdict(rec.prompt.id, rec.prompt.category, "error", f"not judged: {error}")
            writer.write(rec.to_json())
        say(error)
        return False
    if config.update_golden:
        writer.write({"kind": "golden", "path": config.golden, "mode": "update", "notes": run.golden_notes})
        return True
    if config.golden_mode == "baseline":
        change = describe_difference(golden.fields, fields_) if golden.key != key else "the same engine fingerprint"
        run.golden_notes.append(f"new baselines (no speculation) judged against {golden.describe()}: {change}; "
                                f"the noise is measured on the new baselines")
        writer.write({"kind": "golden", "path": config.golden, "mode": config.golden_mode, "notes": run.golden_notes})
        return True
    run.golden_notes.append(f"baselines read from {golden.describe()}")
    missing = []
    for rec in run.records + run.calibration_records:
        if rec.baseline is not None:
            continue  # resumed
        entry = golden.entry_for(rec.prompt)
        if entry is not None:
            _reuse(rec, entry.baseline, entry.tf, "golden", (entry.prompt_ids, entry.max_new_tokens))
        elif rec in run.records:
            missing.append(rec.prompt.id)
            rec.baseline = GenerationResult.failed(
                rec.prompt.id, f"no golden for this prompt in {golden.path} (added or edited since it was recorded: "
                f"record it with --update-golden)")
    if missing:
        run.golden_notes.append(f"{len(missing)} prompt(s) not in the golden (errors): {', '.join(missing)}")
    writer.write({"kind": "golden", "path": config.golden, "mode": config.golden_mode, "notes": run.golden_notes})
    return True


def _record_golden(run: GateRun, golden: Golden | None, writer: ResultsWriter, say: Callable[[str], None],
                   acceptance: bool = False) -> None:
    """``--update-golden``: write this run's measured baselines (selected and calibration prompts);
    with ``acceptance`` (after the speculative phase) again, with each prompt's speculation counters."""
    config = run.config
    done = [Recorded(r.prompt, r.request.prompt_ids, r.request.max_new_tokens, r.baseline, r.baseline_tf,
                     r.request.stop_token_ids,
                     spec=r.spec.spec if acceptance and r.spec is not None and not r.spec.error else None)
            for r in run.records + run.calibration_records
            if r.request is not None and r.baseline is not None and not r.baseline.error and r.baseline_tf is not None]
    keep = golden if golden is not None and golden.key == baseline_key(run.fingerprint) else None
    try:
        n = write_golden(config.golden, run.fingerprint, done, prompt_files=config.prompts, top_k=config.top_k, keep=keep,
                         stop_token_ids=[t for r in done[:1] for t in r.stop_token_ids])
    except (OSError, GoldenError) as exc:
        run.golden_error = f"--update-golden: cannot write {config.golden}: {exc}"
        writer.write({"kind": "golden", "path": config.golden, "error": run.golden_error})
        return
    note = f"wrote {config.golden}: {n} prompt(s), {len(done)} recorded by this run"
    if acceptance:
        counted = sum(1 for r in done if r.spec is not None and r.spec.available)
        note = f"added the speculative run's acceptance of {counted} prompt(s) to {config.golden}"
    run.golden_notes.append(note)
    writer.write({"kind": "golden", "path": config.golden, "mode": "update", "notes": [note]})
    say(note)


def _calibrate(run: GateRun, scorer: Scorer, writer: ResultsWriter, say: Callable[[str], None]) -> bool:
    """Measure the noise on the calibration set, check the scorer, derive the threshold.

    Returns False when nothing can be judged: no baseline could be measured (each prompt is then an
    ``error`` with its own cause), or the calibration was refused (``run.calibration_error``)."""
    config = run.config
    measured = calibration_measured(run)
    if not measured and config.near_tie_nats is None:
        for rec in run.records:
            rec.verdict = _baseline_error(rec)
            writer.write(rec.to_json())
        # nothing can be judged: a harness/engine error (exit 3), not a gate failure; the journal's
        # calibration_refused line keeps that for `specparity report`
        first = next((r.verdict for r in run.records if r.verdict is not None), None)
        run.calibration_error = "no baseline could be decoded and scored, so no noise was measured" + (
            f" (first: {first.prompt_id}: {first.reason})" if first is not None else "")
        writer.write({"kind": "calibration_refused", "error": run.calibration_error, "scorer_check": None})
        return False
    other, cross_note = _score_spec_side(run, scorer, measured, writer)
    samples = [Sample(r.prompt.id, r.baseline.output_ids, r.baseline.scores, r.baseline_tf, other.get(id(r)))
               for r in measured]
    refused = calibrate_run(run, samples, cross_note)
    if refused is not None:
        writer.write({"kind": "calibration_refused", "error": run.calibration_error, "scorer_check": run.scorer_check,
                      "spot": run.calibration_spot})
        for rec in run.records:
            rec.verdict = Verdict(rec.prompt.id, rec.prompt.category, "error", f"not judged: {refused}")
            writer.write(rec.to_json())
        say(f"calibration refused: {refused}")
        return False
    writer.write({"kind": "threshold", **run.threshold.to_json(), "scorer_check": run.scorer_check,
                  "spot": run.calibration_spot})
    say(f"near-tie threshold: {run.threshold.describe()}")
    return True


def _score_spec_side(run: GateRun, scorer: Scorer, measured: Sequence[PromptRecord],
                     writer: ResultsWriter) -> tuple[dict[int, TokenScores], str]:
    """The calibration baselines' tokens scored teacher-forced on the speculative server too (engines
    of two server instances): {id(record): scores}, and a note on what could not be measured ("" when
    everything was). A failure here never judges anything: without the figure the noise is the one
    within the baseline's instance, which is the stricter bound. Each prompt's scores (or why they
    failed) are journalled (``cross_instance``), so the noise can be measured again from the journal
    (``specparity merge``)."""
    if scorer.spec_side is None or not measured:
        return {}, scorer.spec_side_note
    there = Scorer(f"{scorer.description}, on the speculative server", scorer.spec_side)
    got: dict[int, TokenScores] = {}
    failed: list[str] = []
    t0 = time.perf_counter()
    for rec, (scores, err) in dispatch(measured, lambda r: _score(there, r.request, r.baseline), run.concurrency):
        if scores is not None:  # a constrained prompt's rows as its other rows are (hide_forced_rows)
            got[id(rec)] = hide_forced_rows(scores) if rec.request.constraint is not None else scores
            rec.cross_tf = got[id(rec)]
            writer.write({"kind": "cross_instance", "prompt_id": rec.prompt.id, "scores": got[id(rec)].to_json()})
        else:
            failed.append(f"{rec.prompt.id}: {err}")
            writer.write({"kind": "cross_instance", "prompt_id": rec.prompt.id, "error": err})
    run.timings["cross_instance_scoring"] += time.perf_counter() - t0
    return got, cross_failure_note(failed, len(measured))


def _check_baselines(run: GateRun, decode: Callable[[Sequence[int]], str], writer: ResultsWriter,
                     say: Callable[[str], None]) -> bool:
    """The baselines are what the run claims (:mod:`specparity.judge.baseline_checks`): greedy decodes
    under this run's stop set and limit. Returns False when they are not: the run is refused as a
    calibration is (``run.calibration_error``, exit 3) — a wrong stop set or a sampling engine is
    the configuration's fault for every prompt, never a speculative prompt "diverged"."""
    refusal = baseline_refusal(run.records + run.calibration_records,
                               run.threshold.nats if run.threshold is not None else None, decode)
    check = "stop_or_greedy"
    if refusal is None:
        refusal, check = unconstrained_baselines(run.records + run.calibration_records, decode), "constraint"
    if refusal is None:
        return True
    run.calibration_error = refusal
    writer.write({"kind": "calibration_refused", "error": refusal, "scorer_check": run.scorer_check,
                  "stage": "baselines", "check": check})
    for rec in run.records:
        rec.verdict = Verdict(rec.prompt.id, rec.prompt.category, "error", f"not judged: {refusal}")
        writer.write(rec.to_json())
    say(f"baselines refused: {refusal}")
    return False


def _baseline_error(rec: PromptRecord) -> Verdict:
    """The verdict of a prompt whose baseline could not be used, with the first cause."""
    p = rec.prompt
    if rec.baseline is not None and rec.baseline.error:
        cause = f"baseline failed: {rec.baseline.error}"
    elif rec.tf_error:
        cause = f"baseline {rec.tf_error}"
    else:
        cause = "not run"
    return Verdict(p.id, p.category, "error", cause)


def _speculative(engine: Engine, run: GateRun, scorer: Scorer, writer: ResultsWriter,
                 say: Callable[[str], None], golden: Golden | None = None) -> None:
    """Phase 2: every prompt with speculation, scored and classified as it finishes; prompts a
    resumed journal already judged are kept. Under ``--golden-mode baseline`` nothing runs: each
    new baseline (phase 1) is judged against the golden's (:func:`_against_golden`)."""
    todo = []
    for rec in run.records:
        if rec.verdict is not None:  # judged by the interrupted run (--resume)
            if rec.spec is not None:
                run.coverage.add(rec.spec.spec)
        elif rec.request is None or rec.baseline is None or rec.baseline.error:
            rec.verdict = _baseline_error(rec)  # nothing to compare against: no speculative run
            writer.write(rec.to_json())
        else:
            todo.append(rec)
    judge = partial(_judge, run, tuple(engine.stop_token_ids()), engine.decode, writer, say)
    if run.config.golden and run.config.golden_mode == "baseline":
        for rec in todo:
            _against_golden(rec, golden)
            judge(rec)
        return
    work = partial(_decode_and_score, engine, scorer, True)
    t_phase = time.perf_counter()
    for rec, (result, tf, err, t_gen, t_tf) in dispatch(todo, work, run.concurrency):
        rec.spec, rec.spec_tf, rec.spec_tf_error = result, tf, err
        run.timings["spec_decode"] += t_gen
        run.timings["tf_scoring"] += t_tf
        run.coverage.add(rec.spec.spec)
        judge(rec)
    run.timings["spec_phase_wall"] = time.perf_counter() - t_phase


def replayed(run: GateRun) -> list[PromptRecord]:
    """The failing prompts whose speculative request is replayed (:mod:`specparity.model.replay`): a
    ``diverged`` prompt, or an ``error`` whose speculative request itself failed, the first
    :data:`MAX_REPLAYED_PROMPTS` in run order."""
    failing = [r for r in run.records if r.verdict is not None and r.verdict.klass in REPLAYED
               and r.request is not None and r.spec is not None and r.baseline is not None and not r.baseline.error
               and (r.verdict.klass == "diverged" or r.spec.error)]
    return failing[:MAX_REPLAYED_PROMPTS]


def replay_one(engine: Engine, rec: PromptRecord, tries: int) -> Replay:
    """Send ``rec``'s speculative request ``tries`` times more and sort the answers."""
    out = Replay(tries, of_error=bool(rec.spec.error))
    for _ in range(tries):
        got = _generate_one(engine, rec.request, True)
        if got.error:
            out.failed += 1
            out.first_error = out.first_error or got.error
        elif not out.of_error and got.output_ids == rec.spec.output_ids and got.finish_reason == rec.spec.finish_reason:
            out.same += 1
        elif got.output_ids == rec.baseline.output_ids and got.finish_reason == rec.baseline.finish_reason:
            out.baseline += 1
        else:
            out.other += 1
            if not out.of_error:
                at = first_mismatch(rec.spec.output_ids, got.output_ids)
                out.other_positions = sorted(set(out.other_positions) | {at})
    return out


def _replay_failures(engine: Engine, run: GateRun, writer: ResultsWriter, say: Callable[[str], None]) -> None:
    """``--replay N``: each failing prompt's speculative request sent again, one prompt after another, its
    answers journalled on a ``replay`` line; the verdicts stay as judged."""
    tries = run.config.replays
    if tries < 1 or (run.config.golden and run.config.golden_mode == "baseline"):
        return
    t0 = time.perf_counter()
    for rec in replayed(run):
        rec.replay = replay_one(engine, rec, tries)
        writer.write({"kind": "replay", "prompt_id": rec.prompt.id, **rec.replay.to_json()})
        say(f"{rec.prompt.id}: {rec.replay.describe()}")
    run.timings["replays"] += time.perf_counter() - t0


def _against_golden(rec: PromptRecord, golden: Golden) -> None:
    """``--golden-mode baseline``: the golden's baseline becomes the reference and this run's new
    baseline the stream judged against it (its own rows and teacher-forced scores with it)."""
    entry = golden.entry_for(rec.prompt)
    new, new_tf = rec.baseline, rec.baseline_tf
    if entry is None:
        rec.baseline = GenerationResult.failed(rec.prompt.id, f"no golden for this prompt in {golden.path} (added or "
                                               f"edited since it was recorded: record it with --update-golden)")
        return
    rec.spec, rec.spec_tf = new, new_tf
    _reuse(rec, entry.baseline, entry.tf, "golden", (entry.prompt_ids, entry.max_new_tokens), rec.tf_error)
    _check_reused(rec)


def _judge(run: GateRun, stop_ids: tuple[int, ...], decode: Callable[[Sequence[int]], str], writer: ResultsWriter,
           say: Callable[[str], None], rec: PromptRecord) -> None:
    """Classify one prompt (its baseline against ``rec.spec``), journal it and say it."""
    rec.verdict = _timed(run.timings, "comparison", lambda: judge_prompt(rec, run.threshold, stop_ids, decode))
    writer.write(rec.to_json())
    say(f"{rec.prompt.id}: {rec.verdict.klass}")


def judge_prompt(rec: PromptRecord, threshold: NearTieThreshold, stop_ids: tuple[int, ...],
                 decode: Callable[[Sequence[int]], str], constraint: dict[str, Any] | None = None) -> Verdict:
    """A prompt's verdict from its record: its baseline against ``rec.spec`` under ``threshold``; a
    failed scoring (the baseline's, else the speculative output's) makes it an ``error`` unless the
    tokens already diverged; a constrained prompt's outputs are checked against its constraint —
    or, given ``constraint`` (a verdict's recorded checks), that record is applied, as
    ``specparity merge`` does where no tokenizer reads the text. The one classification of a run and
    of a merge of shards."""
    p = rec.prompt
    if rec.baseline is None or rec.baseline.error or rec.spec is None:
        return _baseline_error(rec)
    err = f"baseline {rec.tf_error}" if rec.tf_error else rec.spec_tf_error
    verdict = compare(p.id, p.category, rec.baseline, rec.spec, rec.spec_tf, threshold=threshold.nats,
                      max_new_tokens=rec.request.max_new_tokens, stop_ids=stop_ids, decode=decode,
                      baseline_tf=rec.baseline_tf, drift_nats=threshold.drift_nats)
    if err and verdict.klass != "diverged":
        verdict.klass, verdict.reason = "error", err
    if p.constraint is not None and constraint is not None:
        apply_constraint_checks(verdict, constraint)
    elif p.constraint is not None:
        judge_constraint(verdict, p.constraint, rec.baseline, rec.spec, decode)
    return verdict


def _aggregate_counters(engine: Engine, kind: str) -> dict[str, Any] | None:
    """Run-wide draft counters (engines that report only aggregates, e.g. vLLM's /metrics)."""
    read = getattr(engine, "activity_counters", None)
    return read() if kind == "aggregate" and callable(read) else None


def _aggregate_delta(before: dict[str, Any], after: dict[str, Any]) -> SpecStats:
    delta = {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in ("proposed", "accepted", "verify_steps")}
    return SpecStats(available=True, **delta, source=f"aggregate counters read before and after the speculative "
                                                        f"phase ({after.get('source', 'engine')})")


def conclude(run: GateRun) -> GateDecision:
    """Apply the policy and record the outcome: a final ``verdict`` line in the journal (so a machine
    reads the result without parsing markdown) and ``summary.md`` beside it."""
    decision = decide(run)
    if run.config.report_dir:
        writer = ResultsWriter(run.config.report_dir, mode="append")
        try:
            writer.write({"kind": "verdict", **decision.to_json(), "interrupted": run.interrupted})
        finally:
            writer.close()
        write_reports(run, decision, run.config.report_dir)
    return decision
