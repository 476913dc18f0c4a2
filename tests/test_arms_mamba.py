"""``specparity arms --arms mamba-slots``: a hybrid target's mamba state cache sized below the requests in
flight, proven from the server (the running-request cap ``/server_info`` states, beside what the mamba-slots
probe predicts) and from the judged requests themselves (more alive at once than the server runs: the rest
waited for a slot).

A fake whose bug shows only on a request that waited for a slot fails this arm and passes ``default``; a server
that is not capped, or whose answers carry no times, leaves the arm NOT EXERCISED.
"""

from __future__ import annotations

import sys
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import SGLangServer
from specparity.engines import SERVER_ENGINES
from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_knobs import ArmSetupError, ArmSizing, arm_launch, mamba_slots_size
from specparity.gate import exitcodes
from specparity.engines.server.arm_knobs import arm_engines, parse_arms, unsupported_reason
from specparity.model.arms import ARMS, NOT_EXERCISED
from specparity.probes.mamba_slots import LaunchFlags
from specparity.run.arm_plan import mamba_slots_per_request, predict_mamba_slots, target_is_hybrid
from specparity.run.arm_evidence import most_alive
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
    assert arm_engines(arm.name, SERVER_ENGINES) == ("sglang",) and arm.hybrid and arm.launch
    assert {e for e in SERVER_ENGINES if unsupported_reason(e, arm.name) != "no knob"} == {"vllm", "llamacpp"}
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


# --------------------------------------------------------------------------- the proof piece by piece


def test_the_probes_flags_are_read_from_server_info_field_by_field():
    _mamba_flags = LaunchFlags.from_server_info

    info = {"disable_radix_cache": 1, "mamba_radix_cache_strategy": "extra_buffer", "disable_overlap_schedule": 1,
            "page_size": 16, "max_mamba_cache_size": 40, "max_running_requests": 8, "linear_attn_backend": "fla",
            "speculative_algorithm": "EAGLE"}
    assert _mamba_flags(info) == LaunchFlags(disable_radix_cache=True, mamba_radix_cache_strategy="extra_buffer",
                                             disable_overlap_schedule=True, page_size=16, max_mamba_cache_size=40,
                                             max_running_requests=8, linear_attn_backend="fla",
                                             speculative_algorithm="EAGLE")
    # what a server leaves out (or says as null) is SGLang's default; a boolean is not a number
    assert _mamba_flags({"page_size": True, "max_mamba_cache_size": None, "mamba_radix_cache_strategy": None,
                         "linear_attn_backend": ""}) == LaunchFlags()
    assert _mamba_flags({"max_running_requests": "8"}).max_running_requests is None


class _Endpoint(SimpleNamespace):
    pass


def _engine(*infos):
    """A stand-in SGLang engine whose speculative servers answer ``infos`` on /server_info."""
    endpoints = [_Endpoint(base_url=f"http://s{i}") for i in range(len(infos))]
    by_url = {e.base_url: info for e, info in zip(endpoints, infos)}
    return SimpleNamespace(name="sglang", spec=SimpleNamespace(fleet=SimpleNamespace(endpoints=endpoints)),
                           raw_server_info=lambda endpoint: by_url[endpoint.base_url])


def _info(cap, **over):
    return {"internal_states": [{"effective_max_running_requests_per_dp": cap}], "version": "0.5.17",
            "max_mamba_cache_size": 3 * cap if isinstance(cap, int) else 6, **over}


def _alive(n, start=100.0):
    """``n`` judged answers alive together (each received before the first finished)."""
    return _answers([(start + i * 0.01, start + 10 + i) for i in range(n)])


PREDICTED = ("http://s0: the mamba-slots probe predicts 3 state slots per request (no_buffer) and, with "
             "max_mamba_cache_size 6, a cap of 2 (sglang 0.5.17)")


def test_the_proof_says_the_cap_the_prediction_and_how_many_waited():
    from specparity.run.arm_evidence import slots_check

    got = slots_check(_engine(_info(2)), _alive(5), 8, str(HYBRID))
    assert got.ok is True
    assert got.lines == [
        "running-request cap as each speculative server says (/server_info effective_max_running_requests_per_dp): "
        "http://s0 2", PREDICTED,
        "5 judged requests alive at once on server(s) that run 2: at least 3 waited for a state slot"]
    assert got.facts == {"running_caps": {"http://s0": 2}, "requests_in_flight": 8, "most_alive": 5}


