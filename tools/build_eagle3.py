#!/usr/bin/env python
"""Build ``fixtures/models/eagle3``: a one-layer EAGLE-3 head for ``fixtures/models/target``, trained on a
CPU, in the checkpoint layout that vLLM (``eagle3``) and SGLang (``EAGLE3``) load.

    python tools/build_eagle3.py --manifest          # the recorded build (one H200: about a minute)
    python tools/build_eagle3.py --device cpu --set max_s=1e9 --manifest   # the same steps on a CPU (hours)
    python tools/build_eagle3.py --smoke --out DIR   # tiny steps: checks the pipeline only
    python tools/build_eagle3.py --eval-only         # re-measure the committed head

Why this head: EAGLE-3 is the draft family most deployments of vLLM and SGLang use, and no public head
exists for a 4-layer, 4096-token target. Training needs the target's forward pass every step, so the
recorded build ran on a GPU; the committed head is what it wrote. The architecture is ``LlamaForCausalLMEagle3`` (both engines
register that name): ``fc`` projects the concatenation of three target hidden states (the residual stream
after target layers 0, 1 and 2) to the hidden size; one decoder layer whose attention reads
``[input_layernorm(embed(token)), hidden_norm(hidden)]`` (2 x hidden wide) with the un-normed hidden as
residual; a final ``norm``; the target's own embedding and lm_head (neither is stored, so both engines
share the target's: vLLM when ``embed_tokens``/``lm_head`` are absent from the checkpoint, SGLang when
``draft_vocab_size`` is unset and embeddings are untied). The draft's next-step hidden state is the
pre-norm output (``norm_output`` unset), as both engines feed it back.

Which target layers: ``eagle_config.eagle_aux_hidden_state_layer_ids`` is ``[1, 2, 3]``, in vLLM's
convention (id k = the residual stream entering target layer k, i.e. HF ``hidden_states[k]``; vLLM's
Qwen2/Qwen3/Llama models append it after layer k-1). SGLang 0.5.17 reads the same key as "after layer k"
(its Qwen3 model captures before layer k+1), so the same features are ``[0, 1, 2]`` there:
``tools/gpu/sglang-0.5.17/sglang_live.sh`` serves a copy of this head with the ids shifted by one. Without
the key both engines fall back to (2, L // 2, L - 3), which is (2, 2, 1) for this 4-layer target: two
distinct layers, and an ``fc`` that expects three, so the key is required here.

Recipe (seeds fixed; numbers of the recorded build in ``fixtures/models/eagle3/build_info.json``):

1. rows    tools/corpus.py stream "train" (the prompt suite held out as tools/build_fixtures.py does),
           packed into rows of ``seq`` tokens; the target runs once per batch (fp32, no grad) for the
           three hidden states and its greedy next token at every position (the labels).
2. train   the head sees slot s = (embed of token s+1, target features at s) at position s and is trained
           to predict the target's greedy token after s+1 (cross-entropy), unrolled ``ttt`` steps as in
           EAGLE-3's training-time test: step p replaces the features by the head's own pre-norm output
           of step p-1 one slot earlier, and its attention sees step-1 keys up to slot s-p+1 and the
           keys of steps 2..p on the diagonal — exactly what chain drafting at inference sees.
3. save    bf16 ``model.safetensors`` (``fc``, ``midlayer.*``, ``norm``), ``config.json``; then measured
           in fp32 on the bf16 weights: the greedy acceptance of chain drafts of ``k`` tokens on
           prompts/default.jsonl (the target decoding greedily, the head drafting from the target's
           features of the verified prefix), per category.

Each stage stops at its step count or its wall-clock budget (``max_s``), whichever comes first (the
convention of tools/build_fixtures.py); with a budget that never leads, a rebuild with the same torch and
``--threads`` is bit-identical. ``--manifest`` rewrites only the ``models/eagle3/`` lines of
fixtures/MANIFEST.sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_fixtures as bf  # noqa: E402
import corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
TARGET = FIXTURES / "models" / "target"
AUX_LAYER_IDS = [1, 2, 3]  # vLLM's convention: HF hidden_states[k]
ARCH = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)

FULL = dict(n_train=40_000, seq=256, bs=32, steps=3000, lr=2e-3, max_s=300, ttt=3, k=4, seed=7, prompts=0)
SMOKE = dict(n_train=400, seq=64, bs=4, steps=5, lr=2e-3, max_s=60, ttt=2, k=3, seed=7, prompts=4)


def log(msg: str) -> None:
    print(f"[eagle3 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (neox-style, rotate-half) rotary embedding; x [B, H, T, D], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Eagle3Head(nn.Module):
    """The forward of ``LlamaForCausalLMEagle3`` with one layer (vLLM llama_eagle3.py, SGLang
    llama_eagle3.py), over one sequence of slots with an explicit attention mask, so that the
    training-time-test unroll can attend to the keys of earlier steps."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 theta: float, n_aux: int, embed: torch.Tensor):
        super().__init__()
        self.embed = embed  # the target's embedding, also its (tied) lm_head: a plain tensor, never trained
        self.h, self.nh, self.nkv, self.hd, self.theta = hidden, heads, kv_heads, head_dim, theta
        self.fc = nn.Linear(n_aux * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)

    def qkv(self, emb: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        """Queries, keys and values of one step: emb/hidden [B, T, H] -> q [B, nh, T, hd], k/v [B, nkv, T, hd]."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        return rope(q, pos, self.theta), rope(k, pos, self.theta), v

    def finish(self, hidden: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
               mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q over (keys, vals) under mask [T, S] (True = may attend), then the MLP; returns
        (normed output for the lm_head, pre-norm output fed back as the next step's hidden)."""
        rep = self.nh // self.nkv
        keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        b, _, t, _ = a.shape
        h = self.o_proj(a.transpose(1, 2).reshape(b, t, self.nh * self.hd)) + hidden
        m = self.post_attention_layernorm(h)
        pre = self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m)) + h
        return self.norm(pre), pre

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensor names (``midlayer.*`` as released EAGLE-3 heads name them)."""
        names = {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight,
                 "midlayer.hidden_norm.weight": self.hidden_norm.weight,
                 "midlayer.input_layernorm.weight": self.input_layernorm.weight,
                 "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm.weight}
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names[f"midlayer.self_attn.{p}.weight"] = getattr(self, p).weight
        for p in ("gate_proj", "up_proj", "down_proj"):
            names[f"midlayer.mlp.{p}.weight"] = getattr(self, p).weight
        return names

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        own = self.state_dict_hf()
        missing = sorted(set(own) - set(sd))
        if missing:
            raise ValueError(f"eagle3 checkpoint lacks {missing}")
        with torch.no_grad():
            for k, p in own.items():
                p.copy_(sd[k].float())


def ttt_masks(t: int, steps: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """mask[p] [T, p*T] for unroll step p (1-based): slot s sees step-1 keys at slots <= s-p+1 and the key of
    step q (2 <= q <= p) at slot s-(p-q)."""
    idx = torch.arange(t, device=device)
    out = []
    for p in range(1, steps + 1):
        blocks = [idx[None, :] <= (idx[:, None] - p + 1)]
        for q in range(2, p + 1):
            blocks.append(idx[None, :] == (idx[:, None] - (p - q)))
        out.append(torch.cat(blocks, 1))
    return out


@torch.no_grad()
def target_features(target, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(aux features [B, T, 3H], greedy next tokens [B, T], embeddings [B, T, H]) of rows x."""
    out = target(input_ids=x, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[k] for k in AUX_LAYER_IDS], -1)
    return feats, out.logits.argmax(-1), target.get_input_embeddings()(x)


