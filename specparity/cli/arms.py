"""``specparity arms``: the lossless gate once per configuration arm (:mod:`specparity.run.arm_runs`).

The other options are ``specparity run``'s (the gate's option table); the arms command adds
``--arms`` (default: every arm the engine supports) and ``--prelaunched`` (running servers already
launched with the arms' settings: the counters still decide whether each arm happened).
"""

from __future__ import annotations

import argparse
from typing import Any

from specparity.run.setup import BadInput

#: ``specparity arms``'s default report directory (each arm in a subdirectory of its name).
ARMS_REPORT = "reports/arms"
#: Gate options an arms run sets itself or cannot honour across arms, with why.
REFUSED_OPTIONS = {
    "resume": ("--resume", "an arms run is not resumed; rerun it (each arm's journal stays in its own directory)"),
    "update_golden": ("--update-golden", "record the golden once with `specparity record`, then run the arms"),
    "golden": ("--golden", "every arm decodes its own baseline: the arms change the baseline's launch too"),
}


def check_arms_options(raw: dict[str, Any]) -> None:
    for dest, (flag, why) in REFUSED_OPTIONS.items():
        if raw.get(dest) not in (None, False, ""):
            raise BadInput(f"{flag}: {why}")


def _run_arms(args: argparse.Namespace) -> int:
    from specparity.cli.option_table import gate_dests
    from specparity.cli.options import build_setup
    from specparity.engines.server.arm_knobs import parse_arms
    from specparity.engines.libraries import configure_libraries
    from specparity.run.arm_plan import engine_kind, plan_arms, target_is_hybrid
    from specparity.cli.outcome import run_shown
    from specparity.run.arm_runs import run_arms, terminal_lines, write_arms

    configure_libraries(args.verbose)
    raw = {dest: getattr(args, dest) for dest in gate_dests()}
    check_arms_options(raw)
    setup = build_setup(raw, check_report=True)
    engine, _server = engine_kind(setup)
    try:
        arms = parse_arms(args.arms, engine, hybrid=target_is_hybrid(setup.engine_options.target))
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if args.arms is None and setup.engine_options.baseline_urls and not args.prelaunched:
        arms = tuple(a for a in arms if not a.launch)  # running servers: only what needs no launch change
    if not arms:
        raise BadInput(f"--arms: engine {engine!r} supports no arm")
    plans = plan_arms(setup, arms, prelaunched=args.prelaunched)
    root = setup.config.report_dir or ARMS_REPORT
    return run_shown(args, lambda say: run_arms(plans, engine, root, say=say), write_arms, terminal_lines, "arms")


def add_arms_command(sub: Any) -> None:
    from specparity.cli.outcome import EXIT_CODES_EPILOG, add_outcome_options
    from specparity.model.arms import ARMS

    p = sub.add_parser(
        "arms",
        help="run the gate once per configuration arm (deterministic, preempt, prefix-warm, fp8-kv, long, "
        "mamba-slots) and "
        "prove each arm happened",
        description="Run the lossless gate once per configuration arm against one engine and one prompt set, each "
        "arm journalled in REPORT/<arm>/, its proof read from the judged requests and the engine, with the "
        "proof that it is free of the other arms' conditions (an arm not proven is NOT EXERCISED: a failure). "
        "Prints one table; writes REPORT/arms.md and arms.json; exits with the worst arm. "
        "Arms: " + "; ".join(f"{a.name}: {a.description}" for a in ARMS.values()) + ". The other options are those "
        "of `specparity run`.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arms", metavar="A,B,...", default=None,
                   help=f"the arms to run, in this order (default: every arm the engine supports; with "
                   f"--baseline-url/--spec-url and no --prelaunched, those that need no launch change; known: "
                   f"{', '.join(ARMS)})")
    p.add_argument("--prelaunched", action="store_true",
                   help="with --baseline-url/--spec-url: the servers were launched with the arms' settings (see "
                   "docs/ARMS.md); without it an arm that changes the launch is refused there")
    add_outcome_options(p, ARMS_REPORT, "arms.md, arms.json and one directory per arm",
                        "print arms.json on stdout instead of the table")
    p.set_defaults(func=_run_arms)
