"""The gate on a model family the project does not ship (``tests/foreign_model.py``): a tiny Llama
with its own byte-level BPE tokenizer, BOS/EOS/end-of-turn at ids of its own, two stop ids and its
own chat template.

What is asserted: the ids the gate sends are that tokenizer's encoding (its BOS first on a raw
prompt, its chat template on messages), computed without the engine's tokenizer code (``tokenizers``
and jinja2 alone), the stop ids are its two (``generation_config.json``), and the gate passes —
in-process (``hf``: prompt lookup, which needs no draft, and a draft built the same way sharing the
tokenizer; there both sides' output ids must also be the model's greedy continuation from a plain
argmax loop over its forward, so a target the engine computes wrongly on both sides cannot pass as
exact) and on llama.cpp (the model converted with
``tools/llamacpp/convert_gguf.py --pre gpt-2``, both servers launched by the gate; skipped without
a llama-server build, failed under ``SPECPARITY_REQUIRE_LLAMACPP=1``). The ``dflash`` engine is not
run: it needs a DFlash draft trained for the target, and none exists for this family.

Also here, the refusals that keep a user's model from being paired with the fixtures: ``--target``
without the ``--draft`` a draft mode needs, one server on both sides, a baseline that drafts, and
two sides that serve different models.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from foreign_model import BOS, CHAT_TEMPLATE, FOREIGN_PROMPTS, GGUF_PRE, ForeignModel, build_foreign_model
from inprocess import run_cli, run_pytest
from specparity.gate import exitcodes
from specparity.engines import EngineLoadError, load_engine
from specparity.engines.base import EngineOptions
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import load_prompts
from specparity.model.gate_run import GateConfig
from specparity.report.render import render_summary_md
from specparity.run.runner import conclude, run_gate

CONFIG = GateConfig(max_new_tokens=12, calibration="selected")


@pytest.fixture(scope="session")
def foreign(tmp_path_factory) -> ForeignModel:
    return build_foreign_model(tmp_path_factory.mktemp("foreign") / "target")


@pytest.fixture(scope="session")
def foreign_draft(tmp_path_factory, foreign) -> ForeignModel:
    """A draft directory of the same family and tokenizer, built alike (the target's own weights:
    random weights of another seed would never agree with the target, and the gate would rightly
    call that speculation inactive)."""
    draft = build_foreign_model(tmp_path_factory.mktemp("foreign") / "draft")
    assert (draft.path / "tokenizer.json").read_text() == (foreign.path / "tokenizer.json").read_text()
    return draft


@pytest.fixture(scope="session")
def foreign_other(tmp_path_factory) -> ForeignModel:
    """The same family, shapes and tokenizer with other weights: another model."""
    return build_foreign_model(tmp_path_factory.mktemp("foreign") / "other", seed=1)


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "foreign.jsonl"
    path.write_text(FOREIGN_PROMPTS)
    return load_prompts(path).prompts


def expected_ids(model: ForeignModel, prompt) -> list[int]:
    """The prompt's ids without the engine's tokenizer code (transformers' tokenizer classes and
    ``apply_chat_template``): the chat template (``foreign_model.CHAT_TEMPLATE``) rendered by jinja2,
    then the model's ``tokenizer.json`` encoding through the ``tokenizers`` library alone — its post
    processor adds the BOS to a raw prompt; the template writes its own."""
    import jinja2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model.path / "tokenizer.json"))
    if prompt.messages is None:
        return tok.encode(prompt.prompt, add_special_tokens=True).ids
    text = jinja2.Environment().from_string(CHAT_TEMPLATE).render(
        messages=prompt.messages_as_dicts(), bos_token=BOS, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False).ids


def model_stop_ids(model: ForeignModel) -> set[int]:
    """The stop ids as the model directory's ``generation_config.json`` lists them."""
    eos = json.loads((model.path / "generation_config.json").read_text())["eos_token_id"]
    return set(eos if isinstance(eos, list) else [eos])


