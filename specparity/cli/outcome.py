"""What the commands print and take alike: the exit codes' epilog of every ``--help``, a run's outcome
(``run``, ``merge``, ``run --ray``: its ``--json`` document or its lines), and the output options and
printing of the commands that run the gate several times (``sweep``, ``arms``). A module of
its own so that those commands and :mod:`specparity.cli.commands`, which registers them, import it
rather than each other."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

#: The exit codes of every command, for ``specparity --help`` (README "Exit codes").
EXIT_CODES_EPILOG = """\
exit codes (every command, and `pytest suites/lossless`; ci/gate.sh exits with the worst of its suites):
  0  pass: the gate passed (probe: every probe ok or warn; with --policy, unknown only where the
     policy's allow_unknown names the probe)
  1  gate failure: a prompt diverged, drifted or failed in the engine, a run-level rule failed
     (speculation inactive, near-tie budget, a path not taken under --require-all-paths), or
     nothing was judged (a selection or comparison left no prompt); probe: a predicted failure
  2  interrupted (Ctrl-C or SIGTERM): finished prompts are kept, the summary and the journal say INTERRUPTED
  3  harness or engine error: the engine could not load or start, nothing could be judged
     (calibration refused, no noise measured), or the reports could not be written; no verdict
  4  bad input: an option, path, engine, prompt or policy file, named in one line before any model
     loads, or a policy the engine's counters cannot check
  6  specparity probe only, without --policy: no probe predicts a failure, but one answered unknown
(docs/ERRORS.md: every entry point, every refusal and how to fix it)
"""

VERBOSE_HELP = ("also show the warnings and log lines of the libraries the engine loads (transformers, "
                "huggingface_hub), kept off the console otherwise")


def add_outcome_options(p: argparse.ArgumentParser, report: str, report_holds: str, json_help: str) -> None:
    """A multi-run command's options (``sweep``, ``arms``): the gate's own, with ``--report`` defaulting
    to ``report`` (which holds ``report_holds``), and its output group (--json, -q, -v)."""
    from specparity.cli.option_table import add_gate_options

    add_gate_options(lambda name, description: p.add_argument_group(name, description).add_argument)
    p.set_defaults(report=report)
    for action in p._actions:  # the shared --report help names the gate's default, not this command's
        if action.dest == "report":
            action.help = f"report directory (default {report}): {report_holds}"
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help=json_help)
    out.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line and the failures")
    out.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)


#: ``specparity run --json``: the version of the document's layout (bumped on an incompatible change).
RUN_JSON_SCHEMA = 1


def run_json(result: Any) -> dict[str, Any]:
    """``specparity run --json``: the decision and what a machine needs to act on it (schema in README)."""
    from specparity.gate.decision import near_tie_policy

    run, decision = result.run, result.decision
    act = run.activity()
    prompts = []
    for r in run.records:
        v = r.verdict
        prompts.append({
            "id": r.prompt.id,
            "category": r.prompt.category,
            "class": v.klass if v is not None else None,
            "reason": v.reason if v is not None else "never finished",
            "position": v.divergence.position if v is not None and v.divergence is not None else None,
        })
    return {
        "schema": RUN_JSON_SCHEMA,
        "status": decision.status,
        "exit_code": decision.exit_code,
        "passed": decision.passed,
        "counts": dict(decision.counts),
        "total": len(run.records),
        "failures": list(decision.failures),
        "warnings": list(decision.warnings),
        "decision": decision.to_json(),
        "threshold": run.threshold.to_json() if run.threshold is not None else None,
        "near_tie_policy": near_tie_policy(run),
        "fingerprint": run.fingerprint.to_json() if run.fingerprint is not None else None,
        "activity": {"proposed": act.proposed, "accepted": act.accepted, "verify_steps": act.verify_steps,
                     "mean_accept_length": act.mean_accept_length, "reported_requests": act.reported_requests},
        "prompts": prompts,
        "report": {"dir": run.config.report_dir, "files": [str(p) for p in result.paths if p.exists()]},
    }


def shown_lines(args: argparse.Namespace, lines: list[str], reports: Sequence[Path]) -> list[str]:
    """The terminal lines to print: under ``--quiet`` the verdict line and the failures only, otherwise
    every line with the report paths after them."""
    if args.quiet:
        return lines[:1] + [line for line in lines if line.startswith("FAIL: ")]
    return lines + [f"report: {p}" for p in reports]


def print_result(args: argparse.Namespace, result: Any) -> None:
    """A run's outcome (``run``, ``merge``, ``run --ray``): its ``--json`` document, else its terminal
    lines with the report files that were written."""
    from specparity.report.lines import terminal_lines

    if args.json:
        print(json.dumps(run_json(result), indent=1, default=str))
        return
    print("\n".join(shown_lines(args, terminal_lines(result.run, result.decision),
                                [p for p in result.paths if p.exists()])))


def print_outcome(args: argparse.Namespace, result: Any, lines: list[str], paths: Sequence[Path]) -> None:
    """A multi-run command's outcome (``sweep``, ``arms``): its JSON under ``--json``; else its terminal
    lines — under ``--quiet`` the verdict line and the failures only, otherwise with the report paths."""
    if args.json:
        print(json.dumps(result.to_json(), indent=1, default=str))
        return
    print("\n".join(shown_lines(args, lines, paths)))


def progress(args: argparse.Namespace) -> Callable[[str], None] | None:
    """Where a multi-run command says how far it got: stderr, unless ``--json`` or ``--quiet``."""
    return None if (args.json or args.quiet) else (lambda msg: print(msg, file=sys.stderr, flush=True))


def run_shown(args: argparse.Namespace, run: Callable[[Callable[[str], None] | None], Any],
              write: Callable[[Any], Sequence[Path]], lines: Callable[[Any], list[str]], partial: str) -> int:
    """A multi-run command (``sweep``, ``arms``): ``run`` it with :func:`progress`, write and print its outcome
    and return its exit code; interrupted, the partial outcome the interrupt carries (attribute ``partial``) is
    written and shown before the interrupt goes on."""
    try:
        result = run(progress(args))
    except KeyboardInterrupt as exc:  # runner.GateInterrupted: the partial outcome, written, is shown
        got = getattr(exc, partial, None)
        if got is not None:
            print_outcome(args, got, lines(got), write(got))
        raise
    print_outcome(args, result, lines(result), write(result))
    return result.exit_code
