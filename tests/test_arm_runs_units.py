"""``specparity arms`` piece by piece (:mod:`specparity.run.arm_runs`), with stand-in records and engines: the
plans and their refusals, the engine that starts the judged phase cold and sends prefix-warm's warm-ups, each
proof (cold, warm, preempted or not, the launch-level conditions, every arm's own), the bias line, the
results and the files and table they are written to. The end-to-end runs against the fake servers are
``tests/test_arms.py`` and ``tests/test_arms_proof.py``; here every line a proof or a table says is checked
word for word, and every count and boundary a verdict turns on."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fakes.backend import TARGET
from specparity.engines import SERVER_ENGINES
from specparity.engines.base import EngineInfo, EngineOptions
from specparity.engines.server import arm_knobs
from specparity.engines.server.arm_knobs import ArmLaunch, ArmSizing, arm_changes, arm_launch, unsupported_reason
from specparity.engines.server.engine import HFTokenizer
from specparity.engines.server.http import ServerError
from specparity.gate import exitcodes
from specparity.model.arms import ARMS, LONG_MIN_TOKENS, NOT_EXERCISED
from specparity.model.gate_run import Activity, GateConfig, PromptRecord
from specparity.model.prompts import Prompt, long_context_prompt
from specparity.model.types import GenerationRequest, GenerationResult, SpecStats, TokenScores
from specparity.run import arm_runs
from specparity.run import arm_plan
from specparity.run import arm_evidence
from specparity.run.arm_runs import (ARM_JSON, ARMS_JSON, ARMS_MD, ArmResult, ArmsResult, arm_line, arms_markdown, run_arms,
                                     terminal_lines, write_arm, write_arms)
from specparity.run.arm_plan import LONG_FIT_TOKENS, ArmPlan, engine_kind, plan_arms, sized_long_prompt
from specparity.run.arm_evidence import (ArmEngine, Check, Evidence, JudgedPhase, bias_line, cold_check, collect_evidence,
                                         preempt_check, warm_check)
from specparity.run.setup import BadInput, GateSetup

# --------------------------------------------------------------------------- stand-ins


def answer(rid: str, output=(), *, facts=None, error=None) -> GenerationResult:
    return GenerationResult(rid, list(output), "", "length", TokenScores.empty(), SpecStats.unavailable("stand-in"),
                            error=error, facts=dict(facts or {}))


def record(rid: str, prompt_ids=(1, 2, 3), output=(), *, facts=None, error=None, request=True,
           spec=True) -> PromptRecord:
    """A judged prompt's record: its request (``prompt_ids``) and its speculative answer (``output``, ``facts``)."""
    return PromptRecord(Prompt(rid, "math", "en", prompt="stand-in"),
                        request=GenerationRequest(rid, list(prompt_ids), 8) if request else None,
                        spec=answer(rid, output, facts=facts, error=error) if spec else None)


def metrics(engine: str, value: int) -> str:
    """A ``/metrics`` page with ``engine``'s preemption counter at ``value``."""
    name = {"vllm": "vllm:num_preemptions_total", "sglang": "sglang:num_retracted_requests_total"}[engine]
    return f"# TYPE {name} counter\n{name} {value}\n"


class Endpoint:
    """A server as the arm proofs read it: ``/metrics`` (None: 404), the prefix-cache reset route's answer
    (an exception: raised), and its ``/server_info`` (``info``)."""

    def __init__(self, url: str, *, metrics_text: str | None = None, reset: str | Exception | None = None,
                 info: dict | None = None):
        self.base_url = url
        self.metrics_text = metrics_text
        self.reset = reset
        self.info = info
        self.calls: list[tuple[str, str]] = []

    def request(self, method: str, path: str, timeout_s: float = 0.0):
        self.calls.append((method, path))
        value = self.metrics_text if path == "/metrics" else self.reset
        if isinstance(value, Exception):
            raise value
        if value is None:
            raise ServerError("404 Not Found", status=404)
        return SimpleNamespace(body=value.encode())


class Engine:
    """A server engine as an arm runs it: both sides' endpoints, their facts, and ``generate`` answering each
    request from ``answers`` (by request id; else an empty answer), each call recorded."""

    def __init__(self, name: str | None, spec=(), baseline=(), answers=None):
        if name is not None:
            self.name = name
        self.spec = SimpleNamespace(fleet=SimpleNamespace(endpoints=list(spec)))
        self.baseline = SimpleNamespace(fleet=SimpleNamespace(endpoints=list(baseline)))
        self.answers = answers or {}
        self.calls: list[tuple[list[tuple[str, int]], bool]] = []
        self.closed = 0

    def every_server(self):
        return [("baseline", e) for e in self.baseline.fleet.endpoints] + [("spec", e) for e in self.spec.fleet.endpoints]

    def dev_server_info(self, endpoint):
        return endpoint.info

    def raw_server_info(self, endpoint):
        return endpoint.info

    def generate(self, requests, *, speculative):
        self.calls.append(([(r.request_id, r.max_new_tokens) for r in requests], speculative))
        return [self.answers.get(r.request_id) or answer(r.request_id) for r in requests]

    def close(self):
        self.closed += 1


class InProcess:
    """An in-process engine: no servers (no ``every_server``)."""

    name = "hf"


def vllm_info(dtype: str | None = None, block: int | None = None) -> dict:
    cache = {}
    if dtype is not None:
        cache["cache_dtype"] = dtype
    if block is not None:
        cache["block_size"] = block
    return {"vllm_config": {"cache_config": cache}}


def plan_of(arm: str, engine_spec: str = "vllm", report_dir: str | None = "reports/x") -> ArmPlan:
    setup = SimpleNamespace(engine_spec=engine_spec, config=GateConfig(report_dir=report_dir), prompts=[],
                            calibration=None, golden=None)
    return ArmPlan(ARMS[arm], setup, ArmLaunch(), "nothing")


# --------------------------------------------------------------------------- results as JSON


def _result(**kw) -> ArmResult:
    base = dict(arm="default", report_dir="r/default", launch="nothing", gate_status="PASS", exit_code=0,
                counts={"exact": 2}, failures=[], total=2, proposed=10, accepted=6, accept_length=2.5,
                threshold=0.25, threshold_source="measured", evidence=Evidence(True, ["cold"], {"cached_tokens": {}}))
    base.update(kw)
    return ArmResult(**base)


def test_an_arm_result_in_json_is_its_fields_then_its_verdict_and_its_proof_last():
    r = _result(wall_s={"launch": 1.5, "total": 3.0})
    got = r.to_json()
    assert got == {"arm": "default", "report_dir": "r/default", "launch": "nothing", "gate_status": "PASS",
                   "exit_code": 0, "counts": {"exact": 2}, "failures": [], "total": 2, "proposed": 10, "accepted": 6,
                   "accept_length": 2.5, "threshold": 0.25, "threshold_source": "measured", "bias": None,
                   "wall_s": {"launch": 1.5, "total": 3.0}, "status": "PASS", "gate_exit_code": 0,
                   "evidence": {"exercised": True, "lines": ["cold"], "facts": {"cached_tokens": {}}}}
    assert list(got)[-3:] == ["status", "gate_exit_code", "evidence"]  # arm.json: the proof comes last


def test_an_arm_not_proven_is_not_exercised_in_json_with_the_gate_s_own_exit_beside_it():
    got = _result(evidence=Evidence(False, ["not cold"])).to_json()
    assert (got["status"], got["exit_code"], got["gate_exit_code"], got["gate_status"]) == (
        NOT_EXERCISED, exitcodes.GATE_FAILED, exitcodes.PASS, "PASS")
    assert got["evidence"] == {"exercised": False, "lines": ["not cold"], "facts": {}}


def test_the_arms_result_in_json():
    ok = _result()
    failed = _result(arm="preempt", gate_status="FAIL", exit_code=1)
    arms = ArmsResult("vllm", ("default", "preempt", "long"), "reports/a", [ok, failed])
    got = arms.to_json()
    assert list(got) == ["schema", "status", "exit_code", "engine", "arms", "report", "results"]
    assert got == {"schema": 1, "status": "FAIL", "exit_code": 1, "engine": "vllm",
                   "arms": ["default", "preempt", "long"], "report": "reports/a",
                   "results": [ok.to_json(), failed.to_json()]}


# --------------------------------------------------------------------------- planning


def factory_with(info: EngineInfo | None):
    def factory(options):  # pragma: no cover - planning builds no engine
        raise AssertionError("planning builds no engine")

    if info is not None:
        factory.engine_info = info
    return factory


class Checks:
    """An engine's own option check: records each option set it is shown; raises ``refuse`` when set."""

    def __init__(self, refuse: str | None = None):
        self.seen: list[EngineOptions] = []
        self.refuse = refuse

    def __call__(self, options: EngineOptions) -> None:
        self.seen.append(options)
        if self.refuse:
            raise ValueError(self.refuse)


PROMPTS = [Prompt("short-1", "math", "en", prompt="What is 2 + 2?", max_new_tokens=5),
           Prompt("chat-1", "chat", "en", messages=(("system", "Be brief."), ("user", "Name a colour.")))]
CALIBRATION = [Prompt("calib-long", "code", "en",
                      prompt="Write a Python function that returns the sum of the squares of a list of integers, "
                             "with a docstring and two doctests, then explain how it handles an empty list.",
                      max_new_tokens=40)]


def setup_for(engine: str, *, server: bool = True, check=None, urls: bool = False, target=str(TARGET),
              report_dir: str | None = None, extra=None, config=None, prompts=PROMPTS,
              calibration=CALIBRATION) -> GateSetup:
    info = EngineInfo(name=engine, server=server, check=check) if engine != "plugin" else None
    options = EngineOptions(target=target, preset=None if urls else f"{engine}-ngram",
                            extra=dict({"max_concurrency": 3} if extra is None else extra),
                            baseline_urls=("http://127.0.0.1:9",) if urls else (),
                            spec_urls=("http://127.0.0.1:10",) if urls else ())
    return GateSetup(engine_spec="my_plugin.py:make" if engine == "plugin" else engine, factory=factory_with(info),
                     engine_options=options, config=config or GateConfig(report_dir=report_dir, concurrency=2),
                     prompts=list(prompts), calibration=None if calibration is None else list(calibration))


