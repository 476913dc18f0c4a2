"""Faults never pass: a server that misbehaves makes its prompts ``error`` with the cause, never exact.

Each test drives the real gate — the ``llamacpp`` engine, ``run_gate`` and ``conclude`` in-process,
or the ``pytest suites/lossless --engine llamacpp`` command (exit codes and summary wording) —
against :class:`fakes.LlamaCppServer`, a llama.cpp-protocol server that replays the captured answers
(so the same run passes when nothing is wrong: the first test) and misbehaves on purpose. The same
faults are then injected into the SGLang and vLLM fakes (:mod:`fakes`, answering from the fixture
models) under the ``sglang`` and ``vllm`` engines. The last test SIGKILLs a real ``llama-server``
mid-run.

For every fault: the affected prompts are ``error`` and the cause names the endpoint and what
happened; the prompts that finished stay ``exact`` in ``results.jsonl``; the journal ends with the
verdict; the exit code is 1 (3 when the engine could not run at all). Timeouts are short and the
dead-endpoint breaker (3 consecutive transport failures) makes later prompts fail at once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest

import specparity.engines.server.llamacpp as llamacpp
from fakes import FakeServer, LlamaCppServer, Rule, SGLangServer, VLLMServer
from fakes.backend import TARGET
from fakes.gate import pytest_in_process
from llamacpp_fixtures import SUITE_PYTEST, require_llamacpp
from specparity.gate import exitcodes
from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.engines.server.http import DEAD_AFTER
from specparity.engines.server.engine import HFTokenizer
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.gate.decision import GateDecision, decide
from specparity.run.journal import load_run
from specparity.model.prompts import Prompt, load_prompts
from specparity.model.gate_run import GateConfig, GateRun
from specparity.run.runner import conclude, run_gate

TESTS = REPO_ROOT / "tests"
MAX_NEW = 16
#: ``--categories math``: the math prompts of the default file, in this order.
MATH = [p for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category == "math"]
IDS = [p.id for p in MATH]
URL = r"http://127\.0\.0\.1:\d+"


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    return HFTokenizer(str(fixture_dir("target")))


@pytest.fixture(autouse=True)
def shared_tokenizer(monkeypatch: pytest.MonkeyPatch, tokenizer: HFTokenizer) -> None:
    """``create()`` loads the tokenizer (about 2 s); every test here shares one."""
    monkeypatch.setattr(llamacpp, "HFTokenizer", lambda path: tokenizer)


def prompt_ids(tokenizer: HFTokenizer, prompt_id: str) -> list[int]:
    p = next(p for p in MATH if p.id == prompt_id)
    return tokenizer.encode_prompt(p.prompt, p.messages_as_dicts())


@dataclass
class Outcome:
    run: GateRun
    decision: GateDecision
    journal: list[dict[str, Any]]
    report: Path

    def klass(self, pid: str) -> str:
        return self.run.record(pid).verdict.klass

    def reason(self, pid: str) -> str:
        return self.run.record(pid).verdict.reason

    def written(self) -> dict[str, dict[str, Any]]:
        """Prompt id -> its verdict as the journal recorded it."""
        return {x["verdict"]["prompt_id"]: x["verdict"] for x in self.journal if x["kind"] == "prompt"}


def journal(report: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (report / "results.jsonl").read_text().splitlines()]


def gate(tmp_path: Path, baseline: LlamaCppServer, spec: LlamaCppServer, *, timeout: float = 2.0,
         prompts: Sequence[Prompt] = MATH) -> Outcome:
    """The real gate, in-process: ``llamacpp.create`` against the two URLs, run, conclude."""
    report = tmp_path / "report"
    engine = llamacpp.create(EngineOptions(baseline_urls=(baseline.url,), spec_urls=(spec.url,),
                                           request_timeout=timeout, extra={"tokenizer": str(fixture_dir("target"))}))
    try:
        run = run_gate(engine, prompts, GateConfig(max_new_tokens=MAX_NEW, report_dir=str(report), categories=["math"]))
    finally:
        engine.close()
    decision = conclude(run)
    return Outcome(run, decision, journal(report), report)


def assert_failed(out: Outcome, causes: dict[str, Sequence[str]], ids: Sequence[str] = IDS,
                  max_total_s: float | None = 8) -> None:
    """``causes``: prompt id -> regexes its error reason must match. Every other prompt of ``ids`` is
    exact — in the run and in the journal — and the journal ends with a FAIL verdict, exit code 1."""
    written = out.written()
    assert set(written) == set(ids), f"journal lacks prompts: {set(ids) - set(written)}"
    for pid in ids:
        if pid in causes:
            assert out.klass(pid) == "error", (pid, out.klass(pid), out.reason(pid))
            assert written[pid]["class"] == "error" and written[pid]["reason"] == out.reason(pid)
            for pattern in causes[pid]:
                assert re.search(pattern, out.reason(pid)), f"{pid}: {pattern!r} not in {out.reason(pid)!r}"
        else:
            assert out.klass(pid) == "exact", (pid, out.klass(pid), out.reason(pid))
            assert written[pid]["class"] == "exact"
    final = out.journal[-1]
    assert final["kind"] == "verdict" and final["status"] == "FAIL" and final["exit_code"] == exitcodes.GATE_FAILED
    assert final["counts"]["error"] == len(causes) and final["counts"]["exact"] == len(ids) - len(causes)
    failed = [f for f in final["failures"] if "failed in the engine" in f]
    assert failed and all(pid in failed[0] for pid in causes), final["failures"]
    assert out.decision.exit_code == exitcodes.GATE_FAILED and not out.decision.passed
    if max_total_s is not None:
        assert out.run.timings["total"] < max_total_s, out.run.timings  # no prompt waited out a long timeout


# --------------------------------------------------------------------------- nothing wrong: a pass


def test_replayed_answers_pass_when_nothing_is_wrong(tmp_path):
    """The fake server is faithful enough that the gate passes on it: every failure below is the
    fault's doing."""
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        out = gate(tmp_path, base, spec)
    assert {pid: out.klass(pid) for pid in IDS} == {pid: "exact" for pid in IDS}
    assert out.decision.passed and out.decision.exit_code == exitcodes.PASS, out.decision.failures
    assert out.journal[-1]["kind"] == "verdict" and out.journal[-1]["status"] == "PASS"
    act = out.run.activity()
    assert act.accepted > 0 and act.accepted <= act.proposed
    assert len(spec.seen) == len(IDS) and all(s.n_predict == MAX_NEW for s in spec.seen)
    assert len(base.seen) > len(IDS)  # the baselines and their per-position scoring requests


