"""The gate over fake servers, the way a user runs it: a subprocess, or the same pytest command in
this process (no second interpreter to start: the same plugin, options, terminal output, report and
exit code, without the imports a subprocess pays for again)."""

from __future__ import annotations

import json
from pathlib import Path

from fakes.backend import REPO


def run_lossless(engine: str, baseline_url: str, spec_url: str, report: Path, *extra: str,
                 timeout_s: float = 180.0, in_process: bool = False):
    """``pytest suites/lossless --engine ENGINE --baseline-url … --spec-url … --categories math
    --max-new-tokens 16 --calibration selected --report REPORT`` as a subprocess, the way a user runs
    the gate (``in_process``: through ``pytest.main`` here); returns the completed process and the
    journal's records. The noise is measured on the selected prompts only (the default, every prompt
    of the prompt files, would decode the whole suite for a threshold these runs do not examine);
    ``extra`` may name another ``--calibration``."""
    import os
    import subprocess
    import sys

    args = ["suites/lossless", "-q", "-p", "no:cacheprovider", "--engine", engine, "--baseline-url", baseline_url,
            "--spec-url", spec_url, "--categories", "math", "--max-new-tokens", "16", "--calibration", "selected",
            "--report", str(report), *extra]
    if in_process:
        proc = pytest_in_process(args)
    else:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s, env=env)
    journal = report / "results.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
    return proc, records


def pytest_in_process(args: list[str]):
    """``python -m pytest ARGS`` from the repository root, run by ``pytest.main`` in this process:
    a CompletedProcess with its exit code and its terminal output. The inner session's own test
    modules (``suites/``, the root conftest) are dropped from ``sys.modules`` afterwards, so each run
    collects them afresh as a new interpreter would."""
    import contextlib
    import io
    import os
    import subprocess
    import sys

    import pytest

    before = set(sys.modules)
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = pytest.main(list(args))
    finally:
        os.chdir(cwd)
        for name in set(sys.modules) - before:
            path = getattr(sys.modules[name], "__file__", None) or ""
            if path.startswith(str(REPO / "suites")) or path == str(REPO / "conftest.py"):
                del sys.modules[name]
    return subprocess.CompletedProcess(["pytest", *args], int(code), out.getvalue(), err.getvalue())
