"""The checks behind each class: compare() records the rule that decided a verdict, and
:func:`specparity.judge.checks.verdict_checks` turns that verdict into the steps the reports show.

Every verdict here is what the real comparison returned for constructed streams and rows; the rows
hold binary fractions only, so every margin is exact.
"""

from __future__ import annotations

import json
import re
from html import unescape
from typing import Sequence

import numpy as np
import pytest

from specparity.report import render as report
from specparity.report import view
from specparity.judge.checks import Check, verdict_checks
from specparity.judge.compare import OWN_ROW_REJECTED, compare
from specparity.model.verdicts import CLASSES, Verdict
from specparity.gate.decision import decide, near_tie_budget, prompt_checks
from specparity.run.journal import JOURNAL, RESULTS_SCHEMA, load_run
from specparity.model.threshold import NearTieThreshold, NoiseStats
from specparity.model.prompts import Prompt
from specparity.model.gate_run import GateConfig, GatePolicy, GateRun, PromptRecord
from specparity.model.types import GenerationResult, SpecStats, StepRecord, TokenScores

K = 6
STOP = 0
MAX_NEW = 8
THRESHOLD = 0.25
NOISE = NoiseStats(0.125, 0.0625, 400, 3000)
TOP_LP = -0.5
BASE = [11, 12, 13, 14, 15, 16, 17, 18]


def decode(ids: Sequence[int]) -> str:
    return "".join(f" w{i}" for i in ids)


def rows(ids: Sequence[int], alt: dict[int, tuple[int, float]] | None = None) -> TokenScores:
    """``ids[i]`` is each row's argmax; the runner-up sits 5 nats below, or ``alt[i] = (token, margin)``."""
    n = len(ids)
    top_ids = np.zeros((n, K), np.int64)
    top_lp = np.zeros((n, K), np.float32)
    for i, t in enumerate(ids):
        r, m = (alt or {}).get(i, (t + 100, 5.0))
        top_ids[i] = [t, r, *[200 + 10 * i + j for j in range(K - 2)]]
        top_lp[i] = [TOP_LP, TOP_LP - m, *[-16.0 - j for j in range(K - 2)]]
    return TokenScores(np.array(ids, np.int64), top_lp[:, 0].copy(), top_ids, top_lp)


def rejecting(ids: Sequence[int], at: int, prefers: int, by: float) -> TokenScores:
    """Rows whose argmax is ``ids`` except at ``at``, where the row prefers ``prefers`` by ``by`` nats."""
    r = rows(ids)
    r.top_ids[at, :2] = [prefers, ids[at]]
    r.top_logprobs[at, 1] = r.logprobs[at] = TOP_LP - by
    return r


def threshold() -> NearTieThreshold:
    return NearTieThreshold(THRESHOLD, "override", NOISE, 1.5, 2.0, "the prompts that ran")


def result(ids: Sequence[int], scores: TokenScores, error: str | None = None) -> GenerationResult:
    finish = "error" if error else ("stop" if ids and ids[-1] == STOP else "length")
    return GenerationResult("p", list(ids), decode(ids), finish, scores,
                            SpecStats.from_steps([StepRecord(4, 2, 3), StepRecord(4, 4, 5)], "test"), error=error)


def judged(pid: str, base_ids, base_rows, spec_ids, spec_rows, tf, *, error=None, base_tf=None) -> PromptRecord:
    base, spec = result(base_ids, base_rows), result(spec_ids, spec_rows, error)
    v = compare(pid, "c", base, spec, tf, threshold=THRESHOLD, max_new_tokens=MAX_NEW, stop_ids=[STOP],
                decode=decode, baseline_tf=base_tf, drift_nats=threshold().drift_nats)
    return PromptRecord(Prompt(id=pid, category="c", lang="en", prompt=f"Prompt of {pid}"), baseline=base,
                        spec=spec, spec_tf=tf, verdict=v)


def split_at(i: int, token: int) -> list[int]:
    return BASE[:i] + [token] + BASE[i + 1:]


def unreported_at(ids: Sequence[int], i: int) -> TokenScores:
    r = rows(ids)
    r.top_ids[i] = -1
    r.top_logprobs[i] = np.nan
    r.logprobs[i] = np.nan
    return r


