"""The ``sglang`` engine adapter, tested WITHOUT a real SGLang server.

Nothing here talks to SGLang: no GPU is available, so no SGLang server was ever started. The
adapter (``specparity/engines/server/sglang.py``) is tested against

* the response bodies in ``tests/data/sglang/`` — derived from the source of the SGLang **0.5.23**
  wheel (and **0.5.19** for ``error_500_unknown_sampling_param_0.5.19.json``), never recorded from
  a running server (each file's ``_source`` says so and cites ``file:line``);
* the SGLang protocol emulator ``tests/fakes/sglang.py``: a small HTTP server that speaks SGLang's
  wire format as read from those sources (0.5.23, or 0.5.19 with ``version="0.5.19"``) and computes
  tokens, logprobs and speculation counters with the committed fixture models through specparity's
  in-process ``HFEngine``;
* the launch commands of the deployments the SGLang presets reproduce (below, verbatim: a 128K
  DFlash2 launch on SGLang 0.5.19, and a 32K FP8 deployment's DFlash2 and MTP launches), for the
  presets' argv.

A pass here means the adapter agrees with what was read from SGLang's source; it does not prove
that a live SGLang answers that way.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from fakes import SGLangServer
from fakes.backend import DATA, REPO, TARGET
from fakes.gate import run_lossless
from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.engines.server.http import Endpoint, Fleet, ServerError
from specparity.judge.flip_budget import HAND_SET
from specparity.engines.server.launch import health_ok
from specparity.engines.server.presets import PRESETS, presets_for
from specparity.engines.server.engine import Session
from specparity.engines.server.sglang_wire import (NUMERICS_KEYS, SAMPLING_KEYS_0_5_19, SAMPLING_KEYS_0_5_23,
                                                   SENT_SAMPLING_KEYS, UNKNOWN, generate_body, parse_generate,
                                                   parse_score, spec_stats)
from specparity.engines.server.sglang import SGLangEngine, check_options
from specparity.engines.server.sglang_launch import SGLangLaunch, launch_configs
from specparity.model.prompts import load_many
from specparity.model.types import GenerationRequest

pytestmark = pytest.mark.offline

SG = DATA / "sglang"

#: The near-tie policy of a run whose threshold --near-tie-nats set: the fixed share, exact ties apart.
HAND_SET_BUDGET = ("near-tie flips that are not exact ties allowed up to 25% of the prompts, exact-tie flips allowed and "
                   f"counted apart ({HAND_SET}, so the budget cannot follow the data)")


def load(name: str):
    return json.loads((SG / name).read_text())


def body_of(name: str):
    data = load(name)
    return {k: v for k, v in data.items() if not k.startswith("_")} if isinstance(data, dict) else data


# ---------------------------------------------------------------------------------------------- fakes


class FakeEndpoint:
    """Answers GETs from a dict of recorded bodies (for the /server_info parsing tests)."""

    def __init__(self, url: str, bodies: dict[str, object]):
        self.base_url = url
        self.bodies = bodies

    def get_json(self, path: str, **_: object):
        if path not in self.bodies:
            raise ServerError(f"GET {path}: HTTP 404 from {self.base_url}: Not Found", status=404)
        return self.bodies[path]


def engine_over(base: FakeEndpoint, spec: FakeEndpoint) -> SGLangEngine:
    return SGLangEngine(EngineOptions(), Session("baseline", Fleet("baseline", [base]), []),
                        Session("spec", Fleet("spec", [spec]), []), None, target=None, draft=None,
                        launches=(None, None), max_concurrency=8)


# ---------------------------------------------------------------------------------------------- recorded bodies


def test_generate_spec_on_0_5_23():
    """generate_greedy_spec_on.json (0.5.23, DFLASH block 16): ids, finish, logprob rows, counters."""
    data = load("generate_greedy_spec_on.json")
    ids, finish, scores, meta = parse_generate(body_of("generate_greedy_spec_on.json"), 8)
    assert ids == data["output_ids"] and finish == "stop" and ids[-1] == 2
    rows = data["meta_info"]["output_token_logprobs"]
    np.testing.assert_allclose(scores.logprobs, [r[0] for r in rows], rtol=0, atol=1e-6)
    tops = data["meta_info"]["output_top_logprobs"]
    assert scores.top_ids.tolist() == [[e[1] for e in row] for row in tops]
    assert all(scores.top_ids[i, 0] == ids[i] for i in range(len(ids)))  # greedy: chosen = top-1
    s = spec_stats(meta, len(ids), "DFLASH")
    assert (s.available, s.verify_steps, s.accepted, s.proposed) == (True, 3, 6, 45)  # 45 = 3 x (16 - 1)


def test_generate_spec_off_0_5_23_and_the_missing_counters_trap():
    """generate_greedy_spec_off.json (0.5.23, plain launch): no spec_* keys. From a server that
    declares speculation, that is an error (never a silent pass); from a plain server, 'unavailable'."""
    ids, finish, scores, meta = parse_generate(body_of("generate_greedy_spec_off.json"), 8)
    assert finish == "stop" and len(ids) == 10 and not any(k.startswith("spec_") for k in meta)
    with pytest.raises(ServerError, match="declares speculative_algorithm=DFLASH .* no spec_\\* keys"):
        spec_stats(meta, len(ids), "DFLASH")
    # a "speculative" server that declares no algorithm does not speculate: inactive (0 proposed, 0
    # verify steps, reported), which the gate fails, never "unknown" (which --allow-unknown-activity passes)
    none = spec_stats(meta, len(ids), None)
    assert (none.available, none.proposed, none.accepted, none.verify_steps) == (True, 0, 0, 0)
    assert "declares no speculative_algorithm" in none.source
    assert spec_stats(meta, len(ids), UNKNOWN).available is False
    one = spec_stats(meta, 1, "DFLASH")  # a 1-token answer finished at the prefill: no verify step
    assert one.available and one.verify_steps == 0


def test_score_body_drops_the_null_entry():
    """generate_score_logprob_start_len_0.json (0.5.23): entry 0 is [null, id, text] and
    input_top_logprobs[0] is null; with logprob_start_len = len(prompt) - 1 (here 0, prompt = 1 token)
    the continuation's rows follow. Its values equal the spec-off generation logprobs."""
    data = load("generate_score_logprob_start_len_0.json")
    ids = data["_request"]["input_ids"]
    scores = parse_score(body_of("generate_score_logprob_start_len_0.json"), ids[:1], ids[1:], 8)
    rows = data["meta_info"]["input_token_logprobs"]
    assert rows[0][0] is None and data["meta_info"]["input_top_logprobs"][0] is None
    np.testing.assert_allclose(scores.logprobs, [r[0] for r in rows[1:]], atol=1e-6)
    assert 1183 not in scores.top_ids[1].tolist()  # ' capital' at rank 12: outside its own top-8 row
    off = load("generate_greedy_spec_off.json")["meta_info"]["output_token_logprobs"]
    np.testing.assert_allclose(scores.logprobs[5:], [r[0] for r in off[:5]], atol=1e-6)  # same positions
    with pytest.raises(ServerError, match="has 11 entries, expected 10"):  # a body for another start
        parse_score(body_of("generate_score_logprob_start_len_0.json"), ids[:2], ids[2:], 8)


