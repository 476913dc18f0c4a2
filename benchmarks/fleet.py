"""One gate run over 1 and over 2 Ray nodes of this machine, and what 10,000 prompts would take on 16 H200 nodes.

Measures, in child processes and in this order, with the same gate options (default: llama.cpp,
``llamacpp-ngram-simple``, the default prompts at 16 new tokens, the noise measured on the prompts
that run):

* a plain ``specparity run`` (no Ray): the servers launched by the run itself;
* a local Ray cluster of one node (``ray start --head``, one CPU): ``specparity run --ray`` with one pair;
* the same cluster with a second node (``ray start --address``): ``--ray`` with one pair per node;

and prints one table: per setup its wall time from the outside, the seconds until every pair served
(``ray.json``), the slowest shard's gate run and the merge (from the journals' timings), and prompts
per second. The cluster is stopped afterwards (``ray stop``). Both nodes share this machine's CPUs, so
the second node adds a server pair and no compute: the table shows what the fleet costs here, not a
speed-up.

``--project`` prints the projection of docs/FLEET.md instead (no run): the wall time of a nightly gate
of N prompts over P server pairs from the per-pair figures measured on an H200 (docs/PERFORMANCE.md),
with the largest shard the SHA-256 split actually gives N synthetic ids and the merge's cost measured
here (``--merge-fixed-s``, ``--merge-s-per-prompt``).

    python benchmarks/fleet.py --report reports/fleet-bench
    python benchmarks/fleet.py --project --prompts 10000 --nodes 16

Exit status: 0 when every run ended with a verdict (whatever it was), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GATE = ["--engine", "llamacpp", "--preset", "llamacpp-ngram-simple", "--max-new-tokens", "16",
        "--calibration", "selected", "-q"]

#: Measured on one H200 with vLLM 0.26.0 and the 54-prompt default set (docs/PERFORMANCE.md): the gate
#: phase (both phases after the servers serve), the two launches one after the other and side by side
#: (--engine-opt parallel_start=true), and a plain run at concurrency 8 from the outside.
H200_GATE_S, H200_PROMPTS = 6.6, 54
H200_LAUNCH_SERIAL_S, H200_LAUNCH_PARALLEL_S = 113.0, 66.0
H200_PLAIN_RUN_S = 122.7


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timings(report: Path) -> dict[str, float]:
    path = report / "results.jsonl"
    out: dict[str, float] = {}
    if path.is_file():
        for row in path.read_text().splitlines():
            line = json.loads(row)
            if line.get("kind") == "timings":
                for key, value in line["timings"].items():
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def _prompts(report: Path) -> int:
    path = report / "results.jsonl"
    return sum(1 for row in path.read_text().splitlines() if '"kind": "prompt"' in row) if path.is_file() else 0


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    code = subprocess.call(argv, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, code


def _slowest_shard(report: Path) -> float:
    shards = sorted((report / "shards").glob("*")) if (report / "shards").is_dir() else []
    return max((_timings(s).get("total", 0.0) for s in shards), default=_timings(report).get("total", 0.0))


def measure(report: Path, extra: list[str]) -> list[dict]:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
    rows = []
    plain = report / "plain"
    wall, code = _run([_bin("specparity"), "run", *GATE, *extra, "--report", str(plain)], env)
    rows.append({"setup": "plain run (no Ray)", "pairs": 1, "wall_s": wall, "exit": code, "pairs_up_s": None,
                 "slowest_shard_s": _timings(plain).get("total", 0.0), "merge_s": None, "prompts": _prompts(plain)})
    port = _free_port()
    temp = tempfile.mkdtemp(prefix="sp-ray-")
    ray = _bin("ray")
    try:
        subprocess.run([ray, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                        "--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}"],
                       env=env, check=True, capture_output=True)
        for nodes in (1, 2):
            if nodes == 2:
                subprocess.run([ray, "start", f"--address=127.0.0.1:{port}", "--num-cpus=1",
                                "--node-ip-address=127.0.0.1"], env=env, check=True, capture_output=True)
            out = report / f"ray-{nodes}"
            wall, code = _run([_bin("specparity"), "run", "--ray", f"127.0.0.1:{port}", "--ray-server-host", "127.0.0.1",
                               *GATE, *extra, "--report", str(out)], env)
            fleet = json.loads((out / "ray.json").read_text()) if (out / "ray.json").is_file() else {}
            rows.append({"setup": f"--ray, {nodes} local node(s)", "pairs": len(fleet.get("pairs", [])), "wall_s": wall,
                         "exit": code, "pairs_up_s": fleet.get("pairs_started_s"),
                         "slowest_shard_s": _slowest_shard(out), "merge_s": _timings(out).get("merge"),
                         "prompts": _prompts(out)})
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)
    return rows


def _cell(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def print_measured(rows: list[dict]) -> None:
    print("| setup | pairs | wall s | pairs up s | slowest shard s | merge s | prompts | prompts/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        rate = r["prompts"] / r["wall_s"] if r["wall_s"] else 0.0
        print(f"| {r['setup']} | {r['pairs']} | {r['wall_s']:.1f} | {_cell(r['pairs_up_s'])} | "
              f"{_cell(r['slowest_shard_s'])} | {_cell(r['merge_s'])} | {r['prompts']} | {rate:.2f} |")


def largest_shard(prompts: int, pairs: int) -> int:
    """The largest shard the SHA-256 split gives ``prompts`` synthetic ids over ``pairs`` shards."""
    from specparity.model.shards import shard_of

    sizes = [0] * pairs
    for i in range(prompts):
        sizes[shard_of(f"nightly-{i:05d}", pairs)] += 1
    return max(sizes)


def print_projection(prompts: int, nodes: int, merge_s_per_prompt: float, merge_fixed_s: float) -> None:
    per_prompt = H200_GATE_S / H200_PROMPTS
    print(f"per pair on one H200 (vLLM 0.26.0, {H200_PROMPTS} prompts): gate {H200_GATE_S:g} s = "
          f"{per_prompt:.4f} s/prompt; launch {H200_LAUNCH_SERIAL_S:g} s one after the other, "
          f"{H200_LAUNCH_PARALLEL_S:g} s side by side; merge {merge_fixed_s:g} s + {merge_s_per_prompt * 1000:.1f} ms/prompt "
          f"(measured here)")
    print()
    print("| pairs | layout | largest shard | launch s | gate s | merge s | wall s | wall min |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    layouts = [(1, "one pair, one H200 (no fleet)"), (nodes, f"{nodes} nodes, one pair each"),
               (nodes * 8, f"{nodes} nodes x 8 H200, one pair per GPU")]
    for pairs, layout in layouts:
        big = largest_shard(prompts, pairs)
        gate = big * per_prompt
        merge = merge_fixed_s + prompts * merge_s_per_prompt if pairs > 1 else 0.0
        wall = H200_LAUNCH_PARALLEL_S + gate + merge
        print(f"| {pairs} | {layout} | {big} | {H200_LAUNCH_PARALLEL_S:g} | {gate:.0f} | {merge:.0f} | {wall:.0f} | "
              f"{wall / 60:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", default="reports/fleet-bench", help="where each run's report directory goes")
    ap.add_argument("--project", action="store_true", help="print the H200 projection only (no run)")
    ap.add_argument("--prompts", type=int, default=10_000, help="--project: prompts of the nightly gate")
    ap.add_argument("--nodes", type=int, default=16, help="--project: H200 nodes")
    ap.add_argument("--merge-s-per-prompt", type=float, default=0.006,
                    help="--project: seconds `specparity merge` takes per prompt (docs/PERFORMANCE.md)")
    ap.add_argument("--merge-fixed-s", type=float, default=1.5,
                    help="--project: seconds `specparity merge` takes whatever the prompts (loading the tokenizer)")
    args, extra = ap.parse_known_args(argv)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.project:
        print_projection(args.prompts, args.nodes, args.merge_s_per_prompt, args.merge_fixed_s)
        return 0
    rows = measure(Path(args.report), extra)
    print_measured(rows)
    return 0 if all(r["exit"] in (0, 1) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