#: name -> (make, the class compare() gives it, the rule that decided it)
CASES = {
    "exact": (lambda: judged("exact", BASE, rows(BASE), BASE, rows(BASE), rows(BASE)), "exact", "identical"),
    "near_tie": (lambda: judged("near_tie", BASE, rows(BASE, {3: (31, 0.0625)}), split_at(3, 31),
                                rows(split_at(3, 31), {3: (14, 0.015625)}), rows(split_at(3, 31))),
                 "near_tie", "near_tie"),
    "drifted": (lambda: judged("drifted", BASE, rows(BASE), BASE, rows(BASE, {i: (BASE[i] + 100, 1.0)
                                                                                for i in range(2, MAX_NEW)}),
                               rows(BASE)), "drifted", "drift"),
    "drifted-at-split": (lambda: judged("drifted-at-split", BASE, rows(BASE, {3: (31, 0.0625)}), split_at(3, 31),
                                        rows(split_at(3, 31), {3: (14, 1.0)}), rows(split_at(3, 31))),
                         "drifted", "split_gap"),
    "diverged": (lambda: judged("diverged", BASE, rows(BASE, {2: (41, 9.0625)}), split_at(2, 41),
                                rows(split_at(2, 41)), rows(split_at(2, 41))), "diverged", "margin_over_threshold"),
    "error": (lambda: judged("error", BASE, rows(BASE), [], TokenScores.empty(K), None, error="RuntimeError: boom"),
              "error", "failed"),
    "own-row-at-split": (lambda: judged("own-row-at-split", BASE, rows(BASE, {2: (41, 0.0625)}), split_at(2, 41),
                                        rejecting(split_at(2, 41), 2, BASE[2], 0.0625), rows(split_at(2, 41))),
                         "diverged", "own_row_rejected"),
    "own-row-no-split": (lambda: judged("own-row-no-split", BASE, rows(BASE), BASE, rejecting(BASE, 5, 99, 0.0625),
                                        rows(BASE)), "diverged", "own_row_rejected"),
    "past-stop": (lambda: judged("past-stop", BASE, rows(BASE), split_at(4, STOP), rows(split_at(4, STOP)),
                                 rows(split_at(4, STOP))), "diverged", "stream_problem"),
    "later-unscored": (lambda: judged("later-unscored", BASE, rows(BASE, {3: (31, 0.0625)}), split_at(3, 31),
                                      rows(split_at(3, 31), {3: (14, 0.015625)}), None), "diverged", "later_unscored"),
    "margin-unreported": (lambda: judged("margin-unreported", BASE, unreported_at(BASE, 3), split_at(3, 31),
                                         rows(split_at(3, 31)), None), "diverged", "margin_unreported"),
}


def make_run(records: list[PromptRecord], policy: GatePolicy | None = None) -> GateRun:
    run = GateRun(None, GateConfig(near_tie_nats=THRESHOLD, policy=policy or GatePolicy(max_near_tie=1.0)), records,
                  threshold=threshold())
    for r in records:
        run.coverage.add(r.spec.spec)
    return run


def states(checks: list[Check]) -> list[str]:
    return [c.state for c in checks]


@pytest.mark.parametrize("case", CASES)
def test_compare_records_the_rule_and_its_checks_follow_the_class(case):
    """compare() gives every class a list of checks, decided by the rule it records on the verdict."""
    make, klass, rule = CASES[case]
    v = make().verdict
    assert (v.klass, v.rule) == (klass, rule), v.reason
    checks = verdict_checks(v, noise=NOISE)
    assert checks and all(c.state in ("ok", "fail", "warn", "info") and c.text and c.what for c in checks)
    if klass in ("exact", "near_tie"):
        assert "fail" not in states(checks), [(c.state, c.text) for c in checks]
    else:
        assert "fail" in states(checks), [(c.state, c.text) for c in checks]
    if klass == "error":
        assert [(c.state, c.text, c.what) for c in checks] == [("fail", v.reason, "error")]
    elif v.divergence is not None:
        first = checks[0]
        assert (first.what, first.position) == ("first_difference", v.divergence.position)
        margin = next(c for c in checks if c.what == "baseline_margin")
        assert margin.numbers["margin"] == v.divergence.baseline_margin
        assert margin.state == ("ok" if v.rule in ("near_tie", "split_gap", "later_unscored", "own_row_rejected")
                                else "fail")
    else:
        assert checks[0].what in ("identical", "finish_mismatch") and checks[-1].what == "drift"


