"""Mamba state-slot prediction from a hybrid target config and launch flags (offline, table data)."""

from __future__ import annotations

import pytest

import probe_artifacts as pa
from specparity.probes.checkpoints import load_checkpoint
from specparity.probes.version_facts import EngineSpec, sglang_mamba_sizing
from specparity.probes.mamba_slots import LaunchFlags, predict_slots, probe_mamba_slots
from specparity.probes.finding import Status

SG19 = EngineSpec.parse("sglang==0.5.19")


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba")
    return {
        "hybrid": load_checkpoint(pa.hybrid_target(d / "h")),
        "broken": load_checkpoint(pa.hybrid_target(d / "b", consistent=False)),
        "dense": load_checkpoint(pa.dense_target(d / "d")),
    }


def slots(targets, flags: str, engine=SG19, env=None):
    return probe_mamba_slots(targets["hybrid"], engine, LaunchFlags.parse(flags), None, env or {})


def test_a_cache_of_8_under_speculation_caps_at_one_request(targets):
    """--max-mamba-cache-size 8 under speculation -> 5 slots/request -> cap 1 (a deployed configuration)."""
    v = slots(targets, "--speculative-algorithm DFLASH --max-mamba-cache-size 8")
    assert v.status is Status.WARN
    assert v.message.startswith(
        "max_running_requests is capped to 1 by the mamba state cache (max_mamba_cache_size=8, 5 state slots per request)")
    joined = "\n".join(v.evidence)
    assert "'auto' strategy -> extra_buffer" in joined and "slots per request = 3 base + 2" in joined
    assert "kv_cache_configurator.py:157" in joined and ":2127 'max_running_requests is capped to" in joined


@pytest.mark.parametrize("flags, per_req, cap, status", [
    ("--max-mamba-cache-size 10", 5, 2, Status.OK),
    ("--max-mamba-cache-size 4", 5, 0, Status.FAIL),
    ("--disable-radix-cache --max-mamba-cache-size 8", 1, 8, Status.OK),
    ("--disable-overlap-schedule --max-mamba-cache-size 8", 3, 2, Status.OK),
    ("--disable-overlap-schedule --page-size 16 --max-mamba-cache-size 8", 4, 2, Status.OK),
    ("--mamba-radix-cache-strategy extra_buffer_lazy --max-mamba-cache-size 8", 4, 2, Status.OK),
    ("--linear-attn-backend flashinfer --max-mamba-cache-size 8", 3, 2, Status.OK),
    ("--max-mamba-cache-size 20 --max-running-requests 8", 5, 4, Status.WARN),
])
def test_slot_arithmetic(targets, flags, per_req, cap, status):
    pred = predict_slots(targets["hybrid"], LaunchFlags.parse(flags), sglang_mamba_sizing((0, 5, 19)), {})
    assert (pred.slots_per_request, pred.cap) == (per_req, cap)
    assert slots(targets, flags).status is status


def test_skip_decode_lock_env(targets):
    pred = predict_slots(targets["hybrid"], LaunchFlags.parse("--max-mamba-cache-size 8"), sglang_mamba_sizing((0, 5, 19)),
                         {"SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": "1"})
    assert pred.slots_per_request == 4


def test_arch_list_depends_on_version(targets):
    """Qwen3_5ForCausalLM joined _MAMBA_EXTRA_BUFFER_ARCHS in 0.5.19: on 0.5.17 'auto' gives no_buffer."""
    pred = predict_slots(targets["hybrid"], LaunchFlags.parse("--max-mamba-cache-size 8"), sglang_mamba_sizing((0, 5, 17)), {})
    assert (pred.strategy, pred.slots_per_request) == ("no_buffer", 3)


def test_auto_sized_pool_is_unknown(targets):
    v = slots(targets, "")
    assert v.status is Status.UNKNOWN and "5 mamba state slots per request" in v.summary


def test_layer_types_disagreeing_with_interval(targets):
    v = probe_mamba_slots(targets["broken"], SG19, LaunchFlags(), None)
    assert v.status is Status.FAIL
    joined = "\n".join(v.evidence)
    assert "disagree at layers [3, 4]" in joined and "full_attention_interval=4" in joined
    assert "qwen3_next.py:260" in joined
    assert probe_mamba_slots(targets["broken"], EngineSpec.parse("vllm==0.11.0"), LaunchFlags(), None).status is Status.WARN


def test_non_hybrid_and_other_engines(targets):
    assert probe_mamba_slots(targets["dense"], SG19, LaunchFlags(), None).status is Status.OK
    assert probe_mamba_slots(targets["hybrid"], EngineSpec.parse("vllm==0.11.0"), LaunchFlags(), None).status is Status.UNKNOWN


def test_bad_launch_flags():
    with pytest.raises(ValueError, match="--launch-flags"):
        LaunchFlags.parse("--max-mamba-cache-size lots")