@pytest.fixture(autouse=True)
def no_installed_engines(monkeypatch):
    """The arms' launch knobs are checked against an installed engine's source: none is installed here."""
    monkeypatch.setattr(arm_knobs, "installed_package_dir", lambda name: None)


def tokens(prompts) -> tuple[int, ...]:
    tok = HFTokenizer(str(TARGET))
    return tuple(len(tok.encode_prompt(p.prompt, p.messages_as_dicts())) for p in prompts)


def test_engine_kind_names_a_declared_engine_and_whether_it_talks_to_servers():
    assert engine_kind(setup_for("vllm")) == ("vllm", True)
    assert engine_kind(setup_for("hf", server=False)) == ("hf", False)
    assert engine_kind(setup_for("plugin")) == ("my_plugin.py:make", False)  # declares nothing: in process
    # a server engine named on the command line by its file: the name it declares
    by_file = dataclasses.replace(setup_for("sglang"), engine_spec="engines/my_sglang.py:make")
    assert engine_kind(by_file) == ("sglang", True)


def test_prompt_tokens_are_the_tokenizer_s_and_llamacpp_s_an_upper_bound_in_characters():
    setup = setup_for("vllm")
    assert arm_plan._prompt_tokens(setup, "vllm", PROMPTS + CALIBRATION) == tokens(PROMPTS + CALIBRATION)
    both = [Prompt("p", "math", "en", prompt="abcd"), Prompt("m", "chat", "en", messages=(("system", "ab"),
                                                                                         ("user", "cde")))]
    assert arm_plan._prompt_tokens(setup, "llamacpp", both) == (4, 5)
    nowhere = setup_for("vllm", target="/nonexistent/t")
    with pytest.raises(ValueError) as exc:
        arm_plan._prompt_tokens(nowhere, "vllm", PROMPTS)
    assert str(exc.value) == ("--engine-opt tokenizer: the vllm engine sends token ids, so it needs a local Hugging "
                              "Face tokenizer directory (--target '/nonexistent/t' is not a local directory); pass "
                              "--engine-opt tokenizer=DIR")


def test_the_output_limit_is_the_run_s_else_the_prompt_s_else_the_default():
    from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS

    assert arm_plan._max_new(setup_for("vllm"), PROMPTS + CALIBRATION) == (5, DEFAULT_MAX_NEW_TOKENS, 40)
    capped = setup_for("vllm", config=GateConfig(max_new_tokens=7))
    assert arm_plan._max_new(capped, PROMPTS + CALIBRATION) == (7, 7, 7)


def test_an_in_process_engine_is_refused_every_arm_but_default_in_one_line():
    setup = setup_for("plugin")
    with pytest.raises(BadInput) as exc:
        plan_arms(setup, [ARMS["default"], ARMS["preempt"], ARMS["long"]])
    assert str(exc.value) == ("--arms preempt,long: engine 'my_plugin.py:make' runs in process; these arms change a "
                              f"GPU server's launch (--engine {', '.join(SERVER_ENGINES)}) — only 'default' runs here")


def test_an_in_process_engine_plans_default_as_it_is_and_its_own_checks_are_not_run(tmp_path):
    check = Checks(refuse="not for an in-process engine")
    setup = setup_for("hf", server=False, check=check, report_dir=str(tmp_path))
    (plan,) = plan_arms(setup, [ARMS["default"]])
    assert plan.arm is ARMS["default"] and plan.launch == ArmLaunch() and plan.launch_text == "nothing"
    out = str(tmp_path / "default")
    assert plan.setup == dataclasses.replace(setup, engine_options=dataclasses.replace(setup.engine_options,
                                                                                        log_dir=out),
                                             config=dataclasses.replace(setup.config, report_dir=out))
    assert check.seen == []


def test_an_arm_that_changes_the_launch_of_running_servers_is_refused_naming_the_first_one():
    setup = setup_for("vllm", urls=True)
    with pytest.raises(BadInput) as exc:
        plan_arms(setup, [ARMS["default"], ARMS["prefix-warm"], ARMS["preempt"], ARMS["fp8-kv"]])
    assert str(exc.value) == (f"--arms preempt: it changes the servers' launch ({arm_changes('vllm', 'preempt')}), "
                              "which the gate cannot do to servers at --baseline-url/--spec-url; use --preset, or "
                              "launch them so yourself and pass --prelaunched")
    # an engine the arm says nothing about
    with pytest.raises(BadInput) as exc:
        plan_arms(setup_for("llamacpp", urls=True), [ARMS["deterministic"]])
    assert str(exc.value) == ("--arms deterministic: it changes the servers' launch (n/a), which the gate cannot do to "
                              "servers at --baseline-url/--spec-url; use --preset, or launch them so yourself and pass "
                              "--prelaunched")


def test_an_arm_a_server_engine_cannot_run_is_refused_naming_why_and_what_it_runs():
    with pytest.raises(BadInput) as exc:
        plan_arms(setup_for("llamacpp", target=None), [ARMS["default"], ARMS["fp8-kv"]])
    assert str(exc.value) == (f"--arms fp8-kv: engine 'llamacpp' cannot run it: {unsupported_reason('llamacpp', 'fp8-kv')}"
                              " (it supports: default, long)")
    with pytest.raises(BadInput) as exc:  # a server engine no arm knows
        plan_arms(setup_for("tgi"), [ARMS["default"]])
    assert str(exc.value) == ("--arms default: engine 'tgi' cannot run it: it declares no arm knobs (its EngineInfo "
                              "has no ServerDescriptor) (it supports: )")


def test_server_arms_are_planned_with_their_launch_sized_from_every_prompt_sent(tmp_path):
    check = Checks()
    setup = setup_for("vllm", check=check, report_dir=str(tmp_path))
    arms = [ARMS["default"], ARMS["preempt"], ARMS["prefix-warm"], ARMS["fp8-kv"]]
    plans = plan_arms(setup, arms)
    sent = PROMPTS + CALIBRATION  # the calibration is the longest request: it sizes the preempt arm
    sizing = ArmSizing(tokens(sent), (5, 48, 40), 3)
    assert [p.arm for p in plans] == arms
    for plan in plans:
        launch = arm_launch("vllm", plan.arm.name, sizing, setup.engine_options)
        out = str(tmp_path / plan.arm.name)
        assert plan.launch == launch and plan.launch_text == launch.describe(), plan.arm.name
        assert plan.setup == dataclasses.replace(
            setup, engine_options=dataclasses.replace(launch.apply(setup.engine_options), log_dir=out),
            config=dataclasses.replace(setup.config, report_dir=out, concurrency=launch.concurrency or 2)), plan.arm.name
    assert plans[1].setup.config.concurrency == 3 and plans[0].setup.config.concurrency == 2
    assert plans[1].launch.flags[:2] == ("--num-gpu-blocks-override",
                                         str(math.ceil((max(t + n for t, n in zip(sizing.prompt_tokens,
                                                                                   sizing.max_new_tokens)) + 32) / 16)))
    assert check.seen == [p.setup.engine_options for p in plans]


def test_without_a_report_directory_each_arm_journals_under_reports_arms():
    (plan,) = plan_arms(setup_for("vllm"), [ARMS["default"]])
    assert plan.setup.config.report_dir == str(Path("reports/arms") / "default")
    assert plan.setup.engine_options.log_dir == str(Path("reports/arms") / "default")


def test_prelaunched_servers_keep_their_options_and_the_plan_says_what_the_arm_expects(tmp_path):
    check = Checks(refuse="not for running servers")
    setup = setup_for("sglang", urls=True, check=check, report_dir=str(tmp_path))
    plans = plan_arms(setup, [ARMS["default"], ARMS["deterministic"]], prelaunched=True)
    assert [p.launch_text for p in plans] == [
        "nothing", "servers at the URLs, as launched (the arm expects: --engine-opt deterministic=True)"]
    for plan in plans:
        out = str(tmp_path / plan.arm.name)
        assert plan.setup.engine_options == dataclasses.replace(setup.engine_options, log_dir=out)
    assert plans[1].launch == ArmLaunch(engine_opts={"deterministic": True})
    assert check.seen == []  # the gate launches nothing: the engine's launch checks do not apply


def test_running_servers_take_the_arms_without_a_launch_change(tmp_path):
    plans = plan_arms(setup_for("vllm", urls=True, report_dir=str(tmp_path)), [ARMS["default"], ARMS["prefix-warm"]])
    launch = arm_launch("vllm", "prefix-warm", ArmSizing((1, 1), (1, 1), 3), EngineOptions())
    assert [p.launch_text for p in plans][1] == f"servers at the URLs, as launched (the arm expects: {launch.describe()})"


def test_a_launch_the_engine_refuses_is_one_line_naming_the_arm():
    with pytest.raises(BadInput) as exc:
        plan_arms(setup_for("vllm", check=Checks(refuse="--preset vllm-ngram: no vllm on PATH")), [ARMS["default"]])
    assert str(exc.value) == "--arms default: --preset vllm-ngram: no vllm on PATH"
    plans = plan_arms(setup_for("vllm", check=None), [ARMS["default"]])  # an engine without checks of its own
    assert len(plans) == 1


def test_an_arm_the_launch_sizing_refuses_is_named_once():
    with pytest.raises(BadInput) as exc:
        plan_arms(setup_for("vllm", extra={"max_concurrency": 1}), [ARMS["default"], ARMS["preempt"]])
    assert str(exc.value) == ("--arms preempt: 1 request in flight cannot preempt another; raise --engine-opt "
                              "max_concurrency (at least 2)")


def test_an_arm_the_installed_engine_cannot_launch_is_refused_as_the_check_words_it(monkeypatch, tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "arg_utils.py").write_text("kv_cache_dtype = 'auto'\n")
    monkeypatch.setattr(arm_knobs, "installed_package_dir", lambda name: pkg if name == "vllm" else None)
    with pytest.raises(BadInput) as exc:
        plan_arms(setup_for("vllm"), [ARMS["default"]])
    where = f"{pkg / 'engine/arg_utils.py'}, {pkg / 'entrypoints/openai/cli_args.py'}"
    assert str(exc.value) == (f"--arms default: the installed vllm ({where}) has no --enable-prompt-tokens-details "
                              "(enable_prompt_tokens_details), which this arm launches with; upgrade it or drop the arm")


