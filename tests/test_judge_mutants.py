"""Focused unit tests of the verdict code's small functions: the ones only an end-to-end run reached,
or reached without checking the exact figure or wording.

Each test pins one behaviour a reader of a verdict relies on (which category a total comes from,
which side of a tie a token is called, what a message says), so a change to the arithmetic or the
wording fails here in milliseconds instead of passing silently through a whole gate run.
"""

from __future__ import annotations

import numpy as np
import pytest

from specparity.gate.decision import unrecorded_steps
from specparity.gate.parity import ParityResult, ParityRow, compare_acceptance
from specparity.gate.policy_file import allowed_unknown, judge_unknown
from specparity.judge.acceptance import _rate, wilson
from specparity.judge.bias import _margins, decode_prefill_bias
from specparity.judge.compare import _describe_divergence
from specparity.judge.flip_budget import tie_positions
from specparity.judge.invariance import Rejection, SelfDraftReport
from specparity.judge.noise import abs_deltas, abs_deltas_with_margins
from specparity.judge.resolution import (accepted_draft_positions, baseline_tie_break, describe_ulps, spec_tie_break,
                                         ulps)
from specparity.judge.structured import OutputCheck
from specparity.model.gate_run import Activity
from specparity.model.types import GenerationResult, SpecStats, StepRecord, TokenScores
from specparity.model.verdicts import TokenView
from specparity.probes.finding import Finding, Status


def scores(token_ids, top_ids, top_logprobs, logprobs=None) -> TokenScores:
    top_logprobs = np.asarray(top_logprobs, np.float32)
    if logprobs is None:
        logprobs = top_logprobs[:, 0]
    return TokenScores(np.asarray(token_ids), np.asarray(logprobs), np.asarray(top_ids), top_logprobs)


# --- acceptance parity (gate/parity.py) -------------------------------------------------------------

def test_compare_acceptance_keeps_shared_categories_and_sums_their_totals():
    """Only categories both runs have are compared, sorted; the overall row is the ratio of summed
    counters (a mean of per-category rates would weigh a category of 2 drafts like one of 200)."""
    a = {"code": Activity(proposed=10, accepted=5, verify_steps=4, emitted=8, reported_requests=1),
         "chat": Activity(proposed=30, accepted=27, verify_steps=10, emitted=40, reported_requests=3),
         "only_a": Activity(proposed=100, accepted=0, verify_steps=50, emitted=50, reported_requests=9)}
    b = {"code": Activity(proposed=20, accepted=4, verify_steps=8, emitted=12, reported_requests=2),
         "chat": Activity(proposed=10, accepted=10, verify_steps=5, emitted=20, reported_requests=1)}
    res = compare_acceptance(a, b, tolerance=0.25)
    assert [r.category for r in res.rows] == ["chat", "code"]
    chat, code = res.rows
    assert (chat.rate_a, chat.rate_b, chat.accept_length_a, chat.accept_length_b) == (0.9, 1.0, 4.0, 4.0)
    assert (code.rate_a, code.rate_b, code.accept_length_a, code.accept_length_b) == (0.5, 0.2, 2.0, 1.5)
    assert res.overall.category == "all"
    assert res.overall.rate_a == pytest.approx(32 / 40) and res.overall.rate_b == pytest.approx(14 / 30)
    assert res.overall.accept_length_a == pytest.approx(48 / 14)
    assert res.overall.accept_length_b == pytest.approx(32 / 13)
    assert res.tolerance == 0.25
    assert code.gap == pytest.approx(0.3) and chat.gap == pytest.approx(0.1)
    assert res.failures == ["code: acceptance 0.500 vs 0.200 differs by 0.300 > 0.25",
                            "all: acceptance 0.800 vs 0.467 differs by 0.333 > 0.25"]


def test_compare_acceptance_default_tolerance_and_a_side_without_counters():
    res = compare_acceptance({"x": Activity(proposed=10, accepted=9)}, {"x": Activity()})
    assert res.tolerance == 0.10
    assert res.rows[0].rate_b is None and res.rows[0].gap is None
    assert res.failures == ["x: no acceptance reported by one side", "all: no acceptance reported by one side"]
    # a gap exactly at the tolerance passes: only a larger one fails
    edge = compare_acceptance({"x": Activity(proposed=4, accepted=2)}, {"x": Activity(proposed=4, accepted=3)},
                              tolerance=0.25)
    assert edge.rows[0].gap == 0.25 and edge.failures == []


def test_parity_table_names_both_runs_and_prints_missing_figures_as_na():
    res = ParityResult([ParityRow("code", 0.5, 0.25, 2.0, None)], ParityRow("all", 0.5, None, 2.125, 1.0), 0.1)
    assert res.table("ref", "llama") == [
        "| category | acceptance ref | acceptance llama | gap | accept length ref | accept length llama |",
        "|---|---:|---:|---:|---:|---:|",
        "| code | 0.500 | 0.250 | 0.250 | 2.00 | n/a |",
        "| all | 0.500 | n/a | n/a | 2.12 | 1.00 |",
    ]


# --- decode/prefill bias (judge/bias.py) --------------------------------------------------------------

def test_decode_prefill_bias_is_the_signed_mean_over_rows_both_sides_report():
    decode = scores([1, 2, 3], [[1, 9], [2, 9], [3, 9]], [[-0.1, -1.1], [-0.2, -0.7], [-0.1, -3.1]])
    forced = scores([1, 2], [[1, 9], [2, 9]], [[-0.1, -1.4], [-0.2, -0.5]])  # one row shorter: 2 pairs
    bias = decode_prefill_bias([(decode, forced)])
    # margins: decode 1.0, 0.5 ; forced 1.3, 0.3 -> deltas -0.3, +0.2
    assert bias.rows == 2
    assert bias.mean == pytest.approx(-0.05, abs=1e-6)
    assert bias.mean_abs == pytest.approx(0.25, abs=1e-6)
    assert "mean signed Δmargin (decode − teacher-forced) -0.05 nats over 2 rows (mean |Δ| 0.25)" in bias.describe()


def test_decode_prefill_bias_skips_unreported_rows_and_is_none_without_pairs():
    nan = float("nan")
    decode = scores([1, 2], [[1, 9], [2, 9]], [[-0.1, -1.1], [nan, nan]])
    forced = scores([1, 2], [[1, 9], [2, 9]], [[-0.1, -2.1], [-0.2, -0.5]])
    bias = decode_prefill_bias([(decode, forced), (decode, forced)])
    assert (bias.rows, bias.mean, bias.mean_abs) == (2, pytest.approx(-1.0), pytest.approx(1.0))
    assert decode_prefill_bias([]) is None
    one_alt = scores([1], [[1]], [[-0.1]])
    assert np.isnan(_margins(one_alt)).all() and len(_margins(one_alt)) == 1
    assert decode_prefill_bias([(one_alt, one_alt)]) is None
    assert _margins(forced).tolist() == pytest.approx([2.0, 0.3])


# --- resolution (judge/resolution.py) -------------------------------------------------------------------

def test_describe_ulps_wording():
    assert describe_ulps(None, 0.125) == "unknown"
    assert describe_ulps(0.0, 0.125) == "0 nats (an exact tie: both tokens are the row's argmax)"
    assert describe_ulps(-5e-7, None) == "0 nats (an exact tie: both tokens are the row's argmax)"
    assert describe_ulps(0.3, None) == "0.3 nats"
    assert describe_ulps(0.125, 0.125) == "0.125 nats (1 ulp of 0.125 at this row's resolution)"
    assert describe_ulps(0.25, 0.125) == "0.25 nats (2 ulps of 0.125 at this row's resolution)"
    assert describe_ulps(-0.0625, 0.03125) == "-0.0625 nats (2 ulps of 0.03125 at this row's resolution)"


def test_ulps_needs_both_a_margin_and_a_quantum():
    assert ulps(None, 0.125) is None and ulps(0.25, None) is None and ulps(None, None) is None
    assert ulps(-0.25, 0.125) == 2.0


def test_accepted_draft_positions_with_and_without_the_prefill_token():
    steps = [StepRecord(proposed=3, accepted=2, emitted=3), StepRecord(proposed=3, accepted=0, emitted=1),
             StepRecord(proposed=3, accepted=3, emitted=2, cut="limit")]
    spec = SpecStats.from_steps(steps, "test")
    # 6 emitted by steps + 1 from the prefill: positions start at 1
    got = accepted_draft_positions(spec, 7)
    assert got.dtype == bool
    assert got.tolist() == [False, True, True, False, False, True, True]
    # the steps account for every token: positions start at 0
    assert accepted_draft_positions(spec, 6).tolist() == [True, True, False, False, True, True]
    assert accepted_draft_positions(spec, 5) is None and accepted_draft_positions(spec, 8) is None
    assert accepted_draft_positions(SpecStats(available=True, proposed=3, accepted=1), 4) is None
    assert accepted_draft_positions(None, 4) is None


def test_tie_breaks_name_the_lower_or_higher_id():
    assert baseline_tie_break(3, 7) == "lower_id" and baseline_tie_break(7, 3) == "higher_id"
    assert spec_tie_break(7, 3, 0.0, False) == "lower_id" and spec_tie_break(3, 7, 0.0, False) == "higher_id"
    assert spec_tie_break(3, 7, 0.0, None) == "higher_id"
    assert spec_tie_break(3, 7, 0.0, True) == "draft"
    assert spec_tie_break(3, 7, 0.5, True) == "own_argmax"
    assert spec_tie_break(3, 7, None, False) == "unknown"
    assert spec_tie_break(3, 7, None, True) == "draft"


# --- noise and flips (judge/noise.py, judge/flip_budget.py) ---------------------------------------------

def test_abs_deltas_is_the_first_part_of_abs_deltas_with_margins():
    a = scores([1, 2], [[1, 9], [2, 8]], [[-0.1, -1.1], [-0.2, -0.7]])
    b = scores([1, 2], [[1, 9], [2, 8]], [[-0.1, -1.3], [-0.2, -0.6]])
    d = abs_deltas(a, b)
    assert d.tolist() == pytest.approx([0.2, 0.1], abs=1e-6)
    assert np.array_equal(d, abs_deltas_with_margins(a, b)[0])
    assert len(abs_deltas(a, TokenScores.empty(2))) == 0


def test_tie_positions_counts_rows_whose_token_ties_its_best_alternative():
    rows = scores([1, 2, 3, 4], [[1, 9], [9, 2], [3, 9], [4, 9]],
                  [[-0.5, -0.5], [-0.5, -0.5], [-0.1, -0.9], [-0.5, -0.5000005]])
    assert tie_positions(rows) == 3
    assert tie_positions(TokenScores.empty(2)) == 0


# --- small records ----------------------------------------------------------------------------------------

def test_rejection_and_self_draft_report_to_json():
    rej = Rejection("p1", 4, 0.125, "within", False)
    out = rej.to_json()
    assert out == {"prompt_id": "p1", "position": 4, "baseline_margin": 0.125, "against_noise": "within",
                   "output_differs": False}
    out["position"] = 99
    assert rej.position == 4  # a copy: editing the JSON leaves the record alone
    rep = SelfDraftReport("hf", "float32", "as the model", 4, prompts=2, tokens=500, proposed=40, accepted=30,
                          verify_steps=12, threshold=0.01, drift_bound=0.1, rejections=[rej],
                          classes={"exact": 1, "near_tie": 1})
    j = rep.to_json()
    assert j["rejections"] == [rej.to_json()]
    assert j["acceptance"] == 0.75 and j["rejections_per_1k"] == 2.0 and j["outputs_differ"] == 1
    assert (j["status"], j["why"]) == rep.status()
    assert j["status"] == "warn"
    assert {k: j[k] for k in ("engine", "dtype", "kv_cache_dtype", "width", "prompts", "tokens", "proposed",
                              "accepted", "verify_steps", "threshold", "drift_bound", "classes", "reported",
                              "located")} == {
        "engine": "hf", "dtype": "float32", "kv_cache_dtype": "as the model", "width": 4, "prompts": 2,
        "tokens": 500, "proposed": 40, "accepted": 30, "verify_steps": 12, "threshold": 0.01, "drift_bound": 0.1,
        "classes": {"exact": 1, "near_tie": 1}, "reported": True, "located": True}


def test_output_check_round_trips_through_json():
    check = OutputCheck("invalid", "not JSON at 3")
    assert OutputCheck.from_json(check.to_json()) == check
    assert OutputCheck.from_json({"status": "valid"}) == OutputCheck("valid", "")
    assert OutputCheck.from_json(None) is None and OutputCheck.from_json({}) is None


def test_rate_prints_the_share_its_interval_and_the_counts():
    lo, hi = wilson(3, 4)
    assert _rate((4, 3)) == f"0.750 [{lo:.3f}, {hi:.3f}] (3/4)"
    assert _rate(None) == "n/a" and _rate((0, 0)) == "n/a"


# --- probes under a policy (gate/policy_file.py) ------------------------------------------------------------

