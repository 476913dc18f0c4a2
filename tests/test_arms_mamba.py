"""``specparity arms --arms mamba-slots``: a hybrid target's mamba state cache sized below the requests in
flight, proven from the server (the running-request cap ``/server_info`` states, beside what the mamba-slots
probe predicts) and from the judged requests themselves (more alive at once than the server runs: the rest
waited for a slot).

A fake whose bug shows only on a request that waited for a slot fails this arm and passes ``default``; a server
that is not capped, or whose answers carry no times, leaves the arm NOT EXERCISED.
"""

from __future__ import annotations

from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import SGLangServer
from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_knobs import ArmSetupError, ArmSizing, arm_launch, mamba_slots_size
from specparity.gate import exitcodes
from specparity.model.arms import ARMS, NOT_EXERCISED, parse_arms
from specparity.probes.mamba_slots import LaunchFlags
from specparity.run.arm_runs import mamba_slots_per_request, most_alive, predict_mamba_slots, target_is_hybrid
from test_arms import arms, prompts, rows, url_args  # noqa: F401 - prompts: a fixture test_arms defines

REPO = Path(__file__).resolve().parents[1]
HYBRID = REPO / "fixtures" / "models" / "hybrid"
PLAIN = REPO / "fixtures" / "models" / "target"
#: What a server launched with --enable-metrics and a small mamba state cache says of itself.
METRICS = {"enable_metrics": True}


def hybrid_args(base, spec, prompt_file: Path, report: Path) -> list[str]:
    """The arms' URL arguments with the hybrid fixture as the target (its tokenizer is the fakes')."""
    args = url_args("sglang", base, spec, prompt_file, report)
    args[args.index("--target") + 1] = str(HYBRID)
    return args


def run_mamba(capsys, tmp_path, prompt_file, chosen, spec: SGLangServer, *extra: str):
    with SGLangServer(server_args=METRICS) as base, spec:
        code, out, err = arms(capsys, *hybrid_args(base, spec, prompt_file, tmp_path), "--arms", "default,mamba-slots",
                              "--prelaunched", "--concurrency", "1", "--engine-opt", f"max_concurrency={len(chosen)}",
                              *extra)
    return code, out + err, rows(tmp_path)


# --------------------------------------------------------------------------- the registry and the plan


def test_the_arm_is_sglangs_and_needs_a_hybrid_target():
    arm = ARMS["mamba-slots"]
    assert arm.engines == ("sglang",) and arm.hybrid and arm.launch
    assert set(arm.unsupported) == {"vllm", "llamacpp"}
    assert "mamba-slots" not in [a.name for a in parse_arms(None, "sglang")]
    assert "mamba-slots" in [a.name for a in parse_arms(None, "sglang", hybrid=True)]
    assert "mamba-slots" not in [a.name for a in parse_arms(None, "vllm", hybrid=True)]
    assert target_is_hybrid(str(HYBRID)) and not target_is_hybrid(str(PLAIN)) and not target_is_hybrid(None)


def test_the_pool_holds_half_the_requests_in_flight():
    sizing = ArmSizing((10, 20), (8, 8), concurrency=8, mamba_slots=3)
    assert mamba_slots_size(sizing) == (12, 4)
    launch = arm_launch("sglang", "mamba-slots", sizing, EngineOptions(target=str(HYBRID)))
    assert launch.flags == ("--max-mamba-cache-size", "12", "--enable-metrics") and launch.concurrency == 8
    assert mamba_slots_size(ArmSizing((10,), (8,), concurrency=3, mamba_slots=5)) == (5, 1)
    with pytest.raises(ArmSetupError, match="1 request in flight cannot wait"):
        mamba_slots_size(ArmSizing((10,), (8,), concurrency=1, mamba_slots=3))
    with pytest.raises(ArmSetupError, match="the target has no linear-attention layers"):
        mamba_slots_size(ArmSizing((10,), (8,), concurrency=8, mamba_slots=None))
    with pytest.raises(ArmSetupError, match="engine 'vllm' cannot run it"):
        arm_launch("vllm", "mamba-slots", sizing, EngineOptions(target=str(HYBRID)))


def test_the_slots_per_request_are_the_probes_for_the_launch():
    """The fixture's class is not in SGLang 0.5.17's extra-buffer list: 'auto' resolves to no_buffer, 3 slots;
    an explicit extra_buffer with the overlap schedule takes 5."""
    plain = predict_mamba_slots(str(HYBRID), LaunchFlags.parse(["--speculative-algorithm", "EAGLE"]), (0, 5, 17))
    assert (plain.strategy, plain.slots_per_request) == ("no_buffer", 3)
    extra = predict_mamba_slots(str(HYBRID), LaunchFlags.parse(["--mamba-radix-cache-strategy", "extra_buffer",
                                                                "--max-mamba-cache-size", "20"]), (0, 5, 17))
    assert (extra.slots_per_request, extra.cap) == (5, 4)
    assert predict_mamba_slots(str(PLAIN), LaunchFlags(), (0, 5, 17)) is None


