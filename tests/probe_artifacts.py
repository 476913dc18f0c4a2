"""Builders of real (tiny) artefacts for the probe tests.

Checkpoints are written with the ``safetensors`` library in the dtypes real exports use
(F8_E4M3 via ``torch.float8_e4m3fn``, BF16, I32 packed INT4, U8 NVFP4) and with the tensor names
real exports use (Qwen3 / Qwen3.5 targets, DFlash2 drafts as the ``dflash`` reference and SGLang
name them). Hostile safetensors files are written byte by byte. The tiny engine wraps real
random-init transformers models and counts acceptance by instrumenting transformers' own
candidate generator; it implements the engine protocol and lives here, in tests, only.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import struct
import time
import zipfile
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from specparity.model.cache import wheel_cache_dir

# Dimensions: big enough for two 128x128 scale blocks per FP8 matrix, small enough to be instant.
H = 256  # hidden size
V = 512  # vocab size
I = 384  # intermediate size
HEAD_DIM = 64
N_HEADS = 4
N_KV = 2

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dense(shape: Sequence[int], dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_g(seed)) * 0.02).to(dtype)


def fp8_weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(out, inp, generator=_g(seed)) * 50).clamp(-440, 440).to(FP8)


def block_scale(out: int, inp: int, block: int = 128) -> torch.Tensor:
    return torch.full((math.ceil(out / block), math.ceil(inp / block)), 1e-3, dtype=torch.float32)


def scalar_scale() -> torch.Tensor:
    return torch.tensor(1e-3, dtype=torch.float32)


def write_checkpoint(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    *,
    shards: int = 1,
    side_files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """config.json + safetensors (sharded with an index when ``shards`` > 1) + side JSON files."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, data in (side_files or {}).items():
        (path / name).write_text(json.dumps(data, indent=2))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n].contiguous() for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# ----------------------------------------------------------------------------------------------
# Targets
# ----------------------------------------------------------------------------------------------


