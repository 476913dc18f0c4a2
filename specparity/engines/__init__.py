"""Engine registry: built-in names plus ``module:factory`` / ``path/to/file.py:factory``.

A factory is any callable taking :class:`~specparity.engines.base.EngineOptions` and returning an
object that answers the :class:`~specparity.engines.base.Engine` protocol, so a team can gate its
own decoder with ``--engine mypkg.mod:factory``. A factory may carry an
:class:`~specparity.engines.base.EngineInfo` (``@engine_factory``): its spec modes, ``--engine-opt``
keys and dtypes are then checked by :func:`check_options` before anything loads.

Every engine that runs local models (``EngineInfo.local_models``, or no declaration) gets the
committed fixtures when ``--target`` is not given — the fixture draft only with the fixture target,
never with a user's model (:func:`fill_model_defaults`) — and
every engine that is not a server (``EngineInfo.server`` false, or no declaration) runs with
``--threads`` applied to torch before its factory is called (:func:`build_engine`).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from specparity.engines.base import Engine, EngineInfo, EngineOptions
from specparity.engines.common import set_threads
from specparity.model.locations import FixtureError, fixture_dir

#: Built-in engines: name -> "module:factory", imported lazily (torch is heavy).
BUILTIN: dict[str, str] = {
    "hf": "specparity.engines.inprocess.hf:create",
    "dflash": "specparity.engines.inprocess.dflash:create",
    "llamacpp": "specparity.engines.server.llamacpp:create",
    "sglang": "specparity.engines.server.sglang:create",
    "vllm": "specparity.engines.server.vllm:create",
}
#: The built-in engines behind HTTP: their modules live under ``specparity/engines/server/`` and import
#: no torch. Read from :data:`BUILTIN`, so a new server engine is listed by adding its row there.
SERVER_ENGINES: tuple[str, ...] = tuple(name for name, target in BUILTIN.items()
                                        if target.startswith("specparity.engines.server."))
#: The built-in engines that run in this process: known without importing them (torch is heavy).
INPROCESS_ENGINES: tuple[str, ...] = tuple(name for name in BUILTIN if name not in SERVER_ENGINES)
_REQUIRED = ("encode_prompt", "decode", "stop_token_ids", "generate", "score", "fingerprint", "close")

Factory = Callable[[EngineOptions], Engine]


class EngineLoadError(ValueError):
    """An engine that cannot be found, imported or configured; the message names the option."""


def resolve_factory(spec: str, option: str = "--engine") -> Factory:
    """Import the factory named by ``spec`` (no model loads). ``option`` is the flag that named it,
    so an error blames the right one (``--engine`` or ``--live-engine``)."""
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise EngineLoadError(
            f"{option} {spec!r}: expected one of {', '.join(sorted(BUILTIN))} or 'module:factory' / "
            "'path/to/file.py:factory'"
        )
    module_part, _, attr = target.rpartition(":")
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise EngineLoadError(f"{option} {spec!r}: file {module_part} not found")
        # The file's folder goes on sys.path so a plugin can import the modules beside it.
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        module = _import_file(path, spec, option)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise EngineLoadError(f"{option} {spec!r}: cannot import module {module_part!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EngineLoadError(f"{option} {spec!r}: {module_part} has no callable {attr!r}")
    return factory


def _import_file(path: Path, spec: str, option: str):
    """Import a plugin file under its own name (``mine.py`` -> ``mine``), reusing the module when that
    file is already imported (the tests import ``broken_loops`` too) and a unique name when the
    stem is taken by another module."""
    existing = sys.modules.get(path.stem)
    if existing is not None:
        if Path(getattr(existing, "__file__", "") or "").resolve() == path:
            return existing
        mod_name = f"specparity_user_engine_{abs(hash(str(path)))}"
    else:
        mod_name = path.stem
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise EngineLoadError(f"{option} {spec!r}: cannot import {path}")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken plugin is bad input, said in one line
        del sys.modules[mod_name]
        raise EngineLoadError(f"{option} {spec!r}: importing {path.name} failed: {type(exc).__name__}: {exc}") from exc
    return module


def engine_info(factory: Factory) -> EngineInfo | None:
    info = getattr(factory, "engine_info", None)
    return info if isinstance(info, EngineInfo) else None


def server_descriptor(spec: str) -> Any:
    """The :class:`~specparity.engines.server.descriptor.ServerDescriptor` of the engine ``spec`` names (a
    built-in name or a ``module:factory`` / ``file.py:factory`` spec), from its factory's
    :class:`~specparity.engines.base.EngineInfo`; None for an engine that declares none (in-process engines,
    plugins that do not say) or a spec that does not resolve."""
    try:
        info = engine_info(resolve_factory(spec))
    except EngineLoadError:
        return None
    return info.descriptor if info is not None else None


def engines_applying(constraint: str) -> list[str]:
    """The built-in server engines whose :class:`EngineInfo` declares ``constraint`` (``json_schema``,
    ``grammar``): their modules are imported (no torch), no engine is built."""
    return [name for name in SERVER_ENGINES
            if constraint in getattr(engine_info(resolve_factory(name)), "constraints", ())]


def check_options(factory: Factory, options: EngineOptions, name: str) -> EngineOptions:
    """Check ``options`` against the factory's declaration; return them with ``extra`` values parsed
    and, for engines that run local models, ``target`` / ``draft`` defaulted to the fixtures
    (:func:`fill_model_defaults`).

    Unknown ``--engine-opt`` keys are refused, naming the keys the engine knows: a typo
    (``bugs=`` for ``bug=``) must never run the engine with the option silently ignored.
    """
    info = engine_info(factory)
    if info is None:
        if options.extra:
            raise EngineLoadError(
                f"--engine-opt {', '.join(sorted(options.extra))}: engine {name!r} declares no --engine-opt keys "
                "(its factory has no @engine_factory(EngineInfo(...)) declaration)"
            )
        return fill_model_defaults(None, options)
    unknown = sorted(set(options.extra) - set(info.options))
    if unknown:
        known = ", ".join(sorted(info.options)) or "none"
        raise EngineLoadError(f"--engine-opt {unknown[0]}: unknown key for engine {info.name!r} (it knows: {known})")
    if info.spec_modes and options.spec_mode is not None and options.spec_mode not in info.spec_modes:
        raise EngineLoadError(
            f"--spec-mode {options.spec_mode!r}: engine {info.name!r} supports {', '.join(info.spec_modes)}"
        )
    if not info.spec_modes and options.spec_mode is not None:
        raise EngineLoadError(f"--spec-mode {options.spec_mode!r}: engine {info.name!r} takes no --spec-mode")
    if info.dtypes and options.dtype not in info.dtypes:
        raise EngineLoadError(f"--dtype {options.dtype!r}: engine {info.name!r} supports {', '.join(info.dtypes)}")
    if not info.server and (options.baseline_urls or options.spec_urls or options.preset):
        flag = "--baseline-url" if options.baseline_urls else "--spec-url" if options.spec_urls else "--preset"
        raise EngineLoadError(f"{flag}: engine {info.name!r} runs in-process; server options need "
                              f"--engine {', '.join(SERVER_ENGINES[:-1])} or {SERVER_ENGINES[-1]}")
    parsed = {key: info.options[key].check(key, str(value)) for key, value in options.extra.items()}
    checked = fill_model_defaults(info, dataclasses.replace(options, extra=parsed))
    if info.check is not None:
        info.check(checked)
    return checked


def fill_model_defaults(info: EngineInfo | None, options: EngineOptions) -> EngineOptions:
    """``options`` with ``target`` / ``draft`` defaulted to the committed fixtures, for an engine that
    runs local models (``info.local_models``, or an undeclared factory); server engines are returned
    unchanged (their ``--target`` names what the server serves).

    ``target`` defaults to ``fixtures/models/target``. ``draft`` defaults, only with that fixture
    target, to the fixture draft of the spec mode (``--spec-mode``, else the engine's first declared
    mode): the DFlash fixture for ``dflash2`` / ``dflash1``, ``fixtures/models/draft`` for anything
    else — an engine that needs no draft (prompt lookup) ignores it. A given ``--target`` never
    gets a fixture draft: the engine refuses a missing draft it needs (``EngineInfo.check``). Without the fixtures (not a checkout) a missing ``--target`` is
    an error naming the flag; a missing draft fixture leaves ``draft`` None for the engine to decide.
    """
    if info is not None and not info.local_models:
        return options
    target, draft = options.target, options.draft
    if target is None:
        try:
            target = str(fixture_dir("target"))
        except FixtureError as exc:
            raise EngineLoadError(f"--target: not given, and the default fixture is missing: {exc}") from None
    if draft is None and options.target is None:  # the fixture draft goes only with the fixture target
        mode = options.spec_mode or (info.spec_modes[0] if info is not None and info.spec_modes else None)
        try:
            draft = str(fixture_dir(default_draft_fixture(mode)))
        except FixtureError:
            draft = None
    if (target, draft) == (options.target, options.draft):
        return options
    return dataclasses.replace(options, target=target, draft=draft)


def default_draft_fixture(spec_mode: str | None) -> str:
    """The fixture (``fixtures/models/<name>``) that is the default draft of ``spec_mode``."""
    from specparity.engines.inprocess.dflash import SPEC_MODES as DFLASH_MODES  # the one mode -> fixture table (no torch)

    return DFLASH_MODES[spec_mode][1] if spec_mode in DFLASH_MODES else "draft"


def apply_threads(info: EngineInfo | None, options: EngineOptions) -> None:
    """Pin torch's threads to ``--threads`` for an engine that is not a server (``info.server``
    false, or an undeclared factory). Torch is imported only then, and only when installed: a
    server engine never pays for it, and a torch-free plugin has no threads to pin."""
    if (info is not None and info.server) or not options.threads:
        return
    if importlib.util.find_spec("torch") is None:
        return
    set_threads(options.threads)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration, then as it was.

    Loading an in-process engine imports torch and transformers and builds its models: a few
    hundred thousand objects that live as long as the process. Left on, the collector walks that
    growing heap again and again while none of it is garbage yet: 0.6 of the 5 CPU-seconds of a
    one-prompt ``specparity run`` (docs/PERFORMANCE.md). Nothing is frozen or leaked; the first full
    collection after the load sees the heap once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_engine(factory: Factory, options: EngineOptions, spec: str, option: str = "--engine") -> Engine:
    """Call a resolved factory with checked options (``--threads`` applied first, see
    :func:`apply_threads`; the collector paused while it imports and loads, :func:`collector_paused`)
    and verify the result answers the protocol."""
    with collector_paused():
        apply_threads(engine_info(factory), options)
        engine = factory(options)
    missing = [m for m in _REQUIRED if not callable(getattr(engine, m, None))]
    if missing or not isinstance(getattr(engine, "name", None), str):
        what = ", ".join(missing) if missing else "a string attribute 'name'"
        raise EngineLoadError(f"{option} {spec!r}: the factory returned {type(engine).__name__} without {what}")
    return engine


def load_engine(spec: str, options: EngineOptions, option: str = "--engine") -> Engine:
    """Resolve, check and build the engine named by ``spec`` (``option``: the flag that named it)."""
    factory = resolve_factory(spec, option)
    try:
        checked = check_options(factory, options, spec)
    except ValueError as exc:
        raise EngineLoadError(str(exc)) from None
    return build_engine(factory, checked, spec, option)
