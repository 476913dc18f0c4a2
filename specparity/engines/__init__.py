"""Engine registry: built-in names plus ``module:factory`` / ``path/to/file.py:factory``.

A factory is any callable taking :class:`~specparity.engines.base.EngineOptions` and returning an
object that answers the :class:`~specparity.engines.base.Engine` protocol, so a team can gate its
own decoder with ``--engine mypkg.mod:factory``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable

from specparity.engines.base import Engine, EngineOptions

#: Built-in engines: name -> "module:factory", imported lazily (torch is heavy).
BUILTIN: dict[str, str] = {
    "hf": "specparity.engines.hf:create",
    "dflash": "specparity.engines.dflash:create",
}
_REQUIRED = ("encode_prompt", "decode", "stop_token_ids", "generate", "score", "fingerprint", "close")


class EngineLoadError(ValueError):
    pass


def _resolve(spec: str) -> Callable[[EngineOptions], Engine]:
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise EngineLoadError(
            f"--engine {spec!r}: expected one of {sorted(BUILTIN)} or 'module:factory' / 'path/to/file.py:factory'"
        )
    module_part, _, attr = target.rpartition(":")
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise EngineLoadError(f"--engine {spec!r}: file {path} not found")
        mod_name = f"specparity_user_engine_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise EngineLoadError(f"--engine {spec!r}: cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise EngineLoadError(f"--engine {spec!r}: cannot import module {module_part!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EngineLoadError(f"--engine {spec!r}: {module_part} has no callable {attr!r}")
    return factory


def load_engine(spec: str, options: EngineOptions) -> Engine:
    """Build the engine named by ``spec`` and check that it answers the protocol."""
    engine = _resolve(spec)(options)
    missing = [m for m in _REQUIRED if not callable(getattr(engine, m, None))]
    if missing or not isinstance(getattr(engine, "name", None), str):
        what = ", ".join(missing) if missing else "a string attribute 'name'"
        raise EngineLoadError(f"--engine {spec!r}: the factory returned {type(engine).__name__} without {what}")
    return engine