def test_batch_body_is_refused_and_its_items_parse():
    """generate_batch2.json (0.5.23): a JSON array; each item is an ordinary answer; top_logprobs_num 0
    leaves the top rows absent (not reported: id -1)."""
    batch = load("generate_batch2.json")
    with pytest.raises(ServerError, match="JSON array of 2 items"):
        parse_generate(batch, 8)
    ids0, finish0, scores0, meta0 = parse_generate(batch[0], 8)
    ids1, finish1, _, meta1 = parse_generate(batch[1], 8)
    assert (finish0, len(ids0), finish1, ids1[-1]) == ("length", 8, "stop", 2)
    assert (scores0.top_ids == -1).all() and np.isnan(scores0.top_logprobs).all()
    s0 = spec_stats(meta0, len(ids0), "DFLASH")  # 9 accepted counted before the finish truncation
    assert (s0.verify_steps, s0.accepted, s0.proposed) == (2, 9, 30)
    request = load("generate_batch2.request.json")
    ours = generate_body([1, 2], 8, [2], 0)
    assert {"input_ids", "sampling_params", "return_logprob", "top_logprobs_num"} <= set(request) & set(ours)


def test_sent_sampling_keys_are_known_to_both_versions():
    """error_400_unknown_sampling_param.json (0.5.23) lists the allow-list in its message; 0.5.19's
    SamplingParams fields come from its source. An unknown key is 400 in 0.5.23 and 500 in 0.5.19
    (error_500_unknown_sampling_param_0.5.19.json), so every key sent must be known to both."""
    message = load("error_400_unknown_sampling_param.json")["error"]
    allowed = set(re.findall(r"`(\w+)`", message.split("expected one of", 1)[1]))
    assert allowed == SAMPLING_KEYS_0_5_23
    body = generate_body([1, 2, 3], 16, [2, 0], 8, rid="x")
    assert set(body["sampling_params"]) == SENT_SAMPLING_KEYS
    assert SENT_SAMPLING_KEYS <= SAMPLING_KEYS_0_5_23 and SENT_SAMPLING_KEYS <= SAMPLING_KEYS_0_5_19
    assert "seed" not in body["sampling_params"]
    assert isinstance(body["sampling_params"]["max_new_tokens"], int)  # a float is a 400 in 0.5.23
    assert body["sampling_params"]["ignore_eos"] is False  # true would also disable stop_token_ids
    assert body["logprob_start_len"] == -1 and body["return_logprob"] is True and body["top_logprobs_num"] == 8


def test_emulator_error_bodies_match_the_recorded_ones():
    """The three 0.5.23 error shapes and the 0.5.19 500, as the emulator answers them; the adapter's
    HTTP client names the status and the body."""
    cases = [("error_400_unknown_sampling_param.json", "0.5.23"), ("error_400_value_error.json", "0.5.23"),
             ("error_500_unknown_sampling_param_0.5.19.json", "0.5.19")]
    for name, version in cases:
        rec = load(name)
        with SGLangServer(version=version) as emu:
            endpoint = Endpoint(emu.url, connect_retries=0)
            r = endpoint.request("POST", "/generate", rec["_request"], expect=(200, 400, 500))
            assert r.status == rec["_http_status"], name
            assert r.content_type.split(";")[0] == rec["_content_type"].split(";")[0], name
            if "_body" in rec:
                assert r.body.decode() == rec["_body"], name
            else:
                assert json.loads(r.body) == body_of(name), name
            with pytest.raises(ServerError, match=f"HTTP {rec['_http_status']}"):
                endpoint.post_json("/generate", rec["_request"])
    rec = load("error_400_request_validation.json")
    with SGLangServer() as emu:
        r = Endpoint(emu.url).request("POST", "/generate", {"input_ids": [1, 2], "stream": "yes"}, expect=(400,))
        got = json.loads(r.body)
        assert list(got) == [k for k in rec if not k.startswith("_")] and got["type"] == "Bad Request"