# --------------------------------------------------------------------------- transport faults


def test_hang_times_out_and_the_breaker_fails_the_rest_fast(tmp_path):
    timeout = 0.5
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[Rule("hang", from_request=2)]) as spec:
        out = gate(tmp_path, base, spec, timeout=timeout)
        timed_out = IDS[1:1 + DEAD_AFTER]
        dead = IDS[1 + DEAD_AFTER:]
        assert dead, "the breaker needs a prompt after the ones that time out"
        assert_failed(out, {
            **{pid: [rf"POST {URL}/completion: timed out after 0\.5 s"] for pid in timed_out},
            **{pid: [rf"{URL} is marked dead \(3 consecutive transport failures, last: timed out after 0\.5 s\)"]
               for pid in dead},
        })
        assert len(spec.seen) == 1 + DEAD_AFTER  # the prompts after the breaker never reached the server
    for pid in timed_out:
        assert out.run.record(pid).spec.wall_s >= timeout * 0.9
    for pid in dead:
        assert out.run.record(pid).spec.wall_s < 0.1, "a dead endpoint must fail at once"
    assert out.run.timings["spec_decode"] < DEAD_AFTER * timeout + 1.5


def test_trickled_answer_is_bounded_by_the_request_timeout(tmp_path):
    """Headers at once, then the body a few bytes at a time: every socket read is quick, so only a
    deadline on the whole request ends it (before the fix in http.py it ran for minutes). The deadline
    leaves the baseline's own requests room on a loaded machine; the trickled body (4 bytes per 50 ms)
    takes far longer than it."""
    timeout = 2.5
    rule = Rule("trickle", requests={2})
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[rule], trickle_s=0.05) as spec:
        out = gate(tmp_path, base, spec, timeout=timeout)
    assert_failed(out, {IDS[1]: [rf"^speculative run failed: POST {URL}/completion: timed out after 2\.5 s$"]})
    assert out.run.record(IDS[1]).spec.wall_s < 2 * timeout + 0.5


