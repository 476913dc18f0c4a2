"""Gate policy: what a run must show to pass.

Policy (README "What each class means"):

* any ``diverged`` or ``error`` prompt fails;
* ``near_tie`` prompts are allowed up to ``max_near_tie`` (a fraction of prompts); ``strict``
  demands bit-exactness;
* a run in which speculation never accepted a single draft token fails as "speculation inactive":
  an exact match proves nothing if the draft never ran. An engine that reports no counters at all
  fails too unless ``allow_unknown_activity`` is set;
* a path never taken (reject, partial accept, full accept, block cut by the limit or by a stop
  token) is a warning, or a failure with ``require_all_paths``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from specparity import exitcodes
from specparity.coverage import PATHS
from specparity.records import GateConfig, GateRun


@dataclass
class GateDecision:
    passed: bool
    failures: list[str]
    warnings: list[str]
    counts: dict[str, int]
    interrupted: bool = False
    #: The engine could not run at all (failed health check or start-up): no verdict was reached.
    engine_error: bool = False

    @property
    def status(self) -> str:
        """``PASS``, ``FAIL`` or ``INTERRUPTED`` — what the summary's title and the journal say."""
        if self.interrupted:
            return "INTERRUPTED"
        return "PASS" if self.passed else "FAIL"

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return exitcodes.INTERRUPTED
        if self.engine_error:
            return exitcodes.ENGINE_ERROR
        return exitcodes.PASS if self.passed else exitcodes.GATE_FAILED

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "failures": list(self.failures),
            "warnings": list(self.warnings),
            "counts": dict(self.counts),
        }


def decide(run: GateRun, config: GateConfig) -> GateDecision:
    """Apply the policy to a finished (or partly finished) run."""
    counts = Counter(r.verdict.klass for r in run.records if r.verdict is not None)
    total = sum(counts.values())
    failures: list[str] = []
    warnings: list[str] = []
    if counts["diverged"]:
        ids = [r.prompt.id for r in run.records if r.verdict and r.verdict.klass == "diverged"]
        failures.append(f"{counts['diverged']} prompt(s) diverged: {', '.join(ids)}")
    if counts["error"]:
        ids = [r.prompt.id for r in run.records if r.verdict and r.verdict.klass == "error"]
        failures.append(f"{counts['error']} prompt(s) failed in the engine: {', '.join(ids)}")
    if counts["near_tie"]:
        frac = counts["near_tie"] / total
        if config.strict:
            failures.append(f"--bit-exact: {counts['near_tie']} near-tie flip(s) where bit-exactness is required")
        elif frac > config.max_near_tie:
            failures.append(
                f"{counts['near_tie']}/{total} near-tie prompts ({frac:.0%}) exceed --max-near-tie {config.max_near_tie:.0%}"
            )
    activity = run.activity()
    if activity.reported_requests == 0:
        msg = "speculation activity unknown: the engine reported no draft counters for any request"
        if run.counters_error:
            msg += f" (reading its aggregate counters after the speculative phase failed: {run.counters_error})"
        (warnings if config.allow_unknown_activity else failures).append(msg)
    elif activity.accepted == 0:
        failures.append(
            f"speculation inactive: {activity.proposed} draft tokens proposed over {activity.verify_steps} verify "
            f"steps and none accepted; an exact match proves nothing if the draft never ran"
        )
    missing = run.coverage.missing()
    for path in missing:
        msg = f"path never taken: {PATHS[path]} ({path})"
        (failures if config.require_all_paths else warnings).append(msg)
    if run.coverage.requests_with_steps == 0 and activity.reported_requests:
        warnings.append("path coverage unknown: the engine reports totals only, no per-step records")
    if run.interrupted:
        failures.append("the run was interrupted (Ctrl-C); the verdicts below are of the prompts that finished")
    if run.fatal:
        failures.append(f"the run stopped early: {run.fatal.splitlines()[0]}")
    not_run = [r.prompt.id for r in run.records if r.verdict is None]
    if not_run:
        failures.append(f"{len(not_run)} prompt(s) never finished: {', '.join(not_run)}")
    counts_out = {k: counts[k] for k in ("exact", "near_tie", "diverged", "error")}
    engine_error = run.fatal is not None and not any(r.verdict is not None or r.baseline is not None for r in run.records)
    return GateDecision(not failures, failures, warnings, counts_out, interrupted=run.interrupted,
                        engine_error=engine_error)
