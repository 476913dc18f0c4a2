"""``specparity arms``: the gate once per configuration arm, each arm proven on its judged requests and by the
engine (how the proofs read them: ``tests/test_arms_proof.py``).

* bad input is one line, exit 4, before any request: an unknown arm (naming the known ones), an arm
  given twice, an arm an in-process engine or llama.cpp cannot run, an arm that changes the launch of
  servers the gate did not launch, a long arm on a target too short for it;
* each arm's launch change, as the argv and environment of both launches (vLLM and SGLang presets);
* per arm, a fake engine bug that only that arm catches (vLLM and SGLang emulators): the default arm
  passes it, the arm fails it;
* an arm whose proof is missing (no preemption counted, no cached-token count answered) ends NOT
  EXERCISED with a non-zero exit, never a pass.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from fakes import SGLangServer, VLLMServer
from fakes.backend import TARGET
from prompt_subsets import first_of_categories
from specparity.cli.commands import main
from specparity.engines.base import EngineOptions
from specparity.engines.server import sglang as sglang_engine
from specparity.engines.server import vllm as vllm_engine
from specparity.engines.server import vllm_launch
from specparity.engines.server.engine import HFTokenizer
from specparity.engines.server.arm_knobs import (
    LOOKAHEAD_TOKENS,
    KV_BLOCK_TOKENS,
    ArmSizing,
    arm_launch,
    preempt_tokens,
)
from specparity.gate import exitcodes
from specparity.engines import SERVER_ENGINES
from specparity.engines.server.arm_knobs import arm_changes, arm_proof, parse_arms, supported_arms, unsupported_reason
from specparity.model.arms import ARMS, LONG_MIN_TOKENS, NOT_EXERCISED
from specparity.run.arm_runs import ARM_JSON, ARMS_JSON, ARMS_MD
from specparity.run.arm_plan import LONG_FIT_TOKENS

#: Prompts per run: few, so every request of a phase is in flight at once under the preempt arm.
PER_CATEGORY = {"math": 2, "code": 2}
MAX_NEW = ("--max-new-tokens", "12")
#: A vLLM fake as every arm launches vLLM: answers carry cached prompt tokens, /reset_prefix_cache is there.
AS_LAUNCHED = {"prompt_tokens_details": True, "dev_mode": True}


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    chosen = first_of_categories(path, PER_CATEGORY)
    return path, chosen


def arms(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["arms", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def url_args(engine: str, base, spec, prompt_file: Path, report: Path) -> list[str]:
    return ["--engine", engine, "--baseline-url", base.url, "--spec-url", spec.url, "--target", str(TARGET),
            "--prompts", str(prompt_file), "--calibration", "selected", *MAX_NEW, "--report", str(report)]


def rows(report: Path) -> dict[str, dict]:
    return {r["arm"]: r for r in json.loads((report / ARMS_JSON).read_text())["results"]}


# --------------------------------------------------------------------------- the registry


def test_every_arm_is_declared_once_with_its_proof_per_engine():
    assert list(ARMS) == ["default", "deterministic", "preempt", "prefix-warm", "fp8-kv", "long", "mamba-slots"]
    for arm in ARMS.values():
        for engine in SERVER_ENGINES:
            if arm.name in supported_arms(engine):
                assert arm_changes(engine, arm.name) != "n/a" and arm_proof(engine, arm.name), (arm.name, engine)
            else:  # an engine that cannot set an arm up says why
                assert unsupported_reason(engine, arm.name) != "no knob", (arm.name, engine)


def test_the_default_arms_are_every_arm_the_engine_supports():
    assert [a.name for a in parse_arms(None, "vllm")] == [a.name for a in ARMS.values() if a.name in supported_arms("vllm")]
    assert [a.name for a in parse_arms(None, "sglang")] == [a.name for a in ARMS.values()
                                                            if a.name in supported_arms("sglang") and not a.hybrid]
    assert [a.name for a in parse_arms(None, "llamacpp")] == [a.name for a in ARMS.values() if a.name in supported_arms("llamacpp")]


# --------------------------------------------------------------------------- bad input


DUMMY = ["--baseline-url", "http://127.0.0.1:9", "--spec-url", "http://127.0.0.1:10", "--target", str(TARGET)]


@pytest.mark.parametrize("given, words", [
    ("preempt,nope", "unknown arm 'nope' (known: " + ", ".join(ARMS) + ")"),
    ("default,default", "default given twice"),
    ("default,,long", "expected arm names separated by commas"),
])
def test_bad_arm_names_are_one_line(capsys, tmp_path, given, words):
    code, _out, err = arms(capsys, "--engine", "vllm", *DUMMY, f"--arms={given}", "--report", str(tmp_path / "r"))
    assert code == exitcodes.BAD_INPUT
    assert err.count("\n") == 1 and err.startswith("specparity: error: --arms") and words in err, err


def test_an_in_process_engine_runs_only_the_default_arm(capsys, tmp_path):
    code, _out, err = arms(capsys, "--engine", "dflash", "--arms", "default,preempt", "--report", str(tmp_path / "r"))
    assert code == exitcodes.BAD_INPUT
    assert "--arms preempt" in err and "runs in process" in err and "GPU server" in err, err


def test_an_arm_llamacpp_cannot_set_up_names_why_and_what_it_supports(capsys, tmp_path):
    code, _out, err = arms(capsys, "--engine", "llamacpp", "--baseline-url", "http://127.0.0.1:9", "--spec-url",
                           "http://127.0.0.1:10", "--arms", "fp8-kv", "--prelaunched", "--report", str(tmp_path / "r"))
    assert code == exitcodes.BAD_INPUT
    supported = ", ".join(a.name for a in ARMS.values() if a.name in supported_arms("llamacpp"))
    assert "--arms fp8-kv" in err and "no fp8" in err and f"(it supports: {supported})" in err, err


def test_a_launch_arm_on_running_servers_is_refused_before_any_request(capsys, tmp_path, prompts):
    with VLLMServer() as base, VLLMServer(speculative=True) as spec:
        code, _out, err = arms(capsys, *url_args("vllm", base, spec, prompts[0], tmp_path), "--arms",
                               "default,preempt")
        assert not base.seen and not spec.seen
    assert code == exitcodes.BAD_INPUT
    assert "--arms preempt" in err and "--num-gpu-blocks-override" in err and "--prelaunched" in err, err


def test_on_running_servers_the_default_arms_are_those_without_a_launch_change(capsys, tmp_path, prompts):
    with VLLMServer() as base, VLLMServer(speculative=True) as spec:
        arms(capsys, *url_args("vllm", base, spec, prompts[0], tmp_path))
    assert list(rows(tmp_path)) == [a.name for a in ARMS.values() if not a.launch and a.name in supported_arms("vllm")]


def test_the_long_arm_on_a_short_target_names_its_positions(capsys, tmp_path):
    positions = json.loads((TARGET / "config.json").read_text())["max_position_embeddings"]
    code, _out, err = arms(capsys, "--engine", "vllm", "--preset", "vllm-ngram", "--target", str(TARGET), "--arms",
                           "long", "--report", str(tmp_path / "r"))
    assert code == exitcodes.BAD_INPUT
    assert f"max_position_embeddings is {positions}" in err and err.startswith("specparity: error: --arms long"), err


# --------------------------------------------------------------------------- launch changes (argv)


def _sizing(concurrency: int = 4) -> ArmSizing:
    return ArmSizing((40, 70, 25, 90, 33), (48, 48, 12, 48, 48), concurrency)


def _launched(module, engine: str, arm: str, preset: str, **extra):
    options = EngineOptions(preset=preset, target="/models/t", draft="/models/d", extra=dict(extra))
    launch = arm_launch(engine, arm, _sizing(), options)
    return launch, module.launch_configs(launch.apply(options))


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_vllm_arms_change_both_launches():
    plain = vllm_launch.launch_configs(EngineOptions(preset="vllm-ngram", target="/models/t"))
    for arm, flag, value in (("fp8-kv", "--kv-cache-dtype", "fp8"),
                             ("prefix-warm", "--enable-prompt-tokens-details", None)):
        _launch, both = _launched(vllm_engine, "vllm", arm, "vllm-ngram")
        for launch, before in zip(both, plain):
            argv = launch.args()
            assert flag in argv and flag not in before.args(), (arm, argv)
            if value is not None:
                assert _pairs(argv, flag) == [value]
    _launch, both = _launched(vllm_engine, "vllm", "deterministic", "vllm-ngram")
    assert all(launch.env() == {"VLLM_BATCH_INVARIANT": "1", "VLLM_SERVER_DEV_MODE": "1"} for launch in both)
    _launch, both = _launched(vllm_engine, "vllm", "fp8-kv", "vllm-ngram")  # its cache dtype is read back there
    assert all(launch.env() == {"VLLM_SERVER_DEV_MODE": "1"} for launch in both)
    assert not any(launch.env() for launch in plain)
    # every arm, default included: each answer's cached prompt tokens, and dev mode's /reset_prefix_cache
    for arm in ARMS:
        if arm == "long" or arm not in supported_arms("vllm"):
            continue  # its context needs a target's positions
        _launch, both = _launched(vllm_engine, "vllm", arm, "vllm-ngram")
        assert all("--enable-prompt-tokens-details" in launch.args() for launch in both), arm
        assert all(launch.env().get("VLLM_SERVER_DEV_MODE") == "1" for launch in both), arm


def test_vllm_preempt_sizes_the_kv_cache_below_what_runs_at_once():
    sizing = _sizing()
    launch, both = _launched(vllm_engine, "vllm", "preempt", "vllm-ngram")
    blocks = {int(_pairs(launch_.args(), "--num-gpu-blocks-override")[0]) for launch_ in both}
    assert len(blocks) == 1
    tokens = blocks.pop() * KV_BLOCK_TOKENS
    sizes = sorted((p + n + LOOKAHEAD_TOKENS for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens)), reverse=True)
    assert tokens >= sizes[0]  # the largest request fits on its own
    assert tokens < sum(sizes[: sizing.concurrency])  # those in flight together do not
    assert launch.concurrency == sizing.concurrency
    assert math.ceil(preempt_tokens(sizing) / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS == tokens
    # the context fits the KV cache (vLLM refuses to start otherwise) and the largest request fits the context
    contexts = {int(_pairs(launch_.args(), "--max-model-len")[-1]) for launch_ in both}
    assert len(contexts) == 1 and sizes[0] <= contexts.pop() <= tokens


def test_arm_flags_come_after_the_users_server_args_so_they_win():
    options = EngineOptions(preset="vllm-ngram", target="/models/t",
                            extra={"server_args": ["--enforce-eager", "--max-model-len", "2048"]})
    launch = arm_launch("vllm", "fp8-kv", _sizing(), options)
    argv = vllm_launch.launch_configs(launch.apply(options))[1].args()
    assert argv[-5:] == ["--max-model-len", "2048", "--kv-cache-dtype", "fp8", "--enable-prompt-tokens-details"]
    assert options.extra["server_args"] == ["--enforce-eager", "--max-model-len", "2048"]  # left as it was


def test_sglang_arms_change_both_launches():
    for arm, flag, value in (("fp8-kv", "--kv-cache-dtype", "fp8_e4m3"), ("preempt", "--max-total-tokens",
                                                                          str(preempt_tokens(_sizing())))):
        _launch, both = _launched(sglang_engine, "sglang", arm, "sglang-mtp")
        assert all(_pairs(launch.args(), flag)[-1] == value for launch in both), arm
    _launch, both = _launched(sglang_engine, "sglang", "preempt", "sglang-mtp")
    for launch in both:
        argv = launch.args()
        assert "--enable-metrics" in argv  # its retraction counter is on /metrics only then
        assert int(_pairs(argv, "--context-length")[-1]) <= int(_pairs(argv, "--max-total-tokens")[-1])
    _launch, both = _launched(sglang_engine, "sglang", "deterministic", "sglang-mtp")
    assert all("--enable-deterministic-inference" in launch.args() for launch in both)


def test_an_installed_engine_without_the_arms_argument_is_refused_naming_it(tmp_path, monkeypatch):
    from specparity.engines.server import arm_knobs

    pkg = tmp_path / "vllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "arg_utils.py").write_text("max_model_len = None\nkv_cache_dtype = 'auto'\n")
    monkeypatch.setattr(arm_knobs, "installed_package_dir", lambda name: pkg if name == "vllm" else None)
    options = EngineOptions(preset="vllm-ngram", target="/models/t")
    # every vLLM arm answers each request's cached prompt tokens: a front-end flag, in cli_args.py
    with pytest.raises(arm_knobs.ArmSetupError, match=r"--arms default: the installed vllm .* has no "
                                                      r"--enable-prompt-tokens-details"):
        arm_launch("vllm", "default", _sizing(), options)
    (pkg / "entrypoints" / "openai").mkdir(parents=True)
    (pkg / "entrypoints" / "openai" / "cli_args.py").write_text("enable_prompt_tokens_details: bool = False\n")
    with pytest.raises(arm_knobs.ArmSetupError, match=r"--arms preempt: the installed vllm .* has no "
                                                      r"--num-gpu-blocks-override \(num_gpu_blocks_override\)"):
        arm_launch("vllm", "preempt", _sizing(), options)
    assert arm_launch("vllm", "fp8-kv", _sizing(), options).flags[:2] == ("--kv-cache-dtype", "fp8")  # declared there


@pytest.mark.skipif(shutil.which("vllm") is not None, reason="a vllm on PATH would really launch")
def test_an_arm_whose_servers_do_not_start_is_an_error_and_the_next_arm_still_runs(capsys, tmp_path):
    code, out, err = arms(capsys, "--engine", "vllm", "--preset", "vllm-ngram", "--target", str(TARGET), "--arms",
                          "default,fp8-kv", "--report", str(tmp_path))
    got = rows(tmp_path)
    assert list(got) == ["default", "fp8-kv"], got
    assert all(r["status"] == "ERROR" and r["exit_code"] == exitcodes.ENGINE_ERROR for r in got.values()), got
    assert "cannot start" in got["fp8-kv"]["failures"][0]
    assert all((tmp_path / arm / ARM_JSON).is_file() for arm in got)
    assert code == exitcodes.ENGINE_ERROR, out + err


class _Metrics:
    """An endpoint answering ``/metrics`` with ``text`` (None: HTTP 404, metrics off)."""

    def __init__(self, text: str | None):
        self.text = text

    def request(self, method: str, path: str, timeout_s: float = 0.0):
        from types import SimpleNamespace

        from specparity.engines.server.http import ServerError

        if self.text is None:
            raise ServerError("404 Not Found", status=404)
        return SimpleNamespace(body=self.text.encode())


def _engine_with(name: str, *texts: str | None):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, spec=SimpleNamespace(fleet=SimpleNamespace(endpoints=[_Metrics(t) for t in texts])))


def test_preemption_counters_are_summed_and_a_missing_one_is_unknown_not_zero():
    from specparity.engines.server.arm_knobs import preemptions

    vllm_text = '# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total{{engine="0"}} {}\n'
    assert preemptions(_engine_with("vllm", vllm_text.format(3), vllm_text.format(4))) == 7
    assert preemptions(_engine_with("vllm", "# TYPE vllm:other gauge\nvllm:other 1\n")) is None
    assert preemptions(_engine_with("vllm", None)) is None
    # SGLang's counter appears at the first retraction: before it, metrics on means 0 so far
    running = '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{tp_rank="0"} 2\n'
    retracted = '# TYPE sglang:num_retracted_requests_total counter\nsglang:num_retracted_requests_total 5\n'
    assert preemptions(_engine_with("sglang", running)) == 0
    assert preemptions(_engine_with("sglang", running + retracted)) == 5
    assert preemptions(_engine_with("sglang", None)) is None
    assert preemptions(_engine_with("llamacpp", running)) is None


# --------------------------------------------------------------------------- bugs only an arm catches (fakes)


def test_a_bug_after_preemption_passes_the_default_arm_and_fails_the_preempt_arm(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    tok = HFTokenizer(str(TARGET))
    longest = max(len(tok.encode_prompt(p.prompt, p.messages_as_dicts())) for p in chosen)
    budget = longest + int(MAX_NEW[1])  # one request always fits; several at once do not
    base = VLLMServer(**AS_LAUNCHED)
    spec = VLLMServer(speculative=True, preempt_budget_tokens=budget, preempt_bug=True, **AS_LAUNCHED)
    with base, spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms",
                              "default,prefix-warm,preempt", "--prelaunched", "--concurrency", "1",
                              "--engine-opt", f"max_concurrency={len(chosen)}")
    assert spec.preempted, "the fake never preempted: nothing was tested"
    got = rows(tmp_path)
    assert got["default"]["status"] == "PASS" and got["default"]["counts"]["exact"] == len(chosen), got["default"]
    assert got["prefix-warm"]["status"] == "PASS", got["prefix-warm"]  # one request in flight: none preempted
    assert got["preempt"]["status"] == "FAIL" and got["preempt"]["counts"]["diverged"] >= 1, got["preempt"]
    assert got["preempt"]["evidence"]["exercised"] is True
    assert got["preempt"]["evidence"]["facts"]["preemptions"] == len(spec.preempted)
    assert code == exitcodes.GATE_FAILED, out + err
    assert "preempt" in out and "FAIL" in out
    for arm in ("default", "prefix-warm", "preempt"):  # each arm keeps its own journal, summary and proof
        assert (tmp_path / arm / "results.jsonl").is_file() and (tmp_path / arm / ARM_JSON).is_file()
        assert f"## Arm {arm}:" in (tmp_path / arm / "summary.md").read_text()
    assert "| preempt |" in (tmp_path / ARMS_MD).read_text()


def test_a_preempt_arm_without_preemptions_is_not_exercised(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    with VLLMServer() as base, VLLMServer(speculative=True) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms", "preempt",
                              "--prelaunched", "--engine-opt", f"max_concurrency={len(chosen)}")
    row = rows(tmp_path)["preempt"]
    assert row["gate_status"] == "PASS" and row["status"] == NOT_EXERCISED, row
    assert row["evidence"]["facts"]["preemptions"] == 0
    assert code == exitcodes.GATE_FAILED and "FAIL: arm preempt: not exercised" in out, out + err


def test_a_bug_on_a_prefix_cache_hit_is_caught_only_by_prefix_warm(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    base = VLLMServer(**AS_LAUNCHED)
    spec = VLLMServer(speculative=True, prefix_hit_bug=True, **AS_LAUNCHED)
    with base, spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms",
                              "default,prefix-warm")
    assert spec.arm_flipped, "no answer was a prefix-cache hit: nothing was tested"
    got = rows(tmp_path)
    assert got["default"]["status"] == "PASS", got["default"]
    assert got["prefix-warm"]["status"] == "FAIL" and got["prefix-warm"]["evidence"]["exercised"] is True
    cached = got["prefix-warm"]["evidence"]["facts"]["cached_tokens"]
    assert sorted(cached) == sorted(p.id for p in chosen) and all(n > 0 for n in cached.values()), cached
    assert code == exitcodes.GATE_FAILED, out + err


def test_prefix_warm_on_an_eagle_server_counts_only_prompts_past_the_dropped_block(capsys, tmp_path, prompts):
    """An EAGLE-3 server (the method read back from its dev-mode config) answers a warm prompt of two blocks
    with nothing cached, as vLLM does: the arm still proves the warm path on the longer prompts and names
    the ones it cannot count, where counting them would call a working cache cold."""
    prompt_file, chosen = prompts
    base = VLLMServer(**AS_LAUNCHED)
    spec = VLLMServer(speculative=True, spec_method="eagle3", **AS_LAUNCHED)
    with base, spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms", "prefix-warm")
    row = rows(tmp_path)["prefix-warm"]
    cached = row["evidence"]["facts"]["cached_tokens"]
    assert any(n == 0 for n in cached.values()) and any(n > 0 for n in cached.values()), cached
    assert row["status"] == "PASS" and row["evidence"]["exercised"] is True, row
    assert any("two cache units" in line for line in row["evidence"]["lines"]), row["evidence"]
    assert code == exitcodes.PASS, out + err


def test_a_prefix_warm_arm_without_cached_token_counts_is_not_exercised(capsys, tmp_path, prompts):
    """The server caches prefixes but does not say so (vLLM without --enable-prompt-tokens-details)."""
    prompt_file, _chosen = prompts
    with VLLMServer() as base, VLLMServer(speculative=True, prefix_cache=True) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms", "prefix-warm")
    row = rows(tmp_path)["prefix-warm"]
    assert row["gate_status"] == "PASS" and row["status"] == NOT_EXERCISED, row
    assert code == exitcodes.GATE_FAILED and "--enable-prompt-tokens-details" in out, out + err


def test_a_bug_only_in_deterministic_mode_is_caught_by_the_deterministic_arm(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    # the same buggy build: launched plainly (the default arm's servers), and in batch-invariant mode
    with VLLMServer(**AS_LAUNCHED) as base, VLLMServer(speculative=True, deterministic_bug=True, **AS_LAUNCHED) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path / "plain"), "--arms",
                              "default")
        assert code == exitcodes.PASS and not spec.arm_flipped, out + err
    with VLLMServer(batch_invariant=True, **AS_LAUNCHED) as base, \
            VLLMServer(speculative=True, batch_invariant=True, deterministic_bug=True, **AS_LAUNCHED) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path / "det"), "--arms",
                              "deterministic", "--prelaunched")
        assert spec.arm_flipped
    row = rows(tmp_path / "det")["deterministic"]
    assert row["status"] == "FAIL" and row["evidence"]["exercised"] is True, row
    assert code == exitcodes.GATE_FAILED, out + err


def test_deterministic_arm_on_servers_that_do_not_declare_it_is_not_exercised(capsys, tmp_path, prompts):
    with VLLMServer(dev_mode=True) as base, VLLMServer(speculative=True, dev_mode=True) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompts[0], tmp_path), "--arms", "deterministic",
                              "--prelaunched")
    assert rows(tmp_path)["deterministic"]["status"] == NOT_EXERCISED
    assert code == exitcodes.GATE_FAILED, out + err


def test_a_bug_only_under_fp8_kv_is_caught_by_the_fp8_arm_with_its_bias_line(capsys, tmp_path, prompts):
    prompt_file, _chosen = prompts
    with VLLMServer(**AS_LAUNCHED) as base, VLLMServer(speculative=True, fp8_bug=True, **AS_LAUNCHED) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path / "plain"), "--arms",
                              "default")
        assert code == exitcodes.PASS, out + err
    with VLLMServer(kv_cache_dtype="fp8", **AS_LAUNCHED) as base, \
            VLLMServer(speculative=True, kv_cache_dtype="fp8", fp8_bug=True, **AS_LAUNCHED) as spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path / "fp8"), "--arms",
                              "fp8-kv", "--prelaunched")
    row = rows(tmp_path / "fp8")["fp8-kv"]
    assert row["status"] == "FAIL" and row["evidence"]["exercised"] is True, row
    assert row["bias"] and row["bias"].startswith("decode/prefill bias: mean signed Δmargin"), row
    assert f"arm fp8-kv: {row['bias']}" in out
    assert code == exitcodes.GATE_FAILED, out + err


def test_a_bug_only_beyond_16k_tokens_is_caught_only_by_the_long_arm(capsys, tmp_path, prompts):
    """The long arm sends 32K-token prompts (the long fixture's 40960 positions allow them); a speculative
    server that goes wrong only past 16K tokens passes the default arm and fails the long one. The
    emulator's model does not see the first LONG_MIN_TOKENS - 512 tokens of a long prompt, so both arms
    run on the CPU."""
    prompt_file, _chosen = prompts
    long_target = TARGET.parent / "long"
    drop = LONG_MIN_TOKENS - 512
    with VLLMServer(drop_leading=drop, **AS_LAUNCHED) as base, \
            VLLMServer(speculative=True, drop_leading=drop, long_bug_tokens=16384, **AS_LAUNCHED) as spec:
        args = url_args("vllm", base, spec, prompt_file, tmp_path)
        args[args.index("--target") + 1] = str(long_target)
        code, out, err = arms(capsys, *args, "--arms", "default,long", "--prelaunched")
    got = rows(tmp_path)
    assert got["default"]["status"] == "PASS", got["default"]
    long_row = got["long"]
    assert long_row["status"] == "FAIL" and long_row["evidence"]["exercised"] is True, long_row
    assert long_row["counts"]["diverged"] + long_row["counts"]["drifted"] >= 1, long_row
    assert spec.arm_flipped and all(len(p.split(",")) > 16384 for p in spec.arm_flipped)
    # sized with the target's tokenizer: at least the arm's size, and within the context the arm launches
    sizes = long_row["evidence"]["facts"]["prompt_tokens"].values()
    assert sizes and all(LONG_MIN_TOKENS <= n <= LONG_MIN_TOKENS + LONG_FIT_TOKENS for n in sizes), sizes
    assert code == exitcodes.GATE_FAILED, out + err


def test_sglang_prefix_warm_reads_meta_info_cached_tokens(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    with SGLangServer() as base, SGLangServer(speculative=True, prefix_hit_bug=True) as spec:
        code, out, err = arms(capsys, *url_args("sglang", base, spec, prompt_file, tmp_path), "--arms",
                              "default,prefix-warm")
    got = rows(tmp_path)
    assert got["default"]["status"] == "PASS", got["default"]
    assert got["prefix-warm"]["status"] == "FAIL" and spec.arm_flipped, got["prefix-warm"]
    assert all(n > 0 for n in got["prefix-warm"]["evidence"]["facts"]["cached_tokens"].values())
    assert code == exitcodes.GATE_FAILED, out + err


def test_sglang_preempt_without_retractions_is_not_exercised(capsys, tmp_path, prompts):
    """SGLang answers each request's retractions (meta_info.num_retractions): none retracted is no proof."""
    prompt_file, chosen = prompts
    with SGLangServer() as base, SGLangServer(speculative=True) as spec:
        code, out, err = arms(capsys, *url_args("sglang", base, spec, prompt_file, tmp_path), "--arms", "preempt",
                              "--prelaunched", "--engine-opt", f"max_concurrency={len(chosen)}")
    row = rows(tmp_path)["preempt"]
    assert row["status"] == NOT_EXERCISED, row
    assert row["evidence"]["facts"]["preemptions_per_request"] == {p.id: 0 for p in chosen}, row["evidence"]
    assert code == exitcodes.GATE_FAILED, out + err


def _prefix_warm_evidence(lengths: dict[str, int], cached: dict[str, int], method: str | None = None,
                          warm_errors: dict[str, str] | None = None):
    """The prefix-warm arm's evidence on vLLM for prompts of ``lengths`` tokens whose judged requests found
    ``cached`` tokens after warm-ups that failed with ``warm_errors`` (by prompt; the others succeeded), the
    run's speculative method read from its fingerprint (None: no fingerprint)."""
    from types import SimpleNamespace

    from specparity.model.types import GenerationRequest
    from specparity.run.arm_evidence import collect_evidence

    errors = warm_errors or {}
    records = [SimpleNamespace(spec=SimpleNamespace(facts={"cached_tokens": n, "prompt_tokens": lengths[rid]},
                                                    error=None, output_ids=[]),
                               request=GenerationRequest(rid, [1] * lengths[rid], 8)) for rid, n in cached.items()]
    engine = SimpleNamespace(warm_results={rid: SimpleNamespace(error=errors.get(rid)) for rid in cached})
    plan = SimpleNamespace(arm=ARMS["prefix-warm"], setup=SimpleNamespace(engine_spec="vllm"))
    fingerprint = None if method is None else SimpleNamespace(spec_config={"method": method})
    return collect_evidence(plan, engine, SimpleNamespace(records=records, fingerprint=fingerprint), None)


def test_prefix_warm_needs_each_warm_up_to_succeed_and_the_whole_prompt_cached():
    """Any cached token used to prove the arm: with every warm-up failed (HTTP 500) and each 200-token prompt
    finding only the 16-token block it shares with the others, the arm was "exercised". A prompt counts only
    when its warm-up succeeded and it found all of its prompt a cache can hold (whole blocks of all but its
    last token)."""
    from specparity.engines.server.arm_knobs import descriptor_of

    unit = descriptor_of("vllm").prefix_cache.unit
    lengths = {f"p{i}": 200 for i in range(3)}
    whole = (200 - 1) // unit * unit
    failed = _prefix_warm_evidence(lengths, {rid: unit for rid in lengths},
                                   warm_errors={rid: "HTTP 500: Internal Server Error" for rid in lengths})
    assert failed.exercised is False, failed.lines
    assert any("warm-up failed for 3 prompt(s)" in line for line in failed.lines), failed.lines
    shared_block_only = _prefix_warm_evidence(lengths, {rid: unit for rid in lengths})
    assert shared_block_only.exercised is False, shared_block_only.lines
    assert _prefix_warm_evidence(lengths, {rid: whole for rid in lengths}).exercised is True
    one_failed = _prefix_warm_evidence(lengths, {rid: whole for rid in lengths}, warm_errors={"p1": "HTTP 500"})
    assert one_failed.exercised is False, one_failed.lines


def test_prefix_warm_counts_only_prompts_long_enough_to_be_cached():
    """vLLM caches whole blocks and recomputes a prompt's last token: a prompt of one block or less can find
    nothing cached, so it neither proves nor disproves the warm path; with only such prompts nothing is proven."""
    from specparity.engines.server.arm_knobs import descriptor_of

    unit = descriptor_of("vllm").prefix_cache.unit
    lengths = {"short": unit, "long": 3 * unit + 1}

    def run_with(cached: dict[str, int]):
        return _prefix_warm_evidence(lengths, cached)

    proven = run_with({"short": 0, "long": 3 * unit})
    assert proven.exercised is True and any("shorter than one cache unit" in line for line in proven.lines)
    assert run_with({"short": 0, "long": 0}).exercised is False
    only_short = run_with({"short": 0})
    assert only_short.exercised is False and any("long enough" in line for line in only_short.lines)


def test_prefix_warm_floor_counts_the_block_vllm_drops_for_hidden_state_drafts():
    """For a draft that reads the target's hidden states (EAGLE, EAGLE-3, MTP, DFlash) vLLM drops the last
    matched block of every hit: a prompt of two blocks finds nothing cached there, and counting it would
    call a working cache cold (live vLLM 0.26.0 answered exactly floor((n - 1) / 16) * 16 - 16)."""
    from specparity.engines.server.arm_knobs import descriptor_of, prefix_cache_floor

    unit = descriptor_of("vllm").prefix_cache.unit
    assert prefix_cache_floor("vllm", {"method": "ngram"})[0] == unit + 1
    assert prefix_cache_floor("vllm", None)[0] == unit + 1
    assert prefix_cache_floor("vllm", {"method": "eagle3"})[0] == 2 * unit + 1
    assert prefix_cache_floor("sglang", {"method": "eagle3"})[0] == descriptor_of("sglang").prefix_cache.unit + 1
    lengths = {"two-blocks": 2 * unit, "three-blocks": 3 * unit + 1}

    def run_with(cached: dict[str, int], method: str):
        return _prefix_warm_evidence(lengths, cached, method)

    # what vLLM answers for EAGLE-3: the two-block prompt finds nothing, the longer one two blocks
    eagle = run_with({"two-blocks": 0, "three-blocks": 2 * unit}, "eagle3")
    assert eagle.exercised is True, eagle.lines
    assert any("two cache units" in line and "two-blocks" in line for line in eagle.lines), eagle.lines
    # the same answers under n-gram (nothing dropped) are a cold cache
    assert run_with({"two-blocks": 0, "three-blocks": 2 * unit}, "ngram").exercised is False
    # and a hidden-state draft whose long prompt found nothing is still not proven
    assert run_with({"two-blocks": 0, "three-blocks": 0}, "eagle3").exercised is False
