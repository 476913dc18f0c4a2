"""The ``vllm`` engine adapter, tested without a running vLLM server (CI has no GPU).

Nothing here talks to vLLM. The adapter (``specparity/engines/server/vllm.py``) is tested against

* the answers a **live vLLM 0.26.0** gave to the adapter's own requests, recorded on one H200
  (``tests/data/vllm-0.26.0/``): parsed as the gate parses them, and the emulator built with
  ``version="0.26.0"`` checked against them field by field;
* the response bodies and ``/metrics`` expositions in ``tests/data/vllm/`` — derived from the source
  of the vLLM **0.33.0** wheel, never recorded from a running server (each file's ``_source`` says
  so and cites ``file:line``; ``metrics.md`` for the two ``.txt`` files);
* the vLLM protocol emulator ``tests/fakes/vllm.py``: a small HTTP server that speaks vLLM 0.33's
  OpenAI completions format as read from that source and computes tokens, logprobs and the
  Prometheus speculation counters with the committed fixture models through specparity's
  in-process ``HFEngine``; its ``spec_disabled_for_logprobs`` switch reproduces what vLLM
  **0.11–0.13** did to logprob requests under the ngram/suffix proposers (read in those wheels:
  drafting silently skipped, counters never move).

No vLLM deployment's launch flags were available (only "vLLM with MTP"), so the vllm-* presets'
argv are checked against the flags read in the 0.33.0 source.

A pass on the 0.33.0 data means the adapter agrees with what was read from that source; the live
runs of the gate itself (docs/SERVERS.md "Verified live") are made with ``tools/gpu/vllm_live.sh``.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest

from fakes import VLLMServer
from fakes.backend import DATA, TARGET
from fakes.gate import run_lossless
from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.engines.server.engine import HFTokenizer
from specparity.engines.server.http import Endpoint, ServerError
from specparity.engines.server.presets import VLLM_GPU_FRACTION, presets_for
from specparity.engines.server.vllm_wire import (NUMERICS_PATHS, SPEC_COUNTERS, completion_body, normalise_dtype,
                                                 parse_completion, parse_metrics, parse_prompt_logprobs,
                                                 parse_token_key, reported_numerics, request_spec_stats,
                                                 stable_spec_config, top_k_disabled)
from specparity.engines.server.vllm_launch import VLLMLaunch, VLLMApi, drop_unsupported_per_request, launch_configs
from specparity.engines.server.vllm import check_options
from specparity.gate import exitcodes
from specparity.gate.decision import decide
from specparity.model.types import GenerationRequest

pytestmark = pytest.mark.offline

VL = DATA / "vllm"


def load(name: str):
    return json.loads((VL / name).read_text())


def body_of(name: str):
    return {k: v for k, v in load(name).items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------------------- recorded bodies


def test_completion_with_token_id_keys():
    """completions_greedy_logprobs8_token_ids.json (0.33.0): ids from "token_id:N", cross-checked
    against choices[0].token_ids; rows sorted, the greedy token first."""
    data = load("completions_greedy_logprobs8_token_ids.json")
    ids, finish, scores, choice = parse_completion(body_of("completions_greedy_logprobs8_token_ids.json"), 8)
    assert ids == data["choices"][0]["token_ids"] and finish == "stop" and choice["stop_reason"] is None
    np.testing.assert_allclose(scores.logprobs, data["choices"][0]["logprobs"]["token_logprobs"], atol=1e-6)
    assert scores.top_ids[:, 0].tolist() == ids
    assert (np.diff(scores.top_logprobs, axis=1) <= 0).all()
    bad = body_of("completions_greedy_logprobs8_token_ids.json")
    bad["choices"][0]["token_ids"] = ids[:-1]
    with pytest.raises(ServerError, match="disagree with logprobs.tokens"):
        parse_completion(bad, 8)


def test_text_keys_are_refused():
    """completions_greedy_logprobs8_text_keys.json (0.33.0): without return_tokens_as_token_ids the keys
    are decoded strings and collide (7 keys at position 6): never parsed as if they were exact."""
    data = load("completions_greedy_logprobs8_text_keys.json")
    assert len(data["choices"][0]["logprobs"]["top_logprobs"][6]) == 7
    with pytest.raises(ValueError, match="ignored return_tokens_as_token_ids"):
        parse_completion(body_of("completions_greedy_logprobs8_text_keys.json"), 8)
    assert parse_token_key("token_id:1587") == 1587


def test_per_request_spec_metrics():
    """completions_greedy_spec_request_metrics.json (0.33.0, --per-request-spec-decode-metrics
    summary): 3 verify steps, 6 of 21 drafts accepted."""
    s = request_spec_stats(body_of("completions_greedy_spec_request_metrics.json"))
    assert (s.available, s.proposed, s.accepted, s.verify_steps) == (True, 21, 6, 3)
    assert request_spec_stats(body_of("completions_greedy_logprobs8_token_ids.json")) is None  # metrics: null


def test_prompt_logprobs_scoring():
    """completions_echo_scoring.json (0.33.0): choices[0].prompt_logprobs = [null, {"<id>": {logprob,
    rank, decoded_token}}, ...]; the actual token first (position 2: rank 12, outside the top 8, so
    the dict has 9 entries). Equal to the SGLang scores of the same toy model."""
    data = load("completions_echo_scoring.json")
    ids = data["_request"]["prompt"]
    rows = data["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows[2]) == 9
    scores = parse_prompt_logprobs(rows, ids[:1], ids[1:], 8)
    np.testing.assert_allclose(scores.logprobs, data["choices"][0]["logprobs"]["token_logprobs"][1:11], atol=1e-6)
    assert 1183 not in scores.top_ids[1].tolist() and scores.top_ids[1, 0] == 1354
    assert (np.diff(scores.top_logprobs, axis=1) <= 0).all()
    sglang = json.loads((DATA / "sglang" / "generate_score_logprob_start_len_0.json").read_text())
    np.testing.assert_allclose(scores.logprobs, [r[0] for r in sglang["meta_info"]["input_token_logprobs"][1:]],
                               atol=1e-6)
    with pytest.raises(ValueError, match="has 12 positions, expected 11"):
        parse_prompt_logprobs(rows + [None], ids[:1], ids[1:], 8)


def test_metrics_expositions():
    """metrics_before.txt / metrics_after.txt (0.33.0 exposition): the three counters summed over
    labels; the delta is the request of completions_greedy_spec_request_metrics.json."""
    before = parse_metrics((VL / "metrics_before.txt").read_text())
    after = parse_metrics((VL / "metrics_after.txt").read_text())
    assert before == {"proposed": 0, "accepted": 0, "verify_steps": 0, "finished": 0, "generated": 0,
                      "spec_families": True}
    # the one request: finished (summed over finished_reason), with its 10 generated tokens
    assert after == {"proposed": 21, "accepted": 6, "verify_steps": 3, "finished": 1, "generated": 10,
                     "spec_families": True}
    plain = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n" \
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    assert parse_metrics(plain)["spec_families"] is False
    assert parse_metrics(plain)["finished"] is None and parse_metrics(plain)["generated"] is None  # not exposed
    two_engines = (VL / "metrics_after.txt").read_text().replace('engine="0"', 'engine="1"')
    summed = parse_metrics((VL / "metrics_after.txt").read_text() + "\n".join(
        line for line in two_engines.splitlines() if line.startswith("vllm:spec_decode_num_draft")) + "\n")
    assert summed["verify_steps"] == 6 and summed["proposed"] == 42  # summed over the engine label


def test_request_body_matches_the_recorded_request():
    """Every sampling knob of the recorded request, with the same values (vLLM fills unset ones from
    generation_config.json); min_p 0 (> 1e-5 is a 400 with speculation); top_k per version."""
    rec = load("completions_greedy_logprobs8_token_ids.json")["_request"]
    ours = completion_body("org/toy-2k", rec["prompt"], 16, [], logprobs=8, top_k=top_k_disabled("0.33.0"))
    for key in ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "logprobs", "return_tokens_as_token_ids",
                "return_token_ids", "stop_token_ids", "ignore_eos"):
        assert ours[key] == rec[key], key
    assert top_k_disabled(body_of("version.json")["version"]) == 0
    assert top_k_disabled("0.10.2") == -1 and top_k_disabled(None) == -1


def test_emulator_bodies_match_the_recorded_ones():
    """The emulator's answers have the recorded key order; its 400s equal error_400_max_logprobs.json
    and error_400_min_p_with_spec.json byte for byte; /v1/models and /version as recorded."""
    with VLLMServer(speculative=True) as spec:
        e = Endpoint(spec.url)
        for name in ("error_400_max_logprobs.json", "error_400_min_p_with_spec.json"):
            rec = load(name)
            req = {**rec["_request"], "model": spec.served, "top_p": 1.0, "top_k": 0,
                   "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "min_p": rec["_request"].get("min_p", 0.0)}
            r = e.request("POST", "/v1/completions", req, expect=(400,))
            assert json.loads(r.body) == body_of(name), name
        models = e.get_json("/v1/models")
        assert list(models["data"][0]) == list(body_of("models.json")["data"][0])
        assert e.get_json("/version") == body_of("version.json")
        rec = body_of("completions_greedy_logprobs8_token_ids.json")
        req = load("completions_greedy_logprobs8_token_ids.json")["_request"]
        got = e.post_json("/v1/completions", {**req, "model": spec.served, "prompt": [1, 282, 203, 507, 318, 225]})
        assert list(got) == list(rec) and list(got["choices"][0]) == list(rec["choices"][0])
        assert list(got["usage"]) == list(rec["usage"])
        assert list(got["choices"][0]["logprobs"]) == list(rec["choices"][0]["logprobs"])
        assert all(t.startswith("token_id:") for t in got["choices"][0]["logprobs"]["tokens"])
        assert got["system_fingerprint"].startswith("vllm-0.33.0-")
        text = e.request("GET", "/metrics").body.decode()
        assert [f for f in parse_metrics(text) if f in SPEC_COUNTERS] == list(SPEC_COUNTERS)
        want = {(fam.split()[2], fam.split()[3]) for fam in (VL / "metrics_before.txt").read_text().splitlines()
                if fam.startswith("# TYPE")}
        have = {(fam.split()[2], fam.split()[3]) for fam in text.splitlines() if fam.startswith("# TYPE")}
        assert want <= have  # the same families with the same types


# ---------------------------------------------------------------------------------------------- launch argv


def test_every_vllm_preset_argv():
    """Every vLLM preset: `vllm serve MODEL --speculative-config JSON --gpu-memory-utilization F`, the draft
    path filled into the speculative config
    (flags read in 0.33.0: vllm/engine/arg_utils.py:1864; batch invariance is the env var
    VLLM_BATCH_INVARIANT only); F per launch so that both fit one GPU (vLLM's default 0.9 cannot
    start twice on one device: seen live with 0.26.0)."""
    assert presets_for("vllm") == ["vllm-draft-model", "vllm-eagle3", "vllm-mtp", "vllm-ngram"]
    want = {"vllm-mtp": {"method": "mtp", "num_speculative_tokens": 3},
            "vllm-draft-model": {"method": "draft_model", "model": "/models/d", "num_speculative_tokens": 4},
            "vllm-eagle3": {"method": "eagle3", "model": "/models/d", "num_speculative_tokens": 4},
            "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2}}
    share = ["--gpu-memory-utilization", str(VLLM_GPU_FRACTION)]  # two launches fit one GPU
    assert 2 * VLLM_GPU_FRACTION < 0.9
    for name in presets_for("vllm"):
        base, spec = launch_configs(EngineOptions(preset=name, target="/models/int8", draft="/models/d"))
        assert base.args() == ["/models/int8", *share]
        args = spec.args()
        assert args[:2] == ["/models/int8", "--speculative-config"] and json.loads(args[2]) == want[name]
        assert args[3:] == share
        proc = spec.process("vllm-spec", log_dir=None)
        assert proc.argv()[0].endswith("vllm") and proc.argv()[1] == "serve" and proc.env == {}
        assert proc.argv()[-4:-2] == ["--host", "127.0.0.1"]


def test_launch_options():
    base, spec = launch_configs(EngineOptions(preset="vllm-mtp", target="/m", num_draft_tokens=5,
                                              extra={"batch_invariant": True, "max_logprobs": 32,
                                                     "per_request_metrics": "summary", "entrypoint": "api_server",
                                                     "server_args": ["--max-model-len", "8192"]}))
    assert json.loads(spec.args()[3])["num_speculative_tokens"] == 5
    assert spec.args()[:2] == ["--model", "/m"]
    i = spec.args().index("--max-logprobs")
    assert spec.args()[i + 1] == "32" and "--per-request-spec-decode-metrics" in spec.args()
    assert "--per-request-spec-decode-metrics" not in base.args() and base.args()[-2:] == ["--max-model-len", "8192"]
    assert spec.process("s", log_dir=None).env == {"VLLM_BATCH_INVARIANT": "1"}
    assert spec.program == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert not any("batch-invariant" in a for a in spec.args() + base.args())
    with pytest.raises(ValueError, match="per_request_spec_decode_metrics needs speculative_config"):
        VLLMLaunch("m", per_request_spec_decode_metrics="summary").args()


def test_parallel_layout_options_reach_both_launches():
    """--engine-opt tensor_parallel_size / pipeline_parallel_size / data_parallel_size: the same layout on
    both sides (the identity check refuses servers that compute the target with another TP or PP size)."""
    base, spec = launch_configs(EngineOptions(preset="vllm-ngram", target="/m", extra={
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "data_parallel_size": 2}))
    for launch in (base, spec):
        a = launch.args()
        for flag, value in (("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "1"),
                            ("--data-parallel-size", "2")):
            assert a[a.index(flag) + 1] == value, a
    assert "--tensor-parallel-size" not in launch_configs(EngineOptions(preset="vllm-ngram", target="/m"))[1].args()
    from specparity.engines.server import vllm as vllm_engine

    assert {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"} <= set(vllm_engine.OPTIONS)
    with pytest.raises(ValueError):
        vllm_engine.OPTIONS["tensor_parallel_size"].parse("0")


@pytest.mark.parametrize("options, message", [
    (EngineOptions(spec_urls=("http://127.0.0.1:1",), target=str(TARGET)),
     "--baseline-url: the vllm engine needs both --baseline-url and --spec-url"),
    (EngineOptions(preset="vllm-mtp", extra={"tokenizer": str(TARGET)}),
     "--preset vllm-mtp: this preset needs --target"),
    (EngineOptions(baseline_urls=("http://a:1",), spec_urls=("ftp://a:2",), target=str(TARGET)),
     "--spec-url 'ftp://a:2': expected http://host:port"),
    (EngineOptions(baseline_urls=("http://a:1",), spec_urls=("http://a:2",)),
     "--engine-opt tokenizer: the vllm engine sends token ids"),
])
def test_check_options_one_line(options, message):
    with pytest.raises(ValueError) as err:
        check_options(options)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def servers():
    with VLLMServer() as base, VLLMServer(speculative=True) as spec:
        yield base, spec


def engine_for(base_url: str, spec_url: str, **extra: object):
    return load_engine("vllm", EngineOptions(baseline_urls=(base_url,), spec_urls=(spec_url,),
                                             extra={"tokenizer": str(TARGET), **{k: str(v) for k, v in extra.items()}}))


def request_for(engine, text: str, k: int = 8) -> GenerationRequest:
    ids = engine.encode_prompt(None, [{"role": "user", "content": text}])
    return GenerationRequest("p1", ids, 16, engine.stop_token_ids(), k)


def test_generate_score_and_counters_over_http(servers):
    base, spec = servers
    engine = engine_for(base.url, spec.url)
    try:
        req = request_for(engine, "What is 12 + 9?")
        before = engine.activity_counters()
        b = engine.generate([req], speculative=False)[0]
        s = engine.generate([req], speculative=True)[0]
        after = engine.activity_counters()
        assert b.error is None and s.error is None and b.output_ids == s.output_ids
        assert s.spec.available is False and "run-wide" in s.spec.source  # aggregate only
        assert after["accepted"] > before["accepted"] and after["verify_steps"] > before["verify_steps"]
        assert spec.url in after["source"]
        tf = engine.score(req.prompt_ids, b.output_ids, 8)
        np.testing.assert_allclose(tf.logprobs, b.scores.logprobs, atol=1e-4)
        assert tf.top_ids[:, 0].tolist() == b.output_ids
        caps = engine.capabilities()
        assert (caps.counters, caps.top_k, caps.scoring, caps.deterministic) == ("aggregate", 20, True, None)
        sent = [body for _, path, body in spec.requests if path == "/v1/completions"][-1]
        assert sent["top_k"] == 0 and sent["return_tokens_as_token_ids"] and sent["logprobs"] == 8
        fp = engine.fingerprint()
        assert fp.engine_version == "vllm 0.33.0" and fp.target.path == str(TARGET)
        r = engine.generate([request_for(engine, "What is 12 + 9?", k=21)], speculative=True)[0]
        assert "--max-logprobs 20" in r.error
    finally:
        engine.close()


def test_misconfigured_servers_and_per_request_metrics(servers):
    base, spec = servers
    engine = engine_for(spec.url, base.url)  # swapped: the baseline speculates, the spec server does not
    try:
        req = request_for(engine, "What is 30 - 14?")
        r = engine.generate([req], speculative=False)[0]
        assert "the baseline server exposes vllm:spec_decode_* counters" in r.error and spec.url in r.error
        r = engine.generate([req], speculative=True)[0]
        assert "launched without --speculative-config" in r.error and base.url in r.error
    finally:
        engine.close()
    with VLLMServer(speculative=True, per_request_metrics=True) as detailed:
        engine = engine_for(base.url, detailed.url)
        try:
            s = engine.generate([request_for(engine, "What is 30 - 14?")], speculative=True)[0]
            assert s.spec.available and s.spec.accepted > 0 and "metrics.speculative_decoding" in s.spec.source
        finally:
            engine.close()


def test_gate_end_to_end_passes(servers, tmp_path, default_prompts):
    """`pytest suites/lossless --engine vllm --baseline-url … --spec-url …` over two emulators: exit 0,
    every math prompt exact, speculation active (the /metrics counters moved). The command runs in this
    process: its verdict, report and exit status are the subject, not the process."""
    base, spec = servers
    proc, records = run_lossless("vllm", base.url, spec.url, tmp_path / "report", "--engine-opt",
                                 f"tokenizer={TARGET}", in_process=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert len(prompts) == sum(p.category == "math" for p in default_prompts)  # --categories math
    assert all(r["verdict"]["class"] == "exact" for r in prompts)
    agg = next(r for r in records if r["kind"] == "aggregate_counters")
    assert agg["accepted"] > 0 and agg["verify_steps"] > 0 and "vllm:spec_decode_num_drafts_total" in agg["source"]
    run = next(r for r in records if r["kind"] == "run")
    assert run["capabilities"]["counters"] == "aggregate"
    assert records[-1]["kind"] == "verdict" and records[-1]["status"] == "PASS"


def test_gate_end_to_end_speculation_disabled_for_logprobs(servers, tmp_path, default_prompts):
    """vLLM 0.11–0.13 behaviour (ngram/suffix proposers skipped logprob requests silently): every
    token matches, but the counters never moved — the gate fails as "speculation inactive", exit 1."""
    base, _ = servers
    with VLLMServer(speculative=True, spec_disabled_for_logprobs=True) as lazy:
        proc, records = run_lossless("vllm", base.url, lazy.url, tmp_path / "report", "--target", str(TARGET),
                                     in_process=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert len(prompts) == sum(p.category == "math" for p in default_prompts)  # --categories math
    assert all(r["verdict"]["class"] == "exact" for r in prompts)
    agg = next(r for r in records if r["kind"] == "aggregate_counters")
    assert (agg["proposed"], agg["accepted"], agg["verify_steps"]) == (0, 0, 0)
    verdict = records[-1]
    assert verdict["kind"] == "verdict" and verdict["status"] == "FAIL"
    assert any(f.startswith("speculation inactive") for f in verdict["failures"])
    assert "speculation inactive" in proc.stdout


class SharedServer(VLLMServer):
    """A speculative vLLM server that another client uses as well: when the gate's first speculative
    decode arrives, it waits for that client's request to be answered first (so the other traffic
    falls inside the speculative phase on every run, however the threads are scheduled)."""

    def __init__(self, other_prompt: list[int], **kw):
        super().__init__(**kw)
        self.other_prompt = other_prompt
        self.other_answered = threading.Event()
        self.other_tokens = 0
        self._started = threading.Lock()

    def completions(self, body, fault=None):
        gate_decode = isinstance(body, dict) and body.get("logprobs") is not None and (body.get("max_tokens") or 0) > 1
        if gate_decode and self._started.acquire(blocking=False):
            threading.Thread(target=self._other_client, daemon=True).start()
            assert self.other_answered.wait(60), "the other client got no answer"
        return super().completions(body, fault)

    def _other_client(self) -> None:
        """Another client's plain completion: no logprobs, so this server drafts for it."""
        body = {"model": self.served, "prompt": self.other_prompt, "max_tokens": 16, "temperature": 0.0, "top_p": 1.0,
                "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0}
        answer = Endpoint(self.url).post_json("/v1/completions", body)
        self.other_tokens = answer["usage"]["completion_tokens"]
        self.other_answered.set()


def test_another_clients_drafts_are_never_this_runs_activity(servers, tmp_path, default_prompts):
    """The server skips drafting for the gate's logprob requests (vLLM 0.11–0.13), and another client
    sends it a plain request during the speculative phase: the server-wide draft counters move, for the
    other client. The gate compares what the server finished and generated with what it sent and got
    back, and says "activity unknown: other traffic on the server" — never "speculation active"."""
    base, _ = servers
    tokenizer = HFTokenizer(str(TARGET))
    other = tokenizer.encode_prompt(None, [{"role": "user", "content": "Count from one to ten."}])
    with SharedServer(other, speculative=True, spec_disabled_for_logprobs=True) as shared:
        proc, records = run_lossless("vllm", base.url, shared.url, tmp_path / "report", "--target", str(TARGET),
                                     in_process=True)
    assert shared.other_answered.is_set() and shared.other_tokens > 0
    out = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.GATE_FAILED, out[-3000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    assert len(prompts) == sum(p.category == "math" for p in default_prompts)
    assert all(r["verdict"]["class"] == "exact" for r in prompts)
    agg = next(r for r in records if r["kind"] == "aggregate_counters")
    assert agg["accepted"] > 0, agg  # the other client's drafts: what the gate used to call "active"
    mine = sum(len(r["spec"]["output_ids"]) for r in prompts)
    reason = agg["unattributed"]
    assert reason.startswith("activity unknown: other traffic on the server: during the speculative phase the "
                             f"speculative servers finished {len(prompts) + 1} request(s) and generated "
                             f"{mine + shared.other_tokens} token(s), this run sent them {len(prompts)} and got "
                             f"{mine} back (vllm:request_success_total, vllm:generation_tokens_total at "
                             f"{shared.url})"), reason
    verdict = records[-1]
    assert verdict["status"] == "FAIL" and f"speculation {reason}" in verdict["failures"]
    assert not any(f.startswith("speculation inactive") or "speculation active" in f for f in verdict["failures"])
    assert f"FAIL: speculation {reason}" in proc.stdout
    # the journal alone decides the same (`specparity report`)
    from specparity.run.journal import load_run

    rebuilt = decide(load_run(tmp_path / "report"))
    assert f"speculation {reason}" in rebuilt.failures and rebuilt.exit_code == exitcodes.GATE_FAILED


# ---------------------------------------------------------------------------------------------- batch invariance


def test_batch_invariance_is_declared_only_for_both_sides():
    """Capabilities.deterministic from VLLM_BATCH_INVARIANT: every server's dev-mode /server_info
    (vllm_env holds the parsed value, JSON true) on both sides, or both launches; one side only is
    deterministic_partial, never strict; servers without the dev route declare nothing."""
    with VLLMServer(dev_mode=True, batch_invariant=True) as base, \
            VLLMServer(speculative=True, dev_mode=True, batch_invariant=True) as spec, \
            VLLMServer(speculative=True, dev_mode=True) as plain_spec, VLLMServer() as no_dev, \
            VLLMServer() as no_dev2:
        info = Endpoint(spec.url).get_json("/server_info?config_format=json")
        assert info["vllm_env"]["VLLM_BATCH_INVARIANT"] is True and set(info) == {"vllm_config", "vllm_env",
                                                                                   "system_env"}
        caps = engine_for(base.url, spec.url).capabilities()
        assert caps.deterministic == (f"vllm /server_info vllm_env.VLLM_BATCH_INVARIANT=true (baseline {base.url}: "
                                      f"true, spec {spec.url}: true; VLLM_SERVER_DEV_MODE=1 servers)")
        assert caps.deterministic_partial is None
        caps = engine_for(base.url, plain_spec.url).capabilities()
        assert caps.deterministic is None
        assert caps.deterministic_partial == (f"vllm /server_info vllm_env.VLLM_BATCH_INVARIANT=true, but not on "
                                              f"every server of both sides (baseline {base.url}: true, spec "
                                              f"{plain_spec.url}: false)")
        caps = engine_for(no_dev.url, spec.url).capabilities()
        assert caps.deterministic is None
        assert f"baseline {no_dev.url}: unknown (no dev-mode /server_info)" in caps.deterministic_partial
        caps = engine_for(no_dev.url, no_dev2.url).capabilities()
        assert (caps.deterministic, caps.deterministic_partial) == (None, None)
    # launched servers: --engine-opt batch_invariant=true sets the variable on both (by construction)
    both = launch_configs(EngineOptions(preset="vllm-mtp", target="/m", extra={"batch_invariant": True}))
    caps = _launched(both).capabilities()
    assert caps.deterministic == "vllm: VLLM_BATCH_INVARIANT=1 set in the environment of both launched servers (env only)"
    base_only = (both[0], launch_configs(EngineOptions(preset="vllm-mtp", target="/m"))[1])
    caps = _launched(base_only).capabilities()
    assert caps.deterministic is None
    assert caps.deterministic_partial == "vllm: VLLM_BATCH_INVARIANT=1 set for the baseline launch only"


def _launched(launches):
    """A VLLMEngine as create() builds it for two launches, without starting them."""
    from specparity.engines.server.http import Fleet
    from specparity.engines.server.engine import Session
    from specparity.engines.server.vllm import VLLMEngine

    sessions = [Session(role, Fleet(role, [Endpoint(f"http://127.0.0.1:{port}")]), [])
                for role, port in (("baseline", 1), ("spec", 2))]
    return VLLMEngine(EngineOptions(), *sessions, None, target=None, draft=None, launches=launches,
                      max_concurrency=8, max_logprobs=20)


def test_gate_batch_invariant_is_bit_exact(tmp_path):
    """Both vLLM servers declare VLLM_BATCH_INVARIANT on their dev-mode /server_info and the
    speculative one flips one answer at its closest call: the runner records the declaration and
    decide() applies the strict policy — the near tie fails the gate (exit 1), naming the
    declaration; the fixture target's margins need a wide --near-tie-nats to call the flip a near tie."""
    with VLLMServer(dev_mode=True, batch_invariant=True) as base, \
            VLLMServer(speculative=True, dev_mode=True, batch_invariant=True, near_tie_flips=1) as spec:
        proc, records = run_lossless("vllm", base.url, spec.url, tmp_path / "report", "--engine-opt",
                                     f"tokenizer={TARGET}", "--near-tie-nats", "20", "--near-tie-ceiling", "20",
                                     in_process=True)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    prompts = [r for r in records if r["kind"] == "prompt"]
    ties = [r["prompt"]["id"] for r in prompts if r["verdict"]["class"] == "near_tie"]
    assert len(spec.flipped) == 1 and len(ties) == 1
    assert all(r["verdict"]["class"] == "exact" for r in prompts if r["prompt"]["id"] not in ties)
    declared = next(r for r in records if r["kind"] == "run")["capabilities"]["deterministic"]
    assert declared.startswith("vllm /server_info vllm_env.VLLM_BATCH_INVARIANT=true (baseline ")
    verdict = records[-1]
    assert verdict["kind"] == "verdict" and verdict["status"] == "FAIL"
    assert verdict["failures"] == [
        f"engine declares deterministic inference ({declared}): 1 near-tie flip(s) are a failure — the engine "
        f"promised bit-exact output (pass --allow-near-tie to allow): {ties[0]}"]
    assert f"near-tie policy: bit-exact: declared by the engine ({declared})" in proc.stdout
    assert f"- Near-tie policy: bit-exact: declared by the engine ({declared})" in \
        (tmp_path / "report" / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------- live vLLM 0.26.0

V026 = DATA / "vllm-0.26.0"


def recorded_026(name: str) -> list[dict]:
    """The exchanges of one live 0.26.0 server (tests/data/vllm-0.26.0/capture-<name>.json)."""
    return json.loads((V026 / f"capture-{name}.json").read_text())["exchanges"]


def exchange(name: str, label: str) -> dict:
    return next(e for e in recorded_026(name) if e["label"] == label)


def skeleton(obj):
    """A JSON value's shape: key order and value types, with token-keyed dicts (top_logprobs rows
    {token: logprob}, prompt_logprobs rows {id: {logprob, rank, decoded_token}}) folded to one entry
    and a list to the set of its element shapes."""
    if isinstance(obj, dict):
        values = list(obj.values())
        if values and (all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
                       or all(isinstance(v, dict) and "logprob" in v for v in values)):
            return {"<token>": sorted({json.dumps(skeleton(v), sort_keys=True) for v in obj.values()})}
        return {k: skeleton(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return sorted({json.dumps(skeleton(v), sort_keys=True) for v in obj})
    if isinstance(obj, bool) or obj is None:
        return repr(obj) if obj is None else "bool"
    return "number" if isinstance(obj, (int, float)) else type(obj).__name__


@pytest.mark.parametrize("name", ["baseline", "ngram", "draft", "dflash"])
def test_recorded_026_answers_parse(name):
    """Every live 0.26.0 completion the adapter's own requests got: token ids from "token_id:N",
    cross-checked against choices[0].token_ids, EOS kept in token_ids but not in text, stop_reason
    null for EOS, metrics null (no per-request counters in 0.26), no weight_versions, no
    usage.completion_tokens_details, system_fingerprint vllm-0.26.0-nohash; every speculative server
    answered the baseline's tokens."""
    base = {tuple(e["request"]["prompt"]): e["response"] for e in recorded_026("baseline") if e["label"] == "greedy"}
    greedy = [e for e in recorded_026(name) if e["label"] == "greedy"]
    assert greedy
    for e in greedy:
        k = e["request"]["logprobs"]
        ids, finish, scores, choice = parse_completion(e["response"], k)
        assert ids == choice["token_ids"] and scores.top_ids[:, 0].tolist() == ids
        assert (np.diff(scores.top_logprobs, axis=1) <= 0).all()
        assert e["response"]["metrics"] is None and request_spec_stats(e["response"]) is None
        assert "weight_versions" not in choice and "completion_tokens_details" not in e["response"]["usage"]
        assert e["response"]["system_fingerprint"] == "vllm-0.26.0-nohash"
        if finish == "stop":
            assert choice["stop_reason"] is None and ids[-1] in e["request"]["stop_token_ids"]
        assert ids == base[tuple(e["request"]["prompt"])]["choices"][0]["token_ids"]
    assert exchange(name, "GET /version")["response"] == {"version": "0.26.0"}
    assert top_k_disabled(exchange(name, "GET /version")["response"]["version"]) == 0


def test_recorded_026_edge_answers():
    """The 0.26.0 edge cases: logprobs 21 is the recorded 400; min_p 0.1 under greedy is accepted by
    the speculative server (0.33 refuses it); decoded-string keys are refused by the parser; the
    prompt_logprobs scoring answer parses into the continuation's rows, argmax = the answer."""
    for name in ("baseline", "ngram"):
        e = exchange(name, "logprobs_21")
        assert e["status"] == 400 and e["response"]["error"]["param"] == "logprobs"
        assert exchange(name, "min_p_0.1")["status"] == 200
        with pytest.raises(ValueError, match="ignored return_tokens_as_token_ids"):
            parse_completion(exchange(name, "text_keys")["response"], 8)
        assert exchange(name, "logprobs_null")["response"]["choices"][0]["logprobs"] is None
        score = exchange(name, "score")
        prompt = score["request"]["prompt"]
        answer = next(e for e in recorded_026(name) if e["label"] == "greedy"
                      and prompt[:len(e["request"]["prompt"])] == e["request"]["prompt"])
        n = len(answer["request"]["prompt"])
        tf = parse_prompt_logprobs(score["response"]["choices"][0]["prompt_logprobs"], prompt[:n], prompt[n:], 8)
        assert tf.top_ids[:, 0].tolist() == prompt[n:]
        _, _, decoded, _ = parse_completion(answer["response"], 8)
        np.testing.assert_allclose(tf.logprobs, decoded.logprobs, atol=0.05)  # teacher-forced vs incremental, bf16
    assert not VLLMApi.of("0.26.0").min_p_refused_with_spec and VLLMApi.of("0.33.0").min_p_refused_with_spec


def test_recorded_026_metrics_deltas():
    """/metrics of the live ngram server before/after its three greedy requests: the counters the
    gate reads moved by the recorded deltas; per-position acceptance sums to the accepted total;
    the baseline exposes no vllm:spec_decode_* family."""
    summary = json.loads((V026 / "capture-summary.json").read_text())
    before = parse_metrics((V026 / "metrics-ngram-before.txt").read_text())
    after = parse_metrics((V026 / "metrics-ngram-after.txt").read_text())
    delta = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    assert delta == summary["ngram"]["delta"] and delta["accepted"] > 0
    text = (V026 / "metrics-ngram-after.txt").read_text()
    per_pos = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{"))
    assert per_pos == after["accepted"]
    assert parse_metrics((V026 / "metrics-baseline-after.txt").read_text())["spec_families"] is False
    # what the server served moved by exactly the greedy requests and the tokens their answers carried
    greedy = [e for e in recorded_026("ngram") if e["label"] == "greedy"]
    assert after["finished"] - before["finished"] == len(greedy)
    assert after["generated"] - before["generated"] == sum(e["response"]["usage"]["completion_tokens"] for e in greedy)


def test_stable_spec_config_from_recorded_server_info():
    """The recorded dev-mode /server_info holds a 7 KB SpeculativeConfig with nested model and
    parallel configs and run-specific ports; the fingerprint keeps its stable part only, and a second
    launch (other ports) gives the same one."""
    info = json.loads((V026 / "server_info_ngram.json").read_text())
    full = info["vllm_config"]["speculative_config"]
    assert len(json.dumps(full)) > 5000
    stable = stable_spec_config(full)
    assert {k: stable[k] for k in ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
                                   "prompt_lookup_min")} == {"method": "ngram", "model": "ngram",
                                                             "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                                             "prompt_lookup_min": 2}
    assert len(json.dumps(stable)) < 1000 and not any("port" in k for k in stable)
    assert not any(isinstance(v, (dict, list)) for v in stable.values())
    relaunched = json.loads(json.dumps(full))
    for cfg in ("target_parallel_config", "draft_parallel_config"):
        relaunched[cfg]["data_parallel_rpc_port"] += 7
        relaunched[cfg]["master_port"] += 11
    assert stable_spec_config(relaunched) == stable
    assert normalise_dtype(info["vllm_config"]["model_config"]["dtype"]) == "bfloat16"
    assert normalise_dtype("float16") == "float16" and normalise_dtype(None) is None


def test_emulator_026_answers_like_the_recorded_server():
    """VLLMServer(version="0.26.0") against every recorded 0.26.0 request, baseline and
    speculative: the same status, the same shape (keys in order, value types) for every answer, the
    400 body byte for byte, the same token ids (the fixture target is confident: CPU float32 and GPU
    bfloat16 agree), logprobs of the chosen tokens within 1e-3 and teacher-forced rows within 0.25
    nats (bfloat16 on the server); /version, /v1/models and /metrics families as recorded."""
    for spec, name in ((False, "baseline"), (True, "ngram")):
        with VLLMServer(speculative=spec, version="0.26.0", dev_mode=True) as emu:
            e = Endpoint(emu.url)
            for x in recorded_026(name):
                if x["method"] == "GET":
                    r = e.request("GET", x["label"][4:])
                    if x["label"] != "GET /health":
                        assert skeleton(json.loads(r.body)) == skeleton(x["response"]), x["label"]
                    continue
                r = e.request("POST", "/v1/completions", {**x["request"], "model": emu.served}, expect=(200, 400))
                assert r.status == x["status"], (name, x["label"])
                got, rec = json.loads(r.body), x["response"]
                if r.status == 400:
                    assert got == rec
                    continue
                assert skeleton(got) == skeleton(rec), (name, x["label"])
                c, rc = got["choices"][0], rec["choices"][0]
                assert c["token_ids"] == rc["token_ids"] and c["text"] == rc["text"], (name, x["label"])
                assert (c["finish_reason"], c["stop_reason"]) == (rc["finish_reason"], rc["stop_reason"])
                assert got["system_fingerprint"] == rec["system_fingerprint"] and got["usage"] == rec["usage"]
                if rc["logprobs"]:
                    assert c["logprobs"]["tokens"] == rc["logprobs"]["tokens"]
                    np.testing.assert_allclose(c["logprobs"]["token_logprobs"], rc["logprobs"]["token_logprobs"],
                                               atol=1e-3)
                if rc["prompt_logprobs"]:
                    rows, rrows = c["prompt_logprobs"], rc["prompt_logprobs"]
                    assert len(rows) == len(rrows) and rows[0] is None is rrows[0]
                    for row, rrow, tok in zip(rows[1:], rrows[1:], x["request"]["prompt"][1:]):
                        assert abs(row[str(tok)]["logprob"] - rrow[str(tok)]["logprob"]) < 0.25
            text = e.request("GET", "/metrics").body.decode()
            want = {tuple(line.split()[2:4]) for line in (V026 / f"metrics-{name}-after.txt").read_text().splitlines()
                    if line.startswith("# TYPE vllm:spec_decode_")}
            have = {tuple(line.split()[2:4]) for line in text.splitlines() if line.startswith("# TYPE")}
            assert want <= have and (not spec) == (not want)
    with pytest.raises(ValueError, match="no --per-request-spec-decode-metrics"):
        VLLMServer(speculative=True, version="0.26.0", per_request_metrics=True)


def test_adapter_says_which_version_it_saw_and_keeps_a_stable_fingerprint():
    """Against 0.26.0 emulators in dev mode (the recorded /server_info shape): the fingerprint's
    spec_config is the stable part of the served SpeculativeConfig (no nested configs, no ports),
    dtype "bfloat16", and the server summary says which vLLM API the adapter saw; the same
    fingerprint from a second pair of servers (other ports)."""
    fingerprints = []
    for _ in range(2):
        with VLLMServer(version="0.26.0", dev_mode=True) as base, \
                VLLMServer(speculative=True, version="0.26.0", dev_mode=True) as spec:
            engine = engine_for(base.url, spec.url)
            try:
                fp = engine.fingerprint()
            finally:
                engine.close()
        assert fp.engine_version == "vllm 0.26.0" and fp.dtype == "bfloat16"
        assert fp.spec_config["method"] == "draft_model" and "target_model_config" not in fp.spec_config
        assert len(json.dumps(fp.spec_config)) < 1000
        assert fp.extra["spec_server"]["api"].startswith("vLLM 0.26.0: no per-request speculation metrics")
        fingerprints.append((fp.spec_config, fp.dtype, fp.engine_version))
    assert fingerprints[0] == fingerprints[1]


def test_recorded_server_info_reports_what_decides_the_numerics():
    """The recorded dev-mode /server_info of a live 0.26.0 names the target's dtype, quantization, KV cache
    dtype, tensor- and pipeline-parallel size where the adapter reads them; its attention backend is null (chosen by
    vLLM, not reported), so it is left out rather than compared."""
    config = json.loads((V026 / "server_info_ngram.json").read_text())["vllm_config"]
    assert reported_numerics(config) == {"model_config.dtype": "bfloat16", "model_config.quantization": "none",
                                         "cache_config.cache_dtype": "auto",
                                         "parallel_config.tensor_parallel_size": 1,
                                         "parallel_config.pipeline_parallel_size": 1}
    assert set(NUMERICS_PATHS) - set(reported_numerics(config)) == {"attention_config.backend"}
    assert config["attention_config"]["backend"] is None
    assert reported_numerics({}) == {}  # no dev-mode /server_info: nothing reported, nothing compared


@pytest.mark.parametrize("base_knobs, spec_knobs, shown", [
    ({}, {"kv_cache_dtype": "fp8"}, "cache_config.cache_dtype 'auto' vs 'fp8'"),
    ({}, {"tensor_parallel_size": 2}, "parallel_config.tensor_parallel_size 1 vs 2"),
    ({}, {"pipeline_parallel_size": 2}, "parallel_config.pipeline_parallel_size 1 vs 2"),
    ({"attention_backend": "FLASH_ATTN"}, {"attention_backend": "FLASHINFER"},
     "attention_config.backend 'FLASH_ATTN' vs 'FLASHINFER'"),
    ({}, {"attention_backend": "FLASHINFER"}, None),
])
def test_servers_that_compute_the_target_differently_are_refused(base_knobs, spec_knobs, shown):
    """0.26.0 emulators in dev mode: a speculative server launched with another KV cache dtype,
    tensor-parallel size or attention backend is refused before anything is judged, naming the field and
    both values; an attention backend is compared only when both servers report one (a null one was
    chosen by vLLM, which says no more)."""
    with VLLMServer(version="0.26.0", dev_mode=True, **base_knobs) as base, \
            VLLMServer(speculative=True, version="0.26.0", dev_mode=True, **spec_knobs) as spec:
        engine = engine_for(base.url, spec.url)
        try:
            if shown is None:
                engine.health()
                return
            with pytest.raises(ServerError) as refused:
                engine.health()
        finally:
            engine.close()
    assert str(refused.value) == (
        f"the baseline server {base.url} and the spec server {spec.url} do not compute the target the same way: "
        f"{shown}; launch every server with the same dtype, quantization, KV cache dtype, attention backend, "
        f"tensor-parallel and pipeline-parallel size")


def test_per_request_flag_never_reaches_a_vllm_without_it():
    """--engine-opt per_request_metrics=summary with an installed vLLM that lacks the flag (0.26.0):
    the launch goes without it and says so (counters from /metrics); with the flag, or when the
    installed vLLM cannot be read here, the request is passed on."""
    opts = EngineOptions(preset="vllm-ngram", target="/m", extra={"per_request_metrics": "summary"})
    _, spec = launch_configs(opts)
    note = drop_unsupported_per_request(spec, False)
    assert "--per-request-spec-decode-metrics" not in spec.args() and "/metrics" in note
    for supported in (True, None):
        _, spec = launch_configs(opts)
        assert drop_unsupported_per_request(spec, supported) is None
        assert "--per-request-spec-decode-metrics" in spec.args()
    assert VLLMApi.of("0.26.0").per_request_metrics is False and VLLMApi.of("0.33.0").per_request_metrics
    assert VLLMApi.of("0.30.1").per_request_metrics is None and VLLMApi.of("dev").version == "dev"


def test_recorded_026_graph_mode_draft_model_scores_wrong_rows():
    """vLLM 0.26.0 under CUDA graphs: the same prompt + continuation (the tokens an eager baseline
    decoded) scored with prompt_logprobs on the baseline server and on a draft_model speculative
    server, recorded live. Read by the adapter's parser, the baseline's rows pick every continuation
    token and the draft_model server's rows pick none: the rows the gate's scorer check refuses (the
    run stops with exit 3 instead of judging against them). Its decoded tokens are right: judged
    with --scorer embedded the same servers pass (docs/SERVERS.md)."""
    picked = {}
    for name in ("baseline", "draft_model"):
        rec = json.loads((V026 / f"score-graphs-{name}.json").read_text())
        ids, n = rec["request"]["prompt"], rec["_source"]["continuation_tokens"]
        tf = parse_prompt_logprobs(rec["response"]["choices"][0]["prompt_logprobs"], ids[:-n], ids[-n:], 1)
        picked[name] = (ids, int((tf.top_ids[:, 0] == np.asarray(ids[-n:])).sum()), n)
    assert picked["baseline"][0] == picked["draft_model"][0]
    _, agree, n = picked["baseline"]
    assert agree == n
    _, agree, n = picked["draft_model"]
    assert agree == 0 and n > 0