def test_connection_closed_mid_response(tmp_path):
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[Rule("close_mid", requests={2})]) as spec:
        out = gate(tmp_path, base, spec)
    # one transport failure, then the server answers again: not dead, the run goes on
    assert_failed(out, {IDS[1]: [rf"POST {URL}/completion: connection closed by the server mid-request"]})


def test_spec_server_dies_after_two_requests_pytest_run(tmp_path):
    """The N+1-th request is dropped unanswered and the server stops listening (a crash): that
    prompt and every later one are errors; exit code 1 and summary.md say so. (The same pytest
    command as the subprocess tests, run in this process.)"""
    assert len(IDS) > 3, "the crash needs prompts before it and after the one it drops"
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, die_after=2) as spec:
        proc, report = gate_pytest_run(tmp_path, base, spec)
    out = proc.stdout + proc.stderr
    failed = len(IDS) - 2
    assert proc.returncode == exitcodes.GATE_FAILED, out[-3000:]
    assert (f"specparity lossless gate: FAIL — exact 2, near_tie 0, drifted 0, diverged 0, error {failed} "
            f"({len(IDS)} prompts)") in out, out[-3000:]
    lines = journal(report)
    written = {x["verdict"]["prompt_id"]: x["verdict"] for x in lines if x["kind"] == "prompt"}
    assert [written[p]["class"] for p in IDS] == ["exact"] * 2 + ["error"] * failed
    assert re.search(rf"speculative run failed: POST {URL}/completion: connection closed by the server mid-request",
                     written[IDS[2]]["reason"]), written[IDS[2]]["reason"]
    # the dropped request and the refused ones after it are DEAD_AFTER transport failures in a row
    for pid in IDS[3:2 + DEAD_AFTER]:
        assert re.search(rf"speculative run failed: POST {URL}/completion: connection refused", written[pid]["reason"])
    for pid in IDS[2 + DEAD_AFTER:]:
        assert re.search(rf"speculative run failed: {URL} is marked dead \(3 consecutive transport failures, last: "
                         r"connection refused\)", written[pid]["reason"]), written[pid]["reason"]
    assert lines[-1]["kind"] == "verdict" and lines[-1]["exit_code"] == exitcodes.GATE_FAILED
    summary = (report / "summary.md").read_text()
    assert summary.startswith("# specparity lossless gate: FAIL")
    assert f"{failed} prompt(s) failed in the engine: {', '.join(IDS[2:])}" in summary
    assert "connection refused" in summary and "connection closed by the server mid-request" in summary
    for pid in IDS[2:]:
        assert f"FAILED suites/lossless/test_lossless.py::test_lossless[{pid}]" in out


def test_refused_at_start_is_an_engine_error_pytest_run(tmp_path):
    """Nothing listens on the speculative URL: the health check fails before any prompt runs —
    exit code 3 (the engine could not run), not a verdict. (The pytest command in this process; a
    subprocess run of it is test_real_llama_server_killed_mid_run.)"""
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, refuse=True) as spec:
        proc, report = gate_pytest_run(tmp_path, base, spec)
        cause = f"spec endpoint unhealthy: GET {spec.url}/health: connection refused"
    out = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.ENGINE_ERROR, out[-3000:]
    assert cause in out and "specparity lossless gate: FAIL" in out, out[-3000:]
    lines = journal(report)
    assert [x["kind"] for x in lines] == ["fatal", "timings", "verdict"]  # no prompt ran, none is called exact
    rebuilt = load_run(report)
    assert rebuilt.fatal and not rebuilt.records and decide(rebuilt).exit_code == exitcodes.ENGINE_ERROR
    assert lines[-1]["exit_code"] == exitcodes.ENGINE_ERROR and lines[-1]["counts"]["exact"] == 0
    assert any(cause in f for f in lines[-1]["failures"])
    summary = (report / "summary.md").read_text()
    assert summary.startswith("# specparity lossless gate: FAIL") and "The run stopped early" in summary
    assert cause in summary and f"{len(IDS)} prompt(s) never finished: {', '.join(IDS)}" in summary