def test_a_prompt_the_tokenizer_cannot_count_is_refused_naming_the_arm():
    with pytest.raises(BadInput) as exc:
        plan_arms(setup_for("vllm", target="/nonexistent/t"), [ARMS["default"]])
    assert str(exc.value) == ("--arms default: --engine-opt tokenizer: the vllm engine sends token ids, so it needs a "
                              "local Hugging Face tokenizer directory (--target '/nonexistent/t' is not a local "
                              "directory); pass --engine-opt tokenizer=DIR")


# --------------------------------------------------------------------------- the long arm's prompts


def _asked(prompt: Prompt) -> int:
    """The size a generated long prompt was asked for (its tag ``tokens~N``)."""
    return int(next(t for t in prompt.tags if t.startswith("tokens~")).split("~")[1])


def test_a_long_prompt_that_fits_at_once_is_kept_including_both_ends_of_the_window():
    for extra in (0, LONG_FIT_TOKENS):  # exactly the size, and the most it may exceed it by
        seen = []

        def count(p, extra=extra):
            seen.append(_asked(p))
            return _asked(p) + extra

        got = sized_long_prompt(1000, 3, count)
        assert got == long_context_prompt(1000, seed=3) and seen == [1000], extra


def test_a_long_prompt_is_rescaled_by_what_was_measured_until_it_fits():
    seen = []

    def count(p):  # the target's tokenizer counts twice the generator's estimate
        seen.append(_asked(p))
        return 2 * _asked(p)

    got = sized_long_prompt(1000, 1, count)
    assert seen == [1000, round(1000 * 1032 / 2000)] == [1000, 516]
    assert got == long_context_prompt(516, seed=1)
    first = []

    def once_short(p):  # one measure far below the size (1 token), then the size itself
        first.append(_asked(p))
        return 1 if len(first) == 1 else 20

    assert _asked(sized_long_prompt(20, 0, once_short)) == 20 * 52 == 1040


def test_a_long_prompt_that_never_fits_stops_after_four_measures_and_never_asks_below_16():
    seen = []

    def count(p):
        seen.append(_asked(p))
        return 10**9  # always far too long

    got = sized_long_prompt(1000, 0, count)
    assert len(seen) == 4 and seen[1:] == [16, 16, 16]
    assert got == long_context_prompt(16, seed=0)


def test_llamacpp_long_prompts_are_the_generator_s_at_the_arm_s_size(tmp_path):
    (plan,) = plan_arms(setup_for("llamacpp", target=None, report_dir=str(tmp_path)), [ARMS["long"]])
    want = [dataclasses.replace(long_context_prompt(LONG_MIN_TOKENS, seed=s), id=f"longctx-en-{LONG_MIN_TOKENS}-s{s}")
            for s in range(arm_plan.LONG_PROMPTS)]
    assert plan.setup.prompts == want and len(want) == 2
    assert plan.setup.calibration is None  # the long arm measures its noise on its own prompts
    chars = max(len(p.prompt) for p in want)
    assert plan.launch == ArmLaunch(("--ctx-size", str(chars + 48 + arm_knobs.LONG_SLACK_TOKENS)))


def test_long_prompts_are_sized_with_the_target_s_tokenizer(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(TARGET, target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 33280}))
    (plan,) = plan_arms(setup_for("vllm", target=str(target), report_dir=str(tmp_path / "r")), [ARMS["long"]])
    prompts = plan.setup.prompts
    assert [p.id for p in prompts] == [f"longctx-en-{LONG_MIN_TOKENS}-s0", f"longctx-en-{LONG_MIN_TOKENS}-s1"]
    assert [p.source.endswith(f"seed={s}>") for s, p in enumerate(prompts)] == [True, True]
    sizes = tokens(prompts)
    assert all(LONG_MIN_TOKENS <= n <= LONG_MIN_TOKENS + LONG_FIT_TOKENS for n in sizes), sizes
    assert plan.setup.calibration is None
    with pytest.raises(BadInput) as exc:  # a target whose positions cannot be read
        plan_arms(setup_for("vllm", target=str(tmp_path / "r")), [ARMS["long"]])
    assert str(exc.value) == (f"--arms long: cannot read max_position_embeddings from --target "
                              f"{str(tmp_path / 'r')!r}/config.json; the long arm needs a target of at least "
                              f"{LONG_MIN_TOKENS} positions")


# --------------------------------------------------------------------------- the engine an arm runs


def _requests(*rids: str) -> list[GenerationRequest]:
    return [GenerationRequest(rid, [1, 2, 3], 12) for rid in rids]


def test_the_judged_phase_starts_at_the_first_speculative_request_resetting_once():
    a = Endpoint("http://s1", reset="ok", metrics_text=metrics("sglang", 4))
    b = Endpoint("http://s2", reset="ok", metrics_text=metrics("sglang", 3))
    inner = Engine("sglang", spec=[a, b])
    engine = ArmEngine(inner)
    assert engine.name == "sglang" and engine.warm is False and engine.warm_results == {}
    engine.generate(_requests("p1"), speculative=False)  # baseline requests: nothing reset
    assert engine.judged_phase is None and a.calls == []
    engine.generate(_requests("p1", "p2"), speculative=True)
    phase = engine.judged_phase
    assert phase == JudgedPhase([("http://s1", True, "ok"), ("http://s2", True, "ok")], 7)
    assert a.calls == [("POST", "/flush_cache"), ("GET", "/metrics")]
    engine.generate(_requests("p3"), speculative=True)
    assert engine.judged_phase is phase and a.calls == [("POST", "/flush_cache"), ("GET", "/metrics")]
    assert engine.start_judged_phase() is phase
    assert inner.calls == [([("p1", 12)], False), ([("p1", 12), ("p2", 12)], True), ([("p3", 12)], True)]
    engine.close()
    assert inner.closed == 1


def test_a_reset_that_raises_is_recorded_as_not_done():
    inner = Engine("vllm", spec=[Endpoint("http://s1", reset=RuntimeError("connection pool closed"),
                                          metrics_text=metrics("vllm", 2))])
    phase = ArmEngine(inner).start_judged_phase()
    assert phase == JudgedPhase([("", False, "RuntimeError: connection pool closed")], None)


def test_prefix_warm_sends_each_prompt_once_with_one_output_token_before_the_judged_request():
    inner = Engine("vllm", spec=[Endpoint("http://s1", reset='{"success": true}', metrics_text=metrics("vllm", 0))],
                   answers={"p2/warm": answer("p2/warm", error="HTTP 500")})
    engine = ArmEngine(inner, warm=True)
    engine.generate(_requests("p1"), speculative=False)
    got = engine.generate(_requests("p1", "p2"), speculative=True)
    assert [g.request_id for g in got] == ["p1", "p2"]
    assert inner.calls == [([("p1", 12)], False), ([("p1/warm", 1)], True), ([("p2/warm", 1)], True),
                           ([("p1", 12), ("p2", 12)], True)]
    assert {rid: g.request_id for rid, g in engine.warm_results.items()} == {"p1": "p1/warm", "p2": "p2/warm"}
    assert engine.warm_errors == {"p2": "HTTP 500"}
    assert engine.judged_phase == JudgedPhase([("http://s1", True, '{"success": true}')], 0)


# --------------------------------------------------------------------------- small readers


def test_only_answered_speculative_requests_are_judged():
    ok = record("ok")
    run = SimpleNamespace(records=[record("no-spec", spec=False), record("no-request", request=False), ok,
                                   record("failed", error="HTTP 500")])
    assert arm_evidence._judged(run) == [ok]


def test_an_engine_s_name_and_whether_it_has_servers():
    assert arm_evidence._name(Engine("vllm")) == "vllm"
    assert arm_evidence._name(Engine(None)) == ""
    assert arm_evidence._name(SimpleNamespace(name=None)) == ""
    assert arm_evidence._server(Engine("vllm")) is True
    assert arm_evidence._server(InProcess()) is False
    assert arm_evidence._server(SimpleNamespace(every_server="not callable")) is False


def test_the_common_prefix_of_two_sequences():
    common = arm_evidence._common
    assert [common([1, 2, 3], [1, 2, 4]), common([1, 2], [1, 2, 3]), common([5], [6]), common([], [1]),
            common([7, 8, 9], [7, 8, 9])] == [2, 2, 0, 0, 3]


def test_the_shared_prefix_is_with_the_nearest_other_request_on_either_side():
    judged = [record("a", [1, 2, 3, 4, 5]), record("b", [1, 2, 3, 9], output=[4, 5, 6]), record("c", [1, 2, 7]),
              record("d", [8, 8]), record("e", [1, 2, 3, 4, 5])]
    assert arm_evidence._shared(judged) == {"a": 5, "b": 3, "c": 2, "d": 0, "e": 5}
    assert arm_evidence._shared([record("alone", [1, 2])]) == {"alone": 0}
    # the nearest on the right, not the first in sorted order
    assert arm_evidence._shared([record("a", [1]), record("b", [5, 5]), record("c", [5, 6])]) == {"a": 0, "b": 1, "c": 1}
    # a prompt is never compared with its own answer
    assert arm_evidence._shared([record("x", [1, 2], output=[3]), record("y", [1, 2, 3, 4])]) == {"x": 2, "y": 3}


def test_why_a_request_reads_no_prefix_cache():
    assert arm_evidence._cache_off(InProcess()) == "the engine runs in process: no prefix cache"
    assert arm_evidence._cache_off(Engine("llamacpp")) == "llamacpp: every request sends cache_prompt: false"
    assert arm_evidence._cache_off(Engine("vllm")) is None


def test_the_reset_line_names_each_server_or_what_failed():
    assert arm_evidence._reset_line(None) == []
    assert arm_evidence._reset_line(JudgedPhase()) == []
    assert arm_evidence._reset_line(JudgedPhase([("http://a", True, "ok"), ("http://b", True, "ok")], 0)) == [
        "prefix cache reset on the speculative server(s) before the judged requests (http://a, http://b)"]
    long_said = "x" * 150 + "0123456789ABCDEF"
    assert arm_evidence._reset_line(JudgedPhase([("http://a", True, "ok"), ("http://b", False, long_said),
                                             ("", False, "RuntimeError: boom")])) == [
        "prefix cache NOT reset before the judged requests: http://b: " + "x" * 150 + "0123456789; ?: RuntimeError: boom"]


