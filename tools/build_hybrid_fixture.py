#!/usr/bin/env python
"""Build ``fixtures/models/hybrid``: a tiny Gated DeltaNet *hybrid* target (Qwen3.5 text architecture,
``Qwen3_5ForCausalLM``: 3 linear-attention layers + 1 full-attention layer, plus the one-layer MTP head
that Qwen3.5 checkpoints carry), trained on this machine's CPU to imitate ``fixtures/models/target``.

    python tools/build_hybrid_fixture.py --manifest       # the recorded build (CPU, <10 min, 1 thread)
    python tools/build_hybrid_fixture.py --smoke --out /tmp/h   # tiny steps: checks the pipeline only
    python tools/build_hybrid_fixture.py --eval-only      # re-measure the committed fixture (~1 min)

Why this model: it is the architecture family the field deploys with speculative decoding (Qwen3.5 /
Qwen3-Next GDN hybrids), transformers 5 instantiates and trains it on a CPU (pure-PyTorch fallbacks for
the chunked gated delta rule and the causal conv1d), and llama.cpp's converter (``Qwen3_5ForCausalLM`` ->
``qwen35``) and ``llama-server`` run it, with speculation, so recurrent-state rollback is exercised for
real. The converter insists on an MTP block for Qwen3.5 / Qwen3-Next (``_QwenMtpMixin`` asserts when a
checkpoint has neither ``mtp_num_hidden_layers`` nor ``mtp.*`` tensors and ``--no-mtp`` is not given),
so the fixture carries a real, trained one (``mtp_num_hidden_layers: 1``, tensors ``mtp.*``; transformers
ignores them on load, llama.cpp loads them for ``--spec-type draft-mtp``).

Recipe (all seeds fixed; numbers of the recorded build in ``fixtures/models/hybrid/build_info.json`` and
docs/notes/fixtures-build.md, "Hybrid (GDN) target: how it was built and measured"):

1. corpus   tools/corpus.py stream "train" (the target's own training stream, the held-out prompt suite
            dropped exactly as tools/build_fixtures.py does), packed into rows of 256 tokens without
            splitting documents; stream "val" for evaluation.
2. init     Qwen3_5ForCausalLM (``ARCH``); the tied embedding is the fixture target's embedding projected
            onto its top ``hidden_size`` principal directions (the student starts with the target's token
            geometry), everything else transformers' init.
3. trunk    next-token CE on the corpus rows (``ce_weight``; ``kl_weight`` adds KL(target || hybrid) per
            token, off in the recorded build). The target was trained on this corpus down to 0.014 nats
            on assistant tokens, so the corpus answers are, to within that, its greedy answers; on this
            2-core CPU, at equal wall time, CE imitated the target better than KL distillation (whose
            teacher forward costs ~60% more per step): top-1 agreement 0.848 vs 0.826 and assistant CE
            0.53 vs 0.77 after ~128 s each. AdamW (0.9/0.95, wd 0.1 on matrices), warm-up then cosine to
            10%, grad-clip 1.0.
4. mtp      trunk frozen (bf16-rounded, as shipped); the MTP block (fc over [enorm(embed(x[t+1])),
            hnorm(h[t])], one gated full-attention decoder layer at position t+1, its own final norm, the
            tied lm_head — llama.cpp's ``graph_mtp`` in src/models/qwen35.cpp, with h = the trunk's
            final-normed hidden state, which is what llama.cpp feeds it) trained with
            KL(trunk(t+1) || mtp(t)).
5. save     bf16 safetensors (trunk via save_pretrained + ``mtp.*``), config with ``layer_types`` and a
            matching ``full_attention_interval``, generation_config (eos [0, 2]), tokenizer files linked
            from fixtures/models/target, build_info.json; then measured in fp32 on the bf16 weights:
            val CE, top-1 agreement with the target, and on prompts/default.jsonl the greedy outputs,
            their top-1/top-2 margins, and a simulated draft-simple acceptance of fixtures/models/draft
            (HF, greedy drafts of up to 4 tokens).

Each training stage stops at its step count or its wall-clock budget (``*_max_s``), whichever comes first,
with the LR schedule following the same progress (tools/build_fixtures.py's convention). With budgets that
never lead (``--set trunk_max_s=1e9 --set mtp_max_s=1e9``) everything depends on steps only and a rebuild
with the same torch and ``--threads`` is bit-identical; with the default budgets a loaded machine can end
a stage early (the log says so; the steps reached are recorded), so a rebuild reproduces the recipe, not
the bytes — the recorded build's MTP stage stopped at its budget. The evaluation is deterministic.
``--manifest`` rewrites only the ``models/<out dir name>/`` lines of fixtures/MANIFEST.sha256 (appending
them if absent); the other lines are left as they are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_fixtures as bf  # noqa: E402
import corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "fixtures"
TARGET_DIR = FIXTURES / "models" / "target"
DRAFT_DIR = FIXTURES / "models" / "draft"

VOCAB_SIZE = bf.VOCAB_SIZE
SEQ_LEN = 256
FULL_ATTENTION_INTERVAL = 4
ARCH = dict(hidden_size=128, intermediate_size=192, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # the full-attention layer (gated q)
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4)  # GDN layers: 2 k heads, 4 v heads (as Qwen3.5: v = 2k)
LAYER_TYPES = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
               for i in range(ARCH["num_hidden_layers"])]
# rope over half of each 32-dim head (16 dims = 8 frequency pairs), interleaved M-RoPE sections 3/3/2 like
# Qwen3.5's 11/11/10 (text positions are equal in all sections, so this is plain RoPE on the text path)
ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[3, 3, 2],
            mrope_interleaved=True)

FULL = dict(n_train=45_000, n_val=600, trunk_steps=500, trunk_bs=16, trunk_lr=6e-3, trunk_warmup=30,
            trunk_max_s=480, ce_weight=1.0, kl_weight=0.0, teacher_temp=1.0, teacher_bf16=1,
            mtp_steps=120, mtp_bs=16, mtp_lr=3e-3, mtp_warmup=15, mtp_max_s=75)
SMOKE = dict(n_train=2_000, n_val=100, trunk_steps=6, trunk_bs=4, trunk_lr=6e-3, trunk_warmup=2,
             trunk_max_s=60, ce_weight=1.0, kl_weight=1.0, teacher_temp=1.0, teacher_bf16=1,
             mtp_steps=4, mtp_bs=4, mtp_lr=3e-3, mtp_warmup=2, mtp_max_s=60)

log = bf.log


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def hybrid_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=VOCAB_SIZE, max_position_embeddings=4096, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, bos_token_id=None,
                             eos_token_id=corpus.SPECIAL_TOKENS.index(corpus.IM_END),
                             pad_token_id=corpus.SPECIAL_TOKENS.index(corpus.PAD),
                             layer_types=list(LAYER_TYPES), rope_parameters=dict(ROPE), **ARCH)


class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction block, laid out as its checkpoints store it (``mtp.*``):
    ``fc`` [H, 2H], ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers.0`` (a full-attention
    decoder layer), ``norm``. The lm_head is the trunk's (tied embedding)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                                  Qwen3_5TextRotaryEmbedding)

        cfg = config.__class__(**{**config.to_dict(), "layer_types": ["full_attention"] * config.num_hidden_layers})
        cfg._attn_implementation = "sdpa"
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, 0)])
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(cfg)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden[:, t] = trunk's final-normed state at t, next_embeds[:, t] = embed(x[t + 1]),
        positions[:, t] = t + 1. Returns the MTP hidden state (before the lm_head)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        pe = self.rotary(x, positions)
        x = self.layers[0](x, position_embeddings=pe, attention_mask=None, position_ids=positions)
        return self.norm(x)


def pca_embedding(target_embed: torch.Tensor, dim: int) -> torch.Tensor:
    """The target's [V, D] embedding projected onto its top ``dim`` principal directions, rescaled to the
    target's per-entry RMS (deterministic: a full SVD, sign-fixed)."""
    e = target_embed.float()
    u, s, vh = torch.linalg.svd(e - e.mean(0, keepdim=True), full_matrices=False)
    vh = vh[:dim]
    sign = torch.sign(vh[:, :1].sum(-1, keepdim=True) + 1e-12)
    proj = e @ (vh * sign).T
    return proj * (e.pow(2).mean().sqrt() / proj.pow(2).mean().sqrt())


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def lr_at(step: int, steps: int, peak: float, warmup: int, t0: float, max_s: float) -> float:
    """tools/build_fixtures.py's schedule: warm-up, then cosine to 10% over the progress (steps done or
    wall-clock budget used, whichever is further along). While step progress leads, the schedule (and the
    result) depends on steps only; on a loaded machine wall time can lead, and then on the machine."""
    return bf.lr_at(step, bf.progress(step, steps, t0, max_s), peak, warmup)


