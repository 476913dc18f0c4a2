#!/usr/bin/env python
"""Tokens/s without and with DFlash speculation, speedup and accept length, per block size.

    python benchmarks/dflash_blocks.py                      # fixtures, DFlash2, blocks 1..16, fp32
    python benchmarks/dflash_blocks.py --spec-mode dflash1 --blocks 2,4,8 --repeats 5
    python benchmarks/dflash_blocks.py --device cuda        # both models on the GPU

"No spec" is the target's plain greedy decode (transformers ``generate``, the gate's baseline);
"dflash" is ``dflash_generate`` through the engine (instrumented, as the gate runs it). Block 1
is dflash's own loop with nothing drafted: it prices the loop against ``generate``. Every
configuration is timed ``--repeats`` times, interleaved with the baseline so that load from other
processes on a shared machine hits both alike; the table shows medians. Every speculative output
is also compared with the baseline's: the table marks a block size whose outputs differ.

Prints a markdown table in the style of the field reports (``../shared/seeds``), followed by the
accept length per prompt category and block size.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specparity.engines.base import EngineOptions  # noqa: E402
from specparity.model.prompts import load_many  # noqa: E402
from specparity.model.types import GenerationRequest  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target model dir (default: fixtures/models/target)")
    ap.add_argument("--draft", help="DFlash draft dir (default: the spec mode's fixture)")
    ap.add_argument("--spec-mode", default="dflash2", choices=["dflash2", "dflash1"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both models moved to the GPU after loading "
                    "(the speculative path runs through the engine; the baseline calls generate directly)")
    ap.add_argument("--blocks", default="1,2,4,6,8,12,16")
    ap.add_argument("--prompts", default=str(REPO / "prompts" / "default.jsonl"))
    ap.add_argument("--per-category", type=int, default=2, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def pick_prompts(path: str, per_category: int):
    out, count = [], defaultdict(int)
    for p in load_many([path]):
        if count[p.category] < per_category:
            out.append(p)
            count[p.category] += 1
    return out


def device_baseline(engine, req):
    """The engine's baseline (``generate`` with its generation config) with the inputs on the model's device."""
    import torch

    model = engine.target.model
    ids = torch.tensor([list(req.prompt_ids)], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=engine.target.generation_config(req))
    new = out.sequences[0, ids.shape[1]:].tolist()  # .tolist() waits for the GPU
    return SimpleNamespace(output_ids=new, wall_s=time.perf_counter() - t0, error=None)


def timed(engine, reqs, speculative, device="cpu"):
    """(results, tokens/s over the whole set) — wall time from the engine's own per-request clock."""
    if device != "cpu" and not speculative:
        results = [device_baseline(engine, r) for r in reqs]
    else:
        results = engine.generate(reqs, speculative=speculative)
    bad = [r.error for r in results if r.error]
    if bad:
        raise SystemExit(f"engine error: {bad[0]}")
    toks = sum(len(r.output_ids) for r in results)
    return results, toks / sum(r.wall_s for r in results)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    from specparity.engines.inprocess.dflash import DFlashEngine

    engine = DFlashEngine(EngineOptions(target=args.target, draft=args.draft, spec_mode=args.spec_mode,
                                        dtype=args.dtype, threads=args.threads))
    if args.device != "cpu":
        engine.target.model.to(args.device)
        engine.draft.to(args.device)
    blocks = [int(b) for b in args.blocks.split(",")]
    prompts = pick_prompts(args.prompts, args.per_category)
    stops = engine.stop_token_ids()
    reqs = [GenerationRequest(p.id, engine.encode_prompt(p.prompt, p.messages_as_dicts()), args.max_new_tokens, stops)
            for p in prompts]
    # warm-up (allocator, first-call overheads)
    engine.set_block_size(blocks[-1])
    timed(engine, reqs[:1], False, args.device)
    timed(engine, reqs[:1], True, args.device)

    base_tps, spec_tps = [], defaultdict(list)
    base_out = None
    per_block = {}
    t0 = time.time()
    for _ in range(args.repeats):
        res, tps = timed(engine, reqs, False, args.device)
        base_tps.append(tps)
        base_out = base_out or [r.output_ids for r in res]
        for b in blocks:
            engine.set_block_size(b)
            res, tps = timed(engine, reqs, True, args.device)
            spec_tps[b].append(tps)
            per_block[b] = res
    base = statistics.median(base_tps)
    fp = engine.fingerprint()
    where = (torch.cuda.get_device_name(0) if args.device != "cpu"
             else f"{platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    print("# DFlash block-size benchmark\n")
    print(f"command: `python benchmarks/dflash_blocks.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip())
    print(f"engine: {fp.engine_version}; draft {fp.draft.kind} ({fp.draft.path}); target {fp.target.path}")
    print(f"device: {args.device} ({where}); dtype {args.dtype}; torch {torch.__version__}; "
          f"transformers {transformers.__version__}")
    print(f"workload: {len(reqs)} prompts ({args.per_category} per category) x up to {args.max_new_tokens} new tokens, "
          f"greedy; medians of {args.repeats} interleaved repeats; {time.time() - t0:.0f}s\n")
    print("| block size | tok/s no spec | tok/s DFlash | speedup | accept length | draft tokens accepted | lossless |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for b in blocks:
        res = per_block[b]
        steps = sum(r.spec.verify_steps for r in res)
        emitted = sum(sum(s.emitted for s in r.spec.steps) for r in res)
        acc, prop = sum(r.spec.accepted for r in res), sum(r.spec.proposed for r in res)
        same = all(r.output_ids == o for r, o in zip(res, base_out))
        tps = statistics.median(spec_tps[b])
        print(f"| {b} | {base:.1f} | {tps:.1f} | {tps / base:.2f}x | {emitted / steps:.2f} | "
              f"{acc}/{prop} | {'yes' if same else 'NO'} |")
    cats = sorted({p.category for p in prompts})
    print("\naccept length (tokens per verify step, bonus included) per category:\n")
    print("| category | " + " | ".join(f"block {b}" for b in blocks) + " |")
    print("|---|" + "---:|" * len(blocks))
    for c in cats:
        cells = []
        for b in blocks:
            rs = [r for r, p in zip(per_block[b], prompts) if p.category == c]
            steps = sum(r.spec.verify_steps for r in rs)
            cells.append(f"{sum(sum(s.emitted for s in r.spec.steps) for r in rs) / steps:.2f}" if steps else "n/a")
        print(f"| {c} | " + " | ".join(cells) + " |")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