def test_the_line_on_answers_without_cached_tokens_says_what_the_engine_needs():
    assert arm_evidence._unknown_line(Engine("vllm"), 2) == ("2 judged answer(s) carried no cached-token count (vLLM "
                                                         "answers it only with --enable-prompt-tokens-details)")
    assert arm_evidence._unknown_line(Engine("sglang"), 1) == "1 judged answer(s) carried no cached-token count"


# --------------------------------------------------------------------------- cold


def test_an_engine_without_a_prefix_cache_is_cold_by_construction():
    judged = [record("a", facts={"cached_tokens": 5})]
    assert cold_check(InProcess(), judged) == Check(
        True, ["cold by construction (the engine runs in process: no prefix cache)"], {"cached_tokens": None})
    assert cold_check(Engine("llamacpp"), judged) == Check(
        True, ["cold by construction (llamacpp: every request sends cache_prompt: false)"], {"cached_tokens": None})


def test_cold_is_not_shown_without_answers_or_without_their_cached_tokens():
    assert cold_check(Engine("vllm"), []) == Check(False, ["no speculative request was answered"], {"cached_tokens": {}})
    judged = [record("a", facts={"cached_tokens": 0}), record("b"), record("c")]
    assert cold_check(Engine("vllm"), judged) == Check(
        False, ["2 judged answer(s) carried no cached-token count (vLLM answers it only with "
                "--enable-prompt-tokens-details)"], {"cached_tokens": {"a": 0, "b": None, "c": None}})


def test_cold_when_nothing_or_only_a_shared_prefix_was_found_cached():
    prompts = {"a": [1, 2, 3, 4, 5, 9], "b": [1, 2, 3, 4, 6], "c": [7, 8]}
    judged = [record(rid, ids, facts={"cached_tokens": 0}) for rid, ids in prompts.items()]
    shared = {"a": 4, "b": 4, "c": 0}
    assert cold_check(Engine("sglang"), judged) == Check(
        True, ["cold: none of the 3 judged request(s) found anything cached"],
        {"cached_tokens": {"a": 0, "b": 0, "c": 0}, "shared_prefix": shared})
    found = {"a": 4, "b": 0, "c": 0}  # a found exactly what it shares with b: still cold
    judged = [record(rid, ids, facts={"cached_tokens": found[rid]}) for rid, ids in prompts.items()]
    assert cold_check(Engine("sglang"), judged) == Check(
        True, ["cold: 2 of 3 judged request(s) found nothing cached, the others only a prefix shared with another "
               "judged prompt (at most 4 tokens)"], {"cached_tokens": found, "shared_prefix": shared})


def test_not_cold_names_the_first_six_requests_that_found_more_than_they_share():
    judged = [record(f"p{i}", [100 + i, 1, 2, 3], facts={"cached_tokens": 16}) for i in range(8)]
    judged.append(record("q", [200, 1], facts={"cached_tokens": 0}))
    check = cold_check(Engine("vllm"), judged)
    assert check.ok is False
    assert check.lines == ["not cold: 8 of 9 judged request(s) found more cached than they share with another judged "
                           "prompt: " + ", ".join(f"p{i} 16 (shares 0)" for i in range(6))]
    assert check.facts == {"cached_tokens": {**{f"p{i}": 16 for i in range(8)}, "q": 0},
                           "shared_prefix": {**{f"p{i}": 0 for i in range(8)}, "q": 0}}


# --------------------------------------------------------------------------- warm


def warm_engine(name="vllm", *, info=None, warm=None, errors=None):
    """A speculative server of ``name`` whose warm-ups answered (``warm``: the prompts that had one, default
    all of them; ``errors``: the warm-ups that failed)."""
    engine = Engine(name, spec=[Endpoint("http://s", info=info)])
    if warm is not None:
        errs = errors or {}
        engine.warm_results = {rid: answer(rid + "/warm", error=errs.get(rid)) for rid in warm}
    return engine


def warm_run(judged, method=None):
    records = list(judged)
    fingerprint = None if method is None else SimpleNamespace(spec_config={"method": method})
    return SimpleNamespace(records=records, fingerprint=fingerprint)


def test_warm_when_each_prompt_long_enough_found_its_whole_prompt_cached():
    # 40 tokens in blocks of 16: all but the last token, whole blocks, is 32
    judged = [record("a", [1] * 40, facts={"cached_tokens": 32, "prompt_tokens": 40}),
              record("b", [2] * 17, facts={"cached_tokens": 16}),  # no server count: its prompt's length
              record("tiny", [3] * 16, facts={"cached_tokens": 0, "prompt_tokens": 16})]
    engine = warm_engine(info=vllm_info(block=16), warm=["a", "b", "tiny"])
    check = warm_check(plan_of("prefix-warm"), engine, judged, warm_run(judged))
    assert check == Check(True, [
        "cached prompt tokens per judged speculative request (cache unit 16 tokens, /server_info "
        "cache_config.block_size): a 32/32, b 16/16, tiny 0/0",
        "1 prompt(s) shorter than one cache unit (16 tokens) plus the recomputed last token (17 tokens), which "
        "nothing can be cached for, are not counted: tiny",
        "warm: each of the 2 judged request(s) long enough found its whole prompt cached"],
        {"cached_tokens": {"a": 32, "b": 16, "tiny": 0}, "needed": {"a": 32, "b": 16, "tiny": 0}, "cache_unit": 16,
         "cache_unit_source": "/server_info cache_config.block_size", "warm_up_errors": {}})


def test_the_server_s_own_prompt_count_decides_what_a_whole_prompt_is():
    judged = [record("a", [1] * 20, facts={"cached_tokens": 32, "prompt_tokens": 40})]
    check = warm_check(plan_of("prefix-warm"), warm_engine(warm=["a"]), judged, warm_run(judged))
    assert check.ok is True and check.facts["needed"] == {"a": 32}
    assert check.lines[0] == ("cached prompt tokens per judged speculative request (cache unit 16 tokens, vllm's "
                              "default): a 32/32")


def test_the_cache_unit_is_the_server_s_and_the_engine_s_name_comes_before_the_command_line_s():
    # an SGLang engine run as a plugin: its own name says which server it is (page size from /server_info)
    judged = [record("a", [1] * 20, facts={"cached_tokens": 16})]
    engine = warm_engine("sglang", info={"page_size": 8}, warm=["a"])
    check = warm_check(plan_of("prefix-warm", engine_spec="my_plugin.py:make"), engine, judged, warm_run(judged))
    assert check.facts["cache_unit"] == 8 and check.facts["cache_unit_source"] == "/server_info page_size"
    assert check.facts["needed"] == {"a": 16} and check.ok is True
    # an engine that gives no name: the command line's
    nameless = Engine(None, spec=[Endpoint("http://s")])
    nameless.warm_results = {"a": answer("a/warm")}
    check = warm_check(plan_of("prefix-warm", engine_spec="vllm"), nameless, judged, warm_run(judged))
    assert (check.facts["cache_unit"], check.facts["cache_unit_source"]) == (16, "vllm's default")
    # a server unit larger than the engine's default
    judged = [record("a", [1] * 70, facts={"cached_tokens": 64})]
    check = warm_check(plan_of("prefix-warm"), warm_engine(info=vllm_info(block=32), warm=["a"]), judged,
                       warm_run(judged))
    assert check.facts["needed"] == {"a": 64} and check.ok is True
    judged = [record("b", [1] * 30, facts={"cached_tokens": 0})]
    check = warm_check(plan_of("prefix-warm"), warm_engine(info=vllm_info(block=32), warm=["b"]), judged,
                       warm_run(judged))
    assert check.lines[1] == ("1 prompt(s) shorter than one cache unit (32 tokens) plus the recomputed last token (33 "
                              "tokens), which nothing can be cached for, are not counted: b")


def test_a_hidden_state_draft_needs_one_block_less_read_from_the_run_s_fingerprint():
    judged = [record("two", [1] * 32, facts={"cached_tokens": 0}), record("three", [2] * 49, facts={"cached_tokens": 32})]
    engine = warm_engine(warm=["two", "three"])
    check = warm_check(plan_of("prefix-warm"), engine, judged, warm_run(judged, method="eagle3"))
    assert check.ok is True and check.facts["needed"] == {"two": 0, "three": 32}
    assert check.lines[1] == ("1 prompt(s) shorter than two cache units (16 tokens each: vLLM drops a hit's last block "
                              "for eagle3, whose draft needs its hidden states) plus the recomputed last token (33 "
                              "tokens), which nothing can be cached for, are not counted: two")
    plain = warm_check(plan_of("prefix-warm"), engine, judged, warm_run(judged, method="ngram"))
    assert plain.ok is False and plain.facts["needed"] == {"two": 16, "three": 48}
    # a run without a fingerprint: no method known
    bare = SimpleNamespace(records=judged)
    assert warm_check(plan_of("prefix-warm"), engine, judged, bare).facts["needed"] == {"two": 16, "three": 48}


def test_a_prompt_of_two_tokens_counts_where_one_token_can_be_cached():
    judged = [record("a", [1, 2], facts={"cached_tokens": 1})]
    check = warm_check(plan_of("prefix-warm"), warm_engine("sglang", warm=["a"]), judged, warm_run(judged))
    assert check.ok is True and check.facts["needed"] == {"a": 1} and len(check.lines) == 2


def test_nothing_to_prove_without_judged_requests_or_without_a_prompt_long_enough():
    check = warm_check(plan_of("prefix-warm"), warm_engine(warm=[]), [], warm_run([]))
    assert check == Check(False, ["cached prompt tokens per judged speculative request (cache unit 16 tokens, vllm's "
                                  "default): none", "no speculative request was judged"],
                          {"cached_tokens": {}, "needed": {}, "cache_unit": 16, "cache_unit_source": "vllm's default",
                           "warm_up_errors": {}})
    judged = [record(f"s{i}", [i] * 10, facts={"cached_tokens": 0}) for i in range(9)]
    check = warm_check(plan_of("prefix-warm"), warm_engine(warm=[]), judged, warm_run(judged))
    assert check.ok is False and check.lines[1:] == [
        "9 prompt(s) shorter than one cache unit (16 tokens) plus the recomputed last token (17 tokens), which "
        "nothing can be cached for, are not counted: " + ", ".join(f"s{i}" for i in range(8)),
        "no judged prompt is long enough to be cached"]


def _long(rid: str, cached) -> PromptRecord:
    return record(rid, [7] * 40, facts={"cached_tokens": cached})


