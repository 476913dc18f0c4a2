#!/usr/bin/env python3
"""Two measurements the gate does not make, against one running SGLang server (hybrid_live.sh runs them).

  python3 tools/gpu/sglang-0.5.17/hybrid_probe.py accept URL --tokenizer DIR [--concurrency N] --out PREFIX
      the gate's prompts (prompts/default.jsonl, encoded as the gate encodes them, greedy, the prompt's
      max_new_tokens or 48), sent to a speculating server; SGLang 0.5.17 answers each with
      meta_info.spec_correct_drafts_histogram (verify steps by the number of draft tokens accepted in
      them), which the gate does not read. Summed over the prompts it gives the acceptance per draft
      position: position k accepted in the share of verify steps that accepted at least k drafts.
  python3 tools/gpu/sglang-0.5.17/hybrid_probe.py cache URL --tokenizer DIR --out PREFIX
      the radix cache on a hybrid (Gated DeltaNet) target, per prompt: a warm-up request (max_new_tokens 1,
      the prefix-warm arm's), then (a) the same prompt again, (b) the prompt followed by the warm-up's
      answer token; meta_info.cached_tokens of (a) and (b). (a) is what the prefix-warm arm counts.

Writes PREFIX.json and PREFIX.md. Needs only the standard library, numpy-free specparity modules and the
tokenizer (transformers), as the gate does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from specparity.engines.server.engine import HFTokenizer  # noqa: E402
from specparity.engines.server.sglang_wire import generate_body
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS  # noqa: E402
from specparity.model.prompts import load_prompts  # noqa: E402


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def prompts_and_ids(tokenizer: str, prompt_file: str):
    tok = HFTokenizer(tokenizer)
    out = []
    for p in load_prompts(prompt_file).prompts:
        ids = tok.encode_prompt(p.prompt, p.messages_as_dicts())
        out.append((p, ids))
    return tok, out


def gen(url: str, ids, max_new: int, stop, rid_tag: str) -> dict:
    body = generate_body(ids, max_new, stop, 8, rid=f"probe-{rid_tag}-{uuid.uuid4().hex[:8]}")
    return post(url, body)


def accept(args) -> dict:
    tok, items = prompts_and_ids(args.tokenizer, args.prompts)
    stop = tok.stop_token_ids()

    def one(item):
        p, ids = item
        ans = gen(args.url, ids, p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, stop, p.id)
        m = ans["meta_info"]
        return {"id": p.id, "category": p.category, "completion_tokens": m.get("completion_tokens"),
                "verify": m.get("spec_verify_ct"), "accepted": m.get("spec_num_correct_drafts"),
                "proposed": m.get("spec_num_proposed_drafts"),
                "histogram": m.get("spec_correct_drafts_histogram") or m.get("spec_accept_histogram"),
                "accept_length": m.get("spec_accept_length")}

    t0 = time.time()
    with ThreadPoolExecutor(args.concurrency) as ex:
        rows = list(ex.map(one, items))
    hist: list[int] = []
    for r in rows:
        for k, n in enumerate(r["histogram"] or []):
            hist += [0] * (k + 1 - len(hist))
            hist[k] += int(n)
    steps = sum(hist)
    accepted = sum(k * n for k, n in enumerate(hist))
    per_pos = [sum(hist[j] for j in range(k, len(hist))) / steps for k in range(1, len(hist))] if steps else []
    tot = {k: sum(int(r[k] or 0) for r in rows) for k in ("verify", "accepted", "proposed", "completion_tokens")}
    return {"url": args.url, "concurrency": args.concurrency, "prompts": len(rows), "wall_s": round(time.time() - t0, 2),
            "histogram": hist, "verify_steps_from_histogram": steps, "accepted_from_histogram": accepted,
            "per_position_acceptance": [round(x, 4) for x in per_pos],
            "accept_length_steps": round((accepted + steps) / steps, 4) if steps else None,
            "totals": tot,
            "accept_length_sglang": round(tot["completion_tokens"] / tot["verify"], 4) if tot["verify"] else None,
            "missing_histogram": [r["id"] for r in rows if not r["histogram"]], "rows": rows}


def cache(args) -> dict:
    tok, items = prompts_and_ids(args.tokenizer, args.prompts)
    stop = tok.stop_token_ids()
    rows = []
    for p, ids in items:  # one at a time: each pair of requests must see its own warm-up
        warm = gen(args.url, ids, 1, stop, p.id + "-warm")
        t = [int(x) for x in warm["output_ids"]][:1]
        same = gen(args.url, ids, 8, stop, p.id + "-same")
        ext = gen(args.url, ids + t, 8, stop, p.id + "-ext") if t else None
        rows.append({"id": p.id, "prompt_tokens": len(ids),
                     "warm_cached": warm["meta_info"].get("cached_tokens"),
                     "same_cached": same["meta_info"].get("cached_tokens"),
                     "extended_cached": ext["meta_info"].get("cached_tokens") if ext else None})

    def summary(key):
        vals = [r[key] for r in rows if r[key] is not None]
        hits = [v for v in vals if v > 0]
        return {"answered": len(vals), "hits": len(hits), "min": min(vals) if vals else None,
                "max": max(vals) if vals else None}

    return {"url": args.url, "prompts": len(rows), "prompt_tokens": [min(r["prompt_tokens"] for r in rows),
                                                                     max(r["prompt_tokens"] for r in rows)],
            "same": summary("same_cached"), "extended": summary("extended_cached"), "rows": rows}


def markdown(mode: str, d: dict, label: str) -> str:
    if mode == "accept":
        pos = " / ".join(f"{x:.3f}" for x in d["per_position_acceptance"]) or "-"
        return "\n".join([
            f"# Per-position acceptance: {label}", "",
            f"{d['prompts']} prompts of prompts/default.jsonl, {d['concurrency']} in flight, {d['wall_s']} s; "
            "from SGLang's per-request `meta_info.spec_correct_drafts_histogram`, summed.", "",
            "| verify steps | accepted drafts | histogram (steps accepting 0, 1, 2, ... drafts) | "
            "acceptance at draft position 1 / 2 / ... | accept length (accepted + steps) / steps | "
            "SGLang accept length (completion tokens / verify steps) |",
            "|---|---|---|---|---|---|",
            f"| {d['verify_steps_from_histogram']} | {d['accepted_from_histogram']} | {d['histogram']} | {pos} | "
            f"{d['accept_length_steps']} | {d['accept_length_sglang']} |", "",
            f"Totals from the scalar counters: {d['totals']}; prompts without a histogram: "
            f"{len(d['missing_histogram'])}.", ""])
    s, e = d["same"], d["extended"]
    return "\n".join([
        f"# Radix cache on the hybrid target: {label}", "",
        f"{d['prompts']} prompts ({d['prompt_tokens'][0]}-{d['prompt_tokens'][1]} tokens), one at a time: a warm-up "
        "request (max_new_tokens 1), then the same prompt, then the prompt followed by the warm-up's token.", "",
        "| request after the warm-up | answered | cached_tokens > 0 | min | max |", "|---|---|---|---|---|",
        f"| the same prompt (what the prefix-warm arm counts) | {s['answered']} | {s['hits']} | {s['min']} | {s['max']} |",
        f"| the prompt + the warm-up's answer token | {e['answered']} | {e['hits']} | {e['min']} | {e['max']} |", ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("accept", "cache"))
    ap.add_argument("url")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", default=str(ROOT / "prompts" / "default.jsonl"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    d = accept(args) if args.mode == "accept" else cache(args)
    Path(args.out + ".json").write_text(json.dumps(d, indent=1))
    md = markdown(args.mode, d, args.label or args.url)
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
