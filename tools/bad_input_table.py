"""Write docs/BAD_INPUT.md: every bad input in tests/bad_inputs.py, run for real, with its exit code
and the one line it printed.

    python tools/bad_input_table.py            # rewrites docs/BAD_INPUT.md
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bad_inputs import CASES  # noqa: E402

INTRO = """# Bad input: one line, exit code 4

Every option, path, engine and prompt file is checked once, before any model loads. A bad one
prints **one line** naming the option (or `file:line`) and what was expected, and the command
exits with **4** — distinct from a gate failure (1). Exit codes (`specparity/exitcodes.py`, the
same for `pytest suites/…` and `specparity …`):

| code | meaning |
|---:|---|
| 0 | the gate passed (probes: every probe ok, warn or unknown) |
| 1 | the gate failed, whatever tests were selected (`-k`, node ids, `--lf`, `-n`), or a probe predicts a failure |
| 2 | interrupted (Ctrl-C); `summary.md` and the journal's last line say `INTERRUPTED` |
| 3 | the engine could not load or start, or an internal error: no verdict was reached |
| 4 | bad input (this page) |

Every case below was run for real by `python tools/bad_input_table.py` (which wrote this table)
and is asserted by `tests/test_bad_input.py`; scratch paths are shortened to their file name.

| case | command | exit | the one line |
|---|---|---:|---|
"""


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for case in CASES:
            if case.make:
                case.make(tmp)
            proc = subprocess.run(case.full_argv(tmp), cwd=ROOT, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            line = " / ".join(ln for ln in proc.stderr.splitlines() if ln.strip()).replace(str(tmp) + "/", "")
            cell = line.replace("|", "\\|")
            rows.append(f"| `{case.id}` | `{case.shown()}` | {proc.returncode} | {cell} |")
            print(f"{case.id}: {proc.returncode}", file=sys.stderr)
    (ROOT / "docs" / "BAD_INPUT.md").write_text(INTRO + "\n".join(rows) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
