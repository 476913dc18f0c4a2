"""SIGTERM ends a run as Ctrl-C does.

A CI runner's timeout, ``kill``, ``timeout(1)`` and Kubernetes stop a process with SIGTERM. Its default
disposition kills the interpreter on the spot: no ``finally`` block, no ``atexit`` hook, so the servers a
run launched (each in its own process group, so that Ctrl-C in a terminal does not reach them first) keep
running and holding their GPU memory, and the journal's interrupted ending is never written. Raising
:class:`Terminated` (a ``KeyboardInterrupt``) from the handler sends SIGTERM down the path Ctrl-C already
takes: the run in progress is concluded as interrupted, finished results stay, every launched server is
stopped.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signal.Signals(signum).name}")


def install() -> Any | None:
    """Turn SIGTERM into :class:`Terminated` in this process; returns the handler it replaced, or None
    when it left things as they were (not the main thread, or a handler other than the default is
    already set: the embedding program decides)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None
    signal.signal(signal.SIGTERM, _raise_terminated)
    return previous


def restore(previous: Any | None) -> None:
    """Undo :func:`install` (nothing when it changed nothing)."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    previous = install()
    try:
        yield
    finally:
        restore(previous)