def test_each_way_a_prompt_is_not_warm_fails_the_proof_on_its_own():
    ok = _long("ok", 32)
    cases = {
        "failed": ([ok, _long("f", 32)], dict(warm=["ok", "f"], errors={"f": "HTTP 500"}),
                   "warm-up failed for 1 prompt(s), which are not warm: f: HTTP 500"),
        "missing": ([ok, _long("m", 32)], dict(warm=["ok"]), "1 prompt(s) were sent no warm-up: m"),
        "unknown": ([ok, _long("u", None)], dict(warm=["ok", "u"]),
                    "1 judged answer(s) carried no cached-token count (vLLM answers it only with "
                    "--enable-prompt-tokens-details)"),
        "cold": ([ok, _long("c", 31)], dict(warm=["ok", "c"]),
                 "1 judged request(s) found less than their whole prompt cached: c 31 of 32"),
    }
    for what, (judged, kw, line) in cases.items():
        check = warm_check(plan_of("prefix-warm"), warm_engine(**kw), judged, warm_run(judged))
        assert check.ok is False and check.lines[1:] == [line], (what, check.lines)


def test_every_way_at_once_each_named_up_to_its_limit():
    judged = [_long("ok", 32)]
    judged += [_long(f"f{i}", 0) for i in range(4)]  # warm-up failed: not warm whatever they found
    judged += [_long(f"m{i}", 0) for i in range(9)]  # no warm-up
    judged += [_long(f"u{i}", None) for i in range(2)]
    judged += [_long(f"c{i}", 16) for i in range(7)]
    judged += [record("short", [1] * 5, facts={"cached_tokens": 0})]
    warmed = ["ok", "short"] + [f"f{i}" for i in range(4)] + [f"u{i}" for i in range(2)] + [f"c{i}" for i in range(7)]
    engine = warm_engine(warm=warmed, errors={f"f{i}": f"HTTP 50{i}" for i in range(4)})
    check = warm_check(plan_of("prefix-warm"), engine, judged, warm_run(judged))
    assert check.ok is False
    assert check.lines[1:] == [
        "1 prompt(s) shorter than one cache unit (16 tokens) plus the recomputed last token (17 tokens), which nothing "
        "can be cached for, are not counted: short",
        "warm-up failed for 4 prompt(s), which are not warm: f0: HTTP 500; f1: HTTP 501; f2: HTTP 502",
        "9 prompt(s) were sent no warm-up: " + ", ".join(f"m{i}" for i in range(8)),
        "2 judged answer(s) carried no cached-token count (vLLM answers it only with --enable-prompt-tokens-details)",
        "7 judged request(s) found less than their whole prompt cached: " + ", ".join(f"c{i} 16 of 32" for i in range(6)),
    ]
    assert check.lines[0].startswith("cached prompt tokens per judged speculative request (cache unit 16 tokens, "
                                     "vllm's default): ok 32/32, f0 0/32, ")
    assert "u0 unknown/32, u1 unknown/32, c0 16/32" in check.lines[0] and check.lines[0].endswith("short 0/0")
    assert check.facts["warm_up_errors"] == {f"f{i}": f"HTTP 50{i}" for i in range(4)}


def test_an_engine_that_sent_no_warm_up_at_all_is_not_warm():
    judged = [_long("a", 32)]
    engine = Engine("vllm", spec=[Endpoint("http://s")])  # no warm_results: not an arm engine
    check = warm_check(plan_of("prefix-warm"), engine, judged, warm_run(judged))
    assert check.ok is False and check.lines[1:] == ["1 prompt(s) were sent no warm-up: a"]


# --------------------------------------------------------------------------- preemption


def test_engines_that_never_preempt_say_why():
    for engine, how in ((InProcess(), "the engine runs in process: nothing is preempted"),
                        (Engine("llamacpp"), "llamacpp: llama-server's slots each own their context")):
        assert preempt_check(engine, [], None, want=False) == Check(True, [f"not preempted: {how}"], {"preemptions": 0})
        assert preempt_check(engine, [], None, want=True) == Check(
            False, [f"preemptions of the judged requests: 0, {how}"], {"preemptions": 0})


def test_preemptions_are_the_answers_own_where_every_answer_carries_them():
    per = {"a": 0, "b": 2, "c": 1}
    judged = [record(rid, facts={"preemptions": n}) for rid, n in per.items()]
    engine = Engine("sglang", spec=[Endpoint("http://s", metrics_text=metrics("sglang", 50))])
    phase = JudgedPhase([], 10)
    facts = {"preemptions": 3, "preemptions_per_request": per}
    assert preempt_check(engine, judged, phase, want=True) == Check(
        True, ["preemptions of the judged requests: 3, per judged request (b 2, c 1)"], facts)
    assert preempt_check(engine, judged, phase, want=False) == Check(
        False, ["preempted: 3 preemption(s) of the judged requests, per judged request (b 2, c 1)"], facts)
    none = [record(rid, facts={"preemptions": 0}) for rid in per]
    assert preempt_check(engine, none, phase, want=False) == Check(
        True, ["not preempted: per judged request (none)"], {"preemptions": 0, "preemptions_per_request":
                                                             dict.fromkeys(per, 0)})
    assert preempt_check(engine, none, phase, want=True).ok is False


def test_one_preemption_is_enough_for_the_preempt_arm_and_too_many_for_the_others():
    judged = [record("a", facts={"preemptions": 1}), record("b", facts={"preemptions": 0})]
    engine = Engine("sglang")
    assert preempt_check(engine, judged, None, want=True).ok is True
    assert preempt_check(engine, judged, None, want=False) == Check(
        False, ["preempted: 1 preemption(s) of the judged requests, per judged request (a 1)"],
        {"preemptions": 1, "preemptions_per_request": {"a": 1, "b": 0}})


def test_without_per_answer_counts_the_counter_is_read_over_the_judged_phase():
    judged = [record("a", facts={"preemptions": 1}), record("b")]  # one answer lacks its count
    engine = Engine("vllm", spec=[Endpoint("http://s", metrics_text=metrics("vllm", 8))])
    how = "on the speculative servers during the judged requests (counter delta)"
    assert preempt_check(engine, judged, JudgedPhase([], 5), want=True) == Check(
        True, [f"preemptions of the judged requests: 3, {how}"], {"preemptions": 3})
    assert preempt_check(engine, judged, JudgedPhase([], 8), want=False) == Check(
        True, [f"not preempted: {how}"], {"preemptions": 0})
    assert preempt_check(engine, [], JudgedPhase([], 8), want=False) == Check(  # no answer at all: the counter
        True, [f"not preempted: {how}"], {"preemptions": 0})


def test_a_counter_not_read_at_either_end_is_unknown_not_zero():
    unknown = "no preemption counter read from the speculative servers (vllm: unknown)"
    judged = [record("a")]
    read = Engine("vllm", spec=[Endpoint("http://s", metrics_text=metrics("vllm", 8))])
    unreadable = Engine("vllm", spec=[Endpoint("http://s", metrics_text=None)])
    for engine, phase in ((read, None), (read, JudgedPhase([], None)), (unreadable, JudgedPhase([], 5))):
        for want in (True, False):
            assert preempt_check(engine, judged, phase, want=want) == Check(False, [unknown], {"preemptions": None})
    # without a reading at the start there is no delta: the counter is not read at the end either
    assert read.spec.fleet.endpoints[0].calls == []
    nameless = Engine(None, spec=[Endpoint("http://s")])
    assert preempt_check(nameless, judged, None, want=False).lines == [
        "no preemption counter read from the speculative servers (?: unknown)"]


# --------------------------------------------------------------------------- the launch-level conditions


def test_default_is_free_of_the_launch_level_arms_where_the_run_shows_them():
    engine = Engine("vllm", baseline=[Endpoint("http://b1", info=vllm_info("fp8")), Endpoint("http://b2", info={})],
                    spec=[Endpoint("http://s1", info=vllm_info("fp8_e5m2")), Endpoint("http://s2", info=None),
                          Endpoint("http://s3", info=vllm_info("auto"))])
    judged = [record("long-1", [1] * LONG_MIN_TOKENS), record("short", [1] * (LONG_MIN_TOKENS - 1))]
    run = SimpleNamespace(deterministic="both launches set VLLM_BATCH_INVARIANT=1")
    dtypes = [("baseline", "http://b1", "fp8"), ("baseline", "http://b2", None), ("spec", "http://s1", "fp8_e5m2"),
              ("spec", "http://s2", None), ("spec", "http://s3", "auto")]
    assert arm_evidence._launch_conditions(engine, judged, run) == Check(False, [
        "determinism declared (both launches set VLLM_BATCH_INVARIANT=1): the deterministic arm's condition",
        "an fp8 KV cache on baseline http://b1, spec http://s1: the fp8-kv arm's condition",
        f"1 prompt(s) of {LONG_MIN_TOKENS}+ tokens: the long arm's condition",
        "KV cache dtype unknown on baseline http://b2, spec http://s2"], {"kv_cache_dtype": dtypes})
    clean = Engine("vllm", spec=[Endpoint("http://s1", info=vllm_info("auto"))])
    assert arm_evidence._launch_conditions(clean, judged[1:], SimpleNamespace(deterministic=None)) == Check(
        True, [], {"kv_cache_dtype": [("spec", "http://s1", "auto")]})


def test_an_in_process_engine_shows_no_kv_cache_dtype():
    nameless = SimpleNamespace()  # no servers and no name
    assert arm_evidence._launch_conditions(nameless, [record("a")], SimpleNamespace()) == Check(True, [], {})
    assert arm_evidence._launch_conditions(InProcess(), [record("a")], SimpleNamespace(deterministic="")) == Check(True, [], {})


def test_combined_proofs_end_with_the_reset_line_and_record_the_reset():
    a = Check(True, ["one"], {"x": 1})
    b = Check(False, ["two", "three"], {"y": 2, "x": 3})
    assert arm_evidence._combine(None, a, b) == Evidence(False, ["one", "two", "three"], {"x": 3, "y": 2})
    assert arm_evidence._combine(JudgedPhase(), a) == Evidence(True, ["one"], {"x": 1})
    phase = JudgedPhase([("http://s", True, "ok")], 0)
    assert arm_evidence._combine(phase, a, a) == Evidence(
        True, ["one", "one", "prefix cache reset on the speculative server(s) before the judged requests (http://s)"],
        {"prefix_cache_reset": [("http://s", True, "ok")], "x": 1})


