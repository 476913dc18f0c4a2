"""The 128K variant of the long-context fixture (``tools/build_long_fixture.py --max-position-embeddings``):
the committed model's weights, a larger declared context, and the ``long`` arm then sizes its prompts to
131072 tokens instead of 32768."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from child_signals import default_sigint
from specparity.engines.server.arm_knobs import long_prompt_tokens
from specparity.model.arms import LONG_MAX_TOKENS, LONG_MIN_TOKENS
from specparity.model.locations import REPO_ROOT, fixture_dir


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tool(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "build_long_fixture.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, preexec_fn=default_sigint)


def model_fields(model_dir) -> dict:
    """The configuration that defines the model, as this transformers reads it: ``config.json`` through
    ``AutoConfig`` (so both sides of a comparison share one schema) without what the library writes about
    itself (``transformers_version``), which a rebuild under another release changes and the model does not."""
    from transformers import AutoConfig

    fields = AutoConfig.from_pretrained(str(model_dir)).to_dict()
    for key in ("transformers_version", "_name_or_path"):
        fields.pop(key, None)
    return fields


def _build(out, *args: str) -> None:
    proc = _tool(out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_128k_variant_is_the_same_model_with_a_larger_context(tmp_path):
    """Against a build of the committed configuration made here (the bytes of a seeded build are this
    torch's on this CPU)."""
    out, default = tmp_path / "long-128k", tmp_path / "long"
    _build(out, "--max-position-embeddings", str(LONG_MAX_TOKENS + 512))
    _build(default)
    committed = fixture_dir("long")
    assert _sha(out / "model.safetensors") == _sha(default / "model.safetensors")
    assert model_fields(default) == model_fields(committed)
    assert model_fields(out) == {**model_fields(committed), "max_position_embeddings": LONG_MAX_TOKENS + 512}
    assert long_prompt_tokens(str(committed)) == LONG_MIN_TOKENS
    assert long_prompt_tokens(str(out)) == LONG_MAX_TOKENS


def test_a_context_below_one_is_refused(tmp_path):
    proc = _tool(tmp_path / "x", "--max-position-embeddings", "0")
    assert proc.returncode == 2 and "--max-position-embeddings: expected a positive integer, got 0" in proc.stderr
    assert not (tmp_path / "x").exists()


def _greedy_figures(model_dir) -> tuple[float, float]:
    """(share of positions whose top-1 / top-2 gap exceeds 1 nat, share of the second half's argmaxes that
    stay the same without the first half) over 400 seeded random tokens, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.randint(10, 4000, (1, 400), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits[0]
        half = model(ids[:, 200:]).logits[0]
    top = full.log_softmax(-1).topk(2, -1).values
    clear = float(((top[:, 0] - top[:, 1]) > 1.0).float().mean())
    same = float((half[50:].argmax(-1) == full[250:].argmax(-1)).float().mean())
    return clear, same


def test_the_wide_head_variant_is_a_usable_gate_subject_of_the_same_recipe(tmp_path):
    """``--head-dim 64`` (for attention kernels without head_dim 16): the declared and stored head size,
    the same context, and what makes the committed model a gate subject — clear greedy margins at most
    positions, and an output that depends on the context."""
    out = tmp_path / "long-hd64"
    _build(out, "--head-dim", "64")
    from safetensors import safe_open

    config = model_fields(out)
    committed = model_fields(fixture_dir("long"))
    assert config["head_dim"] == 64 and committed["head_dim"] == 16
    assert {**config, "head_dim": 16} == committed
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        q = f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape()
        o = f.get_slice("model.layers.0.self_attn.o_proj.weight").get_shape()
    assert list(q) == [64, config["hidden_size"]] and list(o) == [config["hidden_size"], 64]
    clear, same = _greedy_figures(out)
    assert clear > 0.75, f"only {clear:.0%} of positions have a top-1 / top-2 gap above 1 nat"
    assert same < 0.9, f"{same:.0%} of the second half's argmaxes ignore the first half"


def test_an_odd_head_dim_is_refused(tmp_path):
    proc = _tool(tmp_path / "x", "--head-dim", "15")
    assert proc.returncode == 2 and "--head-dim: expected a positive even integer (RoPE rotates pairs), got 15" in proc.stderr
    assert not (tmp_path / "x").exists()
