#!/usr/bin/env python
"""Path coverage of a prompt suite: which speculative code paths each embedded engine takes on it.

A lossless check only says something about the paths a run actually took (``specparity.model.coverage``):
a full reject (``reject``), a partial accept (``partial``), a fully accepted block (``all``), a
block cut by ``max_new_tokens`` (``cut_limit``) and a block cut by a stop token inside it
(``cut_stop``). This script runs only the *speculative* side of every prompt (no baseline, no
scoring) on the fixture models in fp32 on the CPU, feeds each result's per-step records to a
:class:`specparity.model.coverage.Coverage`, and prints, per engine/mode and path, the number of prompts
that took the path at least once and the number of verify steps that took it.

    python tools/path_coverage.py                                   # hf:draft and dflash:dflash2
    python tools/path_coverage.py --engines hf:draft,hf:prompt_lookup,dflash:dflash2,dflash:dflash1
    python tools/path_coverage.py --prompts /tmp/candidates.jsonl --per-prompt
    python tools/path_coverage.py --json reports/path_coverage.json

Each prompt runs with its own ``max_new_tokens`` (default 48), the engine's stop tokens and the
default draft width / block size (hf: 4 draft tokens per step; dflash: block 8). ``--per-prompt``
also lists, per prompt, the paths it took and its step kinds. The counts are what
``tests/test_path_prompts.py`` asserts (>= 5 prompts per path for hf:draft and dflash:dflash2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from specparity.model.coverage import PATHS, Coverage  # noqa: E402
from specparity.model.locations import REPO_ROOT, fixture_dir  # noqa: E402
from specparity.model.prompts import Prompt, load_prompts  # noqa: E402
from specparity.model.gate_run import GateConfig  # noqa: E402
from specparity.run.runner import request_for  # noqa: E402

DEFAULT_ENGINES = "hf:draft,dflash:dflash2"
ALL_ENGINES = "hf:draft,hf:prompt_lookup,dflash:dflash2,dflash:dflash1"
#: engine/mode -> draft fixture directory (None: the mode has no draft model)
DRAFTS = {("hf", "draft"): "draft", ("hf", "prompt_lookup"): None,
          ("dflash", "dflash2"): "dflash2", ("dflash", "dflash1"): "dflash1"}


def parse_engines(text: str) -> list[tuple[str, str]]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, mode = item.partition(":")
        mode = mode or {"hf": "draft", "dflash": "dflash2"}.get(name, "")
        if (name, mode) not in DRAFTS:
            raise SystemExit(f"--engines {item!r}: expected one of {', '.join(f'{e}:{m}' for e, m in DRAFTS)}")
        out.append((name, mode))
    return out


def load(name: str, mode: str, threads: int | None = 1):
    """The embedded engine ``name`` in spec mode ``mode`` on the fixture models (fp32)."""
    from specparity.engines import load_engine
    from specparity.engines.base import EngineOptions

    draft = DRAFTS[(name, mode)]
    return load_engine(name, EngineOptions(target=str(fixture_dir("target")),
                                           draft=str(fixture_dir(draft)) if draft else None,
                                           spec_mode=mode, threads=threads))


def prompt_paths(spec: Any) -> list[str]:
    """The paths one request took (in ``PATHS`` order)."""
    one = Coverage()
    one.add(spec)
    return [p for p in PATHS if one.prompts[p]]


def run_suite(engine: Any, prompts: list[Prompt]) -> tuple[Coverage, list[dict[str, Any]]]:
    """Run the speculative side of every prompt: the suite's coverage and one row per prompt."""
    cov = Coverage()
    rows = []
    for p in prompts:
        req = request_for(engine, p, GateConfig(), tuple(engine.stop_token_ids()))
        (res,) = engine.generate([req], speculative=True)
        if res.error:
            print(f"{p.id}: request failed: {res.error}", file=sys.stderr)
        cov.add(res.spec)
        steps = res.spec.steps or []
        rows.append({
            "id": p.id,
            "paths": prompt_paths(res.spec),
            "steps": [[s.proposed, s.accepted, s.emitted, s.cut] for s in steps],
            "new_tokens": len(res.output_ids),
            "max_new_tokens": req.max_new_tokens,
            "finish": res.finish_reason,
            "error": res.error,
            "text": res.text,
        })
    return cov, rows


def step_summary(steps: list[list[Any]]) -> str:
    """``a/p`` per step (accepted/proposed), ``S``/``L`` marking a cut by stop / limit."""
    return " ".join(f"{a}/{p}" + ({"stop": "S", "limit": "L"}.get(c, "")) for p, a, _, c in steps)


def table(results: dict[str, Coverage]) -> str:
    keys = list(results)
    lines = ["| path | " + " | ".join(f"{k} prompts | {k} steps" for k in keys) + " |",
             "|---|" + "---:|---:|" * len(keys)]
    for path in PATHS:
        cells = []
        for k in keys:
            cov = results[k]
            cells += [str(cov.prompts[path]), str(cov.taken()[path])]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    lines.append("| (verify steps) | " + " | ".join(f" | {results[k].steps}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=str(REPO_ROOT / "prompts" / "default.jsonl"))
    ap.add_argument("--engines", default=DEFAULT_ENGINES,
                    help=f"comma-separated engine:mode (default {DEFAULT_ENGINES}; all: {ALL_ENGINES})")
    ap.add_argument("--ids", help="comma-separated prompt ids to run (default: all)")
    ap.add_argument("--per-prompt", action="store_true", help="also list the paths each prompt took")
    ap.add_argument("--text", action="store_true", help="with --per-prompt: print each output text")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the coverage and per-prompt rows here")
    args = ap.parse_args(argv)

    prompts = load_prompts(args.prompts).prompts
    if args.ids:
        want = set(args.ids.split(","))
        prompts = [p for p in prompts if p.id in want]
    results: dict[str, Coverage] = {}
    dump: dict[str, Any] = {"prompts_file": args.prompts, "n_prompts": len(prompts), "engines": {}}
    for name, mode in parse_engines(args.engines):
        key = f"{name}:{mode}"
        t0 = time.perf_counter()
        engine = load(name, mode, args.threads)
        try:
            cov, rows = run_suite(engine, prompts)
        finally:
            engine.close()
        wall = time.perf_counter() - t0
        results[key] = cov
        dump["engines"][key] = {"coverage": cov.to_json(), "seconds": round(wall, 2), "per_prompt": rows}
        print(f"{key}: {len(prompts)} prompts, {cov.steps} verify steps, {wall:.1f} s", file=sys.stderr)
        if args.per_prompt:
            print(f"\n## {key}\n")
            for r in rows:
                print(f"{r['id']:24s} {','.join(r['paths']):36s} {r['new_tokens']:3d}/{r['max_new_tokens']:<3d} "
                      f"{step_summary(r['steps'])}")
                if args.text:
                    print(f"    {r['text']!r}")
    print(f"\nPath coverage of {args.prompts} ({len(prompts)} prompts): prompts that took each path at least "
          "once / verify steps on it\n")
    print(table(results))
    low = {k: [p for p in PATHS if c.prompts[p] < 5] for k, c in results.items()}
    low = {k: v for k, v in low.items() if v}
    if low:
        print("\npaths on fewer than 5 prompts: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in low.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dump, f, indent=1, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
