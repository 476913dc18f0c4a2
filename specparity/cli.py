"""The ``specparity`` console script.

Subcommands register themselves on one argparse parser (``add_<name>_command``) so other
commands can be added next to ``probe`` without touching its code. ``specparity lossless ARGS``
hands ``ARGS`` to ``pytest suites/lossless`` untouched. Exit codes are those of
:mod:`specparity.exitcodes`: bad input (unreadable or hostile checkpoints, a malformed
``--engine``) prints one line and exits 4; a predicted failure exits 1; everything
ok/warn/unknown exits 0; an internal error exits 3.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from specparity import exitcodes
from specparity.checkpoints import CheckpointError
from specparity.probes.capabilities import EngineSpecError
from specparity.probes.sglang_source import SourceError

INPUT_ERRORS = (CheckpointError, EngineSpecError, SourceError, ValueError, OSError)


def _run_probe(args: argparse.Namespace) -> int:
    from specparity.probes import live
    from specparity.probes.table import print_report
    from specparity.probes.inputs import ProbeInputs, prepare, run_static
    from specparity.probes.finding import Status

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
            verdicts.append(live.first_decode(engine))
            recorded = args.recorded_accept_length
            if recorded is None and args.accept_record:
                recorded = live.load_recorded(args.accept_record, engine.fingerprint())
            verdicts.append(live.acceptance_floor(engine, floor=args.accept_floor, recorded=recorded,
                                                  relative=args.accept_relative))
            if args.stress_requests:
                verdicts.append(live.mamba_stress(engine, requests=args.stress_requests))
            verdicts.append(live.self_draft(engine))
        finally:
            engine.close()
    print_report(verdicts, sys.stdout, args.format)
    return exitcodes.GATE_FAILED if any(v.status is Status.FAIL for v in verdicts) else exitcodes.PASS


def add_probe_command(sub: Any) -> None:
    from specparity.probes.live import DEFAULT_FLOOR, DEFAULT_RELATIVE
    from specparity.probes.inputs import DEFAULT_WHEEL_CACHE

    p = sub.add_parser(
        "probe",
        help="predict engine-side failures of a target/draft pair before deploying",
        description="Static probes (checkpoint headers, configs, engine source) and, with --live-engine, "
        "live probes against a running engine. Exit 1 on a predicted failure, 0 when every probe is "
        "ok, warn or unknown, 4 on bad input.",
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


def run_lossless(pytest_args: Sequence[str]) -> int:
    """``pytest suites/lossless ARGS`` from any directory, ARGS passed through untouched."""
    import pytest

    from specparity.fixtures import REPO_ROOT

    return int(pytest.main([str(REPO_ROOT / "suites" / "lossless"), "--rootdir", str(REPO_ROOT), *pytest_args]))


def add_lossless_command(sub: Any) -> None:
    # Only for --help: main() hands everything after "lossless" to pytest before argparse sees it
    # (argparse's REMAINDER with parse_known_args reorders "--engine hf" into "--engine" + "hf").
    sub.add_parser(
        "lossless",
        help="run the lossless gate (pytest suites/lossless); every further argument goes to pytest",
        description="Same as `pytest suites/lossless ARGS`: e.g. `specparity lossless --engine hf --categories math`.",
        add_help=False,
    )


COMMANDS: tuple[Callable[[Any], None], ...] = (add_probe_command, add_lossless_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specparity", description="Correctness gate for speculative decoders.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lossless"]:
        return run_lossless(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2; specparity's bad-input code is 4
        return exitcodes.BAD_INPUT if exc.code not in (0, None) else exitcodes.PASS
    try:
        return int(args.func(args))
    except INPUT_ERRORS as exc:
        if args.debug:
            raise
        print(f"specparity: error: {exc}".replace("\n", " "), file=sys.stderr)
        return exitcodes.BAD_INPUT
    except Exception as exc:  # never a traceback for the operator; --debug shows it
        if args.debug:
            raise
        print(f"specparity: internal error: {type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        return exitcodes.ENGINE_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
