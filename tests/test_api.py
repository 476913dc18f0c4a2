"""``specparity.api.check_lossless``: the gate's comparison as a plain function for other suites.

Hand-built scores (no model) pin each class and the message; one test runs a real engine (the
fixture ``hf`` engine passes, the hand-written loop with ``drop_bonus`` fails).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specparity.api import LosslessError, check_lossless, measure_threshold
from specparity.model.types import GenerationResult, SpecStats, TokenScores

OTHER = 99  # a token no stream below emits: the runner-up everywhere the choice is clear


def scores(ids: list[int], rows: list[dict[int, float]]) -> TokenScores:
    """One row per position: ``{token: logprob}`` holding the chosen token, sorted into the top-k."""
    k = len(rows[0])
    top = [sorted(r.items(), key=lambda kv: -kv[1]) for r in rows]
    assert all(len(t) == k for t in top) and all(tok in r for tok, r in zip(ids, rows))
    return TokenScores(np.array(ids), np.array([r[t] for t, r in zip(ids, rows)]),
                       np.array([[t for t, _ in row] for row in top]), np.array([[lp for _, lp in row] for row in top]))


def sure(tok: int) -> dict[int, float]:
    return {tok: -0.01, OTHER: -5.0}


def result(ids: list[int], rows: list[dict[int, float]], rid: str = "p0", finish: str = "length") -> GenerationResult:
    return GenerationResult(rid, ids, "", finish, scores(ids, rows), SpecStats.unavailable("hand-built"))


# baseline [1, 2, 3, 4] vs speculative [1, 2, 5, 6]: at position 2 the baseline chose 3 over 5 by
# `gap` nats; the speculative run took 5, and under its own prefix 6 is the target's clear choice.
def flip(gap: float, later_ok: bool = True):
    base = result([1, 2, 3, 4], [sure(1), sure(2), {3: -0.69, 5: -0.69 - gap}, sure(4)])
    spec = result([1, 2, 5, 6], [sure(1), sure(2), {5: -0.69, 3: -0.69 - gap}, sure(6)])
    last = sure(6) if later_ok else {7: -0.2, 6: -1.5}
    tf = scores([1, 2, 5, 6], [sure(1), sure(2), {3: -0.69, 5: -0.69 - gap}, last])
    return base, spec, tf


def test_identical_token_lists_pass():
    verdicts = check_lossless([[5, 6, 7, 0], [8, 9, 10, 11]], [[5, 6, 7, 0], [8, 9, 10, 11]],
                              max_new_tokens=4, stop_token_ids=[0])
    assert [v.klass for v in verdicts] == ["exact", "exact"]
    assert check_lossless([[5, 0]], [[5, 0]], max_new_tokens=8, stop_token_ids=[0])[0].klass == "exact"


def test_one_token_difference_raises_naming_the_position():
    with pytest.raises(AssertionError) as info:
        check_lossless([[5, 6, 7, 8], [1, 2, 3, 4]], [[5, 6, 7, 8], [1, 2, 9, 4]], max_new_tokens=4)
    msg = str(info.value)
    assert "1 of 2 prompt(s) not lossless" in msg
    assert "prompt 1 (id '#1'): diverged at position 2: baseline token 3, speculative token 9" in msg
    assert "only 'exact' can pass" in msg and "margin not known" in msg
    assert isinstance(info.value, LosslessError) and [v.prompt_id for v in info.value.failed] == ["#1"]
    assert [v.klass for v in info.value.verdicts] == ["exact", "diverged"]


def test_near_tie_with_scores_passes_unless_near_ties_are_refused():
    base, spec, tf = flip(gap=0.01)
    (v,) = check_lossless([base], [spec], spec_scores=[tf], threshold=0.05, max_new_tokens=4)
    assert v.klass == "near_tie" and v.divergence.position == 2
    with pytest.raises(AssertionError, match=r"prompt 0 \(id 'p0'\): near_tie \(allow_near_tie=False\) at position 2"):
        check_lossless([base], [spec], spec_scores=[tf], threshold=0.05, max_new_tokens=4, allow_near_tie=False)
    # the same flip without teacher-forced scores cannot be shown to be a near tie
    with pytest.raises(AssertionError, match="only 'exact' can pass"):
        check_lossless([base], [spec], max_new_tokens=4)


def test_real_divergence_fails_with_margin_and_names():
    base, spec, tf = flip(gap=2.4)
    with pytest.raises(AssertionError) as info:
        check_lossless([base], [spec], spec_scores=[tf], threshold=0.05, max_new_tokens=4,
                       decode=lambda ids: "".join(f"<{t}>" for t in ids), names=("ref", "mine"))
    msg = str(info.value)
    assert "diverged at position 2: ref token 3 '<3>', mine token 5 '<5>', ref margin 2.4 nats" in msg
    assert "exceeds the near-tie threshold" in msg and "'<1><2>' + '<5><6>'" in msg
    # a near tie at the split, but a later token the target would not have chosen
    base, spec, tf = flip(gap=0.01, later_ok=False)
    with pytest.raises(AssertionError, match="at position 3 the spec token 6 is not the target's choice 7"):
        check_lossless([base], [spec], spec_scores=[tf], threshold=0.05, max_new_tokens=4)


def test_stream_contract_and_errors_fail():
    with pytest.raises(AssertionError, match="only 2 of max_new_tokens=4"):  # short without a stop token
        check_lossless([[1, 2]], [[1, 2]], max_new_tokens=4, stop_token_ids=[0])
    failed = r"prompt 0 \(id '#0'\): error\n    reason: speculative run failed: boom"
    with pytest.raises(AssertionError, match=failed):
        check_lossless([[1, 2]], [GenerationResult.failed("p", "boom")], max_new_tokens=2)


def test_threshold_is_never_guessed():
    base, spec, tf = flip(gap=0.01)
    with pytest.raises(ValueError, match="no threshold.*measure_threshold"):
        check_lossless([base], [spec], spec_scores=[tf], max_new_tokens=4)
    with pytest.raises(ValueError, match="2 baseline outputs but 1"):
        check_lossless([base, base], [spec], max_new_tokens=4)
    with pytest.raises(ValueError, match="no baseline position"):
        measure_threshold([])


def test_measured_threshold_from_decode_against_teacher_forcing():
    decoded = scores([3, 4], [{3: -0.5, 5: -1.0}, {4: -0.1, 5: -3.0}])
    teacher_forced = scores([3, 4], [{3: -0.5001, 5: -1.0}, {4: -0.1, 5: -3.0002}])
    t = measure_threshold([(decoded, teacher_forced)])
    assert t.source == "measured" and math.isclose(t.nats, 1.5 * 2e-4, rel_tol=1e-2)
    base, spec, tf = flip(gap=1e-4)
    assert check_lossless([base], [spec], spec_scores=[tf], threshold=t, max_new_tokens=4)[0].klass == "near_tie"
    base, spec, tf = flip(gap=1e-2)
    with pytest.raises(AssertionError, match="measured"):
        check_lossless([base], [spec], spec_scores=[tf], threshold=t, max_new_tokens=4)


# ---------------------------------------------------------------------------- a real engine
PROMPTS = ("one two three one two three one two three", "The cat sat on the mat. The cat sat on the")


def test_real_engine_passes_and_a_broken_loop_fails():
    from broken_loops import LoopEngine

    from specparity.engines import load_engine
    from specparity.engines.base import EngineOptions
    from specparity.model.types import GenerationRequest

    def run(engine, max_new=16):
        reqs = [GenerationRequest(f"p{i}", engine.encode_prompt(t, None), max_new, engine.stop_token_ids())
                for i, t in enumerate(PROMPTS)]
        base = engine.generate(reqs, speculative=False)
        spec = engine.generate(reqs, speculative=True)
        tf = [engine.score(r.prompt_ids, s.output_ids, r.top_k) for r, s in zip(reqs, spec)]
        noise = [(b, engine.score(r.prompt_ids, b.output_ids, r.top_k)) for r, b in zip(reqs, base)]
        kw = dict(spec_scores=tf, threshold=measure_threshold(noise), max_new_tokens=max_new,
                  stop_token_ids=engine.stop_token_ids(), decode=engine.decode)
        return base, spec, kw

    engine = load_engine("hf", EngineOptions())  # the fixture target and draft, by default
    try:
        base, spec, kw = run(engine)
        assert all(s.spec.accepted > 0 for s in spec), "speculation must be active for the pass to mean anything"
        assert {v.klass for v in check_lossless(base, spec, **kw)} <= {"exact", "near_tie"}
        check_lossless([b.output_ids for b in base], [s.output_ids for s in spec], max_new_tokens=16,
                       stop_token_ids=engine.stop_token_ids())
    finally:
        engine.close()

    broken = LoopEngine(EngineOptions(), "drop_bonus")
    try:
        base, spec, kw = run(broken)
        diverged = r"diverged at position \d+: baseline token \d+ '.*', speculative token"
        with pytest.raises(AssertionError, match=diverged):
            check_lossless(base, spec, **kw)
    finally:
        broken.close()


def test_nothing_to_judge_is_not_a_pass():
    """check_lossless([], []) judged nothing: it raises (the gate's FAIL), never returns an empty pass."""
    with pytest.raises(LosslessError, match="nothing judged") as exc:
        check_lossless([], [], max_new_tokens=4)
    assert exc.value.verdicts == [] and exc.value.failed == []
