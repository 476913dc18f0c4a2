"""The ``specparity`` console script.

Subcommands register themselves on one argparse parser (``add_<name>_command`` functions listed in
:data:`COMMANDS`, a tuple other modules may extend) so a command is added without touching the
others. ``specparity run`` runs the lossless gate without pytest; ``specparity lossless ARGS`` hands
``ARGS`` to pytest on the gate's test module shipped in the package, untouched. Exit codes are those
of :mod:`specparity.gate.exitcodes` (the ``--help`` epilog lists them); :func:`main` maps every failure to
one of them in one place: bad input (an option, unreadable or hostile checkpoints, a malformed
``--engine``) prints one line and exits 4, an exception carrying an ``exit_code`` attribute
(``session.EngineLoadFailed``: 3, ``session.PolicyUnsupported``: 4, ``session.ReportWriteFailed``: 3)
prints one line and exits with it, Ctrl-C (or SIGTERM: :mod:`specparity.run.signals`) exits 2, any other
error one line and 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specparity.cli.outcome import (
    EXIT_CODES_EPILOG,
    RUN_JSON_SCHEMA,
    VERBOSE_HELP,
    add_outcome_options,
    print_result,
)
from typing import Any, Callable, Sequence

from specparity.engines.libraries import configure_libraries
from specparity.gate import exitcodes
from specparity.probes.checkpoints import CheckpointError
from specparity.probes.version_facts import EngineSpecError
from specparity.probes.sglang_source import SourceError
from specparity.probes.version_facts import ENGINE_NAMES

INPUT_ERRORS = (CheckpointError, EngineSpecError, SourceError, ValueError, OSError)


def _run_probe(args: argparse.Namespace) -> int:
    from specparity.probes import live
    from specparity.probes.table import print_report
    from specparity.probes.inputs import ProbeInputs, prepare, run_static

    allowed: tuple[str, ...] | None = None
    if args.policy:  # read first: a bad policy is bad input before any probe runs
        from specparity.gate.policy_file import PolicyError, allowed_unknown

        try:
            allowed = allowed_unknown(args.policy)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
    ctx = prepare(ProbeInputs(args.target, args.draft, args.engine, args.launch_flags, args.sglang_source, args.wheel_cache))
    live_spec = None
    if args.live_engine:  # resolved and checked before any probe runs or model loads
        from specparity.engines import check_options, resolve_factory
        from specparity.engines.base import EngineOptions

        factory = resolve_factory(args.live_engine, "--live-engine")
        live_spec = (factory, check_options(factory, EngineOptions(target=args.target, draft=args.draft), args.live_engine))
    verdicts = run_static(ctx)
    if live_spec is not None:
        from specparity.engines import build_engine

        engine = build_engine(live_spec[0], live_spec[1], args.live_engine, "--live-engine")
        try:
            verdicts += live.run_live(engine, live.LiveSettings(
                floor=args.accept_floor, relative=args.accept_relative, recorded=args.recorded_accept_length,
                record_file=args.accept_record, stress_requests=args.stress_requests))
        finally:
            engine.close()
    if allowed is not None:
        from specparity.gate.policy_file import judge_unknown

        verdicts = [judge_unknown(v, allowed, args.policy) for v in verdicts]
    print_report(verdicts, sys.stdout, args.format)
    return probe_exit_code([v.status for v in verdicts], under_policy=allowed is not None)


def probe_exit_code(statuses: Sequence[Any], *, under_policy: bool) -> int:
    """1 for a predicted failure; else, without a policy, :data:`~specparity.gate.exitcodes.PROBE_UNKNOWN`
    for a probe that answered ``unknown`` (an unchecked question is not a pass); else 0. Under a
    policy every unknown was already judged (:func:`~specparity.gate.policy_file.judge_unknown`): a
    failure, or allowed by name."""
    from specparity.probes.finding import Status

    if any(s is Status.FAIL for s in statuses):
        return exitcodes.GATE_FAILED
    if not under_policy and any(s is Status.UNKNOWN for s in statuses):
        return exitcodes.PROBE_UNKNOWN
    return exitcodes.PASS


def add_probe_command(sub: Any) -> None:
    from specparity.probes.live import DEFAULT_FLOOR, DEFAULT_RELATIVE
    from specparity.probes.inputs import DEFAULT_WHEEL_CACHE

    p = sub.add_parser(
        "probe",
        help="predict engine-side failures of a target/draft pair before deploying",
        description="Static probes (checkpoint headers, configs, engine source) and, with --live-engine, "
        "live probes against a running engine. Exit 1 on a predicted failure, 6 when none fails but a "
        "probe answered unknown (with --policy: unknown fails, 1, unless its allow_unknown names the probe), "
        "0 when every probe is ok or warn, 3 when a live engine cannot run, 4 on bad input.",
    )
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--draft", help="draft checkpoint directory")
    p.add_argument("--engine", required=True,
                   help=f"name==version: {', '.join(ENGINE_NAMES[:-1])} or {ENGINE_NAMES[-1]} (e.g. sglang==0.5.19)")
    p.add_argument("--launch-flags", help="the server's launch flags as one string (mamba slot prediction)")
    p.add_argument("--sglang-source", help="SGLang source to read: wheel, unpacked tree or installed package dir")
    p.add_argument("--wheel-cache", default=DEFAULT_WHEEL_CACHE, help="where sglang-<version>-*.whl files are cached")
    p.add_argument("--live-engine", help="engine for the live probes: a built-in name (hf, dflash), "
                   "package.module:factory or path/to/file.py:factory (EngineOptions -> Engine)")
    p.add_argument("--accept-floor", type=float, default=DEFAULT_FLOOR, help="absolute mean-accept-length floor")
    p.add_argument("--accept-relative", type=float, default=DEFAULT_RELATIVE, help="fraction of the recorded accept length")
    p.add_argument("--recorded-accept-length", type=float, help="accept length recorded for this configuration")
    p.add_argument("--accept-record", help="JSON file of recorded accept lengths keyed by engine fingerprint")
    p.add_argument("--stress-requests", type=int, default=0, help="run the mamba stress with N concurrent requests")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--policy", metavar="FILE", help="the gate policy file (ci/policy.toml): a probe answering unknown "
                   "fails unless its allow_unknown names the probe")
    p.set_defaults(func=_run_probe)


#: The package holding the gate's test module (``specparity lossless`` runs pytest on it; a directory, so
#: node ids outside the rootdir read ``test_lossless.py::test_lossless[<id>]``).
SUITE_DIR = Path(__file__).resolve().parents[1] / "suite"
#: ``specparity sweep``'s default report directory (each level in a cN subdirectory).
SWEEP_REPORT = "reports/sweep"



# --------------------------------------------------------------------------- specparity run


class GateProgress:
    """One rich progress bar per phase, on stderr, advanced by the runner's ``progress(msg)`` calls.

    The runner says ``"baseline <id>: N tokens"`` for each baseline (calibration-only prompts
    included), ``"near-tie threshold: …"`` (or ``"calibration refused: …"``) between the phases and
    ``"<id>: <class>"`` for each speculative run; anything else is ignored. Prompt ids hold no spaces
    (prompts schema), so the two forms cannot be confused. ``counts`` keeps what was seen, also
    when the bar is not drawn.
    """

    def __init__(self, baseline_total: int, spec_total: int, console: Any | None = None):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.counts = {"baseline": 0, "speculative": 0}
        self.bar = Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.fields[current]}"),
                            console=console, transient=True, redirect_stdout=False, redirect_stderr=False)
        self.tasks = {
            "baseline": self.bar.add_task("baseline", total=max(baseline_total, 1), current=""),
            "speculative": self.bar.add_task("speculative", total=max(spec_total, 1), current="", start=False),
        }

    def __enter__(self) -> "GateProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.stop()

    def _advance(self, phase: str, current: str) -> None:
        self.counts[phase] += 1
        self.bar.update(self.tasks[phase], completed=self.counts[phase], current=current)

    def __call__(self, msg: str) -> None:
        from specparity.model.verdicts import CLASSES

        if msg.startswith("baseline "):
            self._advance("baseline", msg[len("baseline "):].split(":", 1)[0])
        elif msg.startswith(("near-tie threshold:", "calibration refused")):
            base = self.tasks["baseline"]
            self.bar.update(base, total=max(self.counts["baseline"], 1), completed=max(self.counts["baseline"], 1),
                            current="")
            self.bar.start_task(self.tasks["speculative"])
        else:
            pid, sep, klass = msg.rpartition(": ")
            if sep and " " not in pid and klass in CLASSES:
                self.bar.start_task(self.tasks["speculative"])
                self._advance("speculative", f"{pid}: {klass}")


def _calibration_only(setup: Any) -> int:
    """How many calibration prompts run a baseline only (the runner's ``calibration_records``)."""
    if setup.calibration is None or setup.config.calibration == "selected":
        return 0
    key = lambda p: (p.id, p.prompt, p.messages, p.max_new_tokens)  # noqa: E731 - runner._content
    chosen = {key(p) for p in setup.prompts}
    return sum(key(p) not in chosen for p in setup.calibration)


def _progress_wanted(args: argparse.Namespace, stream: Any) -> bool:
    """The bar only for a person watching: never with --json or --quiet, never when stderr is not a TTY."""
    isatty = getattr(stream, "isatty", None)
    return not (args.json or args.quiet) and callable(isatty) and bool(isatty())


def _error_json(status: str, code: int, message: str) -> dict[str, Any]:
    """``--json`` when no run concluded (bad input, the engine did not load): the same keys a
    machine branches on, no verdict."""
    return {"schema": RUN_JSON_SCHEMA, "status": status, "exit_code": code, "passed": False, "error": message}


def _run_gate(args: argparse.Namespace) -> int:
    from specparity.cli.option_table import gate_dests, shard_dests
    from specparity.cli.options import build_setup
    from specparity.run.setup import BadInput
    from specparity.run.runner import GateInterrupted
    from specparity.run.gate_command import RunRefused, execute

    # As the pytest plugin: never download, no tokenizer fork warnings, no progress bars of the libraries
    # (this command draws its own, or none), their warnings only under --verbose
    configure_libraries(args.verbose)
    raw = {dest: getattr(args, dest) for dest in gate_dests() + shard_dests()}
    try:
        ray = _ray_options(args)
        setup = build_setup(raw, check_report=True)
    except BadInput as exc:
        if args.json:
            print(json.dumps(_error_json("BAD_INPUT", exitcodes.BAD_INPUT, str(exc))))
        raise
    if ray is not None:
        return _run_on_ray(args, setup, ray)
    finished: list[Any] = []
    progress = GateProgress(len(setup.prompts) + _calibration_only(setup), len(setup.prompts),
                            console=_stderr_console()) if _progress_wanted(args, sys.stderr) else None
    try:
        if progress is None:
            result = execute(setup, on_finish=finished.append)
        else:
            with progress:
                result = execute(setup, progress=progress, on_finish=finished.append)
    except GateInterrupted:
        if finished:  # the partial run, concluded: the summary and the journal say INTERRUPTED
            print_result(args, finished[-1])
        raise
    except RunRefused as exc:
        if args.json:
            status = "BAD_INPUT" if exc.exit_code == exitcodes.BAD_INPUT else "ERROR"
            print(json.dumps(_error_json(status, exc.exit_code, str(exc))))
        raise
    print_result(args, result)
    return result.decision.exit_code


def _ray_options(args: argparse.Namespace) -> Any:
    """``--ray`` and its companions, checked before anything loads (None without ``--ray``); Ray itself
    must be importable (the ``[ray]`` extra), else one line naming the extra."""
    from specparity.run.ray_fleet import RayOptions, require_ray
    from specparity.run.setup import BadInput

    companions = [flag for flag, value in (("--ray-pairs", args.ray_pairs), ("--ray-gpus-per-pair", args.ray_gpus_per_pair),
                                           ("--ray-server-host", args.ray_server_host)) if value is not None]
    if not args.ray:
        if companions:
            raise BadInput(f"{companions[0]}: needs --ray ADDRESS")
        return None
    pairs = gpus = None
    if args.ray_pairs is not None:
        try:
            pairs = int(args.ray_pairs)
        except ValueError:
            pairs = 0
        if pairs < 1:
            raise BadInput(f"--ray-pairs {args.ray_pairs}: expected an integer >= 1")
    if args.ray_gpus_per_pair is not None:
        try:
            gpus = float(args.ray_gpus_per_pair)
        except ValueError:
            gpus = -1.0
        if not gpus >= 0:
            raise BadInput(f"--ray-gpus-per-pair {args.ray_gpus_per_pair}: expected a number >= 0")
    require_ray()
    return RayOptions(args.ray, pairs, gpus or 0.0, args.ray_server_host or None)


def _run_on_ray(args: argparse.Namespace, setup: Any, ray: Any) -> int:
    """``specparity run --ray``: the shards on the cluster's server pairs, merged into ``--report``."""
    from specparity.run.gate_command import SessionResult, report_paths_of, write_failed
    from specparity.run.merge import MergeRefused
    from specparity.run.ray_fleet import check_ray_options, run_on_ray
    from specparity.run.runner import conclude
    from specparity.run.setup import BadInput

    try:
        check_ray_options(setup, ray)
    except BadInput as exc:
        if args.json:
            print(json.dumps(_error_json("BAD_INPUT", exitcodes.BAD_INPUT, str(exc))))
        raise
    say = (lambda msg: None) if (args.json or args.quiet) else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        merged, _fleet = run_on_ray(setup, ray, say)
    except MergeRefused as exc:  # the parts themselves disagree: a harness error here, not the operator's input
        print(f"specparity: error: merging the shards failed: {exc}", file=sys.stderr)
        return exitcodes.ENGINE_ERROR
    try:
        decision = conclude(merged.run)
    except OSError as exc:
        from specparity.gate.decision import decide

        raise write_failed(f"--report {setup.config.report_dir}", exc, decide(merged.run).status) from None
    print_result(args, SessionResult(merged.run, decision, report_paths_of(setup.config.report_dir)))
    return decision.exit_code


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr)