def test_an_unknown_probe_fails_unless_the_policy_allows_it(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('[gate]\nallow_unknown = ["mamba-slots"]\n')
    assert allowed_unknown(path) == ("mamba-slots",)
    empty = tmp_path / "empty.toml"
    empty.write_text("[gate]\n")
    assert allowed_unknown(empty) == ()

    unknown = Finding("draft-format", Status.UNKNOWN, "header not read", action="read the header")
    failed = judge_unknown(unknown, ("mamba-slots",), "ci/policy.toml")
    assert failed.status is Status.FAIL and failed.probe == "draft-format"
    assert failed.summary == "unknown, and the policy ci/policy.toml does not allow it: header not read"
    assert failed.action == ('read the header; make the probe answer (see its evidence), or add "draft-format" '
                             "to allow_unknown in ci/policy.toml")
    bare = judge_unknown(Finding("x", Status.UNKNOWN, "s"), (), "p.toml")
    assert bare.action == 'make the probe answer (see its evidence), or add "x" to allow_unknown in p.toml'
    assert judge_unknown(unknown, ("draft-format",), "p.toml") is unknown
    ok = Finding("draft-format", Status.OK, "fine")
    assert judge_unknown(ok, (), "p.toml") is ok


# --- --require-all-paths without step records (gate/decision.py) -------------------------------------------

def _answer(pid: str, spec: SpecStats, error: str | None = None):
    from specparity.model.gate_run import PromptRecord
    from specparity.model.prompts import Prompt
    from specparity.model.types import GenerationResult

    result = GenerationResult(pid, [1, 2], "", "length", TokenScores.empty(), spec, error=error)
    return PromptRecord(Prompt(id=pid, category="c", lang="en", prompt="p"), spec=result)


def test_unrecorded_steps_names_the_engine_the_first_prompt_and_both_kinds_of_answer():
    from types import SimpleNamespace

    steps = SpecStats.from_steps([StepRecord(proposed=2, accepted=1, emitted=2)], "steps")
    totals = SpecStats(available=True, proposed=6, accepted=4, verify_steps=3, source="/metrics")
    records = [_answer("a", steps), _answer("b", totals), _answer("c", SpecStats(available=True, proposed=1)),
               _answer("d", SpecStats.unavailable("no counters here")), _answer("e", SpecStats.unavailable("")),
               _answer("f", totals, error="boom")]
    run = SimpleNamespace(records=records, fingerprint=SimpleNamespace(engine="vllm"))
    assert unrecorded_steps(run, 2) == (
        "--require-all-paths 2: engine 'vllm' declares per-verify-step counters but returned per-request totals "
        "without step records for 2 (first b: 6 proposed, 4 accepted over 3 verify steps; source: /metrics) and "
        "no speculation counters for 2 (first d: no counters here) of 5 speculative answer(s); the rule needs a "
        "record of each verify step, so the paths those prompts took are unknown")
    only_c = SimpleNamespace(records=[records[2], records[4]], fingerprint=None)
    assert unrecorded_steps(only_c, 1) == (
        "--require-all-paths 1: engine 'the engine' declares per-verify-step counters but returned per-request "
        "totals without step records for 1 (first c: 1 proposed, 0 accepted over 0 verify steps; source: not given) "
        "and no speculation counters for 1 (first e: no reason given) of 2 speculative answer(s); the rule needs a "
        "record of each verify step, so the paths those prompts took are unknown")
    assert unrecorded_steps(SimpleNamespace(records=[records[0], records[5]], fingerprint=None), 1) is None


# --- margins and their deltas: the rows the noise figure is built from -------------------------------------

def test_decode_margins_reads_each_row_on_its_own_and_skips_missing_alternatives():
    """An alternative with id -1 (a slot the engine did not fill) is no rival; id 0 is a real token;
    every row is measured against its own best rival; a row without any rival is NaN."""
    from specparity.judge.flip_budget import decode_margins

    rows = scores([5, 0, 7, 3], [[5, 0, -1], [0, 5, 9], [-1, 7, 2], [3, -1, -1]],
                  [[-0.25, -1.0, -0.5], [-0.5, -0.75, -2.0], [-0.125, -0.5, -4.0], [-0.5, -0.25, -0.25]],
                  logprobs=[-0.25, -0.5, -0.5, -0.5])
    m = decode_margins(rows)
    assert m.dtype == np.float64 and len(m) == 4
    assert m[:3].tolist() == [0.75, 0.25, 3.5]
    assert np.isnan(m[3])
    one = scores([1], [[1, 2]], [[-0.5, -0.5]])
    assert decode_margins(one).tolist() == [0.0] and tie_positions(one) == 1


def test_margin_deltas_use_the_shorter_stream_and_only_pairs_both_sides_recorded():
    """Two scorings of streams of different lengths are compared over the common prefix; an id of -1
    or a row the engine did not report (NaN) never becomes a |Δmargin| (it would enter the noise)."""
    nan = float("nan")
    a = scores([1, 2, 3], [[1, 0, -1], [2, 8, -1], [3, 9, 4]],
               [[-0.1, -1.1, -3.0], [-0.2, -0.7, -3.0], [-0.1, -0.6, -2.0]])
    b = scores([1, 2], [[1, 0, -1], [2, 8, -1]], [[-0.1, -1.4, -3.0], [nan, nan, nan]], logprobs=[-0.1, nan])
    d, margins = abs_deltas_with_margins(a, b)
    assert d.tolist() == pytest.approx([0.3], abs=1e-6)  # id 0 at position 0; position 1 unreported on b
    assert margins.tolist() == pytest.approx([1.0], abs=1e-6)  # the smaller |margin| of the pair: 1.0 vs 1.3
    d2, m2 = abs_deltas_with_margins(b, a)
    assert d2.tolist() == pytest.approx([0.3], abs=1e-6) and m2.tolist() == pytest.approx([1.0], abs=1e-6)
    assert np.array_equal(abs_deltas(a, b), d)


def test_margin_deltas_stay_quiet_on_minus_infinity():
    """A masked alternative reported as -inf on both sides gives inf - inf: the judge drops it without
    a numpy warning (a run under -W error must not crash on it)."""
    import warnings

    inf = float("inf")
    a = scores([1, 2], [[1, 7], [2, 7]], [[-0.1, -inf], [-0.2, -0.9]])
    b = scores([1, 2], [[1, 7], [2, 7]], [[-0.1, -inf], [-0.2, -0.8]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d, _ = abs_deltas_with_margins(a, b)
    assert d.tolist() == pytest.approx([0.1], abs=1e-6)


def test_decode_prefill_bias_is_computed_in_float64():
    """The signed bias is a small difference of margins: float32 arithmetic would round it away."""
    decode = scores([1], [[1, 9]], [[-0.1, -20.3]])
    forced = scores([1], [[1, 9]], [[-0.3, -20.7]])
    top_d = decode.top_logprobs.astype(np.float64)
    top_f = forced.top_logprobs.astype(np.float64)
    expected = (top_d[0, 0] - top_d[0, 1]) - (top_f[0, 0] - top_f[0, 1])
    assert decode_prefill_bias([(decode, forced)]).mean == float(expected)


def test_a_margin_of_exactly_tie_nats_is_a_tie():
    from specparity.judge.resolution import TIE_NATS, is_tie

    assert is_tie(TIE_NATS) and is_tie(-TIE_NATS) and not is_tie(2 * TIE_NATS) and not is_tie(None)


def test_rejected_reason_says_where_the_first_rejection_sits_against_the_split():
    from specparity.judge.compare import OWN_ROW_REJECTED, _rejected_reason
    from specparity.model.verdicts import TFViolation

    rejected = [TFViolation(5, 11, 12, 0.5), TFViolation(9, 13, 14, 0.25)]
    decode = lambda ids: f"<{ids[0]}>"  # noqa: E731
    assert _rejected_reason(rejected, decode, split=3) == (
        f"position 5 (first difference at position 3): the speculative run emitted 11 '<11>', but its own row "
        f"there prefers 12 '<12>' by 0.5 nats: {OWN_ROW_REJECTED}; 2 such position(s)")
    assert _rejected_reason(rejected, decode, split=5).startswith("position 5 (at the first difference): ")
    assert _rejected_reason(rejected[1:], decode).startswith("position 9: the speculative run emitted 13")


def test_rate_of_a_run_that_accepted_nothing_is_zero_not_unknown():
    lo, hi = wilson(0, 8)
    assert _rate((8, 0)) == f"0.000 [{lo:.3f}, {hi:.3f}] (0/8)" and lo == 0.0


# --- the split: its gap and its resolution (judge/compare.py, judge/resolution.py) ---------------------------

def _divergence(baseline_margin=0.5, spec_margin=None, spec_token=5, ulp_nats=None):
    from specparity.model.verdicts import Divergence, TokenView

    return Divergence(0, TokenView(7, "b"), None if spec_token is None else TokenView(spec_token, "s"),
                      baseline_margin, 1, spec_margin, 1, "", "", "", None, ulp_nats=ulp_nats)


def test_split_gap_adds_both_sides_margins_and_bounds_a_missing_token_by_the_rows_floor():
    from specparity.judge.compare import split_gap

    nan = float("nan")
    rows = scores([5, 6, 6], [[5, 8], [6, 8], [6, 8]], [[-0.25, -1.0], [-0.125, -2.0], [nan, nan]],
                  logprobs=[-0.25, -0.125, nan])
    assert split_gap(_divergence(spec_margin=0.25), rows, 0) == 0.75
    # no spec margin: the speculative token's own logprob over the row's lowest recorded value
    assert split_gap(_divergence(), rows, 0) == 0.5 + (-0.25 + 1.0)
    assert split_gap(_divergence(spec_token=9), rows, 0) is None  # its token is nowhere in the row
    assert split_gap(_divergence(spec_margin=0.25), rows, 2) is None  # unreported row
    assert split_gap(_divergence(spec_margin=0.25), rows, 3) is None  # past the end
    assert split_gap(_divergence(spec_margin=0.25), rows, 4) is None
    assert split_gap(_divergence(baseline_margin=None, spec_margin=0.25), rows, 0) is None
    assert split_gap(_divergence(spec_token=None, spec_margin=0.25), rows, 0) is None
    no_alternatives = TokenScores(np.array([5]), np.array([-0.25]), np.zeros((1, 0)), np.zeros((1, 0)))
    assert split_gap(_divergence(), no_alternatives, 0) is None


def test_resolution_words_count_ulps_in_the_singular_and_the_plural():
    from specparity.judge.compare import _resolution_words

    assert _resolution_words(_divergence(baseline_margin=0.125, ulp_nats=0.125)) == " (1 ulp of 0.125)"
    assert _resolution_words(_divergence(baseline_margin=0.25, ulp_nats=0.125)) == " (2 ulps of 0.125)"
    assert _resolution_words(_divergence(baseline_margin=-0.375, ulp_nats=0.125)) == " (3 ulps of 0.125)"
    assert _resolution_words(_divergence(baseline_margin=0.25, ulp_nats=None)) == ""


def test_power_of_two_divisor_edges():
    """Non-finite and zero differences have no quantum; the tolerance is inclusive and measured in nats
    (a difference 1.5e-5 nats off a multiple of 0.5 is that multiple)."""
    from specparity.judge.resolution import QUANTUM_TOLERANCE, power_of_two_divisor

    assert power_of_two_divisor(float("inf")) is None and power_of_two_divisor(float("nan")) is None
    assert power_of_two_divisor(0.0) is None
    assert power_of_two_divisor(0.5 + 1.5e-5) == 0.5
    assert power_of_two_divisor(-0.375) == 0.125
    assert power_of_two_divisor(QUANTUM_TOLERANCE) == 1.0  # within the tolerance of 0: a multiple of every quantum
    assert power_of_two_divisor(0.3) is None


def test_margin_quantum_is_the_rows_quantum_never_coarser_than_the_margin():
    from specparity.judge.resolution import margin_quantum, scores_quantum

    row = scores([1], [[1, 2, 3, 4]], [[-0.125, -0.25, -0.5, -0.875]])
    assert scores_quantum(row, 0) == 0.125
    assert margin_quantum(row, 0, None) == 0.125  # no margin: the row's own quantum
    assert margin_quantum(row, 0, 0.0) == 0.125  # an exact tie: the row's quantum
    assert margin_quantum(row, 0, 0.25) == 0.125
    assert margin_quantum(row, 0, 0.0625) == 0.0625
    assert margin_quantum(row, 0, 0.3) is None  # a margin no quantum divides
    assert margin_quantum(row, 1, 0.25) is None  # past the end


def test_scores_quantum_reads_every_filled_slot_and_the_chosen_token():
    """Token id 0 is a real alternative, -1 an empty slot; the chosen token's own logprob is part of the
    row even when the engine left it out of the top-k; an unreported row has no quantum."""
    from specparity.judge.resolution import scores_quantum

    nan = float("nan")
    with_id_0 = scores([1], [[1, 0, 3, -1]], [[-0.125, -0.25, -0.5, -0.1875]])
    assert scores_quantum(with_id_0, 0) == 0.125
    chosen_outside = scores([1], [[2, 3]], [[-0.25, -0.5]], logprobs=[-0.125])
    assert scores_quantum(chosen_outside, 0) == 0.125
    unreported = scores([1, 1], [[1, 2], [1, 2]], [[nan, nan], [-0.125, -0.25]], logprobs=[nan, -0.125])
    assert scores_quantum(unreported, 0) is None


def test_row_quantum_counts_differences_and_reads_only_the_values_near_the_top():
    from specparity.judge.resolution import QUANTUM_TOLERANCE, row_quantum

    assert row_quantum([0.0, -0.125, -0.375]) == 0.125  # three values, two differences: enough
    assert row_quantum([0.0, -0.125]) is None  # one difference is a multiple of anything
    # a value within rounding of the top is the top again, not a second spacing
    assert row_quantum([0.0, -QUANTUM_TOLERANCE, -0.125]) is None
    # exactly NEAR_NATS below the top is still near; beyond it the values are not read
    assert row_quantum([0.0, -0.5, -4.0, -4.3]) == 0.5
    # two near values are enough: the far ones (another binade) are left out
    assert row_quantum([0.0, -0.5, -1.0, -5.3]) == 0.5
    # the tolerance is in nats: 1.5e-5 nats off a multiple of 0.5 is that multiple
    assert row_quantum([0.0, -0.5 - 1.5e-5, -1.0]) == 0.5


def test_absolute_remerge_offsets():
    from specparity.judge.compare import _absolute

    assert _absolute((2, 3), 10) == (12, 13) and _absolute(None, 10) is None


def test_find_remerge_edges():
    """A short common run counts only when it ends both streams; a token repeated hundreds of times is
    still matched (difflib's popularity heuristic, off here, would drop it)."""
    from specparity.judge.compare import find_remerge

    assert find_remerge([5, 1, 2], [6, 1, 2]) == (1, 1)
    assert find_remerge([5, 1, 2], [6, 1, 2, 7]) is None
    assert find_remerge([5, 1, 2, 8], [6, 1, 2]) is None
    assert find_remerge([5, 6, 1, 2, 3, 4, 9], [7, 1, 2, 3, 4]) == (2, 1)
    assert find_remerge([9] + [1] * 300, [8] + [1] * 300) == (1, 1)


def test_batch_report_to_json():
    from specparity.judge.invariance import BatchReport

    rep = BatchReport("hf", "bfloat16", 4, "in-process left-padded batch", 0.25)
    assert rep.to_json() == {"engine": "hf", "dtype": "bfloat16", "batch_size": 4,
                             "how": "in-process left-padded batch", "threshold": 0.25, "classes": {},
                             "status": "ok", "why": "every prompt identical alone and batched", "verdicts": []}


# --- the split's description: where the baseline margin is read from (judge/compare.py) ----------------------
# The property tests of test_compare.py build every row from the decode scores; these pin the other sources
# (the baseline's teacher-forced row when the engine left its decode row out, the speculative stream's
# teacher-forced row when the speculative token is outside the baseline's top-k) and rows shorter than the
# streams.

_NAN = float("nan")
_SAME_PREFIX = "teacher-forced (the speculative stream's row at the split: same prefix)"


def _stream(ids, rows, spec=None) -> GenerationResult:
    return GenerationResult("p", list(ids), "", "length", rows, spec or SpecStats.unavailable("test"))


def _decode(ids) -> str:
    return "".join(f"<{t}>" for t in ids)


def _f32(x: float) -> float:
    return float(np.float32(x))


#: The baseline's decode rows of [1, 2, 3]; at the split (position 1) the row is bf16-like (0.125
#: steps near the top) with one far alternative, token 8, 5.175 nats down.
_BASE_IDS = [1, 2, 3]
_UNREPORTED = ([-1, -1, -1, -1], [_NAN] * 4)


def _base_rows(row1=([2, 5, 7, 8], [-0.125, -0.25, -0.5, -5.3]), n=3) -> TokenScores:
    table = [([1, 9, 8, 7], [-0.1, -3.0, -4.0, -5.0]), row1, ([3, 9, 8, 7], [-0.2, -3.0, -4.0, -5.0])][:n]
    lp = [r[1][0] for r in table]
    return scores(_BASE_IDS[:n], [r[0] for r in table], [r[1] for r in table], logprobs=lp)


def _spec_rows(spec_token: int) -> TokenScores:
    """The speculative run's own rows: at the split it prefers its token over 2 by 0.2 nats."""
    return scores([1, spec_token, 3], [[1, 9, 8, 7], [spec_token, 2, 9, 4], [3, 9, 8, 7]],
                  [[-0.1, -3.0, -4.0, -5.0], [-0.1, -0.3, -4.0, -5.0], [-0.2, -3.0, -4.0, -5.0]])


#: The baseline's teacher-forced rows: at the split 2 over 5 by 0.25 nats (not the decode row's 0.125).
_BASE_TF = scores(_BASE_IDS, [[1, 9, 8, 7], [2, 5, 7, 8], [3, 9, 8, 7]],
                  [[-0.1, -3.0, -4.0, -5.0], [-0.125, -0.375, -0.5, -6.0], [-0.2, -3.0, -4.0, -5.0]])


def _spec_tf_rows(spec_token: int, own: float = -3.125, argmax: int = 2, scored: int | None = None) -> TokenScores:
    """The target's teacher-forced scoring of the speculative stream: at the split its argmax is the
    baseline's token (same prefix) and the speculative token carries ``own`` (3 nats down by default;
    ``scored``: the row holds another token's logprob instead)."""
    return scores([1, spec_token if scored is None else scored, 3], [[1, 9, 8, 7], [argmax, 5, 7, 11], [3, 9, 8, 7]],
                  [[-0.1, -3.0, -4.0, -5.0], [-0.125, -0.25, -0.5, -5.0], [-0.2, -3.0, -4.0, -5.0]],
                  logprobs=[-0.1, own, -0.2])


def _split(spec_token=5, baseline=None, baseline_tf=None, spec_tf=None, spec_ids=None, spec_scores=None):
    base = _stream(_BASE_IDS, _base_rows() if baseline is None else baseline)
    ids = [1, spec_token, 3] if spec_ids is None else spec_ids
    spec = _stream(ids, _spec_rows(spec_token) if spec_scores is None else spec_scores)
    return _describe_divergence(1, base, spec, _decode, baseline_tf, spec_tf)


#: Rows that stop before the split (one row, position 0 only).
_ONE_ROW = scores([1], [[1, 9]], [[-0.1, -3.0]])


def test_the_margin_comes_from_the_baseline_decode_row_when_it_holds_both_tokens():
    """The decode row wins over both teacher-forced scorings, which would give other margins here."""
    d = _split(baseline_tf=_BASE_TF, spec_tf=_spec_tf_rows(5))
    assert d.position == 1
    assert (d.baseline_token, d.spec_token) == (TokenView(2, "<2>"), TokenView(5, "<5>"))
    assert d.margin_source == "decode"
    assert d.baseline_margin == 0.125 and d.spec_rank_in_baseline == 1
    assert d.ulp_nats == 0.125 and not d.tie
    # the speculative run's own row at the split: its token over the baseline's
    assert d.spec_margin == pytest.approx(_f32(-0.1) - _f32(-0.3)) and d.baseline_rank_in_spec == 1


def test_a_far_alternative_gives_a_margin_no_quantum_divides():
    """5.175 nats is no whole number of the row's 0.125 steps (the far value sits in another binade):
    the margin has no ulp, and the record does not claim one."""
    d = _split(spec_token=8)
    assert d.baseline_margin == pytest.approx(_f32(-0.125) - _f32(-5.3))
    assert d.spec_rank_in_baseline == 3
    assert d.ulp_nats is None


def test_an_unreported_decode_row_takes_the_margin_from_the_baseline_teacher_forced_row():
    d = _split(baseline=_base_rows(_UNREPORTED), baseline_tf=_BASE_TF)
    assert d.margin_source == "teacher-forced"
    assert d.baseline_margin == 0.25 and d.spec_rank_in_baseline == 1 and d.ulp_nats == 0.125
    # decode rows that stop before the split: the same
    short = _split(baseline=_base_rows(n=1), baseline_tf=_BASE_TF)
    assert (short.margin_source, short.baseline_margin, short.spec_rank_in_baseline) == ("teacher-forced", 0.25, 1)


def test_rows_that_stop_before_the_split_give_no_margin():
    """Decode rows or teacher-forced rows shorter than the streams are read only where they exist."""
    for kwargs in ({"baseline": _base_rows(n=1)}, {"baseline": TokenScores.empty(4)},
                   {"baseline": _base_rows(_UNREPORTED), "baseline_tf": _ONE_ROW},
                   {"baseline": _base_rows(n=1), "spec_tf": _ONE_ROW}):
        d = _split(**kwargs)
        assert (d.baseline_margin, d.spec_rank_in_baseline, d.ulp_nats, d.margin_source) == (None, None, None,
                                                                                             "decode"), kwargs
    # the speculative run's own rows stopping before the split: no margin of its own, no rank
    d = _split(spec_scores=_ONE_ROW)
    assert (d.baseline_margin, d.spec_margin, d.baseline_rank_in_spec) == (0.125, None, None)


def test_a_token_outside_the_baseline_top_k_takes_its_margin_from_the_speculative_teacher_forced_row():
    """Up to the split both streams share the prefix, so the row that scored the speculative token is the
    baseline's row too: its argmax over the speculative token's exact logprob is the margin."""
    d = _split(spec_token=6, spec_tf=_spec_tf_rows(6))
    assert d.spec_rank_in_baseline is None
    assert d.margin_source == _SAME_PREFIX
    assert d.baseline_margin == 3.0 and d.ulp_nats == 0.125
    # a row whose argmax is not the baseline's token is another prefix's row: not read
    other = _split(spec_token=6, spec_tf=_spec_tf_rows(6, argmax=9))
    assert (other.baseline_margin, other.margin_source) == (None, "decode")
    # a row without the speculative token's own logprob gives no margin either
    unscored = _split(spec_token=6, spec_tf=_spec_tf_rows(6, scored=4))
    assert (unscored.baseline_margin, unscored.margin_source, unscored.ulp_nats) == (None, "decode", None)
    # 5.175 nats is no whole number of that row's 0.125 steps: no ulp is claimed
    far = _split(spec_token=6, spec_tf=_spec_tf_rows(6, own=-5.3))
    assert far.baseline_margin == pytest.approx(_f32(-0.125) - _f32(-5.3)) and far.ulp_nats is None


def test_a_stream_that_ends_at_the_split_has_no_margin_and_no_source():
    """Where the speculative run ended, there is no second token: no margin is read from any row."""
    d = _split(baseline=_base_rows(_UNREPORTED), baseline_tf=_BASE_TF, spec_ids=[1], spec_scores=_ONE_ROW)
    assert d.spec_token is None and d.baseline_token == TokenView(2, "<2>")
    assert (d.baseline_margin, d.spec_rank_in_baseline, d.margin_source, d.remerge) == (None, None, "decode", None)


# --- the noise figures and the threshold derived from them (judge/noise.py) ---------------------------------

def _noise_pairs():
    """Two (decode, teacher-forced) pairs with exact binary logprobs. Pair one: two positions whose four
    alternatives move by 0.125, 0, 0 and 0.5 nats (their margins 0.5, 2.5, 2.0 and 5.75 on the closer side);
    pair two: three decode rows against one teacher-forced row, one alternative moved by 0.0625 (margin 0.25)."""
    a1 = scores([1, 2], [[1, 5, 6], [2, 5, 6]], [[-0.5, -1.0, -3.0], [-0.25, -2.25, -6.0]])
    b1 = scores([1, 2], [[1, 5, 6], [2, 5, 6]], [[-0.5, -1.125, -3.0], [-0.25, -2.25, -6.5]])
    a2 = scores([3, 4, 5], [[3, 7], [4, 7], [5, 7]], [[-0.125, -0.375], [-0.1, -0.2], [-0.1, -0.2]])
    b2 = scores([3], [[3, 7]], [[-0.125, -0.4375]])
    return [(a1, b1), (a2, b2)]


def test_measure_noise_counts_every_shared_pair_and_the_near_ones_up_to_the_window():
    from specparity.judge.noise import measure_noise
    from specparity.model.threshold import NoiseStats

    deltas = np.array([0.125, 0.0, 0.0, 0.5, 0.0625], np.float32)
    p99 = float(np.quantile(deltas, 0.99))
    got = measure_noise(_noise_pairs(), window=2.0)
    # positions: 2 + min(3, 1); a margin of exactly the window is near (0.125, 0.0 at 2.0, 0.0625)
    assert got == NoiseStats(0.5, p99, 3, 5, 2.0, near_pairs=3, near_max_abs_delta=0.125, robust_abs_delta=0.5,
                             near_robust_abs_delta=0.125, moved_pairs=3)
    # no window: the near figures stay unset
    assert measure_noise(_noise_pairs()) == NoiseStats(0.5, p99, 3, 5, None, robust_abs_delta=0.5, moved_pairs=3)
    # a window no pair is within: no near pair, near figures 0
    assert measure_noise(_noise_pairs(), window=0.1) == NoiseStats(0.5, p99, 3, 5, 0.1, near_pairs=0,
                                                                   near_max_abs_delta=0.0, robust_abs_delta=0.5,
                                                                   near_robust_abs_delta=0.0, moved_pairs=3)


def test_measure_noise_with_nothing_shared_counts_the_positions_and_no_pair():
    from specparity.judge.noise import measure_noise
    from specparity.model.threshold import NoiseStats

    assert measure_noise([]) == NoiseStats(0.0, 0.0, 0, 0, None, moved_pairs=0)
    apart = (scores([1, 2], [[1, 5], [2, 5]], [[-0.5, -1.0], [-0.5, -1.0]]),
             scores([1, 2], [[1, 6], [2, 6]], [[-0.5, -1.0], [-0.5, -1.0]]))  # no alternative in common
    assert measure_noise([apart], window=2.0) == NoiseStats(0.0, 0.0, 2, 0, 2.0, moved_pairs=0)


def test_derive_threshold_takes_an_override_from_zero_up_to_the_ceiling_and_keeps_every_setting():
    from specparity.judge.noise import CalibrationError, derive_threshold, near_tie_above_ceiling
    from specparity.model.threshold import NoiseStats

    noise, cross = NoiseStats(0.25, 0.125, 10, 40), NoiseStats(0.5, 0.25, 10, 40)
    t = derive_threshold(noise, override=1.0, multiplier=3.0, ceiling=1.0, calibration="2 prompts", cross=cross,
                         cross_note="a note")
    assert (t.nats, t.source, t.noise, t.multiplier, t.ceiling, t.calibration, t.cross, t.cross_note) == (
        1.0, "override", noise, 3.0, 1.0, "2 prompts", cross, "a note")
    assert type(t.nats) is float and derive_threshold(None, override=1).nats == 1.0
    zero = derive_threshold(None, override=0.0)
    assert (zero.nats, zero.source, zero.calibration, zero.cross_note, zero.cross) == (0.0, "override", "", "", None)
    assert derive_threshold(None, override=0.5).nats == 0.5
    with pytest.raises(ValueError) as negative:
        derive_threshold(noise, override=-0.25)
    assert str(negative.value) == "--near-tie-nats: expected a non-negative number of nats, got -0.25"
    with pytest.raises(CalibrationError) as above:
        derive_threshold(noise, override=1.5, ceiling=1.25)
    assert str(above.value) == near_tie_above_ceiling(1.5, 1.25)


def test_derive_threshold_from_the_noise_up_to_the_ceiling():
    from specparity.judge.noise import NO_NOISE, derive_threshold
    from specparity.model.threshold import FLOOR_NATS, NoiseStats

    for missing in (None, NoiseStats(0.0, 0.0, 5, 0)):
        with pytest.raises(ValueError) as no_noise:
            derive_threshold(missing)
        assert str(no_noise.value) == NO_NOISE
    noise = NoiseStats(0.25, 0.125, 10, 1)  # one pair is a measurement
    t = derive_threshold(noise, multiplier=2.0, ceiling=1.0, calibration="2 prompts", cross_note="a note")
    assert (t.nats, t.source, t.noise, t.multiplier, t.ceiling, t.calibration, t.cross, t.cross_note) == (
        0.5, "measured", noise, 2.0, 1.0, "2 prompts", None, "a note")
    assert derive_threshold(noise).calibration == "" and derive_threshold(noise).cross_note == ""
    # exactly at the ceiling is allowed; noise 0 gives the float32 floor
    assert derive_threshold(NoiseStats(1.0, 0.5, 10, 40), multiplier=2.0, ceiling=2.0).nats == 2.0
    assert derive_threshold(NoiseStats(0.0, 0.0, 10, 40), multiplier=2.0).nats == FLOOR_NATS


def test_derive_threshold_says_which_noise_broke_the_ceiling():
    from specparity.judge.noise import CalibrationError, derive_threshold
    from specparity.model.threshold import NoiseStats

    within = NoiseStats(2.0, 1.0, 10, 40)
    with pytest.raises(CalibrationError) as err:
        derive_threshold(within)
    assert str(err.value) == (
        f"the measured near-tie threshold 3 nats (1.5 × |Δmargin| 2 between decode and teacher-forced scoring: "
        f"{within.describe_flip()}) exceeds the ceiling 2 nats: a flip that large is not numeric noise, so either "
        f"the scorer or the target is not fit to judge near ties; raise --near-tie-ceiling only if this noise is real")
    # the noise between two server instances, as far as the allowance takes it (2 × 0.75 here), is the larger
    small, cross = NoiseStats(0.75, 0.5, 10, 40), NoiseStats(1.5, 1.0, 10, 40)
    with pytest.raises(CalibrationError) as err:
        derive_threshold(small, cross=cross)
    assert (f"(1.5 × |Δmargin| 1.5 between the two server instances: {cross.describe_flip()}) exceeds the ceiling"
            in str(err.value))


# --- the flip budget: the baseline's own flip rate and the flips it predicts (judge/flip_budget.py) ----------

def _margin_rows(tokens, margins, n_rows=None):
    """Rows whose chosen token beats one alternative (id + 100) by ``margins`` nats (negative: the
    alternative wins, the row's argmax is another token; NaN: an unreported row)."""
    ids = list(tokens)
    own = [-0.5 if m == m else float("nan") for m in margins]
    alt = [o - m for o, m in zip(own, margins)]
    top_ids = [[t, t + 100] if m >= 0 else [t + 100, t] for t, m in zip(ids, margins)]
    top_lp = [[o, a] if m >= 0 else [a, o] for o, a, m in zip(own, alt, margins)]
    return scores(ids, top_ids, top_lp, logprobs=own)


def test_measure_flip_rate_counts_positions_at_risk_flips_ties_and_every_compared_position():
    """At risk: above an exact tie, at most the window (0.5 inclusive); a teacher-forced tie is half a flip;
    only the positions both passes have are compared (a pair without teacher-forced rows adds nothing), and
    a position whose teacher-forced row is unreported is compared but not at risk."""
    from specparity.judge.flip_budget import measure_flip_rate
    from specparity.model.threshold import FlipRate

    decoded = _margin_rows([1, 2, 3, 4, 5], [0.0, 0.25, 0.5, 1.0, 0.125])
    tf = _margin_rows([1, 2, 3, 4], [0.25, -0.25, 0.0, -1.0])  # one row short: position 4 is not compared
    empty = (_margin_rows([6, 7], [0.25, 0.25]), TokenScores.empty(2))
    unreported = (_margin_rows([8], [0.25]), _margin_rows([8], [float("nan")]))
    assert measure_flip_rate([(decoded, tf), empty, unreported], window=0.5) == FlipRate(0.5, 2, 1.5, 1, 5)
    # on a channel too coarse for exact ties the reported tie at position 0 is at risk too (it held: no flip)
    assert measure_flip_rate([(decoded, tf), empty, unreported], window=0.5, with_ties=True) == FlipRate(
        0.5, 3, 1.5, 1, 5, True)
    assert measure_flip_rate([], window=0.5) == FlipRate(0.5, 0, 0.0, 0, 0)


def _brute_quantile(ps, q):
    """The smallest k with P(K <= k) >= q, K a sum of independent Bernoulli(p): by enumeration."""
    import itertools

    dist = np.zeros(len(ps) + 1)
    for outcome in itertools.product([0, 1], repeat=len(ps)):
        dist[sum(outcome)] += np.prod([p if o else 1 - p for p, o in zip(ps, outcome)])
    return int(np.argmax(np.cumsum(dist) >= q - 1e-12))


def test_expected_flips_is_the_rule_of_the_module_docstring():
    from specparity.judge.flip_budget import expected_flips
    from specparity.model.threshold import FlipRate, wilson

    rate = FlipRate(0.5, 10, 2.0, 3, 30)  # r = 0.2
    counts = [0, 1, 2, 3, 8]
    lo_r, hi_r = wilson(2.0, 10)

    def probs(x):
        return [1 - (1 - x) ** c for c in counts]

    got = expected_flips(rate, counts, observed=2)
    assert got.expected == pytest.approx(sum(probs(0.2)))
    assert (got.low, got.high, got.limit) == (_brute_quantile(probs(lo_r), 0.025), _brute_quantile(probs(hi_r), 0.975),
                                              _brute_quantile(probs(hi_r), 0.99))
    assert got.low < got.high <= got.limit  # the interval's two ends are not one quantile
    assert (got.observed, got.prompts, got.at_risk_prompts, got.rate) == (2, 5, 4, rate)
    # nothing at risk: no rate, nothing expected, and the interval of 0..1 for the bounds
    none = expected_flips(FlipRate(0.5, 0, 0.0, 0, 30), counts, observed=0)
    assert none.expected == 0.0 and none.rate.rate is None
    assert none.limit == _brute_quantile(probs(1.0), 0.99)


def test_flip_expectation_passes_up_to_its_limit_and_round_trips_its_figures():
    from specparity.judge.flip_budget import FlipExpectation
    from specparity.model.threshold import FlipRate

    e = FlipExpectation(3, 1.25, 0, 2, 3, 5, 4, FlipRate(0.5, 10, 2.0, 3, 30))
    assert e.passed and not FlipExpectation(4, 1.25, 0, 2, 3, 5, 4, e.rate).passed
    assert e.to_json() == {"observed": 3, "expected": 1.25, "low": 0, "high": 2, "limit": 3, "prompts": 5,
                           "at_risk_prompts": 4, "passed": True}


# --- the threshold record and its words (model/threshold.py) ---------------------------------------------------

def _near_noise(**kw):
    from specparity.model.threshold import NoiseStats

    fields = dict(near_window=2.0, near_pairs=60, near_max_abs_delta=0.125, robust_abs_delta=0.375,
                  near_robust_abs_delta=0.0625, moved_pairs=300, largest_at="p7 position 3")
    fields.update(kw)
    return NoiseStats(0.5, 0.25, 100, 400, **fields)


def _cross_noise(**kw):
    from specparity.model.threshold import NoiseStats

    fields = dict(near_window=2.0, near_pairs=60, near_max_abs_delta=0.75, robust_abs_delta=0.875,
                  near_robust_abs_delta=0.625, moved_pairs=20, largest_at="p3 position 9")
    fields.update(kw)
    return NoiseStats(1.0, 0.5, 50, 200, **fields)


def test_noise_stats_describe_which_pairs_the_flip_noise_was_taken_over():
    from specparity.model.threshold import NoiseStats

    near = _near_noise()
    assert near.near_measured and near.flip_noise == 0.0625
    assert near.describe_flip() == ("0.0625 over the 60 pairs whose margin is at most 2 nats (3rd-largest 0.0625, "
                                    "max 0.125; every pair: max 0.5 over 400)")
    few = _near_noise(near_pairs=49)
    assert not few.near_measured and few.flip_noise == 0.375
    assert few.describe_flip() == ("0.375 over every pair (only 49 pair(s) with a margin at most 2 nats, fewer than "
                                   "50: 400 pairs, the all-pairs figure; 3rd-largest 0.375, max 0.5)")
    assert _near_noise(near_pairs=50).near_measured
    # a record made before the robust figures existed: the maxima, and no "3rd-largest" words
    old = NoiseStats(0.5, 0.25, 100, 400)
    assert not old.near_measured and old.flip_noise == 0.5
    assert old.describe_flip() == "0.5 over every pair (400 pairs, the all-pairs figure)"
    old_near = NoiseStats(0.5, 0.25, 100, 400, near_window=2.0, near_pairs=60, near_max_abs_delta=0.125)
    assert old_near.flip_noise == 0.125
    assert old_near.describe_flip() == "0.125 over the 60 pairs whose margin is at most 2 nats (every pair: 0.5 over 400)"
    assert NoiseStats(0.5, 0.25, 100, 400, near_pairs=60).flip_noise == 0.5  # no window: nothing is near
    assert near.to_json() == vars(near) and near.to_json() is not vars(near)


def test_the_ordinals_of_the_robust_rank():
    from specparity.model.threshold import _ordinal

    assert [_ordinal(n) for n in (1, 2, 3, 4, 11)] == ["1st", "2nd", "3rd", "4th", "11th"]


def test_wilson_interval_matches_its_formula_and_clamps_to_zero_and_one():
    import math

    from specparity.model.threshold import wilson

    def reference(k, n, z=1.959964):
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return centre - half, centre + half

    for k, n in ((3, 10), (1.5, 4), (7, 9), (1, 1)):
        assert wilson(k, n) == pytest.approx(reference(k, n), rel=1e-12), (k, n)
    # at 0/7 and 20/20 the formula rounds to just below 0 and just above 1: the interval is clamped
    assert wilson(0, 7)[0] == 0.0 and wilson(20, 20)[1] == 1.0
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, -1) == (0.0, 1.0)
    assert wilson(3, 10, z=1.0) == pytest.approx(reference(3, 10, z=1.0), rel=1e-12)


def test_flip_rate_describes_its_rate_and_round_trips():
    from specparity.model.threshold import FlipRate, wilson

    rate = FlipRate(0.5, 10, 1.5, 2, 30)
    lo, hi = wilson(1.5, 10)
    assert rate.rate == 0.15 and rate.bounds() == (lo, hi)
    assert rate.describe() == (
        f"the baseline's decode and teacher-forced passes chose different tokens at 1.5 of 10 positions whose margin is "
        f"above a tie and within 0.5 nats (flip rate 0.15 (95 % interval {lo:.3g}–{hi:.3g})); 2 exact-tie position(s) "
        f"among 30")
    none = FlipRate(0.5, 0, 0.0, 1, 3)
    assert none.rate is None and "(flip rate no position at risk); 1 exact-tie position(s) among 3" in none.describe()
    tied = FlipRate(0.5, 10, 1.5, 2, 30, True)
    assert tied.describe() == (
        f"the baseline's decode and teacher-forced passes chose different tokens at 1.5 of 10 positions whose margin is "
        f"within 0.5 nats, reported ties included (flip rate 0.15 (95 % interval {lo:.3g}–{hi:.3g})); 2 reported-tie "
        f"position(s) among 30")
    assert FlipRate.from_json(tied.to_json()) == tied and FlipRate.from_json(rate.to_json()).with_ties is False
    assert FlipRate.from_json(rate.to_json()) == rate and rate.to_json() is not vars(rate)
    assert FlipRate.from_json(None) is None and FlipRate.from_json({}) is None


def test_a_measured_threshold_with_a_cross_instance_figure_beyond_the_allowance():
    from specparity.model.threshold import FlipRate, NearTieThreshold

    near, cross = _near_noise(), _cross_noise()
    t = NearTieThreshold(0.1875, "measured", near, 1.5, 2.0, "4 prompts", cross, "", FlipRate(2.0, 10, 1.5, 2, 30))
    # the near-tie figure: 0.625 between the servers, of which the allowance takes 0.25 (its floor); the
    # drift bound's: 1.0 between them, exactly the cap 2 × 0.5, all taken
    (f0, f1) = t.cross_figures()
    assert (f0.what, f0.within, f0.cross, f1.what, f1.within, f1.cross) == (
        "near-tie figure", 0.0625, 0.625, "largest over every pair", 0.5, 1.0)
    assert (t.flip_noise, t.noise_max, t.drift_nats, t.drift_held) == (0.25, 1.0, 2.0, True)
    assert t.describe() == (
        "0.1875 nats, measured: 1.5 × |Δmargin| 0.25 (between incremental decode and teacher-forced scoring of the "
        "baseline: 0.0625 over the 60 pairs whose margin is at most 2 nats (3rd-largest 0.0625, max 0.125; every "
        "pair: max 0.5 over 400), 100 positions, p99 0.25; between the two server instances: 0.625 over the 60 pairs "
        "whose margin is at most 2 nats (3rd-largest 0.625, max 0.75; every pair: max 1 over 200), of which the "
        "allowance takes 0.25); ceiling 2; calibrated on 4 prompts")
    assert t.describe_cross() == (
        "max |Δmargin| 0.625 over the 60 pairs whose margin is at most 2 nats (3rd-largest 0.625, max 0.75; every "
        "pair: max 1 over 200) between teacher-forced scoring of the baseline's tokens on the baseline server and on "
        "the speculative server (50 positions; p99 0.5; 20 of 200 pairs moved; the largest at p3 position 9); within "
        "the baseline's instance: 0.0625 (every pair: max 0.5); the allowance takes 0.25 of the near-tie figure")
    # both figures sit above the within-instance ones: both are named, the second taken whole (at its cap);
    # the drift bound is held at the ceiling either way, so only the threshold widened
    assert t.cross_finding() == (
        "the speculative server's target computes differently: cross-instance 0.625 nats vs within-instance 0.0625 "
        "(near-tie figure; the allowance takes 0.25), 1 vs 0.5 (largest over every pair; 1); 20 of 200 pairs moved "
        "between the two servers, the largest at p3 position 9. A figure measured on the speculative server widened "
        "the allowance it is judged against: the near-tie threshold 0.375 nats (0.09375 from the within-instance "
        "figure alone). The threshold and the drift bound take the cross-instance noise only up to the larger of 0.25 "
        "nats and 2 × the within-instance figure; compare what decides the two servers' numerics (dtype, "
        "quantization, KV cache dtype, attention backend, tensor-parallel size, speculative settings that reach the "
        "target's kernels)")
    j = t.to_json()
    assert j == {"nats": 0.1875, "source": "measured", "multiplier": 1.5, "noise": near.to_json(), "ceiling": 2.0,
                 "drift_nats": 2.0, "calibration": "4 prompts", "cross_instance": cross.to_json(),
                 "cross_instance_note": "", "cross_instance_finding": t.cross_finding(),
                 "flip_rate": {"window": 2.0, "positions": 10, "flips": 1.5, "ties": 2, "measured_positions": 30,
                               "with_ties": False},
                 "resolution": None, "judged_side": None, "judged_side_finding": None,
                 "description": t.describe()}
    assert NearTieThreshold.from_json(j) == t


def test_cross_instance_words_without_counts_or_location_and_within_the_allowance():
    from specparity.model.threshold import NearTieThreshold, NoiseStats

    # the finding without a count of moved pairs: only where the largest was, with no leading comma
    bare = _cross_noise(moved_pairs=None)
    t = NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross=bare, cross_note="scored on the spec server")
    assert "(largest over every pair; 1); the largest at p3 position 9. A figure measured" in t.cross_finding()
    assert t.describe_cross().endswith("(50 positions; p99 0.5; the largest at p3 position 9); within the baseline's "
                                       "instance: 0.0625 (every pair: max 0.5); the allowance takes 0.25 of the "
                                       "near-tie figure; scored on the spec server")
    unlocated = NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross=_cross_noise(largest_at=None))
    assert "(largest over every pair; 1); 20 of 200 pairs moved between the two servers. A figure" in (
        unlocated.cross_finding())
    assert "(50 positions; p99 0.5; 20 of 200 pairs moved); within" in unlocated.describe_cross()
    nothing = NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross=_cross_noise(moved_pairs=None,
                                                                                          largest_at=None))
    assert "(largest over every pair; 1). A figure measured" in nothing.cross_finding()
    assert "(50 positions; p99 0.5); within" in nothing.describe_cross()
    # within the cap: no "of which", no "allowance takes" in the threshold's words; the widening is a finding
    small = NoiseStats(0.25, 0.125, 50, 200, moved_pairs=20, largest_at="p3 position 9")
    within = NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross=small)
    assert within.flip_noise == 0.25 and within.noise_max == 0.5
    assert within.cross_finding().startswith(
        "the speculative server's target computes differently: cross-instance 0.25 nats vs within-instance 0.0625 "
        "(near-tie figure; the allowance takes 0.25); 20 of 200 pairs moved between the two servers, the largest at "
        "p3 position 9. A figure measured on the speculative server widened the allowance it is judged against: the "
        "near-tie threshold 0.375 nats (0.09375 from the within-instance figure alone). The threshold")
    # the same figure within the instance: nothing widened, no finding
    assert NearTieThreshold(0.1875, "measured", NoiseStats(0.5, 0.125, 50, 200, robust_abs_delta=0.25), 1.5,
                            cross=small).cross_finding() is None
    assert "of which" not in within.describe() and "allowance" not in within.describe_cross()
    assert within.describe().endswith("; between the two server instances: 0.25 over every pair (200 pairs, the "
                                      "all-pairs figure)); ceiling 2")
    # no cross-instance figure: its note, or "not measured"
    alone = NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross_note="one instance")
    assert alone.cross_figures() == [] and alone.cross_finding() is None and alone.describe_cross() == "one instance"
    assert alone.describe().endswith("100 positions, p99 0.25); ceiling 2")
    assert NearTieThreshold.from_json(alone.to_json()).cross_note == "one instance"
    assert NearTieThreshold(0.1875, "measured", _near_noise(), 1.5).describe_cross() == "not measured"
    assert NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross=NoiseStats(0.0, 0.0, 5, 0),
                            cross_note="").describe_cross() == "not measured"
    # a cross-instance figure without a within-instance one: it alone, up to the floor of the allowance
    only_cross = NearTieThreshold(0.5, "override", None, 1.5, cross=_cross_noise())
    assert [(f.within, f.cross) for f in only_cross.cross_figures()] == [(0.0, 0.625), (0.0, 1.0)]
    assert (only_cross.flip_noise, only_cross.noise_max, only_cross.drift_nats) == (0.25, 0.25, None)
    assert not only_cross.drift_held
    assert only_cross.describe_cross().endswith("20 of 200 pairs moved; the largest at p3 position 9); the allowance "
                                                "takes 0.25 of the near-tie figure, 0.25 of the largest over every pair")