def qwen3_config(**over: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": I,
        "num_hidden_layers": 2,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV,
        "head_dim": HEAD_DIM,
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    cfg.update(over)
    return cfg


def _qwen3_layer(i: int, prefix: str = "model.") -> dict[str, torch.Tensor]:
    p = f"{prefix}layers.{i}."
    return {
        p + "input_layernorm.weight": torch.ones(H, dtype=BF16),
        p + "post_attention_layernorm.weight": torch.ones(H, dtype=BF16),
        p + "self_attn.q_proj.weight": dense((N_HEADS * HEAD_DIM, H), seed=i * 10 + 1),
        p + "self_attn.k_proj.weight": dense((N_KV * HEAD_DIM, H), seed=i * 10 + 2),
        p + "self_attn.v_proj.weight": dense((N_KV * HEAD_DIM, H), seed=i * 10 + 3),
        p + "self_attn.o_proj.weight": dense((H, N_HEADS * HEAD_DIM), seed=i * 10 + 4),
        p + "self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=BF16),
        p + "self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=BF16),
        p + "mlp.gate_proj.weight": dense((I, H), seed=i * 10 + 5),
        p + "mlp.up_proj.weight": dense((I, H), seed=i * 10 + 6),
        p + "mlp.down_proj.weight": dense((H, I), seed=i * 10 + 7),
    }


def _qwen3_body() -> dict[str, torch.Tensor]:
    t = {"model.embed_tokens.weight": dense((V, H), seed=99), "model.norm.weight": torch.ones(H, dtype=BF16)}
    for i in range(2):
        t.update(_qwen3_layer(i))
    return t


def dense_target(path: Path, *, shards: int = 1, head_dtype: torch.dtype = BF16) -> Path:
    """BF16 Qwen3 target with a dense lm_head (the passing case)."""
    t = _qwen3_body()
    t["lm_head.weight"] = dense((V, H), head_dtype, seed=98)
    return write_checkpoint(path, qwen3_config(), t, shards=shards)


def tied_target(path: Path) -> Path:
    """No lm_head tensor: the head is the tied BF16 input embedding."""
    return write_checkpoint(path, qwen3_config(tie_word_embeddings=True), _qwen3_body())


def fp8_head_target(path: Path) -> Path:
    """Native FP8 (block 128x128) target whose lm_head is FP8 too: a quantized head."""
    t = _qwen3_body()
    t["lm_head.weight"] = fp8_weight(V, H, seed=98)
    t["lm_head.weight_scale_inv"] = block_scale(V, H)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    return write_checkpoint(path, qwen3_config(quantization_config=qc), t)


def _pack_int4(out: int, inp: int, seed: int) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized W4A16 group 128: I32 weight_packed, BF16 scales, I64 shape."""
    return {
        "weight_packed": torch.randint(-(2**31), 2**31 - 1, (out, inp // 8), dtype=torch.int32, generator=_g(seed)),
        "weight_scale": dense((out, inp // 128), seed=seed) .abs() + 1e-3,
        "weight_shape": torch.tensor([out, inp], dtype=torch.int64),
    }


def int4_target(path: Path, *, head_quantized: bool) -> Path:
    """RedHatAI-style W4A16 (compressed-tensors pack-quantized); lm_head ignored unless ``head_quantized``."""
    t = {k: v for k, v in _qwen3_body().items() if not k.endswith("_proj.weight")}
    for i in range(2):
        for name, (o, n) in {
            "self_attn.q_proj": (N_HEADS * HEAD_DIM, H), "self_attn.k_proj": (N_KV * HEAD_DIM, H),
            "self_attn.v_proj": (N_KV * HEAD_DIM, H), "self_attn.o_proj": (H, N_HEADS * HEAD_DIM),
            "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I),
        }.items():
            t.update({f"model.layers.{i}.{name}.{k}": v for k, v in _pack_int4(o, n, i).items()})
    if head_quantized:
        t.update({f"lm_head.{k}": v for k, v in _pack_int4(V, H, 7).items()})
    else:
        t["lm_head.weight"] = dense((V, H), seed=98)
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}},
        "ignore": [] if head_quantized else ["lm_head"],
    }
    return write_checkpoint(path, qwen3_config(quantization_config=qc), t)


def modelopt_fp8_head_target(path: Path, *, input_scale: bool) -> Path:
    """ModelOpt FP8 (hf_quant_config.json) with the head quantized; ``input_scale`` optional."""
    t = _qwen3_body()
    t["lm_head.weight"] = fp8_weight(V, H, seed=98)
    t["lm_head.weight_scale"] = scalar_scale()
    if input_scale:
        t["lm_head.input_scale"] = scalar_scale()
    side = {"hf_quant_config.json": {"producer": {"name": "modelopt", "version": "0.31.0"},
                                     "quantization": {"quant_algo": "FP8", "exclude_modules": []}}}
    return write_checkpoint(path, qwen3_config(), t, side_files=side)


def gguf_target(path: Path) -> Path:
    """A GGUF-only target directory (config + .gguf, no safetensors)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(qwen3_config()))
    (path / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + bytes(16))
    return path


HYBRID_LAYERS = 8


def hybrid_target(path: Path, *, consistent: bool = True) -> Path:
    """Qwen3.5-style GDN hybrid (3 linear : 1 full); ``consistent=False`` breaks layer_types."""
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(HYBRID_LAYERS)]
    if not consistent:
        kinds[3], kinds[4] = "linear_attention", "full_attention"
    cfg = qwen3_config(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_hidden_layers=HYBRID_LAYERS,
        layer_types=kinds, full_attention_interval=4, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, mamba_ssm_dtype="float32",
    )
    t = {"model.embed_tokens.weight": dense((V, H), seed=99), "model.norm.weight": torch.ones(H, dtype=BF16),
         "lm_head.weight": dense((V, H), seed=98)}
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=BF16)
        if kind == "full_attention":
            t[p + "self_attn.q_proj.weight"] = dense((2 * N_HEADS * HEAD_DIM, H), seed=i)
            t[p + "self_attn.o_proj.weight"] = dense((H, N_HEADS * HEAD_DIM), seed=i)
        else:
            t[p + "linear_attn.in_proj_qkvz.weight"] = dense((2 * 64 + 2 * 128, H), seed=i)
            t[p + "linear_attn.conv1d.weight"] = dense((256, 1, 4), seed=i)
            t[p + "linear_attn.A_log"] = torch.zeros(4, dtype=torch.float32)
            t[p + "linear_attn.dt_bias"] = torch.ones(4, dtype=BF16)
            t[p + "linear_attn.out_proj.weight"] = dense((H, 128), seed=i)
    return write_checkpoint(path, cfg, t)


