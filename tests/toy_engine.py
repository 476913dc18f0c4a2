"""A fourth server engine, added the way an engine team adds one: this module and one registry row,
nothing else in the package (it talks to running servers, so it needs no preset).

``toy`` stands for a server that speaks the OpenAI completions dialect (the wire format and answers of
vLLM's ``/v1/completions``, which several servers copy), so it talks to the vLLM fake: its adapter is
vLLM's under another name, its descriptor declares its own arms — the default arm and ``prefix-warm``
(a prefix cache of 16-token blocks, emptied by ``POST /reset_prefix_cache``, cached tokens in
``usage.prompt_tokens_details``, preemptions counted on ``/metrics``) — and its reproducer parsers. ``tests/test_fourth_engine.py`` registers
it (``specparity.engines.BUILTIN["toy"]``) and runs the gate, two arms and a reproducer through it.
"""

from __future__ import annotations

import dataclasses

from specparity.engines.base import EngineOptions, engine_factory
from specparity.engines.server import vllm
from specparity.engines.server import vllm_wire
from specparity.engines.server.arm_sizing import ArmLaunch
from specparity.engines.server.descriptor import ArmKnob, PrefixCache, ServerDescriptor, no_change
from specparity.engines.server.engine import HFTokenizer, concurrency, resolve_tokenizer_dir, start_sessions
from specparity.engines.server.vllm_descriptor import REPRO_PARSE, REPRO_ROW_PARSE, read_block_size
from specparity.engines.common import artifact
from specparity.model.types import ArtifactId

NAME = "toy"
DESCRIPTOR = ServerDescriptor(
    name=NAME,
    arms={
        "default": ArmKnob("nothing", "each judged speculative request's cached tokens at most the prefix it shares "
                           "with another judged prompt (cold)", no_change),
        "prefix-warm": ArmKnob("a warm-up request per prompt (its prefix cache is always on)",
                               "every judged speculative request long enough to be cached found its whole prompt "
                               "cached (usage.prompt_tokens_details.cached_tokens)", no_change),
    },
    unsupported_arms={arm: "the toy server has no such knob"
                      for arm in ("deterministic", "preempt", "fp8-kv", "long", "mamba-slots")},
    every_arm=ArmLaunch(engine_opts={"dev_mode": True}),
    prefix_cache=PrefixCache(unit=16, read_unit=read_block_size, unit_source="/server_info cache_config.block_size",
                             reset="/reset_prefix_cache"),
    preemption_counter=("vllm:num_preemptions_total", "vllm:num_preemptions_total"),
    repro_parse=REPRO_PARSE,
    repro_row_parse=REPRO_ROW_PARSE,
)

WIRE = vllm_wire.WIRE


class ToyEngine(vllm.VLLMEngine):
    name = NAME
    descriptor = DESCRIPTOR


INFO = dataclasses.replace(vllm.INFO, name=NAME, descriptor=DESCRIPTOR)


@engine_factory(INFO)
def create(options: EngineOptions) -> ToyEngine:
    """Running servers only (``--baseline-url`` / ``--spec-url``): the toy launches nothing."""
    if not options.baseline_urls:
        raise ValueError("--baseline-url: the toy engine talks to running servers only")
    baseline, spec = start_sessions(options, (None, None), NAME)
    return ToyEngine(options, baseline, spec, HFTokenizer(resolve_tokenizer_dir(options, NAME)),
                     target=artifact(options.target) or ArtifactId("", "", ""), draft=artifact(options.draft),
                     max_concurrency=concurrency(options, spec), max_logprobs=vllm.DEFAULT_MAX_LOGPROBS)
