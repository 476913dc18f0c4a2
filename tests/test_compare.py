"""Property tests of the comparison: the classifier's contract, independent of any engine."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specparity.judge.compare import OWN_ROW_REJECTED, compare, find_remerge, first_mismatch, own_row_rejections, tf_violations
from specparity.model.types import GenerationResult, SpecStats, TokenScores

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
    assert v.divergence is None and v.rule == "identical" and v.later_scored


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
    assert v.divergence.position == i and v.rule == "near_tie"
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
    assert v.klass == "diverged" and v.rule == "margin_over_threshold"
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
    assert "outside the baseline's top" in v.reason and v.rule == "margin_outside_top_k" and v.margin_unknown_explained


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
    assert f"position {j}" in v.reason and v.rule == "later_not_argmax"


@given(streams, st.integers(1, 5))
def test_prefix_or_overrun_is_diverged(ids, extra):
    s = scores_for(ids)
    shorter = ids[:-1]
    v = run_compare(ids, s, shorter, scores_for(shorter), scores_for(shorter), len(ids))
    assert v.klass == "diverged"
    longer = ids + [1] * extra
    v = run_compare(ids, s, longer, scores_for(longer), scores_for(longer), len(ids))
    assert v.klass == "diverged"
    assert "more than max_new_tokens" in v.reason and v.stream_problem


@given(streams, st.integers(1, 5))
def test_tokens_after_a_stop_are_diverged(ids, tail):
    base = ids + [STOP]
    spec = base + [1] * tail
    v = run_compare(base, scores_for(base), spec, scores_for(spec), scores_for(spec), len(spec) + 5)
    assert v.klass == "diverged"
    assert "past stop token" in v.reason and v.stream_problem and not v.own_row_rejected


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


COMMON = dict(threshold=THRESHOLD, max_new_tokens=4, stop_ids=[STOP], decode=lambda x: str(x))


def _rejecting(ids: list[int], at: int, prefers: int, by: float) -> TokenScores:
    """Rows in which ``ids`` is the argmax except at ``at``, where ``prefers`` beats it by ``by`` nats."""
    rows = scores_for(ids)
    rows.top_ids[at, :2] = [prefers, ids[at]]
    rows.top_logprobs[at, :2] = [-0.05, -0.05 - by]
    rows.logprobs[at] = -0.05 - by
    return rows


def test_flip_that_its_own_verify_row_rejected_is_diverged_not_near_tie():
    """A loop that accepts one draft past the first mismatch: at the split the baseline's margin is
    a near tie, the two rows agree (so no drift), but the speculative run's own row preferred the
    baseline's token — the loop emitted a token its verifier rejected."""
    ids, spec_ids = [5, 6, 7, 8], [5, 6, 9, 8]
    base = scores_for(ids, [6, 7, 9, 9], [5.0, 5.0, 0.005, 5.0])
    own = _rejecting(spec_ids, 2, 7, 0.005)  # prefers the baseline's 7 by the same 0.005 nats
    v = compare("p", "c", result(ids, base, 4), result(spec_ids, own, 4), scores_for(spec_ids), drift_nats=0.04,
                **COMMON)
    assert v.klass == "diverged", v.reason
    assert v.reason.startswith("position 2 (at the first difference)") and OWN_ROW_REJECTED in v.reason
    assert v.own_row_rejected and v.own_row_rejected_at_split and v.rejected_at == 2
    assert "emitted 9 " in v.reason and "prefers 7 " in v.reason and "by 0.005 nats" in v.reason
    # the same flip from a loop whose row chose its token (an exact tie breaks its way) stays a near tie
    tie = _rejecting(spec_ids, 2, 7, 0.0)
    v = compare("p", "c", result(ids, base, 4), result(spec_ids, tie, 4), scores_for(spec_ids), drift_nats=0.04,
                **COMMON)
    assert v.klass == "near_tie", v.reason


def test_own_row_rejection_anywhere_is_diverged_and_unreported_rows_are_skipped():
    ids = [5, 6, 7, 8]
    base = scores_for(ids)
    v = compare("p", "c", result(ids, base, 4), result(ids, _rejecting(ids, 3, 2, 1.0), 4), base, **COMMON)
    assert v.klass == "diverged" and v.reason.startswith("position 3:") and OWN_ROW_REJECTED in v.reason
    assert v.own_row_rejected and not v.own_row_rejected_at_split and v.rejected_at == 3
    unreported = scores_for(ids)
    unreported.top_ids[1] = -1
    unreported.top_logprobs[1] = np.nan
    unreported.logprobs[1] = np.nan
    assert own_row_rejections(ids, unreported) == []
    v = compare("p", "c", result(ids, base, 4), result(ids, unreported, 4), base, **COMMON)
    assert v.klass == "exact", v.reason


def test_finish_reason_outside_the_protocol_is_an_error_on_either_side():
    empty = GenerationResult("p", [], "", "abort", TokenScores.empty(K), SpecStats.unavailable("test"))
    v = compare("p", "c", empty, empty, None, **COMMON)
    assert v.klass == "error" and "finish_reason 'abort'" in v.reason and v.reason.startswith("baseline:")
    ids = [5, 6, 7, 8]
    good = result(ids, scores_for(ids), 4)
    v = compare("p", "c", good, GenerationResult("p", ids, "", "cancelled", scores_for(ids), SpecStats.unavailable("t")),
                scores_for(ids), **COMMON)
    assert v.klass == "error" and v.reason.startswith("speculative run:") and "'cancelled'" in v.reason
    for finish in ("stop", "length"):  # an empty finished stream: no stop token to end on, no token to count
        nothing = GenerationResult("p", [], "", finish, TokenScores.empty(K), SpecStats.unavailable("test"))
        v = compare("p", "c", nothing, nothing, None, **COMMON)
        assert v.klass == "error" and "with no token" in v.reason, v.reason


def test_baseline_that_breaks_the_stop_rule_is_a_configuration_error_not_a_divergence():
    """A stop set that is not the model's: both streams end on the model's own end token (3), which
    the run does not count as a stop; never blamed on speculation."""
    ids = [5, 6, 3]
    ended = GenerationResult("p", ids, "", "stop", scores_for(ids), SpecStats.unavailable("test"))
    v = compare("p", "c", ended, ended, scores_for(ids), **{**COMMON, "max_new_tokens": 8})
    assert v.klass == "error", v.reason
    assert "stop set [0]" in v.reason and "ends with token 3" in v.reason and "configuration error" in v.reason
    short = GenerationResult("p", ids[:2], "", "length", scores_for(ids[:2]), SpecStats.unavailable("test"))
    v = compare("p", "c", short, short, scores_for(ids[:2]), **{**COMMON, "max_new_tokens": 8})
    assert v.klass == "error" and "only 2 of max_new_tokens=8" in v.reason


def test_a_near_tie_flip_without_teacher_forced_scores_is_diverged_unscored():
    """The flip is a tie, but nothing checked the tokens after it: never a near tie."""
    ids, spec_ids = [5, 6, 7, 8], [5, 6, 9, 8]
    base = scores_for(ids, [6, 7, 9, 9], [5.0, 5.0, 0.005, 5.0])
    v = compare("p", "c", result(ids, base, 4), result(spec_ids, scores_for(spec_ids), 4), None, **COMMON)
    assert (v.klass, v.rule) == ("diverged", "later_unscored") and v.later_unscored and not v.later_scored
    assert "could not be scored teacher-forced" in v.reason
