"""The committed GDN hybrid target (``fixtures/models/hybrid``, built by ``tools/build_hybrid_fixture.py``).

Offline: its config declares one consistent hybrid layout (``layer_types`` and
``full_attention_interval`` agree; the GDN head shapes llama.cpp needs), the checkpoint headers hold
the tensors of that layout (linear-attention layers, one full-attention layer, the MTP block), the
probes recognise it as a hybrid, it shares the fixture target's tokenizer, and it stays within its
3 MB share of the fixture budget.

Live (slow): the lossless gate against real ``llama-server`` processes on the hybrid GGUF with the
fixture draft (``draft-simple``), speculation active — the one place on this CPU where recurrent
(conv + SSM) state rollback runs under speculation. It needs a llama-server build and the converted
fixtures (``bash ci/llamacpp.sh`` or ``python tools/llamacpp/convert_gguf.py``); without them it skips
and says so, and with ``SPECPARITY_REQUIRE_LLAMACPP=1`` it fails instead.
"""

from __future__ import annotations

import json

import pytest

from inprocess import run_pytest
from llamacpp_fixtures import require_llamacpp

from specparity.probes.checkpoints import load_checkpoint
from specparity.model.locations import MANIFEST, MODELS, REPO_ROOT, fixture_dir
from specparity.model.prompts import load_prompts

HYBRID = MODELS / "hybrid"
LIMIT_BYTES = 3_000_000
LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "norm", "out_proj")
FULL = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


@pytest.fixture(scope="module")
def cfg() -> dict:
    return json.loads((fixture_dir("hybrid") / "config.json").read_text())


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(fixture_dir("hybrid"))


def test_config_declares_one_consistent_hybrid_layout(cfg):
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    n, types, interval = cfg["num_hidden_layers"], cfg["layer_types"], cfg["full_attention_interval"]
    assert len(types) == n
    assert types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    assert "linear_attention" in types and "full_attention" in types
    # llama.cpp's qwen35 loader takes the GDN value head size from the key head size (ssm_d_state)
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"]
    assert cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"] == 0
    # the converter requires the MTP block (Qwen3.5 / Qwen3-Next) unless run with --no-mtp
    assert cfg["mtp_num_hidden_layers"] == 1
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True


def test_checkpoint_holds_the_declared_layers(cfg, ckpt):
    names = set(ckpt.tensors)
    for i, kind in enumerate(cfg["layer_types"]):
        want = [f"model.layers.{i}.linear_attn.{m}" for m in LINEAR] if kind == "linear_attention" else \
            [f"model.layers.{i}.self_attn.{m}" for m in FULL]
        for w in want:
            assert any(n.startswith(w) for n in names), (i, kind, w)
        other = "self_attn" if kind == "linear_attention" else "linear_attn"
        assert not any(n.startswith(f"model.layers.{i}.{other}.") for n in names), (i, kind)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.q_proj.weight"} <= names
    assert {t.dtype for t in ckpt.tensors.values()} == {"BF16"}
    h, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    full = cfg["layer_types"].index("full_attention")
    assert ckpt.tensors[f"model.layers.{full}.self_attn.q_proj.weight"].shape == (2 * heads * hd, h)  # gated q
    kd = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
    vd = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
    assert ckpt.tensors["model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (2 * kd + vd, h)
    conv = ckpt.tensors["model.layers.0.linear_attn.conv1d.weight"]
    assert conv.shape == (2 * kd + vd, 1, cfg["linear_conv_kernel_dim"])


def test_mamba_probe_recognises_a_consistent_hybrid(ckpt):
    from specparity.probes.version_facts import EngineSpec
    from specparity.probes.mamba_slots import LaunchFlags, linear_layer_report, probe_mamba_slots
    from specparity.probes.finding import Status

    hybrid, evidence, problems = linear_layer_report(ckpt)
    assert hybrid and problems == []
    assert any("full attention at [3]" in e for e in evidence), evidence
    assert any("full_attention_interval=4" in e for e in evidence), evidence
    # Qwen3_5ForCausalLM takes SGLang's extra_buffer strategy from 0.5.19: 5 slots per request under speculation
    v = probe_mamba_slots(ckpt, EngineSpec.parse("sglang==0.5.19"),
                          LaunchFlags.parse("--speculative-algorithm DFLASH --max-mamba-cache-size 8"), None, {})
    assert v.status is Status.WARN and "capped to 1" in v.message, v.render()


def test_same_tokenizer_and_stop_ids_as_the_fixture_target():
    target = MODELS / "target"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (HYBRID / name).read_bytes() == (target / name).read_bytes(), name
    assert json.loads((HYBRID / "generation_config.json").read_text())["eos_token_id"] == [0, 2]


def test_size_and_manifest():
    files = [p for p in HYBRID.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= LIMIT_BYTES, f"{total} bytes in {HYBRID}"
    listed = {line.split(maxsplit=1)[1].strip() for line in MANIFEST.read_text().splitlines() if line.strip()}
    assert {f"models/hybrid/{p.relative_to(HYBRID).as_posix()}" for p in files} <= listed


def test_transformers_loads_it_and_ignores_only_the_mtp_block():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(HYBRID), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    sd = model.state_dict()
    ckpt = load_checkpoint(HYBRID)
    assert {n for n in ckpt.tensors if not n.startswith("mtp.")} <= set(sd) | {"lm_head.weight"}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 872, 198]])).logits
    assert logits.shape == (1, 3, 4096) and torch.isfinite(logits).all()


