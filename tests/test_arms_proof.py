"""``specparity arms``: each arm's condition is proven on the judged speculative requests themselves, and the
other arms are proven free of it.

The fakes cache what the engines cache: SGLang's radix cache keeps every finished request, scoring included,
in whole pages; vLLM caches the blocks of a ``prompt_logprobs`` request though it does not read them for it.
So the teacher-forced scoring the run sends to the speculative server before the judged phase warms the
cache for the judged requests unless the cache is reset in between:

* the default arm starts its judged requests cold and proves it from their cached prompt tokens, which every
  arm journals per request (with the retractions SGLang answers);
* a bug only on a cold prefill fails the default arm and passes prefix-warm; a bug only on a prefix-cache hit
  (``tests/test_arms.py``) the other way round; a bug only on a retracted request fails the preempt arm alone;
* prefix-warm reads the cache unit from the server (SGLang ``page_size``);
* preempt counts the judged requests' preemptions, never the scoring requests'.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fakes import SGLangServer, VLLMServer
from fakes.backend import TARGET
from fakes.faults import Rule
from prompt_subsets import DEFAULT_PROMPTS, write_subset
from specparity.engines.server.engine import HFTokenizer
from specparity.gate import exitcodes
from specparity.model.arms import NOT_EXERCISED
from specparity.model.prompts import load_prompts
from test_arms import MAX_NEW, arms, prompts, rows, url_args  # noqa: F401 - prompts: a fixture test_arms defines

#: A vLLM fake as every arm launches vLLM: answers carry cached prompt tokens, /reset_prefix_cache is there.
AS_LAUNCHED = {"prompt_tokens_details": True, "dev_mode": True}


def judged_lines(report: Path, arm: str) -> dict[str, dict]:
    """The arm's journalled prompt records (those with a speculative answer), by prompt id."""
    out = {}
    for line in (report / arm / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "prompt" and row.get("spec"):
            out[row["prompt"]["id"]] = row
    return out


def servers(engine: str, **spec_knobs):
    """A baseline and a speculative fake of ``engine`` as the arms launch it."""
    if engine == "vllm":
        return VLLMServer(**AS_LAUNCHED), VLLMServer(speculative=True, **AS_LAUNCHED, **spec_knobs)
    return SGLangServer(), SGLangServer(speculative=True, **spec_knobs)


def prompt_tokens(chosen) -> dict[str, int]:
    tok = HFTokenizer(str(TARGET))
    return {p.id: len(tok.encode_prompt(p.prompt, p.messages_as_dicts())) for p in chosen}


# --------------------------------------------------------------------------- the fakes cache what the engines cache


def _post(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _generate(url: str, ids: list[int], max_new: int, **extra) -> dict:
    status, body = _post(url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new,
                                                                                    "temperature": 0}, **extra})
    assert status == 200, body
    return json.loads(body)


def test_the_sglang_fake_caches_scoring_requests_in_whole_pages_and_flushes_only_when_idle():
    prompt = list(range(5, 5 + 40))
    with SGLangServer(page_size=16, hang_s=5.0, rules=[Rule("hang", n_predict=7)]) as server:
        # a scoring request: the prompt and a continuation, input logprobs from the prompt's last token
        _generate(server.url, prompt + [60, 61, 62], 1, return_logprob=True, logprob_start_len=len(prompt) - 1)
        again = _generate(server.url, prompt, 4)
        assert again["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16
        # a request in flight: the flush is refused; once idle it empties the cache
        def hang() -> None:
            try:
                _post(server.url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 7}})
            except OSError:
                pass  # the hung request is dropped unanswered

        hung = threading.Thread(target=hang)
        hung.start()
        while not server.in_flight and hung.is_alive():
            time.sleep(0.01)
        assert _post(server.url + "/flush_cache")[0] == 400
        hung.join()
        assert _post(server.url + "/flush_cache")[0] == 200
        assert _generate(server.url, prompt, 4)["meta_info"]["cached_tokens"] == 0
        assert json.loads(urllib.request.urlopen(server.url + "/server_info").read())["page_size"] == 16


