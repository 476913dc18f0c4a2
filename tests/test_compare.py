"""Property tests of the comparison: the classifier's contract, independent of any engine."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specparity.compare import compare, find_remerge, first_mismatch, tf_violations
from specparity.types import GenerationResult, SpecStats, TokenScores

K = 6
VOCAB = 50
STOP = 0
THRESHOLD = 0.01


def scores_for(ids: list[int], runner_up: list[int] | None = None, margins: list[float] | None = None) -> TokenScores:
    """Scores in which ``ids[i]`` is the argmax and ``runner_up[i]`` sits ``margins[i]`` nats below."""
    n = len(ids)
    runner_up = runner_up or [(t + 1) % VOCAB or 1 for t in ids]
    margins = margins or [5.0] * n
    top_ids = np.zeros((n, K), np.int64)
    top_lp = np.zeros((n, K), np.float32)
    for i, (t, r, m) in enumerate(zip(ids, runner_up, margins)):
        others = [x for x in range(1, VOCAB) if x not in (t, r)][: K - 2]
        top_ids[i] = [t, r, *others]
        top_lp[i] = [-0.05, -0.05 - m, *[-10.0 - j for j in range(K - 2)]]
    return TokenScores(np.array(ids), top_lp[:, 0].copy(), top_ids, top_lp)


def result(ids: list[int], scores: TokenScores, max_new: int) -> GenerationResult:
    finish = "stop" if ids and ids[-1] == STOP else "length"
    return GenerationResult("p", ids, "", finish, scores, SpecStats.unavailable("test"))


def run_compare(base_ids, base_scores, spec_ids, spec_scores, spec_tf, max_new, decode=None):
    return compare(
        "p",
        "cat",
        result(base_ids, base_scores, max_new),
        result(spec_ids, spec_scores, max_new),
        spec_tf,
        threshold=THRESHOLD,
        max_new_tokens=max_new,
        stop_ids=[STOP],
        decode=decode or (lambda ids: " ".join(f"<{i}>" for i in ids)),
    )


streams = st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=60)


@given(streams)
def test_identical_streams_are_exact(ids):
    s = scores_for(ids)
    v = run_compare(ids, s, list(ids), s, s, len(ids))
    assert v.klass == "exact", v.reason
    assert v.divergence is None


@given(streams, st.data())
def test_swap_within_noise_is_near_tie(ids, data):
    i = data.draw(st.integers(0, len(ids) - 1))
    alt = data.draw(st.integers(1, VOCAB - 1).filter(lambda t: t != ids[i]))
    margin = data.draw(st.floats(0.0, THRESHOLD))
    runner = [(t + 1) % VOCAB or 1 for t in ids]
    margins = [5.0] * len(ids)
    runner[i], margins[i] = alt, margin
    base_scores = scores_for(ids, runner, margins)
    spec_ids = ids[:i] + [alt] + [(t * 7) % (VOCAB - 1) + 1 for t in ids[i + 1 :]]  # diverges after the flip
    # Teacher-forced, every spec token is the target's choice under its own prefix (the flip itself
    # being a tie); this is what a correct loop produces after a benign flip.
    tf_margins = [5.0] * len(spec_ids)
    tf_runner = [(t + 1) % VOCAB or 1 for t in spec_ids]
    tf = scores_for(spec_ids, tf_runner, tf_margins)
    v = run_compare(ids, base_scores, spec_ids, scores_for(spec_ids), tf, len(ids))
    assert v.klass == "near_tie", v.reason
    assert v.divergence.position == i
    assert abs(v.divergence.baseline_margin - margin) < 1e-5


@given(streams, st.data())
def test_swap_of_low_probability_token_is_diverged(ids, data):
    i = data.draw(st.integers(0, len(ids) - 1))
    alt = data.draw(st.integers(1, VOCAB - 1).filter(lambda t: t != ids[i]))
    margin = data.draw(st.floats(THRESHOLD * 1.01, 30.0))
    runner = [(t + 1) % VOCAB or 1 for t in ids]
    margins = [5.0] * len(ids)
    runner[i], margins[i] = alt, margin
    spec_ids = list(ids)
    spec_ids[i] = alt
    v = run_compare(ids, scores_for(ids, runner, margins), spec_ids, scores_for(spec_ids), scores_for(spec_ids), len(ids))
    assert v.klass == "diverged"
    assert v.divergence.position == i


@given(streams, st.data())
def test_token_outside_baseline_topk_is_diverged(ids, data):
    i = data.draw(st.integers(0, len(ids) - 1))
    base = scores_for(ids)
    outside = [t for t in range(1, VOCAB) if t not in base.top_ids[i]]
    spec_ids = list(ids)
    spec_ids[i] = data.draw(st.sampled_from(outside))
    v = run_compare(ids, base, spec_ids, scores_for(spec_ids), scores_for(spec_ids), len(ids))
    assert v.klass == "diverged"
    assert "outside the baseline's top" in v.reason


@given(streams, st.data())
def test_near_tie_then_bad_token_is_diverged(ids, data):
    """A benign flip does not excuse a later token the target would not have chosen."""
    assume(len(ids) >= 3)
    i = data.draw(st.integers(0, len(ids) - 2))
    j = data.draw(st.integers(i + 1, len(ids) - 1))
    alt = (ids[i] % (VOCAB - 1)) + 1
    runner = [(t + 1) % VOCAB or 1 for t in ids]
    margins = [5.0] * len(ids)
    runner[i], margins[i] = alt, 0.0
    spec_ids = ids[:i] + [alt] + ids[i + 1 :]
    tf_runner = [(t + 1) % VOCAB or 1 for t in spec_ids]
    tf = scores_for(spec_ids, tf_runner)
    # at j the target's argmax is something else, by a clear margin
    tf.top_ids[j, [0, 1]] = tf.top_ids[j, [1, 0]]
    tf.logprobs[j] = tf.top_logprobs[j, 1]
    v = run_compare(ids, scores_for(ids, runner, margins), spec_ids, scores_for(spec_ids), tf, len(ids))
    assert v.klass == "diverged"
    assert f"position {j}" in v.reason


@given(streams, st.integers(1, 5))
def test_prefix_or_overrun_is_diverged(ids, extra):
    s = scores_for(ids)
    shorter = ids[:-1]
    v = run_compare(ids, s, shorter, scores_for(shorter), scores_for(shorter), len(ids))
    assert v.klass == "diverged"
    longer = ids + [1] * extra
    v = run_compare(ids, s, longer, scores_for(longer), scores_for(longer), len(ids))
    assert v.klass == "diverged"
    assert "more than max_new_tokens" in v.reason


@given(streams, st.integers(1, 5))
def test_tokens_after_a_stop_are_diverged(ids, tail):
    base = ids + [STOP]
    spec = base + [1] * tail
    v = run_compare(base, scores_for(base), spec, scores_for(spec), scores_for(spec), len(spec) + 5)
    assert v.klass == "diverged"
    assert "past stop token" in v.reason


@given(streams, st.data())
@settings(max_examples=50)
def test_verdict_ignores_text_decoding(ids, data):
    """Ids decide; text is for display. Two ids that decode to the same text still diverge."""
    i = data.draw(st.integers(0, len(ids) - 1))
    spec_ids = list(ids)
    spec_ids[i] = (ids[i] % (VOCAB - 1)) + 1
    base = scores_for(ids)
    verdicts = {
        run_compare(ids, base, spec_ids, scores_for(spec_ids), scores_for(spec_ids), len(ids), decode=d).klass
        for d in (lambda x: "", lambda x: "same text", lambda x: "".join(chr(0x4E00 + t) for t in x))
    }
    assert verdicts == {"diverged"}


def test_first_mismatch_and_tf_violations():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2
    tf = scores_for([5, 6, 7])
    assert tf_violations([5, 6, 7], tf) == []
    bad = tf_violations([5, 8, 7], tf)
    assert [(b.position, b.spec_token, b.target_argmax) for b in bad] == [(1, 8, 6)]


def test_remerge_found_after_flip():
    # "output: 55" vs "output `55`." shape: differ for a token or two, then continue together
    base_rest = [10, 11, 12, 13, 14, 15]
    spec_rest = [20, 21, 11, 12, 13, 14, 15]
    assert find_remerge(base_rest, spec_rest) == (1, 2)
    assert find_remerge([1, 2, 3], [4, 5, 6]) is None


def test_near_tie_whose_spec_row_disagrees_beyond_the_drift_bound_is_drifted():
    """At a genuine tie the two runs' rows at the split agree up to noise; a speculative row that
    prefers its token by far more than the drift bound is a corrupted computation (found by the
    triage report on a bf16 broken loop: baseline margin 0.25, speculative row 1.56 the other way)."""
    ids = [5, 6, 7, 8]
    base = scores_for(ids, [5, 6, 9, 8 + 1], [5.0, 5.0, 0.005, 5.0])
    spec_ids = [5, 6, 9, 8]
    own = scores_for(spec_ids, [5 + 1, 6 + 1, 7, 8 + 1], [5.0, 5.0, 1.5, 5.0])
    tf = scores_for(spec_ids)
    common = dict(threshold=THRESHOLD, max_new_tokens=4, stop_ids=[STOP], decode=lambda x: str(x))
    v = compare("p", "c", result(ids, base, 4), result(spec_ids, own, 4), tf, drift_nats=0.04, **common)
    assert v.klass == "drifted" and "the two computations of the same position are 1.5 nats apart" in v.reason
    close = scores_for(spec_ids, [5 + 1, 6 + 1, 7, 8 + 1], [5.0, 5.0, 0.004, 5.0])
    v = compare("p", "c", result(ids, base, 4), result(spec_ids, close, 4), tf, drift_nats=0.04, **common)
    assert v.klass == "near_tie", v.reason
