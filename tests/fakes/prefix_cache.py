"""The prefix cache of a fake server: the token sequences it holds, and how much of a new prompt they hold."""

from __future__ import annotations

import threading
from typing import Sequence


class PrefixCache:
    """Token sequences a server has cached, in whole units. ``unit``: what one cache entry holds (vLLM: a KV
    block, 16 tokens by default; SGLang's radix cache: a page, 1 token by default). A request is matched
    against the cache when it is scheduled (:meth:`match`) and its computed tokens are inserted when it
    finishes (:meth:`insert`), as both engines do. Thread-safe: a fake serves requests concurrently."""

    def __init__(self, unit: int = 1):
        self.unit = unit
        self.sequences: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()

    def match(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """The longest prefix of ``tokens`` (at most ``limit`` of them) the cache holds, in whole units."""
        key = tuple(tokens if limit is None else tokens[: max(0, limit)])
        with self._lock:
            best = max((_common(seen, key) for seen in self.sequences), default=0)
        return best // self.unit * self.unit

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache the whole units of ``tokens`` (a partial last unit is not kept)."""
        n = len(tokens) // self.unit * self.unit
        if n:
            with self._lock:
                self.sequences.add(tuple(tokens[:n]))

    def clear(self) -> None:
        with self._lock:
            self.sequences.clear()

    def full_hit(self, prompt_tokens: int, matched: int) -> bool:
        """Whether ``matched`` cached tokens are all a prompt of ``prompt_tokens`` can find: whole units of all
        but its last token (recomputed for the first output's logits)."""
        return matched > 0 and matched >= (prompt_tokens - 1) // self.unit * self.unit


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
