#!/usr/bin/env python
"""Rebuild every specparity fixture model, deterministically (fixed seeds), from nothing but code.

    python tools/build_fixtures.py --device cuda --tokenizer fixtures/models/tokenizer   # the recorded build
    python tools/build_fixtures.py --device cpu --replay    # the recorded step counts, no time budget (slow)
    python tools/build_fixtures.py --device cpu --smoke     # tiny steps: checks the pipeline only

Each training stage stops at its step count or its wall-clock budget (``*_max_s``), whichever comes
first, with the learning-rate schedule following the same progress; on the H200 the budgets bound
(the steps reached are in ``build_info.json``). ``--replay`` uses those recorded step counts and no
budget: the same recipe, not bit-identical (the recorded schedule followed wall-clock progress, and
CUDA attention backward is not deterministic).

Steps (all seeds fixed; see docs/notes/fixtures-build.md for what came out):

1. corpus      tools/corpus.py, streams "train" / "val" / "distill"; documents whose user turn equals a
               prompt of prompts/default.jsonl (or that start with one of its raw prompts) are skipped,
               so the prompt suite is held out.
2. tokenizer   byte-level BPE (``tokenizers``), Qwen2-style pre-tokenizer (single digits), vocab 4096,
               special tokens <|endoftext|> <|im_start|> <|im_end|> <|mask|> <|pad|> (ids 0..4),
               Qwen-style chat template. ``--tokenizer DIR`` reuses an existing one instead.
3. target      Qwen3ForCausalLM (4 layers, hidden 256, 4 heads / 2 kv heads, head_dim 64, inter 768, tied
               embeddings), next-token CE on packed 512-token rows.
4. draft       Qwen3ForCausalLM (1 layer, hidden 256, inter 512, tied), embedding copied from the target,
               distilled with KL(target || draft) on corpus rows and on the target's own greedy
               continuations (for transformers assisted generation).
5. dflash2 / dflash1
               dflash.model.DFlash2DraftModel / DFlashDraftModel (2 layers each), trained with the DFlash
               objective: target hidden states of layers ``TARGET_LAYER_IDS`` over the context (positions
               < anchor) + block [anchor, <|mask|> x 7] -> the target's greedy next tokens at block
               positions 1..7 through the target's lm_head; DFlash2 also trains its candidate selector.
6. save        bf16 safetensors + config + generation_config (+ links to the one tokenizer) under ``--out``,
               ``build_info.json`` (losses, steps, timings) in ``--out``, and ``MANIFEST.sha256`` in the
               parent of ``--out`` (sha256sum format, paths ``models/...``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

VOCAB_SIZE = 4096
SEQ_LEN = 512
TARGET_LAYER_IDS = [0, 2, 3]  # hidden_states[i + 1]: after layers 1, 3 and the final (normed) layer 4
BLOCK_SIZE = 8
QWEN_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TARGET_ARCH = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=768)
DRAFT_ARCH = dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=512)
DFLASH_ARCH = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=512)
DFLASH2_EXTRA = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=32, selector_top_k=8)

FULL = dict(n_train=300_000, n_val=3_000, n_distill=8_192, tok_docs=100_000,
            target_steps=6000, target_bs=64, target_lr=2e-3, target_max_s=170,
            draft_steps=3000, draft_bs=64, draft_lr=2e-3, draft_max_s=60,
            dflash_steps=4000, dflash_bs=32, dflash_anchors=32, dflash_lr=1.5e-3, dflash_max_s=85,
            gen_new_tokens=96, gen_batch=512)
# step counts the recorded H200 build reached inside its budgets (fixtures/models/build_info.json)
RECORDED = dict(target_steps=5093, draft_steps=2301, dflash2_steps=1665, dflash1_steps=2475)
SMOKE = dict(n_train=3_000, n_val=200, n_distill=64, tok_docs=3_000,
             target_steps=30, target_bs=8, target_lr=2e-3, target_max_s=120,
             draft_steps=10, draft_bs=8, draft_lr=2e-3, draft_max_s=60,
             dflash_steps=10, dflash_bs=4, dflash_anchors=8, dflash_lr=1.5e-3, dflash_max_s=60,
             gen_new_tokens=24, gen_batch=32)

LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    LOG.append(line)


def seed_all(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---------------------------------------------------------------------------------------------
# Held-out prompts
# ---------------------------------------------------------------------------------------------


def heldout_from_prompts(path: Path) -> tuple[set[str], list[str]]:
    users: set[str] = set()
    raws: list[str] = []
    if not path.exists():
        return users, raws
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip() or i == 0:
            continue
        obj = json.loads(line)
        if "prompt" in obj:
            raws.append(obj["prompt"])
        else:
            users.update(m["content"] for m in obj["messages"] if m["role"] == "user")
    return users, raws


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=corpus.SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    clean = []
    for t in texts:
        for s in corpus.SPECIAL_TOKENS:
            t = t.replace(s, "\n")
        clean.append(t)
    tok.train_from_iterator(clean, trainer, length=len(clean))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=corpus.IM_END, pad_token=corpus.PAD, bos_token=None, unk_token=None,
        additional_special_tokens=[corpus.EOT, corpus.IM_START, corpus.MASK],
        model_max_length=4096, clean_up_tokenization_spaces=False,
    )
    hf.chat_template = corpus.CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))
    # transformers 5 writes the template to chat_template.jinja; also put it (and a class name every
    # transformers 5.x resolves) into tokenizer_config.json for loaders that only read that file
    cfg_path = out_dir / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg["chat_template"] = corpus.CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    check_tokenizer(out_dir)


def check_tokenizer(tok_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {s: hf.convert_tokens_to_ids(s) for s in corpus.SPECIAL_TOKENS}
    assert ids == {s: i for i, s in enumerate(corpus.SPECIAL_TOKENS)}, ids
    for sample in ["写一首关于春天的短诗。", "def f(n):\n    return n * 2\n\nprint(f(3))  # 6", "1, 2, 3 ... 99"]:
        enc = hf(sample, add_special_tokens=False)["input_ids"]
        assert hf.decode(enc) == sample, (sample, hf.decode(enc))
    msgs = [{"role": "user", "content": "Hi"}]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == corpus.render_chat([("user", "Hi")], add_generation_prompt=True), rendered
    return ids


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def encode(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def pack(seqs: list[list[int]], length: int, pad_id: int) -> torch.Tensor:
    rows, cur = [], []
    for s in seqs:
        s = s[:length]
        if len(cur) + len(s) > length:
            rows.append(cur + [pad_id] * (length - len(cur)))
            cur = []
        cur = cur + s
    if cur:
        rows.append(cur + [pad_id] * (length - len(cur)))
    return torch.tensor(rows, dtype=torch.long)


def assistant_mask(ids: torch.Tensor, assistant_id: int, nl_id: int) -> torch.Tensor:
    """True at tokens of an assistant answer: after ``<|im_start|>assistant\\n`` up to and including
    ``<|im_end|>``."""
    mask = []
    im_start, im_end = corpus.SPECIAL_TOKENS.index(corpus.IM_START), corpus.SPECIAL_TOKENS.index(corpus.IM_END)
    for r in range(ids.shape[0]):
        row = ids[r].tolist()
        mrow = [False] * len(row)
        mask.append(mrow)
        inside, begin = False, -1
        for p, t in enumerate(row):
            if p == begin:
                inside = True
            if inside:
                mrow[p] = True
                if t == im_end:
                    inside = False
            elif t == im_start and p + 2 < len(row) and row[p + 1] == assistant_id and row[p + 2] == nl_id:
                begin = p + 3
    return torch.tensor(mask, dtype=torch.bool).view(ids.shape)


def batches(n_rows: int, bs: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_rows, generator=g)
    pos = 0
    for _ in range(steps):
        if pos + bs > n_rows:
            perm = torch.randperm(n_rows, generator=g)
            pos = 0
        yield perm[pos:pos + bs]
        pos += bs


def lr_at(step: int, progress: float, peak: float, warmup: int = 100) -> float:
    """Linear warmup, then cosine from ``peak`` to ``0.1 * peak`` over ``progress`` in [0, 1]."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def progress(step: int, steps: int, t0: float, max_s: float) -> float:
    """Training progress: steps done or wall-clock budget used, whichever is further along. With a fast
    enough device the step count binds (fully deterministic); otherwise the time budget ends the run
    with the schedule still annealed (the steps reached are recorded in build_info.json)."""
    return max(step / steps, (time.time() - t0) / max_s)


