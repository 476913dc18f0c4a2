"""The near-tie threshold of a run, measured once the baselines are in: which records the noise is measured on,
the words for that set, the calibration itself and where its problem shows. The one calibration of a gate run
(:mod:`specparity.run.runner`) and of a merge of its shards (:mod:`specparity.run.merge`), so both derive the
threshold, its scorer check and its reproducer's spot alike.
"""

from __future__ import annotations

from typing import Any, Sequence

from specparity.judge.calibration import Sample, calibrate, widest_difference
from specparity.judge.noise import CalibrationError
from specparity.model.gate_run import GateRun, PromptRecord


def calibration_label(run: GateRun, n: int) -> str:
    """Which prompts the noise was measured on, in words (the threshold's ``calibration``); a shard
    says that its figure is its share's alone (the merge measures the run's on every shard's)."""
    extra = len(run.calibration_records)
    source = run.config.calibration if run.calibrated_apart else "selected"
    if source == "selected":
        label = f"the {n} prompt(s) that ran (the threshold depends on which prompts were selected)"
    elif source == "suite":
        label = f"every prompt of the prompt files ({n} measured, {extra} of them run only for calibration)"
    else:
        label = f"the calibration set {source} ({n} prompts measured)"
    shard = run.config.shard
    if shard is not None:
        label += (f", in shard {shard.label} only (`specparity merge` measures the run's threshold on the noise of "
                  f"every shard)")
    return label


def calibration_measured(run: GateRun) -> list[PromptRecord]:
    """The records the noise is measured on: the calibration set (the selected prompts it reuses and its
    own), or the selected prompts when it is not apart; only those whose baseline decoded and was scored.
    The one choice of a run and of a merge of its shards."""
    if run.calibrated_apart:
        reused = set(run.calibration_reused)
        pool = [r for r in run.records if r.prompt.id in reused] + run.calibration_records
    else:
        pool = run.records
    return [r for r in pool if r.baseline is not None and not r.baseline.error and r.baseline_tf is not None]


def calibration_spot(run: GateRun, samples: Sequence[Sample]) -> dict[str, Any] | None:
    """Where the two scorings behind the calibration's problem differ most, among the selected prompts
    (their requests are journalled, so a reproducer can send them again): both comparisons for a refused
    calibration, the cross-instance one for a finding; None without a problem."""
    selected = {r.prompt.id for r in run.records}
    chosen = [s for s in samples if s.prompt_id in selected]
    if run.calibration_error:
        return widest_difference(chosen)
    if run.threshold is not None and run.threshold.cross_finding():
        return widest_difference(chosen, ("cross",))
    return None


def cross_failure_note(failed: Sequence[str], measured: int) -> str:
    """What the cross-instance figure lacks, in words ("" when nothing failed): ``failed`` holds
    ``"<prompt id>: <why>"`` per calibration prompt the speculative server could not score."""
    if not failed:
        return ""
    return (f"scoring on the speculative server failed for {len(failed)} of {measured} calibration "
            f"prompt(s) (first: {sorted(failed)[0]})")


def calibrate_run(run: GateRun, samples: Sequence[Sample], cross_note: str) -> str | None:
    """Calibrate ``run`` on ``samples`` (the baselines' rows against their teacher-forced scores, with the
    speculative server's where measured; ``cross_note`` says what those lack): set its threshold and scorer
    check, or its ``calibration_error``, and in either case the spot where the calibration's problem shows.
    Returns None when a threshold was derived, else why not (the run then judges nothing)."""
    config = run.config
    try:
        check, run.threshold = calibrate(samples, scorer=run.scorer, ceiling=config.near_tie_ceiling,
                                         override=config.near_tie_nats, label=calibration_label(run, len(samples)),
                                         cross_note=cross_note)
        run.scorer_check = check.to_json()
        refused = None
    except (CalibrationError, ValueError) as exc:  # ValueError: no position was scored both ways
        run.calibration_error = refused = str(exc)
    run.calibration_spot = calibration_spot(run, samples)
    return refused