# ----------------------------------------------------------------------------------------------
# DFlash2 drafts
# ----------------------------------------------------------------------------------------------

DRAFT_LAYERS = 2
CONV_K, CONV_G, RANK, TOPK = 2, 16, 32, 16
DFLASH2_KEYS = {"conv_kernel_size": CONV_K, "conv_group_size": CONV_G, "selector_rank": RANK, "selector_top_k": TOPK}
_FP8_MODULES = ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_SHAPES = {
    "self_attn.q_proj": (N_HEADS * HEAD_DIM, H), "self_attn.k_proj": (N_KV * HEAD_DIM, H),
    "self_attn.v_proj": (N_KV * HEAD_DIM, H), "self_attn.o_proj": (H, N_HEADS * HEAD_DIM),
    "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I),
}


def dflash2_draft(
    path: Path,
    *,
    stored: str = "block128",
    declared: str = "block128",
    arch: str = "DFlash2DraftModel",
    keys: dict[str, int] | None = None,
    keys_top_level: bool = False,
    v2_tensors: bool = True,
    fc_fp8: bool = False,
    ignore_style: str = "bare",
    codebook_rank: int = RANK,
) -> Path:
    """A DFlash2 draft as the 2026-10 exports lay it out (the published DFlash2 export layout).

    ``stored``: FP8 scale layout written next to o_proj/gate/up/down: ``block128`` (F32
    ``weight_scale_inv`` [ceil(out/128), ceil(in/128)]), ``block64``, ``per_tensor`` (scalar
    ``weight_scale``, the pre-2026-10-08 format) or ``none``. ``declared``: what config.json says:
    ``block128`` (weight_block_size [128,128]), ``per_tensor`` (no weight_block_size),
    ``ct_block``/``ct_tensor`` (compressed-tensors strategies) or ``none``.
    """
    t: dict[str, torch.Tensor] = {
        "fc.weight": dense((H, 2 * H), seed=1),
        "hidden_norm.weight": torch.ones(H, dtype=BF16),
        "norm.weight": torch.ones(H, dtype=BF16),
    }
    if fc_fp8:
        t["fc.weight"] = fp8_weight(H, 2 * H, seed=1)
        t["fc.weight_scale_inv"] = block_scale(H, 2 * H)
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=BF16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=BF16)
        t[p + "self_attn.q_norm.weight"] = torch.ones(HEAD_DIM, dtype=BF16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(HEAD_DIM, dtype=BF16)
        for mod, (o, n) in _SHAPES.items():
            if mod in _FP8_MODULES and stored != "bf16":
                t[p + mod + ".weight"] = fp8_weight(o, n, seed=i)
                if stored == "block128":
                    t[p + mod + ".weight_scale_inv"] = block_scale(o, n, 128)
                elif stored == "block64":
                    t[p + mod + ".weight_scale_inv"] = block_scale(o, n, 64)
                elif stored == "per_tensor":
                    t[p + mod + ".weight_scale"] = scalar_scale()
                elif stored == "ct_block":
                    t[p + mod + ".weight_scale"] = block_scale(o, n, 128)
            else:
                t[p + mod + ".weight"] = dense((o, n), seed=i)
        if v2_tensors:
            for conv in ("attention_conv", "mlp_conv"):
                t[p + f"{conv}.base_kernel"] = dense((2, CONV_K, H), torch.float32, seed=i)
                t[p + f"{conv}.kernel_projection.weight"] = dense((2 * CONV_K * (H // CONV_G), H), seed=i)
    if v2_tensors:
        t["candidate_selector.predecessor_codebook"] = dense((V, codebook_rank), seed=5)
        t["candidate_selector.successor_codebook"] = dense((V, codebook_rank), seed=6)
        t["candidate_selector.hidden_projection.weight"] = dense((RANK, H), seed=7)
    dflash_cfg: dict[str, Any] = {"block_size": 8, "mask_token_id": V - 1, "target_layer_ids": [0, 1]}
    keys = DFLASH2_KEYS if keys is None else keys
    cfg = qwen3_config(architectures=[arch] if arch else [], num_hidden_layers=DRAFT_LAYERS, num_target_layers=2,
                       block_size=8)
    if keys_top_level:
        cfg.update(keys)
    else:
        dflash_cfg.update(keys)
    cfg["dflash_config"] = dflash_cfg
    # ``bare``: the shard names SGLang's DFlash draft matches; ``full``: per-layer paths, which
    # it never matches; ``none``: BF16 q/k/v left to the quantizer.
    ignored = {
        "bare": ["q_proj", "k_proj", "v_proj"],
        "full": [f"layers.{i}.self_attn.{p}" for i in range(DRAFT_LAYERS) for p in ("q_proj", "k_proj", "v_proj")],
        "none": [],
    }[ignore_style]
    if declared == "block128":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128], "ignored_layers": ignored + ["fc"]}
    elif declared == "per_tensor":
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "ignored_layers": ignored + ["fc"]}
    elif declared in ("ct_block", "ct_tensor"):
        strategy = {"strategy": "block", "block_structure": [128, 128]} if declared == "ct_block" else {"strategy": "tensor"}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **strategy},
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}},
            "ignore": ["re:.*[qkv]_proj$", "fc", "re:.*_conv.*", "re:candidate_selector.*"],
        }
    return write_checkpoint(path, cfg, t)