def unrolled_loss(head: Eagle3Head, feats, greedy, emb, valid, steps: int) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy of each unroll step against the target's greedy tokens (slot s predicts greedy[s+1],
    the token after s+1), over slots whose label is a real token."""
    t = feats.shape[1] - 1
    e, lab = emb[:, 1:], greedy[:, 1:]
    ok = valid[:, 1:] & valid[:, :-1]
    pos = torch.arange(t, device=feats.device)
    hidden = head.fc(feats[:, :t])
    keys, vals, total, per = [], [], 0.0, []
    for p, mask in enumerate(ttt_masks(t, steps, feats.device), start=1):
        q, k, v = head.qkv(e, hidden, pos)
        keys.append(k)
        vals.append(v)
        normed, pre = head.finish(hidden, q, torch.cat(keys, 2), torch.cat(vals, 2), mask)
        m = ok.clone()
        m[:, : p - 1] = False
        ce = F.cross_entropy(normed[m] @ head.embed.T, lab[m])
        total = total + ce * (0.8 ** (p - 1))
        per.append(round(float(ce.detach()), 4))
        hidden = torch.cat([pre[:, :1] * 0, pre[:, :-1]], 1)  # step p+1 at slot s continues from slot s-1
    return total, per


def load_target(device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def make_head(target) -> Eagle3Head:
    c = target.config
    head = Eagle3Head(ARCH["hidden_size"], ARCH["num_attention_heads"], ARCH["num_key_value_heads"],
                      ARCH["head_dim"], ARCH["intermediate_size"], c.rms_norm_eps,
                      float(c.rope_parameters["rope_theta"]), len(AUX_LAYER_IDS),
                      target.get_input_embeddings().weight.detach())
    return head.to(target.device)


def train(head: Eagle3Head, target, rows: torch.Tensor, cfg: dict, pad_id: int) -> dict:
    params = [p for n, p in head.named_parameters()]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95))
    t0, last = time.time(), []
    step = 0
    for step, idx in enumerate(bf.batches(rows.shape[0], cfg["bs"], cfg["steps"], seed=cfg["seed"])):
        prog = bf.progress(step, cfg["steps"], t0, cfg["max_s"])
        for g in opt.param_groups:
            g["lr"] = bf.lr_at(step, prog, cfg["lr"], warmup=min(100, cfg["steps"] // 10 + 1))
        x = rows[idx].to(target.device)
        feats, greedy, emb = target_features(target, x)
        loss, per = unrolled_loss(head, feats, greedy, emb, x != pad_id, cfg["ttt"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        last = per
        if step % 100 == 0:
            log(f"step {step} ce/step {per} ({time.time() - t0:.0f}s)")
        if bf.progress(step + 1, cfg["steps"], t0, cfg["max_s"]) >= 1.0:
            break
    return dict(steps=step + 1, seconds=round(time.time() - t0, 1), final_ce_per_step=last)


class Drafter:
    """Greedy chain drafting over one known sequence (prompt + the target's greedy output). The target and
    the head's first step are causal, so both run once over the whole sequence; a verify step at prefix
    length n then reads step 1 at slot n-1 (the slot whose token n is the target's bonus token) and runs
    the k-1 chained steps, each attending to step-1 keys of slots < n and the chain's own keys: what an
    engine's draft KV cache holds at that point."""

    @torch.no_grad()
    def __init__(self, head: Eagle3Head, target, seq: list[int]):
        self.head, self.ew = head, head.embed
        x = torch.tensor([seq], device=target.device)
        feats, _, _ = target_features(target, x)
        n = len(seq) - 1
        pos = torch.arange(n, device=x.device)
        hidden = head.fc(feats[:, :n])
        q, self.k1, self.v1 = head.qkv(self.ew[x[:, 1:]], hidden, pos)
        self.normed, self.pre = head.finish(hidden, q, self.k1, self.v1,
                                            torch.ones(n, n, dtype=torch.bool, device=x.device).tril())

    @torch.no_grad()
    def draft(self, n: int, k: int) -> list[int]:
        """k draft tokens after token n (the bonus token) of the sequence, from a verified prefix of n tokens."""
        head, ew = self.head, self.ew
        out = [int((self.normed[0, n - 1] @ ew.T).argmax())]
        keys, vals = self.k1[:, :, :n], self.v1[:, :, :n]
        h = self.pre[:, n - 1:n]
        for j in range(1, k):
            dev = ew.device
            q, kj, vj = head.qkv(ew[torch.tensor([[out[-1]]], device=dev)], h, torch.tensor([n - 1 + j], device=dev))
            keys, vals = torch.cat([keys, kj], 2), torch.cat([vals, vj], 2)
            normed, h = head.finish(h, q, keys, vals, torch.ones(1, keys.shape[2], dtype=torch.bool, device=dev))
            out.append(int((normed[0, -1] @ ew.T).argmax()))
        return out


@torch.no_grad()
def suite_accept(head: Eagle3Head, target, k: int, limit: int = 0) -> dict:
    """Mean accepted tokens per verify step (the bonus token included) of greedy chain drafting, per
    category of prompts/default.jsonl, with the target's greedy decode as the truth."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TARGET))
    stop = set(target.generation_config.eos_token_id or [])
    per: dict[str, list[int]] = {}
    prompts = bf.load_suite_prompts(tok)
    for pid, cat, ids, mx in prompts[:limit] if limit else prompts:
        gen = target.generate(torch.tensor([ids], device=target.device), max_new_tokens=mx,
                              do_sample=False)[0, len(ids):].tolist()
        drafter = Drafter(head, target, list(ids) + gen)
        # gen[done] is the token the last verify step produced (the bonus); the head drafts what follows it
        done = 0
        while done < len(gen) - 1 and gen[done] not in stop:
            draft = drafter.draft(len(ids) + done, k)
            acc = 0
            while acc < k and done + 1 + acc < len(gen) and draft[acc] == gen[done + 1 + acc]:
                acc += 1
            per.setdefault(cat, []).append(1 + acc)
            done += 1 + acc
    res = {c: round(sum(v) / len(v), 3) for c, v in sorted(per.items())}
    allv = [a for v in per.values() for a in v]
    res["ALL"] = round(sum(allv) / max(1, len(allv)), 3)
    res["verify_steps"] = len(allv)
    return res


def hf_config(target) -> dict:
    c = target.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": ARCH["hidden_size"],
        "intermediate_size": ARCH["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": ARCH["num_attention_heads"],
        "num_key_value_heads": ARCH["num_key_value_heads"],
        "head_dim": ARCH["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": float(c.rope_parameters["rope_theta"]),
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": None,  # the target's vocabulary and lm_head (SGLang reads this key unguarded)
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "torch_dtype": "bfloat16",
        "target_hidden_size": c.hidden_size,
        # both places: vLLM 0.26's V1 runner reads either, its V2 runner (eagle3 runs there) only the top level;
        # SGLang 0.5.17 reads only eagle_config
        "eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True},
    }


def save(head: Eagle3Head, target, out: Path, info: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in head.state_dict_hf().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(target), indent=2) + "\n")
    write_info(out, info)


def write_info(out: Path, info: dict) -> None:
    (out / "build_info.json").write_text(json.dumps(info, indent=1, ensure_ascii=False, default=str) + "\n")


def load_head(target, path: Path) -> Eagle3Head:
    from safetensors.torch import load_file

    head = make_head(target)
    head.load_hf(load_file(str(path / "model.safetensors"), device=str(target.device)))
    return head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(FIXTURES / "models" / "eagle3"))
    ap.add_argument("--smoke", action="store_true", help="tiny corpus and steps: pipeline check only")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    ap.add_argument("--manifest", action="store_true", help="update fixtures/MANIFEST.sha256 for --out")
    ap.add_argument("--eval-only", action="store_true", help="measure the head in --out, build nothing")
    args = ap.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    for kv in args.set:
        k, v = kv.split("=", 1)
        if k not in cfg:
            ap.error(f"--set {k}: unknown recipe key (known: {', '.join(sorted(cfg))})")
        cfg[k] = type(cfg[k])(float(v))
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    target = load_target(args.device)
    if args.eval_only:
        print(json.dumps(suite_accept(load_head(target, out), target, cfg["k"], cfg["prompts"]), indent=1))
        return 0

    bf.seed_all(cfg["seed"])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    users, raws = bf.heldout_from_prompts(REPO / "prompts" / "default.jsonl")
    docs = list(corpus.iter_docs("train", cfg["n_train"], users, raws))
    pad_id = corpus.SPECIAL_TOKENS.index(corpus.PAD)
    rows = bf.pack(bf.encode(tok, [corpus.render(d) for d in docs]), cfg["seq"], pad_id)
    log(f"{len(docs)} documents, {rows.shape[0]} rows of {cfg['seq']}")
    head = make_head(target)
    info: dict = {"torch": torch.__version__, "device": args.device,
                  "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "cfg": cfg, "aux_layer_ids": AUX_LAYER_IDS, "rows": rows.shape[0]}
    info["train"] = train(head, target, rows, cfg, pad_id)
    with torch.no_grad():
        for p in head.state_dict_hf().values():
            p.copy_(p.to(torch.bfloat16).float())
    save(head, target, out, info)  # the head first: the measurement below only adds to build_info.json
    info["accept"] = suite_accept(head, target, cfg["k"], cfg["prompts"])
    log(f"train {info['train']} accept (k={cfg['k']}) {info['accept']}")
    write_info(out, info)
    if args.manifest:
        log(f"manifest {bf.update_manifest(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
