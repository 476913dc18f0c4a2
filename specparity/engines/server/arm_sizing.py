"""What an arm's launch is sized from and what it changes, whatever the engine: the types every engine's
arm knobs (:class:`~specparity.engines.server.descriptor.ServerDescriptor`) build, and the sizes they share
(a KV budget that preempts, a mamba state pool that caps running requests, a long context). No engine is
named here: each engine's descriptor turns a size into its own flags.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specparity.engines.base import EngineOptions
from specparity.engines.server.engine import DEFAULT_CONCURRENCY
from specparity.model.arms import LONG_MAX_TOKENS, LONG_MIN_TOKENS

#: The KV cache block (tokens) the preempt arm's budgets are whole numbers of (vLLM's ``--block-size``
#: default; SGLang's pages are smaller, so a budget of whole blocks is whole pages too).
KV_BLOCK_TOKENS = 16
#: The tokens of slack each request needs beyond its prompt and output (speculative lookahead slots of a
#: verify step).
LOOKAHEAD_TOKENS = 16
#: A context length the long arm asks for is the prompts' longest request plus this much.
LONG_SLACK_TOKENS = 256


class ArmSetupError(ValueError):
    """An arm this engine or model cannot set up: one line naming the missing knob (bad input)."""


@dataclass(frozen=True)
class ArmSizing:
    """What the sizing of an arm's launch is computed from: each prompt's token count and output limit,
    and the requests in flight per server."""

    prompt_tokens: tuple[int, ...]
    max_new_tokens: tuple[int, ...]
    concurrency: int
    #: The mamba state slots a request of the speculative launch takes (the mamba-slots probe's prediction);
    #: None: the target is not a hybrid, or nothing was predicted.
    mamba_slots: int | None = None


@dataclass(frozen=True)
class ArmLaunch:
    """An arm's change to both launches: ``flags`` appended to each server's argv (after the preset's and
    ``--engine-opt server_args``), ``engine_opts`` other ``--engine-opt`` values, ``concurrency`` the
    requests in flight it needs (None: the run's own)."""

    flags: tuple[str, ...] = ()
    engine_opts: dict[str, Any] = field(default_factory=dict)
    concurrency: int | None = None

    def apply(self, options: EngineOptions) -> EngineOptions:
        """``options`` with this launch change (a new object; ``options`` is left as it was)."""
        extra = dict(options.extra)
        if self.flags:
            extra["server_args"] = [*(extra.get("server_args") or ()), *self.flags]
        extra.update(self.engine_opts)
        return replace(options, extra=extra)

    def describe(self) -> str:
        parts = [" ".join(self.flags)] if self.flags else []
        parts += [f"--engine-opt {k}={v}" for k, v in self.engine_opts.items()]
        if self.concurrency:
            parts.append(f"{self.concurrency} requests in flight")
        return "; ".join(parts) or "nothing"


def requests_in_flight(options: EngineOptions) -> int:
    """What a launched server is sent at once: ``--engine-opt max_concurrency``, else the default."""
    return int(options.extra.get("max_concurrency") or DEFAULT_CONCURRENCY)


def preempt_tokens(sizing: ArmSizing) -> int:
    """A KV budget (tokens) that holds the largest request and one block more, far less than what the
    ``concurrency`` requests in flight need together, so that running them preempts some mid-decode.
    (Half of their sum was measured not to preempt on vLLM 0.26.0: requests end before their limit, and
    the scheduler admits only what fits.)"""
    if sizing.concurrency < 2:
        raise ArmSetupError(f"preempt: {sizing.concurrency} request in flight cannot preempt another; raise "
                            "--engine-opt max_concurrency (at least 2)")
    sizes = sorted((p + n + LOOKAHEAD_TOKENS for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens)),
                   reverse=True)
    if len(sizes) < 2:
        raise ArmSetupError("preempt: one prompt cannot preempt another; select two or more prompts")
    return sizes[0] + KV_BLOCK_TOKENS


def mamba_slots_size(sizing: ArmSizing) -> tuple[int, int]:
    """(``--max-mamba-cache-size``, the running-request cap it gives): state slots for half the requests in
    flight (at least one request), so that the rest wait for a slot. SGLang caps its running requests at the
    pool's size divided by the slots a request takes (``max_running_requests is capped to N by the mamba state
    cache``); the slots per request are the mamba-slots probe's prediction for the launch."""
    if sizing.concurrency < 2:
        raise ArmSetupError(f"mamba-slots: {sizing.concurrency} request in flight cannot wait for another's state "
                            "slot; raise --engine-opt max_concurrency (at least 2)")
    if not sizing.mamba_slots:
        raise ArmSetupError("mamba-slots: the target has no linear-attention layers (no mamba state slots); "
                            "the arm needs a hybrid target")
    cap = max(1, sizing.concurrency // 2)
    return sizing.mamba_slots * cap, cap


def preempt_context(sizing: ArmSizing) -> int:
    """The context length of a preempt launch: the largest request, whole blocks (never above the budget
    of :func:`preempt_tokens`, which holds it plus a block)."""
    largest = max(p + n + LOOKAHEAD_TOKENS for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens))
    return math.ceil(largest / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def max_positions(target: str | None) -> int | None:
    """The target's ``max_position_embeddings`` (config.json, or its ``text_config``); None when unreadable."""
    if not target:
        return None
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for c in (config, config.get("text_config") or {}):
        value = c.get("max_position_embeddings") if isinstance(c, dict) else None
        if isinstance(value, int):
            return value
    return None


def long_prompt_tokens(target: str | None) -> int:
    """The long arm's prompt size: :data:`LONG_MAX_TOKENS` where the target's positions allow, else
    :data:`LONG_MIN_TOKENS`; ArmSetupError when even that does not fit (or the config is unreadable)."""
    limit = max_positions(target)
    if limit is None:
        raise ArmSetupError(f"long: cannot read max_position_embeddings from --target {target!r}/config.json; "
                            f"the long arm needs a target of at least {LONG_MIN_TOKENS} positions")
    for size in (LONG_MAX_TOKENS, LONG_MIN_TOKENS):
        if size + 2 * LONG_SLACK_TOKENS <= limit:
            return size
    raise ArmSetupError(f"long: the target's max_position_embeddings is {limit}, below the "
                        f"{LONG_MIN_TOKENS + 2 * LONG_SLACK_TOKENS} tokens a {LONG_MIN_TOKENS}-token prompt and its "
                        "answer need")


def long_context_length(sizing: ArmSizing, target: str | None) -> int:
    """The context a long run is launched with: its longest request plus slack, within the target's positions."""
    need = max(p + n for p, n in zip(sizing.prompt_tokens, sizing.max_new_tokens)) + LONG_SLACK_TOKENS
    limit = max_positions(target)
    if limit is not None and need > limit:
        raise ArmSetupError(f"long: the longest prompt needs {need} tokens of context, above the target's "
                            f"max_position_embeddings {limit}")
    return need


#: The long arm's proof, the same on every engine.
LONG_PROOF = (f"every judged prompt is >= {LONG_MIN_TOKENS} tokens (the engine's own prompt token count where it "
              "reports one)")
