"""The dflash engine: protocol, draft loading checks, truthful counters, the CPU timer, scoring."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from broken_dflash import MODELS_DIR, model_options
from inprocess import run_pytest
from prompt_subsets import first_of_each
from specparity.engines.base import Engine
from specparity.engines.inprocess.dflash import DFlashEngine, DFlashLoadError
from specparity.model.types import GenerationRequest

MAX_NEW = 32


@pytest.fixture(scope="module", params=["dflash2", "dflash1"])
def engine(request):
    eng = DFlashEngine(model_options(request.param))
    yield eng
    eng.close()


def _requests(engine, prompts, n=4, max_new=MAX_NEW):
    return [
        GenerationRequest(p.id, engine.encode_prompt(p.prompt, p.messages_as_dicts()), max_new, engine.stop_token_ids())
        for p in prompts[:n]
    ]


@pytest.fixture(scope="module")
def picked(default_prompts):
    """Draft-friendly and draft-hostile prompts, one that stops early."""
    cats = {}
    for p in default_prompts:
        cats.setdefault(p.category, p)
    return [cats["repeat"], cats["code"], cats["zh_writing"], cats["commonsense"]]


def test_answers_the_protocol(engine):
    assert isinstance(engine, Engine)
    fp = engine.fingerprint()
    assert fp.engine == "dflash"
    assert fp.engine_version.startswith("dflash ") and "transformers " in fp.engine_version and "torch " in fp.engine_version
    assert fp.draft.kind == {"dflash2": "DFlash2DraftModel", "dflash1": "DFlashDraftModel"}[engine.spec_mode]
    assert fp.spec_config["block_size"] == engine.draft.block_size == fp.spec_config["draft_block_size"]
    assert fp.spec_config["target_layer_ids"] == list(engine.draft.target_layer_ids)
    if engine.spec_mode == "dflash2":
        assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(fp.spec_config)
    engine.set_block_size(3)
    assert engine.fingerprint().spec_config["block_size"] == 3
    engine.set_block_size(engine.draft.block_size)


def test_spec_output_is_the_greedy_output_and_counters_are_truthful(engine, picked):
    reqs = _requests(engine, picked)
    base = engine.generate(reqs, speculative=False)
    spec = engine.generate(reqs, speculative=True)
    accepted = 0
    for b, s in zip(base, spec):
        assert s.error is None, s.error
        assert s.output_ids == b.output_ids and s.finish_reason == b.finish_reason, s.request_id
        st = s.spec
        assert st.available and st.source.startswith("target forward hook")
        assert sum(x.emitted for x in st.steps) == len(s.output_ids) - 1  # the first token: prefill
        assert all(x.accepted <= x.proposed <= engine.block_size - 1 and 1 <= x.emitted <= x.accepted + 1
                   for x in st.steps)
        accepted += st.accepted
        # per-position scores come from the verify logits: the emitted token is their argmax
        assert len(s.scores) == len(s.output_ids)
        assert np.array_equal(s.scores.top_ids[:, 0], np.asarray(s.output_ids))
    assert accepted > 0, "the fixture draft must get tokens accepted"


def test_counts_are_cross_checked_with_dflash(engine, picked, monkeypatch):
    """A disagreement between the hook-derived counts and dflash's acceptance_lengths is an engine
    error for that request, not a silently wrong counter."""
    real = engine.loop._dm.dflash_generate

    def lying(*args, **kwargs):
        out = real(*args, **kwargs)
        lens = list(out.acceptance_lengths)
        return SimpleNamespace(**{**vars(out), "acceptance_lengths": lens[:-1] + [lens[-1] + 1]})

    monkeypatch.setattr(engine.loop._dm, "dflash_generate", lying)
    res = engine.generate(_requests(engine, picked, n=1), speculative=True)[0]
    assert res.error and "acceptance_lengths" in res.error


def test_cpu_timer_patch_is_scoped(engine, picked):
    """dflash's return_stats timer calls torch.cuda.synchronize(): the engine swaps it only during
    its own call and restores it (the package is not modified)."""
    original = engine.loop._dm._cuda_time
    engine.generate(_requests(engine, picked, n=1, max_new=4), speculative=True)
    assert engine.loop._dm._cuda_time is original
    if not torch.cuda.is_available():
        ids = torch.tensor([engine.encode_prompt("hi", None)])
        with pytest.raises(AssertionError, match="CUDA"):
            engine.loop._dm.dflash_generate(engine.draft, engine.target.model, ids, 4, [], return_stats=True)


def test_spec_scores_agree_with_teacher_forcing(engine, picked):
    req = _requests(engine, picked, n=1)[0]
    spec = engine.generate([req], speculative=True)[0]
    tf = engine.score(req.prompt_ids, spec.output_ids, req.top_k)
    assert np.array_equal(tf.top_ids[:, 0], spec.scores.top_ids[:, 0])
    assert np.abs(tf.logprobs - spec.scores.logprobs).max() < 1e-3


def _copy_draft(tmp_path, mode="dflash2"):
    dst = tmp_path / mode
    shutil.copytree(MODELS_DIR / mode, dst)
    return dst


def test_refuses_a_draft_of_the_other_kind():
    with pytest.raises(DFlashLoadError, match="--spec-mode dflash1 needs a DFlashDraftModel.*pass --spec-mode dflash2"):
        DFlashEngine(replace(model_options("dflash2"), spec_mode="dflash1"))
    with pytest.raises(DFlashLoadError, match="supports"):
        DFlashEngine(replace(model_options("dflash2"), spec_mode="draft"))
    with pytest.raises(DFlashLoadError, match="block size must be >= 1"):
        DFlashEngine(model_options("dflash2", num_draft_tokens=0))


def test_refuses_a_dflash2_config_without_architectures(tmp_path):
    """Such a checkpoint would silently run as DFlash v1 elsewhere."""
    d = _copy_draft(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("architectures")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashLoadError, match="names no DFlash draft.*DFlash2 keys"):
        DFlashEngine(replace(model_options("dflash2"), draft=str(d)))


def test_refuses_a_checkpoint_with_missing_or_renamed_tensors(tmp_path):
    """A tensor the checkpoint lacks keeps torch.empty garbage (base_kernel); one under an unknown
    name is dropped. Both would load "successfully" and accept nothing."""
    from safetensors.torch import load_file, save_file

    d = _copy_draft(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    key = next(k for k in sd if k.endswith("attention_conv.base_kernel"))
    sd[key.replace("base_kernel", "base_kernel_scale")] = sd.pop(key)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DFlashLoadError, match="missing keys"):
        DFlashEngine(replace(model_options("dflash2"), draft=str(d)))


def test_pytest_lossless_suite_runs_on_dflash(tmp_path):
    """The user-facing command: `pytest suites/lossless --engine dflash` passes and reports the
    accept length per category."""
    prompts = tmp_path / "repeat-code.jsonl"
    first_of_each(prompts, ("repeat", "code"))
    code, out = run_pytest(
        "-q", "suites/lossless", "--engine", "dflash",
        "--target", str(MODELS_DIR / "target"), "--draft", str(MODELS_DIR / "dflash2"),
        "--prompts", str(prompts), "--calibration", "selected", "--max-new-tokens", str(MAX_NEW),
        "--report", str(tmp_path / "r"),
    )
    assert code == 0, out[-3000:]
    assert "accept len" in out and "dflash" in out, out[-3000:]


#: Prompts whose bf16 decode (EOS ignored, 96 tokens) flips at a near-tie under the verify pass
#: with the committed fixtures (docs/notes/findings.md F5); re-pick them if the fixtures are rebuilt.
BF16_FLIP_PROMPTS = ("math-en-001", "math-en-004", "list-en-001", "repeat-en-005")
BF16_STEP = 0.0625  # one bf16 step of a logit around 8..16


def test_bf16_flips_are_near_ties_and_a_real_bug_still_diverges(default_prompts, record_property):
    """bf16: the batched verify pass and the single-token decode round differently, so greedy ties
    flip. The classifier must call those near_tie (margin within the measured threshold, the rest
    of the stream the target's own choice) and still call a loop bug diverged. How many prompts
    flip depends on the CPU's kernels (tests/test_bf16_near_ties.py): recorded, not asserted."""
    from broken_dflash import DFlashLoopEngine

    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import run_gate

    prompts = [p for p in default_prompts if p.id in BF16_FLIP_PROMPTS]
    opts = model_options("dflash2", dtype="bfloat16", extra={"stop_token_ids": "4"})  # <|pad|>: never emitted
    config = GateConfig(max_new_tokens=96)
    engine = DFlashEngine(opts)
    try:
        run = run_gate(engine, prompts, config)
    finally:
        engine.close()
    classes = [r.verdict.klass for r in run.records]
    assert "diverged" not in classes and "error" not in classes, [r.verdict.reason for r in run.records]
    ties = [r.verdict for r in run.records if r.verdict.klass == "near_tie"]
    record_property("bf16_flips", len(ties))
    record_property("bf16_flips_remerged", sum(v.divergence.remerge is not None for v in ties))
    for v in ties:
        assert v.divergence.baseline_margin <= BF16_STEP + 1e-6, v.reason
    buggy = DFlashLoopEngine(opts, "accept_past_mismatch")
    try:
        bad = run_gate(buggy, prompts, config)
    finally:
        buggy.close()
    assert sum(r.verdict.klass == "diverged" for r in bad.records) >= len(prompts) // 2, \
        [r.verdict.reason for r in bad.records]
