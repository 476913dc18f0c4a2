"""Where an installed Python package lives, found without importing it.

Engines and probes read an installed engine's source (a launch flag's presence, a version file) to decide
what to send before starting it; importing vLLM or SGLang for that would pull in CUDA and take seconds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def installed_package_dir(name: str) -> Path | None:
    """The directory of the importable package ``name``, or None when there is none here."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])