# --------------------------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def hybrid_gguf():
    """(hybrid GGUF, draft GGUF) or skip/fail with how to get them."""
    _, gg = require_llamacpp()
    return gg / "hybrid.gguf", gg / "draft.gguf"


#: The categories of prompts/default.jsonl the live gate runs on the hybrid.
CATEGORIES = ("repeat", "math")


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["draft-simple", "draft-mtp"])
def test_gate_on_the_hybrid_under_speculation(hybrid_gguf, tmp_path, spec):
    """Both rollback paths of llama.cpp's recurrent state: checkpoint restore (draft-simple, a
    standalone draft) and in-graph per-token snapshots (draft-mtp, the fixture's own MTP head)."""
    hybrid, draft = hybrid_gguf
    # The noise is measured on the prompts that run (not on the whole suite: a teacher-forced
    # request per position of every prompt); a threshold from fewer prompts can be looser, so every
    # prompt must be exact — what the hybrid shows on llama.cpp — not merely within it.
    args = ["-q", "suites/lossless", "--engine", "llamacpp", "--target", str(hybrid),
            "--categories", ",".join(CATEGORIES), "--max-new-tokens", "32", "--calibration", "selected",
            "--report", str(tmp_path)]
    args += ["--draft", str(draft)] if spec == "draft-simple" else ["--preset", "llamacpp-draft-mtp"]
    code, out = run_pytest(*args)
    assert code == 0, out[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    prompts = [x for x in lines if x["kind"] == "prompt"]
    selected = [p.id for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category in CATEGORIES]
    assert sorted(x["prompt"]["id"] for x in prompts) == sorted(selected)
    assert all(x["verdict"]["class"] == "exact" for x in prompts), [
        (x["prompt"]["id"], x["verdict"]["class"], x["verdict"]["reason"]) for x in prompts
        if x["verdict"]["class"] != "exact"]
    proposed = sum(x["spec"]["spec"]["proposed"] for x in prompts)
    accepted = sum(x["spec"]["spec"]["accepted"] for x in prompts)
    # speculation active, with rejections: the recurrent state is rolled back for real
    assert 0 < accepted < proposed, (proposed, accepted)
    assert f"--spec-type {spec}" in (tmp_path / "summary.md").read_text()
