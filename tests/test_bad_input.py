"""Bad input: one line naming the option or file:line, before any model loads, exit code 4.

Every case of ``tests/bad_inputs.py`` is checked in this process (``bad_inputs.run_in_process``):
``pytest …`` through pytest's own option parsing and every plugin's and conftest's
``pytest_configure`` (where specparity refuses bad options, before collection, so before any model
loads), ``specparity …`` through ``cli.main``. :data:`END_TO_END` cases also run as the real
command, a process, where "before any model loads" shows as: stderr is the single error line
(transformers' "Loading weights" progress, a traceback or a pytest collection error would add
lines), and stdout has no test result. The same cases, with their real output, make the bad-input
table in ``docs/ERRORS.md``; a case missing there fails.
"""

from __future__ import annotations

import pytest

from bad_inputs import CASES, END_TO_END, REPO, Case, Outcome, in_process, run_in_process, run_process
from specparity.gate import exitcodes


def error_line(case: Case, out: Outcome) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{case.id}: expected one line on stderr, got:\n{out.stderr[-3000:]}"
    return lines[0]


def check(case: Case, out: Outcome, tmp_path) -> None:
    line = error_line(case, out)
    assert out.code == exitcodes.BAD_INPUT, f"{case.id}: exit {out.code}\n{out.stdout[-2000:]}{line}"
    # pytest's usage-error line, or the CLI's own (`specparity lossless` is pytest underneath)
    assert line.startswith(("ERROR: specparity: ", "specparity: error: ")), line
    assert case.expect.replace("{tmp}", str(tmp_path)) in line, line
    assert "passed" not in out.stdout and "Traceback" not in out.stdout + out.stderr


@pytest.mark.parametrize("case", [c for c in CASES if in_process(c)], ids=[c.id for c in CASES if in_process(c)])
def test_bad_input_is_one_line_with_exit_code_4(case, tmp_path):
    check(case, run_in_process(case, tmp_path), tmp_path)


@pytest.mark.parametrize("case_id", END_TO_END)
def test_bad_input_end_to_end(case_id, tmp_path):
    (case,) = [c for c in CASES if c.id == case_id]
    check(case, run_process(case, tmp_path), tmp_path)


def test_every_case_is_checked():
    """A case that cannot run in this process must run as a process here."""
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), "duplicate case ids"
    assert set(END_TO_END) <= set(ids), sorted(set(END_TO_END) - set(ids))
    only_process = [c.id for c in CASES if not in_process(c)]
    assert set(only_process) <= set(END_TO_END), f"add {only_process} to END_TO_END"


def test_docs_table_lists_every_case():
    table = (REPO / "docs" / "ERRORS.md").read_text()
    missing = [c.id for c in CASES if f"| `{c.id}` |" not in table]
    assert not missing, f"docs/ERRORS.md lacks {missing}: run python tools/bad_input_table.py"