# ----------------------------------------------------------------------------------------------
# Hostile safetensors files, written byte by byte
# ----------------------------------------------------------------------------------------------


def raw_safetensors(path: Path, header: bytes | dict[str, Any], data: bytes = b"", length: int | None = None) -> Path:
    """``length`` overrides the 8-byte header length (to lie about it)."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


# ----------------------------------------------------------------------------------------------
# SGLang sources: wheels from PyPI, and a patched copy
# ----------------------------------------------------------------------------------------------

#: Outside the checkout (``specparity.model.cache``): a clean clone never carries or commits wheels.
WHEEL_CACHE = wheel_cache_dir()


def sglang_wheel(version: str) -> Path:
    """The cached sglang wheel, downloaded once with ``pip download --no-deps`` (never installed).

    Without a reachable package registry the calling test is skipped with pip's reason (tests that
    call this carry ``@pytest.mark.registry``); with ``SPECPARITY_REQUIRE_REGISTRY=1`` (CI) it fails
    instead, so a CI machine that lost its registry never goes green on skips.
    """
    import os
    import subprocess
    import sys

    import pytest

    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"sglang=={version}",
                               "-d", str(WHEEL_CACHE)], capture_output=True, text=True, timeout=600)
        found = sorted(WHEEL_CACHE.glob(f"sglang-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")] or proc.stderr.splitlines()[-1:]
            msg = (f"needs a package registry: pip download sglang=={version} failed "
                   f"({errors[0] if errors else 'no wheel'})")
            if os.environ.get("SPECPARITY_REQUIRE_REGISTRY"):
                pytest.fail(msg + "; SPECPARITY_REQUIRE_REGISTRY is set", pytrace=False)
            pytest.skip(msg)
    return found[0]


_KEEP = re.compile(r"^sglang/(_version\.py|__init__\.py|srt/mem_cache/.*\.py|srt/mem_cache/kv_cache_configurator\.py"
                   r"|srt/arg_groups/overrides\.py)$")


def extract_sglang(wheel: Path, dest: Path) -> Path:
    """Unpack the files the probes read (mem_cache, configurator, overrides, version) into ``dest``."""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if _KEEP.match(name):
                zf.extract(name, dest)
    return dest


def mamba_component_file(root: Path) -> Path:
    comps = root / "sglang" / "srt" / "mem_cache" / "unified_cache" / "components"
    return next(p for p in (comps / "mamba.py", comps / "mamba_component.py") if p.exists())


def patch_graceful(root: Path, *, allocator: bool = True, guards: bool = True) -> int:
    """Patch the real source with the fix: skip prefix donation on an empty pool.

    ``allocator``: ``_alloc_mamba_slot`` gains ``allow_fail`` and returns None instead of
    asserting when asked. ``guards``: each donation site in ``prepare_for_caching_req`` asks for
    that and returns 0 (no insert, the caller's ``effective_cache_len <= 0`` cleanup) on None.
    Returns the number of donation sites patched.
    """
    path = mamba_component_file(root)
    text = path.read_text()
    if allocator:
        text, n = re.subn(r"def _alloc_mamba_slot\(self([^)]*)\)", r"def _alloc_mamba_slot(self\1, allow_fail: bool = False)", text)
        assert n == 1, "allocator signature not found"
        start = text.index("def _alloc_mamba_slot(")
        end = text.index("return slot", start)
        body = text[start:end]
        new_body, n = re.subn(
            r'(\n(\s*))assert slot is not None, "Can not alloc mamba cache"',
            r'\1if slot is None and allow_fail:\1    return None\1assert slot is not None, "Can not alloc mamba cache"',
            body,
        )
        assert n == 1, "allocator assert not found"
        text = text[:start] + new_body + text[end:]
    sites = 0
    if guards:
        start = text.index("def prepare_for_caching_req(")
        end = text.index("\n    def ", start + 10)
        method = text[start:end]
        arg = ", allow_fail=True" if allocator else ""

        def guard(m: re.Match[str]) -> str:
            indent, var, args = m.group(1), m.group(2), m.group(3)
            call_args = f"{args}{arg}" if args else arg.lstrip(", ")
            return (f"{indent}{var} = self._alloc_mamba_slot({call_args})\n"
                    f"{indent}if {var} is None:\n{indent}    return 0  # pool exhausted: skip donation")

        method, sites = re.subn(r"^( +)(\w+) = self\._alloc_mamba_slot\(([^)]*)\)$", guard, method, flags=re.M)
        text = text[:start] + method + text[end:]
    path.write_text(text)
    return sites


# ----------------------------------------------------------------------------------------------
# A tiny in-process engine implementing the engine protocol (tests only)
# ----------------------------------------------------------------------------------------------


def tiny_qwen3(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


def fp8_block_roundtrip(model, *, block: int = 16, apply_scales: bool):
    """Quantize every decoder linear to FP8 with block scales; dequantize with or without them.

    ``apply_scales=False`` is what an engine that ignores block scales computes: the FP8 codes
    times 1, i.e. each block off by its own factor amax/448.
    """
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in out.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
                w = mod.weight.data.float()
                o, i = w.shape
                blocks = w.reshape(o // block, block, i // block, block)
                scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / 448.0
                codes = (blocks / scale).to(FP8).float()
                deq = codes * scale if apply_scales else codes
                mod.weight.data = deq.reshape(o, i).to(mod.weight.dtype)
    return out


class TinyHFEngine:
    """Greedy decoding of a tiny transformers model, with transformers' assisted generation as
    the speculative mode. Acceptance is counted from the candidate generator's own calls.
    Byte-level "tokenizer": a prompt's UTF-8 bytes are its ids."""

    name = "tiny-hf"

    def __init__(self, target, draft=None) -> None:
        torch.set_num_threads(1)
        self.target, self.draft = target, draft
        if draft is not None:
            # A fixed draft width, and no early stop on draft confidence (a random model is never
            # confident): acceptance then measures agreement only.
            gc = draft.generation_config
            gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 6, "constant"
            gc.assistant_confidence_threshold = 0.0

    def encode_prompt(self, prompt, messages):
        text = prompt if prompt is not None else "\n".join(m["content"] for m in messages or [])
        return list(text.encode("utf-8"))

    def decode(self, token_ids):
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def stop_token_ids(self):
        return ()

    def _assisted(self, input_ids: torch.Tensor, max_new_tokens: int):
        from specparity.model.types import StepRecord

        steps: list[StepRecord] = []
        original = self.target._get_candidate_generator

        def instrumented(*args, **kwargs):
            gen = original(*args, **kwargs)
            get, update = gen.get_candidates, gen.update_candidate_strategy
            last = {"proposed": 0}

            def get_candidates(ids, *a, **kw):
                cand, logits = get(ids, *a, **kw)
                last["proposed"] = int(cand.shape[1] - ids.shape[1])
                return cand, logits

            def update_candidate_strategy(ids, scores, n_matches):
                n = int(n_matches)
                steps.append(StepRecord(last["proposed"], min(n, last["proposed"]), n + 1))
                return update(ids, scores, n_matches)

            gen.get_candidates, gen.update_candidate_strategy = get_candidates, update_candidate_strategy
            return gen

        self.target._get_candidate_generator = instrumented
        try:
            out = self.target.generate(input_ids, assistant_model=self.draft, do_sample=False,
                                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        finally:
            del self.target._get_candidate_generator
        return out, steps

    def generate(self, requests, *, speculative):
        from specparity.model.types import GenerationResult, SpecStats, TokenScores

        results = []
        for req in requests:
            t0 = time.perf_counter()
            ids = torch.tensor([req.prompt_ids], dtype=torch.long)
            with torch.no_grad():
                if speculative and self.draft is not None:
                    out, steps = self._assisted(ids, req.max_new_tokens)
                    spec = SpecStats.from_steps(steps, "instrumented transformers candidate generator")
                else:
                    out = self.target.generate(ids, do_sample=False, max_new_tokens=req.max_new_tokens,
                                               min_new_tokens=req.max_new_tokens)
                    spec = SpecStats.unavailable("no draft" if speculative else "speculation off")
            new = out[0, ids.shape[1]:].tolist()
            results.append(GenerationResult(req.request_id, new, self.decode(new), "length", TokenScores.empty(),
                                            spec, wall_s=time.perf_counter() - t0))
        return results

    def score(self, prompt_ids, continuation_ids, top_k):
        from specparity.model.types import TokenScores

        ids = torch.tensor([list(prompt_ids) + list(continuation_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(self.target(ids).logits[0].float(), -1)
        rows = logp[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(continuation_ids)]
        cont = torch.tensor(list(continuation_ids))
        top = rows.topk(top_k, -1)
        return TokenScores(cont.numpy(), rows.gather(1, cont[:, None])[:, 0].numpy(), top.indices.numpy(),
                           top.values.numpy())

    def fingerprint(self):
        from specparity.model.types import ArtifactId, Fingerprint

        def sha(model) -> str:
            h = hashlib.sha256()
            for k, v in sorted(model.state_dict().items()):
                h.update(k.encode())
                h.update(v.detach().float().numpy().tobytes())
            return h.hexdigest()

        draft = ArtifactId("memory:draft", sha(self.draft)) if self.draft is not None else None
        return Fingerprint("tiny-hf", "0", ArtifactId("memory:target", sha(self.target)), draft, "float32",
                           {"mode": "assisted"})

    def close(self) -> None:
        pass


class SlotPoolEngine:
    """Wraps an engine with a simulated mamba state pool, the way SGLang spends it.

    Each running request holds ``slots_per_request`` slots; every request after the first that
    shares a cached prefix donates its state, which needs one more slot. When the pool runs dry
    during donation, ``graceful=False`` does what released SGLang does (the scheduler asserts
    "Can not alloc mamba cache" and every later request fails), ``graceful=True`` skips the
    donation like the patched copy. ``corrupt=True`` returns wrong tokens under pressure (state
    clobbered). A simulation of behaviour read from source, not SGLang itself.
    """

    def __init__(self, inner, *, pool: int, slots_per_request: int, graceful: bool, corrupt: bool = False) -> None:
        self.inner, self.pool, self.per_req = inner, pool, slots_per_request
        self.graceful, self.corrupt, self.dead = graceful, corrupt, False
        self.name = f"slot-pool({inner.name})"

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def health(self) -> bool:
        return not self.dead

    def generate(self, requests, *, speculative):
        from specparity.model.types import GenerationResult

        if self.dead:
            return [GenerationResult.failed(r.request_id, "scheduler died: AssertionError: Can not alloc mamba cache")
                    for r in requests]
        need = len(requests) * self.per_req + max(len(requests) - 1, 0)
        results = self.inner.generate(requests, speculative=speculative)
        if need > self.pool:
            if not self.graceful:
                self.dead = True
                return [GenerationResult.failed(r.request_id, "AssertionError: Can not alloc mamba cache")
                        for r in requests]
            if self.corrupt:
                for r in results[1:]:
                    r.output_ids = r.output_ids[:-1] + [(r.output_ids[-1] + 1) % 256]
        return results


def copy_draft_engine(options=None) -> TinyHFEngine:
    """Factory for ``--live-engine``: the draft is an exact copy of the target."""
    target = tiny_qwen3()
    return TinyHFEngine(target, copy.deepcopy(target))


def misscaled_draft_engine(options=None) -> TinyHFEngine:
    """Factory for ``--live-engine``: an FP8 block-quantized draft whose block scales were ignored."""
    target = tiny_qwen3()
    return TinyHFEngine(target, fp8_block_roundtrip(target, apply_scales=False))
