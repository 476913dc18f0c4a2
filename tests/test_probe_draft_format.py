"""Draft FP8 scale layout and DFlash2 completeness probes on real synthetic drafts (offline)."""

from __future__ import annotations

import pytest

import probe_artifacts as pa
from specparity.probes.checkpoints import load_checkpoint
from specparity.probes.version_facts import EngineSpec
from specparity.probes.draft_format import LOUD, SILENT, probe_dflash2_format, probe_fp8_scales
from specparity.probes.finding import Status

SG19 = EngineSpec.parse("sglang==0.5.19")


@pytest.fixture
def draft(tmp_path):
    counter = iter(range(100))

    def build(**kw):
        return load_checkpoint(pa.dflash2_draft(tmp_path / f"d{next(counter)}", **kw))

    return build


@pytest.mark.parametrize("stored, declared", [("block128", "block128"), ("per_tensor", "per_tensor"),
                                              ("ct_block", "ct_block"), ("bf16", "none")])
def test_matching_layouts_pass(draft, stored, declared):
    v = probe_fp8_scales(draft(stored=stored, declared=declared), SG19)
    assert v.status is Status.OK, v.render()


def test_block_scales_with_a_per_tensor_config_accept_nothing(draft):
    """A DFlash2 draft stored with 128x128 block scales under a per-tensor config (a real checkpoint's layout)."""
    v = probe_fp8_scales(draft(stored="block128", declared="per_tensor"), SG19)
    assert v.status is Status.FAIL and SILENT in v.summary
    joined = "\n".join(v.evidence)
    assert "8 tensors in layers.*.mlp.down_proj, layers.*.mlp.gate_proj, layers.*.mlp.up_proj, layers.*.self_attn.o_proj" in joined
    assert "layers.0.mlp.down_proj.weight: F8_E4M3 [256, 384]" in joined
    assert "layers.0.mlp.down_proj.weight_scale_inv: F32 [2, 3]" in joined
    assert "weight_block_size=None" in joined
    assert "matches no parameter" in joined


def test_per_tensor_scales_with_a_block_config_accept_nothing(draft):
    v = probe_fp8_scales(draft(stored="per_tensor", declared="block128"), SG19)
    assert v.status is Status.FAIL and SILENT in v.summary
    assert any("stores tensor 'weight_scale' but the config declares block 128x128 'weight_scale_inv'" in e
               for e in v.evidence)


def test_other_block_size_fails_loudly(draft):
    v = probe_fp8_scales(draft(stored="block64", declared="block128"), SG19)
    assert v.status is Status.FAIL and LOUD in v.summary
    assert any("stores block 64x64 'weight_scale_inv' but the config declares block 128x128 'weight_scale_inv'" in e
               and "weight_scale_inv: F32 [4, 6]" in e for e in v.evidence)


def test_compressed_tensors_strategy_mismatch_is_loud(draft):
    v = probe_fp8_scales(draft(stored="ct_block", declared="ct_tensor"), SG19)
    assert v.status is Status.FAIL and LOUD in v.summary
    assert any("strategy='tensor'" in e for e in v.evidence)


def test_missing_scales_accept_nothing(draft):
    v = probe_fp8_scales(draft(stored="none", declared="block128"), SG19)
    assert v.status is Status.FAIL and any("no scale stored" in e for e in v.evidence)


def test_fp8_fc_is_flagged_even_with_a_scale(draft):
    v = probe_fp8_scales(draft(fc_fp8=True), SG19)
    assert v.status is Status.FAIL
    assert any(e.startswith("FP8 weight in a plain linear layer") and "1 tensors in fc;" in e
               and "fc.weight: F8_E4M3 [256, 512]" in e for e in v.evidence)


def test_bf16_modules_the_config_quantizes(draft):
    v = probe_fp8_scales(draft(ignore_style="none"), SG19)
    assert v.status is Status.FAIL
    assert any("layers.*.self_attn.q_proj" in e and "add the module to the ignore list" in e for e in v.evidence)
    assert any("0.5.19:597-610" in e for e in v.evidence)


def test_per_layer_ignore_paths_never_match_in_sglang_dflash(draft):
    """SGLang builds DFlash draft layers with an empty prefix: 'layers.0.self_attn.q_proj' in
    ignored_layers does not exclude the shard it calls 'q_proj'; vLLM-style full paths are fine
    where the engine keeps them."""
    d = draft(ignore_style="full")
    v = probe_fp8_scales(d, SG19)
    assert v.status is Status.FAIL
    assert any("SGLang's DFlash draft matches the bare name" in e and "layers.*.self_attn.q_proj" in e for e in v.evidence)
    assert any("dflash.py:598-602" in e for e in v.evidence)
    assert probe_fp8_scales(d, EngineSpec.parse("vllm==0.11.0")).status is Status.OK


def test_fp8_probe_without_draft_or_engine_data(draft):
    assert probe_fp8_scales(None, SG19).status is Status.UNKNOWN
    assert probe_fp8_scales(draft(), EngineSpec.parse("llamacpp==b6000")).status is Status.UNKNOWN


