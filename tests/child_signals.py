"""Child processes that can be interrupted whatever the test run's own SIGINT disposition.

A shell starts background jobs (``nohup pytest > log 2>&1 &``, CI runners) with SIGINT ignored, and
an ignored disposition is inherited across ``exec``: Python then installs no KeyboardInterrupt
handler, and a test that sends Ctrl-C to a child would see the child shrug it off. Tests that
interrupt a child start it with :func:`default_sigint` as ``preexec_fn``, so the child gets the
disposition an operator's terminal gives it.
"""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """Runs in the child between fork and exec: SIGINT back to its default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