def test_near_tie_checks_state_the_margin_against_the_measured_noise():
    v = CASES["near_tie"][0]().verdict
    margin = next(c for c in verdict_checks(v, noise=NOISE) if c.what == "baseline_margin")
    assert margin.numbers == {"margin": 0.0625, "threshold": THRESHOLD, "flip_noise": NOISE.flip_noise,
                              "ulps": round(v.divergence.margin_ulps), "ulp_nats": v.divergence.ulp_nats}
    assert v.divergence.ulp_nats is not None and "ulp" in margin.text  # its rows are bf16-spaced: the ulps are said
    assert margin.text.endswith(f"reaches {NOISE.flip_noise:.3g} nats, so this margin is inside the measured noise itself")
    # the noise is the run's, passed in: without it the check says nothing about noise
    alone = next(c for c in verdict_checks(v) if c.what == "baseline_margin")
    assert "noise" not in alone.text and "flip_noise" not in alone.numbers


def test_own_row_rejection_at_the_split_fails_the_speculative_row_once():
    v = CASES["own-row-at-split"][0]().verdict
    assert v.own_row_rejected and v.own_row_rejected_at_split and v.rejected_at == v.divergence.position == 2
    assert OWN_ROW_REJECTED in v.reason
    checks = verdict_checks(v, noise=NOISE)
    spec_row = next(c for c in checks if c.what == "spec_margin")
    assert spec_row.state == "fail" and "not its own verify pass's argmax" in spec_row.text
    assert not any(c.text == v.reason for c in checks)  # the spec-row step already says it


def test_own_row_rejection_elsewhere_and_stream_problems_show_the_reason_as_a_failed_step():
    for case, what in (("own-row-no-split", "own_row_rejected"), ("past-stop", "stream_problem")):
        v = CASES[case][0]().verdict
        assert not v.own_row_rejected_at_split
        failed = [c for c in verdict_checks(v, noise=NOISE) if c.state == "fail"]
        assert failed[0].what == what and failed[0].text == v.reason
    v = CASES["own-row-no-split"][0]().verdict
    assert v.rejected_at == 5 and v.divergence is None
    assert [c.what for c in verdict_checks(v, noise=NOISE) if c.state == "fail"] == ["own_row_rejected"]
    # the stop token the speculative stream went on after is outside the baseline's top-k: its margin
    # step says so by the reason (the stream problem decided the class before the margin was read)
    v = CASES["past-stop"][0]().verdict
    failed = [c for c in verdict_checks(v, noise=NOISE) if c.state == "fail"]
    assert [(c.what, c.text) for c in failed] == [("stream_problem", v.reason),
                                                  ("baseline_margin", f"baseline margin unknown: {v.reason}")]


def test_unscored_and_unknown_margins_fail_their_step():
    v = CASES["later-unscored"][0]().verdict
    assert v.later_unscored and not v.later_scored
    later = next(c for c in verdict_checks(v) if c.what == "later_tokens")
    assert later.state == "fail" and "could not be scored teacher-forced" in later.text
    v = CASES["margin-unreported"][0]().verdict
    assert v.margin_unknown_explained
    margin = next(c for c in verdict_checks(v) if c.what == "baseline_margin")
    assert margin.state == "fail" and margin.text == f"baseline margin unknown: {v.reason}"


def test_a_verdict_made_elsewhere_gets_the_generic_checks():
    """A verdict without a recorded rule (made by hand, or journalled before verdicts recorded it)
    shows the checks its fields support and never fails one from its reason's wording."""
    v = CASES["own-row-at-split"][0]().verdict
    v.rule, v.rejected_at = "", None
    checks = verdict_checks(v, noise=NOISE)
    assert not any(c.text == v.reason for c in checks)
    assert next(c for c in checks if c.what == "spec_margin").state == "warn"
    assert verdict_checks(None) == [Check("fail", "never judged: the run ended before this prompt finished",
                                          "never_judged")]


