"""Selector lm_head probe on real synthetic checkpoints (offline: headers and configs only)."""

from __future__ import annotations

import pytest

import probe_artifacts as pa
from specparity.probes.checkpoints import load_checkpoint
from specparity.probes.version_facts import SGLANG_MSG_0519, SGLANG_MSG_0521, EngineSpec
from specparity.probes.lm_head import find_head, probe_lm_head
from specparity.probes.finding import Status


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmhead")
    return {
        "dense": load_checkpoint(pa.dense_target(d / "dense")),
        "tied": load_checkpoint(pa.tied_target(d / "tied")),
        "fp8": load_checkpoint(pa.fp8_head_target(d / "fp8")),
        "int4_dense_head": load_checkpoint(pa.int4_target(d / "i4d", head_quantized=False)),
        "int4_head": load_checkpoint(pa.int4_target(d / "i4q", head_quantized=True)),
        "mo_fp8": load_checkpoint(pa.modelopt_fp8_head_target(d / "mo", input_scale=False)),
        "mo_fp8_static": load_checkpoint(pa.modelopt_fp8_head_target(d / "mos", input_scale=True)),
        "gguf": load_checkpoint(pa.gguf_target(d / "gguf")),
        "dflash2": load_checkpoint(pa.dflash2_draft(d / "draft")),
        "dflash1": load_checkpoint(pa.dflash2_draft(d / "draft1", arch="DFlashDraftModel", keys={}, v2_tensors=False)),
    }


def run(ckpts, target, engine, draft="dflash2"):
    return probe_lm_head(ckpts[target], ckpts[draft] if draft else None, EngineSpec.parse(engine))


def test_head_detection(ckpts):
    assert find_head(ckpts["dense"]).kind == "dense"
    tied = find_head(ckpts["tied"])
    assert (tied.tied, tied.module, tied.kind) == (True, "model.embed_tokens", "dense")
    assert find_head(ckpts["fp8"]).kind == "fp8-block"
    assert find_head(ckpts["int4_head"]).kind == "int4-packed"
    assert find_head(ckpts["int4_dense_head"]).kind == "dense"
    assert find_head(ckpts["mo_fp8"]).kind == "modelopt-fp8"
    assert find_head(ckpts["gguf"]).kind == "gguf"


@pytest.mark.parametrize("target", ["dense", "tied", "int4_dense_head"])
@pytest.mark.parametrize("engine", ["sglang==0.5.19", "sglang==0.5.23", "vllm==0.11.0"])
def test_dense_heads_pass(ckpts, target, engine):
    v = run(ckpts, target, engine)
    assert v.status is Status.OK, v.render()


def test_redhat_int4_target_keeps_a_dense_head(ckpts):
    """A deployed W4A16 target with lm_head in compressed-tensors' ignore list."""
    v = run(ckpts, "int4_dense_head", "vllm==0.11.0")
    assert v.status is Status.OK
    assert any("ignore=['lm_head']" in e for e in v.evidence)


def test_vllm_refuses_quantized_head_with_its_message(ckpts):
    v = run(ckpts, "fp8", "vllm==0.11.0")
    assert v.status is Status.FAIL
    assert v.message == "DFlash2 requires an unquantized target LM head for candidate TopK; got Fp8LinearMethod."
    assert any("lm_head.weight: F8_E4M3 [512, 256]" in e for e in v.evidence)
    assert any("lm_head.weight_scale_inv: F32 [4, 2]" in e for e in v.evidence)
    v = run(ckpts, "int4_head", "vllm==0.11.0")
    assert v.status is Status.FAIL and "CompressedTensorsLinearMethod" in v.message


@pytest.mark.parametrize("engine", ["sglang==0.5.19", "sglang==0.5.21"])
def test_sglang_applies_supported_quant_methods(ckpts, engine):
    for target in ("fp8", "int4_head", "mo_fp8_static"):
        v = run(ckpts, target, engine)
        assert v.status is Status.OK, v.render()
        assert "quant_method" in v.summary and v.live_only and "first decode" in v.live_only


@pytest.mark.parametrize("engine, message, line", [
    ("sglang==0.5.19", SGLANG_MSG_0519, "srt/models/dflash.py:1110"),
    ("sglang==0.5.20", SGLANG_MSG_0519, "srt/models/dflash.py:1189"),
    ("sglang==0.5.21", SGLANG_MSG_0521, "srt/models/dflash.py:124"),
    ("sglang==0.5.23", SGLANG_MSG_0521, "srt/models/dflash.py:126"),
])
def test_modelopt_fp8_head_without_input_scale_fails_on_first_decode(ckpts, engine, message, line):
    v = run(ckpts, "mo_fp8", engine)
    assert v.status is Status.FAIL and v.message == message
    assert "input_scale" in v.summary
    assert any(line in e for e in v.evidence)
    assert "first decode" in (v.live_only or "")


def test_gguf_head_is_rejected_by_the_sglang_selector(ckpts):
    v = run(ckpts, "gguf", "sglang==0.5.19")
    assert v.status is Status.FAIL and v.message == SGLANG_MSG_0519
    assert any("qweight" in e for e in v.evidence)


def test_old_sglang_has_no_selector(ckpts):
    v = run(ckpts, "fp8", "sglang==0.5.18")
    assert v.status is Status.UNKNOWN and "no DFlash2" in v.summary
    assert run(ckpts, "fp8", "sglang==0.5.17", draft="dflash1").status is Status.OK


def test_quantized_head_without_a_dflash2_draft_only_warns(ckpts):
    assert run(ckpts, "fp8", "vllm==0.11.0", draft=None).status is Status.WARN
    assert run(ckpts, "fp8", "vllm==0.11.0", draft="dflash1").status is Status.WARN


def test_unknown_engines_and_versions(ckpts):
    assert run(ckpts, "fp8", "llamacpp==b6000").status is Status.UNKNOWN
    assert run(ckpts, "fp8", "sglang==0.5.10").status is Status.UNKNOWN
    newer = run(ckpts, "mo_fp8", "sglang==0.5.30")
    assert newer.status is Status.FAIL and newer.message == SGLANG_MSG_0521
    assert any("0.5.30 was not read" in e for e in newer.evidence)