def test_complete_dflash2_passes(draft):
    for engine in ("sglang==0.5.19", "sglang==0.5.23", "vllm==0.11.0"):
        v = probe_dflash2_format(draft(), EngineSpec.parse(engine))
        assert v.status is Status.OK, v.render()


def test_v2_tensors_under_a_v1_architecture_run_as_v1(draft):
    v = probe_dflash2_format(draft(arch="DFlashDraftModel"), SG19)
    assert v.status is Status.FAIL and "silently run as DFlash v1" in v.summary
    joined = "\n".join(v.evidence)
    assert "architectures=['DFlashDraftModel']" in joined
    assert "candidate_selector" in joined and "Ignore unexpected weights" in joined
    assert ":770 load_weights" in joined and "v1 + conv, no selector" in joined


def test_missing_architecture_runs_as_v1(draft):
    v = probe_dflash2_format(draft(arch=""), SG19)
    assert v.status is Status.FAIL and "silently run as DFlash v1" in v.summary


def test_missing_selector_keys_fail_at_load_on_sglang(draft):
    v = probe_dflash2_format(draft(keys={"conv_kernel_size": 2, "conv_group_size": 16}), SG19)
    assert v.status is Status.FAIL
    assert v.message == "DFlash selector draft requires dflash_config.selector_rank."


def test_missing_conv_keys_silently_drop_the_convolutions(draft):
    v = probe_dflash2_format(draft(keys={"selector_rank": pa.RANK, "selector_top_k": pa.TOPK}), SG19)
    assert v.status is Status.FAIL and "convolutions silently skipped" in v.summary


def test_keys_at_top_level_are_not_read(draft):
    v = probe_dflash2_format(draft(keys_top_level=True), SG19)
    assert v.status is Status.FAIL
    assert any("top-level keys" in e for e in v.evidence)


def test_declared_v2_without_tensors(draft):
    v = probe_dflash2_format(draft(v2_tensors=False), SG19)
    assert v.status is Status.FAIL and "lacks conv tensors" in v.summary


def test_shape_mismatch_with_dflash_config(draft):
    v = probe_dflash2_format(draft(codebook_rank=24), SG19)
    assert v.status is Status.FAIL
    assert any("candidate_selector.predecessor_codebook: BF16 [512, 24]" in e and "[512, 32]" in e for e in v.evidence)


def test_old_sglang(draft):
    v = probe_dflash2_format(draft(), EngineSpec.parse("sglang==0.5.18"))
    assert v.status is Status.FAIL and "Model architectures ['DFlash2DraftModel']" in v.message
    v = probe_dflash2_format(draft(arch="DFlashDraftModel"), EngineSpec.parse("sglang==0.5.17"))
    assert v.status is Status.FAIL and "silently run as DFlash v1" in v.summary


def test_v1_and_non_dflash_drafts_pass(draft, tmp_path):
    v1 = draft(arch="DFlashDraftModel", keys={}, v2_tensors=False)
    assert probe_dflash2_format(v1, SG19).status is Status.OK
    plain = load_checkpoint(pa.dense_target(tmp_path / "eagle"))
    assert probe_dflash2_format(plain, SG19).status is Status.OK
    assert probe_dflash2_format(None, SG19).status is Status.UNKNOWN


def test_llamacpp_refuses_a_dflash_draft_that_reads_the_last_target_layer(tmp_path):
    """Measured on llama-server 11434: the fixture DFlash2 draft (layers [0, 2, 3] of a 4-layer
    Qwen3 target) aborts the server on the first request; a draft reading [0, 2, 2] runs. The
    reference dflash decoder and SGLang read the last layer fine, so the rule is llama.cpp's only."""
    import json
    import shutil

    from specparity.probes.checkpoints import load_checkpoint
    from specparity.model.locations import fixture_dir
    from specparity.probes.version_facts import EngineSpec
    from specparity.probes.draft_format import LLAMACPP_LAYER_MESSAGE, probe_dflash2_format
    from specparity.probes.finding import Status

    target = load_checkpoint(fixture_dir("target"))
    draft = load_checkpoint(fixture_dir("dflash2"))
    v = probe_dflash2_format(draft, EngineSpec.parse("llamacpp==11434"), target)
    assert v.status is Status.FAIL and v.message == LLAMACPP_LAYER_MESSAGE
    assert "target_layer_ids=[0, 2, 3]; target has 4 layers" in v.evidence[0]
    assert probe_dflash2_format(draft, EngineSpec.parse("sglang==0.5.23"), target).status is Status.OK
    fixed = tmp_path / "dflash2"
    shutil.copytree(fixture_dir("dflash2"), fixed)
    cfg = json.loads((fixed / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 2, 2]
    (fixed / "config.json").write_text(json.dumps(cfg))
    assert probe_dflash2_format(load_checkpoint(fixed), EngineSpec.parse("llamacpp==11434"), target).status is Status.OK
