"""The gate's calibration cannot be disarmed: a wrong scorer is refused, a measured threshold has a
ceiling, latent drift has its own bound, and the selection does not move the threshold."""

from __future__ import annotations

import json

import numpy as np
import pytest

from broken_loops import LoopEngine
from fault_engines import RescoredEngine
from inprocess import run_pytest
from prompt_subsets import one_per_category, write_subset
from specparity.gate import exitcodes
from specparity.judge.calibration import Sample, check_scorer
from specparity.judge.compare import measure_drift
from specparity.engines.inprocess.hf import HFEngine
from specparity.gate.decision import decide
from specparity.judge.noise import CalibrationError, derive_threshold
from specparity.model.threshold import NoiseStats
from specparity.model.gate_run import GateConfig
from specparity.run.runner import run_gate
from specparity.model.types import TokenScores

PROMPTS = ("math-en-004", "logic-en-003", "code-en-003", "repeat-en-003")


@pytest.fixture(scope="module")
def prompts(default_prompts):
    return [p for p in default_prompts if p.id in PROMPTS]


def _gate(engine, prompts, **cfg):
    try:
        run = run_gate(engine, prompts, GateConfig(max_new_tokens=24, **cfg))
    finally:
        engine.close()
    return run, decide(run)


@pytest.mark.parametrize("bug", [None, "short_crop"])
def test_shifted_scorer_is_refused(hf_options, prompts, bug):
    """On a correct loop and on a broken one, a scorer one position late judges nothing."""
    run, decision = _gate(RescoredEngine(LoopEngine(hf_options, bug), shift=1), prompts)
    assert run.calibration_error and "teacher-forced scorer refused" in run.calibration_error
    assert "shifted by one position" in run.calibration_error, run.calibration_error
    assert run.threshold is None and all(r.spec is None for r in run.records)
    assert all(r.verdict.klass == "error" and "not judged" in r.verdict.reason for r in run.records)
    assert not decision.passed and decision.exit_code == exitcodes.ENGINE_ERROR
    assert any("could not be calibrated" in f for f in decision.failures)


def test_the_same_run_with_the_engines_scorer_passes(hf_options, prompts):
    run, decision = _gate(LoopEngine(hf_options, None), prompts)
    assert decision.passed, decision.failures
    assert run.scorer_check["passed"] and run.scorer_check["clear_positions"] > 50


def test_measured_threshold_above_the_ceiling_fails_loudly(hf_options, prompts):
    run, decision = _gate(RescoredEngine(HFEngine(hf_options), noise=0.05), prompts, near_tie_ceiling=0.05)
    assert run.calibration_error and "exceeds the ceiling 0.05 nats" in run.calibration_error
    assert "--near-tie-ceiling" in run.calibration_error
    assert decision.exit_code == exitcodes.ENGINE_ERROR
    # raised on purpose, the same noisy scorer is accepted and the run is judged with its threshold
    run, decision = _gate(RescoredEngine(HFEngine(hf_options), noise=0.05), prompts, near_tie_ceiling=5.0)
    assert run.calibration_error is None and run.threshold.nats > 0.05
    assert decision.passed, decision.failures


def _rows(tokens, margins, k=5, top_lp=-0.1):
    """Rows whose argmax is ``tokens[i]`` with the runner-up ``margins[i]`` nats below."""
    top_ids = np.array([[t] + [(t + j) % 50 for j in range(1, k)] for t in tokens])
    lp = np.array([[top_lp, top_lp - m] + [top_lp - m - j for j in range(1, k - 1)] for m in margins], np.float32)
    return TokenScores(np.array(tokens), lp[:, 0].copy(), top_ids, lp)