def test_a_server_that_runs_as_many_as_are_sent_is_not_capped():
    from specparity.run.arm_evidence import slots_check

    got = slots_check(_engine(_info(4), _info(4)), _alive(8), 8, str(HYBRID))
    assert got.ok is False and got.lines[-1] == ("not capped: the speculative server(s) run 8 request(s) at once, the "
                                                 "run sends 8")
    assert got.facts == {"running_caps": {"http://s0": 4, "http://s1": 4}, "requests_in_flight": 8}
    assert slots_check(_engine(_info(4), _info(3)), _alive(8), 8, str(HYBRID)).ok is True  # 7 < 8, 8 alive


def test_no_more_alive_than_the_server_runs_shows_no_wait():
    from specparity.run.arm_evidence import slots_check

    got = slots_check(_engine(_info(2)), _alive(2), 8, str(HYBRID))
    assert got.ok is False and got.lines[-1] == ("at most 2 judged request(s) alive on the server(s) at once, within "
                                                 "what they run (2): none waited for a slot")
    assert got.facts["most_alive"] == 2
    assert slots_check(_engine(_info(2)), _alive(3), 8, str(HYBRID)).ok is True


def test_a_cap_or_times_the_server_does_not_say_prove_nothing():
    from specparity.run.arm_evidence import slots_check

    unknown = slots_check(_engine(_info(2), {"version": "0.5.17"}), _alive(5), 8, str(HYBRID))
    assert unknown.ok is False and unknown.lines[0].endswith("http://s0 2, http://s1 unknown")
    assert unknown.lines[-1] == "the running-request cap is unknown: nothing shows a slot ran out"
    assert unknown.facts == {"running_caps": {"http://s0": 2, "http://s1": None}, "requests_in_flight": 8}
    for bad in (0, True, "2", None):
        assert slots_check(_engine(_info(bad)), _alive(5), 8, str(HYBRID)).facts["running_caps"] == {"http://s0": None}
    no_times = slots_check(_engine(_info(2)), [SimpleNamespace(spec=SimpleNamespace(facts={}))], 8, str(HYBRID))
    assert no_times.ok is False and no_times.facts["most_alive"] is None
    assert no_times.lines[-1] == ("the judged answers carry no meta_info.request_received_ts / request_finished_ts "
                                  "(SGLang answers them with --enable-metrics): nothing shows a request waited")
    nothing = slots_check(_engine(), [], 8, str(HYBRID))
    assert nothing.ok is False and nothing.lines[0].endswith("effective_max_running_requests_per_dp): none")


def test_the_prediction_line_for_each_kind_of_server():
    from specparity.run.arm_evidence import _predicted_line

    assert _predicted_line(str(HYBRID), "http://s0", _info(2)) == PREDICTED
    unset = _predicted_line(str(HYBRID), "u", {"version": "0.5.17"})
    assert unset == ("u: the mamba-slots probe predicts 3 state slots per request (no_buffer) and, with "
                     "max_mamba_cache_size unset, no cap it can tell (the pool is sized from memory) (sglang 0.5.17)")
    newest = _predicted_line(str(HYBRID), "u", {"version": "not a version", "max_mamba_cache_size": 10})
    assert newest.endswith("a cap of 2 (sglang not a version)"), newest  # the newest constants read: 5 slots
    assert _predicted_line(str(HYBRID), "u", {}).endswith("(sglang version unknown)")
    assert _predicted_line(str(PLAIN), "u", _info(2)) == "u: the mamba-slots probe predicts nothing (the target is not a hybrid)"


def test_the_prediction_takes_the_version_and_falls_back_to_the_newest_read():
    from specparity.probes.version_facts import newest_mamba_read

    flags = LaunchFlags.parse(["--max-mamba-cache-size", "30"])
    old, newest = (predict_mamba_slots(str(HYBRID), flags, v) for v in ((0, 5, 17), newest_mamba_read()))
    assert (old.slots_per_request, old.cap) == (3, 10) and (newest.slots_per_request, newest.cap) == (5, 6)
    for before_any_read in ((0, 5, 16), (0, 4), None):
        got = predict_mamba_slots(str(HYBRID), flags, before_any_read)
        assert (got.slots_per_request, got.cap) == (5, 6), before_any_read
    assert predict_mamba_slots(str(HYBRID), flags, (0, 5, 17, 1)).slots_per_request == 3  # a post release
    assert predict_mamba_slots(None, flags, (0, 5, 17)) is None