def _card_checks(page: str, pid: str) -> list[tuple[str, str]]:
    card = page.split(f'id="p-{pid}"')[1].split('<div class="card')[0]
    return [(s, unescape(t)) for s, t in re.findall(
        r'<li class="check check-(\w+)"><span class="mark mark-\w+">[^<]*</span>(.*?)</li>', card, re.S)]


def test_the_report_renders_the_checks_it_is_given_for_every_class():
    """report.html shows, per prompt, exactly the checks of the verdict (and the gate's budget for a
    near tie), in order; the judgement matches the verdict's class."""
    recs = [make() for make, _, _ in CASES.values()]
    run = make_run(recs)
    decision = decide(run)
    page = report.render_report_html(run, decision)
    for rec, (_, klass, _) in zip(recs, CASES.values()):
        assert rec.verdict.klass == klass
        checks = view.judgement(rec, run, decision)
        assert checks == prompt_checks(rec.verdict, run, decision)
        own = verdict_checks(rec.verdict, noise=run.threshold.noise)
        assert checks == (own + [decision.near_tie_budget] if klass == "near_tie" else own)
        if klass == "exact":
            assert f'id="p-{rec.prompt.id}"' not in page
            continue
        assert _card_checks(page, rec.prompt.id) == [(c.state, c.text) for c in checks]
        assert ("fail" in states(checks)) == (klass not in ("near_tie",))


@pytest.mark.parametrize("policy, fails", [
    (GatePolicy(max_near_tie=1.0), False),
    (GatePolicy(max_near_tie=0.0), True),
    (GatePolicy(max_near_tie=1.0, bit_exact=True), True),
])
def test_the_near_tie_budget_is_the_gates_one_rule(policy, fails):
    run = make_run([CASES["near_tie"][0](), CASES["exact"][0]()], policy)
    decision = decide(run)
    budget = decision.near_tie_budget
    assert budget == near_tie_budget(run, decision.counts)
    assert (budget.state == "fail") == fails == any("near-tie" in f for f in decision.failures)
    assert budget.numbers["near_tie"] == decision.counts["near_tie"] == 1
    assert view.judgement(run.records[0], run, decision)[-1] is budget
    md = report.render_report_md(run, decision)
    assert f"{budget.mark} {budget.text}" in md.replace("\\", "")


def test_verdicts_rebuilt_from_the_journal_give_the_same_checks(tmp_path):
    """The rule and the first rejected position are journalled with the verdict; whether the stream
    was scored teacher-forced is read from the scores the journal holds."""
    recs = [make() for make, _, _ in CASES.values()]
    run = make_run(recs)
    lines = [{"kind": "run", "schema": RESULTS_SCHEMA, "config": run.config.to_json(), "stop_token_ids": [STOP]},
             {"kind": "threshold", **run.threshold.to_json()}] + [r.to_json() for r in recs]
    (tmp_path / JOURNAL).write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    rebuilt = load_run(tmp_path)
    again = decide(rebuilt)
    decision = decide(run)
    for live, back in zip(run.records, rebuilt.records):
        assert back.verdict.to_json() == live.verdict.to_json()
        assert back.verdict.later_scored == live.verdict.later_scored
        assert view.judgement(back, rebuilt, again) == view.judgement(live, run, decision)
    assert {r.verdict.klass for r in rebuilt.records} == set(CLASSES)


def test_verdict_json_keeps_the_rule():
    v = CASES["own-row-at-split"][0]().verdict
    data = v.to_json()
    assert (data["rule"], data["rejected_at"]) == ("own_row_rejected", 2)
    back = Verdict.from_json(json.loads(json.dumps(data)))
    assert (back.rule, back.rejected_at, back.own_row_rejected_at_split) == ("own_row_rejected", 2, True)
    old = {k: val for k, val in data.items() if k not in ("rule", "rejected_at")}
    assert Verdict.from_json(old).rule == ""