def test_an_override_threshold_says_what_was_measured_and_that_the_ceiling_was_raised():
    from specparity.model.threshold import NearTieThreshold, NoiseStats

    noise = NoiseStats(0.5, 0.25, 100, 400)
    t = NearTieThreshold(3.0, "override", noise, 1.5, 4.0, "4 prompts", _cross_noise(), "")
    assert t.describe() == ("3 nats, set by --near-tie-nats (measured noise for reference: max |Δmargin| 0.5; between "
                            "the two server instances 1); --near-tie-ceiling raised to 4 nats on purpose (default 2); "
                            "calibrated on 4 prompts")
    assert NearTieThreshold(0.5, "override", None, 1.5).describe() == "0.5 nats, set by --near-tie-nats"
    assert NearTieThreshold(0.5, "override", noise, 1.5, 2.0).describe() == (
        "0.5 nats, set by --near-tie-nats (measured noise for reference: max |Δmargin| 0.5)")
    empty_cross = NearTieThreshold(0.5, "override", noise, 1.5, 2.0, cross=NoiseStats(0.0, 0.0, 5, 0))
    assert empty_cross.describe() == "0.5 nats, set by --near-tie-nats (measured noise for reference: max |Δmargin| 0.5)"
    # a measured threshold never says "raised", whatever its ceiling; an override at a lowered one neither
    assert "raised" not in NearTieThreshold(0.5, "measured", noise, 1.5, 4.0).describe()
    assert "raised" not in NearTieThreshold(0.5, "override", noise, 1.5, 1.0).describe()
    j = t.to_json()
    assert (j["noise"], j["flip_rate"], j["cross_instance_finding"]) == (noise.to_json(), None, t.cross_finding())
    assert NearTieThreshold.from_json(j) == t
    bare = NearTieThreshold(0.5, "override", None, 1.5)
    assert bare.to_json()["noise"] is None and bare.to_json()["cross_instance"] is None
    assert bare.drift_nats is None and not bare.drift_held and bare.noise_max is None and bare.flip_noise is None
    # a record from before the ceiling, the calibration words and the cross-instance figure were journalled
    old = NearTieThreshold.from_json({"nats": "0.5", "source": "override", "multiplier": "1.5", "noise": None})
    assert old == NearTieThreshold(0.5, "override", None, 1.5, 2.0, "", None, "", None)


def test_the_drift_bound_has_a_floor_and_is_held_only_above_the_ceiling():
    from specparity.model.threshold import FLOOR_NATS, NearTieThreshold, NoiseStats

    zero = NearTieThreshold(1e-5, "measured", NoiseStats(0.0, 0.0, 10, 40), 1.5)
    assert zero.drift_nats == FLOOR_NATS and not zero.drift_held
    at = NearTieThreshold(0.5, "measured", NoiseStats(0.5, 0.25, 10, 40), 1.5, 2.0)
    assert at.drift_nats == 2.0 and not at.drift_held  # 4 × 0.5 is the ceiling itself: not held
    over = NearTieThreshold(0.5, "measured", NoiseStats(0.75, 0.25, 10, 40), 1.5, 2.0)
    assert over.drift_nats == 2.0 and over.drift_held
    under = NearTieThreshold(0.5, "measured", NoiseStats(0.25, 0.25, 10, 40), 1.5, 2.0)
    assert under.drift_nats == 1.0 and not under.drift_held
    unmeasured = NearTieThreshold(0.5, "override", NoiseStats(0.0, 0.0, 10, 0), 1.5)
    assert unmeasured.drift_nats is None and not unmeasured.drift_held


# --- compare(): every rule, with its exact reason (judge/compare.py) --------------------------------------------
# Six tokens, stop token 0, max_new_tokens 6, near-tie threshold 0.25. Every row holds the chosen token at -0.125
# and one alternative ``margin`` nats below it (default 4); the baseline flips 2 -> 7 at position 1.

_C_BASE = [1, 2, 3, 4, 5, 6]
_C_SPEC = [1, 7, 3, 4, 5, 6]  # re-merges at 2/2


def _c_rows(ids, margins=None, alts=None, chosen=None, unreported=()):
    """Rows whose argmax is ``chosen[i]`` (default: the token itself) with ``alts[i]`` (default 9) ``margins[i]``
    nats below; where the argmax is another token, the token itself is the alternative."""
    n = len(ids)
    margins = margins or {}
    alts = alts or {}
    chosen = chosen or {}
    top_ids, top_lp, own = [], [], []
    for i, t in enumerate(ids):
        best, alt, m = chosen.get(i, t), alts.get(i, 9), margins.get(i, 4.0)
        second = t if best != t else alt
        top_ids.append([best, second])
        top_lp.append([-0.125, -0.125 - m])
        own.append(-0.125 if best == t else -0.125 - m)
    rows = scores(ids, top_ids, top_lp, logprobs=own)
    for i in unreported:
        rows.logprobs[i] = np.nan
        rows.top_logprobs[i] = np.nan
        rows.top_ids[i] = -1
    return rows


def _c_stream(ids, rows, finish="length", error=None):
    return GenerationResult("p", list(ids), "", finish, rows, SpecStats.unavailable("test"), error=error)


def _c_compare(base=None, spec=None, spec_tf="default", **kw):
    from specparity.judge.compare import compare

    base = base or _c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.125}, alts={1: 7}))
    spec = spec or _c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.125}, alts={1: 2}))
    if spec_tf == "default":  # the target's own choice at every later position; at the split its row (2 over 7)
        spec_tf = _c_rows(spec.output_ids, margins={1: 0.5}, chosen={1: 2})
    kw.setdefault("threshold", 0.25)
    return compare("p", "cat", base, spec, spec_tf, max_new_tokens=6, stop_ids=[0], decode=_decode, **kw)