# --------------------------------------------------------------------------- each arm's proof


RESET = "prefix cache reset on the speculative server(s) before the judged requests (http://s)"


def sglang_run(cached=(0, 0), preempted=(0, 0), **run):
    """An SGLang arm's engine (its judged phase reset on http://s) and run of two judged prompts."""
    judged = [record(f"p{i}", [10 * (i + 1)] * 40, facts={"cached_tokens": c, "preemptions": n, "prompt_tokens": 40})
              for i, (c, n) in enumerate(zip(cached, preempted))]
    engine = Engine("sglang", spec=[Endpoint("http://s", info={"kv_cache_dtype": "auto"})],
                    baseline=[Endpoint("http://b", info={"kv_cache_dtype": "auto"})])
    engine.judged_phase = JudgedPhase([("http://s", True, "ok")], 0)
    engine.warm_results = {r.request.request_id: answer(r.request.request_id + "/warm") for r in judged}
    fields = dict(records=judged, fingerprint=None, deterministic=None, deterministic_partial=None)
    fields.update(run)
    return engine, SimpleNamespace(**fields)


COLD_FACTS = {"cached_tokens": {"p0": 0, "p1": 0}, "shared_prefix": {"p0": 0, "p1": 0}}
NOT_PREEMPTED = {"preemptions": 0, "preemptions_per_request": {"p0": 0, "p1": 0}}
COLD = "cold: none of the 2 judged request(s) found anything cached"


def test_the_default_arm_s_proof():
    engine, run = sglang_run()
    assert collect_evidence(plan_of("default"), engine, run) == Evidence(
        True, [COLD, "not preempted: per judged request (none)", RESET],
        {"prefix_cache_reset": [("http://s", True, "ok")], **COLD_FACTS, **NOT_PREEMPTED,
         "kv_cache_dtype": [("baseline", "http://b", "auto"), ("spec", "http://s", "auto")]})
    engine, run = sglang_run(deterministic="/server_info enable_deterministic_inference")
    evidence = collect_evidence(plan_of("default"), engine, run)
    assert evidence.exercised is False and evidence.lines[2] == (
        "determinism declared (/server_info enable_deterministic_inference): the deterministic arm's condition")


def test_the_phase_given_is_the_one_read_else_the_engine_s():
    engine, run = sglang_run()
    other = JudgedPhase([("http://other", False, "busy")], 0)
    evidence = collect_evidence(plan_of("default"), engine, run, other)
    assert evidence.exercised is True  # not reset, but the judged requests found nothing cached: cold all the same
    assert evidence.lines[-1] == "prefix cache NOT reset before the judged requests: http://other: busy"
    assert evidence.facts["prefix_cache_reset"] == [("http://other", False, "busy")]
    assert collect_evidence(plan_of("default"), engine, run).lines[-1] == RESET


def test_the_deterministic_arm_s_proof():
    engine, run = sglang_run(deterministic="/server_info enable_deterministic_inference on 2 servers")
    assert collect_evidence(plan_of("deterministic"), engine, run) == Evidence(
        True, ["deterministic on both sides: /server_info enable_deterministic_inference on 2 servers; judged bit-exact",
               COLD, "not preempted: per judged request (none)", RESET],
        {"prefix_cache_reset": [("http://s", True, "ok")],
         "deterministic": "/server_info enable_deterministic_inference on 2 servers", **COLD_FACTS, **NOT_PREEMPTED})
    engine, run = sglang_run(deterministic_partial="baseline http://b only")
    assert collect_evidence(plan_of("deterministic"), engine, run) == Evidence(
        False, ["determinism not declared on every server of both sides (baseline http://b only)", COLD,
                "not preempted: per judged request (none)", RESET],
        {"prefix_cache_reset": [("http://s", True, "ok")], "deterministic": None, "partial": "baseline http://b only",
         **COLD_FACTS, **NOT_PREEMPTED})
    engine, run = sglang_run()
    assert collect_evidence(plan_of("deterministic"), engine, run).lines[0] == (
        "determinism not declared on every server of both sides (no server declared it)")


def test_the_preempt_arm_s_proof():
    engine, run = sglang_run(preempted=(0, 2))
    assert collect_evidence(plan_of("preempt"), engine, run) == Evidence(
        True, ["preemptions of the judged requests: 2, per judged request (p1 2)", COLD, RESET],
        {"prefix_cache_reset": [("http://s", True, "ok")], "preemptions": 2,
         "preemptions_per_request": {"p0": 0, "p1": 2}, **COLD_FACTS})
    engine, run = sglang_run()
    assert collect_evidence(plan_of("preempt"), engine, run).exercised is False


def test_the_prefix_warm_arm_s_proof():
    engine, run = sglang_run(cached=(39, 39))
    assert collect_evidence(plan_of("prefix-warm", engine_spec="sglang"), engine, run) == Evidence(
        True, ["cached prompt tokens per judged speculative request (cache unit 1 tokens, sglang's default): p0 39/39, "
               "p1 39/39", "warm: each of the 2 judged request(s) long enough found its whole prompt cached",
               "not preempted: per judged request (none)", RESET],
        {"prefix_cache_reset": [("http://s", True, "ok")], "cached_tokens": {"p0": 39, "p1": 39},
         "needed": {"p0": 39, "p1": 39}, "cache_unit": 1, "cache_unit_source": "sglang's default",
         "warm_up_errors": {}, **NOT_PREEMPTED})
    engine, run = sglang_run(cached=(39, 39), preempted=(1, 0))
    assert collect_evidence(plan_of("prefix-warm"), engine, run).exercised is False


def test_the_fp8_kv_arm_s_proof():
    engine, run = sglang_run()
    for e in engine.every_server():
        e[1].info = {"kv_cache_dtype": "fp8_e4m3"}
    dtypes = [("baseline", "http://b", "fp8_e4m3"), ("spec", "http://s", "fp8_e4m3")]
    assert collect_evidence(plan_of("fp8-kv"), engine, run) == Evidence(
        True, ["KV cache dtype as each server says: baseline http://b: fp8_e4m3, spec http://s: fp8_e4m3", COLD,
               "not preempted: per judged request (none)", RESET],
        {"prefix_cache_reset": [("http://s", True, "ok")], "kv_cache_dtype": dtypes, **COLD_FACTS, **NOT_PREEMPTED})
    engine.baseline.fleet.endpoints[0].info = {}
    evidence = collect_evidence(plan_of("fp8-kv"), engine, run)
    assert evidence.exercised is False and evidence.lines[0] == (
        "KV cache dtype as each server says: baseline http://b: unknown, spec http://s: fp8_e4m3")
    engine.baseline.fleet.endpoints[0].info = {"kv_cache_dtype": "auto"}
    assert collect_evidence(plan_of("fp8-kv"), engine, run).exercised is False
    # no server says anything (an engine without KV cache dtypes): not shown
    _engine, run = sglang_run()
    quiet = Engine("llamacpp", spec=[Endpoint("http://s")])
    evidence = collect_evidence(plan_of("fp8-kv"), quiet, run)
    assert evidence.exercised is False and evidence.lines[0] == "KV cache dtype as each server says: "
    assert evidence.facts["kv_cache_dtype"] == []


def test_the_long_arm_s_proof():
    judged = [record("a", [1] * 5, facts={"prompt_tokens": LONG_MIN_TOKENS}),
              record("b", [1] * 5, facts={"prompt_tokens": LONG_MIN_TOKENS + 9})]
    run = SimpleNamespace(records=judged)
    assert collect_evidence(plan_of("long"), InProcess(), run) == Evidence(
        True, [f"prompt tokens per judged prompt (the server's count): a {LONG_MIN_TOKENS}, b {LONG_MIN_TOKENS + 9}",
               "cold by construction (the engine runs in process: no prefix cache)",
               "not preempted: the engine runs in process: nothing is preempted"],
        {"prompt_tokens": {"a": LONG_MIN_TOKENS, "b": LONG_MIN_TOKENS + 9}, "cached_tokens": None, "preemptions": 0})
    judged = [record("a", [1] * 5, facts={"prompt_tokens": LONG_MIN_TOKENS - 1}), record("b", [1] * 7)]
    evidence = collect_evidence(plan_of("long"), InProcess(), SimpleNamespace(records=judged))
    assert evidence.exercised is False
    assert evidence.lines[:2] == [f"prompt tokens per judged prompt (the prompts' encoding): a {LONG_MIN_TOKENS - 1}, "
                                  "b 7", "2 prompt(s) below 32768 tokens"]
    assert evidence.facts["prompt_tokens"] == {"a": LONG_MIN_TOKENS - 1, "b": 7}
    empty = collect_evidence(plan_of("long"), InProcess(), SimpleNamespace(records=[]))
    assert empty.exercised is False and empty.lines[0] == "prompt tokens per judged prompt (the server's count): none"


def test_an_arm_without_a_known_proof_is_not_proven():
    plan = ArmPlan(SimpleNamespace(name="mystery"), None, ArmLaunch())
    assert collect_evidence(plan, InProcess(), SimpleNamespace(records=[])) == Evidence(
        False, ["no proof known for arm mystery"], {})


# --------------------------------------------------------------------------- the fp8 arm's bias line


def scores(*rows) -> TokenScores:
    top = np.array(rows, np.float32)
    return TokenScores(np.zeros(len(rows)), top[:, 0], np.zeros(top.shape), top)


def test_the_bias_line_reads_every_baseline_with_its_teacher_forced_rows():
    decode = scores([-0.1, -1.1], [-0.2, -0.7])  # margins 1.0, 0.5
    forced = scores([-0.3, -0.8], [-0.2, -0.4])  # margins 0.5, 0.2
    good = PromptRecord(Prompt("a", "math", "en", prompt="x"), baseline=dataclasses.replace(answer("a"), scores=decode),
                        baseline_tf=forced)
    calib = PromptRecord(Prompt("c", "math", "en", prompt="x"), baseline=dataclasses.replace(answer("c"), scores=decode),
                         baseline_tf=forced)
    failed = PromptRecord(Prompt("f", "math", "en", prompt="x"),
                          baseline=dataclasses.replace(answer("f", error="HTTP 500"), scores=forced), baseline_tf=decode)
    unscored = PromptRecord(Prompt("u", "math", "en", prompt="x"), baseline=answer("u"), baseline_tf=None)
    no_baseline = PromptRecord(Prompt("n", "math", "en", prompt="x"), baseline=None, baseline_tf=decode)
    run = SimpleNamespace(records=[good, failed, unscored, no_baseline], calibration_records=[calib],
                          threshold=SimpleNamespace(nats=0.000123456))
    assert bias_line(run) == ("decode/prefill bias: mean signed Δmargin (decode − teacher-forced) +0.4 nats over 4 rows "
                              "(mean |Δ| 0.4); the noise threshold is 0.0001235 nats")
    run.threshold = None
    assert bias_line(run) == ("decode/prefill bias: mean signed Δmargin (decode − teacher-forced) +0.4 nats over 4 rows "
                              "(mean |Δ| 0.4)")
    assert bias_line(SimpleNamespace(records=[unscored, no_baseline], calibration_records=[], threshold=None)) is None


