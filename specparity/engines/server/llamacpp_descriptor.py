"""llama.cpp's own facts beyond the protocol (:class:`~specparity.engines.server.descriptor.ServerDescriptor`):
the arms ``llama-server`` can set up and why it cannot set up the others, and how a reproducer reads its
answers. Its requests are sent as text (it tokenizes on the server) and never read a prompt cache."""

from __future__ import annotations

from specparity.engines.base import EngineOptions
from specparity.engines.server.arm_sizing import LONG_PROOF, ArmLaunch, ArmSizing, long_context_length
from specparity.engines.server.descriptor import ArmKnob, PrefixCache, ServerDescriptor, no_change


def _long(sizing: ArmSizing, options: EngineOptions) -> ArmLaunch:
    return ArmLaunch(("--ctx-size", str(long_context_length(sizing, options.target))))


ARMS = {
    "default": ArmKnob(
        "nothing",
        "free of every other arm's condition: cold and never preempted by construction (cache_prompt false; slots "
        "do not preempt), no prompt of the long arm's size",
        no_change),
    "long": ArmKnob("--ctx-size L on both launches", LONG_PROOF, _long),
}

UNSUPPORTED = {
    "deterministic": "llama-server has no deterministic / batch-invariant switch",
    "preempt": "llama-server's slots each own their context; it does not preempt",
    "prefix-warm": "not wired: llama-server's cache_prompt reuse is not read back (timings.cache_n)",
    "fp8-kv": "llama-server's KV cache types (--cache-type-k/v) have no fp8",
    "mamba-slots": "llama-server's slots each hold their own recurrent state; no slot pool to exhaust",
}

REPRO_PARSE = r'''
def parse(answer):
    """llama-server /completion: tokens, and completion_probabilities rows aligned by id (a token
    without a row, or an accepted draft token with no alternatives, is not reported)."""
    ids = [int(t) for t in answer["tokens"]]
    rows, cursor = [None] * len(ids), 0
    for row in answer.get("completion_probabilities") or []:
        while cursor < len(ids) and ids[cursor] != int(row["id"]):
            cursor += 1
        if cursor >= len(ids):
            break
        alts = row.get("top_logprobs") or []
        rows[cursor] = [(int(a["id"]), float(a["logprob"]), a.get("token")) for a in alts] or None
        cursor += 1
    return ids, rows
'''

DESCRIPTOR = ServerDescriptor(
    name="llamacpp",
    arms=ARMS,
    unsupported_arms=UNSUPPORTED,
    prefix_cache=PrefixCache(absent="every request sends cache_prompt: false"),
    no_preemption="llama-server's slots each own their context",
    tokenizes_on_server=True,
    repro_parse=REPRO_PARSE,
)
