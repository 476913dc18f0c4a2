"""The lossless gate: every prompt greedily with and without speculation, token by token.

``test_lossless[<prompt id>]`` fails for a ``diverged``, ``drifted`` (unless ``--drift-policy
warn``) or ``error`` prompt (and for a ``near_tie`` one when the run is bit-exact: ``--bit-exact``, or
an engine that declares deterministic inference, unless ``--allow-near-tie``; ``gate.bit_exact``),
with the reason and where to look.
``test_gate_policy`` applies the run-level rules: the near-tie budget, "speculation inactive",
path coverage and prompts that never finished.

This module ships in the package (``specparity lossless`` runs it from an installed wheel);
``suites/lossless/test_lossless.py`` in the checkout re-exports both tests, so
``pytest suites/lossless`` is unchanged. Its fixtures (``lossless_prompt``, ``gate_session``) come
from the plugin, ``specparity.plugin.pytest_plugin`` (loaded by this package's ``conftest.py``).
"""

from __future__ import annotations

import warnings

import pytest

from specparity.gate.decision import bit_exact, near_tie_policy


def test_lossless(lossless_prompt, gate_session):
    rec = gate_session.run.record(lossless_prompt.id)
    v = rec.verdict
    if v is None:
        pytest.fail(f"{lossless_prompt.id}: never finished ({gate_session.run.fatal or 'run stopped early'})", pytrace=False)
    if v.klass in ("diverged", "error"):
        pytest.fail(f"{lossless_prompt.id} [{v.klass}]: {v.reason}", pytrace=False)
    if v.klass == "drifted":
        if gate_session.run.config.policy.drift == "fail":
            pytest.fail(f"{lossless_prompt.id} [drifted]: {v.reason}", pytrace=False)
        warnings.warn(f"{lossless_prompt.id} drifted: {v.reason}", stacklevel=1)
    if v.klass == "near_tie":
        if bit_exact(gate_session.run):
            pytest.fail(f"{lossless_prompt.id} [near_tie; {near_tie_policy(gate_session.run)}]: {v.reason}",
                        pytrace=False)
        warnings.warn(f"{lossless_prompt.id} near-tie flip: {v.reason}", stacklevel=1)


def test_gate_policy(gate_session):
    d = gate_session.decision
    for w in d.warnings:
        warnings.warn(f"specparity: {w}", stacklevel=1)
    if not d.passed:
        pytest.fail("; ".join(d.failures), pytrace=False)