def argmax_continuation(model: ForeignModel, prompt_ids: list[int], max_new: int) -> tuple[list[int], float]:
    """The greedy continuation computed without the engine: the checkpoint loaded by its own class,
    one full forward over the whole sequence per token (no KV cache, no ``generate``), the argmax of
    the last row, until a stop id of ``generation_config.json`` or ``max_new`` tokens. Returns the ids
    and the smallest margin (nats) between the chosen token's logit and the runner-up's on the way."""
    import torch
    from transformers import LlamaForCausalLM

    net = LlamaForCausalLM.from_pretrained(str(model.path), dtype=torch.float32, local_files_only=True).eval()
    stops, ids, out, closest = model_stop_ids(model), list(prompt_ids), [], float("inf")
    with torch.no_grad():
        while len(out) < max_new:
            row = net(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            top = torch.topk(row, 2)
            closest = min(closest, float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            out.append(token)
            ids.append(token)
            if token in stops:
                break
    return out, closest


def assert_model_true_run(engine, model: ForeignModel, prompts, *, greedy: bool = False) -> None:
    """Run the gate; the requests carry the model's own ids and stop ids, and it passes. ``greedy``
    (in-process engines, whose checkpoint is the float32 directory itself): both sides' output ids are
    the model's own greedy continuation, computed without the engine (:func:`argmax_continuation`), so
    a baseline and a speculative run that are wrong alike cannot pass as exact."""
    assert set(engine.stop_token_ids()) == {model.eos_id, model.eot_id}
    try:
        run = run_gate(engine, prompts, CONFIG)
    finally:
        engine.close()
    decision = conclude(run)
    for rec in run.records:
        ids = list(rec.request.prompt_ids)
        assert ids == expected_ids(model, rec.prompt), rec.prompt.id
        assert ids[0] == model.bos_id, rec.prompt.id  # raw: the tokenizer's BOS; chat: the template's
        assert set(rec.request.stop_token_ids) == model_stop_ids(model) == {model.eos_id, model.eot_id}
        if rec.prompt.messages is not None:
            assert model.eot_id in ids  # the template closes each turn with its own end-of-turn token
        if greedy:
            want, closest = argmax_continuation(model, ids, CONFIG.max_new_tokens or rec.prompt.max_new_tokens)
            assert closest > 1e-3, (rec.prompt.id, closest)  # no near tie: float32 rounding cannot pick another token
            assert list(rec.baseline.output_ids) == want, rec.prompt.id
            assert list(rec.spec.output_ids) == want, rec.prompt.id
    assert decision.exit_code == exitcodes.PASS, decision.failures
    assert run.activity().accepted > 0  # speculation really ran
    assert "fixture models" not in render_summary_md(run, decision)
    assert all(r.verdict.klass == "exact" for r in run.records)


# --------------------------------------------------------------------------- in-process (hf)


def test_hf_prompt_lookup_sends_the_models_own_ids_and_passes(foreign, prompts):
    engine = load_engine("hf", EngineOptions(target=str(foreign.path), spec_mode="prompt_lookup", num_draft_tokens=3))
    assert_model_true_run(engine, foreign, prompts, greedy=True)


def test_hf_with_a_draft_of_the_same_family_passes(foreign, foreign_draft, prompts):
    engine = load_engine("hf", EngineOptions(target=str(foreign.path), draft=str(foreign_draft.path),
                                             num_draft_tokens=3))
    assert engine.fingerprint().draft.path == str(foreign_draft.path)
    assert_model_true_run(engine, foreign, prompts, greedy=True)


@pytest.mark.parametrize("engine", ["hf", "dflash"])
def test_target_without_the_draft_its_mode_needs_is_refused_before_loading(foreign, engine):
    with pytest.raises(EngineLoadError, match=r"^--draft: --target .* is given without --draft") as info:
        load_engine(engine, EngineOptions(target=str(foreign.path)))
    assert "\n" not in str(info.value)
    if engine == "hf":
        assert "--spec-mode prompt_lookup" in str(info.value)


def test_target_without_draft_is_exit_4_on_the_command_line(foreign, tmp_path):
    code, out = run_cli("run", "--engine", "hf", "--target", str(foreign.path), "--report", str(tmp_path / "r"))
    assert code == exitcodes.BAD_INPUT, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1 and "--draft" in lines[0], out


def test_the_fixture_demo_says_fixture_models(prompts):
    engine = load_engine("hf", EngineOptions(spec_mode="prompt_lookup"))
    try:
        run = run_gate(engine, prompts[:1], CONFIG)
    finally:
        engine.close()
    assert "- Models: fixture models" in render_summary_md(run, conclude(run))


def test_without_the_fixtures_a_given_target_never_looks_for_them(foreign, monkeypatch, tmp_path):
    """An installed wheel carries no fixture models: with --target nothing asks for them (no
    FixtureError); a missing draft is the one-line --draft refusal."""
    import specparity.engines.server.llamacpp_launch as llamacpp_launch
    import specparity.model.locations as fixtures

    for module in (fixtures, llamacpp_launch):
        monkeypatch.setattr(module, "MANIFEST", tmp_path / "no-fixtures" / "MANIFEST.sha256")
    monkeypatch.setattr(fixtures, "MODELS", tmp_path / "no-fixtures" / "models")
    assert not fixtures.in_checkout()
    engine = load_engine("hf", EngineOptions(target=str(foreign.path), spec_mode="prompt_lookup"))
    engine.close()
    with pytest.raises(EngineLoadError, match="^--draft: --target"):
        load_engine("hf", EngineOptions(target=str(foreign.path)))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(EngineLoadError, match="^--draft: --spec-mode draft-simple needs --draft"):
        load_engine("llamacpp", EngineOptions(target=str(gguf), extra={"binary": sys.executable}))


# --------------------------------------------------------------------------- servers: refused up front


@pytest.mark.parametrize("engine", ["llamacpp", "sglang", "vllm"])
def test_one_server_on_both_sides_is_refused(engine):
    with pytest.raises(EngineLoadError, match=r"^--spec-url http://127\.0\.0\.1:8000/?: the same server is also a "
                                              r"--baseline-url") as info:
        load_engine(engine, EngineOptions(baseline_urls=("http://127.0.0.1:8000",),
                                          spec_urls=("http://127.0.0.1:8000/",)))
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- llama.cpp


@pytest.fixture(scope="session")
def foreign_ggufs(tmp_path_factory, foreign, foreign_draft, foreign_other) -> dict[str, Path]:
    """The target and the other model converted; the draft's GGUF is a copy of the target's. The
    draft directory holds the very files of the target (``foreign_draft`` is built alike), so its
    conversion would differ only in ``general.name``, at the cost of another converter run.

    The models are built byte-identically from their seeds, and the converter keeps its outputs in
    the cache keyed by the models' file hashes (as it keeps the fixtures'): a machine converts them
    once, not once per run."""
    from llamacpp_fixtures import require_llama_server

    require_llama_server()
    assert sorted(p.name for p in foreign_draft.path.iterdir()) == sorted(p.name for p in foreign.path.iterdir())
    assert all((foreign_draft.path / p.name).read_bytes() == p.read_bytes() for p in foreign.path.iterdir())
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "llamacpp" / "convert_gguf.py"),
                           "--model", f"target={foreign.path}", "--model", f"other={foreign_other.path}",
                           "--pre", GGUF_PRE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    converted = dict(line.split("\t") for line in proc.stdout.splitlines() if "\t" in line)
    out = tmp_path_factory.mktemp("gguf")
    shutil.copyfile(converted["target"], out / "draft.gguf")
    return {"target": Path(converted["target"]), "draft": out / "draft.gguf", "other": Path(converted["other"])}


@pytest.mark.slow
def test_gguf_metadata_is_the_models_vocabulary(foreign, foreign_ggufs):
    from specparity.engines.server.gguf_meta import read_vocab

    vocab = read_vocab(foreign_ggufs["target"])
    assert (vocab.architecture, vocab.tokenizer_model) == ("llama", "gpt2")
    assert (vocab.bos_id, vocab.eos_id, vocab.add_bos) == (foreign.bos_id, foreign.eos_id, True)
    assert set(vocab.eog_ids) == {foreign.eos_id, foreign.eot_id}


@pytest.mark.slow
def test_llamacpp_sends_the_models_own_ids_and_passes(foreign, foreign_ggufs, prompts, tmp_path):
    from specparity.engines.server.llamacpp_tokens import LlamaServerTokenizer

    engine = load_engine("llamacpp", EngineOptions(target=str(foreign_ggufs["target"]),
                                                   draft=str(foreign_ggufs["draft"]), spec_mode="draft-simple",
                                                   num_draft_tokens=3, log_dir=str(tmp_path)))
    assert isinstance(engine.tokenizer, LlamaServerTokenizer)  # the server's own /tokenize and template
    assert_model_true_run(engine, foreign, prompts)


@pytest.mark.slow
def test_llamacpp_baseline_that_drafts_is_an_error_never_a_pass(foreign_ggufs, prompts, tmp_path):
    from specparity.engines.server.llamacpp_launch import LlamaServerLaunch, find_binary

    launch = LlamaServerLaunch(str(find_binary()), str(foreign_ggufs["target"]), draft=str(foreign_ggufs["draft"]),
                               spec_type="draft-simple")
    with launch.process("a", log_dir=str(tmp_path)) as a, launch.process("b", log_dir=str(tmp_path)) as b:
        engine = load_engine("llamacpp", EngineOptions(baseline_urls=(a.url,), spec_urls=(b.url,),
                                                       target=str(foreign_ggufs["target"])))
        try:
            run = run_gate(engine, prompts, CONFIG)
        finally:
            engine.close()
    decision = conclude(run)
    assert decision.exit_code != exitcodes.PASS
    reasons = [r.baseline.error or "" for r in run.records if r.baseline is not None]
    assert reasons and all("timings.draft_n=" in x and "the baseline must not" in x for x in reasons), reasons


@pytest.mark.slow
def test_llamacpp_sides_serving_different_models_are_refused_before_judging(foreign_ggufs, prompts, tmp_path):
    from specparity.engines.server.llamacpp_launch import LlamaServerLaunch, find_binary

    binary = str(find_binary())
    base = LlamaServerLaunch(binary, str(foreign_ggufs["target"])).process("base", log_dir=str(tmp_path))
    other = LlamaServerLaunch(binary, str(foreign_ggufs["other"])).process("other", log_dir=str(tmp_path))
    with base, other:
        engine = load_engine("llamacpp", EngineOptions(baseline_urls=(base.url,), spec_urls=(other.url,),
                                                       target=str(foreign_ggufs["target"])))
        try:
            run = run_gate(engine, prompts, CONFIG)
        finally:
            engine.close()
    assert run.fatal and "do not serve the same target" in run.fatal, run.fatal
    assert base.url in run.fatal and other.url in run.fatal
    assert not any(r.verdict for r in run.records)
    assert conclude(run).exit_code == exitcodes.ENGINE_ERROR


def invariance(*args: str, report: Path) -> tuple[int, str]:
    """``pytest suites/invariance --engine llamacpp ARGS`` in this process (its llama-servers are
    real child processes): (exit status, its output)."""
    return run_pytest("-q", "suites/invariance", "--engine", "llamacpp", "--report", str(report), *args)


@pytest.mark.slow
def test_llamacpp_invariance_on_the_foreign_model(foreign_ggufs, tmp_path):
    """Self-draft with the model's own GGUF measures the model (no fixture tokens); a draft that is
    not the target is one line and the engine-error exit code, never a traceback or a verdict."""
    prompts = tmp_path / "foreign.jsonl"
    prompts.write_text(FOREIGN_PROMPTS)
    target = str(foreign_ggufs["target"])
    code, out = invariance("--target", target, "--draft", target, "--prompts", str(prompts), report=tmp_path / "ok")
    assert code == exitcodes.PASS, out[-3000:]
    assert "| self-draft | llamacpp |" in out and "| batching | llamacpp |" in out
    code, out = invariance("--target", target, "--draft", str(foreign_ggufs["other"]), "--prompts", str(prompts),
                           report=tmp_path / "bad")
    assert code == exitcodes.ENGINE_ERROR, out[-3000:]
    assert "Traceback" not in out and "is not the target" in out, out[-3000:]
