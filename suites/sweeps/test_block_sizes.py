"""Losslessness of the dflash engine at every block size, with accept length and speed per size.

Each ``test_block[block-N]`` runs the whole gate (baselines, near-tie threshold, speculative runs,
classification, policy) at block size N on the sweep's prompt subset. Block 1 verifies only the
anchor — no draft token is ever proposed — so its one expected policy failure is "speculation
inactive"; its output must still be exact. The table lands in the terminal summary and in
``reports/sweeps/block_sizes.md``.
"""

from __future__ import annotations

import pytest

#: The block sizes around DFlash2's trained 8 (where is the knee?).
BLOCK_SIZES = (1, 2, 4, 6, 8, 12, 16)


@pytest.mark.parametrize("block", BLOCK_SIZES, ids=[f"block-{b}" for b in BLOCK_SIZES])
def test_block(sweep, block):
    run, decision, row = sweep.run(block)
    bad = [f"{r.prompt.id} [{r.verdict.klass}]: {r.verdict.reason}" for r in run.records
           if r.verdict and r.verdict.klass in ("diverged", "error")]
    assert not bad, "\n".join(bad)
    if block == 1:
        assert row.activity.proposed == 0 and row.activity.verify_steps > 0
        assert [f for f in decision.failures if "speculation inactive" not in f] == [], decision.failures
        return
    assert decision.passed, decision.failures
    assert all(s.proposed <= block - 1 for r in run.records for s in r.spec.spec.steps)
