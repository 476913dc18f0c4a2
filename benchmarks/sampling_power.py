"""The sampling judge's false-alarm rate and power per bug, on the numpy speculative sampler.

    python benchmarks/sampling_power.py [--runs R] [--samples N]

Each row: R simulated runs (tests/sampling_sim.py: bigram target and draft over 48 tokens, 4 prompts,
N samples of 16 tokens per prompt and side, T=2, top-k 8, repetition penalty 1.3, 4 draft tokens),
each judged at the default alpha; "fail rate" is the false-alarm rate for the correct sampler and
the power for a bug. Numbers in docs/PERFORMANCE.md and docs/SAMPLING.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import sampling_sim as sim  # noqa: E402
from specparity.judge.sampling import DEFAULT_ALPHA, judge_sampling  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--samples", type=int, default=sim.SimConfig().samples)
    args = ap.parse_args()
    cfg = sim.SimConfig(samples=args.samples)
    tables = sim.models(cfg)
    print(f"| sampler | N (samples/prompt x prompts) | runs | fail rate | wall per run |")
    print("|---|---|---|---|---|")
    for bug in (None, *sim.BUGS):
        t0, fails = time.perf_counter(), 0
        for rep in range(args.runs):
            base, spec = sim.run_pair(cfg, 10_000 + rep, bug, tables)
            fails += judge_sampling(base, spec, temperature=cfg.temperature, top_k=cfg.top_k,
                                    alpha=DEFAULT_ALPHA, seed=rep).verdict == "fail"
        wall = (time.perf_counter() - t0) / args.runs
        label = bug or "correct (false alarms)"
        print(f"| {label} | {cfg.samples} x {cfg.prompts} | {args.runs} | {fails / args.runs:.1%} | {wall * 1000:.0f} ms |",
              flush=True)


if __name__ == "__main__":
    main()