def test_compare_identical_streams_and_the_record_it_keeps():
    from specparity.model.verdicts import Drift

    same = _c_stream(_C_BASE, _c_rows(_C_BASE))
    v = _c_compare(same, _c_stream(_C_BASE, _c_rows(_C_BASE)), _c_rows(_C_BASE), threshold=0.5)
    assert (v.prompt_id, v.category, v.klass, v.rule, v.reason) == (
        "p", "cat", "exact", "identical", "identical token ids and finish reason")
    assert (v.baseline_len, v.spec_len, v.baseline_finish, v.spec_finish, v.threshold, v.later_scored) == (
        6, 6, "length", "length", 0.5, True)
    assert v.divergence is None and v.drift is None and v.tf_violations == [] and v.rejected_at is None
    unscored = _c_compare(same, same, None, drift_nats=0.5)
    assert unscored.klass == "exact" and not unscored.later_scored and unscored.drift == Drift(0.5, 0.0, None, 0, 6)


def test_compare_failed_and_broken_streams_are_errors():
    ok = _c_stream(_C_BASE, _c_rows(_C_BASE))
    both = _c_compare(_c_stream([], TokenScores.empty(2), error="boom"), _c_stream([], TokenScores.empty(2), error="x"))
    assert (both.klass, both.rule, both.reason) == ("error", "failed", "baseline failed: boom")
    spec_only = _c_compare(ok, _c_stream([], TokenScores.empty(2), error="bad"))
    assert (spec_only.klass, spec_only.rule, spec_only.reason) == ("error", "failed", "speculative run failed: bad")
    why = ("the engine broke the protocol: finish_reason 'abort' for a finished stream (expected 'stop' or 'length')")
    broken = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE), "abort"), _c_stream(_C_BASE, _c_rows(_C_BASE), "abort"))
    assert (broken.klass, broken.rule, broken.reason) == ("error", "broken_finish",
                                                          f"baseline: {why}; speculative run: {why}")
    assert _c_compare(ok, _c_stream(_C_BASE, _c_rows(_C_BASE), "abort")).reason == f"speculative run: {why}"


def test_compare_a_baseline_that_breaks_the_stop_rule_is_not_judged():
    from specparity.judge.compare import stop_rule_problem

    base = _c_stream([1, 2, 3], _c_rows([1, 2, 3]), "stop")
    v = _c_compare(base, _c_stream([1, 2, 3], _c_rows([1, 2, 3]), "stop"))
    assert (v.klass, v.rule) == ("error", "baseline_stop_rule")
    assert v.reason == (f"not judged: the baseline breaks the stop rule ({stop_rule_problem(base, 6, [0], _decode)}): "
                        f"the stop set or token limit is not the engine's, a harness/configuration error, not "
                        f"speculation")
    assert "ends with token 3 '<3>'" in v.reason  # the decode reaches the words


def test_compare_same_tokens_other_finish_own_row_rejection_and_drift():
    from specparity.model.verdicts import Drift

    ids = [1, 2, 3, 4, 5, 0]
    v = _c_compare(_c_stream(ids, _c_rows(ids)), _c_stream(ids, _c_rows(ids), "stop"))
    assert (v.klass, v.rule, v.reason) == ("diverged", "finish_mismatch",
                                           "same tokens but finish reason 'stop' vs baseline 'length'")
    base = _c_stream(_C_BASE, _c_rows(_C_BASE))
    rejected = _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE, margins={2: 1.0}, chosen={2: 9})))
    assert (rejected.klass, rejected.rule, rejected.rejected_at) == ("diverged", "own_row_rejected", 2)
    assert rejected.reason.startswith("position 2: the speculative run emitted 3 '<3>', but its own row there "
                                      "prefers 9 '<9>' by 1 nats: ")
    drifted = _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE, margins={3: 3.0})), drift_nats=0.5)
    assert drifted.drift == Drift(0.5, 1.0, 3, 1, 6)
    assert (drifted.klass, drifted.rule, drifted.reason) == (
        "drifted", "drift", "identical token ids, but the speculative run's own logprobs drift from the baseline's by "
                            "up to 1 nats from position 3 (1 of 6 positions above the drift bound 0.5)")
    within = _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE, margins={3: 3.5})), drift_nats=0.5)
    assert within.klass == "exact" and within.drift == Drift(0.5, 0.5, None, 0, 6)


def test_compare_a_split_with_a_broken_stream_or_no_margin():
    spec_ids = [1, 0, 3, 4, 5, 6]
    v = _c_compare(spec=_c_stream(spec_ids, _c_rows(spec_ids)))
    assert (v.klass, v.rule) == ("diverged", "stream_problem") and v.divergence.position == 1
    assert v.reason == ("speculative stream: continued past stop token 0 at position 1 (4 tokens after it) (first "
                        "difference at position 1)")
    unreported = _c_stream(_C_BASE, _c_rows(_C_BASE, unreported=(1,)))
    u = _c_compare(unreported, spec_tf=None)  # (the speculative stream's teacher-forced row would give a margin)
    assert (u.klass, u.rule) == ("diverged", "margin_unreported")
    assert u.reason == ("position 1: the engine reported no logprobs for the baseline there, so the margin between "
                        "'<2>' and '<7>' is unknown (never assumed to be a near tie)")
    assert _c_compare(unreported, spec_tf=None, baseline_tf=_c_rows(_C_BASE, unreported=(1,))).rule == "margin_unreported"
    # a reported teacher-forced row without the speculative token: outside the top-k, not unreported
    assert _c_compare(unreported, spec_tf=None, baseline_tf=_c_rows(_C_BASE)).rule == "margin_outside_top_k"
    outside = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE)), spec_tf=None)
    assert _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE))).rule == "margin_over_threshold"  # the same from spec_tf
    assert (outside.klass, outside.rule) == ("diverged", "margin_outside_top_k")
    assert outside.reason == "position 1: spec token 7 '<7>' is outside the baseline's top-2 (baseline chose 2 '<2>')"


def test_compare_a_margin_over_the_threshold_and_one_at_it():
    over = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.5}, alts={1: 7})))
    assert (over.klass, over.rule) == ("diverged", "margin_over_threshold")
    assert over.reason == ("position 1: baseline margin 0.5 nats between '<2>' and '<7>' exceeds the near-tie "
                           "threshold 0.25")
    at = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.25}, alts={1: 7})))
    assert (at.klass, at.divergence.baseline_margin) == ("near_tie", 0.25)


def test_compare_a_near_tie_and_what_still_fails_it():
    from specparity.model.verdicts import Drift

    v = _c_compare(drift_nats=0.5)
    assert (v.klass, v.rule) == ("near_tie", "near_tie") and v.drift == Drift(0.5, 0.0, None, 0, 1)
    assert v.reason == ("position 1: '<2>' vs '<7>', baseline margin 0.125 <= threshold 0.25, re-merges at 2/2; every "
                        "later spec token is the target's argmax")
    # the streams re-align at different offsets: 4 on the baseline, 2 on the speculative run (both end on the stop)
    base, short = [1, 2, 3, 4, 5, 0], [1, 7, 5, 0]
    shifted = _c_compare(_c_stream(base, _c_rows(base, margins={1: 0.125}, alts={1: 7}), "stop"),
                         _c_stream(short, _c_rows(short, margins={1: 0.125}, alts={1: 2}), "stop"))
    assert shifted.klass == "near_tie" and ", re-merges at 4/2; every later" in shifted.reason
    # the baseline's decode row left out: the margin from its teacher-forced row
    tf_margin = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, unreported=(1,))), spec_tf=_c_rows(_C_SPEC),
                           baseline_tf=_c_rows(_C_BASE, margins={1: 0.125}, alts={1: 7}))
    assert (tf_margin.klass, tf_margin.divergence.margin_source) == ("near_tie", "teacher-forced")
    apart = [1, 7, 8, 8, 8, 8]
    no_merge = _c_compare(spec=_c_stream(apart, _c_rows(apart, margins={1: 0.125}, alts={1: 2})))
    assert no_merge.reason.endswith("<= threshold 0.25, does not re-merge; every later spec token is the target's "
                                    "argmax")
    # the speculative run's own row rejects a later token
    rejected = _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.125, 3: 1.0}, alts={1: 2},
                                                          chosen={3: 9})))
    assert (rejected.klass, rejected.rule, rejected.rejected_at) == ("diverged", "own_row_rejected", 3)
    assert rejected.reason.startswith("position 3 (first difference at position 1): the speculative run emitted 4")
    unscored = _c_compare(spec_tf=None)
    assert (unscored.klass, unscored.rule, unscored.reason) == (
        "diverged", "later_unscored",
        "position 1: near-tie flip, but the rest of the stream could not be scored teacher-forced")
    # later positions the target would not have chosen: above the threshold, or unscored; one at it is fine
    tf = _c_rows(_C_SPEC, margins={1: 0.5, 3: 0.5, 4: 0.25}, chosen={1: 2, 3: 9, 4: 9, 5: 9})
    tf.token_ids[5] = -1  # the row did not score the token: no margin
    later = _c_compare(spec_tf=tf)
    assert (later.klass, later.rule) == ("diverged", "later_not_argmax")
    assert later.reason == ("near-tie flip at 1 (margin 0.125), but at position 3 the spec token 4 is not the target's "
                            "choice 9 under its own prefix (margin 0.5 nats); 2 such position(s)")
    tf = _c_rows(_C_SPEC, margins={1: 0.5}, chosen={1: 2, 5: 9})
    tf.token_ids[5] = -1
    assert _c_compare(spec_tf=tf).reason.endswith("the spec token 6 is not the target's choice 9 under its own prefix "
                                                   "(outside the top-k); 1 such position(s)")


def test_compare_a_near_tie_after_drift_or_too_far_apart_on_the_two_sides():
    from specparity.model.verdicts import Drift

    spec_rows = _c_rows(_C_SPEC, margins={0: 3.0, 1: 0.125}, alts={1: 2})
    before = _c_compare(spec=_c_stream(_C_SPEC, spec_rows), drift_nats=0.5)
    assert (before.klass, before.rule, before.drift) == ("drifted", "drift_before_split", Drift(0.5, 1.0, 0, 1, 1))
    assert before.reason == (
        "near-tie flip at position 1 (margin 0.125), but before it the speculative run's own logprobs drift from the "
        "baseline's by up to 1 nats from position 0 (1 of 1 positions above the drift bound 0.5): the flip follows a "
        "corrupted computation, not numeric noise")
    # the split's gap: 0.125 (baseline) + 0.125 (the speculative row's own margin) = 0.25
    gap = _c_compare(drift_nats=0.125)
    assert (gap.klass, gap.rule) == ("drifted", "split_gap")
    assert gap.reason == (
        "near-tie flip at position 1 (baseline margin 0.125 <= threshold 0.25), but the speculative run's own row "
        "there prefers '<7>' by 0.125 nats: the two computations of the same position are 0.25 nats apart, beyond "
        "the drift bound 0.125 — not a tie the noise explains")
    assert _c_compare(drift_nats=0.25).klass == "near_tie"  # a gap at the bound is within it
    assert _c_compare().klass == "near_tie"  # no drift bound: no gap check
    # the baseline's token outside the speculative row: its lowest alternative bounds the gap from below
    far = _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.5})), drift_nats=0.125)
    assert "prefers '<7>' by at least 0.5 nats: the two computations of the same position are 0.625 nats" in far.reason


def test_an_exact_tie_at_the_split_says_how_each_side_broke_it():
    """Both tokens carry the same logprob on both sides: the baseline took the lower id; the speculative run
    took the higher one, as an accepted draft when its step records say so."""
    base = _stream([1, 2, 3], scores([1, 2, 3], [[1, 9], [2, 7], [3, 9]], [[-0.1, -3.0], [-0.125, -0.125], [-0.1, -3.0]]))
    spec_rows = scores([1, 7, 3], [[1, 9], [7, 2], [3, 9]], [[-0.1, -3.0], [-0.125, -0.125], [-0.1, -3.0]])
    drafted = SpecStats.from_steps([StepRecord(proposed=2, accepted=2, emitted=3)], "steps")
    d = _describe_divergence(1, base, _stream([1, 7, 3], spec_rows, drafted), _decode)
    assert d.tie is True and d.baseline_margin == 0.0 and d.spec_margin == 0.0
    assert (d.baseline_break, d.spec_break) == ("lower_id", "draft")
    plain = _describe_divergence(1, base, _stream([1, 7, 3], spec_rows), _decode)
    assert (plain.baseline_break, plain.spec_break) == ("lower_id", "higher_id")
    # no tie: no break words, and ``tie`` is a plain False
    far = _split()
    assert far.tie is False and (far.baseline_break, far.spec_break) == ("", "")


def test_the_split_shows_eight_tokens_of_context_on_each_side():
    base_ids = list(range(10, 30))
    spec_ids = base_ids[:10] + [99] + base_ids[11:]
    rows = scores(base_ids, [[t, 5] for t in base_ids], [[-0.1, -3.0]] * 20)
    d = _describe_divergence(10, _stream(base_ids, rows), _stream(spec_ids, rows), _decode)
    assert d.context_before == _decode(base_ids[2:10])
    assert d.baseline_after == _decode(base_ids[10:18]) and d.spec_after == _decode(spec_ids[10:18])
    assert d.remerge == (11, 11)
    early = _describe_divergence(3, _stream(base_ids, rows), _stream(base_ids[:3] + [99] + base_ids[4:], rows), _decode)
    assert early.context_before == "<10><11><12>"


def test_a_baseline_that_ends_at_the_split_has_no_token_there():
    base = _stream([1], _ONE_ROW)
    d = _describe_divergence(1, base, _stream([1, 5, 3], _spec_rows(5)), _decode)
    assert d.baseline_token is None and d.spec_token == TokenView(5, "<5>")
    assert (d.baseline_margin, d.spec_margin, d.tie, d.remerge, d.baseline_after) == (None, None, False, None, "")


def test_positions_at_risk_are_above_a_tie_and_at_most_the_window():
    from specparity.judge.flip_budget import at_risk, risk_mask
    from specparity.judge.resolution import TIE_NATS

    rows = _margin_rows([1, 2, 3, 4, 5], [0.0, 0.25, 0.5, 1.0, float("nan")])
    assert at_risk(rows, 0.5).tolist() == [False, True, True, False, False]
    assert at_risk(rows, 0.5, with_ties=True).tolist() == [True, True, True, False, False]
    # the tie's edges: within TIE_NATS either way is a reported tie, beyond it below is not at risk at all
    edges = np.array([-2 * TIE_NATS, -TIE_NATS, TIE_NATS, 2 * TIE_NATS, np.nan])
    assert risk_mask(edges, 0.5).tolist() == [False, False, False, True, False]
    assert risk_mask(edges, 0.5, with_ties=True).tolist() == [False, True, True, True, False]


def test_quantile_forgives_a_cumulative_sum_rounded_just_below_the_level():
    """0.7 + 0.1 sums to 0.7999999999999999 in floating point: P(K <= 1) is 0.8, so the 0.8 quantile is 1."""
    from specparity.judge.flip_budget import quantile

    assert 0.7 + 0.1 < 0.8
    assert quantile(np.array([0.7, 0.1, 0.2]), 0.8) == 1
    assert quantile(np.array([0.25, 0.5, 0.25]), 0.75) == 1 and quantile(np.array([0.25, 0.5, 0.25]), 0.76) == 2


def test_position_deltas_of_no_rows_and_of_one_row():
    from specparity.judge.noise import position_deltas

    a = scores([1], [[1, 5]], [[-0.5, -1.0]])
    b = scores([1], [[1, 5]], [[-0.5, -1.25]])
    assert position_deltas(a, b).tolist() == [0.25]
    empty = position_deltas(a, TokenScores.empty(2))
    assert empty.dtype == np.float32 and empty.shape == (0,)


def test_noise_figures_are_float32_whatever_the_input():
    """Empty or not, both figures come back as float32 arrays, so a measurement concatenating an empty pair with
    real ones keeps the float32 arithmetic of its quantiles."""
    from specparity.judge.noise import abs_deltas_with_margins, position_deltas

    a = scores([1, 2], [[1, 5], [2, 5]], [[-0.5, -1.0], [-0.25, -2.25]])
    b = scores([1, 2], [[1, 5], [2, 5]], [[-0.5, -1.25], [-0.25, -2.0]])
    for d, m in (abs_deltas_with_margins(a, b), abs_deltas_with_margins(a, TokenScores.empty(2))):
        assert d.dtype == np.float32 and m.dtype == np.float32 and len(d) == len(m)
    assert len(abs_deltas_with_margins(a, TokenScores.empty(2))[1]) == 0
    assert position_deltas(a, b).dtype == np.float32
    # rows without any alternative: no pair at any position, NaN each, and no error
    bare = TokenScores(np.array([1, 2]), np.array([-0.5, -0.25]), np.zeros((2, 0)), np.zeros((2, 0)))
    assert np.isnan(position_deltas(bare, bare)).tolist() == [True, True]


def test_the_robust_figure_is_the_third_largest_from_fifty_values_on():
    from specparity.judge.noise import robust_figure
    from specparity.model.threshold import MIN_NEAR_PAIRS, ROBUST_RANK

    assert (MIN_NEAR_PAIRS, ROBUST_RANK) == (50, 3)
    values = np.arange(1, 51, dtype=np.float32)[::-1].copy()  # 50 .. 1, largest first
    assert robust_figure(values) == 48.0
    assert robust_figure(values[:49]) == 50.0  # 49 values: too few for an order statistic, the maximum
    assert robust_figure(np.concatenate([values, [0.5]]).astype(np.float32)) == 48.0
    assert robust_figure(np.zeros(0, np.float32)) == 0.0


# --- the checks a report shows for a verdict (judge/checks.py) --------------------------------------------------

def _checks_cases():
    """Verdicts compare() gives for the streams above, one per branch of verdict_checks."""
    from specparity.model.verdicts import TFViolation

    base = _c_stream(_C_BASE, _c_rows(_C_BASE))
    ids_stop = [1, 2, 3, 4, 5, 0]
    tie_base = _c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.0}, alts={1: 7}))
    tie_spec = _c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.0}, alts={1: 2}))
    later_tf = _c_rows(_C_SPEC, margins={1: 0.5, 3: 0.5}, chosen={1: 2, 3: 9})
    within_tf = _c_rows(_C_SPEC, margins={1: 0.5, 3: 0.25, 4: 0.0625}, chosen={1: 2, 3: 9, 4: 9})
    unscored_tf = _c_rows(_C_SPEC, margins={1: 0.5}, chosen={1: 2, 5: 9})
    unscored_tf.token_ids[5] = -1
    cases = {
        "exact": _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE)), _c_rows(_C_BASE), drift_nats=0.5),
        "exact-undrifted-unreported": _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE, unreported=range(6))),
                                                 _c_rows(_C_BASE), drift_nats=0.5),
        "exact-no-drift-bound": _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE)), _c_rows(_C_BASE)),
        "finish-mismatch": _c_compare(_c_stream(ids_stop, _c_rows(ids_stop)), _c_stream(ids_stop, _c_rows(ids_stop), "stop")),
        "own-row-identical": _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE, margins={2: 1.0}, chosen={2: 9}))),
        "drift-identical": _c_compare(base, _c_stream(_C_BASE, _c_rows(_C_BASE, margins={3: 3.0})), drift_nats=0.5),
        "stream-problem": _c_compare(spec=_c_stream([1, 0, 3, 4, 5, 6], _c_rows([1, 0, 3, 4, 5, 6]))),
        "margin-unreported": _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, unreported=(1,))), spec_tf=None),
        "margin-outside": _c_compare(base, spec_tf=None),
        "margin-over": _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.5}, alts={1: 7}))),
        "near-tie": _c_compare(drift_nats=0.5),
        "near-tie-no-merge": _c_compare(spec=_c_stream([1, 7, 8, 8, 8, 8], _c_rows([1, 7, 8, 8, 8, 8], margins={1: 0.125},
                                                                                 alts={1: 2}))),
        "near-tie-spec-row-without-baseline-token": _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC))),
        "exact-tie": _c_compare(tie_base, tie_spec, drift_nats=0.5),
        "later-over": _c_compare(spec_tf=later_tf),
        "later-within": _c_compare(spec_tf=within_tf),
        "later-outside-top-k": _c_compare(spec_tf=unscored_tf),
        "later-unscored": _c_compare(spec_tf=None),
        "drift-before-split": _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={0: 3.0, 1: 0.125}, alts={1: 2})),
                                         drift_nats=0.5),
        "split-gap": _c_compare(drift_nats=0.125),
        "own-row-at-split": _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.125}, chosen={1: 2}))),
        "own-row-later": _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.125, 3: 1.0}, alts={1: 2},
                                                                   chosen={3: 9}))),
        "error": _c_compare(_c_stream([], TokenScores.empty(2), error="boom")),
    }
    cases["margin-at-threshold"] = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.25}, alts={1: 7})))
    cases["margin-huge"] = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 800.0}, alts={1: 7})))
    cases["exact-tie-at-zero-threshold"] = _c_compare(tie_base, tie_spec, threshold=0.0)
    cases["near-tie-gap-at-bound"] = _c_compare(drift_nats=0.25)
    end_ids = [1, 2, 3, 4, 5, 7]
    cases["near-tie-at-the-end"] = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={5: 0.125}, alts={5: 7})),
                                              _c_stream(end_ids, _c_rows(end_ids, margins={5: 0.125}, alts={5: 6})),
                                              _c_rows(end_ids, margins={5: 0.125}, chosen={5: 6}))
    # verdicts made elsewhere (journalled, or by hand): the fields alone decide the checks
    ulps = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE, margins={1: 0.25}, alts={1: 7})))
    ulps.divergence.ulp_nats = 0.125
    cases["near-tie-two-ulps"] = ulps
    one_ulp = _c_compare()
    one_ulp.divergence.ulp_nats = 0.125
    cases["near-tie-one-ulp"] = one_ulp
    odd_breaks = _c_compare(tie_base, tie_spec)
    odd_breaks.divergence.baseline_break, odd_breaks.divergence.spec_break = "by_hand", "elsewhere"
    cases["exact-tie-unknown-break-words"] = odd_breaks
    for name, spec_token, base_token in (("length-spec-ended", None, "keep"), ("length-baseline-ended", "keep", None)):
        v = _c_compare()
        v.klass, v.rule = "diverged", "length_mismatch"
        if spec_token is None:
            v.divergence.spec_token = None
        if base_token is None:
            v.divergence.baseline_token = None
        cases[name] = v
    unexplained = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE)), spec_tf=None)
    unexplained.rule = ""
    cases["margin-unknown-unexplained"] = unexplained
    explained_not_diverged = _c_compare(_c_stream(_C_BASE, _c_rows(_C_BASE)), spec_tf=None)
    explained_not_diverged.klass = "drifted"
    cases["margin-unknown-explained-drifted"] = explained_not_diverged
    rank_only = _c_compare()
    rank_only.divergence.spec_margin = None
    cases["spec-margin-unknown-rank-known"] = rank_only
    for name, sm in (("own-row-at-split-spec-prefers-its-token", 0.5), ("own-row-at-split-spec-tie", 0.0)):
        v = _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.125}, chosen={1: 2})))
        v.divergence.spec_margin = sm
        cases[name] = v
    later_no_margin = _c_compare(spec=_c_stream(_C_SPEC, _c_rows(_C_SPEC, margins={1: 0.125, 3: 1.0}, alts={1: 2},
                                                                 chosen={3: 9})))
    later_no_margin.divergence.spec_margin = None
    cases["own-row-later-spec-margin-unknown"] = later_no_margin
    near_unscored = _c_compare()
    near_unscored.later_scored, near_unscored.tf_violations = False, []
    cases["near-tie-later-not-scored"] = near_unscored
    # a verdict journalled before the rule was recorded: a near tie whose split sits beyond its drift bound
    gap = _c_compare(drift_nats=0.125)
    gap.klass, gap.rule = "near_tie", ""
    cases["near-tie-beyond-bound"] = gap
    later = _c_compare(spec_tf=None)
    later.tf_violations, later.later_scored, later.klass, later.rule = [TFViolation(3, 4, 9, 0.125)], False, "diverged", ""
    cases["later-not-in-record"] = later
    empty = _c_compare(spec_tf=None)
    empty.later_scored, empty.klass, empty.rule = False, "diverged", ""
    cases["later-not-scored-diverged"] = empty
    return cases




