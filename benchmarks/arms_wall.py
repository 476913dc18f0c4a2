"""What `specparity arms` costs against plain gate runs, and where its time goes.

Runs, in child processes and in this order:

* one plain ``specparity run`` with the given options (the preset as is), timed from the outside;
* ``specparity arms`` with the same options and ``--arms``, timed from the outside; each arm records in
  its ``arm.json`` how long its launch (both servers started, one after the other), its gate run and
  the whole arm (launch, run, proof, shutdown) took.

and prints one table: per arm its launch, gate and total seconds, the plain run's total beside it, and
what is shared between arms. Nothing is shared today: every arm launches its own two servers and
decodes its own baseline (most arms change the baseline's launch too). The last column says, per arm,
what a baseline shared with the ``default`` arm would save — its baseline's launch (half the arm's
launch: the two servers start one after the other) and its gate's baseline phase (the baseline's decode
and teacher-forced scoring, calibration prompts included, from the arm's journal timings) — and only for an arm whose launch
leaves the baseline as the default arm's (its launch change is "nothing").

    python benchmarks/arms_wall.py --report reports/arms-bench --arms default,preempt,prefix-warm -- \\
        --engine vllm --preset vllm-ngram --target fixtures/models/target \\
        --engine-opt "server_args=--enforce-eager --max-model-len 2048"

Exit status: 0 when both commands ran (whatever their verdicts), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

#: The journal timings (``summary.md``'s "Time" table, ``results.jsonl``'s ``timings`` record) that are
#: the baseline's side of a gate run: its decode and teacher-forced scoring, calibration prompts included.
BASELINE_PHASES = ("baseline_phase_wall",)


def timed(argv: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    code = subprocess.call(argv)
    return time.perf_counter() - t0, code


def journal_timings(report: Path) -> dict[str, float]:
    """The run's phase timings: the ``timings`` records of ``results.jsonl``, summed per phase (as the
    journal reader does)."""
    path = report / "results.jsonl"
    found: dict[str, float] = {}
    if not path.is_file():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") == "timings" and isinstance(row.get("timings"), dict):
            for key, value in row["timings"].items():
                if isinstance(value, (int, float)):
                    found[key] = found.get(key, 0.0) + float(value)
    return found


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", required=True, help="folder for the plain run (plain/) and the arms (arms/)")
    ap.add_argument("--arms", required=True, help="the arms to run (as `specparity arms --arms`)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the options both commands take")
    args = ap.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    out = Path(args.report)
    cli = [sys.executable, "-m", "specparity.cli.commands"]
    plain_s, plain_code = timed([*cli, "run", *rest, "--report", str(out / "plain")])
    arms_s, arms_code = timed([*cli, "arms", *rest, "--arms", args.arms, "--report", str(out / "arms")])
    try:
        table = json.loads((out / "arms" / "arms.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"arms_wall: no arms.json under {out / 'arms'} ({exc})", file=sys.stderr)
        return 1
    print(f"plain `specparity run`: {plain_s:.1f} s (exit {plain_code}); `specparity arms --arms {args.arms}`: "
          f"{arms_s:.1f} s (exit {arms_code})")
    print()
    print("| arm | launch s | gate s | arm total s | plain run s | arm − plain s | baseline-side s | "
          "a shared baseline would save s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    saving_total = 0.0
    for row in table.get("results", []):
        wall = row.get("wall_s") or {}
        phases = journal_timings(Path(row.get("report_dir") or out / "arms" / row["arm"]))
        baseline_side = sum(phases.get(k, 0.0) for k in BASELINE_PHASES)
        launch = wall.get("launch")
        shareable = row["arm"] == "default" or row.get("launch") == "nothing"
        saving = (launch or 0.0) / 2 + baseline_side if shareable and row["arm"] != "default" else 0.0
        saving_total += saving
        total = wall.get("total")
        print(f"| {row['arm']} | {fmt(launch)} | {fmt(wall.get('gate'))} | {fmt(total)} | {plain_s:.1f} | "
              f"{fmt(None if total is None else total - plain_s)} | {baseline_side:.1f} | "
              f"{saving:.1f}{'' if shareable else ' (its launch differs)'} |")
    print()
    print(f"arms in all: {arms_s:.1f} s for {len(table.get('results', []))} arm(s); one plain run each would be "
          f"{plain_s * len(table.get('results', [])):.1f} s; sharing the default arm's baseline would save "
          f"{saving_total:.1f} s")
    return 0 if plain_code not in (3, 4) and arms_code not in (3, 4) else 1


if __name__ == "__main__":
    sys.exit(main())