def test_check_scorer_names_the_evidence():
    tokens = [3, 7, 9, 11, 13, 17]
    decoded = _rows(tokens, [5.0] * 6)
    good = check_scorer([Sample("p", tokens, decoded, _rows(tokens, [4.9] * 6))], clear_nats=2.0)
    assert good.passed and good.clear_positions == 6
    shifted = _rows(tokens[1:] + [19], [5.0] * 6)  # row i is the distribution of position i + 1
    shifted.token_ids = np.array(tokens)
    bad = check_scorer([Sample("p", tokens, decoded, shifted)], clear_nats=2.0)
    assert not bad.passed and bad.disagreements == 6 and bad.shifted_later == 5
    assert "shifted by one position" in bad.evidence() and "p position 0" in bad.evidence()
    wrong = check_scorer([Sample("p", tokens, decoded, _rows([t + 1 for t in tokens], [5.0] * 6))], clear_nats=2.0)
    assert wrong.wrong_ids == 6 and "token other than the baseline's" in wrong.evidence()
    # positions whose decode margin is within the noise prove nothing either way
    ties = check_scorer([Sample("p", tokens, _rows(tokens, [0.1] * 6), shifted)], clear_nats=2.0)
    assert ties.passed and ties.clear_positions == 0


def test_ceiling_and_drift_bound():
    noise = NoiseStats(max_abs_delta=2.0, p99_abs_delta=1.0, positions=10, pairs=40)
    with pytest.raises(CalibrationError, match="exceeds the ceiling 2 nats"):
        derive_threshold(noise)
    assert derive_threshold(noise, ceiling=4.0).nats == pytest.approx(3.0)
    # an explicit threshold is on purpose; the drift bound still comes from the noise, and never above
    # the ceiling: 4 × 2.0 would be 8 nats, a move that large is not numeric noise
    t = derive_threshold(noise, override=0.5)
    assert t.nats == 0.5 and t.drift_nats == pytest.approx(2.0) and t.drift_held
    raised = derive_threshold(noise, override=0.5, ceiling=10.0)
    assert raised.drift_nats == pytest.approx(4 * noise.max_abs_delta) and not raised.drift_held
    # ... but never above the ceiling unless the ceiling is raised too, which the summary logs
    with pytest.raises(CalibrationError, match=r"--near-tie-nats 5: above the near-tie ceiling 2 nats"):
        derive_threshold(noise, override=5.0)
    wide = derive_threshold(noise, override=5.0, ceiling=5.0)
    assert wide.nats == 5.0 and "--near-tie-ceiling raised to 5 nats on purpose (default 2)" in wide.describe()
    assert "raised" not in t.describe()


def test_measure_drift_finds_where_it_starts():
    tokens = [3, 7, 9, 11, 13, 17]
    base = _rows(tokens, [5.0] * 6)
    spec = _rows(tokens, [5.0, 5.0, 5.0 + 1e-6, 4.0, 3.0, 5.0])
    d = measure_drift(base, spec, upto=6, bound=0.01)
    assert (d.start, d.over, d.checked) == (3, 2, 6) and d.max_nats == pytest.approx(2.0)
    assert measure_drift(base, spec, upto=3, bound=0.01).start is None  # only before the split
    unreported = _rows(tokens, [5.0] * 6)
    unreported.logprobs[:] = np.nan
    d = measure_drift(base, unreported, upto=6, bound=0.01)
    assert d.checked == 0 and d.max_nats is None and d.start is None


def _threshold(report):
    lines = [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]
    return next(x for x in lines if x["kind"] == "threshold")


def _pytest(tmp_path, name, prompts, *args):
    """``pytest suites/lossless`` in this process (tests/inprocess.py: a second session through
    ``pytest.main``, as ``specparity lossless`` runs it), so the four runs share the imported engine
    stack."""
    report = tmp_path / name
    code, out = run_pytest("suites/lossless", "-q", "--engine", "hf", "--prompts", prompts, "--max-new-tokens", "6",
                           "--report", report, *args)
    assert code == 0, out[-3000:]
    return _threshold(report)


