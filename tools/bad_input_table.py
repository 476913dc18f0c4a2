"""Write the bad-input table of docs/ERRORS.md: every bad input in tests/bad_inputs.py, run for real,
with its exit code and the one line it printed.

    python tools/bad_input_table.py            # rewrites the table in docs/ERRORS.md
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

#: The table sits between these two lines of docs/ERRORS.md; the rest of the page is written by hand.
BEGIN = "<!-- bad-input table: written by tools/bad_input_table.py -->"
END = "<!-- end of the bad-input table -->"
HEAD = "| case | command | exit | the one line |\n|---|---|---:|---|\n"


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for case in CASES:
            if case.make:
                case.make(tmp)
            proc = subprocess.run(case.full_argv(tmp), cwd=ROOT, capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
            line = " / ".join(ln for ln in proc.stderr.splitlines() if ln.strip()).replace(str(tmp) + "/", "").replace(str(tmp), "{tmp}")
            cell = line.replace("|", "\\|")
            rows.append(f"| `{case.id}` | `{case.shown()}` | {proc.returncode} | {cell} |")
            print(f"{case.id}: {proc.returncode}", file=sys.stderr)
    page = ROOT / "docs" / "ERRORS.md"
    text = page.read_text(encoding="utf-8")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    page.write_text(f"{before}{BEGIN}\n{HEAD}" + "\n".join(rows) + f"\n{END}{after}", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
