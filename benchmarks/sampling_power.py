"""The sampling judge's false-alarm rate and power per bug, on the numpy speculative sampler.

    python benchmarks/sampling_power.py [--far-runs 1000] [--runs 100] [--samples N] [--bugs a,b]

Each row: R simulated runs (tests/sampling_sim.py: bigram target and draft over 48 tokens, 4 prompts,
N samples of 16 tokens per prompt and side, T=2, top-k 8, repetition penalty 1.3, 4 draft tokens),
each judged at the default alpha; "fail rate" is the false-alarm rate for the correct sampler and
the power for a bug, with its exact 95 % confidence interval (Clopper–Pearson, by bisection on the
binomial tail) and the one-sided 95 % bound that matters: the upper one for a false-alarm rate, the
lower one for a power. Seeds are fixed: a rerun prints the same counts. Numbers in docs/PERFORMANCE.md and docs/SAMPLING.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import sampling_sim as sim  # noqa: E402
from specparity.judge.sampling import DEFAULT_ALPHA, judge_sampling  # noqa: E402


def binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """Exact two-sided 95 % interval for a binomial rate k/n."""
    def solve(f, lo: float = 0.0, hi: float = 1.0) -> float:
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2
    low = 0.0 if k == 0 else solve(lambda p: 1 - binom_cdf(k - 1, n, p) < 0.025)
    high = 1.0 if k == n else solve(lambda p: binom_cdf(k, n, p) > 0.025)
    return low, high


def one_sided(k: int, n: int, upper: bool) -> float:
    """The exact one-sided 95 % bound on a binomial rate k/n (upper or lower)."""
    def solve(f) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) else (lo, mid)
        return (lo + hi) / 2
    if upper:
        return 1.0 if k == n else solve(lambda p: binom_cdf(k, n, p) > 0.05)
    return 0.0 if k == 0 else solve(lambda p: 1 - binom_cdf(k - 1, n, p) < 0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--far-runs", type=int, default=1000, help="runs of the correct sampler")
    ap.add_argument("--runs", type=int, default=100, help="runs per bug")
    ap.add_argument("--samples", type=int, default=sim.SimConfig().samples)
    ap.add_argument("--bugs", default="correct," + ",".join(sim.BUGS), help="rows, comma-separated")
    args = ap.parse_args()
    cfg = sim.SimConfig(samples=args.samples)
    tables = sim.models(cfg)
    print(f"alpha {DEFAULT_ALPHA:g}")
    print("| sampler | N (samples/prompt x prompts) | runs | fail rate | 95 % interval | one-sided 95 % bound | "
          "wall per run |")
    print("|---|---|---|---|---|---|---|")
    for name in args.bugs.split(","):
        bug = None if name == "correct" else name
        runs = args.far_runs if bug is None else args.runs
        t0, fails = time.perf_counter(), 0
        for rep in range(runs):
            base, spec = sim.run_pair(cfg, 10_000 + rep, bug, tables)
            fails += judge_sampling(base, spec, temperature=cfg.temperature, top_k=cfg.top_k,
                                    alpha=DEFAULT_ALPHA, seed=rep).verdict == "fail"
        wall = (time.perf_counter() - t0) / runs
        lo, hi = clopper_pearson(fails, runs)
        label = bug or "correct (false alarms)"
        bound = f"≤ {one_sided(fails, runs, True):.2%}" if bug is None else f"≥ {one_sided(fails, runs, False):.1%}"
        print(f"| {label} | {cfg.samples} x {cfg.prompts} | {runs} | {fails}/{runs} = {fails / runs:.1%} | "
              f"{lo:.1%} – {hi:.1%} | {bound} | {wall * 1000:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
