"""What a server could not say is never read as the lenient answer.

* the determinism declaration is read once every server answered ``/health``: a server still
  starting would otherwise read as "unknown", and the run would allow near ties it promised away;
* a declaration made on some servers and unknown on the others is reported without a policy and
  makes the run bit-exact under one (a CI gate does not give an unknown the benefit of the doubt);
* a llama.cpp ``/tokenize`` probe that failed skips the check of a named tokenizer: the run says
  so, and fails under a policy;
* ``--resume`` onto servers whose speculative configuration is unknown is refused: equal unknowns
  prove nothing about what the servers speculate with.

SGLang, llama.cpp and vLLM fakes (:mod:`fakes`); the gate runs in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specparity.engines.server.llamacpp as llamacpp
import specparity.engines.server.llamacpp_tokens as llamacpp_tokens
from fakes import LlamaCppServer, SGLangServer, VLLMServer
from fakes.backend import TARGET
from fakes.gate import run_lossless
from fakes.server import json_reply
from specparity.engines.base import EngineOptions
from specparity.engines.server.engine import HFTokenizer, declaration_unknown
from specparity.gate import exitcodes
from specparity.model.gate_run import GateConfig, GatePolicy
from specparity.model.locations import fixture_dir
from specparity.model.prompts import load_prompts
from specparity.model.locations import REPO_ROOT
from specparity.run.runner import conclude, run_gate

#: The fixture target is confident (closest calls of 5-18 nats): a threshold that makes a flipped
#: answer a near tie.
NEAR_TIE = ("--near-tie-nats", "20", "--near-tie-ceiling", "20")


def policy_file(path: Path) -> Path:
    path.write_text('[gate]\nfail_on = ["diverged", "error", "drifted"]\n', encoding="utf-8")
    return path


# --------------------------------------------------------------------------- determinism


class WarmingUp(SGLangServer):
    """An SGLang server that answers ``/server_info`` with 503 until it was asked ``/health``: one
    still loading its model when the gate first looks at it."""

    asked_health = False

    def route(self, req):
        if req.method == "GET" and req.path == "/health":
            self.asked_health = True
        elif req.path in ("/server_info", "/get_server_info") and not self.asked_health:
            return json_reply(503, {"detail": "the model is still loading"})
        return super().route(req)


def test_the_determinism_declaration_is_read_once_the_servers_are_ready(tmp_path):
    with WarmingUp(declares_deterministic=True) as base, \
            WarmingUp(speculative=True, declares_deterministic=True, near_tie_flips=1) as spec:
        proc, records = run_lossless("sglang", base.url, spec.url, tmp_path / "r", "--target", str(TARGET), *NEAR_TIE,
                                     in_process=True)
        assert base.asked_health and spec.asked_health
    caps = next(r for r in records if r["kind"] == "run")["capabilities"]
    assert caps["deterministic"] == (f"sglang /server_info enable_deterministic_inference=true (baseline {base.url}: "
                                     f"true, spec {spec.url}: true)"), caps
    assert len(spec.flipped) == 1 and proc.returncode == exitcodes.GATE_FAILED, (proc.stdout + proc.stderr)[-3000:]
    assert "engine declares deterministic inference" in records[-1]["failures"][0]


class Silent(SGLangServer):
    """An SGLang server whose ``/server_info`` does not carry ``enable_deterministic_inference``."""

    def server_info(self):
        info = super().server_info()
        info.pop("enable_deterministic_inference", None)
        info["internal_states"][0].pop("enable_deterministic_inference", None)
        return info


def test_a_declaration_unknown_on_one_server_is_strict_under_a_policy(tmp_path):
    with Silent() as base, SGLangServer(speculative=True, declares_deterministic=True, near_tie_flips=1) as spec:
        proc, records = run_lossless("sglang", base.url, spec.url, tmp_path / "lenient", "--target", str(TARGET),
                                     *NEAR_TIE, in_process=True)
        caps = next(r for r in records if r["kind"] == "run")["capabilities"]
        unknown = caps["deterministic_unknown"]
        assert unknown == (f"sglang /server_info enable_deterministic_inference=true on spec {spec.url}; unknown on "
                           f"baseline {base.url} (unknown (/server_info unreadable or without the key))")
        assert caps["deterministic"] is None
        assert proc.returncode == exitcodes.PASS, (proc.stdout + proc.stderr)[-3000:]
        assert f"not bit-exact without a policy, since the declaration is unknown on some servers: {unknown}" in \
            proc.stdout

        spec.near_tie_flips = 1
        proc, records = run_lossless("sglang", base.url, spec.url, tmp_path / "strict", "--target", str(TARGET),
                                     *NEAR_TIE, "--policy", str(policy_file(tmp_path / "p.toml")), in_process=True)
    assert len(spec.flipped) == 2
    assert proc.returncode == exitcodes.GATE_FAILED, (proc.stdout + proc.stderr)[-3000:]
    ties = [r["prompt"]["id"] for r in records if r["kind"] == "prompt" and r["verdict"]["class"] == "near_tie"]
    assert records[-1]["failures"] == [
        f"determinism declaration unknown on some servers ({unknown}): under a policy an unknown is not lenient, so the "
        f"run is bit-exact and {len(ties)} near-tie flip(s) fail (make every server show its setting, or pass "
        f"--allow-near-tie to allow): {', '.join(ties)}"]


@pytest.mark.parametrize("said, expected", [
    ((("baseline", "b", "true"), ("spec", "s", "unknown (no route)")), "X on baseline b; unknown on spec s (unknown (no route))"),
    ((("baseline", "b", "true"), ("spec", "s", "true")), None),  # declared everywhere: not unknown
    ((("baseline", "b", "false"), ("spec", "s", "unknown")), None),  # nobody declares it
    ((("baseline", "b", "true"), ("spec", "s", "false"), ("spec", "t", "unknown")), None),  # one says off: partial
])
def test_declaration_unknown(said, expected):
    assert declaration_unknown(said, "X") == expected


# --------------------------------------------------------------------------- llama.cpp /tokenize


MATH = [p for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category == "math"][:2]


@pytest.mark.parametrize("under_policy", [False, True])
def test_a_failed_tokenize_probe_is_said_and_fails_under_a_policy(tmp_path, monkeypatch, under_policy):
    """The llama.cpp fake has no ``/tokenize``: the named tokenizer cannot be compared with the
    server's, and the run says so instead of skipping the check in silence."""
    tokenizer = HFTokenizer(str(fixture_dir("target")))
    monkeypatch.setattr(llamacpp, "HFTokenizer", lambda path: tokenizer)
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        engine = llamacpp.create(EngineOptions(baseline_urls=(base.url,), spec_urls=(spec.url,),
                                               extra={"tokenizer": str(fixture_dir("target"))}))
        try:
            run = run_gate(engine, MATH, GateConfig(max_new_tokens=16, report_dir=str(tmp_path / "r"),
                                                    policy=GatePolicy(unknown_fails=under_policy)))
        finally:
            engine.close()
        decision = conclude(run)
        assert ("POST", "/tokenize", {"content": llamacpp_tokens.TOKENIZE_PROBE, "add_special": True, "parse_special": True}) \
            in base.requests
    assert [r.verdict.klass for r in run.records] == ["exact"] * len(MATH)
    skipped = (f"tokenizer check skipped: {base.url}/tokenize failed (ServerError: POST /tokenize: HTTP 404 from "
               f"{base.url}")
    assert len(run.skipped_checks) == 1 and run.skipped_checks[0].startswith(skipped), run.skipped_checks
    assert run.skipped_checks[0].endswith(f"so nothing shows that the tokenizer {tokenizer.path} encodes prompts as the "
                                          "server does")
    if under_policy:
        assert decision.failures == [f"{run.skipped_checks[0]}; under a policy a check that could not be made fails"]
    else:
        assert decision.passed and run.skipped_checks[0] in decision.warnings
    head = json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[0])
    assert head["skipped_checks"] == run.skipped_checks  # `specparity report` decides the same from the journal


