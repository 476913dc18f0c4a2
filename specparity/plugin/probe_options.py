"""Probe-specific pytest options, registered by the specparity pytest plugin.

``--target`` / ``--draft`` are shared with the lossless gate (model directories); the engine a
deploy will run is ``--probe-engine name==version`` (the gate's ``--engine`` names an engine to
drive, not a version to predict for). Everything here is prefixed ``--probe-``.
"""

from __future__ import annotations

import warnings
from typing import Any

from specparity.probes.live import DEFAULT_FLOOR, DEFAULT_RELATIVE
from specparity.probes.inputs import DEFAULT_WHEEL_CACHE
from specparity.probes.finding import Status, Finding


def add_probe_options(parser: Any) -> None:
    group = parser.getgroup("specparity probes")
    group.addoption("--probe-engine", default=None,
                    help="the engine and version a deploy will run, name==version (e.g. sglang==0.5.19); "
                    "required when suites/probes is selected explicitly")
    group.addoption("--probe-launch-flags", default=None,
                    help="server launch flags as one string, for the mamba slot prediction")
    group.addoption("--probe-sglang-source", default=None,
                    help="SGLang source to read (wheel, unpacked tree or installed package dir)")
    group.addoption("--probe-wheel-cache", default=DEFAULT_WHEEL_CACHE,
                    help="directory of cached sglang-<version>-*.whl files")
    group.addoption("--probe-live-engine", default=None,
                    help="engine for the live probes: hf, dflash, package.module:factory or file.py:factory "
                    "(else they skip)")
    group.addoption("--probe-accept-floor", type=float, default=DEFAULT_FLOOR,
                    help="absolute mean-accept-length floor for the acceptance probe")
    group.addoption("--probe-accept-relative", type=float, default=DEFAULT_RELATIVE,
                    help="fraction of the recorded accept length below which acceptance has collapsed")
    group.addoption("--probe-recorded-accept-length", type=float, default=None,
                    help="accept length recorded for this configuration")
    group.addoption("--probe-accept-record", default=None,
                    help="JSON file of recorded accept lengths keyed by engine fingerprint")
    group.addoption("--probe-stress-requests", type=int, default=8,
                    help="concurrent shared-prefix requests in the mamba stress probe")


def check_verdict(verdict: Finding) -> None:
    """Turn a verdict into a test outcome: fail -> failed test with the evidence, unknown -> skip
    with the reason, warn -> pass with a warning in the summary, ok -> pass."""
    import pytest

    if verdict.status is Status.FAIL:
        pytest.fail(verdict.render(), pytrace=False)
    if verdict.status is Status.UNKNOWN:
        pytest.skip(verdict.render())
    if verdict.status is Status.WARN:
        warnings.warn(verdict.render(), UserWarning, stacklevel=2)
