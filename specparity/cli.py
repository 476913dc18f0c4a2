"""The ``specparity`` console script.

Subcommands register themselves on one argparse parser (``add_<name>_command``) so other
commands (``lossless`` …) can be added next to ``probe`` without touching its code. Bad input
(unreadable or hostile checkpoints, a malformed ``--engine``) prints one line and exits 2; a
predicted failure exits 1; everything ok/warn/unknown exits 0.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from specparity.checkpoints import CheckpointError
from specparity.probes.capabilities import EngineSpecError
from specparity.probes.sglang_source import SourceError

EXIT_OK, EXIT_PREDICTED_FAILURE, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
INPUT_ERRORS = (CheckpointError, EngineSpecError, SourceError, ValueError, OSError)


def _run_probe(args: argparse.Namespace) -> int:
    from specparity.probes import live
    from specparity.probes.report import print_report
    from specparity.probes.runner import ProbeInputs, prepare, run_static
    from specparity.probes.verdict import Status

    ctx = prepare(ProbeInputs(args.target, args.draft, args.engine, args.launch_flags, args.sglang_source, args.wheel_cache))
    verdicts = run_static(ctx)
    if args.live_engine:
        from specparity.engines import load_engine
        from specparity.engines.base import EngineOptions

        engine = load_engine(args.live_engine, EngineOptions(target=args.target, draft=args.draft))
        try:
            verdicts.append(live.first_decode(engine))
            recorded = args.recorded_accept_length
            if recorded is None and args.accept_record:
                recorded = live.load_recorded(args.accept_record, engine.fingerprint())
            verdicts.append(live.acceptance_floor(engine, floor=args.accept_floor, recorded=recorded,
                                                  relative=args.accept_relative))
            if args.stress_requests:
                verdicts.append(live.mamba_stress(engine, requests=args.stress_requests))
        finally:
            engine.close()
    print_report(verdicts, sys.stdout, args.format)
    return EXIT_PREDICTED_FAILURE if any(v.status is Status.FAIL for v in verdicts) else EXIT_OK


def add_probe_command(sub: Any) -> None:
    from specparity.probes.live import DEFAULT_FLOOR, DEFAULT_RELATIVE
    from specparity.probes.runner import DEFAULT_WHEEL_CACHE

    p = sub.add_parser(
        "probe",
        help="predict engine-side failures of a target/draft pair before deploying",
        description="Static probes (checkpoint headers, configs, engine source) and, with --live-engine, "
        "live probes against a running engine. Exit 1 on a predicted failure, 0 when every probe is "
        "ok, warn or unknown, 2 on bad input.",
    )
    p.add_argument("--target", required=True, help="target checkpoint directory")
    p.add_argument("--draft", help="draft checkpoint directory")
    p.add_argument("--engine", required=True, help="name==version: sglang, vllm or llamacpp (e.g. sglang==0.5.19)")
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
    p.set_defaults(func=_run_probe)


def _run_lossless(args: argparse.Namespace) -> int:
    import pytest

    from specparity.fixtures import REPO_ROOT

    return int(pytest.main([str(REPO_ROOT / "suites" / "lossless"), "--rootdir", str(REPO_ROOT), *args.pytest_args]))


def add_lossless_command(sub: Any) -> None:
    p = sub.add_parser(
        "lossless",
        help="run the lossless gate (pytest suites/lossless); extra arguments go to pytest",
        description="Same as `pytest suites/lossless ARGS`: e.g. `specparity lossless --engine dflash --dtype bfloat16`.",
    )
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="options for the gate / pytest")
    p.set_defaults(func=_run_lossless)


COMMANDS: tuple[Callable[[Any], None], ...] = (add_probe_command, add_lossless_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specparity", description="Correctness gate for speculative decoders.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lossless":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "lossless":
        args.pytest_args = [*args.pytest_args, *extra]
    try:
        return int(args.func(args))
    except INPUT_ERRORS as exc:
        if args.debug:
            raise
        print(f"specparity: error: {exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # never a traceback for the operator; --debug shows it
        if args.debug:
            raise
        print(f"specparity: internal error: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