def make_opt(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "codebook" not in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim >= 2 and "codebook" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def autocast(device: str):
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------


def qwen3_config(arch: dict, **extra):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB_SIZE, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=corpus.SPECIAL_TOKENS.index(corpus.IM_END),
                       pad_token_id=corpus.SPECIAL_TOKENS.index(corpus.PAD), **arch, **extra)


def train_target(rows: torch.Tensor, cfg: dict, device: str, pad_id: int):
    from transformers import Qwen3ForCausalLM

    seed_all(1)
    model = Qwen3ForCausalLM(qwen3_config(TARGET_ARCH)).to(device)
    opt = make_opt(model, cfg["target_lr"])
    t0 = time.time()
    model.train()
    step = 0
    for step, idx in enumerate(batches(rows.shape[0], cfg["target_bs"], cfg["target_steps"], seed=11)):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, progress(step, cfg["target_steps"], t0, cfg["target_max_s"]), cfg["target_lr"])
        x = rows[idx].to(device)
        labels = x.masked_fill(x == pad_id, -100)
        with autocast(device):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB_SIZE), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == cfg["target_steps"] - 1:
            log(f"target step {step} loss {loss.item():.4f} lr {opt.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s")
        if progress(step + 1, cfg["target_steps"], t0, cfg["target_max_s"]) >= 1.0:
            break
    model.eval()
    return model, dict(steps=step + 1, seconds=round(time.time() - t0, 1), final_train_loss=round(loss.item(), 4))