def test_the_plan_reads_the_flags_given_when_there_is_no_preset(tmp_path):
    stub = tmp_path / "python"
    stub.write_text("#!/bin/sh\necho 'a warning first'\necho 0.5.17\n")
    stub.chmod(0o755)
    given = SimpleNamespace(engine_options=EngineOptions(target=str(HYBRID), extra={
        "python": str(stub), "server_args": ["--mamba-radix-cache-strategy", "extra_buffer"]}))
    assert mamba_slots_per_request(given, "sglang") == 5  # extra_buffer with the overlap schedule
    given.engine_options.extra["server_args"] = ["--mamba-radix-cache-strategy", "extra_buffer",
                                                 "--disable-overlap-schedule"]
    assert mamba_slots_per_request(given, "sglang") == 4
    # the preset's speculative launch, not its baseline, and the flags given after it
    preset = SimpleNamespace(engine_options=EngineOptions(target=str(HYBRID), preset="sglang-mtp", extra={
        "python": str(stub), "server_args": ["--mamba-radix-cache-strategy", "extra_buffer"]}))
    assert mamba_slots_per_request(preset, "sglang") == 5


def test_the_sglang_version_is_asked_of_the_interpreter_that_runs_it(tmp_path, monkeypatch):
    from specparity.run import arm_plan

    def script(name, body):
        path = tmp_path / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return str(path)

    # a real interpreter, whose packages hold an SGLang distribution: the version its metadata gives
    site = tmp_path / "site"
    (site / "sglang-0.5.17.dist-info").mkdir(parents=True)
    (site / "sglang-0.5.17.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.17\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert arm_plan._installed_version("sglang", sys.executable) == (0, 5, 17)
    monkeypatch.delenv("PYTHONPATH")
    assert arm_plan._installed_version("sglang", script("ok", "echo 0.5.17.post1\n")) == (0, 5, 17)
    assert arm_plan._installed_version("sglang", script("silent", "true\n")) is None
    assert arm_plan._installed_version("sglang", script("fails", "echo 0.5.17; exit 3\n")) is None
    assert arm_plan._installed_version("sglang", str(tmp_path / "missing")) is None
    import importlib.metadata

    asked = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: asked.append(name) or "0.5.19")
    assert arm_plan._installed_version("sglang", None) == (0, 5, 19) and asked == ["sglang"]


def test_unknown_is_said_for_a_missing_figure():
    from specparity.run.arm_evidence import _or_unknown

    assert [_or_unknown(v) for v in (None, 0, 3)] == ["unknown", "0", "3"]


def _judged(n: int, retractions: dict[int, int] | None = None):
    """``n`` answered judged requests alive together, cold, with their retractions."""
    out = []
    for i in range(n):
        facts = {"received_ts": 100.0 + i * 0.01, "finished_ts": 110.0 + i, "cached_tokens": 0,
                 "preemptions": (retractions or {}).get(i, 0)}
        out.append(SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}", prompt_ids=[10 + i, 5, 6]),
                                   spec=SimpleNamespace(facts=facts, error=None, output_ids=[7])))
    return SimpleNamespace(records=out)


def test_the_arms_evidence_joins_the_wait_the_cold_start_and_the_retractions():
    from specparity.run.arm_evidence import JudgedPhase, collect_evidence

    engine = _engine(_info(2))
    engine.every_server = lambda: []
    phase = JudgedPhase(reset=[("http://s0", True, "Cache flushed.")])

    def plan(concurrency):
        return SimpleNamespace(arm=ARMS["mamba-slots"], setup=SimpleNamespace(
            config=SimpleNamespace(concurrency=concurrency), engine_options=SimpleNamespace(target=str(HYBRID))))

    got = collect_evidence(plan(8), engine, _judged(5, {1: 2}), phase)
    assert got.exercised is True
    assert got.lines[-4:] == [
        "5 judged requests alive at once on server(s) that run 2: at least 3 waited for a state slot",
        "cold: none of the 5 judged request(s) found anything cached",
        "retractions of the judged requests: 2, per judged request (r1 2)",
        "prefix cache reset on the speculative server(s) before the judged requests (http://s0)"]
    assert got.facts["preemptions"] == 2 and got.facts["preemptions_per_request"] == {
        "r0": 0, "r1": 2, "r2": 0, "r3": 0, "r4": 0}
    assert got.facts["cached_tokens"] == {f"r{i}": 0 for i in range(5)} and got.facts["most_alive"] == 5
    assert got.facts["prefix_cache_reset"] == [("http://s0", True, "Cache flushed.")]
    # no requests in flight said: one, which no cap is below
    alone = collect_evidence(plan(None), engine, _judged(5), phase)
    assert alone.exercised is False and ("not capped: the speculative server(s) run 2 request(s) at once, the run "
                                         "sends 1") in alone.lines
    # a warm judged request fails the arm: it must be free of prefix-warm's condition
    warm = _judged(5)
    warm.records[0].spec.facts["cached_tokens"] = 2
    assert collect_evidence(plan(8), engine, warm, phase).exercised is False
