"""The engine protocol: the one small surface every engine answers.

As in vLLM's test ``conftest.py`` (``HfRunner`` / ``VllmRunner``), every engine — in-process
transformers, the dflash reference decoder, a server behind HTTP, or a team's own decoder loaded
with ``--engine mypkg.mod:factory`` — is driven through the same calls, so one comparison serves
all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from specparity.types import Fingerprint, GenerationRequest, GenerationResult, TokenScores


@dataclass
class EngineOptions:
    """What the command line (or a caller) tells an engine factory.

    ``spec_mode`` names the speculative method inside an engine (``draft``, ``prompt_lookup``,
    ``dflash2``, ``dflash1`` …); ``None`` means the engine's default. ``num_draft_tokens`` is the
    draft width / block size; ``None`` means the engine's default. Unknown keys go to ``extra`` so
    user engines can take their own options.
    """

    target: str | None = None
    draft: str | None = None
    spec_mode: str | None = None
    dtype: str = "float32"
    num_draft_tokens: int | None = None
    threads: int | None = 1
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """A greedy decoder that can run with and without speculation."""

    name: str

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        """Token ids for a plain prompt or chat messages (chat template applied)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of a token stream (for display only: verdicts compare ids)."""

    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end generation (EOS and friends)."""

    def generate(self, requests: Sequence[GenerationRequest], *, speculative: bool) -> list[GenerationResult]:
        """Decode each request greedily; return one result per request, in order.

        A request that fails returns ``GenerationResult.failed`` rather than raising, so a batch
        never loses the results that did finish.
        """

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        """Teacher-forced: the target's top-k logprobs at every position of ``continuation_ids``.

        Row i describes the distribution that predicts ``continuation_ids[i]`` given the prompt and
        ``continuation_ids[:i]``, computed in one pass.
        """

    def fingerprint(self) -> Fingerprint:
        """Engine, version, model and draft identity with content hashes, dtype, spec config."""

    def close(self) -> None:
        """Release processes, servers and memory."""
