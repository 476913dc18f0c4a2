"""One test per probe. A predicted failure fails with its evidence; unknown skips with the reason,
or fails under ``--policy FILE`` unless the policy's ``allow_unknown`` names the probe.

Static probes read checkpoint headers, configs and the engine's source; nothing is loaded onto
a GPU. Live probes need ``--probe-live-engine`` and drive the engine through the engine protocol.
"""

from __future__ import annotations

import pytest

from specparity.probes import live
from specparity.probes.inputs import STATIC_PROBES


@pytest.mark.parametrize("probe", list(STATIC_PROBES))
def test_static_probe(probe_ctx, probe, judge):
    judge(STATIC_PROBES[probe](probe_ctx))


def test_first_decode(live_engine, judge):
    judge(live.first_decode(live_engine))


def test_acceptance_floor(live_engine, pytestconfig, judge):
    recorded = pytestconfig.getoption("probe_recorded_accept_length", default=None)
    record_file = pytestconfig.getoption("probe_accept_record", default=None)
    if recorded is None and record_file:
        recorded = live.load_recorded(record_file, live_engine.fingerprint())
    judge(live.acceptance_floor(
        live_engine,
        floor=pytestconfig.getoption("probe_accept_floor", default=live.DEFAULT_FLOOR),
        recorded=recorded,
        relative=pytestconfig.getoption("probe_accept_relative", default=live.DEFAULT_RELATIVE),
    ))


def test_mamba_stress(live_engine, pytestconfig, judge):
    judge(live.mamba_stress(live_engine, requests=pytestconfig.getoption("probe_stress_requests", default=8)))


def test_self_draft(live_engine, judge):
    judge(live.self_draft(live_engine))