def add_run_command(sub: Any) -> None:
    from specparity.cli.option_table import GATE_OPTIONS, SHARD_OPTIONS, add_gate_options

    p = sub.add_parser(
        "run",
        help="run the lossless gate without pytest (same options as `pytest suites/lossless`)",
        description="Decode every selected prompt greedily with and without speculation, diff the token "
        "streams, classify each prompt and apply the gate policy; prints the per-class summary (or --json) "
        "and exits with the gate's exit code. The options are those of `pytest suites/lossless`.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_gate_options(lambda name, description: p.add_argument_group(name, description).add_argument,
                     GATE_OPTIONS + SHARD_OPTIONS)
    fleet = p.add_argument_group("ray", "specparity: the run over a Ray cluster (pip install 'specparity[ray]'; "
                                 "docs/FLEET.md)")
    fleet.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="run one shard per server pair of the Ray cluster at ADDRESS (or auto): the preset's two "
                       "servers launched on a node per pair, or the --baseline-url/--spec-url pairs; a lost pair's "
                       "unfinished prompts rerun once on another; the shards merged into --report")
    fleet.add_argument("--ray-pairs", default=None, metavar="N",
                       help="server pairs to launch from the preset (default: one per live node)")
    fleet.add_argument("--ray-gpus-per-pair", default=None, metavar="G",
                       help="GPUs each pair asks Ray for; its baseline server gets the first half (default 0)")
    fleet.add_argument("--ray-server-host", default=None, metavar="HOST",
                       help="where a launched pair's servers listen (default: the address its node was started "
                       "with; 127.0.0.1 when every node runs on the machine that starts the run)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout (status, exit_code, counts, failures, warnings, threshold, "
                     "fingerprint, per-prompt classes, report files) instead of the summary; no progress bar")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="print only the verdict line and the failures; no progress bar")
    out.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=_run_gate)


