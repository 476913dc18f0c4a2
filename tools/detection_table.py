"""How many prompts catch each deliberately broken loop, and how many false alarms the correct ones raise.

Runs every broken loop in ``tests/broken_loops.py`` (hand-written draft loop) and
``tests/broken_dflash.py`` (hand-copied DFlash loop), their correct versions and the built-in
``hf``/``dflash`` engines over a prompt suite, and prints a markdown table: prompts per verdict
class, prompts caught (any class but ``exact`` and ``near_tie``) and whether the gate passes.

It only calls ``run_gate`` and reads verdict classes, so it also runs against an older checkout
(``--repo``: prepend that tree to ``sys.path``) to give the "before" column of
``docs/notes/findings.md``::

    python tools/detection_table.py                       # this checkout
    git worktree add /tmp/before <rev>
    python tools/detection_table.py --repo /tmp/before --prompts prompts/default.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(HERE), help="checkout whose specparity and tests/ to run (default: this one)")
    ap.add_argument("--prompts", default=str(HERE / "prompts" / "default.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--only", default=None, help="comma-separated loop names to run")
    ap.add_argument("--json", default=None, help="write the rows here too")
    ap.add_argument("--shifted-scorer", action="store_true",
                    help="score teacher-forced one position late (tests/fault_engines.py RescoredEngine, from this checkout)")
    args = ap.parse_args()
    repo = Path(args.repo).resolve()
    sys.path[:0] = [str(repo), str(repo / "tests")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from broken_dflash import BENIGN, BUGS as DFLASH_BUGS, DFlashLoopEngine, model_options
    from broken_loops import BUGS, LoopEngine
    from specparity.engines import load_engine
    from specparity.engines.base import EngineOptions
    from specparity.model.locations import fixture_dir
    from specparity.model.prompts import load_prompts
    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import run_gate

    hf = EngineOptions(target=str(fixture_dir("target")), draft=str(fixture_dir("draft")), spec_mode="draft")
    loops = {"hf (built-in)": lambda: load_engine("hf", hf), "dflash (built-in)": lambda: load_engine("dflash", EngineOptions()),
             "hf-loop: correct": lambda: LoopEngine(hf, None), "dflash-loop: correct": lambda: DFlashLoopEngine(model_options(), None)}
    loops.update({f"hf-loop: {b}": (lambda b=b: LoopEngine(hf, b)) for b in BUGS})
    loops.update({f"dflash-loop: {b}": (lambda b=b: DFlashLoopEngine(model_options(), b)) for b in [*DFLASH_BUGS, *BENIGN]})
    if args.only:
        wanted = set(args.only.split(","))
        loops = {k: v for k, v in loops.items() if k.split(": ")[-1] in wanted or k in wanted}
    if args.shifted_scorer:
        import importlib.util

        spec = importlib.util.spec_from_file_location("fault_engines_here", HERE / "tests" / "fault_engines.py")
        faults = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(faults)
        loops = {k: (lambda make=make: faults.RescoredEngine(make(), shift=1)) for k, make in loops.items()}
    prompts = load_prompts(args.prompts).prompts
    rows = []
    print(f"| loop | exact | near_tie | drifted | diverged | error | caught | threshold (nats) | gate |"
          f"  ({len(prompts)} prompts, {repo})")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make in loops.items():
        t0 = time.time()
        engine = make()
        try:
            run = run_gate(engine, prompts, GateConfig(max_new_tokens=args.max_new_tokens))
        finally:
            engine.close()
        counts = Counter(r.verdict.klass if r.verdict else "not run" for r in run.records)
        caught = sum(n for k, n in counts.items() if k not in ("exact", "near_tie"))
        refused = getattr(run, "calibration_error", None)
        if refused:
            counts, caught = Counter(), 0
        act = run.activity()
        inactive = act.reported_requests and act.accepted == 0
        gate = "refused (exit 3)" if refused else "FAIL" if caught or inactive else "pass"
        threshold = f"{run.threshold.nats:.3g}" if run.threshold else "-"
        rows.append({"loop": name, **counts, "caught": caught, "gate": gate, "threshold": threshold,
                     "seconds": round(time.time() - t0, 1)})
        print(f"| {name} | {counts['exact']} | {counts['near_tie']} | {counts['drifted']} | {counts['diverged']} | "
              f"{counts['error']} | {caught} | {threshold} | {gate}{' (inactive)' if inactive else ''} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
