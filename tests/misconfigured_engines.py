"""The real hf engine with one configuration mistake each, as a user makes them: the gate must
refuse to judge (or fail the prompt), never blame speculation or pass.

* ``stop_set`` — the harness is told a stop set that is not the model's, while decoding still stops
  at the model's own end tokens (a server's end-of-generation set, or a tokenizer-only directory's
  ``eos_token_id``);
* ``not_greedy`` — decoding runs a logit processor that bans repeated 3-grams (transformers'
  ``no_repeat_ngram_size``, as a server's penalties would) and reports the model's own rows;
* ``abort`` — one prompt (``prompt`` option, else the first request) is answered, on both sides,
  with an empty stream and finish reason ``abort``.
"""

from __future__ import annotations

from dataclasses import replace

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS, HFEngine
from specparity.model.types import TokenScores

MISTAKES = ("stop_set", "not_greedy", "abort")


class ForeignStopSet(HFEngine):
    """Says ``wrong`` (the smallest small id that is not a real stop id) is the stop set."""

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        self.real_stops = super().stop_token_ids()
        self.wrong = (min(set(range(16)) - set(self.real_stops)),)

    def stop_token_ids(self):
        return self.wrong

    def generate(self, requests, *, speculative):
        return super().generate([replace(r, stop_token_ids=self.real_stops) for r in requests], speculative=speculative)


class NotGreedy(HFEngine):
    """Decodes with a repeated-3-gram ban on both sides."""

    def __init__(self, options: EngineOptions):
        super().__init__(options)
        plain = self.target.generation_config

        def banned(req):
            config = plain(req)
            config.no_repeat_ngram_size = 3
            return config

        self.target.generation_config = banned


class AbortsOne(HFEngine):
    """Answers ``prompt_id`` (None: the first request it sees) with an empty stream and "abort"."""

    def __init__(self, options: EngineOptions, prompt_id: str | None = None):
        super().__init__(options)
        self.prompt_id = prompt_id

    def generate(self, requests, *, speculative):
        out = super().generate(requests, speculative=speculative)
        if self.prompt_id is None and out:
            self.prompt_id = out[0].request_id
        return [replace(r, output_ids=[], text="", finish_reason="abort", scores=TokenScores.empty(r.scores.k))
                if r.request_id == self.prompt_id else r for r in out]


@engine_factory(EngineInfo(
    "hf-misconfigured",
    spec_modes=("draft",),
    options={**HF_OPTIONS, "mistake": OptionSpec("the configuration mistake to make", choices=MISTAKES),
             "prompt": OptionSpec("abort: the prompt id answered with 'abort'")},
))
def create(options: EngineOptions) -> HFEngine:
    """``--engine tests/misconfigured_engines.py:create --engine-opt mistake=<name>``."""
    mistake = options.extra.get("mistake")
    if mistake == "stop_set":
        return ForeignStopSet(options)
    if mistake == "not_greedy":
        return NotGreedy(options)
    if mistake == "abort":
        return AbortsOne(options, options.extra.get("prompt"))
    raise ValueError(f"--engine-opt mistake: expected one of {', '.join(MISTAKES)}, got {mistake!r}")