def test_server_info_bodies():
    """server_info_{plain,dflash,deterministic}.json (0.5.23): the fingerprint's facts and
    Capabilities.deterministic, read from enable_deterministic_inference."""
    plain, dflash, det = (body_of(f"server_info_{n}.json") for n in ("plain", "dflash", "deterministic"))
    base = FakeEndpoint("http://b", {"/server_info": plain})
    spec = FakeEndpoint("http://s", {"/server_info": dflash})
    engine = engine_over(base, spec)
    info = engine.server_info(spec)
    assert info["version"] == "sglang 0.5.23"
    assert info["spec_config"]["speculative_algorithm"] == "DFLASH"
    assert info["spec_config"]["speculative_num_draft_tokens"] == 16
    assert info["summary"]["avg_spec_accept_length"] == pytest.approx(3.2716, abs=1e-3)
    assert info["summary"]["kv_cache_dtype"] == "auto" and "launch_command" in info["summary"]
    assert engine.server_info(base)["spec_config"] == {}
    assert engine.declared_algorithm(spec) == "DFLASH" and engine.declared_algorithm(base) is None
    assert engine.capabilities().deterministic is None
    engine = engine_over(FakeEndpoint("http://b", {"/get_server_info": det}),
                         FakeEndpoint("http://s", {"/server_info": det}))
    said = engine.capabilities().deterministic
    assert said.startswith("sglang /server_info enable_deterministic_inference=true")
    assert "baseline http://b: true" in said and "spec http://s: true" in said  # /get_server_info fallback
    assert engine.capabilities().deterministic_partial is None
    assert engine.capabilities().counters == "request" and engine.capabilities().scoring
    # one side only (the speculative server): reported, never strict
    caps = engine_over(FakeEndpoint("http://b", {"/server_info": plain}),
                       FakeEndpoint("http://s", {"/server_info": det})).capabilities()
    assert caps.deterministic is None
    assert caps.deterministic_partial == ("sglang /server_info enable_deterministic_inference=true, but not on every "
                                          "server of both sides (baseline http://b: false, spec http://s: true)")
    # a baseline whose /server_info cannot be read does not count as deterministic either
    caps = engine_over(FakeEndpoint("http://b", {}), FakeEndpoint("http://s", {"/server_info": det})).capabilities()
    assert caps.deterministic is None and "baseline http://b: unknown" in caps.deterministic_partial


@pytest.mark.parametrize("field, value", [("kv_cache_dtype", "fp8_e4m3"), ("quantization", "fp8"),
                                          ("attention_backend", "triton"), ("tp_size", 2), ("pp_size", 2),
                                          ("dtype", "bfloat16")])
def test_servers_that_compute_the_target_differently_are_refused(field, value):
    """The recorded plain and DFLASH /server_info bodies agree on what decides the target's numerics; a
    speculative server launched with another value of one of those fields (as its launch flag sets it)
    is refused before anything is judged, naming the field and both values; the model path is the
    target's identity, refused in its own words."""
    plain, dflash = body_of("server_info_plain.json"), body_of("server_info_dflash.json")
    assert all(plain[k] == dflash[k] for k in NUMERICS_KEYS) and NUMERICS_KEYS[0] in plain
    engine_over(FakeEndpoint("http://b", {"/server_info": plain}),
                FakeEndpoint("http://s", {"/server_info": dflash})).check_same_target()
    changed = {**dflash, field: value}
    before = "none" if plain[field] is None else plain[field]  # a null quantization: unquantized weights
    assert before != value
    with pytest.raises(ServerError) as refused:
        engine_over(FakeEndpoint("http://b", {"/server_info": plain}),
                    FakeEndpoint("http://s", {"/server_info": changed})).check_same_target()
    assert str(refused.value) == (
        f"the baseline server http://b and the spec server http://s do not compute the target the same way: "
        f"{field} {before!r} vs {value!r}; launch every server with the same dtype, quantization, KV cache "
        f"dtype, attention backend, tensor-parallel and pipeline-parallel size")
    other = {**dflash, "model_path": "org/another-model"}
    with pytest.raises(ServerError, match=r"do not serve the same target: model_path 'org/toy-2k' vs "
                                          r"'org/another-model'$"):
        engine_over(FakeEndpoint("http://b", {"/server_info": plain}),
                    FakeEndpoint("http://s", {"/server_info": other})).check_same_target()


