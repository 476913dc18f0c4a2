"""Measure bf16 near-tie flips on prompts/near_tie.jsonl with the hf engine, for this CPU's kernels.

Which prompts flip (and how many) depends on the kernels torch selects for the CPU: AVX-512 vs
AVX2 (``ATEN_CPU_CAPABILITY``) and oneDNN's ISA (``ONEDNN_MAX_CPU_ISA``). So the tests assert only
what holds on every CPU (every flip is a near tie at an exact tie or one bf16 step, nothing
diverges, fp32 is exact) and this tool records the rest, for ``docs/notes/findings.md``.

    python tools/bf16_flips.py                          # this CPU's default kernels, a table
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python tools/bf16_flips.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def measure(modes: list[str]) -> dict:
    import torch

    from specparity.engines.base import EngineOptions
    from specparity.engines.inprocess.hf import HFEngine
    from specparity.model.locations import REPO_ROOT, fixture_dir
    from specparity.model.prompts import load_prompts
    from specparity.model.gate_run import GateConfig, GatePolicy
    from specparity.run.runner import run_gate

    prompts = load_prompts(REPO_ROOT / "prompts" / "near_tie.jsonl").prompts
    out: dict = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ},
        "prompts": len(prompts),
        "modes": {},
    }
    for mode in modes:
        engine = HFEngine(EngineOptions(target=str(fixture_dir("target")), draft=str(fixture_dir("draft")),
                                        spec_mode=mode, dtype="bfloat16"))
        try:
            run = run_gate(engine, prompts, GateConfig(policy=GatePolicy(max_near_tie=1.0)))
        finally:
            engine.close()
        out["modes"][mode] = {
            "threshold": run.threshold.nats,
            "classes": {r.prompt.id: r.verdict.klass for r in run.records},
            "flips": [
                {
                    "prompt": r.prompt.id,
                    "category": r.prompt.category,
                    "position": r.verdict.divergence.position,
                    "margin": r.verdict.divergence.baseline_margin,
                    "remerge": r.verdict.divergence.remerge is not None,
                    "late_violations": [t.position for t in r.verdict.tf_violations
                                        if t.margin is None or t.margin > r.verdict.threshold],
                }
                for r in run.records
                if r.verdict.divergence is not None
            ],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="draft,prompt_lookup")
    ap.add_argument("--json", action="store_true", help="print the raw measurement as one JSON line")
    args = ap.parse_args(argv)
    data = measure([m for m in args.modes.split(",") if m])
    if args.json:
        print(json.dumps(data))
        return 0
    env = ", ".join(f"{k}={v}" for k, v in data["env"].items()) or "defaults"
    print(f"kernels: {data['cpu_capability']} ({env}); {data['prompts']} prompts")
    print("| mode | flips | prompts (margin nats) | threshold |")
    print("|---|---:|---|---:|")
    for mode, m in data["modes"].items():
        flips = ", ".join(f"{f['prompt']} ({f['margin']:.4g})" for f in m["flips"]) or "-"
        print(f"| {mode} | {len(m['flips'])} | {flips} | {m['threshold']:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
