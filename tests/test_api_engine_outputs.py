"""``check_lossless`` on engines' offline outputs as they come, written as an engine team's suite would.

The first part is a worked example in the style of vLLM's own tests: a ``vllm_runner`` fixture
(vLLM's ``tests/conftest.py``) whose ``generate_greedy`` returns ``(prompt ids + output ids,
prompt + text)`` per prompt and whose ``generate_greedy_logprobs`` returns ``(output ids, text,
logprobs)`` with one ``{token id: Logprob}`` per position, and a test that hands both runs to
``check_lossless`` with ``check_outputs_equal``'s keywords. The runner here is a toy greedy model
(numpy, no torch, no GPU) so the example runs anywhere; a team swaps in its own ``vllm_runner``.
The second part reads SGLang offline-engine output dicts, starting from the bodies in
``tests/data/sglang/``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from specparity.api import LosslessError, check_lossless

DATA = Path(__file__).resolve().parent / "data" / "sglang"

# --------------------------------------------------------------------------- what a team's conftest holds

VOCAB = 40
EOS = 1
MAX_TOKENS = 12
#: The prompts of the example (vLLM's ``example_prompts`` fixture reads a file of them).
EXAMPLE_PROMPTS = ["The capital of France is", "def fib(n):", "1, 1, 2, 3, 5,", "Translate: bonjour ->"]


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``vllm.logprobs.Logprob``: what ``CompletionOutput.logprobs[i][token_id]`` holds."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def encode(prompt: str) -> list[int]:
    return [2 + ord(c) % (VOCAB - 2) for c in prompt]


def decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def next_logprobs(context: list[int]) -> np.ndarray:
    """The toy target: a fixed log-softmax over the vocabulary for each context (its last 3 tokens)."""
    seed = hash(tuple(context[-3:])) % (2**32)
    logits = np.random.default_rng(seed).normal(0.0, 3.0, VOCAB)
    return logits - np.logaddexp.reduce(logits)


class ToyRunner:
    """Stands in for ``VllmRunner(model, speculative_config=...)``: greedy decoding of the toy target.

    ``speculative_config["bug_at"]`` makes the "speculative" run emit the target's second choice at
    that output position (a broken verify step), so the example can show a failure."""

    def __init__(self, model: str, speculative_config: dict | None = None):
        self.model, self.spec = model, speculative_config or {}

    def __enter__(self) -> "ToyRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def _decode(self, prompt_ids: list[int], max_tokens: int, num_logprobs: int):
        out, rows = [], []
        for pos in range(max_tokens):
            lp = next_logprobs(prompt_ids + out)
            order = np.argsort(-lp)
            tok = int(order[1] if pos == self.spec.get("bug_at") else order[0])
            top = {int(t): Logprob(float(lp[t]), rank=r + 1) for r, t in enumerate(order[:num_logprobs])}
            top.setdefault(tok, Logprob(float(lp[tok])))  # vLLM adds the sampled token to the top-k
            out.append(tok)
            rows.append(top)
            if tok == EOS:
                break
        return out, rows

    def generate_greedy(self, prompts: list[str], max_tokens: int) -> list[tuple[list[int], str]]:
        outputs = []
        for prompt in prompts:
            ids, _ = self._decode(encode(prompt), max_tokens, 1)
            outputs.append((encode(prompt) + ids, prompt + decode(ids)))  # as vLLM's runner: prompt first
        return outputs

    def generate_greedy_logprobs(self, prompts: list[str], max_tokens: int, num_logprobs: int):
        outputs = []
        for prompt in prompts:
            ids, rows = self._decode(encode(prompt), max_tokens, num_logprobs)
            outputs.append((ids, decode(ids), rows))
        return outputs


@pytest.fixture
def vllm_runner():
    return ToyRunner


@pytest.fixture
def example_prompts() -> list[str]:
    return list(EXAMPLE_PROMPTS)


# --------------------------------------------------------------------------- the team's tests


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_spec_decode_greedy_is_lossless(vllm_runner, example_prompts, method):
    with vllm_runner("toy") as ref_llm:
        ref_outputs = ref_llm.generate_greedy(example_prompts, MAX_TOKENS)
    with vllm_runner("toy", speculative_config={"method": method, "num_speculative_tokens": 3}) as spec_llm:
        spec_outputs = spec_llm.generate_greedy(example_prompts, MAX_TOKENS)

    verdicts = check_lossless(outputs_0_lst=ref_outputs, outputs_1_lst=spec_outputs, name_0="ref", name_1="spec",
                              max_new_tokens=MAX_TOKENS, stop_token_ids=[EOS],
                              prompt_token_ids=[encode(p) for p in example_prompts])
    assert [v.klass for v in verdicts] == ["exact"] * len(example_prompts)


def test_a_broken_verify_step_fails_naming_both_runs(vllm_runner, example_prompts):
    with vllm_runner("toy") as ref_llm:
        ref_outputs = ref_llm.generate_greedy_logprobs(example_prompts, MAX_TOKENS, num_logprobs=5)
    with vllm_runner("toy", speculative_config={"method": "ngram", "bug_at": 3}) as spec_llm:
        spec_outputs = spec_llm.generate_greedy_logprobs(example_prompts, MAX_TOKENS, num_logprobs=5)

    with pytest.raises(LosslessError) as info:
        check_lossless(outputs_0_lst=ref_outputs, outputs_1_lst=spec_outputs, name_0="ref", name_1="spec",
                       max_new_tokens=MAX_TOKENS, stop_token_ids=[EOS])
    err = info.value
    reached = [f"#{i}" for i, (ids, _, _) in enumerate(ref_outputs) if len(ids) > 3]  # the rest stopped first
    assert reached and [v.prompt_id for v in err.failed] == reached
    assert {v.klass for v in err.failed} == {"diverged"}
    # the margin comes from the reference's own logprobs (Logprob objects), the gap between its
    # token and the runner-up the broken step took
    ids, _, rows = ref_outputs[int(reached[0][1:])]
    first, second = sorted((lp.logprob for lp in rows[3].values()), reverse=True)[:2]
    d = err.failed[0].divergence
    assert d.position == 3 and d.baseline_margin == pytest.approx(first - second, abs=1e-5)
    assert "ref vs spec" in str(err) and "ref token" in str(err) and "spec token" in str(err)


def test_plain_float_logprobs_read_as_logprob_objects(vllm_runner, example_prompts):
    with vllm_runner("toy") as ref_llm:
        ref = ref_llm.generate_greedy_logprobs(example_prompts, MAX_TOKENS, num_logprobs=3)
    with vllm_runner("toy", speculative_config={"bug_at": 2}) as spec_llm:
        spec = spec_llm.generate_greedy_logprobs(example_prompts, MAX_TOKENS, num_logprobs=3)
    floats = [(ids, text, [{t: lp.logprob for t, lp in row.items()} for row in rows]) for ids, text, rows in ref]
    margins = []
    for outputs in (ref, floats):
        with pytest.raises(LosslessError) as info:
            check_lossless(outputs, spec, max_new_tokens=MAX_TOKENS, stop_token_ids=[EOS])
        margins.append([v.divergence.baseline_margin for v in info.value.failed])
    assert margins[0] == margins[1] and all(m is not None and m > 0 for m in margins[0])


def test_a_pair_tuple_is_accepted_where_it_raised_type_error():
    out = ([5, 6, 7, EOS], "text")
    (v,) = check_lossless([out], [out], max_new_tokens=8, stop_token_ids=[EOS])
    assert v.klass == "exact"


def test_prompt_ids_in_front_are_named_when_not_dropped(vllm_runner, example_prompts):
    ref = vllm_runner("toy").generate_greedy(example_prompts, MAX_TOKENS)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        check_lossless(outputs_0_lst=ref, outputs_1_lst=ref, max_new_tokens=MAX_TOKENS, stop_token_ids=[EOS])
    with pytest.raises(ValueError, match="does not start with its prompt"):
        check_lossless(ref, ref, max_new_tokens=MAX_TOKENS, stop_token_ids=[EOS],
                       prompt_token_ids=[[0]] * len(example_prompts))


def test_the_outputs_are_given_once():
    with pytest.raises(TypeError, match="outputs_0_lst"):
        check_lossless([[1]], [[1]], outputs_0_lst=[[1]], max_new_tokens=1)
    with pytest.raises(TypeError, match="outputs_1_lst"):
        check_lossless(outputs_0_lst=[[1]], max_new_tokens=1)


@dataclass
class CompletionOutput:
    """The fields of vLLM's ``CompletionOutput`` that are read."""

    token_ids: list[int]
    text: str
    logprobs: list | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