# --------------------------------------------------------------------------- --resume


def test_resume_onto_an_unknown_speculative_configuration_is_refused(tmp_path):
    """vLLM servers the gate did not launch (no dev-mode ``/server_info``) say their speculative
    configuration is unknown: a run cut short is not resumed onto them, since nothing shows the
    servers still speculate as they did."""
    report = tmp_path / "r"
    with VLLMServer() as base, VLLMServer(speculative=True) as spec:
        proc, records = run_lossless("vllm", base.url, spec.url, report, "--engine-opt", f"tokenizer={TARGET}",
                                     in_process=True)
        assert proc.returncode == exitcodes.PASS, (proc.stdout + proc.stderr)[-3000:]
        unknown = next(r for r in records if r["kind"] == "run")["fingerprint"]["spec_config"]["speculative_config"]
        assert unknown.startswith("unknown")
        # the run as a kill leaves it: the last judged prompt and everything after it lost
        last = max(i for i, r in enumerate(records) if r["kind"] == "prompt")
        (report / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:last]))
        proc, records = run_lossless("vllm", base.url, spec.url, report, "--engine-opt", f"tokenizer={TARGET}",
                                     "--resume", in_process=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.ENGINE_ERROR, out[-3000:]  # nothing judged: no verdict
    assert (f"--resume: {report / 'results.jsonl'}: the speculative configuration is unknown (speculative_config: "
            f"{unknown}), so nothing shows that the servers speculate as they did for the interrupted run") in out
