"""Find prompts on which the fixture target flips a near tie under bf16 speculation.

The fixture target is confident on in-distribution prompts (``prompts/default.jsonl`` has no
margin under 0.01 nats), so bf16 never flips there. Real models do have low-margin positions;
to show the classifier separating benign bf16 flips from real divergence we need prompts that
reach them. Candidates are raw-text prefixes cut at arbitrary points of held-out corpus documents
and random word mixes (both out of distribution, hence flatter); each is decoded greedily in
bf16 with and without speculation by the ``hf`` engine (draft and prompt lookup), and the ones
whose streams differ are kept with a few that do not, as controls.

Usage: ``python tools/find_near_ties.py [--out prompts/near_tie.jsonl]`` (about 1 minute, 1 thread)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import corpus  # noqa: E402

from specparity.engines.base import EngineOptions  # noqa: E402
from specparity.engines.inprocess.hf import HFEngine  # noqa: E402
from specparity.model.types import GenerationRequest  # noqa: E402

SEED = 7
CORPUS_SEED = 12345  # not a training seed
WORDS = "the cat 猫 river 1 2 + = def print 春天 list apple because 所以 sum".split()
N_CONTROLS = 6


def candidates() -> list[tuple[str, str]]:
    rng = random.Random(SEED)
    out = []
    for i in range(80):
        doc = corpus.render(corpus.make_doc(CORPUS_SEED, i))
        cut = rng.randint(10, max(11, len(doc) // 2))
        out.append((f"neartie-raw-{i:03d}", doc[:cut]))
    for i in range(40):
        out.append((f"neartie-mix-{i:03d}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))))
    return out


def flips(engine: HFEngine, text: str, max_new: int) -> tuple[int, float | None] | None:
    ids = engine.encode_prompt(text, None)
    req = GenerationRequest("x", ids, max_new, engine.stop_token_ids())
    base = engine.generate([req], speculative=False)[0]
    spec = engine.generate([req], speculative=True)[0]
    if base.output_ids == spec.output_ids:
        return None
    n = min(len(base.output_ids), len(spec.output_ids))
    i = next((k for k in range(n) if base.output_ids[k] != spec.output_ids[k]), n)
    lp = base.scores.logprob_of(i, spec.output_ids[i]) if i < n else None
    return i, (None if lp is None else float(base.scores.logprobs[i]) - lp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="prompts/near_tie.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    engines = {m: HFEngine(EngineOptions(dtype="bfloat16", spec_mode=m)) for m in ("draft", "prompt_lookup")}
    rows, controls = [], []
    for pid, text in candidates():
        found = {m: flips(e, text, args.max_new_tokens) for m, e in engines.items()}
        hit = {m: f for m, f in found.items() if f is not None}
        if hit:
            tags = ["bf16-flip"] + [f"flips-{m.replace('_', '-')}" for m in hit]
            rows.append({"id": pid, "category": "bf16_flip", "lang": "mixed", "prompt": text, "tags": tags})
            print(pid, {m: f"pos {i} margin {mg}" for m, (i, mg) in hit.items()}, repr(text[:50]))
        elif len(controls) < N_CONTROLS and pid.endswith(("0", "5")):
            controls.append({"id": pid, "category": "control", "lang": "mixed", "prompt": text, "tags": ["no-flip"]})
    header = {
        "specparity_prompts": 1,
        "description": (
            "Out-of-distribution prompts on which the fixture target has near-tie positions: under bf16 "
            "speculation (hf engine) the bf16_flip prompts flip a token at an exact tie or one bf16 step; "
            "controls do not. Built by tools/find_near_ties.py; fp32 must be exact on all of them."
        ),
    }
    with open(args.out, "w", encoding="utf-8") as fh:
        for obj in [header, *rows, *controls]:
            fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} flipping + {len(controls)} control prompts to {args.out}")


if __name__ == "__main__":
    main()
