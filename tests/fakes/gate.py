"""The gate over fake servers, the way a user runs it (a subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

from fakes.backend import REPO


def run_lossless(engine: str, baseline_url: str, spec_url: str, report: Path, *extra: str,
                 timeout_s: float = 180.0):
    """``pytest suites/lossless --engine ENGINE --baseline-url … --spec-url … --categories math
    --max-new-tokens 16 --report REPORT`` as a subprocess, the way a user runs the gate; returns the
    completed process and the journal's records."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pytest", "suites/lossless", "-q", "-p", "no:cacheprovider", "--engine", engine,
            "--baseline-url", baseline_url, "--spec-url", spec_url, "--categories", "math", "--max-new-tokens", "16",
            "--report", str(report), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
    journal = report / "results.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
    return proc, records