def gate_pytest_run(tmp_path: Path, base: LlamaCppServer, spec: LlamaCppServer,
                    *extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``pytest suites/lossless --engine llamacpp …`` through ``pytest.main`` in this process: its exit
    code, terminal output and report as a subprocess would give them."""
    report = tmp_path / "report"
    args = ["-q", "-p", "no:cacheprovider", "suites/lossless", "--engine", "llamacpp",
            "--baseline-url", base.url, "--spec-url", spec.url, "--categories", "math", "--max-new-tokens", str(MAX_NEW),
            "--calibration", "selected", "--report", str(report), "--request-timeout", "2", "--engine-opt",
            f"tokenizer={fixture_dir('target')}", *extra]
    t0 = time.monotonic()
    proc = pytest_in_process(args)
    assert time.monotonic() - t0 < 60, "the gate waited out timeouts it should not have"
    return proc, report


# --------------------------------------------------------------------------- answers that are wrong


def test_http_500_on_one_prompt(tmp_path, tokenizer):
    victim = IDS[2]
    rule = Rule("http_500", prompt=prompt_ids(tokenizer, victim))
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[rule]) as spec:
        out = gate(tmp_path, base, spec)
    assert_failed(out, {victim: [rf"^speculative run failed: POST /completion: HTTP 500 from {URL}: "
                                 r'\{"error":\{"code":500,"message":"failed to decode the batch']})


def test_http_400_on_the_baseline(tmp_path, tokenizer):
    victim = IDS[1]
    rule = Rule("http_400", prompt=prompt_ids(tokenizer, victim))
    with LlamaCppServer(rules=[rule]) as base, LlamaCppServer(speculative=True) as spec:
        out = gate(tmp_path, base, spec)
    # The runner still scores the speculative output of a prompt whose baseline failed, on the same
    # baseline server, and that scoring error (the same HTTP 400 here) then replaces "baseline failed"
    # as the reason; either way the reason names the endpoint and the answer.
    cause = rf"POST /completion: HTTP 400 from {URL}: .*Prompt contains invalid tokens"
    assert_failed(out, {victim: [rf"^(baseline failed: |teacher-forced scoring failed: ServerError: ){cause}"]})
    baseline_line = next(x for x in out.journal if x["kind"] == "baseline" and x["prompt_id"] == victim)
    assert re.search(cause, baseline_line["baseline"]["error"]), baseline_line


def test_malformed_json(tmp_path):
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[Rule("bad_json", requests={3})]) as spec:
        out = gate(tmp_path, base, spec)
    assert_failed(out, {IDS[2]: [rf"POST {URL}/completion: malformed JSON in the response \('\{{\"index\":0"]})


def test_missing_timings(tmp_path):
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[Rule("no_timings", requests={4})]) as spec:
        out = gate(tmp_path, base, spec)
    assert_failed(out, {IDS[3]: [rf"{URL}: /completion answered without 'timings': cannot tell whether drafting happened"]})


def test_more_drafts_accepted_than_drafted(tmp_path):
    rule = Rule("accepted_gt_drafted", requests={1})
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[rule]) as spec:
        out = gate(tmp_path, base, spec)
    assert_failed(out, {IDS[0]: [rf"{URL}: timings\.draft_n_accepted (\d+) > draft_n \d+"]})


def test_limit_with_fewer_tokens_than_asked(tmp_path):
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[Rule("short_limit", requests={5})]) as spec:
        out = gate(tmp_path, base, spec)
    assert_failed(out, {IDS[4]: [rf"{URL}: returned \d+ of max_new_tokens=16 tokens and finish 'length': "
                                 "the server stopped short without saying why"]})


def test_probability_rows_that_match_no_token(tmp_path):
    with LlamaCppServer() as base, LlamaCppServer(speculative=True, rules=[Rule("bad_prob_ids", requests={2})]) as spec:
        out = gate(tmp_path, base, spec)
    assert_failed(out, {IDS[1]: [rf"{URL}: unexpected response shape \(ValueError: completion_probabilities\[\d+\]\.id "
                                 r"\d+ matches no remaining token\)"]})


def test_baseline_dies_while_scoring(tmp_path, tokenizer):
    """The baseline server dies in the middle of the second prompt's per-position scoring: the
    first prompt stays exact, the second fails its scoring, the rest fail their baselines — the
    last ones at once, through the breaker."""
    assert len(IDS) > 4, "the breaker needs a prompt after the two refused baselines"
    probe = LlamaCppServer()
    first_len = len(probe.model.greedy(prompt_ids(tokenizer, IDS[0]), MAX_NEW, 8)[0])
    die_after = 1 + first_len + 1 + 2  # prompt 1 and its scoring, prompt 2 and two of its positions
    with LlamaCppServer(die_after=die_after) as base, LlamaCppServer(speculative=True) as spec:
        out = gate(tmp_path, base, spec)
        assert base.dead
    dead = rf"{URL} is marked dead \(3 consecutive transport failures, last: connection refused\)"
    # Each prompt keeps its first cause: the second one's own scoring died; the next baselines met
    # a refused connection; the last one the breaker. No speculative run is made without a baseline.
    assert_failed(out, {
        IDS[1]: [rf"^baseline teacher-forced scoring failed: ServerError: POST {URL}/completion: connection "
                 r"(closed by the server mid-request|refused)"],
        IDS[2]: [rf"^baseline failed: POST {URL}/completion: connection refused"],
        IDS[3]: [rf"^baseline failed: POST {URL}/completion: connection refused"],
        **{pid: [rf"^baseline failed: {dead}"] for pid in IDS[4:]},
    })
    first = {x["prompt_id"]: x["baseline"]["error"] for x in out.journal if x["kind"] == "baseline"}
    assert first[IDS[0]] is None and first[IDS[1]] is None  # prompt 2 decoded; its scoring died
    assert re.search(rf"^POST {URL}/completion: connection refused", first[IDS[2]]), first
    assert re.search(rf"^POST {URL}/completion: connection refused", first[IDS[3]]), first
    for pid in IDS[4:]:
        assert re.search(rf"^{dead}", first[pid]), first


def _all_baselines_fail(tmp_path: Path) -> Outcome:
    with LlamaCppServer(die_after=0) as base, LlamaCppServer(speculative=True) as spec:
        return gate(tmp_path, base, spec)


def test_baseline_dead_from_the_first_request_never_passes(tmp_path):
    """Healthy at start, then every baseline request fails: the run stops before the speculative
    phase (no threshold can be measured); nothing could be judged, so it fails with exit code 3 (an
    engine error, no verdict), nothing is called exact, and the journal keeps each baseline's cause."""
    out = _all_baselines_fail(tmp_path)
    final = out.journal[-1]
    assert final["kind"] == "verdict" and final["status"] == "FAIL" and final["exit_code"] == exitcodes.ENGINE_ERROR
    assert final["counts"]["exact"] == 0 and out.decision.exit_code == exitcodes.ENGINE_ERROR
    assert final["counts"]["error"] == len(IDS)
    assert any(f.startswith("the gate could not be calibrated, so nothing was judged: no baseline could be decoded")
               for f in final["failures"]), final["failures"]
    causes = [x["baseline"]["error"] for x in out.journal if x["kind"] == "baseline"]
    assert len(causes) == len(IDS)
    assert re.search(rf"^POST {URL}/completion: connection closed by the server mid-request$", causes[0]), causes
    assert re.search(rf"^{URL} is marked dead \(3 consecutive transport failures", causes[-1]), causes


def test_baseline_dead_from_the_first_request_names_the_cause_per_prompt(tmp_path):
    out = _all_baselines_fail(tmp_path)
    for pid in IDS:
        assert out.run.record(pid).verdict is not None and out.klass(pid) == "error"
        assert re.search(rf"baseline failed: .*{URL}", out.reason(pid))


# --------------------------------------------------------------------------- SGLang and vLLM

#: The SGLang and vLLM fakes decode with the fixture models: a few tokens take every path.
FAKE_NEW = 8
#: protocol -> (its fake, its generation path)
PROTOCOLS = {"sglang": (SGLangServer, "/generate"), "vllm": (VLLMServer, "/v1/completions")}


def fake_gate(tmp_path: Path, protocol: str, baseline: FakeServer, spec: FakeServer,
              prompts: Sequence[Prompt]) -> Outcome:
    """The real gate, in-process, with the ``sglang`` or ``vllm`` engine over two fakes (the
    calibration prompts are the ones judged, so the speculative server first answers one scoring
    request per prompt: the noise between the two instances)."""
    report = tmp_path / "report"
    engine = load_engine(protocol, EngineOptions(baseline_urls=(baseline.url,), spec_urls=(spec.url,),
                                                 request_timeout=60.0, extra={"tokenizer": str(TARGET)}))
    try:
        run = run_gate(engine, prompts, GateConfig(max_new_tokens=FAKE_NEW, report_dir=str(report)))
    finally:
        engine.close()
    return Outcome(run, conclude(run), journal(report), report)


def fault_cases(protocol: str, path: str) -> dict[str, str]:
    """fault -> the regex its prompt's error reason must match, on this protocol."""
    cases = {
        "bad_json": rf"^speculative run failed: POST {URL}{path}: malformed JSON in the response \('\{{",
        "http_500": rf"^speculative run failed: POST {path}: HTTP 500 from {URL}: "
                    + ("Internal Server Error$" if protocol == "sglang" else
                       r'\{"error": \{"message": "EngineCore encountered an issue'),
        "close_mid": rf"^speculative run failed: POST {URL}{path}: connection closed by the server mid-request$",
        "short_limit": rf"^speculative run failed: {URL}: returned \d+ of max_new_tokens={FAKE_NEW} tokens and "
                       "finish 'length': the server stopped short without saying why$",
    }
    if protocol == "sglang":
        cases["bad_prob_ids"] = (rf"^speculative run failed: {URL}: unexpected response shape \(ValueError: "
                                 r"output_token_logprobs\[\d+\] names token \d+, the stream has \d+\)$")
        cases["accepted_gt_drafted"] = (rf"^speculative run failed: {URL}: meta_info spec counters inconsistent: "
                                        r"spec_num_correct_drafts (\d+), spec_num_proposed_drafts (\d+)")
        cases["no_timings"] = (rf"^speculative run failed: {URL}: the server declares speculative_algorithm=STANDALONE "
                               r"but its \d+-token answer carries no spec_\* keys in meta_info: cannot tell whether "
                               "speculation ran$")
    else:
        cases["bad_prob_ids"] = (rf"^speculative run failed: {URL}: choices\[0\]\.token_ids \[[\d, ]+\] disagree with "
                                 r"logprobs\.tokens \[[\d, ]+\]$")
        cases["accepted_gt_drafted"] = (rf"^speculative run failed: {URL}: metrics\.speculative_decoding: "
                                        r"num_accepted_draft_tokens (\d+) > num_draft_tokens (\d+)$")
    return cases


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_faults_on_sglang_and_vllm(protocol, tmp_path, tokenizer, default_prompts):
    """Every fault the adapter must catch, one per prompt, on the speculative server's generation of
    that prompt (a truncated body, an HTTP 500, a connection dropped mid-answer, an answer stopped
    short, a logprob row for another token, more drafts accepted than drafted, and on SGLang the
    spec counters missing): each of those prompts is ``error`` with a cause naming the endpoint, the
    first prompt stays ``exact``, the journal keeps every prompt and ends FAIL, exit code 1."""
    fake, path = PROTOCOLS[protocol]
    cases = fault_cases(protocol, path)
    prompts = default_prompts[: 1 + len(cases)]
    assert len(prompts) == 1 + len(cases), "the default prompt file has too few prompts for one fault each"
    victims = dict(zip((p.id for p in prompts[1:]), cases))
    rules = [Rule(fault, prompt=tokenizer.encode_prompt(p.prompt, p.messages_as_dicts()), n_predict=FAKE_NEW)
             for p, fault in zip(prompts[1:], cases)]
    counters = {"per_request_metrics": True} if protocol == "vllm" else {}  # the answer's own spec counters
    with fake() as base, fake(speculative=True, rules=rules, **counters) as spec:
        out = fake_gate(tmp_path, protocol, base, spec, prompts)
    assert sorted(s.fault for s in spec.seen if s.fault) == sorted(cases), spec.seen  # each hit once
    assert_failed(out, {pid: [cases[fault]] for pid, fault in victims.items()}, ids=[p.id for p in prompts],
                  max_total_s=None)
    accepted = next(pid for pid, fault in victims.items() if fault == "accepted_gt_drafted")
    more, fewer = re.search(cases["accepted_gt_drafted"], out.reason(accepted)).groups()
    assert int(more) > int(fewer)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_sglang_and_vllm_server_dies_mid_run(protocol, tmp_path, default_prompts):
    """The speculative server crashes after answering the calibration scoring and one generation:
    that prompt stays ``exact`` in the journal, the others are ``error`` with the endpoint and the
    dropped or refused connection, FAIL with exit code 1, and no request waits on the dead server."""
    fake, path = PROTOCOLS[protocol]
    prompts = default_prompts[:3]
    with fake() as base, fake(speculative=True, die_after=len(prompts) + 1) as spec:
        out = fake_gate(tmp_path, protocol, base, spec, prompts)
        assert spec.dead
    answered = [s for s in spec.seen if s.fault is None]
    assert [s.n_predict for s in answered].count(FAKE_NEW) == 1, spec.seen  # the scoring requests, one generation
    written = out.written()
    exact = [pid for pid, v in written.items() if v["class"] == "exact"]
    assert len(exact) == 1 and len(written) == len(prompts), written
    causes = {pid: [rf"^speculative run failed: POST {URL}{path}: connection (closed by the server mid-request|"
                    "refused)$"] for pid in written if pid not in exact}
    assert_failed(out, causes, ids=[p.id for p in prompts], max_total_s=None)


# --------------------------------------------------------------------------- a real llama-server, killed


def test_real_llama_server_killed_mid_run(tmp_path):
    """Two real llama-servers launched by the gate; the speculative one is SIGKILLed right after
    the third speculative request. The two prompts after it are errors that say the server process
    exited and where its log is; the three before stay exact; exit code 1."""
    require_llamacpp()
    report = tmp_path / "report"
    # a child process: the SIGKILLed server's exit must reach the gate as it does in a user's run
    cmd = [*SUITE_PYTEST, "suites/lossless",
           "--engine", f"{TESTS / 'llamacpp_fixtures.py'}:killing_llamacpp", "--engine-opt", "kill_after=3",
           "--categories", "math", "--max-new-tokens", str(MAX_NEW), "--calibration", "selected", "--report", str(report),
           "--request-timeout", "10"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS)}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == exitcodes.GATE_FAILED, out[-3000:]
    spec_log = report / "servers" / "llama-server-spec.log"
    assert spec_log.is_file() and "listening" in spec_log.read_text()
    lines = journal(report)
    written = {x["verdict"]["prompt_id"]: x["verdict"] for x in lines if x["kind"] == "prompt"}
    failed = len(IDS) - 3
    assert failed > 0, "the kill needs a prompt after it"
    assert [written[p]["class"] for p in IDS] == ["exact"] * 3 + ["error"] * failed, out[-3000:]
    for pid in IDS[3:3 + DEAD_AFTER]:  # later ones meet the breaker
        reason = written[pid]["reason"]
        assert re.search(rf"^speculative run failed: POST {URL}/completion: connection (refused|closed by the server "
                         r"mid-request)", reason), reason
        assert (f"; the spec server process was killed by SIGKILL (killed from outside, e.g. by the kernel's "
                f"out-of-memory killer or a timeout); log {spec_log}") in reason, reason
    final = lines[-1]
    assert final["kind"] == "verdict" and final["status"] == "FAIL" and final["exit_code"] == exitcodes.GATE_FAILED
    assert f"{failed} prompt(s) failed in the engine: {', '.join(IDS[3:])}" in final["failures"]
    summary = (report / "summary.md").read_text()
    assert summary.startswith("# specparity lossless gate: FAIL") and "the spec server process was killed by SIGKILL" in summary
    assert (f"specparity lossless gate: FAIL — exact 3, near_tie 0, drifted 0, diverged 0, error {failed} "
            f"({len(IDS)} prompts)") in out
