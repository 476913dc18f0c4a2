"""The requests a server engine sent its speculative servers, counted as their answers arrive.

:class:`~specparity.model.traffic.Traffic` compares this count with the servers' own; it is shared by
every view of the engine (``on_speculative_side`` copies the engine, not the tally), and safe under
the run's concurrent requests.
"""

from __future__ import annotations

import threading
from typing import Any


class TrafficTally:
    """Answered requests and the tokens they carried (``usage.completion_tokens``, the answer's own
    count of what the server generated for it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished = 0
        self.generated = 0

    def add(self, answer: Any, fallback_tokens: int) -> None:
        """One answer received: its ``usage.completion_tokens``, else ``fallback_tokens``."""
        usage = answer.get("usage") if isinstance(answer, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        with self._lock:
            self.finished += 1
            self.generated += int(tokens) if isinstance(tokens, int) and not isinstance(tokens, bool) else fallback_tokens

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.finished, self.generated