# --------------------------------------------------------------------------- specparity sweep


def _run_sweep(args: argparse.Namespace) -> int:
    from specparity.cli.option_table import gate_dests
    from specparity.cli.options import build_setup
    from specparity.cli.sweep import check_sweep_options, parse_levels
    from specparity.cli.outcome import run_shown
    from specparity.run.sweep import check_engine, run_sweep, terminal_lines, write_sweep

    configure_libraries(args.verbose)
    levels = parse_levels(args.levels)
    raw = {dest: getattr(args, dest) for dest in gate_dests()}
    check_sweep_options(raw)
    setup = build_setup(raw, check_report=True)
    check_engine(setup, levels)
    return run_shown(args, lambda say: run_sweep(setup, levels, say=say), write_sweep, terminal_lines, "sweep")


def add_sweep_command(sub: Any) -> None:
    p = sub.add_parser(
        "sweep",
        help="run the gate at several concurrency levels on the same servers and report batch-dependent flips",
        description="Run the lossless gate at each --levels concurrency (lowest first) against one engine built "
        "once, each level journalled in REPORT/cN, then judge each level's speculative output against the lowest "
        "level's (as `specparity compare --old-side spec`): per level the gate's classes and acceptance, and the "
        "batch flips (batch_flip_near_tie passes, batch_flip fails). Writes REPORT/sweep.md and sweep.json. "
        "The other options are those of `specparity run`.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--levels", required=True, metavar="N,M,...",
                   help="requests in flight per phase at each level: two or more distinct positive integers, e.g. 1,4,16")
    add_outcome_options(p, SWEEP_REPORT, "sweep.md, sweep.json and one cN directory per level",
                        "print sweep.json on stdout instead of the summary")
    p.set_defaults(func=_run_sweep)


