"""Gate configuration and policy: what a run must show to pass.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specparity.coverage import PATHS

if TYPE_CHECKING:
    from specparity.runner import GateRun

DEFAULT_MAX_NEW_TOKENS = 48
DEFAULT_MAX_NEAR_TIE = 0.25


@dataclass
class GateConfig:
    prompts: list[str] = field(default_factory=list)
    categories: list[str] | None = None
    max_new_tokens: int | None = None  # None: each prompt's own, else DEFAULT_MAX_NEW_TOKENS
    near_tie_nats: float | None = None  # None: measured from the baseline
    max_near_tie: float = DEFAULT_MAX_NEAR_TIE
    strict: bool = False
    report_dir: str | None = None
    top_k: int = 8
    require_all_paths: bool = False
    allow_unknown_activity: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_near_tie <= 1.0:
            raise ValueError(f"--max-near-tie: expected a fraction in [0, 1], got {self.max_near_tie}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: expected an integer >= 1, got {self.max_new_tokens}")
        if self.top_k < 5:
            raise ValueError(f"--top-k: expected >= 5 alternatives per position, got {self.top_k}")

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass
class GateDecision:
    passed: bool
    failures: list[str]
    warnings: list[str]
    counts: dict[str, int]


def decide(run: "GateRun", config: GateConfig) -> GateDecision:
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
            failures.append(f"--strict: {counts['near_tie']} near-tie flip(s) where bit-exactness is required")
        elif frac > config.max_near_tie:
            failures.append(
                f"{counts['near_tie']}/{total} near-tie prompts ({frac:.0%}) exceed --max-near-tie {config.max_near_tie:.0%}"
            )
    activity = run.activity()
    if activity.reported_requests == 0:
        msg = "speculation activity unknown: the engine reported no draft counters for any request"
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
    if run.fatal:
        failures.append(f"the run stopped early: {run.fatal.splitlines()[0]}")
    not_run = [r.prompt.id for r in run.records if r.verdict is None]
    if not_run:
        failures.append(f"{len(not_run)} prompt(s) never finished: {', '.join(not_run)}")
    return GateDecision(not failures, failures, warnings, {k: counts[k] for k in ("exact", "near_tie", "diverged", "error")})
