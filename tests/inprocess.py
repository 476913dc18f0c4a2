"""Run a gate suite or the CLI inside the test process, as a child ``pytest`` would, minus its start-up.

A child process pays for importing torch, transformers and dflash again (about 4 s of the 5–8 s a
one-prompt gate takes on a 2-core machine); the gate itself then runs in well under a second. Tests
whose subject is the gate's verdict, its reports or its exit status, not the process around it, run
it here: :func:`run_pytest` calls ``pytest.main`` (a nested session, as pytest's own ``pytester``
runs one in-process) and :func:`run_cli` calls ``specparity.cli.commands.main``; both return the exit status
and everything printed.

What a child is still needed for, and keeps: signals (Ctrl-C, SIGTERM, a killed server), the
pytest-xdist controller, an installed wheel or entry point, a shell script, a process whose
``import torch`` fails.
"""

from __future__ import annotations

import io
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from specparity.model.locations import REPO_ROOT

#: Installed pytest plugins the gate suites never use; a child ``pytest`` leaves them out too.
QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:syrupy")


class _Environment:
    """``os.environ`` and the working directory for one nested run, restored afterwards."""

    def __init__(self, env: Mapping[str, str | None], cwd: Path):
        self.env, self.cwd = env, cwd

    def __enter__(self) -> None:
        self.saved_env = dict(os.environ)
        self.saved_cwd = os.getcwd()
        for key, value in self.env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.chdir(self.cwd)

    def __exit__(self, *exc: object) -> None:
        os.chdir(self.saved_cwd)
        os.environ.clear()
        os.environ.update(self.saved_env)


def _test_modules(names: Iterator[str]) -> list[str]:
    """Modules a nested session imported from test files or conftests (``test_lossless``,
    ``conftest``): they are collected afresh by the next session, as in a new process."""
    out = []
    for name in names:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None) or ""
        base = Path(path).name
        if base == "conftest.py" or (base.startswith("test_") and base.endswith(".py")):
            out.append(name)
    return out


def run_pytest(*args: str | Path, cwd: Path = REPO_ROOT, env: Mapping[str, str | None] | None = None) -> tuple[int, str]:
    """``pytest ARGS`` in this process from ``cwd``: (exit status, stdout and stderr together).

    ``SPECPARITY_POLICY`` and the xdist worker variables of the surrounding run are unset, as in a
    fresh shell; ``env`` adds or (with ``None``) removes more.
    """
    # The surrounding session's own test modules and conftests (``test_probes`` when the whole suite
    # collects suites/) step aside, so the nested session imports its files afresh, as a new process
    # would, and finds no module of the same name imported from another path.
    outer = {name: sys.modules.pop(name) for name in _test_modules(iter(list(sys.modules)))}
    saved_path = list(sys.path)
    out = io.StringIO()
    environment = {"HF_HUB_OFFLINE": "1", "SPECPARITY_POLICY": None, "PYTEST_XDIST_WORKER": None,
                   "PYTEST_XDIST_WORKER_COUNT": None, "PYTEST_XDIST_TESTRUNUID": None, **(env or {})}
    try:
        with _Environment(environment, cwd), redirect_stdout(out), redirect_stderr(out):
            code = pytest.main([*QUIET_PLUGINS, *(str(a) for a in args)])
    finally:
        sys.path[:] = saved_path
        for name in _test_modules(iter(list(sys.modules))):
            sys.modules.pop(name, None)
        sys.modules.update(outer)
    return int(code), out.getvalue()


def run_cli(*args: str | Path, cwd: Path = REPO_ROOT, env: Mapping[str, str | None] | None = None) -> tuple[int, str]:
    """``specparity ARGS`` in this process: (exit status, stdout and stderr together)."""
    from specparity.cli import commands as cli

    out = io.StringIO()
    environment = {"HF_HUB_OFFLINE": "1", "SPECPARITY_POLICY": None, **(env or {})}
    saved_path = list(sys.path)
    try:
        with _Environment(environment, cwd), redirect_stdout(out), redirect_stderr(out):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as exc:  # argparse and pytest.main callers end with SystemExit
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.path[:] = saved_path
    return int(code), out.getvalue()
