"""``specparity record``, ``compare`` and ``report``: goldens and journals from the command line.

* ``record``: run the baselines and write the golden named by ``--golden`` (the slow part of a gate
  run on a big server, done once), then the speculative decodes, whose acceptance per prompt the
  golden keeps: ``compare GOLDEN NEW`` can then fail on an acceptance drop. ``--baselines-only``
  records no acceptance (``compare`` then says so, and fails under a policy naming
  ``max_accept_drop``).
* ``compare OLD NEW``: judge two recorded runs against each other with the gate's classes, no
  engine needed — each side a golden or a journal (``results.jsonl`` or its directory). OLD gives
  the reference stream (a golden's baseline, a journal's baseline), NEW the stream judged (a
  golden's baseline, a journal's speculative output; ``--new-side baseline`` takes its baseline:
  an engine upgrade between two journals; ``--old-side spec`` makes OLD's speculative output the
  reference: does a prompt's output depend on what else was in flight). The threshold comes from
  OLD's measured noise; NEW's own noise enters it only up to the cap OLD's sets, and a finding says
  so whenever it widens it (docs/CALIBRATION.md). It also compares the two runs' acceptance (the speculative runs'
  counters, per category and per draft position, with a paired bootstrap interval) and fails when
  it dropped beyond ``--max-accept-drop`` (``max_accept_drop`` in ``--policy``; docs/ACCEPTANCE.md).
* ``parity RUN_A RUN_B``: the same draft under two implementations (two journals): their
  acceptance rates per category, with the same interval, must agree within ``--tolerance``.
* ``report DIR``: rebuild every report of a run from its journal alone (after a crash, or with a
  newer specparity), and print the verdict.

Each exits like the gate: 0 pass, 1 gate failure, 3 harness/engine error, 4 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from specparity.gate import exitcodes
from specparity.judge.noise import near_tie_above_ceiling
from specparity.model.threshold import DEFAULT_CEILING_NATS


# --------------------------------------------------------------------------- record


def _gate_raw(args: argparse.Namespace) -> dict[str, Any]:
    from specparity.cli.option_table import gate_dests

    return {dest: getattr(args, dest, None) for dest in gate_dests()}


def _run_record(args: argparse.Namespace) -> int:
    from specparity.cli.options import build_setup
    from specparity.run.setup import BadInput
    from specparity.run.runner import run_gate
    from specparity.run.gate_command import load_engine

    raw = _gate_raw(args)
    if not raw.get("golden"):
        raise BadInput("--golden: specparity record needs --golden FILE (where to write the golden)")
    raw["update_golden"] = raw.get("update_golden") or "update"
    setup = build_setup(raw, check_report=bool(raw.get("report")), speculates=not args.baselines_only)
    engine = load_engine(setup)
    try:
        if setup.counters_pending and not args.baselines_only:
            from specparity.run.gate_command import _check_counters

            _check_counters(setup, engine)
        run = run_gate(engine, setup.prompts, setup.config, calibration=setup.calibration, golden=setup.golden,
                       baselines_only=args.baselines_only, progress=None if args.json else _say)
    finally:
        engine.close()
    accepted = _recorded_acceptance(run, args.baselines_only)
    failed = [r.prompt.id for r in run.records + run.calibration_records
              if r.baseline is None or r.baseline.error or r.tf_error]
    if run.golden_error:
        code, status = exitcodes.GATE_FAILED, run.golden_error
    elif run.calibration_error or run.fatal:
        code, status = exitcodes.ENGINE_ERROR, run.calibration_error or run.fatal.splitlines()[0]
    elif failed:
        code, status = exitcodes.ENGINE_ERROR, f"{len(failed)} baseline(s) failed and were not recorded: {', '.join(failed)}"
    else:
        code, status = exitcodes.PASS, "; ".join(run.golden_notes)
    if args.json:
        print(json.dumps({"status": "PASS" if code == 0 else "FAIL", "exit_code": code, "message": status,
                          "golden": setup.config.golden, "threshold": run.threshold.to_json() if run.threshold else None,
                          "failed": failed, "acceptance": accepted}, indent=2))
    else:
        print(f"specparity record: {'PASS' if code == 0 else 'FAIL'} — {status}")
        if run.threshold:
            print(f"near-tie threshold it supports: {run.threshold.describe()}")
        print(f"acceptance: {accepted}")
    return code


def _recorded_acceptance(run: Any, baselines_only: bool) -> str:
    """What the golden holds of the speculative run's acceptance, in one line: what ``specparity
    compare`` can judge an acceptance drop against."""
    if baselines_only:
        return ("not recorded (--baselines-only): `specparity compare` against this golden cannot check an acceptance "
                "drop, and fails under a policy naming max_accept_drop")
    judged = [r for r in run.records if r.spec is not None and not r.spec.error]
    counted = sum(1 for r in judged if r.spec.spec.available)
    if counted:
        return f"recorded for {counted} of {len(run.records)} prompt(s) (the speculative run's per-request counters)"
    why = ("the engine reports no per-request counters (run-wide ones say nothing per prompt)" if judged
           else "no speculative decode finished")
    return (f"not recorded: {why}; `specparity compare` against this golden cannot check an acceptance drop, and "
            "fails under a policy naming max_accept_drop")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def add_record_command(sub: Any) -> None:
    from specparity.cli.option_table import add_gate_options

    p = sub.add_parser("record", help="run the baselines and write the golden (--golden FILE), with the speculative "
                       "run's acceptance", description="Record a golden: every prompt greedily without speculation, "
                       "scored teacher-forced, written to --golden FILE (golden/README.md); then every prompt with "
                       "speculation, whose acceptance per prompt the golden keeps, so `specparity compare GOLDEN "
                       "NEW` can fail on an acceptance drop. A golden recorded under another engine fingerprint is "
                       "replaced only with --update-golden=force.")
    add_gate_options(lambda name, desc: p.add_argument_group(name, desc).add_argument)
    p.add_argument("--baselines-only", action="store_true",
                   help="record the baselines only, no speculative decode: the golden then holds no acceptance, so "
                   "`specparity compare` against it cannot check an acceptance drop (and fails under a policy naming "
                   "max_accept_drop)")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=_run_record)


# --------------------------------------------------------------------------- compare


def _run_compare(args: argparse.Namespace) -> int:
    from specparity.run.sides import acceptance_verdict, judge_sides, load_side
    from specparity.cli.options import check_report_dir
    from specparity.run.setup import BadInput
    from specparity.report.lines import terminal_lines

    for flag, value, low in (("--near-tie-nats", args.near_tie_nats, 0.0),
                             ("--near-tie-ceiling", args.near_tie_ceiling, 1e-6)):
        if value is not None and not (math.isfinite(value) and value >= low):
            raise BadInput(f"{flag} {value:g}: expected a finite number >= {low:g}")
    if args.near_tie_nats is not None and args.near_tie_nats > args.near_tie_ceiling:
        raise BadInput(near_tie_above_ceiling(args.near_tie_nats, args.near_tie_ceiling))
    rules = _compare_rules(args)
    old = load_side(args.old, "OLD", args.old_side)
    new = load_side(args.new, "NEW", args.new_side)
    if args.report:
        check_report_dir("--report", args.report)
    if not old.streams or not (new.streams or new.errors):
        raise BadInput(f"{'OLD' if not old.streams else 'NEW'}: no usable prompt in {old.label if not old.streams else new.label}")
    run, decision = judge_sides(old, new, args.old, near_tie_nats=args.near_tie_nats,
                                near_tie_ceiling=args.near_tie_ceiling, max_near_tie=rules["max_near_tie"],
                                drift_policy=rules["drift_policy"], only_common=args.only_common,
                                report_dir=args.report or None, bit_exact=rules.get("bit_exact"),
                                allow_unknown_activity=bool(rules.get("allow_unknown_activity")))
    accept = acceptance_verdict(old, new, decision, max_drop=rules["max_accept_drop"],
                                 named_by=rules["max_accept_drop_named_by"])
    if args.report:
        _write_reports(run, decision, args.report)
        _write_acceptance(accept, args.report)
    if args.json:
        print(json.dumps({**decision.to_json(), "prompts": [r.verdict.to_json() for r in run.records],
                          "acceptance": accept.to_json()}, indent=2))
    else:
        from specparity.judge.acceptance import lines

        print("\n".join(terminal_lines(run, decision) + [""] + lines(accept)))
    return decision.exit_code


def _compare_rules(args: argparse.Namespace) -> dict[str, Any]:
    """The compare's policy: its flags, then ``--policy FILE`` for what they leave unset, then the
    defaults (``max_near_tie``, ``fail_on`` and ``max_accept_drop`` apply; bad values exit 4)."""
    from specparity.judge.acceptance import DEFAULT_MAX_ACCEPT_DROP
    from specparity.run.setup import BadInput
    from specparity.gate.policy_file import PolicyError, load_policy, merge, where

    drop = args.max_accept_drop
    if drop is not None:
        drop = _number("--max-accept-drop", drop, 0.0, sys.float_info.max, "a number >= 0 (tokens per verify step)")
    raw = {"max_near_tie": args.max_near_tie, "drift_policy": args.drift_policy, "max_accept_drop": drop}
    named_by = "--max-accept-drop" if drop is not None else None
    if args.policy:
        try:
            policy = load_policy(args.policy)
        except PolicyError as exc:
            raise BadInput(str(exc)) from None
        raw = merge(raw, policy)
        if named_by is None and "max_accept_drop" in policy:
            named_by = f"the policy {where(args.policy, 'max_accept_drop')}"
    # a rule named on purpose is one the comparison must be able to check
    raw["max_accept_drop_named_by"] = named_by
    if raw["max_accept_drop"] is None:
        raw["max_accept_drop"] = DEFAULT_MAX_ACCEPT_DROP
    raw["drift_policy"] = raw["drift_policy"] or "fail"
    if raw["max_near_tie"] is not None and not 0 <= raw["max_near_tie"] <= 1:
        raise BadInput(f"--max-near-tie: expected a fraction in [0, 1], got {raw['max_near_tie']}")
    return raw


def _number(flag: str, value: str, low: float, high: float, expected: str) -> float:
    """A numeric option in [low, high], or one line of bad input (exit 4) naming it."""
    from specparity.run.setup import BadInput

    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not low <= x <= high:
        raise BadInput(f"{flag}: expected {expected}, got {value!r}")
    return x


def _write_acceptance(accept: Any, out: str) -> None:
    """``acceptance.md`` beside the other reports."""
    from specparity.judge.acceptance import lines
    from specparity.run.gate_command import write_failed

    try:
        (Path(out) / "acceptance.md").write_text("# Acceptance\n\n" + "\n".join(lines(accept)) + "\n", encoding="utf-8")
    except OSError as exc:
        raise write_failed(f"--report {out}", exc, "PASS" if not accept.failures else "FAIL") from None


def _write_reports(run: Any, decision: Any, out: str, flag: str = "--report") -> None:
    """The reports, or one line and exit 3 (a harness error, not bad input) when the write fails
    after the directory was checked."""
    from specparity.report.render import write_reports
    from specparity.run.gate_command import write_failed

    try:
        write_reports(run, decision, out)
    except OSError as exc:
        raise write_failed(f"{flag} {out}", exc, decision.status) from None


def add_compare_command(sub: Any) -> None:
    from specparity.judge.acceptance import DEFAULT_MAX_ACCEPT_DROP

    p = sub.add_parser("compare", help="judge two recorded runs (goldens or journals) with the gate's classes",
                       description="OLD gives the reference (a golden's or a journal's baseline), NEW the stream "
                       "judged (a golden's baseline, a journal's speculative output, or with --new-side baseline its "
                       "baseline). The threshold is measured on OLD's recorded baselines. No engine runs.")
    p.add_argument("old", metavar="OLD", help="golden file, results.jsonl or report directory")
    p.add_argument("new", metavar="NEW", help="golden file, results.jsonl or report directory")
    p.add_argument("--new-side", choices=("spec", "baseline"), default="spec",
                   help="which stream of a NEW journal is judged (default spec)")
    p.add_argument("--old-side", choices=("baseline", "spec"), default="baseline",
                   help="which stream of an OLD journal is the reference (default baseline; spec: e.g. the "
                   "speculative outputs at concurrency 1 against those at concurrency N)")
    p.add_argument("--near-tie-nats", type=float, default=None, help="near-tie threshold (default: measured on OLD)")
    p.add_argument("--near-tie-ceiling", type=float, default=DEFAULT_CEILING_NATS,
                   help="largest near-tie threshold accepted, measured or set (default %(default)s nats)")
    p.add_argument("--max-near-tie", type=float, default=None,
                   help="allowed fraction of near-tie prompts, in place of the budget that follows the data (or the "
                        "policy file's)")
    p.add_argument("--drift-policy", choices=("fail", "warn"), default=None, help="default fail, or the policy file's")
    p.add_argument("--max-accept-drop", default=None, metavar="TOKENS",
                   help="largest drop of the mean accept length from OLD to NEW before the comparison fails "
                   f"(default {DEFAULT_MAX_ACCEPT_DROP:g}, or the policy file's max_accept_drop; the drop must also lie beyond the "
                   "bootstrap interval: docs/ACCEPTANCE.md)")
    p.add_argument("--policy", default=None, metavar="FILE",
                   help="policy file (TOML): max_accept_drop, max_near_tie and fail_on apply to compare")
    p.add_argument("--only-common", action="store_true",
                   help="judge only the prompts both sides hold (default: a prompt of OLD missing from NEW is an error)")
    p.add_argument("--report", default=None, help="write the reports of the comparison to this directory")
    p.add_argument("--json", action="store_true", help="print the decision and per-prompt verdicts as JSON")
    p.set_defaults(func=_run_compare)


# --------------------------------------------------------------------------- parity


def _run_parity(args: argparse.Namespace) -> int:
    from specparity.judge.acceptance import lines
    from specparity.run.setup import BadInput
    from specparity.gate.parity import parity

    tolerance = _number("--tolerance", args.tolerance, 0.0, 1.0, "a difference of acceptance rates in [0, 1]")
    from specparity.run.sides import load_side

    a = load_side(args.run_a, "RUN_A", "spec")
    b = load_side(args.run_b, "RUN_B", "spec")
    for which, path, side in (("RUN_A", args.run_a, a), ("RUN_B", args.run_b, b)):
        if side.acceptance.missing:
            raise BadInput(f"{which} {path}: no acceptance to compare: {side.acceptance.missing}")
    result = parity(a.acceptance, b.acceptance, tolerance=tolerance)
    if result.not_recorded:
        raise BadInput(f"RUN_B {args.run_b}: no prompt with acceptance in common with RUN_A {args.run_a} "
                       f"(expected two runs of the same prompts)")
    code = exitcodes.GATE_FAILED if result.failures else exitcodes.PASS
    status = "FAIL" if result.failures else "PASS"
    if args.json:
        print(json.dumps({"status": status, "exit_code": code, **result.to_json()}, indent=2))
    else:
        rows = result.decided_on
        head = (f"specparity parity: {status} — acceptance {rows[-1].old:.3f} (A) vs {rows[-1].new:.3f} (B) over "
                f"{rows[-1].prompts} prompt(s), tolerance {tolerance:g}")
        print("\n".join([head, *[f"FAIL: {f}" for f in result.failures], "", *lines(result, "A", "B")]))
    return code


def add_parity_command(sub: Any) -> None:
    from specparity.gate.parity import DEFAULT_TOLERANCE

    p = sub.add_parser("parity", help="the same draft under two implementations: acceptance per category must agree",
                       description="Compare the acceptance rates (accepted / proposed draft tokens) of two runs of "
                       "the same draft on the same prompts under two engines (journals or report directories), per "
                       "category and overall, with a paired bootstrap interval; fails (exit 1) where they differ by "
                       "more than --tolerance and the interval excludes 0. docs/ACCEPTANCE.md.")
    p.add_argument("run_a", metavar="RUN_A", help="results.jsonl or report directory of the first engine's run")
    p.add_argument("run_b", metavar="RUN_B", help="results.jsonl or report directory of the second engine's run")
    p.add_argument("--tolerance", default=str(DEFAULT_TOLERANCE),
                   help="largest difference of acceptance rates (absolute, default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=_run_parity)


# --------------------------------------------------------------------------- report


def _run_report(args: argparse.Namespace) -> int:
    from specparity.gate.decision import decide
    from specparity.run.journal import JournalError, load_run
    from specparity.cli.options import check_report_dir
    from specparity.run.setup import BadInput
    from specparity.report.lines import terminal_lines

    try:
        run = load_run(args.journal)
    except JournalError as exc:
        raise BadInput(str(exc)) from None
    source = Path(args.journal)
    out = args.out or str(source if source.is_dir() else source.parent)
    check_report_dir("--out", out)
    decision = decide(run)
    _write_reports(run, decision, out, "--out")
    if args.json:
        print(json.dumps({**decision.to_json(), "report": out}, indent=2))
    else:
        print("\n".join(terminal_lines(run, decision) + [f"report: {out}"]))
    return decision.exit_code


def add_report_command(sub: Any) -> None:
    p = sub.add_parser("report", help="rebuild a run's reports from its journal (results.jsonl) alone",
                       description="Rebuild summary.md, report.md and report.html from a journal and print the "
                       "verdict; exits with the run's exit code (1 when it failed).")
    p.add_argument("journal", metavar="JOURNAL", help="results.jsonl or the report directory holding it")
    p.add_argument("--out", default=None, help="where to write the reports (default: beside the journal)")
    p.add_argument("--json", action="store_true", help="print the decision as JSON")
    p.set_defaults(func=_run_report)


COMMANDS = (add_record_command, add_compare_command, add_parity_command, add_report_command)
