"""A report file replaced whole: a reader (a browser, a CI step, a second run) never sees half of it."""

from __future__ import annotations

import os
from pathlib import Path


def replace_whole(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path`` (atomic on one
    filesystem). Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