def test_vllm_request_outputs_and_an_abort():
    ok = RequestOutput([CompletionOutput([5, 6, EOS], "x", None, "stop")])
    aborted = RequestOutput([CompletionOutput([5], "", None, "abort")])
    assert check_lossless([ok], [ok], max_new_tokens=4, stop_token_ids=[EOS])[0].klass == "exact"
    with pytest.raises(LosslessError) as info:
        check_lossless([ok], [aborted], max_new_tokens=4, stop_token_ids=[EOS])
    assert [v.klass for v in info.value.failed] == ["error"]


# --------------------------------------------------------------------------- SGLang offline engine


def sglang_output(name: str):
    """An offline ``Engine.generate`` result: the HTTP body's ``text``/``output_ids``/``meta_info``
    (the offline engine returns the same dict), without the files' provenance keys."""
    body = json.loads((DATA / f"{name}.json").read_text())
    strip = (lambda d: {k: v for k, v in d.items() if not k.startswith("_")})
    return [strip(d) for d in body] if isinstance(body, list) else strip(body)


def _request(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())["_request"]["sampling_params"]


def test_sglang_dicts_identical_tokens_are_exact():
    params = _request("generate_greedy_spec_off")
    off, on = sglang_output("generate_greedy_spec_off"), sglang_output("generate_greedy_spec_on")
    (v,) = check_lossless([off], [on], max_new_tokens=params["max_new_tokens"], stop_token_ids=params["stop_token_ids"])
    assert v.klass == "exact"
    batch = sglang_output("generate_batch2")
    request = json.loads((DATA / "generate_batch2.request.json").read_text())["sampling_params"]
    verdicts = check_lossless(batch, copy.deepcopy(batch), max_new_tokens=request["max_new_tokens"],
                              stop_token_ids=request["stop_token_ids"])
    assert [v.klass for v in verdicts] == ["exact"] * len(batch)


