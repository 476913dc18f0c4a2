"""Bad input: one line naming the option or file:line, before any model loads, exit code 4.

Each case of ``tests/bad_inputs.py`` runs as the real command a user types. "Before any model
loads" shows as: stderr is the single error line (transformers' "Loading weights" progress, a
traceback or a pytest collection error would add lines), and stdout has no test result. The same
cases, with their real output, make the bad-input table in ``docs/ERRORS.md``; a case missing there fails.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from bad_inputs import CASES, REPO, Case
from specparity import exitcodes


def run_case(case: Case, tmp) -> subprocess.CompletedProcess[str]:
    if case.make:
        case.make(tmp)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(case.full_argv(tmp), cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def error_line(case: Case, proc: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{case.id}: expected one line on stderr, got:\n{proc.stderr[-3000:]}"
    return lines[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_with_exit_code_4(case, tmp_path):
    proc = run_case(case, tmp_path)
    line = error_line(case, proc)
    assert proc.returncode == exitcodes.BAD_INPUT, f"{case.id}: exit {proc.returncode}\n{proc.stdout[-2000:]}{line}"
    # pytest's usage-error line, or the CLI's own (`specparity lossless` is pytest underneath)
    assert line.startswith(("ERROR: specparity: ", "specparity: error: ")), line
    assert case.expect.replace("{tmp}", str(tmp_path)) in line, line
    assert "passed" not in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


def test_docs_table_lists_every_case():
    table = (REPO / "docs" / "ERRORS.md").read_text()
    missing = [c.id for c in CASES if f"| `{c.id}` |" not in table]
    assert not missing, f"docs/ERRORS.md lacks {missing}: run python tools/bad_input_table.py"
