"""The gate against a real llama.cpp ``llama-server`` on the CPU (built by ``ci/llamacpp.sh``).

Live: real servers the suite starts (a baseline launch without speculation and a speculative
launch), the fixture models converted to GGUF. Without a build these tests skip and say how to
get one; with ``SPECPARITY_REQUIRE_LLAMACPP=1`` (CI) they fail instead.

* ``pytest suites/lossless --engine llamacpp`` passes on the default suite with drafting active,
  for a standalone draft, an n-gram mode and ``draft-dflash``, and at concurrency 2;
* a target quantized to Q8_0 (the quantized CPU matmul kernels, where a build for another CPU
  dies) loads and passes with n-gram drafting active;
* a speculative server that serves another model is refused before anything is judged;
* the same DFlash2 draft accepts alike under the reference ``dflash`` decoder and llama.cpp, and a
  different draft does not (``specparity.gate.parity``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from inprocess import run_pytest
from llamacpp_fixtures import require_llamacpp, require_quantized_target
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import load_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llamacpp():
    """(binary, GGUF dir), or skip with how to build them (fail under SPECPARITY_REQUIRE_LLAMACPP)."""
    return require_llamacpp()


def gate(*args: str, report: Path) -> tuple[int, str, list[dict]]:
    """``pytest suites/lossless --engine llamacpp ARGS`` in this process (the llama-servers it
    launches are real child processes): (exit status, its output, the lines of results.jsonl)."""
    code, out = run_pytest("-q", "suites/lossless", "--engine", "llamacpp", "--report", str(report), *args)
    path = report / "results.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return code, out, lines


#: The gate arguments of a test that checks one launch configuration on a few categories: the noise
#: is measured on the prompts that run. Calibrating on every prompt of the suite (the default: a
#: teacher-forced request per position of all of them) is what the default-suite test checks. A
#: threshold measured on fewer prompts can be looser, so these tests also demand what the default
#: suite shows on llama.cpp: every prompt exact (see ``assert_all_exact``).
SELECTED = ("--calibration", "selected")
#: The default suite's token limit here: half the default 48 (draft-simple proposes 4 tokens a
#: step, so every prompt still takes several verify steps). Most of the suite's prompts still end
#: on their stop token within it and the rest on the limit, so both endings stay judged; llama.cpp
#: scores one request per baseline position, which makes the limit the cost of the run.
SUITE_TOKENS = ("--max-new-tokens", "24")


def spec_totals(lines: list[dict]) -> tuple[int, int]:
    prompts = [x for x in lines if x["kind"] == "prompt"]
    return (sum(x["spec"]["spec"]["proposed"] for x in prompts), sum(x["spec"]["spec"]["accepted"] for x in prompts))


def assert_all_exact(lines: list[dict]) -> None:
    """Every judged prompt is exact: no near tie a looser threshold could have let through."""
    verdicts = [x["verdict"] for x in lines if x["kind"] == "prompt"]
    assert verdicts and all(v["class"] == "exact" for v in verdicts), [
        (v["prompt_id"], v["class"], v["reason"]) for v in verdicts if v["class"] != "exact"]


def test_default_suite_passes_against_servers_the_suite_starts(llamacpp, tmp_path):
    code, out, lines = gate(*SUITE_TOKENS, report=tmp_path)
    assert code == 0, out[-4000:]
    judged = [x for x in lines if x["kind"] == "prompt"]
    assert len(judged) == len(load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts)
    assert {x["baseline"]["finish_reason"] for x in judged} == {"stop", "length"}
    assert re.search(r"lossless gate: PASS — exact \d+, near_tie 0, drifted 0, diverged 0, error 0", out), out[-3000:]
    proposed, accepted = spec_totals(lines)
    assert accepted > 0 and proposed >= accepted, (proposed, accepted)
    run = lines[0]
    assert run["fingerprint"]["engine"] == "llamacpp" and "b11434" in run["fingerprint"]["engine_version"]
    assert "per position to the baseline llama-server" in run["scorer"]
    summary = (tmp_path / "summary.md").read_text()
    assert "--spec-type draft-simple" in summary and "Log (llama-server-spec)" in summary
    assert (tmp_path / "servers" / "llama-server-spec.log").is_file()


@pytest.mark.parametrize("preset", ["llamacpp-ngram-simple", "llamacpp-draft-dflash"])
def test_other_spec_types_pass_with_drafting_active(llamacpp, tmp_path, preset):
    # 32 new tokens: the repeat prompts repeat well within them, so both modes draft and verify
    args = ["--preset", preset, "--categories", "repeat,code,zh_qa", "--max-new-tokens", "32", *SELECTED]
    if preset == "llamacpp-draft-dflash":
        args += ["--draft", str(llamacpp[1] / "dflash2-llamacpp.gguf")]
    code, out, lines = gate(*args, report=tmp_path)
    assert code == 0, out[-4000:]
    assert_all_exact(lines)
    proposed, accepted = spec_totals(lines)
    assert accepted > 0, (preset, proposed, accepted)


def test_a_q8_0_target_loads_and_passes_with_drafting_active(tmp_path):
    """The fixture target quantized to Q8_0 on both servers, n-gram drafting on the speculative one:
    the server runs the quantized matmul kernels (the f16/f32 fixtures never reach them, and a
    build that uses CPU instructions this machine lacks dies there), and the gate passes on them."""
    _, target = require_quantized_target()
    info = json.loads((target.parent / "convert-info.json").read_text())["models"]["target"]
    assert "Q8_0" in info["gguf"]["tensor_types"], info["gguf"]["tensor_types"]
    categories = ("repeat", "code", "zh_qa")
    code, out, lines = gate("--preset", "llamacpp-ngram-simple", "--target", str(target),
                            "--categories", ",".join(categories), "--max-new-tokens", "32", *SELECTED, report=tmp_path)
    assert code == 0, out[-4000:]
    judged = [x for x in lines if x["kind"] == "prompt"]
    expected = [p.id for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category in categories]
    assert sorted(x["verdict"]["prompt_id"] for x in judged) == sorted(expected)
    classes = [x["verdict"]["class"] for x in judged]
    assert set(classes) <= {"exact", "near_tie"}, [(x["verdict"]["prompt_id"], x["verdict"]["reason"]) for x in judged]
    assert f"exact {classes.count('exact')}, near_tie {classes.count('near_tie')}, drifted 0, diverged 0, error 0" in out
    proposed, accepted = spec_totals(lines)
    assert accepted > 0, (proposed, accepted)
    for side in ("baseline", "spec"):
        log = (tmp_path / "servers" / f"llama-server-{side}.log").read_text()
        assert f"loading model '{target}'" in log, f"llama-server-{side} did not load {target}"


def test_concurrent_requests_on_two_slots(llamacpp, tmp_path):
    code, out, lines = gate("--engine-opt", "parallel=2", "--concurrency", "2", "--categories", "math,logic",
                            *SELECTED, report=tmp_path)
    assert code == 0, out[-4000:]
    assert_all_exact(lines)
    assert lines[0]["concurrency"] == 2
    assert "concurrency: 2 requests in flight per phase" in out


def test_a_speculative_server_serving_another_model_is_refused_before_judging(llamacpp, tmp_path):
    """Not a mock: two real servers, the 'speculative' one runs the draft model as its target. The
    endpoints' identities differ (another file, another size), so nothing is judged: exit 3, the
    message naming both servers and what differs."""
    from specparity.engines.server.llamacpp_launch import LlamaServerLaunch

    binary, gg = llamacpp
    base = LlamaServerLaunch(str(binary), str(gg / "target.gguf")).process("base", log_dir=str(tmp_path))
    wrong = LlamaServerLaunch(str(binary), str(gg / "draft.gguf")).process("wrong", log_dir=str(tmp_path))
    with base, wrong:
        code, out, lines = gate("--baseline-url", base.url, "--spec-url", wrong.url, "--categories", "math",
                                "--allow-unknown-activity", report=tmp_path / "r")
    assert code == exitcodes.ENGINE_ERROR, out[-3000:]
    assert "do not serve the same target" in out and base.url in out and wrong.url in out, out[-3000:]
    assert not [x for x in lines if x["kind"] == "prompt"]


#: New tokens per prompt of the acceptance-parity runs.
PARITY_TOKENS = 32


def test_the_same_dflash2_draft_accepts_alike_in_the_reference_and_in_llamacpp(llamacpp, tmp_path):
    """Both reference runs decode the same target: the first records its baselines as a golden,
    the second (another draft: the baseline key leaves the draft out) reads them from it. At
    ``PARITY_TOKENS`` new tokens the fixtures show what they show at the default 48: the same
    draft's largest per-category gap 0.063 (tolerance 0.10), the other draft's overall gap 0.26."""
    from specparity.engines.base import EngineOptions
    from specparity.engines.inprocess.dflash import DFlashEngine
    from specparity.engines.server.llamacpp import create
    from specparity.model.locations import fixture_dir
    from specparity.run.golden import load_golden
    from specparity.gate.parity import compare_acceptance
    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import run_gate

    _, gg = llamacpp
    prompts = [p for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts
               if p.category in ("code", "commonsense", "repeat", "zh_qa")]
    golden = tmp_path / "target.golden.jsonl"

    def per_category(engine, config=None, **kwargs):
        try:
            run = run_gate(engine, prompts, config or GateConfig(max_new_tokens=PARITY_TOKENS), **kwargs)
        finally:
            engine.close()
        assert not run.fatal and not run.golden_error, run.fatal or run.golden_error
        assert all(r.verdict.klass == "exact" for r in run.records), [r.verdict.reason for r in run.records]
        return {c: run.activity(c) for c in run.categories()}, run

    variant = gg / "variants" / "dflash2-llamacpp"
    ref, _ = per_category(DFlashEngine(EngineOptions(draft=str(variant), spec_mode="dflash2", num_draft_tokens=8)),
                          GateConfig(max_new_tokens=PARITY_TOKENS, golden=str(golden), update_golden="update"))
    llama, _ = per_category(create(EngineOptions(preset="llamacpp-draft-dflash",
                                                 draft=str(gg / "dflash2-llamacpp.gguf"))))
    same = compare_acceptance(ref, llama)
    assert not same.failures, "\n".join(same.table("dflash", "llama.cpp"))
    ref_other, run = per_category(DFlashEngine(EngineOptions(draft=str(fixture_dir("dflash2")), spec_mode="dflash2",
                                                             num_draft_tokens=8)),
                                  GateConfig(max_new_tokens=PARITY_TOKENS, golden=str(golden)),
                                  golden=load_golden(golden))
    assert {r.baseline_from for r in run.records} == {"golden"}
    other = compare_acceptance(ref_other, llama)
    assert other.failures and other.overall.gap > 0.1, "\n".join(other.table("dflash", "llama.cpp"))


def test_self_draft_and_slot_batching_invariance(llamacpp, tmp_path):
    """`pytest suites/invariance` on llama.cpp: `-md` with the target's own GGUF, and each prompt
    alone vs four parallel slots, at this module's token limit for the default suite. Nothing may be
    beyond the noise; the counts are recorded (docs/INVARIANCE.md), not asserted."""
    target = str(llamacpp[1] / "target.gguf")
    code, out = run_pytest("-q", "suites/invariance", "--engine", "llamacpp", "--target", target, "--draft", target,
                           "--engine-opt", "parallel=4", "--categories", "repeat,code,paths", *SUITE_TOKENS,
                           "--report", str(tmp_path))
    assert code == 0, out[-4000:]
    data = json.loads((tmp_path / "invariance" / "invariance.json").read_text())
    self_draft, batching = data
    assert self_draft["engine"] == "llamacpp" and self_draft["proposed"] > 0, self_draft
    assert self_draft["status"] in ("ok", "warn") and batching["status"] in ("ok", "warn"), data
    assert "4 concurrent requests" in batching["how"]