# --------------------------------------------------------------------------- specparity lossless


def run_lossless(pytest_args: Sequence[str]) -> int:
    """``pytest <the packaged gate module> ARGS`` with the rootdir at the current directory (so
    ``--lf``, relative ``--report`` / ``--prompts`` paths and node ids are the caller's), ARGS
    passed through untouched (a later ``--rootdir`` among them wins)."""
    import pytest

    code = int(pytest.main([str(SUITE_DIR), "--rootdir", os.getcwd(), *pytest_args]))
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:  # e.g. -p no:specparity: the plugin could not map it
        print("specparity: FAIL: nothing judged: no gate test was collected (a run that judges nothing never "
              "passes)", file=sys.stderr)
        return exitcodes.GATE_FAILED
    if code not in (exitcodes.PASS, exitcodes.GATE_FAILED, exitcodes.INTERRUPTED, exitcodes.ENGINE_ERROR,
                    exitcodes.BAD_INPUT):
        return exitcodes.ENGINE_ERROR
    return code


def add_lossless_command(sub: Any) -> None:
    # Only for --help: main() hands everything after "lossless" to pytest before argparse sees it
    # (argparse's REMAINDER with parse_known_args reorders "--engine hf" into "--engine" + "hf").
    sub.add_parser(
        "lossless",
        help="run the lossless gate under pytest (per-prompt tests, --junitxml, -k); every further argument goes to pytest",
        description="Same as `pytest suites/lossless ARGS` in a checkout, from any directory and from an installed "
        "package: e.g. `specparity lossless --engine hf --categories math --junitxml gate.xml`.",
        add_help=False,
    )


