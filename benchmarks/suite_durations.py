"""How long the whole test suite takes, and where the time goes, per file.

Runs the README's test command (``pytest -n auto``, plus ``-p no:cacheprovider --durations=0 -q``)
in a child process and prints:

* its wall time, the CPU time of everything it started (workers, child gate runs, llama-servers),
  and its closing line (passed / failed / skipped);
* a table of seconds per test file (call + setup + teardown of the file's tests, as pytest's
  ``--durations=0`` reports them), longest first;
* the speed of this machine just before and just after the run (a fixed pure-Python loop): on a
  shared VM it moves by a quarter between two minutes, and the suite's wall time with it, so a
  comparison between two runs is only as good as these two numbers agree.

``--save FILE`` writes the numbers as JSON; ``--compare FILE`` adds the saved run's seconds as a
"before" column. Arguments after ``--`` replace ``-n auto`` (e.g. ``-- -n 2 tests/test_cli.py``).

    python benchmarks/suite_durations.py --save after.json --compare before.json

Exit status: pytest's own (a benchmark of a failing suite is not a measurement to keep).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DURATION = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+?)::(\S+)")
SUMMARY = re.compile(r"^=*\s*(\d+ (passed|failed).*) in [0-9.]+s")


def machine_speed() -> float:
    """Seconds for a fixed pure-Python loop (the suite is mostly interpreter-bound work)."""
    start = time.perf_counter()
    total = 0
    for i in range(3_000_000):
        total += i * i
    return time.perf_counter() - start


def per_file(output: str) -> tuple[dict[str, float], dict[str, int]]:
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    for line in output.splitlines():
        match = DURATION.match(line.strip())
        if match:
            secs, _, path, test = match.groups()
            seconds[path] += float(secs)
            tests[path].add(test)
    return dict(seconds), {path: len(names) for path, names in tests.items()}


def closing_line(output: str) -> str:
    for line in reversed(output.splitlines()):
        match = SUMMARY.match(line.strip())
        if match:
            return match.group(1)
    return "(no summary line: see the output above)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", type=Path, help="write this run's numbers as JSON")
    ap.add_argument("--compare", type=Path, help="a JSON file saved by --save: its seconds per file as 'before'")
    ap.add_argument("--top", type=int, default=25, help="files in the table (default %(default)s)")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest arguments instead of -n auto")
    args = ap.parse_args(argv)
    before = json.loads(args.compare.read_text()) if args.compare else None

    cmd = [sys.executable, "-m", "pytest", *(args.pytest_args or ["-n", "auto"]), "-p", "no:cacheprovider",
           "--durations=0", "-q"]
    speed_before = machine_speed()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    speed_after = machine_speed()

    seconds, counts = per_file(proc.stdout)
    result = {"command": " ".join(cmd[2:]), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
              "summary": closing_line(proc.stdout), "exit_code": proc.returncode,
              "machine_speed_s": [round(speed_before, 3), round(speed_after, 3)],
              "test_seconds": round(sum(seconds.values()), 1),
              "files": {path: {"seconds": round(s, 2), "tests": counts[path]} for path, s in seconds.items()}}

    print(f"`{result['command']}`: {result['summary']}")
    print(f"wall {int(wall // 60)} min {wall % 60:.0f} s; CPU of everything it ran {cpu:.0f} s; "
          f"test time summed over files {result['test_seconds']:.0f} s; "
          f"machine speed (fixed loop) {speed_before:.2f} s before, {speed_after:.2f} s after")
    if before:
        print(f"before: wall {before['wall_s']:.0f} s, CPU {before['cpu_s']:.0f} s, test time "
              f"{before['test_seconds']:.0f} s, machine speed {before['machine_speed_s']}")
    print()
    header = "| file | tests | s |" + (" before s |" if before else "")
    print(header)
    print("|---|---:|---:|" + ("---:|" if before else ""))
    for path, secs in sorted(seconds.items(), key=lambda kv: -kv[1])[:args.top]:
        row = f"| `{path}` | {counts[path]} | {secs:.1f} |"
        if before:
            old = before["files"].get(path, {}).get("seconds")
            row += f" {old:.1f} |" if old is not None else " – |"
        print(row)
    if args.save:
        args.save.write_text(json.dumps(result, indent=1) + "\n")
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-2000:], file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