def test_sglang_flip_is_judged_with_the_baselines_margin():
    params = _request("generate_greedy_spec_off")
    off, on = sglang_output("generate_greedy_spec_off"), sglang_output("generate_greedy_spec_on")
    meta = off["meta_info"]
    pos = 3
    runner_up = meta["output_top_logprobs"][pos][1]
    on["output_ids"] = on["output_ids"][:pos] + [runner_up[1]] + on["output_ids"][pos + 1:]
    on["meta_info"]["output_token_logprobs"][pos] = [runner_up[0], runner_up[1], None]
    with pytest.raises(LosslessError) as info:
        check_lossless([off], [on], max_new_tokens=params["max_new_tokens"], stop_token_ids=params["stop_token_ids"])
    (v,) = info.value.failed
    assert v.klass == "diverged" and v.divergence.position == pos
    assert v.divergence.baseline_margin == pytest.approx(meta["output_token_logprobs"][pos][0] - runner_up[0], abs=1e-5)


def test_sglang_abort_is_an_error_never_exact():
    params = _request("generate_greedy_spec_off")
    off, on = sglang_output("generate_greedy_spec_off"), sglang_output("generate_greedy_spec_on")
    on["meta_info"]["finish_reason"] = {"type": "abort", "message": "out of memory", "status_code": 500}
    with pytest.raises(LosslessError) as info:
        check_lossless([off], [on], max_new_tokens=params["max_new_tokens"], stop_token_ids=params["stop_token_ids"])
    (v,) = info.value.failed
    assert v.klass == "error" and "out of memory" in v.reason
