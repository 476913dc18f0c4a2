#!/usr/bin/env python
"""Measure the fixture models on this CPU (fp32, one thread by default) and print markdown tables.

    python tools/measure_fixtures.py                       # everything, prints markdown
    python tools/measure_fixtures.py --json reports/fixtures.json

What it measures (docs/FIXTURES.md and docs/notes/fixtures-build.md hold the recorded output):

* sizes of every fixture directory / file;
* the target's cross-entropy on held-out corpus documents (tools/corpus.py stream "val");
* the target's top-1 − top-2 log-prob margin over its own greedy outputs on prompts/default.jsonl;
* acceptance per prompt category for four speculative modes — transformers assisted generation with
  the distilled draft (constant ``--assist-tokens`` per step), transformers prompt lookup
  (``--lookup-tokens``), and ``dflash.model.dflash_generate`` with the DFlash2 and DFlash v1 drafts
  at block ``--block``;
* losslessness: every mode's greedy output tokens == plain greedy (``target.generate``) in fp32.

"Accept length" is tokens emitted per verify step, bonus token included (SGLang's
``spec_accept_length``). For transformers modes the first verify step is also the prefill; for
dflash the prefill emits one token without a draft and is not a verify step (its
``acceptance_lengths`` list). A step is *full* when every proposed token was accepted, *rejected*
when none was, *partial* otherwise; the step that hits a stop token or the token limit is *cut*.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402
from build_fixtures import assistant_mask  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ["assisted", "lookup", "dflash2", "dflash1"]


def sizes(root: Path) -> list[tuple[str, int, int]]:
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        files = [f for f in d.rglob("*") if f.is_file() and not f.is_symlink()]  # links to the tokenizer: 0 bytes
        out.append((d.name, len(files), sum(f.stat().st_size for f in files)))
    return out


def load_prompts(path: Path, tok) -> list[dict]:
    """The suite's prompts with their token ids (``specparity.model.prompts.encode_prompt``, as the engines encode)."""
    from specparity.model.prompts import encode_prompt, load_prompts as load_suite

    return [dict(id=p.id, category=p.category, lang=p.lang, ids=encode_prompt(tok, p.prompt, p.messages_as_dicts()),
                 max_new=p.max_new_tokens or 48) for p in load_suite(path).prompts]


