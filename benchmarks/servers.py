"""The gate against real llama-servers: concurrency 1 vs N, and the harness's own overhead.

    python benchmarks/servers.py [--concurrency 4] [--repeats 3] [--max-new-tokens 48]

For each concurrency the gate launches a baseline and a speculative llama-server (``--parallel``
slots = the concurrency) and runs the default suite; every HTTP request it sends is recorded. A
bare client loop then replays exactly those requests (same bodies, same servers, same
concurrency, plain ``urllib3``, no parsing beyond ``json.loads``): the difference is what the
harness costs — prompt encoding, result building, scoring bookkeeping, comparison, the journal.
Prints one table; numbers go to docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Recorder:
    """Wraps Endpoint.post_json to record (url, path, body) of every request the gate sends."""

    def __init__(self):
        self.calls: list[tuple[str, str, dict]] = []
        self.lock = threading.Lock()

    def install(self):
        from specparity.engines.server.http import Endpoint

        original = Endpoint.post_json
        rec = self

        def post_json(self, path, body, **kw):
            with rec.lock:
                rec.calls.append((self.base_url, path, body))
            return original(self, path, body, **kw)

        Endpoint.post_json = post_json
        return original


def replay(calls, concurrency: int) -> float:
    import urllib3

    pool = urllib3.PoolManager(maxsize=max(4, concurrency))

    def send(call):
        url, path, body = call
        r = pool.request("POST", url + path, body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
        json.loads(r.data)

    t0 = time.perf_counter()
    if concurrency <= 1:
        for c in calls:
            send(c)
    else:
        with ThreadPoolExecutor(concurrency) as ex:
            list(ex.map(send, calls))
    return time.perf_counter() - t0


def one(concurrency: int, max_new: int, prompts) -> dict:
    from specparity.engines.base import EngineOptions
    from specparity.engines.server.http import Endpoint
    from specparity.engines.server.llamacpp import create
    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import conclude, run_gate

    rec = Recorder()
    original = rec.install()
    engine = create(EngineOptions(extra={"parallel": concurrency}))
    try:
        t0 = time.perf_counter()
        run = run_gate(engine, prompts, GateConfig(max_new_tokens=max_new, concurrency=concurrency))
        gate_s = time.perf_counter() - t0
        decision = conclude(run)
        Endpoint.post_json = original
        # replay phase by phase as the gate ran them (phase 2 only starts when phase 1 is done)
        spec_urls = set(engine.spec.fleet.urls)
        first_spec = next(i for i, c in enumerate(rec.calls) if c[0] in spec_urls)
        replay_s = replay(rec.calls[:first_spec], concurrency) + replay(rec.calls[first_spec:], concurrency)
    finally:
        Endpoint.post_json = original
        engine.close()
    gen = [r.spec for r in run.records if r.spec] + [r.baseline for r in run.records if r.baseline]
    tokens = sum(len(r.output_ids) for r in gen)
    return {"concurrency": concurrency, "passed": decision.passed, "gate_s": gate_s, "replay_s": replay_s,
            "requests": len(rec.calls), "tokens": tokens, "phase1_s": run.timings["baseline_phase_wall"],
            "phase2_s": run.timings["spec_phase_wall"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    from specparity.model.locations import REPO_ROOT
    from specparity.model.prompts import load_prompts

    prompts = load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts
    rows = []
    for c in (1, args.concurrency):
        runs = [one(c, args.max_new_tokens, prompts) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("gate_s", "replay_s", "phase1_s", "phase2_s")}
        rows.append({**runs[0], **med, "all_passed": all(r["passed"] for r in runs)})
    print(f"llama-server (fixture GGUFs, draft-simple), {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"median of {args.repeats}")
    print("| concurrency | gate wall s | phase 1 s | phase 2 s | HTTP requests | bare replay s | harness overhead | passed |")
    print("|---:|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        over = (r["gate_s"] - r["replay_s"]) / r["gate_s"]
        print(f"| {r['concurrency']} | {r['gate_s']:.2f} | {r['phase1_s']:.2f} | {r['phase2_s']:.2f} | {r['requests']} | "
              f"{r['replay_s']:.2f} | {over:.0%} | {r['all_passed']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