def test_selection_leaves_the_threshold_unchanged(tmp_path, default_prompts):
    """A selection (-k, --categories) is a strict subset of the prompt file; the threshold is measured
    on the whole file either way. The file: one prompt per category plus every ``code`` prompt and the
    two picked ones, so each selection leaves prompts out."""
    picked_ids = ("math-en-004", "repeat-en-003")
    wanted = {p.id for p in one_per_category(default_prompts)} | set(picked_ids)
    prompts = tmp_path / "prompts.jsonl"
    kept = write_subset(prompts, lambda row: row["id"] in wanted or row["category"] == "code")
    assert set(picked_ids) <= set(kept) and len(kept) > len(picked_ids) + 1
    full = _pytest(tmp_path, "full", prompts)
    picked = _pytest(tmp_path, "k", prompts, "-k", " or ".join(picked_ids))
    category = _pytest(tmp_path, "cat", prompts, "--categories", "code")
    assert picked["nats"] == full["nats"] == category["nats"]
    assert picked["noise"] == full["noise"] == category["noise"]
    assert "every prompt of the prompt files" in picked["description"]
    assert "run only for calibration" in picked["calibration"]
    selected = _pytest(tmp_path, "sel", prompts, "-k", " or ".join(picked_ids), "--calibration", "selected")
    assert "depends on which prompts were selected" in selected["calibration"]
    assert selected["noise"]["positions"] < full["noise"]["positions"]


def test_a_fixed_calibration_set_does_not_move_with_the_selection(hf_options, default_prompts):
    """--calibration FILE: the noise comes from the file's prompts only; a selected prompt that is in
    the set is reused, one that is not is left out of the measurement."""
    cal = default_prompts[:3]
    engine = HFEngine(hf_options)
    try:
        config = GateConfig(max_new_tokens=8, calibration="cal.jsonl")
        inside = run_gate(engine, [cal[0]], config, calibration=cal)
        outside = run_gate(engine, [default_prompts[20]], config, calibration=cal)
    finally:
        engine.close()
    assert inside.threshold.noise == outside.threshold.noise
    assert inside.threshold.calibration == outside.threshold.calibration == "the calibration set cal.jsonl (3 prompts measured)"
    assert [r.prompt.id for r in inside.calibration_records] == [p.id for p in cal[1:]]
    assert [r.prompt.id for r in outside.calibration_records] == [p.id for p in cal]


def test_threshold_and_drift_floor_cover_float32_resolution():
    """Noise measured as exactly 0 (bf16 decode and teacher-forced scoring bit-identical, seen on an
    H200) must not make a 1.9e-6-nat difference of float32 logprobs "drift" (docs/gpu-numerics.md)."""
    from specparity.judge.noise import derive_threshold
    from specparity.model.threshold import FLOOR_NATS, NoiseStats

    t = derive_threshold(NoiseStats(0.0, 0.0, 201, 1407))
    assert t.nats == FLOOR_NATS and t.drift_nats == FLOOR_NATS
    assert FLOOR_NATS > 2 * float(np.spacing(np.float32(40.0)))


def test_the_widest_difference_names_the_largest_margin_change_and_breaks_ties_by_prompt_id():
    """The spot a calibration reproducer sends again: the largest |Δmargin| of the comparisons asked for;
    of equal ones the first prompt by id whatever the order the samples came in, then the first position."""
    from specparity.judge.calibration import Sample, widest_difference
    from specparity.model.types import TokenScores

    def rows(shift: float, at: int) -> TokenScores:
        """Four positions, each choosing token i with logprob 0 against token 9 at -5 (``shift`` lower at ``at``)."""
        top_lp = np.array([[0.0, -5.0 - (shift if i == at else 0.0)] for i in range(4)], np.float32)
        top_ids = np.array([[i, 9] for i in range(4)])
        return TokenScores(np.arange(4), top_lp[:, 0].copy(), top_ids, top_lp)

    base = rows(0.0, 0)
    samples = [Sample("b", [0, 1, 2, 3], base, base, rows(3.0, 2)), Sample("a", [0, 1, 2, 3], base, rows(1.0, 1), rows(3.0, 3))]
    assert widest_difference(samples) == {"prompt_id": "a", "position": 3, "delta_nats": 3.0, "between": "cross"}
    assert widest_difference(samples, ("within",)) == {"prompt_id": "a", "position": 1, "delta_nats": 1.0,
                                                       "between": "within"}
    assert widest_difference([Sample("a", [0], base, base, None)], ("cross",)) is None


