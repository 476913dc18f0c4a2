"""Live probes on the real in-process engines and the committed fixtures.

The acceptance floor must pass the trained DFlash2 draft and trip on the same draft whose FP8
block scales an engine ignored: the stored values are ``w / scale`` (what an FP8 checkpoint holds
before dequantisation), so every projection is blown up by ``448 / max|w|``. Output stays
lossless — verification rejects the garbage — which is exactly why only acceptance shows it.
Offline in the sense that matters here: no SGLang server runs; the engine is ``dflash``.
"""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.model.locations import fixture_dir
from specparity.probes import live
from specparity.probes.finding import Status

FP8_MAX = 448.0
QUANTIZED = ("o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


@pytest.fixture(scope="module")
def unscaled_draft(tmp_path_factory):
    src = fixture_dir("dflash2")
    dst = tmp_path_factory.mktemp("dflash2-unscaled")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if name.endswith(QUANTIZED):
            scale = w.float().abs().max() / FP8_MAX  # per-tensor scale an FP8 export would store
            tensors[name] = (w.float() / scale).to(w.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _engine(draft):
    return load_engine("dflash", EngineOptions(target=str(fixture_dir("target")), draft=str(draft)))


@pytest.fixture(scope="module")
def recorded():
    """The accept length recorded for the good configuration on the probe's own prompts (what
    ``--accept-record`` stores per engine fingerprint)."""
    engine = _engine(fixture_dir("dflash2"))
    try:
        results = engine.generate(live._requests(engine, live.PROMPTS, 48, "record"), speculative=True)
    finally:
        engine.close()
    mal, steps = live.mean_accept_length(results)
    assert steps > 0 and mal > live.DEFAULT_FLOOR
    return mal


def _floor(draft, recorded_length):
    engine = _engine(draft)
    try:
        return live.acceptance_floor(engine, recorded=recorded_length)
    finally:
        engine.close()


def test_acceptance_floor_passes_the_trained_draft(recorded):
    v = _floor(fixture_dir("dflash2"), recorded)
    assert v.status is Status.OK, v.render()


def test_acceptance_floor_trips_on_ignored_fp8_scales(unscaled_draft, recorded):
    v = _floor(unscaled_draft, recorded)
    assert v.status is Status.FAIL, v.render()
    assert "draft silently rejected" in v.render()