@pytest.mark.parametrize("noise", ["measured", "none"])
def test_verdict_checks_wording(noise, snapshot):
    """Every check of every branch, with its state, words, position and figures, with and without the run's
    measured noise (the snapshot pins the wording; ``pytest --snapshot-update`` after a deliberate change)."""
    from dataclasses import asdict

    from specparity.judge.checks import verdict_checks
    from specparity.model.threshold import NoiseStats

    # flip noise 0.125: a margin of 0.125 is inside it, one of 0.25 is not
    measured = NoiseStats(0.5, 0.25, 100, 400, near_window=2.0, near_pairs=60, near_max_abs_delta=0.25,
                          near_robust_abs_delta=0.125, robust_abs_delta=0.375) if noise == "measured" else None
    got = {name: [asdict(c) for c in verdict_checks(v, noise=measured)] for name, v in _checks_cases().items()}
    got["never-judged"] = [asdict(c) for c in verdict_checks(None, noise=measured)]
    assert got == snapshot


def test_check_marks_and_token_words():
    from specparity.judge.checks import Check, rank_words, source_words, token_shown

    assert [(Check(s, "t").mark, Check(s, "t").symbol) for s in ("ok", "fail", "warn", "info")] == [
        ("✅", "✓"), ("❌", "✗"), ("⚠️", "!"), ("ℹ️", "i")]
    assert token_shown(None) == "(end of stream)" and token_shown("") == "∅ (decodes to nothing)"
    assert token_shown(" a\r\tb\n") == "·a␍⇥b⏎"
    assert source_words("decode") == "the baseline's own decode row"
    assert source_words("teacher-forced") == "teacher-forced scoring of the baseline"
    assert source_words("elsewhere") == "elsewhere"
    assert rank_words(None) == "outside top-k" and rank_words(0) == "0"


# --- the scorer check's evidence (judge/calibration.py) ---------------------------------------------------------

def test_scorer_check_evidence_words_a_shift_only_when_most_disagreements_are_one():
    from specparity.judge.calibration import ScorerCheck

    later = ScorerCheck(10, 4, 3, 0, 2, 2.0, first="p position 3")
    assert later.evidence() == (
        "2 row(s) score a token other than the baseline's; its argmax differs from the baseline's token at 4 of 10 "
        "positions where the baseline's own margin exceeds 2 nats; at 3 of them its argmax is the baseline's next "
        "token: it looks shifted by one position (first: p position 3)")
    earlier = ScorerCheck(10, 4, 1, 3, 0, 2.0)
    assert earlier.evidence().endswith("at 3 of them its argmax is the baseline's previous token: it looks shifted by "
                                       "one position")
    # a tie between the two directions reads as the next token; exactly half is no shift
    assert "baseline's next token" in ScorerCheck(10, 3, 2, 2, 0, 2.0).evidence()
    assert ScorerCheck(10, 4, 2, 1, 0, 2.0).evidence() == (
        "its argmax differs from the baseline's token at 4 of 10 positions where the baseline's own margin exceeds "
        "2 nats")
    assert ScorerCheck(10, 0, 0, 0, 0, 2.0).evidence() == ""


def test_largest_at_names_the_first_prompt_and_position_of_the_largest_cross_instance_difference():
    from specparity.judge.calibration import Sample, largest_at

    tf = scores([1, 2], [[1, 5], [2, 5]], [[-0.5, -1.0], [-0.5, -1.0]])
    moved_at_1 = scores([1, 2], [[1, 5], [2, 5]], [[-0.5, -1.25], [-0.5, -1.5]])  # 0.25, then 0.5
    moved_at_0 = scores([1, 2], [[1, 5], [2, 5]], [[-0.5, -1.5], [-0.5, -1.0]])  # 0.5 at 0: a tie, not larger
    one_instance = Sample("solo", [1, 2], tf, tf)
    samples = [one_instance, Sample("a", [1, 2], tf, tf, moved_at_1), Sample("b", [1, 2], tf, tf, moved_at_0)]
    assert largest_at(samples) == "a position 1"
    assert largest_at([one_instance]) is None and largest_at([]) is None


# --- other traffic on the server (judge/traffic.py) -------------------------------------------------------------

def test_unattributed_traffic_words():
    from specparity.judge.traffic import OTHER_TRAFFIC, unattributed
    from specparity.model.traffic import Traffic

    no_counts = (f"{OTHER_TRAFFIC} cannot be ruled out: the engine's run-wide draft counters come without the "
                 "servers' count of finished requests and generated tokens")
    reading = Traffic(10, 100, 2, 20, "before-src")
    assert unattributed(None, reading) == no_counts and unattributed(reading, None) == no_counts
    assert unattributed(Traffic(None, None, 0, 0, "before-src"), Traffic(None, None, 1, 5, "")) == (
        f"{OTHER_TRAFFIC} cannot be ruled out: the servers do not expose their count of finished requests and "
        f"generated tokens (before-src)")
    assert unattributed(reading, Traffic(12, 130, 4, 50, "after-src")) is None
    assert unattributed(reading, Traffic(13, 130, 4, 50, "after-src")) == (
        f"{OTHER_TRAFFIC}: during the speculative phase the speculative servers finished 3 request(s) and generated "
        f"30 token(s), this run sent them 2 and got 30 back (after-src); their draft counters may count another "
        f"client's drafts, so they say nothing about this run's")


# --- findings about the gate's own measurement (gate/calibration_findings.py) -----------------------------------

def test_calibration_findings_each_line_and_when_there_is_none():
    from types import SimpleNamespace

    from specparity.gate.calibration_findings import calibration_findings, findings_fail
    from specparity.model.gate_run import GatePolicy
    from specparity.model.threshold import NearTieThreshold, NoiseStats

    def run(threshold, scorer_check=None, calibration_error=None, golden_error=None):
        return SimpleNamespace(threshold=threshold, scorer_check=scorer_check, calibration_error=calibration_error,
                               golden_error=golden_error)

    beyond = NearTieThreshold(0.1875, "measured", _near_noise(), 1.5, cross=_cross_noise())
    unmeasured = NearTieThreshold(0.5, "override", NoiseStats(0.0, 0.0, 3, 0), 1.5)
    no_noise = (
        "no noise measured: the near-tie threshold 0.5 nats was set by --near-tie-nats and no baseline position was "
        "scored both ways, so the latent-drift check is off (identical tokens whose speculative rows moved are not "
        "judged) and the near-tie budget has no flip rate to follow; fix the baseline's decode or its teacher-forced "
        "scoring so the noise can be measured")
    idle = ("scorer check with nothing to check: no baseline position had a decode margin above 2 nats (the near-tie "
            "ceiling), so a teacher-forced scorer off by one position or scoring another model would not have been "
            "caught, and its noise set the threshold; calibrate on prompts with confident positions, or lower "
            "--near-tie-ceiling")
    assert calibration_findings(run(beyond, {"clear_positions": 0, "clear_nats": 2.0})) == [
        f"finding: {beyond.cross_finding()}", idle]
    assert calibration_findings(run(unmeasured)) == [no_noise]
    assert calibration_findings(run(NearTieThreshold(0.5, "override", None, 1.5), {"clear_positions": 3})) == [
        no_noise]
    assert calibration_findings(run(unmeasured, {})) == [no_noise, idle.replace("above 2 nats", "above 0 nats")]
    # not calibrated at all: a failure of its own, no finding
    for failed in (run(None), run(unmeasured, calibration_error="x"), run(unmeasured, golden_error="y")):
        assert calibration_findings(failed) == []
    assert findings_fail(GatePolicy(calibration_findings="fail")) == 'the policy\'s calibration_findings = "fail"'
    assert findings_fail(GatePolicy(bit_exact=True)) == "--bit-exact (or near_tie in the policy's fail_on)"
    assert findings_fail(GatePolicy()) is None and findings_fail(GatePolicy(bit_exact=False)) is None


# --- the baseline is what it claims (judge/baseline_checks.py) --------------------------------------------------

def test_baseline_refusals_show_the_tokens_decoded():
    from types import SimpleNamespace

    from specparity.judge.baseline_checks import baseline_refusal, greedy_refusal

    def record(pid, baseline):
        return SimpleNamespace(prompt=SimpleNamespace(id=pid), baseline=baseline,
                               request=SimpleNamespace(max_new_tokens=6, stop_token_ids=[0]))

    sampled = record("p", _c_stream(_C_BASE, _c_rows(_C_BASE, margins={2: 1.0}, chosen={2: 9})))
    words = greedy_refusal([sampled], 0.25, _decode)
    assert "(first p position 2: emitted 3 '<3>', its row prefers 9 '<9>' by 1 nats)" in words
    assert "(first p position 2: emitted 3, its row prefers 9 by 1 nats)" in greedy_refusal([sampled], 0.25)
    assert baseline_refusal([sampled], 0.25, _decode) == words and baseline_refusal([sampled], None) is None
    off_rule = record("q", _c_stream([1, 2, 3], _c_rows([1, 2, 3]), "stop"))
    assert "it ends with token 3 '<3>'" in baseline_refusal([off_rule, sampled], 0.25, _decode)


def test_a_baseline_past_the_token_limit_is_blamed_on_the_limit_not_the_stop_set():
    from types import SimpleNamespace

    from specparity.judge.baseline_checks import stop_rule_refusal

    long = SimpleNamespace(prompt=SimpleNamespace(id="p"), baseline=_c_stream(_C_BASE + [7], _c_rows(_C_BASE + [7])),
                           request=SimpleNamespace(max_new_tokens=6, stop_token_ids=[0]))
    words = stop_rule_refusal([long])
    assert "first p: emitted 7 tokens, more than max_new_tokens=6" in words
    assert words.endswith("the engine did not honour the token limit the run asked for (it stopped short of it or ran "
                          "past it): check the server's own cap on new tokens and its context size against "
                          "--max-new-tokens")


# --- acceptance of two runs: the interval, the tables and their words (judge/acceptance.py) ------------------

def test_acceptance_wilson_matches_its_formula_at_any_level_and_clamps_to_one():
    import math
    from statistics import NormalDist

    from specparity.judge.acceptance import wilson as acceptance_wilson

    def reference(k, n, level=0.95):
        z = NormalDist().inv_cdf(1 - (1 - level) / 2)
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        return centre - half, centre + half

    for k, n in ((3, 10), (1, 1), (0, 1), (7, 9), (1, 2)):
        assert acceptance_wilson(k, n) == pytest.approx(reference(k, n), rel=1e-12), (k, n)
    assert acceptance_wilson(3, 10, 0.9) == pytest.approx(reference(3, 10, 0.9), rel=1e-12)
    assert acceptance_wilson(3, 10, 0.9) == pytest.approx((0.12687658390319792, 0.5583002041301648), rel=1e-12)
    # 9/9 rounds to just above 1 before the clamp
    assert reference(9, 9)[1] > 1.0 and acceptance_wilson(9, 9) == (pytest.approx(reference(9, 9)[0]), 1.0)
    assert acceptance_wilson(0, 0) is None and acceptance_wilson(0, -1) is None


def _comparison(**kw):
    from specparity.judge.acceptance import ACCEPT_LENGTH, Comparison, PositionRow, Row

    rows = [Row("chat", 1, 2.0, 1.5),  # one prompt: no interval
            Row("code", 3, 3.25, 3.0, -0.5, 0.125),  # an interval, too few prompts to judge
            Row("math", 5, None, 2.0, None, None),  # the old run has no figure
            Row("all", 9, 2.875, 2.5, -0.75, -0.0625, failed=True)]
    base = dict(metric=ACCEPT_LENGTH, old_label="v1", new_label="v2", rows=rows, clean=rows, flagged={},
                positions=[PositionRow(0, (8, 6), (8, 4)), PositionRow(1, None, (4, 1))])
    base.update(kw)
    return Comparison(**base)


_TABLE = ["| category | prompts | OLD | NEW | Δ (NEW − OLD) | 95% interval of Δ | |",
          "|---|---:|---:|---:|---:|---|---|",
          "| chat | 1 | 2.000 | 1.500 | -0.500 | n/a (fewer than 2 prompts) |  |",
          "| code | 3 | 3.250 | 3.000 | -0.250 | [-0.500, +0.125] (not judged: fewer than 5 prompts) |  |",
          "| math | 5 | n/a | 2.000 | n/a | n/a (fewer than 2 prompts) |  |",
          "| all | 9 | 2.875 | 2.500 | -0.375 | [-0.750, -0.062] | **beyond** |"]


def test_acceptance_lines_word_every_row_kind_and_the_positions():
    from specparity.judge.acceptance import _rate, lines

    assert lines(_comparison(rule="accept length may drop by at most 0.25", notes=["2 prompt(s) left out"])) == [
        "acceptance — mean accept length (tokens per verify step, bonus included); OLD = v1, NEW = v2",
        "interval: 95% paired bootstrap over prompts (2000 resamples, seed 0); rows of fewer than 5 prompts are "
        "shown, not judged",
        "rule: accept length may drop by at most 0.25", "2 prompt(s) left out", "", "with every prompt:",
        *_TABLE, "no prompt flagged as a repetition loop or a recited prompt", "",
        "per draft position (accepted / proposed at that position, 95% Wilson interval):",
        "| position | OLD | NEW |", "|---:|---|---|",
        f"| 0 | {_rate((8, 6))} | {_rate((8, 4))} |", f"| 1 | n/a | {_rate((4, 1))} |"]
    assert _rate((8, 6)).startswith("0.750 [") and _rate((4, 1)).endswith("(1/4)")


def test_acceptance_lines_with_flagged_prompts_unknown_positions_and_nothing_recorded():
    from specparity.judge.acceptance import ACCEPT_RATE, Row, lines

    clean = [Row("code", 5, 0.5, 0.25, -0.5, 0.0), Row("all", 2, 0.5, 0.25, -0.5, 0.0)]
    c = _comparison(metric=ACCEPT_RATE, clean=clean, flagged={"p3": "a repetition loop"}, positions=None,
                    positions_note="positions unknown: neither run has per-step records")
    assert lines(c, "A", "B") == [
        "acceptance — acceptance rate (accepted / proposed draft tokens); A = v1, B = v2",
        "interval: 95% paired bootstrap over prompts (2000 resamples, seed 0); rows of fewer than 5 prompts are "
        "shown, not judged", "", "with every prompt:",
        *[line.replace("OLD", "A").replace("NEW", "B") for line in _TABLE], "",
        "without the 1 flagged prompt(s) (the rule is applied to this table):",
        "| category | prompts | A | B | Δ (B − A) | 95% interval of Δ | |", "|---|---:|---:|---:|---:|---|---|",
        "| code | 5 | 0.500 | 0.250 | -0.250 | [-0.500, +0.000] |  |",
        "| all | 2 | 0.500 | 0.250 | -0.250 | [-0.500, +0.000] (not judged: fewer than 5 prompts) |  |", "",
        "flagged prompts (measurement artefacts):", "- p3: a repetition loop", "",
        "positions unknown: neither run has per-step records"]
    every = lines(_comparison(clean=[], flagged={"p1": "x", "p2": "y"}))
    assert "every one of the 2 prompts is flagged: the rule is applied with them" in every
    assert every[every.index("every one of the 2 prompts is flagged: the rule is applied with them") + 1] == ""
    noted = lines(_comparison(positions_note="positions unknown for v1 (the engine reports totals only)"))
    assert noted[-1] == "positions unknown for v1 (the engine reports totals only)"
    assert lines(_comparison(not_recorded="acceptance not recorded — v1: old", notes=["n"])) == [
        "acceptance: acceptance not recorded — v1: old", "n"]


# --- the policy file: every refusal word for word, the edges it accepts, merge (gate/policy_file.py) --------

_POLICY_KEYS = ("fail_on, max_near_tie, min_accept_length, max_accept_drop, require_all_paths, allow_unknown_activity, "
                "calibration_findings, allow_unknown")
_PROBES = ("lm-head, draft-fp8-scales, dflash2-format, mamba-slots, mamba-exhaustion, first-decode, acceptance-floor, "
           "mamba-stress, self-draft")


@pytest.mark.parametrize("text, expected", [
    ("", "{p}:1: expected one table [gate] with keys " + _POLICY_KEYS),
    ("gate = 1\n", "{p}:1: expected one table [gate] with keys " + _POLICY_KEYS),
    ("[gates]\nmax_near_tie = 0.1\n", "{p}:1: expected one table [gate] with keys " + _POLICY_KEYS + "; unknown gates"),
    ("\nextra = 1\nalso = 2\n[gate]\n", "{p}:3: expected one table [gate] with keys " + _POLICY_KEYS + "; unknown also, extra"),
    ("[gate]\n[more]\n", "{p}:1: expected one table [gate] with keys " + _POLICY_KEYS + "; unknown more"),
    ("[gate]\n\n min_acceptance = 1\n", "{p}:3: min_acceptance: unknown key; expected one of " + _POLICY_KEYS),
    ("[gate]\nfail_on = ['diverged', 'error', 'exact']\n",
     "{p}:2: fail_on: expected a list of classes among near_tie, drifted, diverged, error, got ['diverged', 'error', 'exact']"),
    ("[gate]\nfail_on = 'diverged'\n",
     "{p}:2: fail_on: expected a list of classes among near_tie, drifted, diverged, error, got 'diverged'"),
    ("[gate]\nfail_on = ['error', 'near_tie']\n",
     "{p}:2: fail_on: expected a list that includes diverged and error (they always fail: a policy cannot make a real "
     "bug pass), got ['error', 'near_tie']"),
    ("[gate]\nmax_near_tie = true\n", "{p}:2: max_near_tie: expected a fraction in [0, 1], got True"),
    ("[gate]\nmax_near_tie = '0.1'\n", "{p}:2: max_near_tie: expected a fraction in [0, 1], got '0.1'"),
    ("[gate]\nmax_near_tie = -0.5\n", "{p}:2: max_near_tie: expected a fraction in [0, 1], got -0.5"),
    ("[gate]\nmin_accept_length = -1\n", "{p}:2: min_accept_length: expected a number >= 0 (tokens per verify step), got -1"),
    ("[gate]\nmin_accept_length = true\n",
     "{p}:2: min_accept_length: expected a number >= 0 (tokens per verify step), got True"),
    ("[gate]\nmin_accept_length = 'x'\n",
     "{p}:2: min_accept_length: expected a number >= 0 (tokens per verify step), got 'x'"),
    ("[gate]\nmax_accept_drop = inf\n", "{p}:2: max_accept_drop: expected a number >= 0 (tokens per verify step), got inf"),
    ("[gate]\nmax_accept_drop = -0.1\n",
     "{p}:2: max_accept_drop: expected a number >= 0 (tokens per verify step), got -0.1"),
    ("[gate]\nmax_accept_drop = false\n",
     "{p}:2: max_accept_drop: expected a number >= 0 (tokens per verify step), got False"),
    ("[gate]\nmax_accept_drop = '1'\n", "{p}:2: max_accept_drop: expected a number >= 0 (tokens per verify step), got '1'"),
    ("[gate]\nrequire_all_paths = true\n", "{p}:2: require_all_paths: expected an integer >= 0, got True"),
    ("[gate]\nrequire_all_paths = 1.5\n", "{p}:2: require_all_paths: expected an integer >= 0, got 1.5"),
    ("[gate]\nrequire_all_paths = -1\n", "{p}:2: require_all_paths: expected an integer >= 0, got -1"),
    ("[gate]\nallow_unknown_activity = 'yes'\n", "{p}:2: allow_unknown_activity: expected true or false, got 'yes'"),
    ("[gate]\ncalibration_findings = 'error'\n",
     "{p}:2: calibration_findings: expected one of 'warn', 'fail', got 'error'"),
    ("[gate]\nallow_unknown = 'mamba-slots'\n",
     "{p}:2: allow_unknown: expected a list of probe names among " + _PROBES + ", got 'mamba-slots'"),
    ("[gate]\nallow_unknown = ['mamba-slots', 'no-such-probe']\n",
     "{p}:2: allow_unknown: expected a list of probe names among " + _PROBES + ", got ['mamba-slots', 'no-such-probe']"),
    ("[gate]\nallow_unknown = ['mamba-slots', 3]\n",
     "{p}:2: allow_unknown: expected a list of probe names among " + _PROBES + ", got ['mamba-slots', 3]"),
])
def test_policy_file_refusals_word_for_word(tmp_path, text, expected):
    from specparity.gate.policy_file import PolicyError, load_policy

    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value) == expected.format(p=path)