def kl_per_token(t_logits: torch.Tensor, s_logits: torch.Tensor) -> torch.Tensor:
    t_lp = torch.log_softmax(t_logits.float(), -1)
    s_lp = torch.log_softmax(s_logits.float(), -1)
    return (t_lp.exp() * (t_lp - s_lp)).sum(-1)


def train_trunk(model, target, rows: torch.Tensor, cfg: dict, pad_id: int) -> dict:
    bf.seed_all(21)
    opt = bf.make_opt(model, cfg["trunk_lr"])
    t0 = time.time()
    model.train()
    step, hist = 0, []
    for step, idx in enumerate(bf.batches(rows.shape[0], cfg["trunk_bs"], cfg["trunk_steps"], seed=31)):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, cfg["trunk_steps"], cfg["trunk_lr"], cfg["trunk_warmup"], t0, cfg["trunk_max_s"])
        x = rows[idx]
        valid = x != pad_id
        loss = torch.zeros(())
        s_logits = model(input_ids=x).logits
        if cfg["kl_weight"] > 0:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(cfg["teacher_bf16"])):
                t_logits = target(input_ids=x).logits
            kl = kl_per_token(t_logits.float() / cfg["teacher_temp"], s_logits)
            loss = loss + cfg["kl_weight"] * kl[valid].mean()
        if cfg["ce_weight"] > 0:
            labels = x.masked_fill(~valid, -100)
            loss = loss + cfg["ce_weight"] * F.cross_entropy(s_logits[:, :-1].float().reshape(-1, VOCAB_SIZE),
                                                             labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hist.append(loss.item())
        if step % 25 == 0 or step == cfg["trunk_steps"] - 1:
            agree = ""
            if cfg["kl_weight"] > 0:
                with torch.no_grad():
                    same = (t_logits.argmax(-1) == s_logits.argmax(-1))[valid]
                agree = f" top1-agree {same.float().mean().item():.3f}"
            log(f"trunk step {step} loss {loss.item():.4f}{agree} lr {opt.param_groups[0]['lr']:.2e} "
                f"{time.time() - t0:.0f}s")
        if not math.isfinite(hist[-1]):
            raise SystemExit(f"trunk: non-finite loss at step {step}")
        if bf.progress(step + 1, cfg["trunk_steps"], t0, cfg["trunk_max_s"]) >= 1.0:
            if step + 1 < cfg["trunk_steps"]:
                log(f"trunk: wall-clock budget {cfg['trunk_max_s']}s reached at step {step + 1} (not bit-reproducible)")
            break
    model.eval()
    tail = hist[-25:]
    return dict(steps=step + 1, seconds=round(time.time() - t0, 1), final_loss=round(hist[-1], 4),
                mean_loss_last25=round(sum(tail) / len(tail), 4), tokens_seen=(step + 1) * cfg["trunk_bs"] * SEQ_LEN)


def trunk_states(model, x: torch.Tensor):
    out = model.model(input_ids=x)
    h = out.last_hidden_state  # final-normed (Qwen3_5TextModel applies self.norm), what llama.cpp feeds the MTP
    return h, model.lm_head(h)


def mtp_logits(model, mtp: MTPHead, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Logits of the MTP head for positions 0..L-2 (predicting x[t + 2])."""
    L = x.shape[1]
    pos = torch.arange(1, L, device=x.device)[None].expand(x.shape[0], -1)
    e = model.model.embed_tokens(x[:, 1:])
    return model.lm_head(mtp(h[:, :-1], e, pos))


def train_mtp(model, mtp: MTPHead, rows: torch.Tensor, cfg: dict, pad_id: int) -> dict:
    bf.seed_all(22)
    opt = bf.make_opt(mtp, cfg["mtp_lr"])
    t0 = time.time()
    mtp.train()
    step, hist = 0, []
    for step, idx in enumerate(bf.batches(rows.shape[0], cfg["mtp_bs"], cfg["mtp_steps"], seed=32)):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, cfg["mtp_steps"], cfg["mtp_lr"], cfg["mtp_warmup"], t0, cfg["mtp_max_s"])
        x = rows[idx]
        with torch.no_grad():
            h, logits = trunk_states(model, x)
        m_logits = mtp_logits(model, mtp, x, h)
        valid = (x[:, 2:] != pad_id)  # position t predicts x[t + 2]; the trunk's row t + 1 is the teacher
        kl = kl_per_token(logits[:, 1:], m_logits)
        loss = kl[:, :-1][valid].mean() if valid.any() else kl.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        hist.append(loss.item())
        if step % 25 == 0 or step == cfg["mtp_steps"] - 1:
            with torch.no_grad():
                agree = (logits[:, 1:-1].argmax(-1) == m_logits[:, :-1].argmax(-1))[valid].float().mean().item()
            log(f"mtp step {step} KL {loss.item():.4f} top1-agree {agree:.3f} {time.time() - t0:.0f}s")
        if bf.progress(step + 1, cfg["mtp_steps"], t0, cfg["mtp_max_s"]) >= 1.0:
            if step + 1 < cfg["mtp_steps"]:
                log(f"mtp: wall-clock budget {cfg['mtp_max_s']}s reached at step {step + 1} (not bit-reproducible)")
            break
    mtp.eval()
    tail = hist[-25:]
    return dict(steps=step + 1, seconds=round(time.time() - t0, 1), final_kl=round(hist[-1], 4),
                mean_kl_last25=round(sum(tail) / len(tail), 4))


# ---------------------------------------------------------------------------------------------
# Evaluation (fp32 on the bf16-rounded weights)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def eval_val(model, mtp, target, rows: torch.Tensor, amask: torch.Tensor, pad_id: int, bs: int = 32) -> dict:
    res = bf.eval_ce(model, rows, amask, "cpu", pad_id, bs=bs)
    agree = n = mtp_agree = mtp_n = 0
    for i in range(0, rows.shape[0], bs):
        x = rows[i:i + bs]
        valid = x != pad_id
        t_top = target(input_ids=x).logits.argmax(-1)
        h, logits = trunk_states(model, x)
        s_top = logits.argmax(-1)
        agree += (t_top == s_top)[valid].sum().item()
        n += valid.sum().item()
        if mtp is not None:
            m_top = mtp_logits(model, mtp, x, h).argmax(-1)[:, :-1]
            v2 = x[:, 2:] != pad_id
            mtp_agree += (m_top == s_top[:, 1:-1])[v2].sum().item()
            mtp_n += v2.sum().item()
    res["top1_agree_with_target"] = round(agree / n, 4)
    if mtp is not None:
        res["mtp_top1_agree_with_trunk_next"] = round(mtp_agree / max(1, mtp_n), 4)
    return res


@torch.no_grad()
def greedy(model, ids: list[int], max_new: int, stop: set[int]) -> tuple[list[int], list[float]]:
    """Greedy continuation (no cache: full forward each step, exact) and the top-1 minus top-2 logprob
    margin at each generated position."""
    seq, margins = list(ids), []
    for _ in range(max_new):
        lp = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].float(), -1)
        top = torch.topk(lp, 2)
        margins.append(round((top.values[0] - top.values[1]).item(), 4))
        nxt = int(top.indices[0])
        seq.append(nxt)
        if nxt in stop:
            break
    return seq[len(ids):], margins


@torch.no_grad()
def simulate_draft_simple(target_out: list[int], prompt: list[int], draft, n_max: int = 4) -> dict:
    """What a greedy standalone draft of up to ``n_max`` tokens would get accepted along the (hybrid's)
    greedy output: per verify step, the accepted prefix length. Every step drafts n_max tokens (llama.cpp's
    draft-simple also stops drafting early on low draft confidence, so this is an upper bound on drafts)."""
    steps, pos = [], 0
    n = len(target_out)
    while pos < n - 1:  # the first token comes from the prefill; each step emits accepted + 1
        ctx = prompt + target_out[:pos + 1]
        drafted = []
        for _ in range(min(n_max, n - 1 - pos)):
            nxt = int(draft(input_ids=torch.tensor([ctx + drafted])).logits[0, -1].argmax())
            drafted.append(nxt)
        acc = 0
        for d, t in zip(drafted, target_out[pos + 1:]):
            if d != t:
                break
            acc += 1
        steps.append((len(drafted), acc))
        pos += acc + 1
    return dict(drafted=sum(d for d, _ in steps), accepted=sum(a for _, a in steps), steps=len(steps),
                partial=sum(1 for d, a in steps if 0 < a < d), zero=sum(1 for _, a in steps if a == 0),
                full=sum(1 for d, a in steps if a == d))


def suite_eval(model, target, draft, tok_hf, stop_ids: list[int]) -> dict:
    prompts = bf.load_suite_prompts(tok_hf)
    per, tot = [], dict(drafted=0, accepted=0, steps=0, partial=0, zero=0, full=0)
    same = exact_prefix = 0
    min_margins = []
    for pid, cat, ids, mx in prompts:
        h_out, margins = greedy(model, ids, mx, set(stop_ids))
        t_out, _ = greedy(target, ids, mx, set(stop_ids))
        sim = simulate_draft_simple(h_out, ids, draft)
        for k in tot:
            tot[k] += sim[k]
        match = 0
        for a, b in zip(h_out, t_out):
            if a != b:
                break
            match += 1
        same += int(h_out == t_out)
        exact_prefix += match
        min_margins.append(min(margins))
        per.append(dict(id=pid, new=len(h_out), stops=h_out[-1] in stop_ids, same_as_target=h_out == t_out,
                        common_prefix=match, min_margin=min(margins),
                        mean_margin=round(sum(margins) / len(margins), 3), accept=f"{sim['accepted']}/{sim['drafted']}",
                        text=tok_hf.decode(h_out)))
    all_m = sorted(min_margins)
    return dict(prompts=len(prompts), same_output_as_target=same,
                mean_common_prefix_with_target=round(exact_prefix / len(prompts), 2),
                prompts_min_margin_below_0_2=sum(1 for m in all_m if m < 0.2),
                simulated_draft_simple=dict(tot, acceptance=round(tot["accepted"] / max(1, tot["drafted"]), 3)),
                per_prompt=per)


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def save(model, mtp: MTPHead, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    m = model.to(torch.bfloat16)
    m.generation_config = bf.generation_config()
    m.save_pretrained(str(out))
    st = out / "model.safetensors"
    sd = load_file(str(st))
    for k, v in mtp.state_dict().items():
        if k.startswith("rotary."):
            continue
        sd[f"mtp.{k}"] = v.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(dict(sorted(sd.items())), str(st), metadata={"format": "pt"})
    os.chmod(st, 0o644)  # save_file writes 0600
    cfg = json.loads((out / "config.json").read_text())
    # Qwen3.5 checkpoints carry both: llama.cpp writes the interval, and the layout from layer_types
    cfg["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    cfg["mtp_num_hidden_layers"] = 1
    cfg["mtp_use_dedicated_embeddings"] = False
    (out / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    bf.link_tokenizer(TARGET_DIR.parent / "tokenizer", out)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def load_fixture_lm(path: Path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def load_hybrid(path: Path):
    """(trunk as Qwen3_5ForCausalLM fp32, MTPHead fp32) from a saved fixture directory."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    mtp = MTPHead(model.config)
    sd = {k[len("mtp."):]: v.float() for k, v in load_file(str(path / "model.safetensors")).items()
          if k.startswith("mtp.")}
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.startswith("rotary.") for k in missing), (missing, unexpected)
    return model, mtp.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(FIXTURES / "models" / "hybrid"))
    ap.add_argument("--smoke", action="store_true", help="tiny corpus and steps: pipeline check only")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: robust on a shared 2-core machine; results depend on it)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    ap.add_argument("--no-suite", action="store_true", help="skip the prompt-suite measurement")
    ap.add_argument("--manifest", action="store_true", help="update fixtures/MANIFEST.sha256 for --out")
    ap.add_argument("--eval-only", action="store_true",
                    help="measure an existing --out directory, train nothing, compare with its build_info.json")
    ap.add_argument("--json", help="with --eval-only: write the measurements to this file")
    args = ap.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    for kv in args.set:
        k, v = kv.split("=", 1)
        if k not in cfg:
            ap.error(f"unknown recipe key {k!r} (known: {sorted(cfg)})")
        cfg[k] = type(cfg[k])(float(v))
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    T0 = time.time()
    out = Path(args.out)
    pad_id = corpus.SPECIAL_TOKENS.index(corpus.PAD)
    stop_ids = [corpus.SPECIAL_TOKENS.index(corpus.EOT), corpus.SPECIAL_TOKENS.index(corpus.IM_END)]
    tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    tok_hf = AutoTokenizer.from_pretrained(str(TARGET_DIR))
    target = load_fixture_lm(TARGET_DIR)
    draft = load_fixture_lm(DRAFT_DIR)

    users, raws = bf.heldout_from_prompts(REPO / "prompts" / "default.jsonl")
    val_docs = list(corpus.iter_docs("val", cfg["n_val"], users, raws))
    val_rows = bf.pack(bf.encode(tok, [corpus.render(d) for d in val_docs]), SEQ_LEN, pad_id)
    val_amask = bf.assistant_mask(val_rows, tok.token_to_id("assistant"), tok.encode("\n").ids[0])

    recorded: dict = {}
    if args.eval_only:
        model, mtp = load_hybrid(out)
        if (out / "build_info.json").is_file():
            recorded = json.loads((out / "build_info.json").read_text())
        info = {"eval_only": str(out), "threads": args.threads, "torch": torch.__version__,
                "transformers": transformers.__version__}
    else:
        info = {"device": "cpu", "threads": args.threads, "torch": torch.__version__,
                "transformers": transformers.__version__, "cfg": cfg, "arch": ARCH, "layer_types": LAYER_TYPES,
                "rope_parameters": ROPE, "seq_len": SEQ_LEN}
        log(f"hybrid build start: {info}")
        train_docs = list(corpus.iter_docs("train", cfg["n_train"], users, raws))
        train_rows = bf.pack(bf.encode(tok, [corpus.render(d) for d in train_docs]), SEQ_LEN, pad_id)
        info["corpus"] = dict(train_docs=len(train_docs), skipped_heldout=cfg["n_train"] - len(train_docs),
                              train_rows=train_rows.shape[0], train_tokens=int((train_rows != pad_id).sum()),
                              val_docs=len(val_docs), val_tokens=int((val_rows != pad_id).sum()),
                              seconds=round(time.time() - T0, 1))
        log(f"corpus: {info['corpus']}")

        bf.seed_all(20)
        model = Qwen3_5ForCausalLM(hybrid_config())
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(pca_embedding(target.model.embed_tokens.weight,
                                                                ARCH["hidden_size"]))
        info["params_trunk"] = sum(p.numel() for p in model.parameters())
        info["trunk_train"] = train_trunk(model, target, train_rows, cfg, pad_id)
        log(f"trunk: {info['trunk_train']} ({time.time() - T0:.0f}s)")
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())  # the MTP learns on the trunk that ships

        bf.seed_all(23)
        mtp = MTPHead(model.config)
        info["params_mtp"] = sum(p.numel() for n, p in mtp.named_parameters())
        info["mtp_train"] = train_mtp(model, mtp, train_rows, cfg, pad_id)
        log(f"mtp: {info['mtp_train']} ({time.time() - T0:.0f}s)")
        with torch.no_grad():
            for p in mtp.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        info["train_seconds"] = round(time.time() - T0, 1)
        save(model, mtp, out)
        model, mtp = load_hybrid(out)  # measure exactly what ships (bf16 -> fp32)

    t1 = time.time()
    info["val"] = eval_val(model, mtp, target, val_rows, val_amask, pad_id)
    info["target_val_same_rows"] = bf.eval_ce(target, val_rows, val_amask, "cpu", pad_id, bs=32)
    log(f"val: {info['val']} (target on the same rows: {info['target_val_same_rows']})")
    if not args.no_suite:
        info["suite"] = suite_eval(model, target, draft, tok_hf, stop_ids)
        s = {k: v for k, v in info["suite"].items() if k != "per_prompt"}
        log(f"suite: {s}")
    info["eval_seconds"] = round(time.time() - t1, 1)
    if args.eval_only:
        # the committed build_info.json is pinned by the manifest: report, never rewrite it
        for key in ("val", "suite"):
            if key in info and key in recorded:
                same = info[key] == recorded[key]
                log(f"{key}: {'same as' if same else 'DIFFERS from'} the recorded build_info.json")
        if args.json:
            Path(args.json).write_text(json.dumps(info, indent=1, ensure_ascii=False, default=str) + "\n")
        return 0
    info["total_seconds"] = round(time.time() - T0, 1)
    info["bytes"] = {p.name: p.stat().st_size for p in sorted(out.iterdir())
                     if p.is_file() and p.name != "build_info.json"}
    (out / "build_info.json").write_text(json.dumps(info, indent=1, ensure_ascii=False, default=str) + "\n")
    if args.manifest:
        log(f"manifest: {bf.update_manifest(out)}")
    log(f"done in {time.time() - T0:.0f}s: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