def test_the_plan_predicts_for_the_sglang_the_servers_run(tmp_path):
    """The sglang-mtp preset on the hybrid: the SGLang of ``--engine-opt python`` is asked its version (0.5.17
    here: no_buffer, 3 slots); an interpreter that cannot say leaves the newest version read (extra_buffer
    for this class, 5 slots)."""
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\necho 0.5.17\n")
    stub.chmod(0o755)
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)

    def setup(python):
        return SimpleNamespace(engine_options=EngineOptions(target=str(HYBRID), preset="sglang-mtp",
                                                            extra={"python": str(python)}))

    assert mamba_slots_per_request(setup(stub), "sglang") == 3
    assert mamba_slots_per_request(setup(broken), "sglang") == 5
    assert mamba_slots_per_request(setup(stub), "vllm") is None
    plain = SimpleNamespace(engine_options=EngineOptions(target=str(PLAIN), preset="sglang-mtp", extra={"python": str(stub)}))
    assert mamba_slots_per_request(plain, "sglang") is None


def test_a_target_that_is_not_a_hybrid_is_refused_before_any_request(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    with SGLangServer() as base, SGLangServer(speculative=True) as spec:
        code, _out, err = arms(capsys, *url_args("sglang", base, spec, prompt_file, tmp_path), "--arms", "mamba-slots",
                               "--prelaunched", "--engine-opt", f"max_concurrency={len(chosen)}")
    assert code == exitcodes.BAD_INPUT, err
    assert "the target has no linear-attention layers" in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------- who was alive at once


def _answers(times):
    return [SimpleNamespace(spec=SimpleNamespace(facts={"received_ts": a, "finished_ts": b})) for a, b in times]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 10)), min_size=1, max_size=8))
def test_the_most_alive_at_once_is_the_largest_set_of_overlapping_lifetimes(spans):
    """Against every subset: the largest set of requests all alive at one instant (a request that finished the
    instant another arrived is not alive with it)."""
    times = [(float(a), float(a + d)) for a, d in spans]

    def together(group):
        return max(a for a, _ in group) < min(b for _, b in group)

    want = max(len(g) for n in range(1, len(times) + 1) for g in combinations(times, n) if together(g))
    assert most_alive(_answers(times)) == want


def test_answers_without_times_prove_nothing():
    assert most_alive([SimpleNamespace(spec=SimpleNamespace(facts={"received_ts": 1.0}))]) is None
    assert most_alive([]) == 0


# --------------------------------------------------------------------------- the arm against the fakes


def test_a_bug_only_on_a_request_that_waited_for_a_slot_fails_mamba_slots_alone(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    spec = SGLangServer(speculative=True, running_cap=2, slot_wait_bug=True,
                        server_args={**METRICS, "max_mamba_cache_size": 10})
    code, out, got = run_mamba(capsys, tmp_path, prompt_file, chosen, spec)
    assert spec.waited and spec.arm_flipped, "no request waited for a slot: nothing was tested"
    assert got["default"]["status"] == "PASS", got["default"]
    arm = got["mamba-slots"]
    assert arm["status"] == "FAIL" and arm["evidence"]["exercised"] is True, arm
    facts = arm["evidence"]["facts"]
    assert facts["requests_in_flight"] == len(chosen) and list(facts["running_caps"].values()) == [2], facts
    assert 2 < facts["most_alive"] <= len(chosen), facts
    proof = " ".join(arm["evidence"]["lines"])
    assert f"{facts['most_alive']} judged requests alive at once on server(s) that run 2" in proof, proof
    # the probe's prediction for the server's own flags and version stands beside what it applied (the recorded
    # body is 0.5.23's, whose extra-buffer list holds the fixture's class: 5 slots a request, 10 // 5 = 2)
    assert ("the mamba-slots probe predicts 5 state slots per request (extra_buffer) and, with "
            "max_mamba_cache_size 10, a cap of 2 (sglang 0.5.23)") in proof, proof
    assert code == exitcodes.GATE_FAILED, out


def test_a_capped_server_without_the_bug_passes_and_says_its_retractions(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    spec = SGLangServer(speculative=True, running_cap=2, server_args={**METRICS, "max_mamba_cache_size": 6})
    code, out, got = run_mamba(capsys, tmp_path, prompt_file, chosen, spec)
    arm = got["mamba-slots"]
    assert arm["status"] == "PASS" and arm["evidence"]["exercised"] is True, arm
    assert any(line.startswith("retractions of the judged requests: 0") for line in arm["evidence"]["lines"]), arm
    assert code == exitcodes.PASS, out


@pytest.mark.parametrize("spec_knobs, words", [
    ({"server_args": METRICS}, "not capped: the speculative server(s) run {cap} request(s) at once, the run sends "
                               "{sent}"),
    ({"running_cap": 2}, "carry no meta_info.request_received_ts"),
])
def test_a_server_that_is_not_capped_or_says_no_times_leaves_the_arm_not_exercised(capsys, tmp_path, prompts,
                                                                                   spec_knobs, words):
    prompt_file, chosen = prompts
    spec = SGLangServer(speculative=True, **spec_knobs)
    code, out, got = run_mamba(capsys, tmp_path, prompt_file, chosen, spec)
    arm = got["mamba-slots"]
    assert arm["status"] == NOT_EXERCISED and arm["evidence"]["exercised"] is False, arm
    cap = spec.server_info()["internal_states"][0]["effective_max_running_requests_per_dp"]
    assert words.format(cap=cap, sent=len(chosen)) in " ".join(arm["evidence"]["lines"]), arm["evidence"]["lines"]
    assert code == exitcodes.GATE_FAILED, out