def test_the_vllm_fake_caches_the_blocks_of_a_scoring_request_without_reading_them_for_it():
    prompt = list(range(5, 5 + 40))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    with VLLMServer(**AS_LAUNCHED) as server:
        scoring = {**body, "prompt": prompt + [60, 61], "max_tokens": 1, "prompt_logprobs": 1}
        first = json.loads(_post(server.url + "/v1/completions", scoring)[1])
        again = json.loads(_post(server.url + "/v1/completions", scoring)[1])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # never read for prompt_logprobs
        hit = json.loads(_post(server.url + "/v1/completions", body)[1])
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16
        assert json.loads(_post(server.url + "/reset_prefix_cache")[1]) == {"success": True}
        cold = json.loads(_post(server.url + "/v1/completions", body)[1])
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# --------------------------------------------------------------------------- the default arm is cold


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_bug_only_on_a_cold_prefill_fails_the_default_arm_and_passes_prefix_warm(capsys, tmp_path, prompts,
                                                                                  engine):
    """The judged requests of the default arm used to arrive warm (the speculative server had scored the
    calibration's tokens and kept them), so a bug on a cold prefill was never exercised. Every arm journals
    each judged request's cached prompt tokens."""
    prompt_file, chosen = prompts
    sizes = prompt_tokens(chosen)
    base, spec = servers(engine, cold_prefill_bug=True)
    with base, spec:
        code, out, err = arms(capsys, *url_args(engine, base, spec, prompt_file, tmp_path), "--arms",
                              "default,prefix-warm")
    got = rows(tmp_path)
    assert got["default"]["status"] == "FAIL" and got["default"]["evidence"]["exercised"] is True, got["default"]
    assert got["prefix-warm"]["status"] == "PASS", got["prefix-warm"]
    assert code == exitcodes.GATE_FAILED, out + err
    for arm in ("default", "prefix-warm"):
        journal = judged_lines(tmp_path, arm)
        assert sorted(journal) == sorted(sizes), journal.keys()
        for pid, row in journal.items():
            assert isinstance(row["spec"]["facts"]["cached_tokens"], int), row["spec"]
            assert row["spec"]["facts"]["prompt_tokens"] == sizes[pid]
            if engine == "sglang":
                assert row["spec"]["facts"]["preemptions"] == 0 and row["baseline"]["facts"]["preemptions"] == 0
    cold = {pid: row["spec"]["facts"]["cached_tokens"] for pid, row in judged_lines(tmp_path, "default").items()}
    assert all(n < sizes[pid] - 1 for pid, n in cold.items()), cold


