"""Live probes against the engine protocol, on a tiny in-process transformers engine.

The acceptance floor runs real assisted generation (random-init Qwen3, CPU, one thread) with
acceptance counted from transformers' own candidate generator. The mamba stress runs on a
*simulated* slot pool wrapped around that engine (tests/probe_artifacts.SlotPoolEngine): the
scheduler dying for real under slot exhaustion is something only a live SGLang shows.
"""

from __future__ import annotations

import copy

import pytest

import probe_artifacts as pa
from specparity.probes import live
from specparity.probes.finding import Status
from specparity.model.types import GenerationResult

SHORT = dict(prompts=live.PROMPTS[:2], max_new_tokens=24)


@pytest.fixture(scope="module")
def target():
    return pa.tiny_qwen3()


@pytest.fixture(scope="module")
def copy_engine(target):
    return pa.TinyHFEngine(target, copy.deepcopy(target))


def test_copy_draft_passes_the_floor(copy_engine):
    v = live.acceptance_floor(copy_engine, **SHORT)
    assert v.status is Status.OK, v.render()
    mal, steps = live.mean_accept_length(copy_engine.generate(live._requests(copy_engine, live.PROMPTS[:1], 24, "x"),
                                                              speculative=True))
    assert mal > 4 and steps > 0


def test_draft_with_ignored_block_scales_trips_the_floor(target):
    """An engine that ignores FP8 block scales computes codes x 1: the draft proposes garbage."""
    v = live.acceptance_floor(pa.TinyHFEngine(target, pa.fp8_block_roundtrip(target, apply_scales=False)), **SHORT)
    assert v.status is Status.FAIL and "draft silently rejected" in v.summary
    assert any("accepted 0 of" in e for e in v.evidence)


def test_correctly_scaled_fp8_draft_passes_absolute_but_not_a_strict_relative_floor(target, copy_engine):
    engine = pa.TinyHFEngine(target, pa.fp8_block_roundtrip(target, apply_scales=True))
    recorded, _ = live.mean_accept_length(copy_engine.generate(
        live._requests(copy_engine, SHORT["prompts"], SHORT["max_new_tokens"], "rec"), speculative=True))
    assert live.acceptance_floor(engine, recorded=recorded, relative=0.5, **SHORT).status is Status.OK
    strict = live.acceptance_floor(engine, recorded=recorded, relative=0.99, **SHORT)
    assert strict.status is Status.FAIL and "x recorded" in strict.evidence[1]


def test_no_counters_is_unknown(target):
    v = live.acceptance_floor(pa.TinyHFEngine(target, None), **SHORT)
    assert v.status is Status.UNKNOWN


def test_recorded_accept_length_roundtrip(copy_engine, tmp_path):
    fp = copy_engine.fingerprint()
    path = tmp_path / "accept.json"
    assert live.load_recorded(path, fp) is None
    live.save_recorded(path, fp, 6.5)
    assert live.load_recorded(path, fp) == 6.5
    other = copy.deepcopy(fp)
    other.engine_version = "1"
    assert live.load_recorded(path, other) is None


class _Raising:
    """An engine whose first decode fails the way SGLang does with an unsupported head."""

    name = "raising"

    def __init__(self, inner, *, raise_it: bool) -> None:
        self.inner, self.raise_it = inner, raise_it

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def generate(self, requests, *, speculative):
        msg = "RuntimeError: DFlash2 selector requires a dense FP16/BF16/FP32 target lm_head or a supported lm_head.quant_method."
        if self.raise_it:
            raise RuntimeError(msg)
        return [GenerationResult.failed(r.request_id, msg) for r in requests]


def test_first_decode(copy_engine):
    assert live.first_decode(copy_engine).status is Status.OK
    for raise_it in (True, False):
        v = live.first_decode(_Raising(copy_engine, raise_it=raise_it))
        assert v.status is Status.FAIL and "DFlash2 selector requires a dense" in v.message


STRESS = dict(requests=4, prefix_tokens=96, max_new_tokens=6)


@pytest.mark.parametrize("pool, graceful, corrupt, status, text", [
    (64, False, False, Status.OK, "still healthy"),
    (8, True, False, Status.OK, "still healthy"),
    (8, False, False, Status.FAIL, "engine died"),
    (8, True, True, Status.FAIL, "outputs changed"),
])
def test_mamba_stress_on_a_simulated_slot_pool(copy_engine, pool, graceful, corrupt, status, text):
    engine = pa.SlotPoolEngine(copy_engine, pool=pool, slots_per_request=5, graceful=graceful, corrupt=corrupt)
    v = live.mamba_stress(engine, **STRESS)
    assert v.status is status and text in v.summary, v.render()
