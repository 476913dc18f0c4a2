#!/usr/bin/env python
"""Build ``fixtures/models/long``: a one-layer Qwen3 model with a 40,960-token training context, made
for gating llama.cpp at 32K+ tokens of context on a CPU.

    python tools/build_long_fixture.py --manifest            # the committed build (seconds)
    python tools/build_long_fixture.py --out DIR             # elsewhere, manifest untouched
    python tools/build_long_fixture.py --out DIR --max-position-embeddings 131584   # the 128K variant
    python tools/build_long_fixture.py --out DIR --head-dim 64                      # for vLLM's kernels

The 128K variant has the same weights (RoPE has no parameters; only the context the config declares
differs): the ``long`` arm sends 131,072-token prompts to a target whose context allows them plus the
output, which is what a GPU engine gates; it is not committed (the CPU suite gates 32K).

``--head-dim`` builds another model of the same recipe with wider attention heads, for GPU engines
whose attention kernels do not serve head_dim 16: vLLM 0.26.0's Triton backend refuses head sizes
below 32, and on an H200 its FlashAttention-3 backend accepts 16 but its first attention call on
this model did not return (docs/SERVERS.md). The attention output projection is scaled by
sqrt(16 / head_dim), so the attention output keeps its scale in the residual stream; head_dim 16
builds the committed bytes.

Why this model: llama-server caps a slot's context at the model's training context
(``max_position_embeddings``: 4,096 for the fixture target), and a 32K-token prefill of the
4-layer, 256-wide fixture target takes about 42 s on two CPU threads. A gate needs several such
prefills per prompt (baseline, speculative, and the llama.cpp scorer's one request per position),
so a long-context gate in the CPU test suite needs a model whose prefill is cheap: one layer, one
KV head, head_dim 16, hidden 64. Attention is what grows with the context, and its cost is
proportional to the number of heads times head_dim times layers.

The weights are seeded random (``--seed``; nothing is trained), scaled so that the model is a
usable gate subject:

* greedy margins are clear: the untied ``lm_head`` is drawn with a large scale, so the top-1 /
  top-2 logit gap is several nats at almost every position (flat logits would make every
  position a near tie, and the gate would judge nothing);
* the output depends on the context: the attention output is on the scale of the current token's
  embedding in the residual stream, so the next token is a function of what the attention reads
  from the whole prompt (greedy outputs of the first and second half of a prompt differ), with
  smooth attention (logits of std ~1), so that rounding does not decide the argmax.

The tokenizer is the fixtures' shared one (relative links to ``../tokenizer``), so prompts encode
as for every other fixture. Determinism: every tensor comes from one ``torch.Generator`` seeded
with ``--seed`` and is stored as bf16; the same torch version rebuilds the same bytes.
``--manifest`` rewrites only the ``models/<out dir name>/`` lines of fixtures/MANIFEST.sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "fixtures" / "models" / "long"
TOKENIZER = REPO / "fixtures" / "models" / "tokenizer"
#: The shape: one layer, cheap attention, a training context above 32K plus room for the output.
ARCH = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
}
#: Weight scales (standard deviations, or constant norm weights): see the module docstring.
SCALES = {
    "embed": 1.0,       # token embeddings (unit RMS, like an RMS-normed stream)
    "qk_norm": 1.0,     # q_norm / k_norm weights: attention logits with std ~ 1
    "proj": 0.125,      # q/k/v/gate/up projections (1/sqrt(hidden): unit-scale outputs)
    "o_proj": 0.5,      # attention output: on the embedding's scale in the residual stream
    "down": 0.02,       # MLP output: small
    "lm_head": 3.0,     # logits with std ~ 3 * sqrt(hidden) = 24: clear greedy margins
}
SPECIAL_IDS = {"bos_token_id": None, "eos_token_id": [0, 2], "pad_token_id": 4}


def build(out: Path, seed: int, positions: int = ARCH["max_position_embeddings"], head_dim: int = ARCH["head_dim"]) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=ARCH["vocab_size"], hidden_size=ARCH["hidden_size"], intermediate_size=ARCH["intermediate_size"],
        num_hidden_layers=ARCH["num_hidden_layers"], num_attention_heads=ARCH["num_attention_heads"],
        num_key_value_heads=ARCH["num_key_value_heads"], head_dim=head_dim,
        max_position_embeddings=positions,
        rope_parameters={"rope_type": "default", "rope_theta": ARCH["rope_theta"]},
        tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=2, pad_token_id=4,
        architectures=["Qwen3ForCausalLM"],
    )
    model = Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    scale_of = {"embed_tokens": "embed", "q_proj": "proj", "k_proj": "proj", "v_proj": "proj", "gate_proj": "proj",
                "up_proj": "proj", "o_proj": "o_proj", "down_proj": "down", "lm_head": "lm_head"}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            leaf = name.split(".")[-2]
            if leaf in ("q_norm", "k_norm"):
                param.fill_(SCALES["qk_norm"])
            elif leaf.endswith("norm"):
                param.fill_(1.0)
            elif leaf in scale_of:
                std = SCALES[scale_of[leaf]]
                if leaf == "o_proj":  # a wider head sums more terms: keep the output's scale
                    std *= (ARCH["head_dim"] / head_dim) ** 0.5
                param.copy_(normal(param.shape, std))
            else:
                raise ValueError(f"no scale for parameter {name}")
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, **{
        k: v for k, v in SPECIAL_IDS.items() if v is not None}}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        link = out / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(TOKENIZER / name, out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-position-embeddings", type=int, default=ARCH["max_position_embeddings"],
                    help="the context the config declares (default %(default)s; 131584 for 128K prompts)")
    ap.add_argument("--head-dim", type=int, default=ARCH["head_dim"],
                    help="the attention head size (default %(default)s; 64 for engines without head_dim-16 kernels)")
    ap.add_argument("--manifest", action="store_true", help="update fixtures/MANIFEST.sha256 for --out")
    args = ap.parse_args()
    if args.max_position_embeddings < 1:
        ap.error(f"--max-position-embeddings: expected a positive integer, got {args.max_position_embeddings}")
    if args.head_dim < 2 or args.head_dim % 2:
        ap.error(f"--head-dim: expected a positive even integer (RoPE rotates pairs), got {args.head_dim}")
    build(args.out.resolve(), args.seed, args.max_position_embeddings, args.head_dim)
    print(f"build_long_fixture: wrote {args.out}", file=sys.stderr)
    if args.manifest:
        sys.path.insert(0, str(REPO / "tools"))
        import build_fixtures

        print(f"build_long_fixture: manifest {build_fixtures.update_manifest(args.out.resolve())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