def test_default_on_a_vllm_without_dev_mode_cannot_reset_its_cache_and_is_not_exercised(capsys, tmp_path, prompts):
    """vLLM resets its prefix cache only on a dev-mode server: without it the judged requests find the scoring
    requests' blocks, and the default arm says so instead of passing warm."""
    prompt_file, chosen = prompts
    sizes = prompt_tokens(chosen)
    base = VLLMServer(prompt_tokens_details=True)
    spec = VLLMServer(speculative=True, prompt_tokens_details=True)
    with base, spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms", "default")
    row = rows(tmp_path)["default"]
    assert row["gate_status"] == "PASS" and row["status"] == NOT_EXERCISED, row
    lines = " ".join(row["evidence"]["lines"])
    assert "NOT reset" in lines and "not cold" in lines, lines
    cached = row["evidence"]["facts"]["cached_tokens"]
    assert cached == {pid: (n - 1) // 16 * 16 for pid, n in sizes.items()}, cached
    assert code == exitcodes.GATE_FAILED, out + err


def test_the_default_arm_proves_it_is_free_of_preemption(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    budget = max(prompt_tokens(chosen).values()) + int(MAX_NEW[1])  # one request fits, several at once do not
    base, spec = servers("vllm", preempt_budget_tokens=budget)
    with base, spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms", "default",
                              "--concurrency", str(len(chosen)))
    assert spec.preempted, "the fake never preempted: nothing was tested"
    row = rows(tmp_path)["default"]
    assert row["gate_status"] == "PASS" and row["status"] == NOT_EXERCISED, row
    assert row["evidence"]["facts"]["preemptions"] == len(spec.preempted), row["evidence"]
    assert code == exitcodes.GATE_FAILED, out + err


# --------------------------------------------------------------------------- prefix-warm: the server's cache unit


def test_sglang_prefix_warm_reads_the_page_size_from_server_info(capsys, tmp_path):
    """With --page-size 16 a prompt of 16 tokens or fewer can find nothing cached: the arm names it and proves
    the warm path on the longer prompts, each found cached whole (all but its last token, in whole pages)."""
    page = 16
    tok = HFTokenizer(str(TARGET))
    sizes = {p.id: len(tok.encode_prompt(p.prompt, p.messages_as_dicts()))
             for p in load_prompts(DEFAULT_PROMPTS).prompts if not p.constraint}
    short = [pid for pid, n in sizes.items() if n <= page][:2]
    long = [pid for pid, n in sizes.items() if n > page + 1][:2]
    assert len(short) == 2 and len(long) == 2, sizes
    prompt_file = tmp_path / "prompts.jsonl"
    write_subset(prompt_file, lambda row: row["id"] in short + long)
    with SGLangServer() as base, SGLangServer(speculative=True, page_size=page) as spec:
        code, out, err = arms(capsys, *url_args("sglang", base, spec, prompt_file, tmp_path / "r"), "--arms",
                              "prefix-warm")
    row = rows(tmp_path / "r")["prefix-warm"]
    assert row["status"] == "PASS" and row["evidence"]["exercised"] is True, row
    cached = row["evidence"]["facts"]["cached_tokens"]
    assert {pid: cached[pid] for pid in long} == {pid: (sizes[pid] - 1) // page * page for pid in long}, cached
    assert all(cached[pid] == 0 for pid in short), cached
    assert any("not counted" in line and all(pid in line for pid in short) for line in row["evidence"]["lines"])
    assert code == exitcodes.PASS, out + err


# --------------------------------------------------------------------------- preempt: the judged requests alone


def test_preempted_scoring_requests_do_not_prove_the_preempt_arm(capsys, tmp_path, prompts):
    """vLLM answers no per-request preemption: its counter is read over the judged requests alone, after the
    speculative server scored the calibration's tokens (here each scoring request is preempted)."""
    prompt_file, chosen = prompts
    base, spec = servers("vllm", preempt_scoring=True)
    with base, spec:
        code, out, err = arms(capsys, *url_args("vllm", base, spec, prompt_file, tmp_path), "--arms", "preempt",
                              "--prelaunched", "--engine-opt", f"max_concurrency={len(chosen)}")
    row = rows(tmp_path)["preempt"]
    assert row["gate_status"] == "PASS" and row["status"] == NOT_EXERCISED, row
    assert row["evidence"]["facts"]["preemptions"] == 0, row["evidence"]
    assert code == exitcodes.GATE_FAILED, out + err


def test_a_bug_only_on_a_retracted_request_fails_the_preempt_arm_alone(capsys, tmp_path, prompts):
    """SGLang answers each request's retractions (meta_info.num_retractions): the preempt arm counts the
    judged requests'; the default and prefix-warm arms, one request in flight at a time, prove theirs are 0."""
    prompt_file, chosen = prompts
    budget = max(prompt_tokens(chosen).values()) + int(MAX_NEW[1])  # one request fits, several at once do not
    with SGLangServer() as base, SGLangServer(speculative=True, retract_budget_tokens=budget, retract_bug=True) as spec:
        code, out, err = arms(capsys, *url_args("sglang", base, spec, prompt_file, tmp_path), "--arms",
                              "default,prefix-warm,preempt", "--prelaunched", "--concurrency", "1",
                              "--engine-opt", f"max_concurrency={len(chosen)}")
    assert spec.retracted, "the fake never retracted: nothing was tested"
    got = rows(tmp_path)
    assert got["default"]["status"] == "PASS" and got["prefix-warm"]["status"] == "PASS", got
    assert got["preempt"]["status"] == "FAIL" and got["preempt"]["evidence"]["exercised"] is True, got["preempt"]
    per_request = got["preempt"]["evidence"]["facts"]["preemptions_per_request"]
    assert sorted(per_request) == sorted(p.id for p in chosen) and sum(per_request.values()) >= 1, per_request
    for arm in ("default", "prefix-warm"):
        assert set(got[arm]["evidence"]["facts"]["preemptions_per_request"].values()) == {0}, got[arm]
    assert code == exitcodes.GATE_FAILED, out + err


# --------------------------------------------------------------------------- what a cold request may share


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6),
                          st.lists(st.integers(0, 2), max_size=4)), min_size=1, max_size=8))
def test_the_shared_prefix_is_the_longest_with_any_other_judged_request(requests):
    """What a cold judged request may find cached: the longest prefix its prompt shares with another judged
    request's prompt and answer (found among its neighbours in sorted order), never with its own."""
    from types import SimpleNamespace

    from specparity.run.arm_evidence import _shared

    judged = [SimpleNamespace(request=SimpleNamespace(request_id=f"r{i}", prompt_ids=prompt),
                              spec=SimpleNamespace(output_ids=answer)) for i, (prompt, answer) in enumerate(requests)]

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    want = {r.request.request_id: max((common(r.request.prompt_ids, [*o.request.prompt_ids, *o.spec.output_ids])
                                       for o in judged if o is not r), default=0) for r in judged}
    assert _shared(judged) == want
