"""Two recorded runs judged against each other: the sides of ``specparity compare`` and of the concurrency
sweep's cross-level comparison.

A :class:`Side` is one run's streams as recorded — a golden's baselines, or a journal's baseline or speculative
output — with the samples that calibrate and the acceptance its speculative run showed. :func:`judge_sides` judges
NEW's streams against OLD's with the gate's classes (OLD's samples calibrate; NEW's own noise is the judged side's
figure), :func:`acceptance_verdict` folds an acceptance regression into the decision. The commands parse options,
call these and print; nothing here prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specparity.model.threshold import DEFAULT_CEILING_NATS


@dataclass
class Side:
    """One side of ``compare``: per prompt (record, stream, its teacher-forced scores)."""

    label: str
    fingerprint: Any
    #: prompt id -> (Prompt, GenerationResult, TokenScores | None, max_new_tokens)
    streams: dict[str, tuple[Any, Any, Any, int]]
    samples: list[Any]  # calibration samples (decode rows vs teacher-forced), for the threshold
    speculative: bool
    stop_ids: tuple[int, ...] = ()
    #: prompt id -> why its stream cannot be judged (an errored prompt of a journal): judged as an error.
    errors: dict[str, str] = field(default_factory=dict)
    #: The journal's run-wide aggregate counters (an engine that reports only those), for the activity rule.
    aggregate: Any = None
    #: The speculative run's acceptance per prompt (:class:`specparity.judge.acceptance.AcceptanceSet`),
    #: whatever stream is judged: a golden's recorded ``acceptance``, a journal's speculative run.
    acceptance: Any = None
    #: Why the journal's run-wide counters are not that run's alone (other traffic on the server).
    aggregate_unattributed: str | None = None
    #: The journal's run allowed unknown activity (``--allow-unknown-activity``): its comparison does too.
    unknown_activity_allowed: bool = False


def load_side(path: str, which: str, side: str) -> Side:
    """One side of a comparison from a golden or a journal (``side``: its ``spec`` or ``baseline``
    stream); ``which`` names it in a refusal (:class:`~specparity.run.setup.BadInput`)."""
    from specparity.judge.calibration import Sample
    from specparity.run.golden import HEADER_KEY, GoldenError, load_golden
    from specparity.run.journal import JOURNAL, JournalError, load_run
    from specparity.run.setup import BadInput
    from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS

    p = Path(path)
    journal = p / JOURNAL if p.is_dir() else p
    if not journal.exists():
        raise BadInput(f"{which} {path}: no such file or directory (expected a golden or a journal)")
    try:
        head = journal.read_text(encoding="utf-8").split("\n", 1)[0]
        is_golden = f'"{HEADER_KEY}"' in head
        if is_golden:
            g = load_golden(journal)
            from specparity.model.types import Fingerprint

            streams = {pid: (e.prompt, e.baseline, e.tf, e.max_new_tokens) for pid, e in g.entries.items()}
            samples = [Sample(pid, e.baseline.output_ids, e.baseline.scores, e.tf) for pid, e in g.entries.items()]
            accepted = _acceptance(f"golden {journal}", [(e.prompt, e.spec, e.prompt_ids, e.baseline.output_ids)
                                                          for e in g.entries.values() if e.spec is not None],
                                   "the golden has no acceptance (recorded before it was kept, or by specparity "
                                   "record --baselines-only, which does not speculate)")
            return Side(f"golden {journal}", Fingerprint.from_json(g.header["fingerprint"]), streams, samples, False,
                        tuple(g.header.get("stop_token_ids", ())), acceptance=accepted)
        run = load_run(journal)
    except (GoldenError, JournalError) as exc:
        raise BadInput(f"{which}: {exc}") from None
    streams, samples, errors = {}, [], {}
    for r in run.records + run.calibration_records:
        if r.baseline is not None and not r.baseline.error and r.baseline_tf is not None:
            samples.append(Sample(r.prompt.id, r.baseline.output_ids, r.baseline.scores, r.baseline_tf))
        if r in run.calibration_records:
            continue
        limit = r.request.max_new_tokens if r.request else (run.config.max_new_tokens or r.prompt.max_new_tokens
                                                             or DEFAULT_MAX_NEW_TOKENS)
        if side == "spec" and r.spec is not None and not r.spec.error:
            streams[r.prompt.id] = (r.prompt, r.spec, r.spec_tf, limit)
        elif side == "baseline" and r.baseline is not None and not r.baseline.error:
            streams[r.prompt.id] = (r.prompt, r.baseline, r.baseline_tf, limit)
        else:  # the prompt errored in that run: it stays an error, never silently dropped
            errors[r.prompt.id] = _errored(r, side)
    stops = next((r.request.stop_token_ids for r in run.records if r.request), ())
    spec_runs = [(r.prompt, r.spec.spec, r.request.prompt_ids if r.request else None,
                  r.baseline.output_ids if r.baseline is not None and not r.baseline.error else r.spec.output_ids)
                 for r in run.records if r.spec is not None and not r.spec.error]
    why = ("the journal's speculative run reported no per-request counters"
           + (" (run-wide counters only: no per-prompt spread to compare)" if run.aggregate is not None else "")
           if spec_runs else "the journal holds no speculative run (baselines only)")
    return Side(f"journal {journal} ({side})", run.fingerprint, streams, samples, side == "spec", tuple(stops),
                errors, run.aggregate if side == "spec" else None, _acceptance(f"journal {journal}", spec_runs, why),
                run.aggregate_unattributed if side == "spec" else None, run.config.policy.allow_unknown_activity)


def _acceptance(label: str, spec_runs: list[tuple[Any, Any, Any, Any]], why: str) -> Any:
    """The :class:`~specparity.judge.acceptance.AcceptanceSet` of (prompt, counters, prompt ids, output ids)."""
    from specparity.judge.acceptance import AcceptanceSet, prompt_acceptance

    out = AcceptanceSet(label)
    for prompt, stats, prompt_ids, output_ids in spec_runs:
        pa = prompt_acceptance(prompt.id, prompt.category, stats, prompt_ids, output_ids)
        if pa is not None:
            out.prompts[prompt.id] = pa
    if not out.prompts:
        out.missing = why
    return out


def _errored(rec: Any, side: str) -> str:
    """Why a journal's prompt has no usable stream on ``side``, from its first cause."""
    for label, result in (("baseline", rec.baseline), ("speculative run", rec.spec)):
        if result is not None and result.error:
            return f"{label} failed: {result.error}"
    if rec.verdict is not None and rec.verdict.klass == "error":
        return rec.verdict.reason
    return f"no {'speculative' if side == 'spec' else 'baseline'} output recorded (the run never reached it)"