@torch.no_grad()
def eval_ce(model, rows: torch.Tensor, amask: torch.Tensor, device: str, pad_id: int, bs: int = 64) -> dict:
    tot = tot_a = 0.0
    n = n_a = 0
    for i in range(0, rows.shape[0], bs):
        x = rows[i:i + bs].to(device)
        logits = model(input_ids=x).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1)
        tgt = x[:, 1:]
        nll = -lp.gather(-1, tgt[..., None])[..., 0]
        valid = tgt != pad_id
        am = amask[i:i + bs, 1:].to(device) & valid
        tot += nll[valid].sum().item()
        n += valid.sum().item()
        tot_a += nll[am].sum().item()
        n_a += am.sum().item()
    return dict(ce_all=round(tot / n, 4), ce_assistant=round(tot_a / max(1, n_a), 4), tokens=n, assistant_tokens=n_a)


@torch.no_grad()
def greedy_continue(model, prompts: list[list[int]], new_tokens: int, batch: int, device: str,
                    stop_ids: set[int], pad_id: int) -> list[list[int]]:
    """Right-padded batched greedy decoding without a cache (exact positions, no attention mask needed)."""
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        lens = torch.tensor([len(p) for p in chunk], device=device)
        width = int(lens.max()) + new_tokens
        buf = torch.full((len(chunk), width), pad_id, dtype=torch.long, device=device)
        for r, p in enumerate(chunk):
            buf[r, :len(p)] = torch.tensor(p, device=device)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        cur = lens.clone()
        stop = torch.tensor(sorted(stop_ids), device=device)
        for _ in range(new_tokens):
            upto = int(cur.max())
            with autocast(device):
                logits = model(input_ids=buf[:, :upto]).logits
            nxt = logits[torch.arange(len(chunk), device=device), cur - 1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            buf[torch.arange(len(chunk), device=device), cur.clamp(max=width - 1)] = torch.where(
                done, buf[torch.arange(len(chunk), device=device), cur.clamp(max=width - 1)], nxt)
            cur = torch.where(done, cur, cur + 1)
            done = done | torch.isin(nxt, stop)
            if bool(done.all()):
                break
        for r in range(len(chunk)):
            out.append(buf[r, :int(cur[r])].tolist())
    return out


# ---------------------------------------------------------------------------------------------
# Standalone draft (assisted generation)
# ---------------------------------------------------------------------------------------------


def train_draft(target, rows: torch.Tensor, cfg: dict, device: str, pad_id: int):
    from transformers import Qwen3ForCausalLM

    seed_all(2)
    draft = Qwen3ForCausalLM(qwen3_config(DRAFT_ARCH)).to(device)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    opt = make_opt(draft, cfg["draft_lr"])
    t0 = time.time()
    draft.train()
    step = 0
    for step, idx in enumerate(batches(rows.shape[0], cfg["draft_bs"], cfg["draft_steps"], seed=12)):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, progress(step, cfg["draft_steps"], t0, cfg["draft_max_s"]), cfg["draft_lr"])
        x = rows[idx].to(device)
        valid = (x != pad_id)
        with torch.no_grad(), autocast(device):
            t_logits = target(input_ids=x).logits
        with autocast(device):
            s_logits = draft(input_ids=x).logits
        t_lp = torch.log_softmax(t_logits.float(), -1)
        s_lp = torch.log_softmax(s_logits.float(), -1)
        kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1)
        loss = kl[valid].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == cfg["draft_steps"] - 1:
            with torch.no_grad():
                agree = (t_logits.argmax(-1) == s_logits.argmax(-1))[valid].float().mean().item()
            log(f"draft step {step} KL {loss.item():.4f} top1-agree {agree:.3f} {time.time() - t0:.0f}s")
        if progress(step + 1, cfg["draft_steps"], t0, cfg["draft_max_s"]) >= 1.0:
            break
    draft.eval()
    return draft, dict(steps=step + 1, seconds=round(time.time() - t0, 1), final_kl=round(loss.item(), 4))


