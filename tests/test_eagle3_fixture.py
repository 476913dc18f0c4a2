"""The EAGLE-3 head in ``fixtures/models/eagle3`` (built by ``tools/build_eagle3.py``) fits the fixture
target as vLLM and SGLang load it, and drafts the target's own tokens.

The live runs (docs/SERVERS.md) serve it with vLLM ``eagle3`` and SGLang ``EAGLE3``; these checks keep a
rebuilt or edited head from reaching a GPU host broken: the layer ids name three distinct target layers
(the engines' fallback for a 4-layer target, (2, 2, 1), would feed ``fc`` two features instead of three),
both places the engines read them agree, and greedy chain drafting with the head, on the CPU, agrees
with the target's greedy decode well beyond chance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from specparity.model.locations import MODELS

HEAD, TARGET = MODELS / "eagle3", MODELS / "target"
TOOLS = Path(__file__).resolve().parents[1] / "tools"


def test_head_config_fits_the_target():
    head = json.loads((HEAD / "config.json").read_text())
    target = json.loads((TARGET / "config.json").read_text())
    ids = head["eagle_aux_hidden_state_layer_ids"]
    assert head["architectures"] == ["LlamaForCausalLMEagle3"]
    assert head["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    assert len(set(ids)) == len(ids) == 3 and all(1 <= k < target["num_hidden_layers"] for k in ids)
    assert head["draft_vocab_size"] is None and head["vocab_size"] == target["vocab_size"]
    with safe_open(str(HEAD / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        fc = f.get_slice("fc.weight").get_shape()
        q = f.get_slice("midlayer.self_attn.q_proj.weight").get_shape()
    assert fc == [head["hidden_size"], len(ids) * target["hidden_size"]]
    assert q == [head["num_attention_heads"] * head["head_dim"], 2 * head["hidden_size"]]
    # the target's embedding and lm_head are shared, never stored
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)


@pytest.fixture(scope="module")
def build_eagle3():
    sys.path.insert(0, str(TOOLS))
    try:
        import build_eagle3
    finally:
        sys.path.remove(str(TOOLS))
    return build_eagle3


def test_head_drafts_the_targets_tokens(build_eagle3):
    target = build_eagle3.load_target()
    head = build_eagle3.load_head(target, HEAD)
    acc = build_eagle3.suite_accept(head, target, k=4, limit=2)
    # 1.0 is a head that never agrees with the target; the recorded build accepts ~4.2 of 5 on the suite
    assert acc["ALL"] >= 2.0, acc