def _decoder(fingerprint: Any) -> Callable[[Any], str]:
    """Token text from the target's tokenizer when it is on this machine, else the ids themselves."""
    try:
        from specparity.engines.common import load_tokenizer

        tok = load_tokenizer(fingerprint.target.path)
        return lambda ids: tok.decode(list(ids))
    except Exception:  # noqa: BLE001 - a server's target path, or a machine without the model
        return lambda ids: "".join(f"⟨{int(i)}⟩" for i in ids)


#: The cross-instance line of a comparison of two recorded runs.
JUDGED_APART = ("not applicable: two recorded runs are compared; the judged side's own noise is measured apart from "
                "the reference's, and enters the allowance only up to its cap")


def judge_sides(old: Side, new: Side, old_path: str, *, near_tie_nats: float | None = None,
                near_tie_ceiling: float = DEFAULT_CEILING_NATS, max_near_tie: float | None = None,
                drift_policy: str = "fail", only_common: bool = False, report_dir: str | None = None,
                bit_exact: bool | None = None, deterministic: str | None = None,
                deterministic_unknown: str | None = None, unknown_fails: bool = False,
                allow_unknown_activity: bool = False) -> tuple[Any, Any]:
    """NEW's streams judged against OLD's with the gate's classes: (the run, its decision).

    The one comparison of two recorded runs, for ``specparity compare`` and for the concurrency sweep
    (:mod:`specparity.run.sweep`: each level's speculative output against the lowest level's).
    ``report_dir`` only goes into the run's config (the caller writes the reports). OLD's samples
    calibrate (the noise, the flip rate, the channel's resolution); NEW's own noise is the judged side's
    figure, capped and named as a gate run's cross-instance figure is. The near-tie policy is the gate's
    (:class:`GatePolicy`: the budget from the data unless ``max_near_tie``; ``bit_exact``); ``deterministic`` /
    ``deterministic_unknown`` are the engine's declarations when both sides ran on one engine (the
    sweep's levels), which make the comparison bit-exact as they make a gate run. When NEW is a
    journal's speculative output, the activity rule applies as in the gate: its counters (per
    request or run-wide) must show speculation, and none at all is "activity unknown", a failure
    unless ``allow_unknown_activity`` or NEW's own run allowed it."""
    from specparity.judge.calibration import calibrate
    from specparity.judge.compare import compare
    from specparity.model.verdicts import Verdict
    from specparity.gate.decision import decide
    from specparity.judge.noise import CalibrationError
    from specparity.model.gate_run import GateConfig, GatePolicy, GateRun, PromptRecord

    # a golden, or a journal's baseline side, speculated nothing: the activity rule does not apply
    mode = "spec" if new.speculative else "baseline"
    config = GateConfig(report_dir=report_dir, golden=old_path, golden_mode=mode,
                        near_tie_nats=near_tie_nats,
                        policy=GatePolicy(max_near_tie=max_near_tie, drift=drift_policy, bit_exact=bit_exact,
                                          allow_unknown_activity=allow_unknown_activity or new.unknown_activity_allowed,
                                          unknown_fails=unknown_fails))
    run = GateRun(fingerprint=new.fingerprint, config=config, records=[], scorer=f"recorded: {old.label}",
                  deterministic=deterministic, deterministic_unknown=deterministic_unknown)
    run.aggregate = new.aggregate
    run.aggregate_unattributed = new.aggregate_unattributed
    run.golden_notes.append(f"{new.label} judged against {old.label}")
    # the reference calibrates; the judged side's own decode-vs-scoring noise is measured apart and widens
    # the allowance only as far as the cap the reference sets, and never without a finding
    try:
        _check, run.threshold = calibrate(old.samples, scorer=old.label, override=near_tie_nats,
                                          ceiling=near_tie_ceiling, judged=new.samples, cross_note=JUDGED_APART,
                                          label=f"the recorded baselines of OLD ({len(old.samples)}); NEW's "
                                                f"({len(new.samples)}) measured apart, as the judged side's")
    except (CalibrationError, ValueError) as exc:
        run.calibration_error = str(exc)
    decode = _decoder(old.fingerprint)
    stops = set(old.stop_ids) | set(new.stop_ids)
    in_new = set(new.streams) | set(new.errors)
    wanted = [pid for pid in old.streams if pid in in_new] if only_common else list(old.streams)
    if only_common and len(wanted) < len(old.streams):
        run.golden_notes.append(f"--only-common: {len(old.streams) - len(wanted)} prompt(s) of OLD not in NEW were left out")
    for pid in wanted:
        prompt, ref, ref_tf, limit = old.streams[pid]
        rec = PromptRecord(prompt, baseline=ref, baseline_tf=ref_tf, baseline_from="golden")
        got = new.streams.get(pid)
        if got is None and pid in new.errors:
            rec.verdict = Verdict(pid, prompt.category, "error", f"errored in NEW ({new.label}): {new.errors[pid]}")
        elif got is None:
            rec.verdict = Verdict(pid, prompt.category, "error", f"not in NEW ({new.label})")
        elif run.threshold is None:
            rec.verdict = Verdict(pid, prompt.category, "error", f"not judged: {run.calibration_error}")
        else:
            rec.spec, rec.spec_tf = got[1], got[2]
            if got[3] != limit:
                rec.verdict = Verdict(pid, prompt.category, "error",
                                      f"OLD was decoded with max_new_tokens {limit}, NEW with {got[3]}: not the same request")
            else:
                rec.verdict = compare(pid, prompt.category, ref, got[1], got[2], threshold=run.threshold.nats,
                                      max_new_tokens=limit, stop_ids=tuple(stops), decode=decode, baseline_tf=ref_tf,
                                      drift_nats=run.threshold.drift_nats)
            run.coverage.add(got[1].spec)
        run.records.append(rec)
    only_new = sorted(in_new - set(old.streams))
    if only_new:
        run.golden_notes.append(f"{len(only_new)} prompt(s) only in NEW, not judged: {', '.join(only_new)}")
    decision = decide(run)
    return run, decision


def acceptance_verdict(old: Side, new: Side, decision: Any, *, max_drop: float, named_by: str | None = None) -> Any:
    """Compare both sides' acceptance and fold a regression into ``decision`` (a failure: exit 1).

    A side without acceptance fails nothing by default (the output says it was not recorded); when
    ``named_by`` (``--max-accept-drop``, or a policy file's ``max_accept_drop``) asked for the rule,
    a comparison that cannot check it is a failure that says why."""
    from specparity.judge.acceptance import compare_runs
    from specparity.gate.decision import judge_acceptance

    accept = judge_acceptance(compare_runs(old.acceptance, new.acceptance), max_drop=max_drop)
    if accept.not_recorded and named_by:
        accept.failures.append(
            f"{accept.not_recorded}: {named_by} names max_accept_drop {max_drop:g}, and a comparison that cannot "
            "check it fails (record the golden with `specparity record`, which keeps the speculative run's "
            "acceptance, or compare journals of speculative runs whose engine counts per request)")
    if accept.failures:
        decision.failures.extend(accept.failures)
        decision.passed = False
    return accept
