"""Gate policy: what a run must show to pass.

Policy (README "What each class means"), from :class:`~specparity.model.gate_run.GatePolicy`:

* any ``diverged`` or ``error`` prompt fails; so does a ``drifted`` one unless ``drift`` is
  ``warn``; a speculative output that breaks its prompt's JSON schema where the baseline's kept it
  (:mod:`specparity.judge.structured`) is ``diverged`` and also named on a line of its own; a run that judged no prompt at all (an empty selection, nothing in common) fails:
  nothing judged is never a pass;
* a gate that could not be calibrated (scorer refused, threshold above its ceiling) fails with
  the engine-error exit code: nothing was judged;
* ``near_tie`` prompts are judged by a budget (:func:`near_tie_budget`), unless the run is
  bit-exact (:func:`bit_exact`): under ``--bit-exact``, or — by default — when the engine declares
  deterministic / batch-invariant inference for both sides (``GateRun.deterministic``): the engine
  promised bit-exact output, so any near tie, an exact tie included, breaks that promise and fails.
  ``--allow-near-tie`` keeps near ties within the budget despite the declaration. The budget
  follows the data by default: flips at an *exact tie* (both tokens the baseline row's argmax) are
  allowed and counted apart, and the other near-tie flips may not clearly exceed the count the
  baseline's own decode-versus-teacher-forced flips predict (:mod:`specparity.judge.flip_budget`).
  ``--max-near-tie F`` (or the policy key) replaces it with a fixed fraction of the prompts, ties
  included. No allowance without evidence: where the calibration does not bound the flip rate, the
  threshold was set by hand, or no flip rate was measured
  (:func:`specparity.judge.flip_budget.fixed_share_reason`), the flips that are not exact ties may be
  at most the fixed share (``DEFAULT_MAX_NEAR_TIE``, 25 %) of the prompts, exact ties keeping their
  own budget; the near-tie policy line says which budget applied and why;
* a run in which speculation never accepted a single draft token fails as "speculation inactive":
  an exact match proves nothing if the draft never ran. An engine that reports no counters at all
  fails too unless ``allow_unknown_activity`` is set, and so does one whose run-wide counters may
  hold another client's drafts (``GateRun.aggregate_unattributed``: other traffic on the server);
* a path never taken (reject, partial accept, full accept, block cut by the limit or by a stop
  token) is a warning; with ``require_paths`` N, a path taken on fewer than N prompts fails, and so
  does a speculative answer without per-step records (its paths are unknown: :func:`unrecorded_steps`);
* what the engine could not say is not lenient under a policy (``unknown_fails``): a determinism
  declaration unknown on some servers makes the run bit-exact, a check it had to skip
  (``GateRun.skipped_checks``) fails; without a policy both are warnings;
* under ``--force-reject`` (:mod:`specparity.model.force_reject`) nothing accepted is the point: the
  inactivity rule does not apply to ``all``; instead, fewer than ``MIN_REJECT_SHARE`` of the verify
  steps rejecting every draft (engines with totals only: any accepted draft) fails as a
  configuration error (exit 3), unless a prompt failed on its own (exit 1);
* with ``min_accept_length`` (the acceptance floor, ``--policy``), a mean accept length below it
  fails: lossless, but speculation collapsed;
* a finding about the gate's own measurement (:mod:`specparity.gate.calibration_findings`: the
  speculative server's target computing differently, no noise measured, a scorer check with nothing
  to check) is a warning; under a bit-exact policy or ``calibration_findings = "fail"`` it fails;
* a golden that cannot be used (missing, recorded under another fingerprint) fails: nothing was
  judged. Under ``--golden-mode baseline`` (a new baseline against the golden: an engine upgrade)
  nothing speculates, so the activity, coverage and floor rules do not apply.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping

from specparity.gate import exitcodes
from specparity.gate.calibration_findings import calibration_findings, findings_fail
from specparity.judge.checks import Check, verdict_checks
from specparity.judge.flip_budget import (NO_RATE, FlipExpectation, at_risk, bounded_words, expected_flips,
                                          fixed_share_reason)
from specparity.judge.resolution import resolution_words, ties_exact
from specparity.model.coverage import PATHS
from specparity.model.verdicts import CLASSES, Verdict
from specparity.model.force_reject import RejectShare
from specparity.model.gate_run import DEFAULT_MAX_NEAR_TIE, GatePolicy, GateRun
from specparity.model.threshold import FlipRate


#: The default near-tie policy, in the words the summary and the terminal use.
DATA_BUDGET = ("near ties within what the baseline's own numerics explain: exact-tie flips allowed and counted apart, "
               "the other flips at most the 99 % bound of the count its decode-versus-teacher-forced flips predict")
#: ... on a channel too coarse for a reported tie to be exact (:func:`ties_free`).
DATA_BUDGET_WITH_TIES = ("near ties within what the baseline's own numerics explain: every flip, reported ties "
                         "included, at most the 99 % bound of the count its decode-versus-teacher-forced flips predict")


@dataclass
class GateDecision:
    passed: bool
    failures: list[str]
    warnings: list[str]
    counts: dict[str, int]
    interrupted: bool = False
    #: The engine could not run at all (failed health check or start-up): no verdict was reached.
    engine_error: bool = False
    #: Whether the run's near ties fit the policy (:func:`near_tie_budget`), as the reports show it.
    near_tie_budget: Check | None = None
    #: The flips the baseline's own numerics predict, against the run's (None: no flip rate measured).
    flip_expectation: FlipExpectation | None = None
    #: Why the near ties fail the policy (one of ``failures``; None: they fit it).
    near_tie_failure: str | None = None

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


def _ids(run: GateRun, klass: str) -> str:
    return ", ".join(r.prompt.id for r in run.records if r.verdict and r.verdict.klass == klass)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def bit_exact(run: GateRun, policy: GatePolicy | None = None) -> bool:
    """Whether a near tie fails: ``policy.bit_exact`` when given (``--bit-exact`` / ``--allow-near-tie``),
    else whether the engine declares deterministic inference for both sides. The one rule that
    :func:`decide` and the per-prompt tests (``suites/lossless``) both apply."""
    policy = policy or run.config.policy
    if policy.bit_exact is not None:
        return policy.bit_exact
    return bool(run.deterministic) or unknown_strict(run, policy)


def unknown_strict(run: GateRun, policy: GatePolicy) -> bool:
    """Whether a determinism declaration unknown on some servers makes the run bit-exact: under a
    policy (``unknown_fails``), an unknown is not lenient; ``--allow-near-tie`` still allows."""
    return policy.bit_exact is None and policy.unknown_fails and bool(run.deterministic_unknown)


def near_tie_policy(run: GateRun, policy: GatePolicy | None = None) -> str:
    """Which near-tie policy applies and why, in one line (the summary and the terminal say it)."""
    policy = policy or run.config.policy
    why = fixed_share_why(run)
    if policy.max_near_tie is not None:
        budget = f"near ties allowed up to {_pct(policy.max_near_tie)} of the prompts"
    elif why is not None and ties_free(run):
        budget = (f"near-tie flips that are not exact ties allowed up to {_pct(DEFAULT_MAX_NEAR_TIE)} of the prompts, "
                  f"exact-tie flips allowed and counted apart ({why}, so the budget cannot follow the data)")
    elif why is not None:
        budget = (f"near-tie flips allowed up to {_pct(DEFAULT_MAX_NEAR_TIE)} of the prompts, reported ties included "
                  f"({why}, so the budget cannot follow the data; {coarse_channel(run)})")
    elif ties_free(run):
        budget = f"{DATA_BUDGET} ({bounded_words(_flip_rate(run))})"
    else:
        budget = f"{DATA_BUDGET_WITH_TIES} ({bounded_words(_flip_rate(run))}; {coarse_channel(run)})"
    if policy.bit_exact:
        also = f" (the engine declares it too: {run.deterministic})" if run.deterministic else ""
        return f"bit-exact: --bit-exact{also}"
    if policy.bit_exact is None and run.deterministic:
        return f"bit-exact: declared by the engine ({run.deterministic})"
    if unknown_strict(run, policy):
        return (f"bit-exact: the engine's determinism declaration is unknown on some servers, and under a policy an "
                f"unknown is not lenient ({run.deterministic_unknown})")
    if policy.bit_exact is False and run.deterministic:
        return f"{budget}: --allow-near-tie despite the declaration ({run.deterministic})"
    line = f"{budget} (--max-near-tie)" if policy.max_near_tie is not None else budget
    if run.deterministic_unknown:
        line += (f"; not bit-exact without a policy, since the declaration is unknown on some servers: "
                 f"{run.deterministic_unknown}")
    elif run.deterministic_partial:
        line += (f"; not bit-exact, since a declaration counts only when it covers both sides: "
                 f"{run.deterministic_partial}")
    return line


def _flip_rate(run: GateRun) -> FlipRate | None:
    return run.threshold.flip_rate if run.threshold is not None else None


def fixed_share_why(run: GateRun) -> str | None:
    """Why the run's near ties are held to the fixed share for lack of evidence (None: the budget from
    the data applies): :func:`specparity.judge.flip_budget.fixed_share_reason` of its threshold."""
    if run.threshold is None:
        return NO_RATE
    return fixed_share_reason(run.threshold.flip_rate, run.threshold.source)


def _near_ties(run: GateRun) -> list[Verdict]:
    return [r.verdict for r in run.records if r.verdict is not None and r.verdict.klass == "near_tie"]


def tie_flips(run: GateRun) -> list[Verdict]:
    """The near-tie verdicts whose split is an exact tie (both tokens the baseline row's argmax)."""
    return [v for v in _near_ties(run) if v.divergence is not None and v.divergence.tie]


def ties_free(run: GateRun) -> bool:
    """Whether a flip at a reported tie is an exact tie, allowed apart: the channel's resolution can tell
    one ulp of the logits (:func:`specparity.judge.resolution.ties_exact`; a record without a measured
    resolution: yes, as it was judged)."""
    return ties_exact(run.threshold.resolution if run.threshold is not None else None)


def coarse_channel(run: GateRun) -> str:
    """Why a reported tie is not exact on the run's channel, in words ("" when it is)."""
    if ties_free(run):
        return ""
    assert run.threshold is not None and run.threshold.resolution is not None
    return resolution_words(run.threshold.resolution)


def _which(run: GateRun) -> str:
    """" that are not exact ties", or ", reported ties included," where they count (:func:`ties_free`)."""
    return " that are not exact ties" if ties_free(run) else ", reported ties included,"


def free_ties(run: GateRun) -> list[Verdict]:
    """The exact-tie flips a budget leaves to their own budget (greedy decoding permits either tied token):
    none on a channel too coarse for a reported tie to be exact (:func:`ties_free`)."""
    return tie_flips(run) if ties_free(run) else []


def counted_flips(run: GateRun) -> list[Verdict]:
    """The near-tie flips a budget counts: every one but :func:`free_ties`."""
    free = {id(v) for v in free_ties(run)}
    return [v for v in _near_ties(run) if id(v) not in free]


def flip_expectation(run: GateRun) -> FlipExpectation | None:
    """The near-tie flips that are not exact ties against the count the baseline's own numerics
    predict for the judged prompts (None: the fixed share applies, :func:`fixed_share_why`)."""
    rate = _flip_rate(run)
    if rate is None or fixed_share_why(run) is not None:
        return None
    counts = [int(at_risk(r.baseline.scores, rate.window, rate.with_ties).sum()) for r in run.records
              if r.verdict is not None and r.verdict.klass != "error" and r.baseline is not None]
    return expected_flips(rate, counts, len(counted_flips(run)))


def near_tie_budget(run: GateRun, counts: Mapping[str, int], policy: GatePolicy | None = None,
                    expectation: FlipExpectation | None = None) -> Check:
    """Whether the run's near ties fit the policy, as a check (``ok``/``fail``) in words: the one
    rule :func:`decide` fails a run by and the reports show. ``counts``: prompts per class;
    ``expectation``: :func:`flip_expectation` of the run (computed when not given)."""
    policy = policy or run.config.policy
    n = counts.get("near_tie", 0)
    total = sum(counts.values())
    ties = len(tie_flips(run))
    if bit_exact(run, policy):
        return Check("fail" if n else "ok",
                     f"bit-exact run ({near_tie_policy(run, policy)}): any near tie fails, an exact tie too; this run "
                     f"has {n} ({ties} at exact ties)", "near_tie_budget",
                     numbers={"near_tie": n, "ties": ties, "judged": total})
    exp = expectation if expectation is not None else flip_expectation(run)
    if policy.max_near_tie is not None:
        frac = n / total if total else 0.0
        return Check("ok" if frac <= policy.max_near_tie else "fail",
                     f"near ties are allowed up to {policy.max_near_tie:.0%} of the prompts (--max-near-tie): this run "
                     f"has {n} of {total} judged ({frac:.0%}{f'; {ties} at exact ties' if ties else ''})",
                     "near_tie_budget", numbers={"near_tie": n, "ties": ties, "judged": total, "fraction": frac,
                                                 "allowed": policy.max_near_tie})
    if exp is None:
        free = len(free_ties(run))
        counted = max(0, n - free)
        frac = counted / total if total else 0.0
        why = fixed_share_why(run) or NO_RATE
        why += "" if ties_free(run) else f"; {coarse_channel(run)}"
        return Check("ok" if frac <= DEFAULT_MAX_NEAR_TIE else "fail",
                     f"near-tie flips{_which(run)} are allowed up to {DEFAULT_MAX_NEAR_TIE:.0%} of the prompts "
                     f"({why}): this run has {counted} of {total} judged "
                     f"({frac:.0%}{f'; {free} more at exact ties, allowed apart' if free else ''})", "near_tie_budget",
                     numbers={"near_tie": n, "ties": ties, "judged": total, "counted": counted, "fraction": frac,
                              "allowed": DEFAULT_MAX_NEAR_TIE})
    tied = (f"{ties} flip(s) at exact ties (allowed: greedy decoding permits either tied token)" if ties_free(run) else
            f"{ties} flip(s) at reported ties, counted with the others ({coarse_channel(run)})")
    return Check("ok" if exp.passed else "fail", f"{tied}; {exp.describe()}",
                 "near_tie_budget", numbers={"near_tie": n, "ties": ties, "judged": total, **exp.to_json()})


def prompt_checks(verdict: Verdict | None, run: GateRun, decision: GateDecision | None = None) -> list[Check]:
    """The checks a report shows for one prompt of ``run``: the comparison's own
    (:func:`specparity.judge.checks.verdict_checks`, against the run's measured noise) and, for a near
    tie, the run's near-tie budget from ``decision``."""
    checks = verdict_checks(verdict, noise=run.threshold.noise if run.threshold is not None else None)
    if verdict is not None and verdict.klass == "near_tie" and decision is not None \
            and decision.near_tie_budget is not None:
        checks.append(decision.near_tie_budget)
    return checks


#: Paths that ``--force-reject all`` takes away on purpose (their absence is no warning).
FORCED_AWAY = ("partial", "all")


def reject_share(run: GateRun) -> RejectShare | None:
    """Under ``--force-reject``: what share of verify steps took the reject path (None otherwise)."""
    mode = run.config.force_reject
    return RejectShare.counted(mode, run.coverage, run.activity()) if mode else None


def unrecorded_steps(run: GateRun, require_paths: int) -> str | None:
    """Under ``--require-all-paths``: the speculative answers that came without per-verify-step
    records, in one line naming the engine and what it returned (None: every one had them).

    An engine may declare ``counters="steps"`` (so the rule is not refused before it loads) and then
    answer totals or nothing; its paths are then unknown, and an unknown path is never a pass."""
    answered = [r for r in run.records if r.spec is not None and not r.spec.error]
    totals = [r for r in answered if r.spec.spec.available and r.spec.spec.steps is None]
    none = [r for r in answered if not r.spec.spec.available]
    if not totals and not none:
        return None
    engine = run.fingerprint.engine if run.fingerprint is not None else "the engine"
    what = []
    if totals:
        first = totals[0].spec.spec
        what.append(f"per-request totals without step records for {len(totals)} (first {totals[0].prompt.id}: "
                    f"{first.proposed} proposed, {first.accepted} accepted over {first.verify_steps} verify steps; "
                    f"source: {first.source or 'not given'})")
    if none:
        what.append(f"no speculation counters for {len(none)} (first {none[0].prompt.id}: "
                    f"{none[0].spec.spec.source or 'no reason given'})")
    return (f"--require-all-paths {require_paths}: engine {engine!r} declares per-verify-step counters but returned "
            f"{' and '.join(what)} of {len(answered)} speculative answer(s); the rule needs a record of each verify "
            "step, so the paths those prompts took are unknown")


def near_tie_failure(run: GateRun, counts: Mapping[str, int], policy: GatePolicy,
                     expectation: FlipExpectation | None) -> str:
    """Why the run's near ties fail its policy, in one line (called when :func:`near_tie_budget`
    fails): ``--bit-exact``, a declaration (made, or unknown under a policy), the fixed share, or
    more flips than the baseline's own numerics explain."""
    total = sum(counts.values())
    n = counts.get("near_tie", 0)
    if policy.bit_exact:
        return f"--bit-exact: {n} near-tie flip(s) where bit-exactness is required: {_ids(run, 'near_tie')}"
    if unknown_strict(run, policy) and not run.deterministic:
        return (f"determinism declaration unknown on some servers ({run.deterministic_unknown}): under a policy an "
                f"unknown is not lenient, so the run is bit-exact and {n} near-tie flip(s) fail (make every server "
                f"show its setting, or pass --allow-near-tie to allow): {_ids(run, 'near_tie')}")
    if bit_exact(run, policy):
        return (f"engine declares deterministic inference ({run.deterministic}): {n} near-tie flip(s) are a failure — "
                f"the engine promised bit-exact output (pass --allow-near-tie to allow): {_ids(run, 'near_tie')}")
    if policy.max_near_tie is not None:
        return f"{n}/{total} near-tie prompts ({n / total:.0%}) exceed --max-near-tie {policy.max_near_tie:.0%}"
    counted = counted_flips(run)
    flipped = ", ".join(v.prompt_id for v in counted)
    if expectation is None:
        return (f"{len(counted)}/{total} near-tie prompts{_which(run)} ({len(counted) / total:.0%}) exceed the fixed "
                f"share {DEFAULT_MAX_NEAR_TIE:.0%} ({fixed_share_why(run) or NO_RATE}): {flipped}")
    return (f"{expectation.counted()}, more than the {expectation.limit} the "
            f"baseline's own numerics explain (expected {expectation.expected:.1f}, 95 % interval "
            f"{expectation.low}–{expectation.high}): the verify numerics flip tokens the target's own two computations "
            f"do not: {flipped}")


def decide(run: GateRun, policy: GatePolicy | None = None) -> GateDecision:
    """Apply the policy (default: the run's own) to a finished (or partly finished) run."""
    policy = policy or run.config.policy
    counts = Counter(r.verdict.klass for r in run.records if r.verdict is not None)
    total = sum(counts.values())
    failures: list[str] = []
    warnings: list[str] = []
    if run.calibration_error:
        failures.append(f"the gate could not be calibrated, so nothing was judged: {run.calibration_error}")
    if run.golden_error:
        failures.append(f"the golden could not be used, so nothing was judged: {run.golden_error}")
    if not run.records and not run.interrupted:
        failures.append("nothing judged: no prompt was selected or in common, and a run that judges nothing never passes")
    if counts["drifted"]:
        msg = (f"{counts['drifted']} prompt(s) drifted: identical tokens (or a near tie) but the speculative run's "
               f"logprobs left the target's noise: {_ids(run, 'drifted')}")
        (failures if policy.drift == "fail" else warnings).append(msg)
    if counts["diverged"]:
        failures.append(f"{counts['diverged']} prompt(s) diverged: {_ids(run, 'diverged')}")
    broken = [r.prompt.id for r in run.records if r.verdict and (r.verdict.constraint or {}).get("problem")]
    if broken:
        failures.append(f"{len(broken)} prompt(s) broke their output constraint under speculation (the baseline's "
                        f"output kept it): {', '.join(broken)}")
    if counts["error"] and not (run.calibration_error or run.golden_error):
        failures.append(f"{counts['error']} prompt(s) failed in the engine: {_ids(run, 'error')}")
    expectation = flip_expectation(run)
    budget = near_tie_budget(run, counts, policy, expectation)
    tie_failure = near_tie_failure(run, counts, policy, expectation) if budget.state == "fail" else None
    if tie_failure:
        failures.append(tie_failure)
    activity = run.activity()
    speculates = not (run.config.golden and run.config.golden_mode == "baseline")
    nothing_judged = not any(r.verdict is not None and r.verdict.klass != "error" for r in run.records)
    if not speculates or not run.records or (nothing_judged and (run.calibration_error or run.golden_error)):
        pass  # nothing speculated: no activity, coverage or floor to check
    elif activity.reported_requests == 0 and run.aggregate_unattributed:
        (warnings if policy.allow_unknown_activity else failures).append(f"speculation {run.aggregate_unattributed}")
    elif activity.reported_requests == 0:
        msg = "speculation activity unknown: the engine reported no draft counters for any request"
        if run.counters_error:
            msg += f" (reading its aggregate counters after the speculative phase failed: {run.counters_error})"
        (warnings if policy.allow_unknown_activity else failures).append(msg)
    elif activity.accepted == 0 and run.config.force_reject != "all":
        failures.append(
            f"speculation inactive: {activity.proposed} draft tokens proposed over {activity.verify_steps} verify "
            f"steps and none accepted; an exact match proves nothing if the draft never ran"
        )
    mal = activity.mean_accept_length
    if speculates and policy.min_accept_length is not None and run.config.force_reject:
        warnings.append(f"acceptance floor min_accept_length {policy.min_accept_length:g} not applied: "
                        f"--force-reject {run.config.force_reject} rejects drafts on purpose")
    elif speculates and policy.min_accept_length is not None and mal is not None and mal < policy.min_accept_length:
        failures.append(f"acceptance floor: mean accept length {mal:.2f} is below the policy's min_accept_length "
                        f"{policy.min_accept_length:g} (lossless, but speculation collapsed)")
    forced = reject_share(run) if speculates and run.records else None
    forced_problem = forced.problem() if forced is not None and activity.reported_requests else None
    if forced_problem:
        failures.append(f"{forced_problem} (a configuration error: the run's output was compared, but the reject "
                        "path was not exercised as asked)")
    unrecorded = unrecorded_steps(run, policy.require_paths) if speculates and policy.require_paths else None
    if unrecorded:
        failures.append(unrecorded)
    for path in run.coverage.missing(max(1, policy.require_paths)) if speculates else []:
        if run.config.force_reject == "all" and path in FORCED_AWAY:
            continue  # every draft rejected on purpose: no accept path to take
        n = run.coverage.prompts[path]
        if policy.require_paths:
            failures.append(f"path taken on {n} prompt(s), fewer than --require-all-paths {policy.require_paths}: "
                            f"{PATHS[path]} ({path})")
        else:
            warnings.append(f"path never taken: {PATHS[path]} ({path})")
    strict = findings_fail(policy)
    for finding in calibration_findings(run):
        if strict:
            failures.append(f"{finding} — a failure under {strict}")
        else:
            warnings.append(finding)
    for rec in run.calibration_records:
        if run.golden_error or run.calibration_error:
            break  # nothing was measured on purpose: the failure above says why
        if rec.baseline is None or rec.baseline.error or rec.tf_error:
            cause = rec.baseline.error if rec.baseline is not None and rec.baseline.error else rec.tf_error or "not run"
            warnings.append(f"calibration prompt {rec.prompt.id} could not be measured: {cause}")
    for skipped in run.skipped_checks:
        if policy.unknown_fails:
            failures.append(f"{skipped}; under a policy a check that could not be made fails")
        else:
            warnings.append(skipped)
    if run.coverage.requests_with_steps == 0 and activity.reported_requests:
        warnings.append("path coverage unknown: the engine reports totals only, no per-step records")
    if run.interrupted:
        failures.append("the run was interrupted (Ctrl-C or SIGTERM); the verdicts below are of the prompts that finished")
    if run.fatal:
        failures.append(f"the run stopped early: {run.fatal.splitlines()[0]}")
    not_run = [r.prompt.id for r in run.records if r.verdict is None]
    if not_run:
        failures.append(f"{len(not_run)} prompt(s) never finished: {', '.join(not_run)}")
    counts_out = {k: counts[k] for k in CLASSES}
    engine_error = bool(run.calibration_error) or (
        run.fatal is not None and not any(r.verdict is not None or r.baseline is not None for r in run.records))
    # --force-reject all that rejected too little is a configuration error (exit 3), unless a prompt
    # failed on its own: a divergence found on the way is still the finding (exit 1)
    if forced_problem and not (counts["diverged"] or counts["error"] or counts["drifted"]):
        engine_error = True
    return GateDecision(not failures, failures, warnings, counts_out, interrupted=run.interrupted,
                        engine_error=engine_error, near_tie_budget=budget, flip_expectation=expectation,
                        near_tie_failure=tie_failure)


def judge_acceptance(comparison: Any, *, max_drop: float | None = None, tolerance: float | None = None) -> Any:
    """Apply the acceptance rule to a :class:`specparity.judge.acceptance.Comparison` (marks its rows,
    fills ``rule`` and ``failures``; returns it). One of:

    * ``max_drop`` (``specparity compare``, ``max_accept_drop``): a row fails when NEW's value is
      more than ``max_drop`` below OLD's **and** the whole interval of the difference lies below 0 —
      a drop larger than allowed that the prompts' spread does not explain;
    * ``tolerance`` (``specparity parity``): a row fails when the two runs differ by more than
      ``tolerance`` in either direction **and** the interval of the difference excludes 0.

    Applied to every category and to ``all``, on the prompts not flagged as artefacts (with them
    when every prompt is flagged). A row of fewer than ``acceptance.MIN_PROMPTS`` prompts is shown,
    never judged (its bootstrap understates the spread).
    Acceptance not recorded on a side fails nothing: ``comparison.not_recorded`` says so."""
    from specparity.judge.acceptance import MIN_PROMPTS

    c = comparison
    where = f"per category of at least {MIN_PROMPTS} prompts and overall, without the flagged prompts"
    if max_drop is not None:
        c.rule = (f"FAIL when NEW is more than max_accept_drop {max_drop:g} below OLD and the whole interval of "
                  f"the difference lies below 0 ({where})")
    else:
        c.rule = (f"FAIL when the runs differ by more than the tolerance {tolerance:g} and the interval of the "
                  f"difference excludes 0 ({where})")
    if c.not_recorded:
        return c
    for row in c.decided_on:
        if row.delta is None or row.low is None or row.prompts < MIN_PROMPTS:
            continue
        if max_drop is not None:
            row.failed = -row.delta > max_drop and row.high < 0
            what = f"dropped by {-row.delta:.3f} > max_accept_drop {max_drop:g}"
        else:
            row.failed = abs(row.delta) > tolerance and (row.low > 0 or row.high < 0)
            what = f"differs by {abs(row.delta):.3f} > tolerance {tolerance:g}"
        if row.failed:
            c.failures.append(f"acceptance {row.category}: {row.old:.3f} → {row.new:.3f} {what} "
                              f"(interval of the difference [{row.low:+.3f}, {row.high:+.3f}], {row.prompts} prompts)")
    return c
