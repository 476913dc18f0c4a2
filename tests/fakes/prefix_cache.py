"""The prefix cache of a fake server: which prompts it has seen, and how much of a new one they hold."""

from __future__ import annotations

import threading
from typing import Sequence


class PrefixCache:
    """Prompts a server has cached. ``unit``: what one cache entry holds (vLLM: a KV block of 16 tokens;
    SGLang's radix cache: one token). The prompt's last token is never cached: the engine recomputes it to
    get the first output logits. Thread-safe: a fake serves requests concurrently."""

    def __init__(self, unit: int = 1):
        self.unit = unit
        self.prompts: list[tuple[int, ...]] = []
        self._lock = threading.Lock()

    def lookup(self, prompt: Sequence[int]) -> tuple[int, bool]:
        """(cached tokens, whether the whole prompt was cached before) for a generation request, which
        is then cached itself."""
        key = tuple(prompt)
        with self._lock:
            best = max((_common(seen, key) for seen in self.prompts), default=0)
            full = key in self.prompts
            if not full:
                self.prompts.append(key)
        return min(best, len(key) - 1) // self.unit * self.unit, full


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