# --------------------------------------------------------------------------- results


class Run:
    """A finished gate run as an arm reads it."""

    def __init__(self, records, threshold=None, calibration_records=(), activity=None):
        self.records = list(records)
        self.calibration_records = list(calibration_records)
        self.threshold = threshold
        self.deterministic = None
        self.deterministic_partial = None
        self.fingerprint = None
        self._activity = activity or Activity(proposed=12, accepted=9, verify_steps=4, emitted=13)

    def activity(self):
        return self._activity


def decision(status="PASS", exit_code=0, engine_error=None, counts=None, failures=()):
    return SimpleNamespace(status=status, exit_code=exit_code, engine_error=engine_error,
                           counts=dict(counts or {"exact": 2}), failures=list(failures))


def test_an_arm_s_result_from_its_run_its_decision_and_its_proof():
    evidence = Evidence(True, ["cold"])
    run = Run([record("a"), record("b"), record("c")], threshold=SimpleNamespace(nats=0.5, source="measured"))
    plan = dataclasses.replace(plan_of("default", report_dir="rep/default"), launch_text="--kv-cache-dtype fp8")
    got = arm_runs._result(plan, run, decision(counts={"exact": 2, "drifted": 1}, failures=["p 1 drifted"]), evidence)
    assert got == ArmResult("default", "rep/default", "--kv-cache-dtype fp8", "PASS", 0, {"exact": 2, "drifted": 1},
                            ["p 1 drifted"], 3, 12, 9, 13 / 4, 0.5, "measured", evidence, None)
    bare = arm_runs._result(plan_of("default", report_dir=None), Run([]), decision("FAIL", 1, engine_error="boom"),
                            evidence)
    assert (bare.report_dir, bare.gate_status, bare.exit_code, bare.threshold, bare.threshold_source) == (
        "", "ERROR", 1, None, "none")


def test_only_the_fp8_arm_s_result_carries_the_bias_line():
    forced = scores([-0.3, -0.8])
    rec = PromptRecord(Prompt("a", "math", "en", prompt="x"), baseline=dataclasses.replace(answer("a"), scores=forced),
                       baseline_tf=forced)
    run = Run([rec])
    assert arm_runs._result(plan_of("fp8-kv"), run, decision(), Evidence(True, [])).bias == (
        "decode/prefill bias: mean signed Δmargin (decode − teacher-forced) +0 nats over 1 rows (mean |Δ| 0)")
    assert arm_runs._result(plan_of("default"), run, decision(), Evidence(True, [])).bias is None


def test_an_arm_that_did_not_run_is_an_engine_error():
    plan = dataclasses.replace(plan_of("preempt", report_dir=None), launch_text="--max-total-tokens 99")
    assert arm_runs._not_run(plan, "cannot load engine 'sglang': boom") == ArmResult(
        "preempt", "", "--max-total-tokens 99", "ERROR", exitcodes.ENGINE_ERROR, {}, ["cannot load engine 'sglang': boom"],
        0, 0, 0, None, None, "none", Evidence(None, ["not run"]))


# --------------------------------------------------------------------------- writing an arm


def test_an_arm_s_proof_is_written_beside_its_journal_and_at_the_end_of_its_summary(tmp_path):
    r = _result(report_dir=str(tmp_path / "fp8-kv"), arm="fp8-kv", launch="--kv-cache-dtype fp8",
                evidence=Evidence(False, ["KV cache dtype as each server says: spec http://s: auto", "cold"],
                                  {"where": Path("/srv/a")}), bias="decode/prefill bias: +0 nats")
    (tmp_path / "fp8-kv").mkdir()
    (tmp_path / "fp8-kv" / "summary.md").write_text("# Summary\n", encoding="utf-8")
    write_arm(r)
    text = (tmp_path / "fp8-kv" / ARM_JSON).read_text(encoding="utf-8")
    assert text.startswith('{\n "arm": "fp8-kv",\n "report_dir": ') and text.endswith("\n}\n")
    assert json.loads(text) == json.loads(json.dumps(r.to_json(), default=str))
    assert json.loads(text)["evidence"]["facts"] == {"where": "/srv/a"}
    assert (tmp_path / "fp8-kv" / "summary.md").read_text(encoding="utf-8") == (
        "# Summary\n\n## Arm fp8-kv: NOT EXERCISED\n\n- launch: --kv-cache-dtype fp8\n"
        "- proof: KV cache dtype as each server says: spec http://s: auto\n- proof: cold\n"
        "- decode/prefill bias: +0 nats\n")


def test_an_arm_without_a_summary_gets_its_proof_file_only(tmp_path):
    r = _result(report_dir=str(tmp_path / "default"))
    write_arm(r)
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == [ARM_JSON]
    (tmp_path / "default" / "summary.md").write_text("# S\n", encoding="utf-8")
    write_arm(r)
    assert (tmp_path / "default" / "summary.md").read_text(encoding="utf-8") == (
        "# S\n\n## Arm default: PASS\n\n- launch: nothing\n- proof: cold\n")


# --------------------------------------------------------------------------- running the arms


class Clock:
    """``time`` as run_arms reads it: each ``perf_counter()`` the next of ``ticks``."""

    def __init__(self, *ticks: float):
        self.ticks = list(ticks)

    def perf_counter(self) -> float:
        return self.ticks.pop(0)


@pytest.fixture
def gate(monkeypatch):
    """``run_arms``'s collaborators: the engine loader (``engines``: by arm directory name, an engine or an
    exception), the gate run (each sends the prompts' requests, baseline then speculative, and returns a run
    of their answers) and ``conclude``."""
    from specparity.run import gate_command, runner

    state = SimpleNamespace(engines={}, runs=[], concluded=[], decisions=[], interrupt=None)

    def load_engine(setup):
        got = state.engines[Path(setup.config.report_dir).name]
        if isinstance(got, Exception):
            raise got
        return got

    def run_gate(engine, prompts, config, *, calibration=None, golden=None):
        state.runs.append(SimpleNamespace(engine=engine, prompts=prompts, config=config, calibration=calibration,
                                          golden=golden))
        requests = [GenerationRequest(p.id, [i + 1] * 3, 4) for i, p in enumerate(prompts)]
        engine.generate(requests, speculative=False)
        answers = engine.generate(requests, speculative=True)
        records = [PromptRecord(p, request=q, spec=a) for p, q, a in zip(prompts, requests, answers)]
        run = Run(records, threshold=SimpleNamespace(nats=0.125, source="measured"))
        if state.interrupt is not None:
            raise runner.GateInterrupted(run)
        return run

    def conclude(run):
        state.concluded.append(run)
        state.decisions.append(decision(counts={"exact": len(run.records)}))
        return state.decisions[-1]

    monkeypatch.setattr(gate_command, "load_engine", load_engine)
    monkeypatch.setattr(runner, "run_gate", run_gate)
    monkeypatch.setattr(runner, "conclude", conclude)
    return state


def arm_plan_for(arm: str, root: Path, launch_text: str = "nothing") -> ArmPlan:
    setup = SimpleNamespace(engine_spec="sglang", prompts=[Prompt("p1", "math", "en", prompt="x"),
                                                           Prompt("p2", "math", "en", prompt="y")],
                            config=GateConfig(report_dir=str(root / arm)), calibration=[Prompt("c", "math", "en",
                                                                                               prompt="z")],
                            golden=SimpleNamespace(name="golden"))
    return ArmPlan(ARMS[arm], setup, ArmLaunch(), launch_text)


def served(**answers) -> Engine:
    return Engine("sglang", spec=[Endpoint("http://s", reset="ok")], answers=answers)


def test_every_arm_runs_in_turn_an_engine_that_does_not_load_is_reported_and_the_next_still_runs(gate, tmp_path,
                                                                                                   monkeypatch):
    from specparity.run.gate_command import EngineLoadFailed

    facts = {"cached_tokens": 1, "preemptions": 0, "prompt_tokens": 3}
    engine = served(p1=answer("p1", facts=facts), p2=answer("p2", facts=facts))
    gate.engines = {"default": EngineLoadFailed("cannot load engine 'sglang': no such preset"), "prefix-warm": engine}
    monkeypatch.setattr(arm_runs, "time", Clock(10.0, 11.5, 13.0, 20.0, 21.0, 23.0, 30.0, 34.0))
    plans = [arm_plan_for("default", tmp_path), arm_plan_for("prefix-warm", tmp_path, "radix cache")]
    said: list[str] = []
    result = run_arms(plans, "sglang", str(tmp_path), say=said.append)
    assert (result.engine, result.arms, result.report_dir, result.interrupted) == (
        "sglang", ("default", "prefix-warm"), str(tmp_path), False)
    not_run, warm = result.results
    assert not_run == dataclasses.replace(arm_runs._not_run(plans[0], "cannot load engine 'sglang': no such preset"),
                                          wall_s={"launch": 1.5, "total": 3.0})
    assert warm.wall_s == {"launch": 1.0, "gate": 7.0, "total": 14.0}
    # the prefix-warm arm: each judged request preceded by its warm-up, on the engine that was loaded
    assert engine.calls == [([("p1", 4), ("p2", 4)], False), ([("p1/warm", 1)], True), ([("p2/warm", 1)], True),
                            ([("p1", 4), ("p2", 4)], True)]
    assert engine.closed == 1
    (sent,) = gate.runs
    assert isinstance(sent.engine, ArmEngine) and sent.engine._engine is engine
    assert (sent.prompts, sent.config, sent.calibration, sent.golden) == (
        plans[1].setup.prompts, plans[1].setup.config, plans[1].setup.calibration, plans[1].setup.golden)
    assert gate.concluded == [warm_run_of(gate)]
    assert warm.evidence == collect_evidence(plans[1], sent.engine, gate.concluded[0], sent.engine.judged_phase)
    assert warm.evidence.facts["prefix_cache_reset"] == [("http://s", True, "ok")]
    assert (warm.arm, warm.gate_status, warm.total, warm.counts, warm.launch) == ("prefix-warm", "PASS", 2,
                                                                                   {"exact": 2}, "radix cache")
    assert said == [f"arm default: 2 prompt(s); launch: nothing; journal {tmp_path / 'default'}", arm_line(not_run),
                    f"arm prefix-warm: 2 prompt(s); launch: radix cache; journal {tmp_path / 'prefix-warm'}",
                    arm_line(warm)]
    for r in result.results:
        assert json.loads((tmp_path / r.arm / ARM_JSON).read_text()) == json.loads(json.dumps(r.to_json()))
    assert json.loads((tmp_path / ARMS_JSON).read_text()) == json.loads(json.dumps(result.to_json()))
    assert (tmp_path / ARMS_MD).read_text() == arms_markdown(result)