def test_policy_file_that_cannot_be_read_or_parsed(tmp_path):
    from specparity.gate.policy_file import PolicyError, load_policy, where

    missing = tmp_path / "none.toml"
    with pytest.raises(PolicyError) as err:
        load_policy(missing)
    assert str(err.value) == f"--policy {missing}: cannot read the policy file (No such file or directory)"
    assert where(missing, "fail_on") == str(missing)
    bad = tmp_path / "bad.toml"
    bad.write_text("[gate\n")
    with pytest.raises(PolicyError) as err:
        load_policy(bad)
    assert str(err.value).startswith(f"{bad}: not TOML: ") and len(str(err.value)) > len(f"{bad}: not TOML: ")
    good = tmp_path / "good.toml"
    good.write_text("[gate]\n\n  max_near_tie = 0.5\nfail_on=['diverged','error']\n")
    assert where(good, "max_near_tie") == f"{good}:3" and where(good, "fail_on") == f"{good}:4"
    assert where(good, "near_tie") == f"{good}:1"  # no line sets the key: line 1


def test_policy_file_accepts_each_range_up_to_its_edges(tmp_path):
    from specparity.gate.policy_file import load_policy

    path = tmp_path / "policy.toml"
    path.write_text("[gate]\nfail_on = ['error', 'diverged']\nmax_near_tie = 0\nmin_accept_length = 0\n"
                    "max_accept_drop = 0\nrequire_all_paths = 0\nallow_unknown_activity = false\n"
                    "calibration_findings = 'fail'\nallow_unknown = []\n")
    got = load_policy(path)
    assert got == {"drift_policy": "warn", "max_near_tie": 0.0, "min_accept_length": 0.0, "max_accept_drop": 0.0,
                   "require_all_paths": 0, "allow_unknown_activity": False, "calibration_findings": "fail",
                   "allow_unknown": ()}
    assert all(type(got[k]) is float for k in ("max_near_tie", "min_accept_length", "max_accept_drop"))
    path.write_text("[gate]\nfail_on = ['error', 'diverged', 'drifted']\nmax_near_tie = 1\nmin_accept_length = 0.5\n"
                    "max_accept_drop = 3\nrequire_all_paths = 2\nallow_unknown_activity = true\n"
                    "calibration_findings = 'warn'\nallow_unknown = ['self-draft', 'lm-head']\n")
    got = load_policy(path)
    assert got == {"drift_policy": "fail", "max_near_tie": 1.0, "min_accept_length": 0.5, "max_accept_drop": 3.0,
                   "require_all_paths": 2, "allow_unknown_activity": True, "calibration_findings": "warn",
                   "allow_unknown": ("self-draft", "lm-head")}
    assert type(got["max_near_tie"]) is float and type(got["max_accept_drop"]) is float
    path.write_text("[gate]\n")
    assert load_policy(path) == {}


def test_policy_merge_fills_only_unset_options_and_allow_near_tie_keeps_bit_exact_off():
    from specparity.gate.policy_file import merge

    policy = {"bit_exact": True, "max_near_tie": 0.2, "drift_policy": "warn", "calibration_findings": "fail"}
    assert merge({"allow_near_tie": True, "max_near_tie": None, "drift_policy": ""}, policy) == {
        "allow_near_tie": True, "max_near_tie": 0.2, "drift_policy": "warn", "calibration_findings": "fail"}
    assert merge({"bit_exact": False, "max_near_tie": 0.5, "drift_policy": "fail"}, policy) == {
        "bit_exact": True, "max_near_tie": 0.5, "drift_policy": "fail", "calibration_findings": "fail"}
    assert merge({"allow_near_tie": False}, policy)["bit_exact"] is True
    raw = {"require_all_paths": 0, "allow_unknown_activity": True}
    assert merge(raw, {"require_all_paths": 3, "allow_unknown_activity": False}) == {
        "require_all_paths": 3, "allow_unknown_activity": True}
    assert raw == {"require_all_paths": 0, "allow_unknown_activity": True}  # the raw values are not changed


# --- the logprob channel's words (judge/logprob_channel.py) --------------------------------------------------

def test_a_row_sum_is_shown_as_a_sum_below_e_to_the_700_and_as_a_log_sum_from_there():
    import math

    from specparity.judge.logprob_channel import _sum_text

    assert _sum_text(0.6931471805599453) == "sum 2"
    assert _sum_text(699.0) == f"sum {math.exp(699.0):.3g}" == "sum 3.73e+303"
    assert _sum_text(700.0) == "log-sum 700" and _sum_text(700.5) == "log-sum 700"
    assert _sum_text(1000.0) == "log-sum 1e+03" and _sum_text(math.inf) == "log-sum inf"


def _lp_rows(ids, lps):
    top_ids = np.asarray(ids, np.int64)
    top_lp = np.asarray(lps, np.float32)
    return TokenScores(np.maximum(top_ids[:, 0], 0), top_lp[:, 0].copy(), top_ids, top_lp)


def test_stream_problem_counts_reported_rows_and_names_the_first_over_the_tolerance():
    from specparity.judge.logprob_channel import stream_problem

    nan = float("nan")
    s = _lp_rows([[1, 2, 3], [-1, -1, -1], [4, 5, -1], [6, 7, 8], [4, -1, -1], [1, 2, 3], [9, -1, -1]],
                 [[-0.1, -2.5, -3.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.5, -1.0, nan], [0.0, 0.0, -np.inf],
                  [0.0, 0.0, 0.0], [0.25, 5.0, 5.0]])
    assert stream_problem(s, "decode rows") == (
        "the engine's decode rows are not log-probabilities: the probabilities of a row's reported alternatives sum "
        "to more than 1 at 2 of 6 row(s) (first at position 2: sum 2): margins taken from them mean nothing")
    zeros = _lp_rows([[1, 2], [3, 4], [5, -1]], [[-1.0, -2.0], [0.0, 0.0], [0.0, 7.0]])
    zeros.top_logprobs[0] = [0.0, -np.inf]
    assert stream_problem(zeros, "rows") == (
        "the engine's rows are not log-probabilities: the probabilities of a row's reported alternatives sum to more "
        "than 1 at 1 of 3 row(s) (first at position 1: sum 2); every reported logprob is 0.0: margins taken from "
        "them mean nothing")
    huge = _lp_rows([[1, 2], [3, 4]], [[-1.0, -2.0], [800.0, 1.0]])
    assert "(first at position 1: log-sum 800)" in stream_problem(huge, "rows")
    assert stream_problem(_lp_rows([[1, -1]], [[0.25, 3.0]]), "rows") is None  # exactly the tolerance
    assert stream_problem(_lp_rows([[1, 2]], [[0.25, -9.0]]), "rows") is not None  # just past it
    empty = TokenScores(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, 2), np.int64),
                        np.zeros((0, 2), np.float32))
    assert stream_problem(empty, "rows") is None
    assert stream_problem(_lp_rows([[-1, -1]], [[0.0, 0.0]]), "rows") is None


def test_channel_problem_needs_32_rows_cuts_rows_to_the_narrowest_and_words_both_findings():
    from specparity.judge.logprob_channel import MIN_CHANNEL_ROWS, channel_problem

    assert MIN_CHANNEL_ROWS == 32
    row5 = [-0.125, -2.5, -3.25, -4.0, -5.5]
    wide = _lp_rows([[1, 2, 3, 4, 5]] * 20, [row5] * 20)
    narrow = _lp_rows([[1, 2, 3]] * 12, [row5[:3]] * 12)
    unreported = _lp_rows([[-1, -1, -1]] * 40, [[0.0] * 3] * 40)
    empty = TokenScores(np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, 3), np.int64),
                        np.zeros((0, 3), np.float32))
    assert channel_problem([wide, narrow, unreported, empty], "decode rows") == (
        "every row of the engine's decode rows is the same (32 rows, first -0.125, -2.5, -3.25): not a model's logprobs")
    assert channel_problem([wide, _lp_rows([[1, 2, 3, 4, 5]] * 12, [row5] * 12)], "rows") == (
        "every row of the engine's rows is the same (32 rows, first -0.125, -2.5, -3.25, -4, …): not a model's logprobs")
    assert channel_problem([_lp_rows([[1, 2, 3, 4]] * 32, [row5[:4]] * 32)], "rows").endswith(
        "first -0.125, -2.5, -3.25, -4): not a model's logprobs")
    assert channel_problem([wide, unreported], "rows") is None  # 20 reported rows: too few
    assert channel_problem([wide, _lp_rows([[1, 2, 3, 4, 5]] * 11, [row5] * 11)], "rows") is None
    assert channel_problem([], "rows") is None
    # the narrow stream's rows differ from the wide one's only past its width: the cut rows are all the same
    other = _lp_rows([[1, 2, 3]] * 12, [row5[:2] + [-9.0]] * 12)
    assert channel_problem([wide, other], "rows") is None
    zeros = _lp_rows([[7, -1]] * 16 + [[8, -1]] * 16, [[0.0, -3.0]] * 32)
    assert channel_problem([zeros], "scores") == (
        "every logprob the engine reported in its scores is 0.0 (32 rows): no margin or noise can be measured on them")
    varied = _lp_rows([[1, 2]] * 32, [[-0.5 - i / 64, -2.0] for i in range(32)])
    assert channel_problem([varied], "rows") is None


# --- the scorer check and the calibration that uses it (judge/calibration.py) ---------------------------------

def _cal_sample(pid="p"):
    from specparity.judge.calibration import Sample

    ids = [5, 6, 7, 8, 9, 4]
    # decode margins 3, 0.5, 3, 3, exactly 2 (not above the bound) and 3 at a row whose top is another token
    decoded = scores(ids, [[5, 1], [6, 1], [7, 1], [8, 1], [9, 1], [3, 4]],
                     [[-0.125, -3.125], [-0.125, -0.625], [-0.125, -3.125], [-0.125, -3.125], [-0.125, -2.125],
                      [-0.125, -3.125]])
    # the scorer: its argmax is the next token at 2, the previous one at 3, another at 4 and 5
    tf = scores(ids, [[5, 1], [6, 1], [8, 7], [7, 8], [1, 9], [1, 4]],
                [[-0.125, -3.0], [-0.125, -0.5], [-0.125, -0.25], [-0.125, -0.25], [-0.125, -0.25], [-0.1, -0.2]],
                logprobs=[-0.125, -0.125, -0.25, -0.25, -0.25, -0.2])
    return Sample(pid, ids, decoded, tf)


def test_check_scorer_counts_clear_positions_disagreements_and_shifts():
    from specparity.judge.calibration import Sample, check_scorer

    s = _cal_sample()
    c = check_scorer([s], 2.0)
    assert (c.clear_positions, c.disagreements, c.shifted_later, c.shifted_earlier, c.wrong_ids, c.clear_nats) == (
        3, 2, 1, 1, 0, 2.0)
    assert c.first == "p position 2: baseline token 7 with decode margin 3 nats, scorer row for token 7 with argmax 8"
    assert not c.passed and c.to_json() == {**vars(c), "passed": False}
    # a lower bound takes the margin of exactly 2 in: one more clear position, one more disagreement
    low = check_scorer([s], 1.5)
    assert (low.clear_positions, low.disagreements, low.shifted_later, low.shifted_earlier) == (4, 3, 1, 1)
    # a row scoring another token is counted (and named first when it comes first); an unscored row is not
    wrong_tf = scores([5, 0, 7], [[5, 1], [6, 1], [7, 1]], [[-0.1, -3.0], [-0.1, -3.0], [-0.1, -3.0]],
                      logprobs=[-0.1, -0.1, np.nan])
    wrong_tf.token_ids[2] = 99
    wrong = Sample("q", [5, 6, 7], scores([5, 6, 7], [[5, 1], [6, 1], [7, 1]], [[-0.1, -3.0]] * 3), wrong_tf)
    both = check_scorer([wrong, s], 2.0)
    assert (both.clear_positions, both.disagreements, both.wrong_ids) == (5, 2, 1)
    assert both.first == "q position 1: baseline token 6 with decode margin 2.9 nats, scorer row for token 0 with argmax 6"
    empty = Sample("e", [], scores(np.zeros(0, np.int64), np.zeros((0, 2), np.int64), np.zeros((0, 2))),
                   scores(np.zeros(0, np.int64), np.zeros((0, 2), np.int64), np.zeros((0, 2))))
    fine = check_scorer([empty, wrong], 2.0)
    assert fine.first.startswith("q position 1") and fine.passed is False
    # the stream, the decode rows and the scorer's rows are cut to the shortest of the three
    short = Sample("s", s.output_ids[:3], s.decoded, s.teacher_forced)
    assert check_scorer([short], 2.0).disagreements == 1
    cut_rows = [Sample("d", s.output_ids, TokenScores(s.decoded.token_ids[:3], s.decoded.logprobs[:3],
                                                      s.decoded.top_ids[:3], s.decoded.top_logprobs[:3]), s.teacher_forced),
                Sample("t", s.output_ids, s.decoded, TokenScores(s.teacher_forced.token_ids[:3],
                                                                 s.teacher_forced.logprobs[:3],
                                                                 s.teacher_forced.top_ids[:3],
                                                                 s.teacher_forced.top_logprobs[:3]))]
    assert [check_scorer([c], 2.0).disagreements for c in cut_rows] == [1, 1]
    single = Sample("k0", [7], scores([7], [[7, 1]], [[-0.125, -3.125]]), scores([7], [[6, 7]], [[-0.1, -0.2]],
                                                                                 logprobs=[-0.2]))
    assert (check_scorer([single], 2.0).disagreements, check_scorer([single], 2.0).clear_positions) == (1, 1)
    one = Sample("k1", [5], scores([5], [[5]], [[-0.1]]), scores([5], [[6]], [[-0.1]]))
    assert check_scorer([one], 0.0).clear_positions == 0  # one alternative: no margin, nothing clear


def test_require_fit_scorer_and_sound_channels_name_the_side():
    from specparity.judge.calibration import (DegenerateLogprobs, Sample, ScorerRefused, _decode_margins,
                                              require_fit_scorer, require_sound_channels)

    with pytest.raises(ScorerRefused) as err:
        require_fit_scorer([_cal_sample()], 2.0, "engine")
    assert str(err.value) == (
        "teacher-forced scorer refused (engine): its argmax differs from the baseline's token at 2 of 3 positions "
        "where the baseline's own margin exceeds 2 nats (first: p position 2: baseline token 7 with decode margin "
        "3 nats, scorer row for token 7 with argmax 8)")
    ok = _cal_sample()
    assert require_fit_scorer([ok], 5.0, "engine").passed
    one = scores([5, 6], [[5], [6]], [[-0.5], [-0.25]])
    assert np.isnan(_decode_margins(one, 2)).all() and _decode_margins(one, 2).dtype == np.float32
    assert _decode_margins(ok.decoded, 2).tolist() == [3.0, 0.5]
    const = scores([1] * 32, [[1, 2]] * 32, [[-0.5, -1.5]] * 32)
    varied = scores([1] * 32, [[1, 2]] * 32, [[-0.5 - i / 64, -1.5] for i in range(32)])
    for sides, what in (((const, varied, None), "baseline's decode logprobs"),
                        ((varied, const, None), "teacher-forced scores (s)"),
                        ((varied, varied, const), "teacher-forced scores on the speculative server (s)")):
        with pytest.raises(DegenerateLogprobs) as err:
            require_sound_channels([Sample("p", [1] * 32, *sides)], "s")
        assert str(err.value).startswith(f"refusing to calibrate: every row of the engine's {what} is the same")
    require_sound_channels([Sample("p", [1] * 32, varied, varied, None)], "s")


def _model_rows(n, seed, k=4):
    rng = np.random.default_rng(seed)
    top_lp = np.sort(-np.round(rng.uniform(0.5, 12.0, (n, k)) * 64) / 64, axis=1)[:, ::-1].copy()
    top_lp[:, 0] = -np.round(rng.uniform(0.01, 0.1, n) * 1024) / 1024
    top_ids = np.stack([rng.permutation(50)[:k] for _ in range(n)])
    return TokenScores(top_ids[:, 0].copy(), top_lp[:, 0].astype(np.float32), top_ids, top_lp.astype(np.float32))


def _moved(s, step, seed):
    rng = np.random.default_rng(seed)
    t = (s.top_logprobs + rng.integers(-4, 5, s.top_logprobs.shape) * step).astype(np.float32)
    return TokenScores(s.token_ids.copy(), t[:, 0].copy(), s.top_ids.copy(), t)


def test_calibrate_checks_both_scorers_measures_both_noises_and_keeps_every_setting():
    from specparity.judge.calibration import Sample, ScorerRefused, calibrate

    samples = []
    for i in range(3):
        d = _model_rows(40, i)
        samples.append(Sample(f"p{i}", list(d.token_ids), d, _moved(d, 2.0 ** -10, 10 + i),
                              _moved(d, 2.0 ** -8, 20 + i)))
    check, th = calibrate(samples, scorer="s", ceiling=1.5, multiplier=2.0, label="L", cross_note="")
    assert check.passed and check.clear_positions > 0 and th.source == "measured"
    assert (th.ceiling, th.multiplier, th.calibration) == (1.5, 2.0, "L")
    assert (th.noise.positions, th.noise.pairs, th.noise.near_window) == (120, 360, 1.5)
    assert (th.cross.positions, th.cross.pairs, th.cross.near_window) == (120, 360, 1.5)
    assert th.cross.max_abs_delta > th.noise.max_abs_delta and th.cross.largest_at is not None
    assert th.nats == pytest.approx(2.0 * max(th.noise.flip_noise, th.cross.flip_noise))
    assert th.flip_rate is not None and th.flip_rate.window == th.nats and th.flip_rate.measured_positions == 120
    _, over = calibrate(samples, scorer="s", override=0.25, cross_note="n")
    assert (over.nats, over.source, over.flip_rate.window) == (0.25, "override", 0.25)
    alone = [Sample(s.prompt_id, s.output_ids, s.decoded, s.teacher_forced) for s in samples]
    _, within = calibrate(alone, scorer="s", cross_note="one instance")
    assert within.cross is None and within.cross_note == "one instance"
    shifted = [Sample(s.prompt_id, s.output_ids, s.decoded, s.teacher_forced, _cal_sample().teacher_forced)
               for s in samples[:1]] + samples[1:]
    shifted[0] = Sample("p0", _cal_sample().output_ids, _cal_sample().decoded, _cal_sample().decoded,
                        _cal_sample().teacher_forced)
    with pytest.raises(ScorerRefused) as err:
        calibrate(shifted, scorer="s")
    assert str(err.value).startswith("teacher-forced scorer refused (s, on the speculative server): its argmax differs")


# --- structured output: the JSON prefix scanner and the constraint checks (judge/structured.py) --------------

@pytest.mark.parametrize("text, state", [
    ("", "prefix"), (" \n\t ", "prefix"), ("1", "complete"), ('"x"', "complete"), ("true", "complete"),
    (' {"a": {"b": []}} ', "complete"), ("[1, 2]", "complete"),
    ("[", "prefix"), ("  [1, 2", "prefix"), ("[ 1 ,\n\t2\r", "prefix"), ("[1,", "prefix"), ("[]]", "invalid"),
    ("[1 2", "invalid"), ("[1,]", "invalid"), ("[1}", "invalid"), ("[[]", "prefix"), ("[[],", "prefix"),
    ("{", "prefix"), ('{"a"', "prefix"), ('{"a":', "prefix"), ('{"a" :  1', "prefix"), ('{"a": 1,', "prefix"),
    ('{"a": 1, }', "invalid"), ("{1", "invalid"), ('{"a" 1', "invalid"), ('{"a": 1]', "invalid"),
    ('{"a": 1}}', "invalid"), ('{"a": {}', "prefix"), ('{"a": [', "prefix"), ('{"a": [1], "b"', "prefix"),
    ('{"a": 1, "b": {"c": [true', "prefix"), ('{"a": 1 "b"', "invalid"), ('{"a": 1, 2', "invalid"),
    ("tr", "prefix"), ("f", "prefix"), ("[tru", "prefix"), ("[true", "prefix"), ("[true,", "prefix"),
    ("[nul", "prefix"), ("[n", "prefix"), ("[trux", "invalid"), ("[tx", "invalid"), ("[true false", "invalid"),
    ("true false", "invalid"), ("[false, nulL", "invalid"), ("[xtrue", "invalid"),
    ("-", "prefix"), ("[-", "prefix"), ("[1.5e", "prefix"), ("[1.5e+3, 2", "prefix"), ("[01", "invalid"),
    ("[-]", "invalid"), ("1 2", "invalid"), ("[1E5, 2", "prefix"), ("[2.5E-3", "prefix"), ("[X", "invalid"),
    ("[1, X", "invalid"), ("[[]x", "invalid"), ("[[] x", "invalid"), ('["a" x', "invalid"), ("[,", "invalid"),
    ('{"a": }', "invalid"), ("[{}x", "invalid"), ("[{} x", "invalid"), ("[1, -2.5]x", "invalid"), ("[1, 2] ,", "invalid"),
    ('"abc', "prefix"), ('"ab\\', "prefix"), ('"a\\x', "invalid"), ('"\\u12', "prefix"), ('"\\u12G', "prefix"),
    ('["a\tb', "invalid"), ('"a"b', "invalid"), ('{"a\\"b": 1', "prefix"), ('["a"', "prefix"),
    ('"a\nb"', "invalid"), ('"\\"', "prefix"), ('"a" "b"', "invalid"), ('["a", "b\\n', "prefix"),
    ('{"k\x01": 1', "invalid"), ('{"k', "prefix"), ('{"k\\q', "invalid"), ('["\\/\\b\\f\\r\\t\\"\\\\', "prefix"),
    ('["x\x1f"]', "invalid"), ('["\x01a"', "invalid"), ('["\x01a"]', "invalid"), ('["é"', "prefix"), ("[\"a\" , \"b\" ,", "prefix"), ('[{"a": 1}, {', "prefix"),
    ('[{"a": 1} {', "invalid"), ('{"a": "x"}', "complete"), ('{"a": "x\\u00e9"', "prefix"),
])
def test_json_prefix_state_of_every_kind_of_text(text, state):
    from specparity.judge.structured import json_prefix_state

    assert _in_bounded_steps(json_prefix_state, text) == state