@torch.no_grad()
def heldout_ce(target, tok, n_docs: int, prompts_path: Path) -> dict:
    users, raws = set(), []
    for i, line in enumerate(prompts_path.read_text(encoding="utf-8").splitlines()):
        if i == 0 or not line.strip():
            continue
        o = json.loads(line)
        if "prompt" in o:
            raws.append(o["prompt"])
        else:
            users.update(m["content"] for m in o["messages"] if m["role"] == "user")
    docs = list(corpus.iter_docs("val", n_docs, users, raws))
    a_id = tok.convert_tokens_to_ids("assistant")
    nl = tok("\n", add_special_tokens=False)["input_ids"][0]
    tot = tot_a = 0.0
    n = n_a = 0
    per_cat: dict[str, list[float]] = {}
    for d in docs:
        ids = tok(corpus.render(d), add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        lp = torch.log_softmax(target(input_ids=x).logits[0, :-1].float(), -1)
        nll = -lp.gather(-1, x[0, 1:, None])[:, 0]
        am = assistant_mask(x, a_id, nl)[0, 1:]
        tot += nll.sum().item()
        n += nll.numel()
        tot_a += nll[am].sum().item()
        n_a += int(am.sum())
        per_cat.setdefault(d["category"], [0.0, 0])
        per_cat[d["category"]][0] += nll.sum().item()
        per_cat[d["category"]][1] += nll.numel()
    return dict(docs=len(docs), tokens=n, ce_all=tot / n, assistant_tokens=n_a, ce_assistant=tot_a / max(1, n_a),
                per_category={c: v[0] / v[1] for c, v in sorted(per_cat.items())})


def plain_greedy(target, ids: list[int], max_new: int) -> tuple[list[int], list[float], int]:
    x = torch.tensor([ids])
    out = target.generate(x, max_new_tokens=max_new, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    margins, ties = [], 0
    for lg in out.logits:
        lp = torch.log_softmax(lg[0].float(), -1)
        top = torch.topk(lp, 2).values
        margins.append(float(top[0] - top[1]))
        ties += int(top[0] == top[1])
    return new, margins, ties


def hf_spec(target, ids: list[int], max_new: int, **kw) -> tuple[list[int], list[tuple[int, int]]]:
    """transformers assisted / prompt-lookup generation; returns (new tokens, [(proposed, accepted)])."""
    steps: list[tuple[int, int]] = []
    orig = type(target)._get_candidate_generator

    def wrapped(self, *a, **k):
        cg = orig(self, *a, **k)
        upd = cg.update_candidate_strategy

        def record(input_ids, scores, num_matches):
            steps.append((int(scores.shape[1]) - 1, int(num_matches)))
            return upd(input_ids, scores, num_matches)

        cg.update_candidate_strategy = record
        return cg

    target._get_candidate_generator = wrapped.__get__(target)
    try:
        out = target.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, **kw)
    finally:
        del target._get_candidate_generator
    return out[0, len(ids):].tolist(), steps


def dflash_spec(draft, target, ids: list[int], max_new: int, stop_ids: list[int], block: int):
    import dflash.model as dm

    r = dm.dflash_generate(draft, target, torch.tensor([ids]), max_new, stop_ids, block_size=block,
                           return_stats=True)
    return r.output_ids[0, len(ids):].tolist(), list(r.acceptance_lengths)


def classify(emitted: list[int], proposed: list[int], accepted: list[int]) -> dict:
    """Counts of full / partial / rejected / cut verify steps (the last step counts as cut when the
    output ended there on a stop token or the limit and it emitted less than a full step would)."""
    c = dict(full=0, partial=0, rejected=0, no_draft=0)
    for p, a in zip(proposed, accepted):
        if p <= 0:
            c["no_draft"] += 1  # prompt lookup found no match: a plain decode step
        elif a >= p:
            c["full"] += 1
        elif a == 0:
            c["rejected"] += 1
        else:
            c["partial"] += 1
    return c


def pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default=str(REPO / "fixtures" / "models"))
    ap.add_argument("--prompts", default=str(REPO / "prompts" / "default.jsonl"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--assist-tokens", type=int, default=4)
    ap.add_argument("--lookup-tokens", type=int, default=4)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--val-docs", type=int, default=600)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model dtype for every run (margins are always computed in float32)")
    ap.add_argument("--skip-ce", action="store_true", help="skip the held-out cross-entropy")
    ap.add_argument("--only", help="comma-separated prompt ids (debugging)")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    import warnings

    warnings.filterwarnings("ignore")
    import dflash.model as dm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dm._cuda_time = time.perf_counter  # dflash times with torch.cuda.synchronize(), which fails on a CPU

    root = Path(args.fixtures)
    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(str(root / "target"))
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(root / "draft"), dtype=dtype).eval()
    draft.generation_config.num_assistant_tokens = args.assist_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    d2 = dm.DFlash2DraftModel.from_pretrained(str(root / "dflash2"), dtype=dtype).eval()
    d1 = dm.DFlashDraftModel.from_pretrained(str(root / "dflash1"), dtype=dtype).eval()
    stop_ids = list(target.generation_config.eos_token_id)

    res: dict = {"threads": args.threads, "torch": torch.__version__, "dtype": args.dtype}
    import transformers

    res["transformers"] = transformers.__version__
    res["sizes"] = sizes(root)
    res["heldout"] = None if args.skip_ce else heldout_ce(target, tok, args.val_docs, Path(args.prompts))

    prompts = load_prompts(Path(args.prompts), tok)
    if args.only:
        keep = set(args.only.split(","))
        prompts = [p for p in prompts if p["id"] in keep]
    rows = []
    for p in prompts:
        ids, mx = p["ids"], p["max_new"]
        t0 = time.time()
        ref, margins, ties = plain_greedy(target, ids, mx)
        t_plain = time.time() - t0
        row = dict(id=p["id"], category=p["category"], lang=p["lang"], prompt_tokens=len(ids), max_new=mx,
                   new_tokens=len(ref), stopped=bool(ref and ref[-1] in stop_ids), tags=p.get("tags", []),
                   margins=margins, ties=ties, plain_s=t_plain, text=tok.decode(ref), modes={})
        runs = {
            "assisted": lambda: hf_spec(target, ids, mx, assistant_model=draft,
                                        num_assistant_tokens=args.assist_tokens,
                                        num_assistant_tokens_schedule="constant",
                                        assistant_confidence_threshold=0.0),
            "lookup": lambda: hf_spec(target, ids, mx, prompt_lookup_num_tokens=args.lookup_tokens),
            "dflash2": lambda: dflash_spec(d2, target, ids, mx, stop_ids, args.block),
            "dflash1": lambda: dflash_spec(d1, target, ids, mx, stop_ids, args.block),
        }
        for mode, fn in runs.items():
            t0 = time.time()
            out, steps = fn()
            dt = time.time() - t0
            if mode.startswith("dflash"):
                emitted = steps
                proposed = [args.block - 1] * len(steps)
                accepted = [e - 1 for e in steps]
            else:
                proposed = [s[0] for s in steps]
                accepted = [s[1] for s in steps]
                emitted = [a + 1 for a in accepted]
            cut_last = bool(steps) and (len(out) >= mx or (out and out[-1] in stop_ids))
            cls = classify(emitted[:-1] if cut_last else emitted, proposed[:-1] if cut_last else proposed,
                           accepted[:-1] if cut_last else accepted)
            cls["cut"] = int(cut_last)
            first_diff = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b),
                              None if len(out) == len(ref) else min(len(out), len(ref)))
            row["modes"][mode] = dict(match=out == ref, first_diff=first_diff, steps=len(steps), emitted=emitted,
                                      proposed=proposed, accepted=accepted, classes=cls, seconds=dt,
                                      accept_len=sum(emitted) / max(1, len(emitted)))
        rows.append(row)
        print(f"[{time.time() - t_start:5.1f}s] {p['id']}: {len(ref)} tok "
              f"{'stop' if row['stopped'] else 'limit'}; "
              + " ".join(f"{m}={row['modes'][m]['accept_len']:.2f}{'' if row['modes'][m]['match'] else '(MISMATCH)'}"
                         for m in MODES), file=sys.stderr, flush=True)
    res["prompts"] = rows
    res["seconds"] = time.time() - t_start
    print_markdown(res, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    mismatches = [(r["id"], m) for r in rows for m in MODES if not r["modes"][m]["match"]]
    return 1 if mismatches else 0


def print_markdown(res: dict, args) -> None:
    P = print
    P(f"Measured with `python tools/measure_fixtures.py` (torch {res['torch']}, transformers "
      f"{res['transformers']}, {res['dtype']}, {res['threads']} thread(s), assisted {args.assist_tokens} tokens/step constant, "
      f"prompt lookup {args.lookup_tokens} tokens, dflash block {args.block}); {res['seconds']:.0f} s.\n")
    P("### Sizes\n")
    P("| fixture | files | bytes | MiB |")
    P("|---|---:|---:|---:|")
    tot = 0
    for name, n, b in res["sizes"]:
        tot += b
        P(f"| {name} | {n} | {b} | {b / 2**20:.2f} |")
    P(f"| **all** | | {tot} | {tot / 2**20:.2f} |\n")
    h = res["heldout"] or {}
    if h:
        print_ce(h)
    print_prompts(res)


def print_ce(h: dict) -> None:
    P = print
    P("### Target cross-entropy on held-out corpus (stream `val`)\n")
    P(f"{h['docs']} documents, {h['tokens']} predicted tokens: **{h['ce_all']:.4f} nats/token** over all tokens; "
      f"{h['ce_assistant']:.4f} over the {h['assistant_tokens']} assistant-answer tokens.\n")
    P("| category | CE (nats/token, all tokens) |")
    P("|---|---:|")
    for c, v in h["per_category"].items():
        P(f"| {c} | {v:.4f} |")
    P("")


def print_prompts(res: dict) -> None:
    P = print
    rows = res["prompts"]
    allm = [m for r in rows for m in r["margins"]]
    P("### Target top-1 − top-2 log-prob margin over its greedy outputs (all prompts)\n")
    P(f"{len(allm)} output positions. min {min(allm):.4f}; p1 {pct(allm, .01):.4f}; p5 {pct(allm, .05):.4f}; "
      f"p10 {pct(allm, .10):.4f}; p25 {pct(allm, .25):.4f}; median {pct(allm, .5):.3f}; "
      f"fraction < 0.1 nats: {sum(m < 0.1 for m in allm) / len(allm):.4f} ({sum(m < 0.1 for m in allm)}); "
      f"< 0.01 nats: {sum(m < 0.01 for m in allm) / len(allm):.4f} ({sum(m < 0.01 for m in allm)}); "
      f"exact ties: {sum(r['ties'] for r in rows)}.\n")
    P("### Acceptance per category (mean tokens emitted per verify step, bonus included)\n")
    P("| category | prompts | tokens | " + " | ".join(MODES) + " |")
    P("|---|---:|---:|" + "---:|" * len(MODES))
    cats = sorted({r["category"] for r in rows})
    for c in cats + ["ALL"]:
        rs = [r for r in rows if c == "ALL" or r["category"] == c]
        cells = []
        for m in MODES:
            em = [e for r in rs for e in r["modes"][m]["emitted"]]
            cells.append(f"{sum(em) / max(1, len(em)):.2f}")
        name = f"**{c}**" if c == "ALL" else c
        P(f"| {name} | {len(rs)} | {sum(r['new_tokens'] for r in rs)} | " + " | ".join(cells) + " |")
    P("")
    P("### Verify steps by outcome (all prompts): full / partial / rejected / no draft / cut\n")
    P("| mode | steps | full | partial | rejected | no draft | cut (stop or limit) |")
    P("|---|---:|---:|---:|---:|---:|---:|")
    for m in MODES:
        agg: dict[str, int] = {}
        for r in rows:
            for k, v in r["modes"][m]["classes"].items():
                agg[k] = agg.get(k, 0) + v
        steps = sum(r["modes"][m]["steps"] for r in rows)
        P(f"| {m} | {steps} | {agg.get('full', 0)} | {agg.get('partial', 0)} | {agg.get('rejected', 0)} | "
          f"{agg.get('no_draft', 0)} | {agg.get('cut', 0)} |")
    P("")
    P("### Per prompt\n")
    P("| id | new tokens | end | min margin | " + " | ".join(MODES) + " | spec == greedy |")
    P("|---|---:|---|---:|" + "---:|" * len(MODES) + "---|")
    for r in rows:
        ok = all(r["modes"][m]["match"] for m in MODES)
        bad = [f"{m}@{r['modes'][m]['first_diff']}" for m in MODES if not r["modes"][m]["match"]]
        P(f"| {r['id']} | {r['new_tokens']} | {'stop' if r['stopped'] else 'limit'} | {min(r['margins']):.3f} | "
          + " | ".join(f"{r['modes'][m]['accept_len']:.2f}" for m in MODES)
          + f" | {'yes' if ok else 'NO: ' + ', '.join(bad)} |")
    P("")
    mism = [(r["id"], m) for r in rows for m in MODES if not r["modes"][m]["match"]]
    P(f"**Losslessness ({res['dtype']}): {len(rows) * len(MODES) - len(mism)} of {len(rows) * len(MODES)} "
      f"(prompt, mode) outputs equal plain greedy" + (f"; mismatches: {mism}" if mism else "") + ".**")


if __name__ == "__main__":
    raise SystemExit(main())