def warm_run_of(gate):
    return gate.concluded[0]


def test_an_arm_other_than_prefix_warm_sends_no_warm_up_and_runs_without_a_listener(gate, tmp_path):
    engine = served()
    gate.engines = {"default": engine}
    result = run_arms([arm_plan_for("default", tmp_path)], "sglang", str(tmp_path))
    assert engine.calls == [([("p1", 4), ("p2", 4)], False), ([("p1", 4), ("p2", 4)], True)]
    assert [r.arm for r in result.results] == ["default"] and engine.closed == 1
    assert json.loads((tmp_path / ARMS_JSON).read_text())["arms"] == ["default"]


def test_a_proof_that_cannot_be_read_is_a_missing_proof(gate, tmp_path, monkeypatch):
    engine = served()
    gate.engines = {"default": engine}
    seen = []

    def unreadable(plan, arm_engine, run, phase=None):
        seen.append((plan, arm_engine, run, phase))
        raise RuntimeError("the counters vanished")

    monkeypatch.setattr(arm_runs, "collect_evidence", unreadable)
    plans = [arm_plan_for("default", tmp_path)]
    (arm,) = run_arms(plans, "sglang", str(tmp_path)).results
    assert arm.evidence == Evidence(False, ["the proof could not be read: RuntimeError: the counters vanished"])
    assert arm.status == NOT_EXERCISED and arm.final_exit == exitcodes.GATE_FAILED
    ((plan, arm_engine, run, phase),) = seen
    assert plan is plans[0] and arm_engine._engine is engine and run is gate.concluded[0]
    assert phase is arm_engine.judged_phase and phase is not None


def test_ctrl_c_writes_the_partial_arm_and_hands_the_partial_table_on(gate, tmp_path):
    from specparity.run.runner import GateInterrupted

    engine = served()
    gate.engines = {"default": engine, "preempt": served()}
    gate.interrupt = True
    with pytest.raises(GateInterrupted) as exc:
        run_arms([arm_plan_for("default", tmp_path), arm_plan_for("preempt", tmp_path)], "sglang", str(tmp_path))
    partial = exc.value.arms
    assert partial.interrupted is True and partial.status == "INTERRUPTED"
    (arm,) = partial.results
    assert arm == arm_runs._result(arm_plan_for("default", tmp_path), exc.value.run, gate.decisions[0],
                                   Evidence(None, ["interrupted"]))
    assert gate.concluded == [exc.value.run]
    assert engine.closed == 1
    assert json.loads((tmp_path / "default" / ARM_JSON).read_text())["evidence"]["lines"] == ["interrupted"]
    assert json.loads((tmp_path / ARMS_JSON).read_text())["status"] == "INTERRUPTED"


# --------------------------------------------------------------------------- the table


def test_the_small_formats():
    assert arm_runs._fmt(None) == "n/a" and arm_runs._fmt(2.43e-05) == "2.43e-05" and arm_runs._fmt(0.5) == "0.5"
    assert arm_runs._fmt(1.23456, ".3f") == "1.235"
    r = _result(counts={"exact": 3, "diverged": 1}, accepted=6, proposed=10, accept_length=2.5)
    assert arm_runs._classes(r) == "exact 3, near_tie 0, drifted 0, diverged 1, error 0"
    assert arm_runs._acceptance(r) == "6/10 (accept length 2.500)"
    assert arm_runs._acceptance(_result(accepted=0, proposed=0, accept_length=None)) == "0/0 (accept length n/a)"


def test_an_arm_s_line():
    r = _result(threshold=2.43e-05, evidence=Evidence(True, ["cold", "not preempted"]))
    assert arm_line(r) == ("arm default: PASS — exact 2, near_tie 0, drifted 0, diverged 0, error 0 (2 prompts); "
                           "accepted/proposed 6/10 (accept length 2.500); threshold 2.43e-05 nats (measured); proof: "
                           "cold; not preempted")


def test_the_terminal_table():
    long_proof = "cold: none of the 4 judged request(s) found anything cached; not preempted: per judged request (none)"
    results = [
        _result(evidence=Evidence(True, [long_proof])),
        _result(arm="prefix-warm", threshold=None, threshold_source="none", evidence=Evidence(False, ["not warm"])),
        _result(arm="fp8-kv", gate_status="FAIL", exit_code=1, failures=["p1 drifted", "p2 drifted"],
                bias="decode/prefill bias: +0.1 nats"),
    ]
    arms = ArmsResult("sglang", ("default", "prefix-warm", "fp8-kv", "long"), "r", results)
    classes = "exact 2, near_tie 0, drifted 0, diverged 0, error 0"
    acc = "6/10 (accept length 2.500)"
    assert terminal_lines(arms) == [
        "specparity arms: FAIL — engine sglang, arms default, prefix-warm, fp8-kv, long (3 of 4 run)",
        "arm          classes" + " " * (len(classes) - 7) + "  accepted/proposed" + " " * (len(acc) - 17)
        + "  threshold (source)  proof" + " " * 55 + "  verdict",
        "default      " + classes + "  " + acc + "  0.25 (measured)     " + long_proof[:57] + "...  PASS",
        "prefix-warm  " + classes + "  " + acc + "  n/a (none)          not warm" + " " * 52 + "  NOT EXERCISED",
        "fp8-kv       " + classes + "  " + acc + "  0.25 (measured)     cold" + " " * 56 + "  FAIL",
        "FAIL: arm prefix-warm: not exercised — not warm",
        "arm fp8-kv: decode/prefill bias: +0.1 nats",
        "FAIL: arm fp8-kv: p1 drifted",
        "FAIL: arm fp8-kv: p2 drifted",
    ]


def test_a_proof_of_up_to_sixty_characters_is_shown_whole_and_a_longer_one_cut():
    for size, shown in ((60, "x" * 60), (61, "x" * 57 + "...")):
        arms = ArmsResult("vllm", ("default",), "r", [_result(evidence=Evidence(True, ["x" * size]))])
        header, row = terminal_lines(arms)[1:3]
        assert header.endswith("proof" + " " * 55 + "  verdict") and row.endswith(f"  {shown}  PASS"), size
    arms = ArmsResult("vllm", ("default",), "r", [_result(evidence=Evidence(True, ["short"]))])
    assert terminal_lines(arms)[0] == "specparity arms: PASS — engine vllm, arms default"
    assert terminal_lines(arms)[1].endswith("proof  verdict")
    assert terminal_lines(ArmsResult("vllm", ("default",), "r", []))[1] == (
        "arm  classes  accepted/proposed  threshold (source)  proof  verdict")


def test_arms_md():
    results = [_result(evidence=Evidence(True, ["cold", "a | b"])),
               _result(arm="fp8-kv", gate_status="FAIL", exit_code=1, launch="--kv-cache-dtype fp8",
                       failures=["p1 drifted"], bias="decode/prefill bias: +0.1 nats", threshold=None,
                       threshold_source="none")]
    classes = "exact 2, near_tie 0, drifted 0, diverged 0, error 0"
    assert arms_markdown(ArmsResult("vllm", ("default", "fp8-kv"), "r", results)) == "\n".join([
        "# specparity arms — FAIL", "",
        "Engine vllm; each arm is a full gate run with its own journal and reports (`<arm>/`); its proof is read from "
        "the judged requests and the engine, with the proof that it is free of the other arms' conditions (an arm not "
        "proven is NOT EXERCISED, a failure).", "",
        "| arm | launch | classes | accepted/proposed | threshold (source) | proof | verdict |",
        "|---|---|---|---|---|---|---|",
        f"| default | nothing | {classes} | 6/10 (accept length 2.500) | 0.25 (measured) | cold; a / b | PASS |",
        f"| fp8-kv | --kv-cache-dtype fp8 | {classes} | 6/10 (accept length 2.500) | n/a (none) | cold | FAIL |",
        "", "## Notes and failures", "",
        "- arm fp8-kv: decode/prefill bias: +0.1 nats",
        "- arm fp8-kv: p1 drifted",
        "", "Per arm: [default/summary.md](default/summary.md), [fp8-kv/summary.md](fp8-kv/summary.md)", ""])
    plain = arms_markdown(ArmsResult("vllm", ("default",), "r", results[:1]))
    assert "## Notes" not in plain and plain.endswith(
        "| PASS |\n\nPer arm: [default/summary.md](default/summary.md)\n")


def test_arms_json_and_arms_md_are_written_whole(tmp_path):
    arms = ArmsResult("vllm", ("default",), str(tmp_path / "out"),
                      [_result(evidence=Evidence(True, ["cold"], {"where": Path("/srv")}))])
    paths = write_arms(arms)
    assert paths == [tmp_path / "out" / ARMS_JSON, tmp_path / "out" / ARMS_MD]
    text = paths[0].read_text(encoding="utf-8")
    assert text.startswith('{\n "schema": 1,\n "status": "PASS",\n') and text.endswith("\n}\n")
    assert json.loads(text) == json.loads(json.dumps(arms.to_json(), default=str))
    assert json.loads(text)["results"][0]["evidence"]["facts"] == {"where": "/srv"}
    assert paths[1].read_text(encoding="utf-8") == arms_markdown(arms)
