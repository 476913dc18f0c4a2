"""Benchmark the lossless gate: where the time goes, and how fast the comparison is.

Prints markdown tables:

1. wall time of ``pytest suites/lossless`` (a subprocess, as a user runs it);
2. the split of one in-process run of the default suite between baseline decode, speculative
   decode, teacher-forced scoring, comparison, and the harness's own overhead;
3. the comparison's throughput on long synthetic streams (up to 128K tokens).

Usage: ``python benchmarks/lossless_suite.py [--engine hf] [--skip-pytest] [--reps 3]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specparity.judge.compare import compare  # noqa: E402
from specparity.engines import load_engine  # noqa: E402
from specparity.engines.base import EngineOptions  # noqa: E402
from specparity.model.locations import REPO_ROOT  # noqa: E402
from specparity.model.gate_run import GateConfig  # noqa: E402
from specparity.judge.noise import measure_noise  # noqa: E402
from specparity.model.prompts import load_prompts  # noqa: E402
from specparity.run.runner import run_gate  # noqa: E402
from specparity.model.types import DEFAULT_TOP_K, GenerationResult, SpecStats, TokenScores  # noqa: E402


def pytest_wall(engine: str | None) -> float:
    cmd = [sys.executable, "-m", "pytest", "suites/lossless", "-q", "-p", "no:cacheprovider", "--report", ""]
    if engine:
        cmd += ["--engine", engine]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"pytest suites/lossless failed (exit {proc.returncode})")
    return wall


def split(engine_name: str) -> tuple[dict[str, float], int, int]:
    engine = load_engine(engine_name, EngineOptions())
    prompts = load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts
    run = run_gate(engine, prompts, GateConfig())
    engine.close()
    tokens = sum(len(r.baseline.output_ids) + len(r.spec.output_ids) for r in run.records if r.spec and r.baseline)
    return dict(run.timings), len(prompts), tokens


def synthetic(n: int, k: int = DEFAULT_TOP_K, seed: int = 0) -> tuple[list[int], TokenScores]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 4000, n)
    top_ids = np.concatenate([ids[:, None], rng.integers(4000, 8000, (n, k - 1))], axis=1)
    top_lp = -np.sort(rng.random((n, k)).astype(np.float32) * 5, axis=1)
    return ids.tolist(), TokenScores(ids, top_lp[:, 0].copy(), top_ids, top_lp)


def compare_throughput(n: int, case: str, reps: int) -> float:
    ids, scores = synthetic(n)
    spec_ids = list(ids)
    spec_scores = scores
    if case == "flip-mid":
        spec_ids[n // 2] = int(scores.top_ids[n // 2, 1])
    elif case == "all-wrong":
        spec_ids = [t + 1 for t in ids]
        spec_scores = TokenScores(np.array(spec_ids), scores.logprobs, scores.top_ids, scores.top_logprobs)
    base = GenerationResult("b", ids, "", "length", scores, SpecStats.unavailable("bench"))
    spec = GenerationResult("s", spec_ids, "", "length", spec_scores, SpecStats.unavailable("bench"))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        compare("p", "c", base, spec, spec_scores, threshold=10.0, max_new_tokens=n, stop_ids=[0],
                decode=lambda x: f"<{len(x)} tokens>")
        measure_noise([(scores, scores)])
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=None, help="engine for the suite (default: the plugin's default)")
    ap.add_argument("--skip-pytest", action="store_true", help="skip the pytest subprocess timing")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    if not args.skip_pytest:
        wall = pytest_wall(args.engine)
        print("| command | wall s |\n|---|---|")
        print(f"| pytest suites/lossless{' --engine ' + args.engine if args.engine else ''} | {wall:.1f} |\n")
    from specparity.cli.option_table import DEFAULT_ENGINE

    timings, n_prompts, tokens = split(args.engine or DEFAULT_ENGINE)
    total = timings["total"]
    engine_time = timings["baseline_decode"] + timings["spec_decode"] + timings["tf_scoring"]
    print(f"In-process run of prompts/default.jsonl ({n_prompts} prompts, {tokens} generated tokens):\n")
    print("| phase | seconds | share |\n|---|---|---|")
    for key in ("baseline_decode", "spec_decode", "tf_scoring", "comparison"):
        print(f"| {key} | {timings[key]:.2f} | {timings[key] / total:.1%} |")
    overhead = total - engine_time
    print(f"| harness overhead (total − engine calls) | {overhead:.2f} | {overhead / total:.1%} |")
    print(f"| total | {total:.2f} | 100% |\n")
    print("Comparison + noise measurement on synthetic streams (best of %d):\n" % args.reps)
    print("| tokens | case | seconds | tokens/s |\n|---|---|---|---|")
    for n in (1024, 16384, 131072):
        for case in ("exact", "flip-mid", "all-wrong"):
            s = compare_throughput(n, case, args.reps)
            print(f"| {n} | {case} | {s:.4f} | {n / s:,.0f} |")


if __name__ == "__main__":
    main()