# ---------------------------------------------------------------------------------------------
# DFlash drafts
# ---------------------------------------------------------------------------------------------


def dflash_config(version: int, mask_id: int):
    dcfg = dict(block_size=BLOCK_SIZE, mask_token_id=mask_id, target_layer_ids=list(TARGET_LAYER_IDS))
    if version == 2:
        dcfg.update(DFLASH2_EXTRA)
    cfg = qwen3_config(DFLASH_ARCH, num_target_layers=TARGET_ARCH["num_hidden_layers"], dflash_config=dcfg,
                       architectures=["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"])
    cfg.tie_word_embeddings = False
    return cfg


def init_dflash(draft) -> None:
    """Explicit init of what DFlash leaves undefined: conv base kernels are ``torch.empty``."""
    from dflash.model import GroupedDynamicCausalConv

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mod in draft.modules():
            if isinstance(mod, GroupedDynamicCausalConv):
                mod.base_kernel.zero_()
                mod.base_kernel[:, 0, :] = 1.0  # identity: out[t] = x[t]
                mod.kernel_projection.weight.zero_()
        sel = getattr(draft, "candidate_selector", None)
        if sel is not None:
            # predecessor zero -> the bilinear term starts at 0 (plain argmax); successor random so it can learn
            sel.predecessor_codebook.weight.zero_()
            sel.successor_codebook.weight.copy_(torch.randn(sel.successor_codebook.weight.shape, generator=g) * 0.1)
            sel.hidden_projection.weight.copy_(torch.randn(sel.hidden_projection.weight.shape, generator=g) * 0.02)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def dflash_train_forward(draft, emb_w: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor,
                         anchors: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Many blocks per row in one pass; equals ``draft(...)`` of dflash_generate for each block
    (checked by ``check_train_forward``). Returns final-normed hidden states [B, m, bs, H]."""
    from dflash.model import apply_rotary_pos_emb

    B, L, _ = feats.shape
    m = anchors.shape[1]
    bs = BLOCK_SIZE
    H = draft.config.hidden_size
    dev = feats.device
    th = draft.hidden_norm(draft.fc(feats))
    block_ids = torch.full((B, m, bs), mask_id, dtype=torch.long, device=dev)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    x = F.embedding(block_ids, emb_w).view(B, m * bs, H)
    ar = torch.arange(bs, device=dev)
    qpos = (anchors[:, :, None] + ar).view(B, m * bs)
    kpos = torch.cat([torch.arange(L, device=dev).expand(B, L), qpos], 1)
    cos, sin = draft.rotary_emb(x, kpos)
    ctx_vis = (torch.arange(L, device=dev)[None, None, :] < anchors[:, :, None])  # [B, m, L]
    ctx_vis = ctx_vis.repeat_interleave(bs, dim=1)  # [B, m*bs, L]
    blk = torch.arange(m, device=dev).repeat_interleave(bs)
    own = (blk[:, None] == blk[None, :]).expand(B, m * bs, m * bs)
    mask = torch.cat([ctx_vis, own], -1)[:, None]
    h = x
    for layer in draft.layers:
        attn = layer.self_attn
        hd = attn.head_dim
        res = h
        y = layer.input_layernorm(h)
        akern = None
        if layer.attention_conv is not None:
            y, akern = layer.attention_conv.prepare(y.reshape(B * m, bs, H))
            y = y.reshape(B, m * bs, H)
        q = attn.q_norm(attn.q_proj(y).view(B, m * bs, -1, hd)).transpose(1, 2)
        k = torch.cat([attn.k_proj(th), attn.k_proj(y)], 1).view(B, L + m * bs, -1, hd)
        k = attn.k_norm(k).transpose(1, 2)
        v = torch.cat([attn.v_proj(th), attn.v_proj(y)], 1).view(B, L + m * bs, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = _repeat_kv(k, attn.num_key_value_groups), _repeat_kv(v, attn.num_key_value_groups)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        o = attn.o_proj(o.transpose(1, 2).reshape(B, m * bs, -1))
        if akern is not None:
            o = layer.attention_conv.finish(o.reshape(B * m, bs, H), akern).reshape(B, m * bs, H)
        h = res + o
        res = h
        y = layer.post_attention_layernorm(h)
        mkern = None
        if layer.mlp_conv is not None:
            y, mkern = layer.mlp_conv.prepare(y.reshape(B * m, bs, H))
            y = y.reshape(B, m * bs, H)
        y = layer.mlp(y)
        if mkern is not None:
            y = layer.mlp_conv.finish(y.reshape(B * m, bs, H), mkern).reshape(B, m * bs, H)
        h = res + y
    return draft.norm(h).view(B, m, bs, H)


@torch.no_grad()
def check_train_forward(draft, target, ids: torch.Tensor, mask_id: int) -> float:
    """Max |diff| between the batched training forward and the inference-path forward (fp32)."""
    from dflash.model import extract_context_feature

    draft = draft.float()
    out = target(input_ids=ids, output_hidden_states=True)
    feats = extract_context_feature(out.hidden_states, TARGET_LAYER_IDS).float()
    anchors = torch.tensor([[3, 9, 17]], device=ids.device)
    emb_w = target.get_input_embeddings().weight.float()
    batched = dflash_train_forward(draft, emb_w, feats, ids, anchors, mask_id)
    worst = 0.0
    for j, s in enumerate(anchors[0].tolist()):
        blk = torch.full((1, BLOCK_SIZE), mask_id, dtype=torch.long, device=ids.device)
        blk[0, 0] = ids[0, s]
        ref = draft(target_hidden=feats[:, :s], noise_embedding=F.embedding(blk, emb_w),
                    position_ids=torch.arange(s + BLOCK_SIZE, device=ids.device)[None], past_key_values=None,
                    use_cache=False)
        worst = max(worst, (ref[0] - batched[0, j]).abs().max().item())
    return worst


def train_dflash(version: int, target, rows: torch.Tensor, cfg: dict, device: str, pad_id: int, mask_id: int):
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, extract_context_feature

    seed_all(10 + version)
    cls = DFlash2DraftModel if version == 2 else DFlashDraftModel
    draft = cls(dflash_config(version, mask_id))
    init_dflash(draft)
    draft = draft.to(device)
    emb_w = target.get_input_embeddings().weight.detach()
    opt = make_opt(draft, cfg["dflash_lr"])
    bs, m = BLOCK_SIZE, cfg["dflash_anchors"]
    weights = torch.exp(-torch.arange(bs - 1, dtype=torch.float32, device=device) / 4.0)
    weights = weights / weights.sum() * (bs - 1)
    g = torch.Generator(device="cpu").manual_seed(20 + version)
    t0 = time.time()
    draft.train()
    step = 0
    steps = int(cfg.get(f"dflash{version}_steps", cfg["dflash_steps"]))
    for step, idx in enumerate(batches(rows.shape[0], cfg["dflash_bs"], steps, seed=13 + version)):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, progress(step, steps, t0, cfg["dflash_max_s"]), cfg["dflash_lr"])
        x = rows[idx].to(device)
        B, L = x.shape
        valid = x != pad_id
        with torch.no_grad(), autocast(device):
            out = target(input_ids=x, output_hidden_states=True)
            feats = extract_context_feature(out.hidden_states, TARGET_LAYER_IDS).float()
            greedy = out.logits.argmax(-1)  # greedy[p] = target's next token after position p
        vlen = valid.sum(1).cpu()
        u = torch.rand((B, m), generator=g)
        anchors = (1 + (u * (vlen[:, None] - 2).clamp(min=1)).long()).to(device)  # 1 .. vlen-2
        lpos = anchors[:, :, None] + torch.arange(bs - 1, device=device)  # label p for block pos k = anchor+k-1
        lpos_c = lpos.clamp(max=L - 1)
        labels = greedy.gather(1, lpos_c.view(B, -1)).view(B, m, bs - 1)
        lvalid = (lpos < L) & valid.gather(1, lpos_c.view(B, -1)).view(B, m, bs - 1)
        with autocast(device):
            hid = dflash_train_forward(draft, emb_w, feats, x, anchors, mask_id)[:, :, 1:]
            logits = (hid @ emb_w.T).float()  # target lm_head is the tied embedding
        ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1), reduction="none").view(B, m, bs - 1)
        wv = lvalid.float() * weights
        loss_tok = (ce * wv).sum() / wv.sum()
        loss = loss_tok
        sel_loss = torch.zeros((), device=device)
        if version == 2:
            sel = draft.candidate_selector
            with torch.no_grad():
                cand = logits.topk(sel.top_k, dim=-1).indices  # [B,m,7,k]
            unary = logits.gather(-1, cand)
            pred = torch.cat([x.gather(1, anchors)[:, :, None], labels[:, :, :-1]], -1)  # teacher forced
            with autocast(device):
                hp = sel.hidden_projection(hid)
            pair = torch.einsum("bmpr,bmpkr->bmpk", (sel.predecessor_codebook(pred) * hp).float(),
                                sel.successor_codebook(cand).float())
            scores = unary + pair
            hit = cand == labels[..., None]
            ok = hit.any(-1) & lvalid
            tgt_idx = hit.float().argmax(-1)
            sce = F.cross_entropy(scores.reshape(-1, sel.top_k), tgt_idx.reshape(-1), reduction="none").view(B, m, -1)
            sel_loss = (sce * ok.float() * weights).sum() / (ok.float() * weights).sum().clamp(min=1)
            loss = loss + sel_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            with torch.no_grad():
                hitp = ((logits.argmax(-1) == labels) & lvalid).float().sum((0, 1)) / lvalid.float().sum((0, 1))
            log(f"dflash{version} step {step} ce {loss_tok.item():.4f} sel {sel_loss.item():.4f} "
                f"pos-acc {' '.join(f'{a:.2f}' for a in hitp.tolist())} {time.time() - t0:.0f}s")
        if progress(step + 1, steps, t0, cfg["dflash_max_s"]) >= 1.0:
            break
    draft.eval()
    return draft, dict(steps=step + 1, seconds=round(time.time() - t0, 1), final_ce=round(loss_tok.item(), 4),
                       final_selector_ce=round(sel_loss.item(), 4))


# ---------------------------------------------------------------------------------------------
# Quick acceptance check (wherever we train) on the prompt suite
# ---------------------------------------------------------------------------------------------


def load_suite_prompts(tok_hf) -> list[tuple[str, str, list[int], int]]:
    """(id, category, token ids, max_new_tokens) of the prompt suite, encoded as the engines encode."""
    from specparity.model.prompts import encode_prompt, load_prompts

    path = REPO / "prompts" / "default.jsonl"
    if not path.exists():
        return []
    return [(p.id, p.category, encode_prompt(tok_hf, p.prompt, p.messages_as_dicts()), p.max_new_tokens or 48)
            for p in load_prompts(path).prompts]


@torch.no_grad()
def quick_accept(draft, target, prompts, device: str, stop_ids: list[int]) -> dict[str, float]:
    import dflash.model as dm

    dm._cuda_time = time.perf_counter  # CPU-safe timing (no torch.cuda.synchronize)
    per_cat: dict[str, list[int]] = {}
    for pid, cat, ids, mx in prompts:
        r = dm.dflash_generate(draft, target, torch.tensor([ids], device=device), mx, stop_ids, return_stats=True)
        per_cat.setdefault(cat, []).extend(r.acceptance_lengths)
    res = {c: round(sum(v) / len(v), 3) for c, v in sorted(per_cat.items())}
    allv = [a for v in per_cat.values() for a in v]
    res["ALL"] = round(sum(allv) / max(1, len(allv)), 3)
    return res


def zero_selector(draft) -> dict:
    sel = draft.candidate_selector
    saved = {k: v.clone() for k, v in sel.state_dict().items()}
    with torch.no_grad():
        sel.predecessor_codebook.weight.zero_()
        sel.successor_codebook.weight.zero_()
    return saved


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=[corpus.SPECIAL_TOKENS.index(corpus.EOT),
                                          corpus.SPECIAL_TOKENS.index(corpus.IM_END)],
                            pad_token_id=corpus.SPECIAL_TOKENS.index(corpus.PAD), bos_token_id=None,
                            do_sample=False)


def save_lm(model, out: Path, tok_dir: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    m = model.to("cpu").to(torch.bfloat16)
    m.generation_config = generation_config()
    m.save_pretrained(str(out))
    link_tokenizer(tok_dir, out)


def link_tokenizer(tok_dir: Path, out: Path) -> None:
    """The tokenizer files in a model directory as relative links to the one copy in ``tok_dir`` (every
    fixture shares the tokenizer; loaders and llama.cpp's converter read through the links)."""
    for f in sorted(tok_dir.iterdir()):
        link = out / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(os.path.relpath(f, out)))


def save_dflash(draft, out: Path) -> None:
    """config.json + model.safetensors (bf16) in the reference layout: selector codebooks are stored as
    ``candidate_selector.{predecessor,successor}_codebook`` (no ``.weight``), which is what
    ``DFlash2DraftModel.from_pretrained``'s key_mapping expects from released checkpoints."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in draft.state_dict().items():
        if k.endswith(("predecessor_codebook.weight", "successor_codebook.weight")):
            k = k[: -len(".weight")]
        sd[k] = v.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = draft.config
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(str(out))


def update_manifest(out: Path) -> Path:
    """Replace (or append) the ``models/<out.name>/`` lines of fixtures/MANIFEST.sha256 for a fixture built on
    its own (tools/build_hybrid_fixture.py, tools/build_eagle3.py); other lines untouched."""
    man = REPO / "fixtures" / "MANIFEST.sha256"
    prefix = f"models/{out.name}/"
    keep = [ln for ln in man.read_text().splitlines() if ln.strip() and not ln.split(None, 1)[1].startswith(prefix)]
    new = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  models/{p.relative_to(out.parent).as_posix()}"
           for p in sorted(out.rglob("*")) if p.is_file()]
    man.write_text("\n".join(keep + new) + "\n")
    return man


def write_manifest(root: Path) -> Path:
    lines = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256(p.read_bytes()).hexdigest()
            lines.append(f"{h}  models/{p.relative_to(root).as_posix()}")
    man = root.parent / "MANIFEST.sha256"
    man.write_text("\n".join(lines) + "\n")
    return man


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=str(REPO / "fixtures" / "models"))
    ap.add_argument("--tokenizer", help="reuse this tokenizer dir instead of training one")
    ap.add_argument("--tokenizer-only", action="store_true", help="build the tokenizer and stop")
    ap.add_argument("--smoke", action="store_true", help="tiny corpus and steps: pipeline check only")
    ap.add_argument("--replay", action="store_true",
                    help="the recorded build's step counts and no wall-clock budgets (for CPU rebuilds)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, e.g. --set target_steps=5000 --set target_max_s=1e9 "
                         "(to replay the exact step counts of a recorded build)")
    args = ap.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    if args.replay:
        cfg.update(RECORDED, target_max_s=1e12, draft_max_s=1e12, dflash_max_s=1e12)
    for kv in args.set:
        k, v = kv.split("=", 1)
        if k not in cfg and k not in RECORDED:
            ap.error(f"unknown recipe key {k!r} (known: {sorted(cfg)})")
        cfg[k] = type(cfg.get(k, RECORDED.get(k)))(float(v))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import transformers
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    T0 = time.time()
    out = Path(args.out)
    info: dict = {"device": args.device, "torch": torch.__version__, "transformers": transformers.__version__,
                  "cfg": cfg, "target_layer_ids": TARGET_LAYER_IDS, "block_size": BLOCK_SIZE}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    log(f"build start: {info}")

    # 1. corpus --------------------------------------------------------------------------------
    users, raws = heldout_from_prompts(REPO / "prompts" / "default.jsonl")
    log(f"held-out prompts: {len(users)} user turns, {len(raws)} raw prompts")
    train_docs = list(corpus.iter_docs("train", cfg["n_train"], users, raws))
    val_docs = list(corpus.iter_docs("val", cfg["n_val"], users, raws))
    distill_docs = list(corpus.iter_docs("distill", cfg["n_distill"], users, raws))
    info["corpus"] = dict(train_docs=len(train_docs), skipped_heldout=cfg["n_train"] - len(train_docs),
                          val_docs=len(val_docs), distill_prompts=len(distill_docs))
    log(f"corpus: {info['corpus']} ({time.time() - T0:.0f}s)")

    # 2. tokenizer -----------------------------------------------------------------------------
    tok_dir = out / "tokenizer"
    if args.tokenizer:
        src = Path(args.tokenizer)
        if src.resolve() != tok_dir.resolve():
            if tok_dir.exists():
                shutil.rmtree(tok_dir)
            shutil.copytree(src, tok_dir)
        check_tokenizer(tok_dir)
    else:
        train_tokenizer([corpus.render(d) for d in train_docs[:cfg["tok_docs"]]], tok_dir)
    info["special_token_ids"] = check_tokenizer(tok_dir)
    log(f"tokenizer ok: {info['special_token_ids']}")
    if args.tokenizer_only:
        return 0
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok_hf = AutoTokenizer.from_pretrained(str(tok_dir))
    pad_id = corpus.SPECIAL_TOKENS.index(corpus.PAD)
    mask_id = corpus.SPECIAL_TOKENS.index(corpus.MASK)
    stop_ids = [corpus.SPECIAL_TOKENS.index(corpus.EOT), corpus.SPECIAL_TOKENS.index(corpus.IM_END)]

    train_rows = pack(encode(tok, [corpus.render(d) for d in train_docs]), SEQ_LEN, pad_id)
    val_rows = pack(encode(tok, [corpus.render(d) for d in val_docs]), SEQ_LEN, pad_id)
    a_id, nl_id = tok.token_to_id("assistant"), tok.encode("\n").ids[0]
    val_amask = assistant_mask(val_rows, a_id, nl_id)
    info["tokens"] = dict(train_rows=train_rows.shape[0], train_tokens=int((train_rows != pad_id).sum()),
                          val_tokens=int((val_rows != pad_id).sum()))
    log(f"tokens: {info['tokens']} ({time.time() - T0:.0f}s)")

    # 3. target --------------------------------------------------------------------------------
    target, info["target_train"] = train_target(train_rows, cfg, args.device, pad_id)
    # evaluate the bf16-rounded weights in fp32, i.e. what ships
    with torch.no_grad():
        for p in target.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    info["target_val"] = eval_ce(target, val_rows, val_amask, args.device, pad_id)
    log(f"target val: {info['target_val']} train: {info['target_train']} ({time.time() - T0:.0f}s)")
    for p in target.parameters():
        p.requires_grad_(False)

    # greedy continuations of held-in prompts (the target's own outputs)
    gprompts = []
    for d in distill_docs:
        if d["kind"] == "chat":
            msgs = d["messages"]
            last_user = max(i for i, (r, _) in enumerate(msgs) if r == "user")
            gprompts.append(tok.encode(corpus.render_chat(msgs[:last_user + 1], add_generation_prompt=True),
                                       add_special_tokens=False).ids)
        else:
            ids = tok.encode(d["text"], add_special_tokens=False).ids
            gprompts.append(ids[:max(2, len(ids) // 3)])
    t1 = time.time()
    conts = greedy_continue(target, gprompts, cfg["gen_new_tokens"], cfg["gen_batch"], args.device, set(stop_ids),
                            pad_id)
    eot_nl = tok.encode("\n", add_special_tokens=False).ids + [stop_ids[0]]
    greedy_rows = pack([c + eot_nl for c in conts], SEQ_LEN, pad_id)
    info["greedy"] = dict(sequences=len(conts), rows=greedy_rows.shape[0], seconds=round(time.time() - t1, 1),
                          mean_new=round(sum(len(c) - len(p) for c, p in zip(conts, gprompts)) / len(conts), 1))
    log(f"greedy continuations: {info['greedy']}")
    # mix: all greedy rows + an equal number of corpus rows, plus the rest of the corpus
    mix_rows = torch.cat([greedy_rows, greedy_rows, train_rows[: max(1, 4 * greedy_rows.shape[0])]], 0)

    # 4. standalone draft ----------------------------------------------------------------------
    draft, info["draft_train"] = train_draft(target, mix_rows, cfg, args.device, pad_id)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    info["draft_val"] = eval_ce(draft, val_rows, val_amask, args.device, pad_id)
    log(f"draft val: {info['draft_val']} ({time.time() - T0:.0f}s)")

    # 5. DFlash drafts ---------------------------------------------------------------------------
    prompts = load_suite_prompts(tok_hf)
    dfl = {}
    for version in (2, 1):
        d, info[f"dflash{version}_train"] = train_dflash(version, target, mix_rows, cfg, args.device, pad_id, mask_id)
        with torch.no_grad():
            for p in d.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        d = d.float()
        info[f"dflash{version}_trainfwd_check"] = check_train_forward(d, target.float(), val_rows[:1, :64].to(
            args.device), mask_id)
        if prompts:
            acc = quick_accept(d, target, prompts, args.device, stop_ids)
            info[f"dflash{version}_accept"] = acc
            if version == 2:
                saved = zero_selector(d)
                acc0 = quick_accept(d, target, prompts, args.device, stop_ids)
                info["dflash2_accept_zero_selector"] = acc0
                if acc0["ALL"] > acc["ALL"]:
                    info["dflash2_selector"] = "zeroed (trained selector was worse on the suite)"
                else:
                    d.candidate_selector.load_state_dict(saved)
                    info["dflash2_selector"] = "trained"
        log(f"dflash{version}: {info[f'dflash{version}_train']} check {info[f'dflash{version}_trainfwd_check']:.2e} "
            f"accept {info.get(f'dflash{version}_accept')} ({time.time() - T0:.0f}s)")
        dfl[version] = d
    if prompts:
        log(f"dflash2 zero-selector accept {info['dflash2_accept_zero_selector']} -> {info['dflash2_selector']}")

    # 6. save --------------------------------------------------------------------------------------
    save_lm(target, out / "target", tok_dir)
    save_lm(draft, out / "draft", tok_dir)
    save_dflash(dfl[2], out / "dflash2")
    save_dflash(dfl[1], out / "dflash1")
    info["total_seconds"] = round(time.time() - T0, 1)
    (out / "build_info.json").write_text(json.dumps(info, indent=1, ensure_ascii=False, default=str) + "\n")
    man = write_manifest(out)
    log(f"done in {info['total_seconds']}s; manifest {man}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
