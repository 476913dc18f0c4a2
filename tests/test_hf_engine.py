"""The embedded hf engine on the committed fixtures: protocol, truthful counters, scoring."""

from __future__ import annotations

import numpy as np
import pytest

from specparity.engines import EngineLoadError, load_engine
from specparity.engines.base import Engine, EngineOptions
from specparity.engines.inprocess.hf import HFEngine
from specparity.model.types import GenerationRequest


@pytest.fixture(scope="module", params=["draft", "prompt_lookup"])
def engine(request, hf_options):
    opts = EngineOptions(**{**vars(hf_options), "spec_mode": request.param})
    eng = HFEngine(opts)
    yield eng
    eng.close()


def _requests(engine, prompts, n=6, max_new=40):
    reqs = []
    for p in prompts[:n]:
        ids = engine.encode_prompt(p.prompt, p.messages_as_dicts())
        reqs.append(GenerationRequest(p.id, ids, max_new, engine.stop_token_ids()))
    return reqs


def test_answers_the_protocol(engine):
    assert isinstance(engine, Engine)
    fp = engine.fingerprint()
    assert fp.engine == "hf" and fp.target.sha256.startswith("sha256:")
    assert fp.spec_config["mode"] in ("draft", "prompt_lookup")
    assert engine.stop_token_ids(), "the fixture target must declare stop tokens"


def test_counters_are_consistent_with_the_output(engine, default_prompts):
    """Every emitted token comes from exactly one verify step (transformers verifies the first
    drafts together with the prompt, so prefill is a verify step too), and accepted counts never
    exceed what was proposed."""
    reqs = _requests(engine, [p for p in default_prompts if p.category in ("repeat", "code", "list")])
    total_accepted = 0
    for req, res in zip(reqs, engine.generate(reqs, speculative=True)):
        assert res.error is None, res.error
        s = res.spec
        assert s.available and s.steps is not None
        assert sum(x.emitted for x in s.steps) == len(res.output_ids)
        assert s.accepted == sum(x.accepted for x in s.steps) <= s.proposed
        assert all(x.accepted <= x.proposed and x.emitted <= x.accepted + 1 for x in s.steps)
        total_accepted += s.accepted
    assert total_accepted > 0, "the fixture draft must get tokens accepted"


def test_baseline_and_spec_scores_match_teacher_forcing(engine, default_prompts):
    req = _requests(engine, default_prompts, n=1)[0]
    base, spec = engine.generate([req], speculative=False)[0], engine.generate([req], speculative=True)[0]
    tf = engine.score(req.prompt_ids, base.output_ids, req.top_k)
    assert len(tf) == len(base.scores) == len(base.output_ids)
    assert np.array_equal(tf.top_ids[:, 0], np.asarray(base.output_ids)), "greedy tokens are the argmax"
    assert np.abs(tf.logprobs - base.scores.logprobs).max() < 1e-3
    assert base.spec.available is False
    assert len(spec.scores) == len(spec.output_ids)


def test_user_engine_from_module_and_file(tmp_path, hf_options):
    eng = load_engine("specparity.engines.inprocess.hf:create", hf_options)
    assert eng.name == "hf"
    eng.close()
    # A plugin outside the repository, importing a module beside it, written the public way: a loop
    # over a TorchTarget, joined by InProcessEngine.
    (tmp_path / "my_loops.py").write_text(
        "from specparity.engines.inprocess.hf import AssistedLoop\n"
        "class MyLoop(AssistedLoop):\n    name = 'mine'\n"
    )
    f = tmp_path / "my_engine.py"
    f.write_text(
        "from my_loops import MyLoop\n"
        "from specparity.engines.inprocess.loop import InProcessEngine, TorchTarget\n"
        "def factory(options):\n"
        "    target = TorchTarget.from_options(options)\n"
        "    return InProcessEngine(target, MyLoop(target, 'draft', 3, options.draft))\n"
        "def broken(options):\n    return object()\n"
    )
    eng = load_engine(f"{f}:factory", hf_options)
    assert eng.name == "mine" and eng.fingerprint().spec_config["num_draft_tokens"] == 3
    req = GenerationRequest("p", eng.encode_prompt("The cat", None), 8, eng.stop_token_ids())
    base, spec = eng.generate([req], speculative=False)[0], eng.generate([req], speculative=True)[0]
    assert base.error is None and spec.error is None and spec.output_ids == base.output_ids
    assert spec.spec.available and spec.spec.verify_steps > 0
    eng.close()
    with pytest.raises(EngineLoadError, match="without encode_prompt"):
        load_engine(f"{f}:broken", hf_options)
    with pytest.raises(EngineLoadError, match="no callable 'nope'"):
        load_engine(f"{f}:nope", hf_options)
    with pytest.raises(EngineLoadError, match="expected one of"):
        load_engine("nonsense", hf_options)
    with pytest.raises(EngineLoadError, match="not found"):
        load_engine(f"{tmp_path}/missing.py:factory", hf_options)