def test_gate_refuses_a_speculative_server_with_another_kv_cache_dtype(tmp_path):
    """End to end: the speculative emulator reports kv_cache_dtype fp8_e4m3 (the baseline auto): nothing is
    judged, exit 3, the one line names both servers and the field."""
    with SGLangServer() as base, SGLangServer(speculative=True, server_args={"kv_cache_dtype": "fp8_e4m3"}) as spec:
        proc, records = run_lossless("sglang", base.url, spec.url, tmp_path / "report", "--target", str(TARGET),
                                     in_process=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    line = (f"the baseline server {base.url} and the spec server {spec.url} do not compute the target the same way: "
            f"kv_cache_dtype 'auto' vs 'fp8_e4m3'")
    assert line in out
    assert not [r for r in records if r["kind"] == "prompt" and r["verdict"]["class"] != "error"]


def test_preferred_sampling_params_and_stop_strings():
    """/generate merges the server's --preferred-sampling-params under the request's own keys: every
    knob is sent explicitly, and a preferred key that would still change the tokens (a stop string,
    a grammar, a logit bias) is an error naming it; so is an answer that stopped on a string."""
    info = body_of("server_info_plain.json")
    assert info["preferred_sampling_params"] is None
    info["preferred_sampling_params"] = {"stop": ["\n\n"], "temperature": 0.7}
    engine = engine_over(FakeEndpoint("http://b", {"/server_info": info}), FakeEndpoint("http://s", {}))
    problem = engine.preferred_problem(engine.baseline.fleet.endpoints[0])
    assert "--preferred-sampling-params sets stop" in problem and "temperature" not in problem
    info["preferred_sampling_params"] = '{"temperature": 0.7, "top_p": 0.8}'  # overridden by what is sent
    engine = engine_over(FakeEndpoint("http://b", {"/server_info": info}), FakeEndpoint("http://s", {}))
    assert engine.preferred_problem(engine.baseline.fleet.endpoints[0]) is None
    body = body_of("generate_greedy_spec_off.json")
    body["meta_info"]["finish_reason"] = {"type": "stop", "matched": "\n\n"}
    with pytest.raises(ServerError, match="stopped on the string/regex"):
        parse_generate(body, 8)
    body["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory", "status_code": 500}
    with pytest.raises(ServerError, match="aborted the request: 'out of memory'"):
        parse_generate(body, 8)


def test_emulator_shapes_match_the_recorded_bodies(tmp_path):
    """The emulator answers with the recorded key sets and key order (model_info.json,
    server_info_*.json, generate_greedy_spec_{on,off}.json, the score body), and health is
    200-empty once up (health_starting_503.json is the 503-empty of a server still starting)."""
    with SGLangServer(speculative=True) as spec, SGLangServer() as base:
        e = Endpoint(spec.url)
        assert set(e.get_json("/server_info")) == set(body_of("server_info_dflash.json"))
        assert set(Endpoint(base.url).get_json("/server_info")) == set(body_of("server_info_plain.json"))
        assert list(e.get_json("/model_info")) == list(body_of("model_info.json"))
        r = e.request("GET", "/health")
        assert r.status == 200 and r.body == b"" and health_ok(e) is None
        req = load("generate_greedy_spec_on.json")["_request"]
        ids = [1, 282, 203, 507, 318, 225, 24, 27, 389, 2, 203, 1, 281, 203]
        req = {**req, "input_ids": ids}
        on = e.post_json("/generate", req)
        off = Endpoint(base.url).post_json("/generate", req)
        rec_on, rec_off = body_of("generate_greedy_spec_on.json"), body_of("generate_greedy_spec_off.json")
        assert list(on) == list(rec_on) and list(off) == list(rec_off)
        spec_keys = [k for k in rec_on["meta_info"] if k.startswith("spec_")]
        assert [k for k in on["meta_info"] if not k.startswith("spec_")] == [
            k for k in rec_on["meta_info"] if not k.startswith("spec_")]
        assert [k for k in on["meta_info"] if k.startswith("spec_")] == spec_keys  # 16 tokens: >= 1 verify
        assert list(off["meta_info"]) == list(rec_off["meta_info"])
        score_req = {**load("generate_score_logprob_start_len_0.json")["_request"], "input_ids": ids}
        scored = Endpoint(base.url).post_json("/generate", score_req)
        assert scored["meta_info"]["input_token_logprobs"][0] == [None, ids[0], "<|im_start|>"]
        assert scored["meta_info"]["input_top_logprobs"][0] is None
        assert list(scored["meta_info"]) == list(body_of("generate_score_logprob_start_len_0.json")["meta_info"])
    rec = load("health_starting_503.json")
    assert rec["_http_status"] == 503 and rec["_body"] == ""


# ---------------------------------------------------------------------------------------------- launch argv

#: The deployments' launch commands the SGLang presets reproduce, verbatim (backslash-newlines joined).
LAUNCH_128K = ("python -m sglang.launch_server --model-path /mnt/sda6/download/qwen38-redhat-int4 "
            "--speculative-algorithm DFLASH --speculative-draft-model-path incoai/Qwen3.8-27B-DFlash2 "
            "--speculative-num-draft-tokens 8 --context-length 131072 --mem-fraction-static 0.92 "
            "--max-mamba-cache-size 5 --mamba-ssm-dtype bfloat16 --cuda-graph-backend-prefill=disabled "
            "--kv-cache-dtype fp8_e4m3 --page-size 1 --language-only")
LAUNCH_32K_DFLASH2 = ("python -m sglang.launch_server --model-path ./FP8 --context-length 32768 "
                    "--max-running-requests 16 --mamba-ssm-dtype bfloat16 --speculative-algorithm DFLASH "
                    "--speculative-draft-model-path ./FP8/DFlash2-FP8 --speculative-draft-model-quantization fp8 "
                    "--speculative-num-draft-tokens 8")
LAUNCH_32K_MTP = ("python -m sglang.launch_server --model-path ./FP8 --context-length 32768 --max-running-requests 16 "
                "--mamba-ssm-dtype bfloat16 --speculative-algorithm EAGLE --speculative-num-steps 3 "
                "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
LAUNCH_FIXTURE_NGRAM = ("python -m sglang.launch_server --model-path /m/t --speculative-algorithm NGRAM "
                        "--speculative-num-draft-tokens 4")
LAUNCH_FIXTURE_STANDALONE = ("python -m sglang.launch_server --model-path /m/t --speculative-algorithm STANDALONE "
                             "--speculative-draft-model-path /m/d --speculative-num-steps 3 --speculative-eagle-topk 1 "
                             "--speculative-num-draft-tokens 4")
SPEC_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-draft-tokens",
              "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-draft-model-quantization")


def pairs(argv: list[str]) -> list[tuple[str, str | None]]:
    """Flags with their values (``--a=b`` and ``--a b`` alike), order-free."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        if "=" in flag:
            name, value = flag.split("=", 1)
            out.append((name, value))
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((flag, argv[i + 1]))
            i += 1
        else:
            out.append((flag, None))
        i += 1
    return sorted(out, key=lambda p: (p[0], p[1] or ""))


def launch_pairs(command: str, *, drop_spec: bool = False, change: dict[str, str] | None = None):
    argv = shlex.split(command)[3:]  # drop "python -m sglang.launch_server"
    got = [p for p in pairs(argv) if not (drop_spec and p[0] in SPEC_FLAGS)]
    got = [(f, (change or {}).get(f, v)) for f, v in got]
    have = {f for f, _ in got}
    got += [(f, v) for f, v in (change or {}).items() if f not in have]
    return sorted(got, key=lambda p: (p[0], p[1] or ""))


def argv_of(preset: str, target: str, draft: str | None):
    return launch_configs(EngineOptions(preset=preset, target=target, draft=draft))


EXPECTED = {
    # preset: (target, draft, expected baseline pairs, expected spec pairs)
    "sglang-dflash2-128k": ("/mnt/sda6/download/qwen38-redhat-int4", "incoai/Qwen3.8-27B-DFlash2",
                            launch_pairs(LAUNCH_128K, drop_spec=True), launch_pairs(LAUNCH_128K)),
    "sglang-nospec-128k": ("/mnt/sda6/download/qwen38-redhat-int4", None,
                           launch_pairs(LAUNCH_128K, drop_spec=True), launch_pairs(LAUNCH_128K, drop_spec=True)),
    # inferred in the preset: under speculation a request takes 5 mamba state slots, so two streams need 10
    "sglang-dflash2-128k-dual": ("/mnt/sda6/download/qwen38-redhat-int4", "incoai/Qwen3.8-27B-DFlash2",
                                 launch_pairs(LAUNCH_128K, drop_spec=True, change={"--max-mamba-cache-size": "10",
                                                                              "--max-running-requests": "2"}),
                                 launch_pairs(LAUNCH_128K, change={"--max-mamba-cache-size": "10",
                                                              "--max-running-requests": "2"})),
    "sglang-mtp": ("./FP8", None, launch_pairs(LAUNCH_32K_MTP, drop_spec=True), launch_pairs(LAUNCH_32K_MTP)),
    "sglang-dflash2-fp8": ("./FP8", "./FP8/DFlash2-FP8", launch_pairs(LAUNCH_32K_DFLASH2, drop_spec=True),
                           launch_pairs(LAUNCH_32K_DFLASH2)),
    # the generic presets: the server's defaults, as the fixture servers run them (host flags aside)
    "sglang-ngram": ("/m/t", None, launch_pairs(LAUNCH_FIXTURE_NGRAM, drop_spec=True),
                     launch_pairs(LAUNCH_FIXTURE_NGRAM)),
    "sglang-standalone": ("/m/t", "/m/d", launch_pairs(LAUNCH_FIXTURE_STANDALONE, drop_spec=True),
                          launch_pairs(LAUNCH_FIXTURE_STANDALONE)),
}


def test_every_sglang_preset_has_an_expected_argv():
    assert sorted(EXPECTED) == presets_for("sglang")


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_argv_matches_the_field_reports(preset):
    target, draft, want_base, want_spec = EXPECTED[preset]
    base, spec = argv_of(preset, target, draft)
    assert pairs(base.args()) == want_base
    assert pairs(spec.args()) == want_spec
    # every flag is a ServerArgs field of 0.5.23 (server_info_plain.json lists all 546), spelled
    # --field-name; --tp-size, never --tp
    fields = set(body_of("server_info_plain.json"))
    for flag, _ in pairs(spec.args()) + pairs(base.args()):
        assert flag[2:].replace("-", "_") in fields, flag
    proc = spec.process("sglang-spec", log_dir=None)
    assert proc.argv()[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert proc.argv()[-4:-2] == ["--host", "127.0.0.1"] and proc.argv()[-2] == "--port"


def test_launch_options_and_argv_edges():
    base, spec = launch_configs(EngineOptions(preset="sglang-mtp", target="./FP8", num_draft_tokens=6,
                                              extra={"tp_size": 2, "deterministic": True,
                                                     "server_args": ["--enable-metrics"]}))
    assert ("--tp-size", "2") in pairs(spec.args()) and ("--tp", "2") not in pairs(spec.args())
    assert ("--speculative-num-draft-tokens", "6") in pairs(spec.args())
    assert ("--enable-deterministic-inference", None) in pairs(base.args())
    assert base.args()[-1] == "--enable-metrics"
    assert spec.spec_config()["speculative_algorithm"] == "EAGLE"
    with pytest.raises(ValueError, match="needs speculative_draft_model_path"):
        SGLangLaunch("m", speculative_algorithm="DFLASH").args()
    with pytest.raises(ValueError, match="speculative_num_draft_tokens is set but speculative_algorithm is not"):
        SGLangLaunch("m", speculative_num_draft_tokens=4).args()
    with pytest.raises(ValueError, match="--preset sglang-dflash2-fp8: this preset needs --draft"):
        launch_configs(EngineOptions(preset="sglang-dflash2-fp8", target="./FP8"))
    with pytest.raises(ValueError, match="--num-draft-tokens: preset sglang-nospec-128k launches no"):
        launch_configs(EngineOptions(preset="sglang-nospec-128k", target="t", num_draft_tokens=4))


def test_parallel_layout_options_reach_both_launches():
    """--engine-opt tp_size / dp_size / pp_size: the same layout on both sides."""
    base, spec = launch_configs(EngineOptions(preset="sglang-ngram", target="/m/t",
                                              extra={"tp_size": 2, "dp_size": 2, "pp_size": 1}))
    for launch in (base, spec):
        got = dict(p for p in pairs(launch.args()))
        assert (got["--tp-size"], got["--dp-size"], got["--pp-size"]) == ("2", "2", "1"), got


def test_presets_name_only_launch_fields():
    for name in presets_for("sglang"):
        for values in (PRESETS[name].baseline, PRESETS[name].spec):
            SGLangLaunch(**{k: ("x" if v in ("@target", "@draft") else v) for k, v in values.items()})


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("options, message", [
    (EngineOptions(baseline_urls=("http://127.0.0.1:1",), target=str(TARGET)),
     "--spec-url: the sglang engine needs both --baseline-url and --spec-url"),
    (EngineOptions(target=str(TARGET)), "--baseline-url: the sglang engine needs --baseline-url and --spec-url"),
    (EngineOptions(baseline_urls=("localhost:1",), spec_urls=("http://127.0.0.1:2",), target=str(TARGET)),
     "--baseline-url 'localhost:1': expected http://host:port"),
    (EngineOptions(baseline_urls=("http://a:1",), spec_urls=("http://a:2",), preset="sglang-mtp", target=str(TARGET)),
     "--preset sglang-mtp: give either --baseline-url/--spec-url"),
    (EngineOptions(baseline_urls=("http://a:1",), spec_urls=("http://a:2",), target="org/hub-model"),
     "--engine-opt tokenizer: the sglang engine sends token ids"),
    (EngineOptions(baseline_urls=("http://a:1",), spec_urls=("http://a:2",), extra={"tokenizer": "/nonexistent"}),
     "--engine-opt tokenizer=/nonexistent: not a directory"),
    (EngineOptions(baseline_urls=("http://a:1",), spec_urls=("http://a:2",), target=str(TARGET), num_draft_tokens=4),
     "--num-draft-tokens: the sglang servers at --spec-url run with their own launch setting"),
])
def test_check_options_one_line(options, message):
    with pytest.raises(ValueError) as err:
        check_options(options)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def servers():
    with SGLangServer() as base, SGLangServer(speculative=True) as spec:
        yield base, spec


def engine_for(base_url: str, spec_url: str):
    return load_engine("sglang", EngineOptions(baseline_urls=(base_url,), spec_urls=(spec_url,), target=str(TARGET)))


def request_for(engine, text: str, n: int = 16) -> GenerationRequest:
    ids = engine.encode_prompt(None, [{"role": "user", "content": text}])
    return GenerationRequest("p1", ids, n, engine.stop_token_ids(), 8)


def test_generate_and_score_over_http(servers):
    base, spec = servers
    engine = engine_for(base.url, spec.url)
    try:
        req = request_for(engine, "What is 12 + 9?")
        b = engine.generate([req], speculative=False)[0]
        s = engine.generate([req], speculative=True)[0]
        assert b.error is None and s.error is None
        assert b.output_ids == s.output_ids and b.spec.available is False
        assert s.spec.available and s.spec.verify_steps > 0 and s.spec.accepted > 0
        assert s.spec.proposed == s.spec.verify_steps * 4  # verify_ct x (speculative_num_draft_tokens 5 - 1)
        tf = engine.score(req.prompt_ids, b.output_ids, 8)
        np.testing.assert_allclose(tf.logprobs, b.scores.logprobs, atol=1e-4)
        assert tf.top_ids[:, 0].tolist() == b.output_ids
        sent = [body for method, path, body in spec.requests if path == "/generate"][-1]
        assert set(sent["sampling_params"]) <= SAMPLING_KEYS_0_5_19 & SAMPLING_KEYS_0_5_23
        fp = engine.fingerprint()
        assert fp.engine_version == "sglang 0.5.23" and fp.spec_config["speculative_algorithm"] == "STANDALONE"
        assert fp.target.sha256.startswith("sha256")
    finally:
        engine.close()


def test_misconfigured_servers_are_errors(servers):
    """A baseline URL that speculates, and a speculative server that reports no counters."""
    base, spec = servers
    with SGLangServer(speculative=True) as drafting:  # a second speculative server given as the baseline
        engine = engine_for(drafting.url, spec.url)
        try:
            r = engine.generate([request_for(engine, "What is 30 - 14?")], speculative=False)[0]
            assert "the baseline server declares speculative_algorithm=STANDALONE" in r.error and drafting.url in r.error
        finally:
            engine.close()
    with SGLangServer(speculative=True, drop_spec_fields=True) as silent:
        engine = engine_for(base.url, silent.url)
        try:
            r = engine.generate([request_for(engine, "What is 30 - 14?")], speculative=True)[0]
            assert "declares speculative_algorithm=STANDALONE" in r.error and "no spec_* keys" in r.error
            assert silent.url in r.error
        finally:
            engine.close()


def test_0_5_19_server_and_deterministic_flag(servers):
    """0.5.19: the same body is accepted (no 500), the counters come with the aliases; a baseline
    declaring enable_deterministic_inference next to a speculative server that does not is a
    one-sided declaration: Capabilities.deterministic_partial, not Capabilities.deterministic."""
    base, _ = servers
    with SGLangServer(speculative=True, version="0.5.19") as old, SGLangServer(declares_deterministic=True) as det:
        engine = engine_for(det.url, old.url)
        try:
            r = engine.generate([request_for(engine, "What is 12 + 9?")], speculative=True)[0]
            assert r.error is None and r.spec.available and r.spec.verify_steps > 0
            info = Endpoint(old.url).get_json("/server_info")
            assert info["version"] == "0.5.19" and "launch_command" not in info
            caps = engine.capabilities()
            assert caps.deterministic is None
            partial = caps.deterministic_partial
            assert partial and "enable_deterministic_inference=true" in partial
            assert f"baseline {det.url}: true" in partial and f"spec {old.url}: false" in partial
        finally:
            engine.close()


def test_gate_end_to_end_passes(servers, tmp_path, default_prompts):
    """`pytest suites/lossless --engine sglang --baseline-url … --spec-url …` over two emulators: exit 0,
    every math prompt exact, speculation active (per-request counters from meta_info). The command runs
    in this process: its verdict, report and exit status are the subject, not the process."""
    base, spec = servers
    proc, records = run_lossless("sglang", base.url, spec.url, tmp_path / "report", "--target", str(TARGET),
                                 in_process=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert len(prompts) == sum(p.category == "math" for p in default_prompts)  # --categories math
    assert all(r["verdict"]["class"] == "exact" for r in prompts)
    accepted = sum(r["spec"]["spec"]["accepted"] for r in prompts)
    assert accepted > 0 and all(r["spec"]["spec"]["available"] for r in prompts)
    run = next(r for r in records if r["kind"] == "run")
    assert run["capabilities"]["counters"] == "request" and run["fingerprint"]["engine"] == "sglang"
    assert records[-1]["kind"] == "verdict" and records[-1]["status"] == "PASS"


def test_gate_end_to_end_server_dies(servers, tmp_path):
    """A speculative server that stops answering after 2 speculative requests: exit 1, the 2 finished
    prompts kept in results.jsonl, the others `error` with a cause naming the endpoint. Before them it
    answered one scoring request per calibration prompt (the noise between the two instances)."""
    base, _ = servers
    calibration = sum(p.category == "math" for p in load_many([REPO / "prompts" / "default.jsonl"]))
    with SGLangServer(speculative=True, die_after=calibration + 2) as dying:
        proc, records = run_lossless("sglang", base.url, dying.url, tmp_path / "report",
                                     "--engine-opt", f"tokenizer={TARGET}", "--calibration", "selected",
                                     in_process=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert len(prompts) == calibration  # the math prompts: calibrated and judged
    exact = [r for r in prompts if r["verdict"]["class"] == "exact"]
    errors = [r for r in prompts if r["verdict"]["class"] == "error"]
    assert len(exact) == 2 and len(errors) == calibration - 2
    for r in errors:
        assert dying.url in r["verdict"]["reason"], r["verdict"]["reason"]
    assert records[-1]["kind"] == "verdict" and records[-1]["status"] == "FAIL"
    assert f"{calibration - 2} prompt(s) failed in the engine" in proc.stdout


# ---------------------------------------------------------------------------------------------- declared determinism

#: The fixture target is confident (top-1/top-2 margins of 5-18 nats, the closest call of a 16-token
#: math answer under 10), so the flip the emulator makes at an answer's closest call is a near tie
#: only under a threshold that wide; the drift bound is still measured.
NEAR_TIE_NATS = "20"


def _summary(report: Path) -> str:
    return (report / "summary.md").read_text()


def test_gate_declared_determinism_is_bit_exact(tmp_path):
    """Both servers answer /server_info with the recorded server_info_deterministic.json body
    (enable_deterministic_inference: true) and the speculative one flips one answer at its closest
    call: by default the gate is bit-exact and that near tie fails the gate (exit 1), saying the
    engine promised bit-exact output; with --allow-near-tie the same near tie passes within the
    budget, and the summary says the declaration was overridden."""
    with SGLangServer(declares_deterministic=True) as base, \
            SGLangServer(speculative=True, declares_deterministic=True, near_tie_flips=1) as spec:
        assert Endpoint(spec.url).get_json("/server_info")["enable_deterministic_inference"] is True
        report = tmp_path / "strict"
        proc, records = run_lossless("sglang", base.url, spec.url, report, "--target", str(TARGET),
                                     "--near-tie-nats", NEAR_TIE_NATS, "--near-tie-ceiling", NEAR_TIE_NATS,
                                     in_process=True)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]
        prompts = [r for r in records if r["kind"] == "prompt"]
        ties = [r["prompt"]["id"] for r in prompts if r["verdict"]["class"] == "near_tie"]
        assert len(spec.flipped) == 1 and len(ties) == 1 and spec.flipped[0].startswith(f"specparity-{ties[0]}-")
        assert all(r["verdict"]["class"] == "exact" for r in prompts if r["prompt"]["id"] not in ties)
        run = next(r for r in records if r["kind"] == "run")
        declared = run["capabilities"]["deterministic"]
        assert declared == (f"sglang /server_info enable_deterministic_inference=true (baseline {base.url}: true, "
                            f"spec {spec.url}: true)")
        assert run["config"]["policy"]["bit_exact"] is None  # auto: the declaration decides
        verdict = records[-1]
        assert verdict["kind"] == "verdict" and verdict["status"] == "FAIL"
        reason = (f"engine declares deterministic inference ({declared}): 1 near-tie flip(s) are a failure — the "
                  f"engine promised bit-exact output (pass --allow-near-tie to allow): {ties[0]}")
        assert verdict["failures"] == [reason]
        assert f"FAIL: {reason}" in proc.stdout
        assert f"near-tie policy: bit-exact: declared by the engine ({declared})" in proc.stdout
        assert f"[near_tie; bit-exact: declared by the engine ({declared})]" in proc.stdout  # the prompt's own test
        summary = _summary(report)
        assert f"- {reason}" in summary and f"- Near-tie policy: bit-exact: declared by the engine ({declared})" in summary

        spec.near_tie_flips = 1
        report = tmp_path / "allowed"
        proc, records = run_lossless("sglang", base.url, spec.url, report, "--target", str(TARGET),
                                     "--near-tie-nats", NEAR_TIE_NATS, "--near-tie-ceiling", NEAR_TIE_NATS, "--allow-near-tie",
                                     in_process=True)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        prompts = [r for r in records if r["kind"] == "prompt"]
        assert sum(r["verdict"]["class"] == "near_tie" for r in prompts) == 1 and len(spec.flipped) == 2
        assert records[-1]["status"] == "PASS" and records[-1]["failures"] == []
        line = f"{HAND_SET_BUDGET}: --allow-near-tie despite the declaration ({declared})"
        assert f"near-tie policy: {line}" in proc.stdout and f"- Near-tie policy: {line}" in _summary(report)


def test_gate_one_sided_determinism_is_not_strict(servers, tmp_path):
    """Only the speculative server declares deterministic inference: the declaration does not cover
    the baseline it is compared with, so the near tie stays within the near-tie budget (exit 0)
    and the summary says why the run was not made bit-exact."""
    base, _ = servers
    with SGLangServer(speculative=True, declares_deterministic=True, near_tie_flips=1) as spec:
        proc, records = run_lossless("sglang", base.url, spec.url, tmp_path / "report", "--target", str(TARGET),
                                     "--near-tie-nats", NEAR_TIE_NATS, "--near-tie-ceiling", NEAR_TIE_NATS,
                                     in_process=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert sum(r["verdict"]["class"] == "near_tie" for r in prompts) == 1
    caps = next(r for r in records if r["kind"] == "run")["capabilities"]
    assert caps["deterministic"] is None
    partial = caps["deterministic_partial"]
    assert partial == (f"sglang /server_info enable_deterministic_inference=true, but not on every server of both "
                       f"sides (baseline {base.url}: false, spec {spec.url}: true)")
    line = f"{HAND_SET_BUDGET}; not bit-exact, since a declaration counts only when it covers both sides: {partial}"
    assert f"near-tie policy: {line}" in proc.stdout
    assert f"- Near-tie policy: {line}" in _summary(tmp_path / "report")
    assert records[-1]["status"] == "PASS"


@pytest.mark.parametrize("value", [None, "NONE", "None", "null", ""])
def test_every_spelling_of_no_algorithm_declares_none(value):
    """SGLang's /server_info prints SpeculativeAlgorithm.NONE as "NONE"; null and the other
    spellings mean the same: no speculation (not an algorithm called "NONE")."""
    from specparity.engines.server.sglang_wire import declared_name

    assert declared_name(value) is None
    assert declared_name("DFLASH") == "DFLASH"


def test_spec_server_that_declares_no_algorithm_is_speculation_inactive(tmp_path):
    """Two plain servers given as baseline and "speculative": every prompt is exact, yet the gate fails
    as "speculation inactive" (exit 1), also under --allow-unknown-activity: nothing is unknown here."""
    with SGLangServer() as base, SGLangServer() as plain:
        assert plain.server_info()["speculative_algorithm"] is None
        proc, records = run_lossless("sglang", base.url, plain.url, tmp_path / "report", "--target", str(TARGET),
                                     "--allow-unknown-activity", in_process=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert prompts and all(r["verdict"]["class"] == "exact" for r in prompts)
    assert all("declares no speculative_algorithm" in r["spec"]["spec"]["source"] for r in prompts)
    verdict = records[-1]
    assert verdict["kind"] == "verdict" and verdict["exit_code"] == 1
    assert any(f.startswith("speculation inactive") for f in verdict["failures"]), verdict["failures"]
    assert not any("unknown" in f for f in verdict["failures"])


def test_live_acceptance_probe_calls_a_server_without_an_algorithm_a_failure(servers):
    """The live acceptance probe against a "speculative" server that declares no algorithm: speculation
    never ran (a failure), not "unknown" (which a CI gate might let through)."""
    from specparity.probes import live
    from specparity.probes.finding import Status

    base, _ = servers
    with SGLangServer() as plain:
        engine = engine_for(base.url, plain.url)
        try:
            finding = live.acceptance_floor(engine, prompts=live.PROMPTS[:1], max_new_tokens=8)
        finally:
            engine.close()
    assert finding.status is Status.FAIL, finding.render()
    assert "speculation never ran" in finding.summary