#: Subcommand registrars, in --help order. A tuple: another module extends it
#: (``cli.COMMANDS += (add_record_command,)``) before :func:`build_parser` runs.
def _golden_commands() -> tuple[Callable[[Any], None], ...]:
    from specparity.cli.golden_commands import COMMANDS as GOLDEN

    return GOLDEN


def _llamacpp_command(sub: Any) -> None:
    from specparity.cli.llamacpp import add_llamacpp_command

    add_llamacpp_command(sub)


def _arms_command(sub: Any) -> None:
    from specparity.cli.arms import add_arms_command

    add_arms_command(sub)


def _merge_command(sub: Any) -> None:
    from specparity.cli.merge import add_merge_command

    add_merge_command(sub)


def _sample_command(sub: Any) -> None:
    from specparity.cli.sample import add_sample_command

    add_sample_command(sub)


COMMANDS: tuple[Callable[[Any], None], ...] = (add_run_command, _merge_command, add_sweep_command, _arms_command,
                                                *_golden_commands(),
                                                add_lossless_command, add_probe_command, _llamacpp_command,
                                                _sample_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specparity", description="Correctness gate for speculative decoders.",
                                     epilog=EXIT_CODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def error_exit(exc: BaseException) -> int:
    """One line on stderr for ``exc`` and its exit code: an ``exit_code`` attribute wins (e.g.
    ``session.EngineLoadFailed``: 3), bad input is 4, anything else an internal error (3)."""
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        print(f"specparity: error: {exc}".replace("\n", " "), file=sys.stderr)
        return code
    if isinstance(exc, INPUT_ERRORS):
        print(f"specparity: error: {exc}".replace("\n", " "), file=sys.stderr)
        return exitcodes.BAD_INPUT
    print(f"specparity: internal error: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
    return exitcodes.ENGINE_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lossless"]:
        return run_lossless(argv[1:])
    if argv[:1] == ["llamacpp"]:  # its own parser: options shared with tools/llamacpp/, bad ones in one line
        from specparity.cli.llamacpp import main as llamacpp_main

        return llamacpp_main(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2; specparity's bad-input code is 4
        return exitcodes.BAD_INPUT if exc.code not in (0, None) else exitcodes.PASS
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # runner.GateInterrupted included: the face already showed the partial run
        print("specparity: interrupted (Ctrl-C or SIGTERM)", file=sys.stderr)
        return exitcodes.INTERRUPTED
    except Exception as exc:  # never a traceback for the operator; --debug shows it
        if args.debug:
            raise
        return error_exit(exc)


def console_main() -> int:
    """The console script: :func:`main` with SIGTERM ending the run as Ctrl-C does (launched servers
    stopped, finished results kept)."""
    from specparity.run.signals import sigterm_as_interrupt

    with sigterm_as_interrupt():
        return main()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(console_main())