def test_the_widest_difference_looks_past_a_comparison_it_cannot_make():
    """A sample without the speculative side's rows, or whose two rows share no alternative, still has
    its other comparison looked at; a one-position stream is a spot; rows that share nothing are none."""
    from specparity.judge.calibration import Sample, widest_difference
    from specparity.model.types import TokenScores

    def rows(n: int, shift: float = 0.0, alt: int = 9) -> TokenScores:
        top_lp = np.array([[0.0, -5.0 - shift]] * n, np.float32)
        return TokenScores(np.arange(n), top_lp[:, 0].copy(), np.array([[i, alt] for i in range(n)]), top_lp)

    within_only = Sample("a", [0, 1], rows(2), rows(2, 1.5), None)
    assert widest_difference([within_only]) == {"prompt_id": "a", "position": 0, "delta_nats": 1.5, "between": "within"}
    unshared = Sample("a", [0, 1], rows(2), rows(2, 1.5), rows(2, alt=8))  # cross rows share no alternative
    assert widest_difference([unshared])["between"] == "within"
    assert widest_difference([unshared], ("cross",)) is None
    one = Sample("a", [0], rows(1), rows(1), rows(1, 2.0))
    assert widest_difference([one]) == {"prompt_id": "a", "position": 0, "delta_nats": 2.0, "between": "cross"}


def _varying(tokens):
    """Rows of ``tokens`` whose margins differ from row to row (a channel that varies like a model's)."""
    return _rows(tokens, [5.0 + 0.01 * i for i in range(len(tokens))])


def test_calibrate_names_its_scorer_and_the_prompt_in_each_refusal():
    """Which scorer and which side a refusal is about, and the prompt its evidence starts at; an
    identical-row channel is named with the scorer too; without a label or a note the threshold has none."""
    from specparity.judge.calibration import DegenerateLogprobs, ScorerRefused, calibrate

    tokens = list(range(3, 43))
    good, wrong = _varying(tokens), _varying([t + 1 for t in tokens])
    with pytest.raises(ScorerRefused, match=r"teacher-forced scorer refused \(the scorer\)"):
        calibrate([Sample("p", tokens, _varying(tokens), wrong)], scorer="the scorer")
    with pytest.raises(ScorerRefused, match=r"\(the scorer, on the speculative server\).*first: q position 0"):
        calibrate([Sample("q", tokens, _varying(tokens), good, wrong)], scorer="the scorer")
    with pytest.raises(DegenerateLogprobs, match=r"teacher-forced scores \(the scorer\) is the same"):
        calibrate([Sample("p", tokens, _varying(tokens), _rows(tokens, [5.0] * len(tokens)))], scorer="the scorer")
    _, threshold = calibrate([Sample("p", tokens, _varying(tokens), good, good)], scorer="the scorer")
    assert threshold.calibration == "" and threshold.cross_note == ""


def test_check_scorer_counts_shifts_over_every_sample():
    """A scorer whose row i is the distribution of position i - 1, on two baselines: each one's shifted
    positions are counted, not only the last one's."""
    tokens = [3, 7, 9, 11, 13, 17]
    shifted = _rows([19] + tokens[:-1], [5.0] * 6)
    shifted.token_ids = np.array(tokens)
    check = check_scorer([Sample(p, tokens, _rows(tokens, [5.0] * 6), shifted) for p in ("a", "b")], clear_nats=2.0)
    assert check.shifted_earlier == 2 * (len(tokens) - 1) and check.shifted_later == 0