def _in_bounded_steps(fn, *args, budget: int = 100_000):
    """``fn(*args)``, failing once the Python code under it has run ``budget`` lines: a scanner over a few
    dozen characters that runs that long does not advance (a count of steps, not of seconds)."""
    import sys

    steps = 0

    def local(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > budget:
                raise AssertionError(f"{fn.__name__} ran {budget} lines on {args!r}: it does not advance")
        return local

    before = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        return fn(*args)
    finally:
        sys.settrace(before)


def test_string_helpers_find_the_closing_quote_and_judge_the_open_part():
    from specparity.judge.structured import _string_at, _string_end, _string_ok

    assert _string_end('x"ab"c', 1) == 5 and _string_end('"a\\"b"', 0) == 6 and _string_end('"ab', 0) is None
    assert _string_end('"a\\', 0) is None and _string_end('"a\tb"', 0) is None and _string_end('""', 0) == 2
    assert _string_at('["ab"]', 1) == 5 and _string_at('["ab', 1) == "prefix" and _string_at('["a\x00', 1) == "invalid"
    assert _string_at('"a\\z', 0) == "invalid" and _string_at('"a\\u00', 0) == "prefix"
    assert _string_ok("") and _string_ok("plain é") and _string_ok('\\"\\\\\\/\\b\\f\\n\\r\\t\\u00aF')
    assert _string_ok("ends in \\") and _string_ok("\\u") and _string_ok("\\u1") and _string_ok("x\x7f")
    assert not _string_ok("\x1f") and not _string_ok("a\nb") and not _string_ok("\\a") and not _string_ok('a"b')
    assert _string_ok("\\u12345") and _string_ok("\\\\\\") and not _string_ok("\\\\\\x")


def test_check_output_says_why_in_words():
    import json

    from specparity.judge.structured import OutputCheck, _clip, check_output
    from specparity.model.constraints import Constraint

    schema = Constraint("json_schema", json.dumps({"type": "object", "properties": {
        "n": {"type": "integer"}, "items": {"type": "array", "items": {"type": "string"}}}, "required": ["n"]},
        sort_keys=True))
    assert check_output(schema, '{"n": 1}', "stop") == OutputCheck("valid")
    assert check_output(schema, '{"n": 1', "length") == OutputCheck(
        "truncated", "ended at max_new_tokens before the JSON document closed")
    assert check_output(schema, '{"n": 1', "stop") == OutputCheck("invalid", 'before the JSON document closed: "{\\"n\\": 1"')
    assert check_output(schema, "no", "length") == OutputCheck("invalid", 'not JSON: "no"')
    assert check_output(schema, '{"n": 1}', "length") == OutputCheck("valid")
    assert check_output(schema, '{"n": 1, "items": ["a", 2]}', "stop") == OutputCheck(
        "invalid", "breaks the schema at items/1: 2 is not of type 'string'")
    assert check_output(schema, "[]", "stop") == OutputCheck("invalid", "breaks the schema at <root>: [] is not of type 'object'")
    long_items = json.dumps({"n": 1, "items": ["x" * 300]}).replace('"x', '"x', 1)
    assert len(check_output(Constraint("json_schema", '{"maxLength": 3, "type": "string"}'), json.dumps("y" * 300),
                            "stop").why) == 240
    assert check_output(schema, long_items, "stop").status == "valid"
    assert check_output(Constraint("grammar", 'root ::= "x"'), "{", "length") == OutputCheck("constrained")
    assert _clip("é" * 80) == '"' + "é" * 80 + '"' and _clip("é" * 81) == '"' + "é" * 80 + '…"'
    assert _clip("ab", limit=1) == '"a…"' and _clip("a\nb") == '"a\\nb"'


def test_a_constraint_problem_only_where_the_baseline_kept_it_and_speculation_broke_it():
    from specparity.judge.structured import OutputCheck, constraint_problem

    valid, invalid, truncated = OutputCheck("valid"), OutputCheck("invalid", "not JSON: \"x\""), OutputCheck("truncated")
    assert constraint_problem(valid, invalid) == (
        'constraint broken under speculation: the speculative output not JSON: "x" (the baseline\'s is valid)')
    for base, spec in ((None, invalid), (valid, None), (valid, valid), (valid, truncated), (invalid, invalid),
                       (truncated, invalid), (OutputCheck("constrained"), invalid)):
        assert constraint_problem(base, spec) is None, (base, spec)


def test_hide_forced_rows_hides_only_finite_rows_below_their_argmax():
    from specparity.judge.structured import hide_forced_rows

    nan = np.nan
    s = TokenScores(np.array([5, 7, 9, 3, 4]), np.array([-0.5, -2.0, -1.0, -1.0, nan], np.float32),
                    np.array([[5, 6], [8, 7], [-1, 9], [3, 4], [4, 1]]),
                    np.array([[-0.5, -3.0], [-0.5, -2.0], [-0.5, -1.0], [-1.0, -1.0], [-0.1, -0.2]], np.float32))
    out = hide_forced_rows(s)
    assert [out.reported(i) for i in range(5)] == [True, False, True, True, False]
    assert np.isnan(out.logprobs[1]) and out.top_ids[1].tolist() == [-1, -1] and np.isnan(out.top_logprobs[1]).all()
    assert out.top_ids[2].tolist() == [-1, 9] and out.logprobs[2] == -1.0 and out.top_logprobs[0].tolist() == [-0.5, -3.0]
    assert out.token_ids.tolist() == [5, 7, 9, 3, 4] and out.token_ids is not s.token_ids
    assert s.top_ids[1].tolist() == [8, 7] and s.logprobs[1] == -2.0  # the input is left alone
    kept = TokenScores(s.token_ids[[0, 2, 3]], s.logprobs[[0, 2, 3]], s.top_ids[[0, 2, 3]], s.top_logprobs[[0, 2, 3]])
    assert hide_forced_rows(kept) is kept
    empty = TokenScores.empty()
    assert hide_forced_rows(empty) is empty


def _constrained(ids, finish, error=None):
    res = GenerationResult("r", ids, "", finish, TokenScores.empty(), SpecStats(False))
    res.error = error
    return res


def test_judge_constraint_records_both_checks_and_fails_a_broken_one():
    import json

    from specparity.judge.structured import apply_constraint_checks, judge_constraint, output_text
    from specparity.model.constraints import Constraint
    from specparity.model.verdicts import Verdict

    words = {1: '{"n": ', 2: "1", 3: "}", 4: '"x"', 0: "</s>"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    assert output_text(_constrained([1, 2, 3, 0], "stop"), decode) == '{"n": 1}'
    assert output_text(_constrained([1, 2, 3, 0], "length"), decode) == '{"n": 1}</s>'
    assert output_text(_constrained([], "stop"), decode) == ""
    schema = Constraint("json_schema", json.dumps({"type": "object", "required": ["n"]}))
    v = Verdict("p", "c", "near_tie", "a near tie")
    judge_constraint(v, schema, _constrained([1, 2, 3, 0], "stop"), _constrained([1, 4, 3, 0], "stop"), decode)
    assert v.constraint["kind"] == "json_schema" and v.constraint["baseline"] == {"status": "valid", "why": ""}
    assert v.klass == "near_tie" and v.constraint["spec"] == {"status": "valid", "why": ""}  # {"n": "x"} has an n
    assert "problem" not in v.constraint
    bad = Verdict("p", "c", "near_tie", "a near tie")
    judge_constraint(bad, schema, _constrained([1, 2, 3, 0], "stop"), _constrained([1, 2, 0], "stop"), decode)
    why = 'before the JSON document closed: "{\\"n\\": 1"'
    assert bad.constraint == {"kind": "json_schema", "baseline": {"status": "valid", "why": ""},
                              "spec": {"status": "invalid", "why": why},
                              "problem": f"constraint broken under speculation: the speculative output {why} "
                                         "(the baseline's is valid)"}
    assert bad.klass == "diverged" and bad.reason == f"{bad.constraint['problem']}; a near tie"
    cut = Verdict("p", "c", "exact", "same")
    judge_constraint(cut, schema, _constrained([1, 2], "length"), _constrained([1, 2], "length"), decode)
    truncated = {"status": "truncated", "why": "ended at max_new_tokens before the JSON document closed"}
    assert cut.constraint == {"kind": "json_schema", "baseline": truncated, "spec": truncated}
    failed = Verdict("p", "c", "error", "engine failed")
    judge_constraint(failed, schema, _constrained([1, 2, 3, 0], "stop"), _constrained([], "error", error="boom"), decode)
    assert failed.constraint == {"kind": "json_schema", "baseline": {"status": "valid", "why": ""}, "spec": None}
    assert failed.klass == "error" and failed.reason == "engine failed"
    kept_error = Verdict("p", "c", "error", "engine failed")
    apply_constraint_checks(kept_error, {"kind": "json_schema", "problem": "x"})
    assert kept_error.klass == "error" and kept_error.reason == "engine failed" and kept_error.constraint["problem"] == "x"
    checks = {"kind": "grammar", "baseline": {"status": "constrained", "why": ""}}
    plain = Verdict("p", "c", "exact", "same")
    apply_constraint_checks(plain, checks)
    assert plain.constraint == checks and plain.constraint is not checks and (plain.klass, plain.reason) == ("exact", "same")
    empty = Verdict("p", "c", "exact", "same")
    apply_constraint_checks(empty, {"kind": "grammar", "problem": ""})
    assert empty.klass == "exact"


def test_unconstrained_baselines_names_the_count_and_the_first_prompt():
    import json
    from types import SimpleNamespace

    from specparity.judge.structured import unconstrained_baselines
    from specparity.model.constraints import Constraint

    words = {1: '{"n": ', 2: "1", 3: "}", 4: "oops", 0: "</s>"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    schema = Constraint("json_schema", json.dumps({"type": "object", "required": ["n"]}))

    def rec(pid, ids, finish="stop", constraint=schema, error=None, baseline=True):
        return SimpleNamespace(prompt=SimpleNamespace(id=pid, constraint=constraint),
                               baseline=_constrained(ids, finish, error) if baseline else None)

    recs = [rec("ok", [1, 2, 3, 0]), rec("cut", [1, 2], "length"), rec("free", [4], constraint=None),
            rec("gbnf", [4], constraint=Constraint("grammar", 'root ::= "x"')), rec("failed", [4], error="x"),
            rec("none", [], baseline=False)]
    assert unconstrained_baselines(recs, decode) is None
    recs += [rec("bad", [4, 0]), rec("bad2", [1, 3, 0])]
    assert unconstrained_baselines(recs, decode) == (
        'the baseline output breaks its prompt\'s JSON schema on 2 prompt(s), first bad (not JSON: "oops"): the '
        "engine did not apply the constraint it was sent (docs/STRUCTURED.md)")


# --- verify/decode invariance: the reports' statuses word for word (judge/invariance.py) ---------------------

def _report(**kw):
    base = dict(engine="e", dtype="float32", kv_cache_dtype="as the model", width=4, prompts=2, tokens=100,
                proposed=10, accepted=8, verify_steps=4, threshold=0.01, drift_bound=0.04)
    base.update(kw)
    return SelfDraftReport(**base)


def test_self_draft_status_of_every_case():
    assert _report(reported=False, proposed=0).status() == (
        "warn", "the engine reports no speculation counters: acceptance is unknown")
    assert _report(proposed=0, accepted=0).status() == ("fail", "no draft token was proposed: the self-draft never ran")
    assert _report(located=False).status() == (
        "warn", "2 draft token(s) rejected; the engine reports totals only, so where (and at which margins) is unknown")
    assert _report(located=False, classes={"exact": 1, "near_tie": 1}).status()[0] == "warn"
    for klass in ("diverged", "drifted", "error"):
        assert _report(located=False, classes={"exact": 1, klass: 2}).status() == (
            "fail", f"outputs not lossless against plain decode: {{'{klass}': 2}}")
        assert _report(classes={"exact": 1, klass: 2}).status() == (
            "fail", f"outputs not lossless against plain decode: {{'{klass}': 2}}")
    assert _report(located=False, accepted=10).status() == (
        "ok", "every draft token accepted: verify and decode agree on every position")
    beyond = [Rejection("p", 3, 0.01, "within", False), Rejection("q", 7, 0.5, "beyond", True),
              Rejection("r", 9, 0.25, "beyond", True)]
    assert _report(rejections=beyond, classes={"diverged": 1}).status() == (
        "fail", "2 rejection(s) where the baseline's margin exceeds the drift bound 0.04 nats (first: q position 7, "
                "margin 0.5): verify and decode disagree beyond the target's noise")
    unknown = [Rejection("p", 3, 0.01, "within", False), Rejection("q", 5, None, "unknown", False),
               Rejection("r", 6, 0.02, "noise", False), Rejection("s", 8, None, "unknown", False)]
    assert _report(rejections=unknown).status() == (
        "warn", "4 rejection(s), margin unknown at 2 (first: q position 5: the output had already left plain decode "
                "there, or the engine reported no row), so those are not shown to be arithmetic; the other 2 at a "
                "margin within the target's noise")
    assert _report(rejections=unknown[1:2]).status() == (
        "warn", "1 rejection(s), margin unknown at 1 (first: q position 5: the output had already left plain decode "
                "there, or the engine reported no row), so those are not shown to be arithmetic")
    assert _report(rejections=unknown[:1] + unknown[2:3]).status() == (
        "warn", "2 rejection(s), each at a margin within the target's noise: verify and decode round differently "
                "there (arithmetic, not a bug)")
    assert _report(accepted=10, classes={"exact": 2, "near_tie": 1}).status() == (
        "ok", "every draft token accepted: verify and decode agree on every position")
    rep = _report(tokens=0, proposed=0, reported=False, classes={"exact": 1, "near_tie": 2, "diverged": 1})
    assert rep.acceptance is None and rep.rejections_per_1k is None and rep.outputs_differ == 3


def test_batch_report_status_names_what_changed():
    from specparity.judge.invariance import BatchReport
    from specparity.model.verdicts import Verdict

    def verdicts(*classes):
        return [Verdict(f"p{i}", "c", k, f"why {i}") for i, k in enumerate(classes)]

    rep = BatchReport("hf", "float32", 4, "how", 0.25, verdicts("exact", "error", "near_tie", "diverged", "drifted",
                                                                "diverged"))
    assert rep.status() == ("fail", "4 prompt(s) change beyond a near tie when batched: p1 (error: why 1), "
                                    "p3 (diverged: why 3), p4 (drifted: why 4)")
    assert rep.classes == {"exact": 1, "error": 1, "near_tie": 1, "diverged": 2, "drifted": 1}
    assert BatchReport("hf", "float32", 4, "how", 0.25, verdicts("diverged")).status() == (
        "fail", "1 prompt(s) change beyond a near tie when batched: p0 (diverged: why 0)")
    ties = BatchReport("hf", "float32", 2, "how", 0.25, verdicts("exact", "near_tie", "near_tie"))
    assert ties.status() == ("warn", "2 prompt(s) flip at a near tie when batched (not batch-invariant)")
    j = ties.to_json()
    assert (j["status"], j["why"], j["classes"]) == ("warn", ties.status()[1], {"exact": 1, "near_tie": 2})
    assert j["verdicts"] == [v.to_json() for v in ties.verdicts] and j["batch_size"] == 2
    assert BatchReport("hf", "float32", 2, "how", 0.25, verdicts("exact", "exact")).status() == (
        "ok", "every prompt identical alone and batched")


def _inv_result(ids, steps, margins=None, k=2):
    n = len(ids)
    margins = margins if margins is not None else [5.0] * n
    top = np.array([[t, t + 1][:k] for t in ids]).reshape(n, k)
    lp = np.array([[-0.125, -0.125 - m][:k] for m in margins], np.float32).reshape(n, k)
    return GenerationResult("p", list(ids), "", "length", TokenScores(np.array(ids), lp[:, 0].copy(), top, lp),
                            SpecStats.from_steps(steps, "test"))


def test_self_draft_report_sorts_rejections_by_margin_and_counts_what_it_judged():
    from specparity.judge.invariance import _margin, rejection_positions, self_draft_report
    from specparity.model.verdicts import Verdict

    ids = list(range(1, 9))
    # rejections at positions 3 (margin 0.01: within), 5 (0.03: noise), 7 (0.04: exactly the drift bound)
    steps = [StepRecord(4, 2, 3), StepRecord(4, 1, 2), StepRecord(3, 1, 2), StepRecord(2, 0, 1)]
    assert rejection_positions(_inv_result(ids, steps)) == [2, 4, 6, 7]
    base = _inv_result(ids, [], margins=[5, 5, 0.0078125, 5, 0.03125, 5, 0.0625, 5])
    spec = _inv_result(ids, steps)
    exact = Verdict("p", "c", "exact", "")
    rep = self_draft_report([("p", base, spec, exact)], engine="e", dtype="d", threshold=0.0078125,
                            drift_bound=0.0625, kv_cache_dtype="fp8", width=3)
    assert [(r.position, r.baseline_margin, r.against_noise, r.output_differs) for r in rep.rejections] == [
        (2, 0.0078125, "within", False), (4, 0.03125, "noise", False), (6, 0.0625, "noise", False),
        (7, 5.0, "beyond", False)]
    assert (rep.prompts, rep.tokens, rep.proposed, rep.accepted, rep.verify_steps) == (1, 8, 13, 4, 4)
    assert (rep.kv_cache_dtype, rep.width, rep.threshold, rep.drift_bound, rep.classes) == ("fp8", 3, 0.0078125,
                                                                                           0.0625, {"exact": 1})
    # the output left the baseline at 5: margins after it are unknown (the baseline's row is another prefix)
    other = _inv_result([1, 2, 3, 4, 5, 9, 9, 9], steps)
    rep = self_draft_report([("p", base, other, Verdict("p", "c", "diverged", ""))], engine="e", dtype="d",
                            threshold=0.0078125, drift_bound=0.0625)
    assert [(r.position, r.against_noise, r.output_differs) for r in rep.rejections] == [
        (2, "within", True), (4, "noise", True), (6, "unknown", True), (7, "unknown", True)]
    assert rep.kv_cache_dtype == "as the model" and rep.width is None
    # a rejection at the split itself still reads the baseline's row (same prefix up to there)
    at_split = _inv_result([1, 2, 3, 4, 5, 6, 9, 9], steps)
    rep = self_draft_report([("p", base, at_split, None)], engine="e", dtype="d", threshold=0.0078125,
                            drift_bound=0.0625)
    assert [r.against_noise for r in rep.rejections] == ["within", "noise", "noise", "unknown"] and rep.classes == {}
    # a cut block counts its accepted drafts as proposed; errors are counted and skipped
    cut = _inv_result(ids, [StepRecord(4, 4, 5), StepRecord(4, 2, 3, "limit")])
    failed = _inv_result(ids, steps)
    failed.error = "boom"
    rep = self_draft_report([("p", base, cut, exact), ("q", base, failed, exact), ("r", failed, cut, None)],
                            engine="e", dtype="d", threshold=0.01, drift_bound=0.1)
    assert (rep.prompts, rep.proposed, rep.accepted, rep.tokens, rep.classes) == (1, 6, 6, 8, {"exact": 1, "error": 2})
    totals = GenerationResult("p", ids, "", "length", base.scores, SpecStats(True, proposed=9, accepted=5,
                                                                              verify_steps=3))
    none = GenerationResult("p", ids, "", "length", base.scores, SpecStats(False))
    rep = self_draft_report([("q", base, none, exact), ("p", base, totals, exact), ("r", base, totals, exact)],
                            engine="hf", dtype="bf16", threshold=0.01, drift_bound=0.1)
    assert (rep.located, rep.reported, rep.proposed, rep.accepted, rep.verify_steps, rep.prompts, rep.tokens) == (
        False, False, 18, 10, 6, 3, 24)
    assert (rep.engine, rep.dtype, rep.classes) == ("hf", "bf16", {"exact": 3})
    rep = self_draft_report([("p", base, spec, exact), ("q", base, spec, exact)], engine="e", dtype="d",
                            threshold=0.01, drift_bound=0.1)
    assert (rep.verify_steps, rep.accepted, rep.proposed, len(rep.rejections)) == (8, 8, 26, 8)
    # the margin: a row past the end, an unreported row and a row of one alternative have none
    assert _margin(base, 8) is None and _margin(base, 2) == 0.0078125 and _margin(base, 7) == 5.0
    assert _margin(_inv_result(ids, [], k=1), 2) is None
    hidden = _inv_result(ids, [])
    hidden.scores.top_ids[3] = -1
    hidden.scores.logprobs[3] = np.nan
    hidden.scores.top_logprobs[3] = np.nan
    assert _margin(hidden, 3) is None and _margin(hidden, 4) == 5.0


def _acc_set(label, values, categories=None, positions=None, artefacts=None):
    from specparity.judge.acceptance import AcceptanceSet, PromptAcceptance

    return AcceptanceSet(label, {pid: PromptAcceptance(pid, (categories or {}).get(pid, "c"), 4 * s, a, s, e,
                                                       (positions or {}).get(pid), (artefacts or {}).get(pid))
                                 for pid, (e, s, a) in values.items()})


def _bootstrap(old, new, seed=0, resamples=2000, level=0.95):
    o, w = np.asarray(old, float), np.asarray(new, float)
    idx = np.random.default_rng(seed).integers(0, len(old), size=(resamples, len(old)))
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = w[idx, 0].sum(1) / w[idx, 1].sum(1) - o[idx, 0].sum(1) / o[idx, 1].sum(1)
    diff = diff[np.isfinite(diff)]
    tail = (1 - level) / 2 * 100
    return float(np.percentile(diff, tail)), float(np.percentile(diff, 100 - tail))


def test_paired_interval_is_the_seeded_percentile_bootstrap_of_the_ratio_difference():
    from specparity.judge.acceptance import paired_interval

    old = [(5, 1), (9, 2), (4, 1), (12, 3), (7, 2), (0, 0)]
    new = [(4, 1), (8, 2), (3, 1), (10, 3), (6, 2), (1, 1)]
    assert paired_interval(old, new) == _bootstrap(old, new)
    assert paired_interval(old, new, seed=3, resamples=500, level=0.8) == _bootstrap(old, new, 3, 500, 0.8)
    assert paired_interval(old[:2], new[:2]) == _bootstrap(old[:2], new[:2])
    assert paired_interval(old[:1], new[:1]) is None and paired_interval([], []) is None
    import warnings

    with warnings.catch_warnings():  # 0/0 and x/0 in a resample are dropped quietly
        warnings.simplefilter("error")
        assert paired_interval([(0, 0), (0, 0)], [(1, 0), (2, 0)]) is None  # no resample has a finite ratio
        assert paired_interval([(0, 0), (2, 1)], [(1, 0), (2, 1)]) == _bootstrap([(0, 0), (2, 1)], [(1, 0), (2, 1)])


def test_positions_of_and_prompt_acceptance():
    from specparity.judge.acceptance import positions_of, prompt_acceptance

    steps = [StepRecord(3, 3, 4), StepRecord(3, 0, 1), StepRecord(1, 1, 2), StepRecord(2, 5, 3)]
    assert positions_of(SpecStats.from_steps(steps, "t")) == [(4, 3), (3, 2), (2, 1)]
    assert positions_of(SpecStats.from_steps([], "t")) == []
    assert positions_of(SpecStats(True, proposed=4, accepted=2, verify_steps=2)) is None
    stats = SpecStats.from_steps(steps, "t")
    pa = prompt_acceptance("p", "code", stats, [1, 2, 3], [4, 5, 6])
    assert (pa.prompt_id, pa.category, pa.proposed, pa.accepted, pa.verify_steps, pa.emitted, pa.artefact) == (
        "p", "code", stats.proposed, stats.accepted, stats.verify_steps, stats.emitted, None)
    assert pa.positions == [(4, 3), (3, 2), (2, 1)]
    assert pa.ratio("accept_length") == (stats.emitted, stats.verify_steps)
    assert pa.ratio("acceptance_rate") == (stats.accepted, stats.proposed)
    looped = prompt_acceptance("p", "code", stats, [1, 2, 3], [7, 8] * 12)
    assert looped.artefact is not None and "repetition loop" in looped.artefact
    assert prompt_acceptance("p", "code", SpecStats(False), None, [1]) is None
    prompt = list(range(100, 140))
    recited = prompt_acceptance("p", "code", stats, prompt, prompt[5:25])
    assert recited.artefact is not None and "recite" in recited.artefact


def test_compare_runs_rows_flags_positions_and_json():
    from specparity.judge.acceptance import ACCEPT_RATE, RESAMPLES, compare_runs

    old_v = {"a": (10, 4, 5), "b": (9, 3, 6), "c": (12, 4, 9), "d": (8, 4, 3), "e": (6, 3, 3), "x": (1, 1, 0)}
    new_v = {"a": (8, 4, 3), "b": (9, 3, 5), "c": (10, 4, 7), "d": (8, 4, 4), "e": (5, 3, 2), "y": (1, 1, 0)}
    cats = {"a": "code", "b": "code", "c": "math", "d": "math", "e": "math"}
    pos_old = {p: [(2, 1), (1, 1)] for p in "abcde"}
    old = _acc_set("v1", old_v, cats, pos_old, {"c": "a repetition loop"})
    new = _acc_set("v2", new_v, cats, {p: [(3, 2)] for p in "abcde"}, {"e": "recites the prompt"})
    c = compare_runs(old, new)
    assert c.notes == ["2 prompt(s) with acceptance on one side only are left out"]
    assert c.flagged == {"c": "a repetition loop", "e": "recites the prompt"}
    assert [(r.category, r.prompts, r.old, r.new) for r in c.rows] == [
        ("code", 2, 19 / 7, 17 / 7), ("math", 3, 26 / 11, 23 / 11), ("all", 5, 45 / 18, 40 / 18)]
    old_pairs = [(10, 4), (9, 3), (12, 4), (8, 4), (6, 3)]
    new_pairs = [(8, 4), (9, 3), (10, 4), (8, 4), (5, 3)]
    assert (c.rows[-1].low, c.rows[-1].high) == _bootstrap(old_pairs, new_pairs)
    assert (c.rows[0].low, c.rows[0].high) == _bootstrap(old_pairs[:2], new_pairs[:2])
    assert [(r.category, r.prompts) for r in c.clean] == [("code", 2), ("math", 1), ("all", 3)]
    assert c.clean[1].low is None and c.clean[1].old == 8 / 4
    assert c.decided_on is c.clean
    assert [(p.position, p.old, p.new) for p in c.positions] == [(0, (10, 5), (15, 10)), (1, (5, 5), None)]
    assert c.positions_note == "" and c.not_recorded is None
    back = compare_runs(new, old)  # the old side now has the shorter per-position record
    assert [(p.position, p.old, p.new) for p in back.positions] == [(0, (15, 10), (10, 5)), (1, None, (5, 5))]
    j = c.to_json()
    assert {k: j[k] for k in ("metric", "old", "new", "rule", "not_recorded", "flagged", "failures", "notes",
                              "resamples", "seed", "level")} == {
        "metric": "accept_length", "old": "v1", "new": "v2", "rule": "", "not_recorded": None,
        "flagged": c.flagged, "failures": [], "notes": c.notes, "resamples": RESAMPLES, "seed": 0, "level": 0.95}
    assert j["rows"][-1] == {"category": "all", "prompts": 5, "old": 2.5, "new": 40 / 18, "low": c.rows[-1].low,
                             "high": c.rows[-1].high, "failed": False, "delta": 40 / 18 - 2.5}
    assert [r["prompts"] for r in j["without_flagged"]] == [2, 1, 3]
    assert j["positions"] == [{"position": 0, "old": (10, 5), "new": (15, 10)},
                              {"position": 1, "old": (5, 5), "new": None}]
    rate = compare_runs(old, new, metric=ACCEPT_RATE)
    assert rate.metric == ACCEPT_RATE and rate.rows[-1].old == 26 / 72 and rate.rows[-1].new == 21 / 72
    # one side without per-step records, then neither
    half = compare_runs(_acc_set("v1", old_v, cats), new)
    assert half.positions_note == "positions unknown for v1 (the engine reports totals only)"
    assert [(p.old, p.new) for p in half.positions] == [(None, (15, 10))]
    none = compare_runs(_acc_set("v1", old_v, cats), _acc_set("v2", new_v, cats))
    assert none.positions is None and none.to_json()["positions"] is None
    assert none.positions_note == "positions unknown: neither run has per-step records (the engines report totals only)"
    # every common prompt flagged: the rule reads every row
    flagged = compare_runs(_acc_set("v1", {"a": (4, 2, 1)}, artefacts={"a": "loop"}), _acc_set("v2", {"a": (4, 2, 1)}))
    assert flagged.clean == [] and flagged.decided_on is flagged.rows and flagged.rows[0].low is None
    assert flagged.notes == []


def test_compare_runs_without_counters_on_a_side_or_in_common():
    from specparity.judge.acceptance import AcceptanceSet, compare_runs

    gone = compare_runs(AcceptanceSet("v1", missing="baselines only"), AcceptanceSet("v2", missing="no counters"))
    assert gone.not_recorded == "acceptance not recorded — v1: baselines only; v2: no counters"
    assert (gone.rows, gone.clean, gone.flagged, gone.positions, gone.notes) == ([], [], {}, None, [])
    assert (gone.metric, gone.old_label, gone.new_label) == ("accept_length", "v1", "v2")
    rate = compare_runs(AcceptanceSet("v1", missing="x"), AcceptanceSet("v2"), metric="acceptance_rate")
    assert (rate.metric, rate.not_recorded) == ("acceptance_rate", "acceptance not recorded — v1: x")
    apart = compare_runs(_acc_set("v1", {"a": (4, 2, 1)}), _acc_set("v2", {"b": (4, 2, 1), "c": (4, 2, 1)}))
    assert apart.not_recorded == "acceptance not comparable — no prompt has counters on both sides"
    assert apart.notes == ["3 prompt(s) with acceptance on one side only are left out"] and apart.rows == []
    assert (apart.metric, apart.old_label, apart.new_label) == ("accept_length", "v1", "v2")
    assert (apart.clean, apart.flagged, apart.positions) == ([], {}, None)
    assert compare_runs(_acc_set("v1", {"a": (4, 2, 1)}), _acc_set("v2", {"b": (4, 2, 1)}),
                        metric="acceptance_rate").metric == "acceptance_rate"


def test_a_ratio_of_no_denominator_is_unknown():
    from specparity.judge.acceptance import _ratio

    assert _ratio([]) is None and _ratio([(0, 0), (3, 0)]) is None
    assert _ratio([(3, 2), (1, 2)]) == 1.0 and _ratio([(0, 4)]) == 0.0


def _baseline_record(pid, ids, rows=None, finish="length", limit=6, stops=(0,), error=None, request=True):
    from types import SimpleNamespace

    base = _c_stream(ids, rows if rows is not None else _c_rows(ids), finish, error=error)
    req = SimpleNamespace(max_new_tokens=limit, stop_token_ids=list(stops)) if request else None
    return SimpleNamespace(prompt=SimpleNamespace(id=pid), baseline=base, request=req)


def test_stop_rule_refusal_word_for_word_for_the_stop_set_and_for_the_limit():
    from types import SimpleNamespace

    from specparity.judge.baseline_checks import baseline_refusal, stop_rule_refusal

    good = _baseline_record("ok", _C_BASE)
    stopped = _baseline_record("s", [1, 2, 0], finish="stop")
    off_set = _baseline_record("q", [1, 2, 3], finish="stop", stops=(0, 7))
    past = _baseline_record("r", [1, 0, 3, 4, 5, 6])
    skipped = [_baseline_record("e", [1, 2, 3], finish="stop", error="boom"),
               _baseline_record("n", [1, 2, 3], finish="stop", request=False),
               SimpleNamespace(prompt=SimpleNamespace(id="b"), baseline=None, request=SimpleNamespace())]
    assert stop_rule_refusal([good, stopped, *skipped]) is None
    stop_fix = ("the stop ids come from the model's generation_config.json (GGUF: its end-of-generation tokens): give "
                "the model's own directory or file, not a tokenizer-only one")
    assert stop_rule_refusal([good, off_set, past, *skipped]) == (
        "the baseline breaks the stop rule on 2 of 3 prompt(s), so the stop set or token limit this run uses is not "
        "the engine's (a configuration error, not a speculation bug): first q: finish_reason is 'stop' but the last "
        "token is not a stop token; it ends with token 3 (finish 'stop', 3 of max_new_tokens=6); stop set [0, 7]; "
        + stop_fix)
    assert stop_rule_refusal([past], _decode) == (
        "the baseline breaks the stop rule on 1 of 1 prompt(s), so the stop set or token limit this run uses is not "
        "the engine's (a configuration error, not a speculation bug): first r: continued past stop token 0 at "
        "position 1 (4 tokens after it); it ends with token 6 '<6>' (finish 'length', 6 of max_new_tokens=6); "
        "stop set [0]; " + stop_fix)
    limit_fix = ("the engine did not honour the token limit the run asked for (it stopped short of it or ran past it): "
                 "check the server's own cap on new tokens and its context size against --max-new-tokens")
    short = _baseline_record("t", [1, 2, 3])
    assert stop_rule_refusal([short]) == (
        "the baseline breaks the stop rule on 1 of 1 prompt(s), so the stop set or token limit this run uses is not "
        "the engine's (a configuration error, not a speculation bug): first t: finish_reason is 'length' but only 3 of "
        "max_new_tokens=6 tokens were emitted; it ends with token 3 (finish 'length', 3 of max_new_tokens=6); stop set "
        "[0]; " + limit_fix)
    assert baseline_refusal([short], 0.25) == stop_rule_refusal([short])
    assert baseline_refusal([good], None) is None and baseline_refusal([good], 0.25) is None


def test_greedy_refusal_counts_positions_and_prompts_beyond_the_tolerance():
    from specparity.judge.baseline_checks import baseline_refusal, greedy_refusal

    sampled = _baseline_record("p", _C_BASE, _c_rows(_C_BASE, margins={2: 1.0, 4: 0.5}, chosen={2: 9, 4: 8}))
    also = _baseline_record("q", _C_BASE, _c_rows(_C_BASE, margins={1: 0.75}, chosen={1: 9}))
    near = _baseline_record("r", _C_BASE, _c_rows(_C_BASE, margins={1: 0.25}, chosen={1: 9}))
    good = _baseline_record("ok", _C_BASE)
    failed = _baseline_record("e", _C_BASE, _c_rows(_C_BASE, margins={1: 2.0}, chosen={1: 9}), error="boom")
    tail = ("): the engine samples, applies a penalty or a logit processor; configure greedy decoding (temperature 0, "
            "no repetition/presence/frequency penalty, no logit processor or bias)")
    assert greedy_refusal([good, near, sampled, also, failed], 0.25) == (
        "the baseline is not a greedy decode: at 3 position(s) of 2 of 4 prompt(s) the emitted token is not the argmax "
        "of its own decode row beyond the near-tie threshold 0.25 nats (first p position 2: emitted 3, its row "
        "prefers 9 by 1 nats" + tail)
    assert greedy_refusal([near], 0.25) is None and greedy_refusal([near, good], 0.0) is not None
    assert "beyond the near-tie threshold 1e-05 nats (first r position 1: emitted 2 '<2>', its row prefers 9 '<9>' by " \
           "0.25 nats)" in greedy_refusal([near], 0.0, _decode)
    assert "threshold 0.6 nats (first p position 2" in greedy_refusal([sampled, also], 0.6)
    assert "at 1 position(s) of 1 of 2 prompt(s)" in greedy_refusal([sampled, also], 0.8)
    assert greedy_refusal([good, failed], 0.25) is None
    assert baseline_refusal([sampled], 0.25) == greedy_refusal([sampled], 0.25)


# --- the comparison's building blocks (judge/compare.py) ----------------------------------------------------

def test_first_mismatch_of_equal_prefix_and_differing_streams():
    from specparity.judge.compare import first_mismatch

    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None and first_mismatch([], []) is None
    assert first_mismatch([1, 2, 3], [1, 9, 3]) == 1 and first_mismatch([5], [6]) == 0
    assert first_mismatch([1, 2], [1, 2, 3]) == 2 and first_mismatch([1, 2, 3], [1, 2]) == 2
    assert first_mismatch([], [4]) == 0 and first_mismatch([1, 2, 3, 4], [1, 2, 3, 5]) == 3
    assert first_mismatch([2**40, 1], [2**40, 2]) == 1


def test_measure_drift_counts_positions_over_the_bound_up_to_the_split():
    from specparity.judge.compare import measure_drift

    ids = [1, 2, 3, 4, 5]
    base = _c_rows(ids, margins={i: 1.0 for i in range(5)})
    spec = _c_rows(ids, margins={0: 1.0, 1: 1.25, 2: 1.5, 3: 1.0, 4: 3.0}, unreported=(3,))
    d = measure_drift(base, spec, 5, 0.25)
    assert (d.bound, d.max_nats, d.start, d.over, d.checked) == (0.25, 2.0, 2, 2, 4)
    d = measure_drift(base, spec, 3, 0.25)  # positions 0..2 only
    assert (d.max_nats, d.start, d.over, d.checked) == (0.5, 2, 1, 3)
    d = measure_drift(base, spec, 5, 0.5)  # exactly the bound is within it
    assert (d.max_nats, d.start, d.over, d.checked) == (2.0, 4, 1, 4)
    d = measure_drift(base, spec, 2, 0.5)
    assert (d.max_nats, d.start, d.over, d.checked) == (0.25, None, 0, 2)
    hidden = _c_rows(ids, unreported=range(5))
    d = measure_drift(base, hidden, 5, 0.25)
    assert (d.bound, d.max_nats, d.start, d.over, d.checked) == (0.25, None, None, 0, 0)
    assert measure_drift(base, spec, 0, 0.25).checked == 0


def test_tf_violations_and_own_row_rejections_with_their_margins():
    from specparity.judge.compare import own_row_rejections, tf_violations

    ids = [1, 2, 3, 4, 5, 6]
    rows = _c_rows(ids, margins={1: 0.5, 2: 2.0, 4: 1e-6, 5: 0.75}, chosen={1: 9, 2: 8, 4: 7, 5: 9})
    rows.token_ids[5] = -1  # the row did not score the token: no margin
    got = [(v.position, v.spec_token, v.target_argmax, v.margin) for v in tf_violations(ids, rows)]
    assert got == [(1, 2, 9, 0.5), (2, 3, 8, 2.0), (4, 5, 7, pytest.approx(1e-6, abs=1e-7)), (5, 6, 9, None)]
    assert [v.position for v in tf_violations(ids, rows, start=2)] == [2, 4, 5]
    assert tf_violations(ids, rows, start=6) == [] and tf_violations(ids[:1], rows) == []
    assert tf_violations(ids, _c_rows(ids)) == []
    nan_row = _c_rows(ids, margins={3: 1.0}, chosen={3: 9})
    nan_row.logprobs[3] = np.nan
    assert [(v.position, v.margin) for v in tf_violations(ids, nan_row)] == [(3, None)]
    assert [(v.position, v.margin) for v in tf_violations(ids[:4], rows)] == [(1, 0.5), (2, 2.0)]
    # the row that chose the token: only margins above the tolerance, only rows holding the token's logprob
    assert [(v.position, v.margin) for v in own_row_rejections(ids, rows)] == [(1, 0.5), (2, 2.0)]
    assert [v.position for v in own_row_rejections(ids, rows, tolerance=0.5)] == [2]
    assert [v.position for v in own_row_rejections(ids, rows, tolerance=1e-7)] == [1, 2, 4]
    unreported = _c_rows(ids, margins={1: 0.5}, chosen={1: 9}, unreported=(1,))
    assert own_row_rejections(ids, unreported) == [] and own_row_rejections([], rows) == []
    no_top = _c_rows(ids, margins={1: 0.5}, chosen={1: 9})
    no_top.top_ids[1, 0] = -1
    assert own_row_rejections(ids, no_top) == []
    assert [v.position for v in own_row_rejections(ids[:2], rows)] == [1]
    first = _c_rows(ids, margins={0: 0.5}, chosen={0: 9})  # the first position is checked by default
    assert [(v.position, v.margin) for v in tf_violations(ids, first)] == [(0, 0.5)]
    assert tf_violations(ids, first, start=1) == []
    zero = _c_rows(ids, margins={3: 0.5}, chosen={3: 0})  # token id 0 is a real token
    assert [(v.position, v.target_argmax, v.margin) for v in own_row_rejections(ids, zero)] == [(3, 0, 0.5)]


def test_finish_and_stream_problems_word_for_word():
    from specparity.judge.compare import _stream_problem, finish_problem, stop_rule_problem

    assert finish_problem(_c_stream([1], _c_rows([1]), "abort")) == (
        "the engine broke the protocol: finish_reason 'abort' for a finished stream (expected 'stop' or 'length')")
    assert finish_problem(_c_stream([], _c_rows([]), "stop")) == (
        "the engine broke the protocol: finish_reason 'stop' with no token (a finished stream holds the stop token "
        "it ended on, or max_new_tokens >= 1 tokens)")
    assert finish_problem(_c_stream([1], _c_rows([1]), "length")) is None
    assert finish_problem(_c_stream([0], _c_rows([0]), "stop")) is None
    stops = {0, 7}
    assert _stream_problem(_c_stream([1, 2, 3], _c_rows([1, 2, 3])), 2, stops) == (
        "emitted 3 tokens, more than max_new_tokens=2")
    assert _stream_problem(_c_stream([1, 7, 3, 4], _c_rows([1, 7, 3, 4])), 6, stops) == (
        "continued past stop token 7 at position 1 (2 tokens after it)")
    assert _stream_problem(_c_stream([1, 2, 0], _c_rows([1, 2, 0]), "stop"), 6, stops) is None
    assert _stream_problem(_c_stream([1, 2, 0], _c_rows([1, 2, 0]), "length"), 3, stops) is None
    assert _stream_problem(_c_stream([1, 2], _c_rows([1, 2]), "stop"), 6, stops) == (
        "finish_reason is 'stop' but the last token is not a stop token")
    assert _stream_problem(_c_stream([], _c_rows([]), "stop"), 6, stops) == (
        "finish_reason is 'stop' but the last token is not a stop token")
    assert _stream_problem(_c_stream([1, 2], _c_rows([1, 2]), "length"), 6, stops) == (
        "finish_reason is 'length' but only 2 of max_new_tokens=6 tokens were emitted")
    assert _stream_problem(_c_stream([1, 2], _c_rows([1, 2]), "length"), 2, stops) is None
    assert _stream_problem(_c_stream([1, 2], _c_rows([1, 2]), "error"), 6, stops) is None
    assert stop_rule_problem(_c_stream([], _c_rows([]), "stop"), 6, [7, 0]) == (
        "finish_reason is 'stop' but the last token is not a stop token; it ends with no token (finish 'stop', 0 of "
        "max_new_tokens=6); stop set [0, 7]")
    assert stop_rule_problem(_c_stream([1, 2], _c_rows([1, 2]), "stop"), 6, [0], _decode) == (
        "finish_reason is 'stop' but the last token is not a stop token; it ends with token 2 '<2>' (finish 'stop', "
        "2 of max_new_tokens=6); stop set [0]")
    assert stop_rule_problem(_c_stream([1, 0], _c_rows([1, 0]), "stop"), 6, [0]) is None
