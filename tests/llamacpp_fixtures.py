"""A real llama-server for tests: find it or skip (fail in CI), and a plugin engine that kills one.

``require_llamacpp()`` returns ``(binary, gguf_dir)`` — the ``llama-server`` that
``specparity.engines.server.llamacpp.find_binary()`` finds and the fixture GGUF directory
(``fixture_gguf_dir()``, with ``target.gguf`` and ``draft.gguf``). When either is missing the
calling test is skipped with the reason and the command that makes it; with
``SPECPARITY_REQUIRE_LLAMACPP=1`` (CI, ``ci/llamacpp.sh``) it fails instead, so a CI machine that
lost its build never goes green on skips. ``llamacpp`` is the same as a pytest fixture.

``killing_llamacpp`` is a plugin engine (``--engine tests/llamacpp_fixtures.py:killing_llamacpp``):
the real ``llamacpp`` engine, launching both servers itself, except that it SIGKILLs the
speculative ``llama-server`` (``ServerProcess.kill()``) right after its ``kill_after``-th
speculative request (``--engine-opt kill_after=N``, default 3) — a server dying mid-run.

``spec_args_llamacpp`` is a plugin engine (``--engine tests/llamacpp_fixtures.py:spec_args_llamacpp``):
the real ``llamacpp`` engine, launching both servers itself, with ``--engine-opt
spec_server_args='...'`` added to the speculative launch only (after ``server_args``, so a later
flag wins) — one side of a deployment configured differently from the other.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, parse_positive_int
from specparity.engines.server.llamacpp import INFO, OPTIONS, LlamaCppEngine, _engine, create
from specparity.engines.server.llamacpp_launch import find_binary, fixture_gguf_dir, launch_configs
from specparity.engines.server.engine import start_sessions

REQUIRE_ENV = "SPECPARITY_REQUIRE_LLAMACPP"
#: A child ``pytest`` that runs one of the project's suites (``suites/lossless``,
#: ``suites/invariance``) against llama.cpp: no cache directory, and none of the installed plugins
#: the suites never use (hypothesis, anyio, syrupy), whose imports cost about a second per child.
SUITE_PYTEST = (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                "-p", "no:anyio", "-p", "no:syrupy")
#: The GGUFs the llamacpp tests need (draft-simple's and draft-dflash's drafts; ``long.gguf``: the
#: 40K-context model of the long-context gate).
REQUIRED_GGUFS = ("target.gguf", "draft.gguf", "dflash2-llamacpp.gguf", "hybrid.gguf", "long.gguf")


def binary_missing() -> str | None:
    """Why no llama-server binary can run here, or None when one can."""
    binary = find_binary()
    if binary is None:
        return ("no llama-server binary (build one with `bash ci/llamacpp.sh` or "
                "`specparity llamacpp build`, or set $SPECPARITY_LLAMA_SERVER)")
    if not binary.is_file() or not os.access(binary, os.X_OK):
        return f"llama-server {binary} is not an executable file"
    return None


def llamacpp_missing() -> str | None:
    """Why no real llama-server run on the fixture GGUFs is possible here, or None when it is."""
    why = binary_missing()
    if why is not None:
        return why
    ggufs = fixture_gguf_dir()
    missing = [name for name in REQUIRED_GGUFS if not (ggufs / name).is_file()]
    if missing:
        return (f"no fixture GGUF {', '.join(missing)} in {ggufs} "
                "(convert the fixtures with `specparity llamacpp convert`)")
    return None


def _skip_or_fail(why: str | None) -> None:
    if why is not None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"needs a real llama-server: {why}; {REQUIRE_ENV}=1 is set", pytrace=False)
        pytest.skip(f"needs a real llama-server: {why}")


def require_llamacpp() -> tuple[Path, Path]:
    """(llama-server binary, fixture GGUF directory); skips the calling test when either is
    missing, or fails it when ``SPECPARITY_REQUIRE_LLAMACPP=1``."""
    _skip_or_fail(llamacpp_missing())
    binary = find_binary()
    assert binary is not None
    return binary, fixture_gguf_dir()


def require_llama_server() -> Path:
    """The llama-server binary alone (a test that converts its own models needs no fixture GGUF);
    skip or fail as :func:`require_llamacpp`."""
    _skip_or_fail(binary_missing())
    binary = find_binary()
    assert binary is not None
    return binary


#: The precision of the quantized fixture target (``specparity llamacpp convert --outtype q8_0``).
QUANTIZED = "q8_0"


def quantized_gguf_dir() -> Path:
    """Where ``specparity llamacpp convert --outtype q8_0`` writes the fixtures: the f16 directory's
    key with the precision appended."""
    ggufs = fixture_gguf_dir()
    return ggufs.with_name(f"{ggufs.name}-{QUANTIZED}")


def require_quantized_target() -> tuple[Path, Path]:
    """(llama-server binary, the fixture target quantized to Q8_0); skip or fail as
    :func:`require_llamacpp` when either is missing."""
    binary = require_llama_server()
    target = quantized_gguf_dir() / "target.gguf"
    _skip_or_fail(None if target.is_file() else
                  f"no {target} (make it with `specparity llamacpp convert --outtype {QUANTIZED} --only target`)")
    return binary, target


@pytest.fixture
def llamacpp() -> tuple[Path, Path]:
    """:func:`require_llamacpp` as a fixture."""
    return require_llamacpp()


# --------------------------------------------------------------------------- a server killed mid-run


def _check(options: EngineOptions) -> None:
    INFO.check(dataclasses.replace(options, extra={k: v for k, v in options.extra.items() if k != "kill_after"}))


def arm_kill(engine: LlamaCppEngine, after: int) -> LlamaCppEngine:
    """Make ``engine`` SIGKILL its launched speculative server right after its ``after``-th
    speculative ``generate`` call returns."""
    if not engine.spec.processes:
        raise ValueError("kill_after needs a speculative server launched by the gate (no --spec-url)")
    generate = engine.generate
    calls = {"spec": 0}

    def killing_generate(requests: Any, *, speculative: bool) -> Any:
        out = generate(requests, speculative=speculative)
        if speculative:
            calls["spec"] += 1
            if calls["spec"] == after:
                for proc in engine.spec.processes:
                    proc.kill()
        return out

    engine.generate = killing_generate  # type: ignore[method-assign]
    return engine


@engine_factory(EngineInfo(
    "llamacpp-killing",
    spec_modes=INFO.spec_modes,
    options={**OPTIONS, "kill_after": OptionSpec("SIGKILL the speculative llama-server after this many speculative "
                                                 "requests", parse=parse_positive_int)},
    dtypes=(),
    local_models=False,
    check=_check,
    server=True,
))
def killing_llamacpp(options: EngineOptions) -> LlamaCppEngine:
    after = int(options.extra.get("kill_after", 3))
    engine = create(dataclasses.replace(options, extra={k: v for k, v in options.extra.items() if k != "kill_after"}))
    try:
        return arm_kill(engine, after)
    except BaseException:
        engine.close()
        raise


# --------------------------------------------------------------------------- flags on one side only


def _without_spec_args(options: EngineOptions) -> EngineOptions:
    return dataclasses.replace(options, extra={k: v for k, v in options.extra.items() if k != "spec_server_args"})


@engine_factory(EngineInfo(
    "llamacpp-spec-args",
    spec_modes=INFO.spec_modes,
    options={**OPTIONS, "spec_server_args": OptionSpec("extra llama-server flags for the speculative launch only, "
                                                       "after server_args", parse=shlex.split)},
    dtypes=(),
    local_models=False,
    check=lambda options: INFO.check(_without_spec_args(options)),
    server=True,
    counters="request",
))
def spec_args_llamacpp(options: EngineOptions) -> LlamaCppEngine:
    rest = _without_spec_args(options)
    base, spec = launch_configs(rest)
    spec = dataclasses.replace(spec, extra=(*spec.extra, *options.extra.get("spec_server_args", ())))
    baseline, speculative = start_sessions(rest, (base, spec), "llama-server")
    try:
        return _engine(rest, baseline, speculative, spec.model, spec.draft, (base, spec))
    except BaseException:
        baseline.close()
        speculative.close()
        raise
