"""Findings about the gate's own measurement: a run that passes on them proved less than it says.

The threshold and the drift bound are measured before anything is judged (docs/CALIBRATION.md). Four
ways that measurement can be weaker than it looks, each a line of its own in the summary:

* **the speculative server's target computes differently** — the noise between the two server
  instances is above the noise within the baseline's (by more than the channel resolves), so it
  widened the threshold or the drift bound (:mod:`specparity.model.cross_instance`): up to the cap it
  is taken, beyond it never, and either way a run that passes does so on an allowance the
  speculative side helped to set;
* **the judged side's own noise exceeds the reference's** — the same rule, for ``specparity compare``
  and the concurrency sweep: the judged run's own decode-versus-teacher-forced noise above the
  reference's widened the allowance it is judged against;
* **no noise measured** — the threshold was set with ``--near-tie-nats`` and no baseline position was
  scored both ways: the latent-drift check is off (identical tokens whose rows moved are not judged)
  and the near-tie budget has no flip rate to follow;
* **a scorer check with nothing to check** — no baseline position had a clear margin, so a scorer off
  by one position or scoring another model would not have been caught, and its noise set the threshold.

They are warnings by default; under a bit-exact policy (``--bit-exact``, ``near_tie`` in the policy's
``fail_on``) or the policy key ``calibration_findings = "fail"`` they fail the gate.
"""

from __future__ import annotations

from specparity.model.gate_run import GatePolicy, GateRun


def calibration_findings(run: GateRun) -> list[str]:
    """The findings of ``run``'s calibration, one line each (empty when there is none, or when the run was
    not calibrated at all: that is a failure of its own)."""
    th = run.threshold
    if th is None or run.calibration_error or run.golden_error:
        return []
    found = []
    for widened in (th.cross_finding(), th.judged_finding()):
        if widened:
            found.append(f"finding: {widened}")
    if th.noise is None or not th.noise.pairs:
        found.append(
            f"no noise measured: the near-tie threshold {th.nats:.4g} nats was set by --near-tie-nats and no "
            f"baseline position was scored both ways, so the latent-drift check is off (identical tokens whose "
            f"speculative rows moved are not judged) and the near-tie budget has no flip rate to follow; fix the "
            f"baseline's decode or its teacher-forced scoring so the noise can be measured")
    check = run.scorer_check
    if check is not None and not check.get("clear_positions"):
        found.append(
            f"scorer check with nothing to check: no baseline position had a decode margin above "
            f"{check.get('clear_nats', 0):g} nats (the near-tie ceiling), so a teacher-forced scorer off by one "
            f"position or scoring another model would not have been caught, and its noise set the threshold; "
            f"calibrate on prompts with confident positions, or lower --near-tie-ceiling")
    return found


def findings_fail(policy: GatePolicy) -> str | None:
    """Why the findings fail the gate under ``policy``, in words (None: they are warnings)."""
    if policy.calibration_findings == "fail":
        return 'the policy\'s calibration_findings = "fail"'
    if policy.bit_exact:
        return "--bit-exact (or near_tie in the policy's fail_on)"
    return None
