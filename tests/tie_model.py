"""A tie-dense copy of the fixture target: its greedy path meets exact ties and one-ulp margins in bf16
at most positions, as a real bf16 model does, while the committed fixture was trained for clear margins.

How: the fixture ties ``lm_head`` to ``embed_tokens``. For each of the :data:`PAIRS` token ids the
fixture emits most often on ``prompts/default.jsonl`` (read from the committed golden), a *partner*
id that no prompt or output uses gets a copy of its embedding row plus a perturbation of
:data:`RELATIVE_EPS` of the row's norm. In bf16 the two logits then round to the same value at most
positions (an exact tie, which greedy decoding breaks towards the lower id: the partner) or differ
by one ulp; as an input embedding the partner is nearly its twin, so a flip between the two leaves
the continuation almost unchanged. In fp32 the pair is never tied exactly. The weights are written
in bf16 like the fixture's; the build is deterministic (seeded) and takes about a second, so the
model is made in the test, not committed.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

from specparity.model.locations import REPO_ROOT, fixture_dir

GOLDEN = REPO_ROOT / "golden" / "dflash-float32.jsonl"
#: How many emitted tokens get a near-twin.
PAIRS = 200
#: The twin's distance from its token's embedding row, relative to the row's norm: far below one
#: bf16 ulp of the logits (about 0.4 %), so most positions tie exactly.
RELATIVE_EPS = 0.01
EMBED = "model.embed_tokens.weight"


def build_tie_model(dest: Path, *, pairs: int = PAIRS, eps: float = RELATIVE_EPS, seed: int = 0) -> dict[int, int]:
    """Write the tie-dense target to ``dest`` (a new directory); returns ``{token: partner}``."""
    import torch
    from safetensors.torch import load_file, save_file

    src = fixture_dir("target")
    shutil.copytree(src, dest)
    weights = load_file(str(src / "model.safetensors"))
    emb = weights[EMBED].float()
    emitted: Counter[int] = Counter()
    used: set[int] = set()
    for line in GOLDEN.read_text().splitlines()[1:]:
        rec = json.loads(line)
        emitted.update(rec["output_ids"])
        used.update(rec["output_ids"], rec["prompt_ids"])
    free = [i for i in range(emb.shape[0]) if i not in used]
    gen = torch.Generator().manual_seed(seed)
    partners: dict[int, int] = {}
    for token, _ in emitted.most_common(pairs):
        twin = free.pop(0)
        direction = torch.randn(emb.shape[1], generator=gen)
        emb[twin] = emb[token] + eps * emb[token].norm() * direction / direction.norm()
        partners[token] = twin
    weights[EMBED] = emb.to(weights[EMBED].dtype)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return partners
