"""Where specparity keeps downloads and builds: outside any checkout.

``$SPECPARITY_CACHE``, else ``$XDG_CACHE_HOME/specparity``, else ``~/.cache/specparity``. Wheels
read by the probes, llama-server builds and GGUF conversions live here, keyed by what made them,
so a clean checkout never carries (or commits) them and a warm machine reuses them.
"""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    root = os.environ.get("SPECPARITY_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "specparity" if xdg else Path.home() / ".cache" / "specparity"


def wheel_cache_dir() -> Path:
    return user_cache_dir() / "wheels"
