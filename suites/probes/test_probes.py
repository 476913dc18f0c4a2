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


@pytest.mark.parametrize("probe", list(live.LIVE_PROBES))
def test_live_probe(live_engine, live_settings, probe, judge):
    finding = live.run_probe(probe, live_engine, live_settings)
    if finding is None:
        pytest.skip(f"{probe}: left out by its option (e.g. --probe-stress-requests 0)")
    judge(finding)
