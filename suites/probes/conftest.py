"""Fixtures for the probe suite: ``pytest suites/probes --target DIR --draft DIR --engine sglang==0.5.19``.

``--target/--draft/--engine`` come from the root conftest (plain strings); the ``--probe-*``
options from :func:`specparity.pytest_options.add_probe_options`. Without ``--target`` and
``--engine`` every probe skips and says so: the suite probes *your* deploy, it has no default.
Live probes run only with ``--probe-live-engine`` (a built-in engine name or ``module:factory``).
"""

from __future__ import annotations

import pytest

from specparity.checkpoints import CheckpointError
from specparity.probes.capabilities import EngineSpecError
from specparity.probes.sglang_source import SourceError


def _opt(config: pytest.Config, name: str, default=None):
    return config.getoption(name, default=default)


@pytest.fixture(scope="session")
def probe_ctx(pytestconfig: pytest.Config):
    """The parsed target/draft/engine; bad input fails every probe with one line, no traceback."""
    from specparity.probes.runner import DEFAULT_WHEEL_CACHE, ProbeInputs, prepare

    target, engine = _opt(pytestconfig, "target"), _opt(pytestconfig, "engine")
    if not target or not engine:
        pytest.skip("probes need --target DIR and --engine name==version (plus --draft DIR for draft probes)")
    if "==" not in engine:
        # `pytest --engine dflash` from the root means the lossless gate's engine, not a deploy target.
        pytest.skip(f"--engine {engine!r} names an in-process engine for the lossless gate; probes need name==version")
    inputs = ProbeInputs(
        target=target,
        draft=_opt(pytestconfig, "draft"),
        engine=engine,
        launch_flags=_opt(pytestconfig, "probe_launch_flags"),
        sglang_source=_opt(pytestconfig, "probe_sglang_source"),
        wheel_cache=_opt(pytestconfig, "probe_wheel_cache", DEFAULT_WHEEL_CACHE),
    )
    try:
        return prepare(inputs)
    except (CheckpointError, EngineSpecError, SourceError, ValueError, OSError) as exc:
        pytest.fail(f"bad probe input: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def live_engine(pytestconfig: pytest.Config):
    """An engine from ``--probe-live-engine``; the live probes skip without one."""
    spec = _opt(pytestconfig, "probe_live_engine")
    if not spec:
        pytest.skip("live probe: pass --probe-live-engine (hf, dflash, package.module:factory) "
                    "(server engines for SGLang/vLLM/llama.cpp land in a later issue)")
    from specparity.engines import load_engine
    from specparity.engines.base import EngineOptions

    try:
        engine = load_engine(spec, EngineOptions(target=_opt(pytestconfig, "target"), draft=_opt(pytestconfig, "draft")))
    except (ValueError, OSError) as exc:
        pytest.fail(f"cannot load live engine {spec!r}: {exc}", pytrace=False)
    yield engine
    engine.close()
