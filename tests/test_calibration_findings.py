"""A measurement that checked less than it seems is said, never passed in silence.

Two ways the calibration can prove less than a passing run suggests, each a warning line in the
summary and a failure under a bit-exact policy or ``calibration_findings = "fail"``:

* no noise measured: ``--near-tie-nats`` set the threshold while no baseline position was scored
  both ways, which turns the latent-drift check off (the refusal that suggests the option says so);
* the scorer check had nothing to check: no baseline position's margin cleared the ceiling, so a
  scorer off by one position would have passed it.

The engines are the real ``hf`` engine and ``tests/unscored_pairs_engine.py`` (its scorer reports only
the token it scored, so its rows share no alternative with the decode rows).
"""

from __future__ import annotations

import pytest

from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.gate.decision import decide
from specparity.gate.exitcodes import ENGINE_ERROR, GATE_FAILED, PASS
from specparity.model.gate_run import GateConfig, GatePolicy
from specparity.model.locations import REPO_ROOT
from specparity.report.lines import drift_line, scorer_check_line
from specparity.run.runner import run_gate

UNSCORED = f"{REPO_ROOT / 'tests' / 'unscored_pairs_engine.py'}:create"
#: The policies under which a finding fails the gate: a bit-exact run, and the policy key.
STRICT = (GatePolicy(bit_exact=True), GatePolicy(calibration_findings="fail"))


@pytest.fixture(scope="module")
def math_prompts(default_prompts):
    return [p for p in default_prompts if p.category == "math"][:3]


def _gate(spec: str, options: EngineOptions, prompts, tmp_path, **config):
    engine = load_engine(spec, options)
    try:
        return run_gate(engine, prompts, GateConfig(max_new_tokens=12, report_dir=str(tmp_path),
                                                    calibration="selected", **config))
    finally:
        engine.close()


def test_no_noise_measured_names_what_a_hand_set_threshold_loses(hf_options, math_prompts, tmp_path):
    refused = _gate(UNSCORED, hf_options, math_prompts, tmp_path / "refused")
    assert decide(refused).exit_code == ENGINE_ERROR
    error = refused.calibration_error
    assert error.startswith("cannot measure the near-tie threshold: no baseline position was scored both ways")
    assert ("--near-tie-nats would set the threshold without a measurement, but the latent-drift check is then off"
            in error) and "\n" not in error

    run = _gate(UNSCORED, hf_options, math_prompts, tmp_path / "set", near_tie_nats=0.5)
    assert run.threshold.source == "override" and run.threshold.noise.pairs == 0
    assert run.threshold.drift_nats is None and drift_line(run) == "not checked (no noise was measured)"
    assert run.scorer_check["clear_positions"] > 0  # the scorer itself was checked: only the noise is missing
    judged = [r.verdict for r in run.records if r.verdict is not None]
    assert len(judged) == len(math_prompts) and all(v.drift is None for v in judged)
    expected = ("no noise measured: the near-tie threshold 0.5 nats was set by --near-tie-nats and no baseline "
                "position was scored both ways, so the latent-drift check is off (identical tokens whose speculative "
                "rows moved are not judged)")
    decision = decide(run)
    assert decision.exit_code == PASS
    assert [w for w in decision.warnings if w.startswith(expected)] and not decision.failures
    for policy in STRICT:
        strict = decide(run, policy)
        assert strict.exit_code == GATE_FAILED
        assert len(strict.failures) == 1 and strict.failures[0].startswith(expected)
        assert "— a failure under" in strict.failures[0]
        assert not [w for w in strict.warnings if w.startswith("no noise measured")]


def test_a_scorer_check_with_nothing_to_check_is_said(hf_options, math_prompts, tmp_path):
    """A ceiling above every margin of the fixture target (5–18 nats) leaves the scorer check no
    position to check; with the default ceiling the same prompts have clear positions and no finding."""
    run = _gate("hf", hf_options, math_prompts, tmp_path / "wide", near_tie_ceiling=50.0)
    check = run.scorer_check
    assert check["clear_positions"] == 0 and check["passed"]
    assert scorer_check_line(run) == "nothing to check: no baseline position had a clear margin"
    expected = ("scorer check with nothing to check: no baseline position had a decode margin above 50 nats (the "
                "near-tie ceiling), so a teacher-forced scorer off by one position or scoring another model would "
                "not have been caught")
    decision = decide(run)
    assert decision.passed and [w for w in decision.warnings if w.startswith(expected)]
    for policy in STRICT:
        strict = decide(run, policy)
        assert not strict.passed and [f for f in strict.failures if f.startswith(expected)]

    usual = _gate("hf", hf_options, math_prompts, tmp_path / "usual")
    assert usual.scorer_check["clear_positions"] > 0
    assert not [w for w in decide(usual).warnings if "nothing to check" in w]
    assert decide(usual, STRICT[1]).passed  # no finding: the strict policy has nothing to fail
