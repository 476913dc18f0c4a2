"""Fixtures for the probe suite: ``pytest suites/probes --target DIR --draft DIR --probe-engine sglang==0.5.19``.

The suite probes *your* deploy; it has no default. Selected explicitly (``pytest suites/probes``)
without ``--probe-engine`` and ``--target`` it is a usage error (exit 4): a CI job that forgets a
flag must not go green on eight skips. Collected as part of the whole test suite (a plain
``pytest``) with neither given, every probe skips and says why. Live probes run only with
``--probe-live-engine`` (a built-in engine name or ``module:factory``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specparity.probes.checkpoints import CheckpointError
from specparity.probes.version_facts import EngineSpecError
from specparity.probes.sglang_source import SourceError

HERE = Path(__file__).resolve().parent


def _opt(config: pytest.Config, name: str, default=None):
    return config.getoption(name, default=default)


def _selected_explicitly(config: pytest.Config) -> bool:
    for arg in config.args:
        path = Path(str(arg).split("::")[0]).resolve()
        if path == HERE or HERE in path.parents:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    if not _selected_explicitly(config):
        return
    missing = [flag for flag, name in (("--probe-engine name==version", "probe_engine"), ("--target DIR", "target"))
               if not _opt(config, name)]
    if missing:
        raise pytest.UsageError(
            f"specparity: suites/probes needs {' and '.join(missing)} (e.g. --probe-engine sglang==0.5.19 "
            "--target DIR --draft DIR); without them every probe would skip"
        )


@pytest.fixture(scope="session")
def probe_ctx(pytestconfig: pytest.Config):
    """The parsed target/draft/engine; bad input fails every probe with one line, no traceback."""
    from specparity.probes.inputs import DEFAULT_WHEEL_CACHE, ProbeInputs, prepare

    target, engine = _opt(pytestconfig, "target"), _opt(pytestconfig, "probe_engine")
    if not target or not engine:
        pytest.skip("probes need --target DIR and --probe-engine name==version (plus --draft DIR for draft probes)")
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
        pytest.skip("live probe: pass --probe-live-engine (hf, dflash, package.module:factory)")
    from specparity.engines import EngineLoadError, load_engine
    from specparity.engines.base import EngineOptions

    try:
        engine = load_engine(spec, EngineOptions(target=_opt(pytestconfig, "target"), draft=_opt(pytestconfig, "draft")),
                             "--probe-live-engine")
    except (EngineLoadError, ValueError, OSError) as exc:
        pytest.fail(f"cannot load live engine {spec!r}: {exc}", pytrace=False)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def live_settings(pytestconfig: pytest.Config):
    """The live probes' settings from the ``--probe-*`` options."""
    from specparity.probes.live import DEFAULT_FLOOR, DEFAULT_RELATIVE, LiveSettings

    return LiveSettings(floor=_opt(pytestconfig, "probe_accept_floor", DEFAULT_FLOOR),
                        relative=_opt(pytestconfig, "probe_accept_relative", DEFAULT_RELATIVE),
                        recorded=_opt(pytestconfig, "probe_recorded_accept_length"),
                        record_file=_opt(pytestconfig, "probe_accept_record"),
                        stress_requests=_opt(pytestconfig, "probe_stress_requests", 8))


@pytest.fixture(scope="session")
def judge(pytestconfig: pytest.Config):
    """``check_verdict`` under the gate policy (``--policy FILE``): a probe answering unknown fails
    unless the policy's ``allow_unknown`` names it; without a policy, unknown skips with the reason."""
    from specparity.gate.policy_file import PolicyError, allowed_unknown, judge_unknown
    from specparity.plugin.probe_options import check_verdict

    policy = _opt(pytestconfig, "policy")
    try:
        allowed = allowed_unknown(policy) if policy else None
    except PolicyError as exc:  # the gate plugin refuses it first (exit 4); without the plugin, one line here
        pytest.fail(f"specparity: {exc}", pytrace=False)

    def judge_finding(finding) -> None:
        check_verdict(finding if allowed is None else judge_unknown(finding, allowed, policy))

    return judge_finding
