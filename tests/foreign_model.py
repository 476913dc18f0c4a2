"""A tiny model of a family the project does not ship, built in a test: Llama architecture, its own
byte-level BPE tokenizer trained here on a few sentences, special tokens at ids of its own (after
the learned vocabulary: BOS ``<s>``, EOS ``</s>``, end of turn ``<|eot_id|>``, pad), a BOS the
tokenizer adds to every text, two stop ids in ``generation_config.json`` (EOS and end of turn) and
a chat template of its own.

The weights are random (seeded, float32) and scaled up so that greedy decoding has clear margins,
and single-byte tokens never win (their output rows are zero): the gate needs a deterministic
model, not a good one. ``build_foreign_model(dest)`` writes the
directory with ``save_pretrained``; ``FOREIGN_PROMPTS`` are prompts in the ``prompts/README.md``
schema (raw text and chat messages).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: The text the tokenizer learns its merges from.
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a small model of another family speaks its own tokens",
    "numbers like 12 and 345 are split by the byte level pre tokenizer",
    "speculative decoding must write what the target alone would write",
    "every draft token is checked by the target before it is kept",
] * 4
BOS, EOS, EOT, PAD = "<s>", "</s>", "<|eot_id|>", "<pad>"
#: The chat template: its own markers, the BOS written by the template, each turn closed by EOT.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
VOCAB_SIZE = 300
#: ``tokenizer.ggml.pre`` for llama.cpp: the tokenizer splits text with GPT-2's byte-level regex.
GGUF_PRE = "gpt-2"

FOREIGN_PROMPTS = "\n".join(json.dumps(x) for x in [
    {"specparity_prompts": 1, "description": "prompts for the tiny foreign-family model built in tests"},
    {"id": "raw-fox", "category": "raw", "lang": "en", "prompt": "the quick brown fox", "max_new_tokens": 12},
    {"id": "raw-numbers", "category": "raw", "lang": "en", "prompt": "numbers like 12 and", "max_new_tokens": 12},
    {"id": "chat-draft", "category": "chat", "lang": "en",
     "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a draft token"}],
     "max_new_tokens": 12},
]) + "\n"


@dataclass(frozen=True)
class ForeignModel:
    path: Path
    bos_id: int
    eos_id: int
    eot_id: int
    pad_id: int


def build_foreign_model(dest: Path, *, seed: int = 0) -> ForeignModel:
    """Write the model, tokenizer and configs to ``dest`` (a new directory) and return its ids."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=VOCAB_SIZE, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([BOS, EOS, EOT, PAD])  # appended after the learned vocabulary
    bos, eos, eot, pad = (tok.token_to_id(t) for t in (BOS, EOS, EOT, PAD))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[EOT])
    fast.chat_template = CHAT_TEMPLATE
    dest.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=True, add_eos_token=False)  # what llama.cpp's converter reads
    cfg_path.write_text(json.dumps(cfg, indent=1))

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False,
                         initializer_range=0.3, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # single bytes never win: outputs are whole pieces (complete UTF-8 text)
        model.lm_head.weight[:256] = 0.0
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=[eos, eot], pad_token_id=pad,
                                               do_sample=False)
    model.save_pretrained(dest)
    return ForeignModel(dest, bos, eos, eot, pad)
