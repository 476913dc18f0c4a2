"""The triage report (report.html, report.md) and summary.md on runs judged by the real comparison.

Every verdict here is what :func:`specparity.judge.compare.compare` returned for constructed token
streams and rows (one prompt of each class, as in tests/test_compare.py): no engine, no browser.
What the report *says* about each class is pinned by snapshot files (``tests/__snapshots__/``,
rewritten by ``pytest --snapshot-update`` after a deliberate wording change); the assertions here
check what can be derived from the verdicts: the report's judgement of every prompt is the class
the comparison gave it, the page is self-contained, everything from a run is escaped, and nothing
missing from a run (no threshold, no fingerprint, an interrupted or fatal run, prompts without a
speculative result) crashes the rendering.

The rows hold binary fractions only (margins 0.0625, 9.0625, …), so every figure the report
prints is exact and the snapshots read the same on every CPU.
"""

from __future__ import annotations

import math
import re
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import pytest

from specparity.report import render as report
from specparity.report import view
from specparity.judge.compare import compare
from specparity.model.verdicts import CLASSES
from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import decide
from specparity.model.threshold import NearTieThreshold, NoiseStats
from specparity.model.prompts import Prompt
from specparity.model.gate_run import GateConfig, GatePolicy, GateRun, PromptRecord
from specparity.run.runner import ResultsWriter
from specparity.model.types import ArtifactId, Fingerprint, GenerationResult, SpecStats, StepRecord, TokenScores

XSS = "<script>alert('x')</script>"

K = 6
STOP = 0
MAX_NEW = 10
THRESHOLD = 0.25
#: Measured noise of the run (binary fractions): the drift bound (NearTieThreshold.drift_nats),
#: noise.DRIFT_MULTIPLIER times it, is exact in binary too.
NOISE = NoiseStats(0.125, 0.0625, 400, 3000)
#: Request seconds without and with speculation (every timed prompt has MAX_NEW tokens on each side).
BASE_S, SPEC_S = 0.5, 0.25
TOP_LP = -0.5

BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def decode(ids: Sequence[int]) -> str:
    return "".join(f" w{i}" for i in ids)


def rows(ids: Sequence[int], alt: dict[int, tuple[int, float]] | None = None) -> TokenScores:
    """Rows in which ``ids[i]`` is the argmax (logprob −0.5) and the runner-up sits 5 nats below,
    or ``alt[i] = (token, margin)`` replaces the runner-up; the rest of the top-k far below."""
    n = len(ids)
    top_ids = np.zeros((n, K), np.int64)
    top_lp = np.zeros((n, K), np.float32)
    for i, t in enumerate(ids):
        r, m = (alt or {}).get(i, (t + 100, 5.0))
        others = [200 + 10 * i + j for j in range(K - 2)]
        top_ids[i] = [t, r, *others]
        top_lp[i] = [TOP_LP, TOP_LP - m, *[-16.0 - j for j in range(K - 2)]]
    return TokenScores(np.array(ids, np.int64), top_lp[:, 0].copy(), top_ids, top_lp)


def threshold() -> NearTieThreshold:
    return NearTieThreshold(THRESHOLD, "override", NOISE, 1.5, 2.0, "the prompts that ran")


def _result(ids: Sequence[int], scores: TokenScores, text: str, wall: float, steps=None,
            error=None) -> GenerationResult:
    spec = SpecStats.from_steps(steps, "test steps") if steps is not None else SpecStats.unavailable("baseline")
    finish = "error" if error else "length"
    return GenerationResult("p", list(ids), text, finish, scores, spec, wall_s=wall, error=error)


def judged(pid: str, category: str, base_ids: Sequence[int], base_rows: TokenScores, spec_ids: Sequence[int],
           spec_rows: TokenScores, tf: TokenScores | None, *, error: str | None = None,
           dec: Callable[[Sequence[int]], str] = decode, text: str | None = None,
           spec_text: str | None = None) -> PromptRecord:
    """A prompt judged by :func:`compare` from these streams and rows (the run's threshold and drift bound)."""
    p = Prompt(id=pid, category=category, lang="en", prompt=f"Prompt of {pid}")
    base = _result(base_ids, base_rows, dec(base_ids) if text is None else text, BASE_S)
    spec = _result(spec_ids, spec_rows, dec(spec_ids) if spec_text is None else spec_text, SPEC_S,
                   steps=[StepRecord(4, 2, 3), StepRecord(4, 4, 5)], error=error)
    verdict = compare(pid, category, base, spec, tf, threshold=THRESHOLD, max_new_tokens=MAX_NEW, stop_ids=[STOP],
                      decode=dec, drift_nats=threshold().drift_nats)
    return PromptRecord(p, baseline=base, spec=spec, spec_tf=tf, verdict=verdict)


# ------------------------------------------------------------------------ one prompt of each class
def exact_case() -> PromptRecord:
    return judged("ok-1", "math", BASE, rows(BASE), BASE, rows(BASE), rows(BASE))


def near_tie_case() -> PromptRecord:
    """An fp8-style flip at position 3: the baseline's margin 0.0625 ≤ 0.25 (inside the measured noise
    0.125); the speculative row agrees up to 0.078 nats; later, one token the target prefers another
    over by 0.03125 (within the threshold); the streams re-merge at 5/5."""
    spec_ids = BASE[:3] + [31, 32] + BASE[5:]
    own = rows(spec_ids, {1: (112, 5.0625), 3: (14, 0.015625)})  # 0.0625 of drift at 1, under the bound
    tf = rows(spec_ids)
    tf.top_ids[7, :2] = [33, spec_ids[7]]
    tf.top_logprobs[7, 1] = tf.logprobs[7] = TOP_LP - 0.03125
    return judged("tie-1", "code", BASE, rows(BASE, {3: (31, 0.0625)}), spec_ids, own, tf)


def diverged_case() -> PromptRecord:
    """A flip at position 2 the baseline preferred by 9.0625 nats; the speculative row has no place
    for the baseline's token; a later token teacher-forced scoring did not hold (outside the top-k)."""
    spec_ids = BASE[:2] + list(range(41, 49))
    tf = rows(spec_ids)
    tf.top_ids[4, 0], tf.token_ids[4] = 49, -1
    return judged("div-1", "code", BASE, rows(BASE, {2: (41, 9.0625)}), spec_ids, rows(spec_ids), tf)


def drifted_case() -> PromptRecord:
    """Identical tokens, but from position 2 the speculative rows put the runner-up 4 nats closer."""
    own = rows(BASE, {i: (BASE[i] + 100, 1.0) for i in range(2, MAX_NEW)})
    return judged("drift-1", "math", BASE, rows(BASE), BASE, own, rows(BASE))


def error_case() -> PromptRecord:
    return judged("err-1", "logic", BASE, rows(BASE), [], TokenScores.empty(K), None, error="RuntimeError: boom")


def xss_case() -> PromptRecord:
    """A divergence whose id, category, tokens and texts are markup."""
    words = {50: XSS, 5: XSS, 6: "<b>"}

    def dec(ids: Sequence[int]) -> str:
        return "".join(words.get(i, " tail") for i in ids)

    base_ids, spec_ids = [50, 5] + BASE[2:], [50, 6] + BASE[2:]
    return judged("xss-" + XSS, "zz" + XSS, base_ids, rows(base_ids, {1: (6, 3.0)}), spec_ids,
                  rows(spec_ids, {1: (5, 0.5)}), rows(spec_ids), dec=dec, text="out " + XSS, spec_text="spec " + XSS)


def own_row_case() -> PromptRecord:
    """A split at a near-tie margin, but the speculative run's own row there prefers the baseline's
    token: the loop emitted a token its own verifier rejected."""
    spec_ids = BASE[:2] + [41] + BASE[3:]
    own = rows(spec_ids)
    own.top_ids[2, :2] = [BASE[2], 41]
    own.top_logprobs[2, 1] = own.logprobs[2] = TOP_LP - 0.0625
    return judged("own-1", "code", BASE, rows(BASE, {2: (41, 0.0625)}), spec_ids, own, rows(spec_ids))


def past_stop_case() -> PromptRecord:
    """The speculative stream goes on after a stop token."""
    spec_ids = BASE[:4] + [STOP] + BASE[5:]
    return judged("stop-1", "code", BASE, rows(BASE), spec_ids, rows(spec_ids), rows(spec_ids))


def split_drift_case() -> PromptRecord:
    """A near-tie margin at the split (0.0625), but the speculative row there prefers its token by
    1 nat: the two computations of one position are 1.0625 nats apart, beyond the drift bound."""
    spec_ids = BASE[:3] + [31] + BASE[4:]
    return judged("tie-drift-1", "math", BASE, rows(BASE, {3: (31, 0.0625)}), spec_ids,
                  rows(spec_ids, {3: (14, 1.0)}), rows(spec_ids))


#: More ways to reach a class, each judged by its own steps: (make, the class compare() gives it).
VARIANTS = {"diverged-own-row": (own_row_case, "diverged"), "diverged-past-stop": (past_stop_case, "diverged"),
            "drifted-at-split": (split_drift_case, "drifted")}

CASES = {"exact": exact_case, "near_tie": near_tie_case, "diverged": diverged_case, "drifted": drifted_case,
         "error": error_case}


def _fingerprint(extra=None):
    return Fingerprint("hf", "transformers 5.24.0", ArtifactId("/models/target", "a" * 64, "Qwen3ForCausalLM"),
                       ArtifactId("/models/draft", "b" * 64, "Qwen3ForCausalLM"), "bfloat16",
                       {"mode": "draft", "num_draft_tokens": 4}, extra if extra is not None else
                       {"attn_implementation": "sdpa", "kv_cache_dtype": "fp8_e4m3"})


def make_run(records: list[PromptRecord]) -> GateRun:
    run = GateRun(_fingerprint(), GateConfig(near_tie_nats=THRESHOLD, policy=GatePolicy(max_near_tie=1.0)), records,
                  threshold=threshold())
    for r in records:
        if r.spec is not None:
            run.coverage.add(r.spec.spec)
    run.timings.update({"baseline_decode": 3.0, "spec_decode": 1.5, "total": 6.0})
    run.scorer = "the engine: one teacher-forced pass"
    return run


def full_run() -> GateRun:
    """A run with one prompt of every class, in CASES order, and one whose everything is markup."""
    return make_run([make() for make in CASES.values()] + [xss_case()])


def render(run):
    decision = decide(run)
    return report.render_report_html(run, decision), report.render_report_md(run, decision)


def by_class(run: GateRun, klass: str) -> PromptRecord:
    return next(r for r in run.records if r.verdict.klass == klass)


def run_with(case: str) -> tuple[GateRun, PromptRecord]:
    """The full run, and its prompt of class ``case`` — or the full run with the variant ``case`` added."""
    run = full_run()
    if case in VARIANTS:
        run.records.append(VARIANTS[case][0]())
        if run.records[-1].spec is not None:
            run.coverage.add(run.records[-1].spec.spec)
        return run, run.records[-1]
    return run, by_class(run, case)


# --------------------------------------------------------------------------------- page helpers
class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def parse(page: str) -> list[tuple[str, dict]]:
    c = _Collect()
    c.feed(page)
    return c.tags


class _Text(HTMLParser):
    """The text a reader sees: one line per block element, no style or SVG."""

    BLOCKS = {"p", "li", "tr", "h1", "h2", "h3", "div", "pre", "summary", "table", "ul", "section", "br"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0
        self.spans: list[bool] = []  # open <span>s: whether each is a check's mark (✓ ✗ i !)

    def handle_starttag(self, tag, attrs):
        if tag in ("style", "svg"):
            self.hidden += 1
        if tag == "span":
            self.spans.append("mark" in (dict(attrs).get("class") or "").split())
        if tag in self.BLOCKS:
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" | ")

    def handle_endtag(self, tag):
        if tag in ("style", "svg"):
            self.hidden -= 1
        if tag == "span" and self.spans and self.spans.pop():
            self.parts.append(" ")
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.hidden:
            self.parts.append(data)


def page_text(html: str) -> str:
    p = _Text()
    p.feed(html)
    lines = (re.sub(r"[ \t]+", " ", line).strip() for line in "".join(p.parts).splitlines())
    return "\n".join(line for line in lines if line)


def card_html(page: str, pid: str) -> str:
    """The flip card of prompt ``pid`` (up to the next card or section)."""
    start = page.rindex("<div", 0, page.index(f'id="p-{pid}"'))
    card = '<div class="card' + page[start:].split('<div class="card')[1]
    return card.split("</section>")[0]


def md_details(md: str, pid: str) -> str:
    """The ``<details>`` block of prompt ``pid`` in report.md."""
    start = md.rindex("<details>", 0, md.index(f"<code>{pid}</code>"))
    return md[start:].split("</details>")[0] + "</details>"


def summary_section(summary: str, pid: str) -> str:
    return summary.split(f"### `{pid}`")[1].split("\n### ")[0].split("\n## ")[0]


def normalise(text: str) -> str:
    """Snapshot text without what varies between machines: the checkout and home paths."""
    for path, name in ((str(REPO_ROOT), "<repo>"), (str(Path.home()), "<home>")):
        text = text.replace(path, name)
    return re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?", "<timestamp>", text)


def assert_self_contained(page: str) -> None:
    tags = parse(page)
    for tag, attrs in tags:
        for key in ("src", "href", "srcset", "data", "action", "poster", "xlink:href"):
            val = (attrs.get(key) or "").strip().lower()
            assert not re.match(r"^(https?:)?//", val), (tag, key, val)
            if key != "href":
                assert not val or val.startswith("data:"), (tag, key, val)
        assert tag not in ("script", "link", "iframe", "object", "embed", "base"), tag
    css = "".join(re.findall(r"<style>(.*?)</style>", page, re.S))
    assert "@import" not in css and "url(" not in css


# ------------------------------------------------------------------------------ the verdicts
@pytest.mark.parametrize("case", [*CASES, *VARIANTS])
def test_each_case_is_judged_by_compare_as_its_class(case):
    """The streams above make the real comparison return each class (what every other test relies on)."""
    make, klass = VARIANTS[case] if case in VARIANTS else (CASES[case], case)
    v = make().verdict
    assert v.klass == klass, v.reason
    assert set(CASES) == set(CLASSES)


@pytest.mark.parametrize("case", [*CLASSES, *VARIANTS])
def test_report_judgement_matches_the_verdict(case, tmp_path):
    """For every class, report.html, report.md and summary.md judge the prompt as compare() did."""
    run, rec = run_with(case)
    decision = decide(run)
    report.write_reports(run, decision, tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    v, pid = rec.verdict, rec.prompt.id
    klass = v.klass
    n = sum(1 for r in run.records if r.verdict.klass == klass)
    assert decision.counts[klass] == n
    assert f"| {klass} | {n} |" in summary
    total_row = page.split('<tr class="total">')[1].split("</tr>")[0]
    cells = re.findall(r'<td class="n[^"]*">(\d+)</td>', total_row)
    assert int(cells[CLASSES.index(klass)]) == n
    if klass == "exact":
        assert f'id="p-{pid}"' not in page and f"<code>{pid}</code>" not in md and f"### `{pid}`" not in summary
        return
    cards = {a["id"]: a["data-class"] for t, a in parse(page) if t == "div" and "flip" in (a.get("class") or "")}
    assert cards[f"p-{pid}"] == klass
    card = card_html(page, pid)
    assert f'<span class="badge k-{klass}">{klass}</span> <code>{pid}</code>' in card
    index = page.split('id="flip-index"')[1].split("</table>")[0]
    assert f'<code>{pid}</code></a></td><td><span class="badge k-{klass}">{klass}</span>' in index
    assert f"<summary><b>{klass}</b> <code>{pid}</code>" in md
    section = summary_section(summary, pid)
    assert section.startswith(f" — {klass}\n") and v.reason in section
    assert unescape(card.split('<p class="reason"><strong>Reason:</strong> ')[1].split("</p>")[0]) == v.reason
    # the steps shown are the report's judgement of this record, in both reports
    states = re.findall(r'<li class="check check-(\w+)">', card)
    checks = view.judgement(rec, run, decision)
    assert states == [c.state for c in checks] and states
    assert md_details(md, pid).count("❌") == states.count("fail")
    if klass == "near_tie":
        assert "fail" not in states
    d = v.divergence
    if d is not None and d.baseline_margin is not None:
        sign = "≤" if d.baseline_margin <= v.threshold else ">"
        assert sign == "≤" or klass == "diverged"  # a margin above the threshold is never excused
        assert f"{sign} threshold {v.threshold:.4g}" in unescape(card)
        assert f"margin {d.baseline_margin:.4g} nats {sign} threshold {v.threshold:.4g}" in md


@pytest.mark.parametrize("case", [
    *(c for c in [*CLASSES, *VARIANTS] if c not in ("exact", "near_tie")),
])
def test_every_class_but_near_tie_fails_a_step(case):
    """A prompt that is not exact or a near tie has a step of its judgement that says why (✗)."""
    run, rec = run_with(case)
    checks = view.judgement(rec, run, decide(run))
    assert any(c.state == "fail" for c in checks), [(c.state, c.text) for c in checks]


@pytest.mark.parametrize("case", [*CLASSES, *VARIANTS])
def test_report_wording_per_class(case, snapshot):
    """What the three reports say about a prompt of each class (the snapshot pins the wording)."""
    run, rec = run_with(case)
    decision = decide(run)
    page, md = render(run)
    summary = report.render_summary_md(run, decision)
    pid = rec.prompt.id
    if rec.verdict.klass == "exact":
        shown = {"summary.md class row": next(line for line in summary.splitlines() if line.startswith("| exact |"))}
    else:
        shown = {"report.html card": page_text(card_html(page, pid)),
                 "report.md details": md_details(md, pid).strip(),
                 "summary.md section": summary_section(summary, pid).strip()}
    assert {k: normalise(v) for k, v in shown.items()} == snapshot


def test_whole_reports_wording(snapshot):
    """Every section of the three reports of the full run, as text (the page without its CSS and plots)."""
    run = full_run()
    decision = decide(run)
    page, md = render(run)
    summary = report.render_summary_md(run, decision)
    shown = {"report.html": page_text(page), "report.md": md, "summary.md": summary}
    assert {k: normalise(v) for k, v in shown.items()} == snapshot


# ------------------------------------------------------------------------------ the page
def test_full_report_is_self_contained_and_complete():
    run = full_run()
    page, md = render(run)
    assert_self_contained(page)
    tags = parse(page)
    ids = {a.get("id") for _, a in tags}
    for section in ("verdict", "classes", "flips", "margins", "speculation", "calibration", "coverage", "fingerprint",
                    "timings", "class-table", "speed-table", "margin-plot", "accept-plot", "flip-index"):
        assert section in ids, section
    assert sum(1 for t, _ in tags if t == "svg") == 2
    assert 'id="verdict-status">FAIL<' in page
    # each non-exact prompt has a card with both streams and the split marked on each side
    cards = [a for t, a in tags if t == "div" and "flip" in (a.get("class") or "")]
    assert sorted(a["data-class"] for a in cards) == sorted(r.verdict.klass for r in run.records
                                                           if r.verdict.klass != "exact")
    splits = sum(1 for r in run.records if r.verdict.divergence is not None)
    assert splits >= 3
    assert page.count('<mark class="split base"') == splits and page.count('<mark class="split spec"') == splits
    # speed: MAX_NEW tokens in BASE_S without, SPEC_S with speculation
    assert f"{MAX_NEW / BASE_S:.1f}" in page and f"{MAX_NEW / SPEC_S:.1f}" in page
    assert f"{BASE_S / SPEC_S:.2f}×" in page
    # fingerprint and in-process launch
    assert "fp8_e4m3" in page and "in-process engine" in page
    assert "a" * 64 in page
    assert run.threshold.describe().split(";")[0] in page
    assert md.startswith("## specparity lossless gate: **FAIL**")


def test_near_tie_flip_is_explained_from_its_verdict():
    """An fp8 KV-cache near tie must be explainable from the report alone: the figures it gives are
    the verdict's own (the words are in the snapshot)."""
    run = full_run()
    page, md = render(run)
    rec = by_class(run, "near_tie")
    v, d = rec.verdict, rec.verdict.divergence
    card = unescape(card_html(page, rec.prompt.id))
    n = None if d.margin_ulps is None else round(d.margin_ulps)
    ulps = "" if n is None else f" ({n:g} ulp{'s' if n != 1 else ''} of {d.ulp_nats:g} at this row's resolution)"
    assert f"baseline margin {d.baseline_margin:.4g} nats{ulps} ≤ near-tie threshold {v.threshold:.4g} nats" in card
    assert f"{math.exp(-d.baseline_margin):.3f}× the probability" in card
    assert d.baseline_margin <= run.threshold.flip_noise and "inside the measured noise itself" in card
    later = [t for t in v.tf_violations if t.position > d.position]
    assert later and all(t.margin <= v.threshold for t in later)
    assert f"{len(later)} position(s) differ by at most {max(t.margin for t in later):.3g} nats" in card
    assert v.drift is not None and v.drift.start is None and v.drift.max_nats > 0
    assert f"stay within {v.drift.max_nats:.3g} nats" in card
    assert d.remerge and f"baseline position {d.remerge[0]}" in card
    assert f"{run.config.policy.max_near_tie:.0%} of the prompts" in card
    assert f"{d.baseline_margin:.6g} ≤ threshold {v.threshold:.4g}" in card  # the margin table says it too
    details = md_details(md, rec.prompt.id)
    assert f"✅ baseline margin {d.baseline_margin:.4g} nats{ulps} ≤ near-tie threshold {v.threshold:.4g} nats" in details
    assert "```text" in details
    assert f"⟦{d.baseline_token.text}⟧" in details and f"⟦{d.spec_token.text}⟧" in details


def test_diverged_flip_says_which_check_failed():
    run = full_run()
    page, _ = render(run)
    rec = by_class(run, "diverged")
    v, d = rec.verdict, rec.verdict.divergence
    card = unescape(card_html(page, rec.prompt.id))
    assert d.baseline_margin > v.threshold
    assert f"baseline margin {d.baseline_margin:.4g} nats > near-tie threshold {v.threshold:.4g} nats" in card
    unscored = [t for t in v.tf_violations if t.position > d.position and t.margin is None]
    assert unscored and "outside the top-k" in card
    assert d.remerge is None and "do not re-merge" in card


def test_everything_from_the_run_is_escaped():
    page, md = render(full_run())
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(" in page
    assert "<b>" not in page and "&lt;b&gt;" in page  # the template itself uses <strong>, never <b>
    # the plots escape what they take from the run (prompt ids in tooltips)
    svg = page.split('id="margin-plot"')[1].split("</svg>")[0]
    assert "<script" not in svg and "xss-&lt;script&gt;" in svg
    # markdown: raw HTML from the run never reaches GitHub's renderer outside code
    outside_code = re.sub(r"```.*?```", "", md, flags=re.S)
    outside_code = re.sub(r"`[^`\n]*`", "", outside_code)
    assert "<script" not in outside_code.lower()
    assert "&lt;script&gt;" in md


@pytest.mark.parametrize("case", ["no_threshold", "no_fingerprint", "interrupted", "fatal", "no_spec", "empty",
                                  "calibration_error", "not_run", "no_counters", "aggregate_only", "concurrent"])
def test_missing_pieces_render(case):
    run = full_run()
    if case == "no_threshold":
        run.threshold = None
    elif case == "no_fingerprint":
        run.fingerprint = None
    elif case == "interrupted":
        run.interrupted = True
        for r in run.records[3:]:
            r.verdict = None
    elif case == "fatal":
        run.fatal = "ConnectionError: server went away\nTraceback ...\n  " + XSS
    elif case == "no_spec":
        for r in run.records:
            r.spec = None
    elif case == "empty":
        run.records = []
    elif case == "calibration_error":
        run.calibration_error = "the measured near-tie threshold 57.85 nats exceeds the ceiling 2 nats"
        run.threshold = None
    elif case == "not_run":
        run.records.append(PromptRecord(Prompt(id="late-1", category="math", lang="en", prompt="Prompt of late-1"),
                                        baseline=_result(BASE, rows(BASE), decode(BASE), BASE_S)))
    elif case == "no_counters":
        for r in run.records:
            if r.spec is not None:
                r.spec.spec = SpecStats.unavailable("no counters")
    elif case == "aggregate_only":  # a server that reports run-wide counters only (vLLM /metrics)
        for r in run.records:
            if r.spec is not None:
                r.spec.spec = SpecStats.unavailable("totals only")
        run.aggregate = SpecStats(True, proposed=100, accepted=60, verify_steps=40, source="aggregate counters")
    elif case == "concurrent":
        run.concurrency = 4
    page, md = render(run)
    assert_self_contained(page)
    assert "<script" not in page.lower()
    assert md.startswith("## specparity lossless gate:")
    if case == "aggregate_only":
        assert "60 of 100 draft tokens accepted" in page and "accept length <strong>2.50</strong>" in page
        assert "| **total** |" in md and "| 2.50 |" in md
    if case == "concurrent":
        assert "4 requests were in flight per phase, so these are per-request speeds" in unescape(page)
    if case == "no_threshold":
        assert "not measured" in page and "(from the verdicts)" in page
    if case == "no_fingerprint":
        assert "stopped before the engine was fingerprinted" in page
    if case == "interrupted":
        assert 'id="verdict-status">INTERRUPTED<' in page and "never judged" in page and "not run" in page
    if case == "fatal":
        assert 'id="fatal"' in page and "server went away" in md and "&lt;script&gt;" in page
    if case == "no_spec":
        assert 'id="accept-plot"' not in page and "activity unknown" in page
    if case == "empty":
        assert "every prompt is exact" in page and 'id="margin-plot"' not in page
    if case == "calibration_error":
        assert "could not be calibrated" in page and "57.85" in md
    if case == "not_run":
        assert "late-1" in page and "never judged" in page
    if case == "no_counters":
        assert "activity unknown" in page


def test_server_launch_commands_and_running_servers():
    run = full_run()
    run.fingerprint = _fingerprint({"baseline_urls": ["http://127.0.0.1:8001"], "spec_urls": ["http://127.0.0.1:8002"],
                                    "launch": {"baseline": ["llama-server -m t.gguf --port 8001"],
                                               "spec": ["llama-server -m t.gguf -md d.gguf --port 8002"]}})
    run.attachments = [("llama-server-spec", "/tmp/r/llama-server-spec.log")]
    page, md = render(run)
    assert_self_contained(page)
    assert "servers launched by the gate" in page and "llama-server -m t.gguf -md d.gguf --port 8002" in page
    assert "launch (spec): `llama-server -m t.gguf -md d.gguf --port 8002`" in md
    assert "/tmp/r/llama-server-spec.log" in page
    run.fingerprint = _fingerprint({"baseline_urls": ["http://127.0.0.1:8001"], "spec_urls": ["http://h:2"],
                                    "launch": {"baseline": [], "spec": []}})
    page, _ = render(run)
    assert "servers already running, not launched by the gate" in page and "http://h:2" in page
    assert_self_contained(page)


def test_speed_and_accept_length_per_category():
    run = full_run()
    cats, prompts = view.speed_rows(run)
    total = cats[-1]
    assert total.name == "total"
    timed = [r for r in run.records if r.spec is not None and not r.spec.error]
    assert total.prompts == len(timed) and total.base_tokens == MAX_NEW * len(timed)
    assert total.base_tps == pytest.approx(MAX_NEW / BASE_S) and total.spec_tps == pytest.approx(MAX_NEW / SPEC_S)
    assert total.speedup == pytest.approx(BASE_S / SPEC_S)
    assert total.accept_length == pytest.approx(run.activity().mean_accept_length)
    assert {p.name for p in prompts} == {r.prompt.id for r in timed}
    bars = view.accept_bars(run)
    assert [b.category for b in bars] == run.categories()


def test_markdown_pr_comment():
    run = full_run()
    _, md = render(run)
    non_exact = sum(1 for r in run.records if r.verdict.klass != "exact")
    assert md.count("<details>") == md.count("</details>") == non_exact + 1  # the prompts + calibration
    assert "| category | exact | near_tie | drifted | diverged | error | prompts |" in md
    assert "| category | prompts | no spec tok/s | spec tok/s | speedup | accept length | acceptance |" in md
    assert "| **total** |" in md and f"{BASE_S / SPEC_S:.2f}×" in md
    class_rows = md.split("| category | exact")[1].split("\n\n")[0].splitlines()
    assert len(class_rows) == 1 + len(run.categories()) + 1 + 1  # header rest, separator, categories, total
    assert len({row.count("|") - row.count("\\|") for row in class_rows[1:]}) == 1  # escaped pipes stay in a cell


def test_markdown_stays_under_a_comment_limit():
    """Many diverged prompts whose tokens decode to long texts: report.md keeps to GitHub's comment limit."""
    run = full_run()
    first = by_class(run, "diverged")

    def long_words(ids):
        return "".join(f" {i:03d}" + "x" * 300 for i in ids)

    spec_ids = BASE[:2] + list(range(41, 49))
    for i in range(200):
        rec = judged(f"many-{i:03d}", "code", BASE, rows(BASE, {2: (41, 9.0625)}), spec_ids, rows(spec_ids),
                     rows(spec_ids), dec=long_words)
        assert rec.verdict.klass == "diverged", rec.verdict.reason
        run.records.append(rec)
    md = report.render_report_md(run, decide(run))
    assert len(md) <= view.MD_MAX_CHARS and "more non-exact prompt(s): see `report.html`" in md
    assert first.prompt.id in md


def test_write_reports_and_derived_files(tmp_path):
    run = full_run()
    summary = report.write_reports(run, decide(run), tmp_path)
    assert summary == tmp_path / "summary.md"
    for name in ("summary.md", "report.html", "report.md"):
        assert (tmp_path / name).stat().st_size > 0
        assert name in report.DERIVED_FILES
    ResultsWriter(str(tmp_path)).close()  # a new run removes every derived file first
    assert not any((tmp_path / name).exists() for name in report.DERIVED_FILES)


def test_a_report_that_fails_to_render_keeps_the_summary(tmp_path, monkeypatch):
    def boom(run, decision, reproducers=None):
        raise RuntimeError("template broke " + XSS)

    monkeypatch.setattr(report, "render_report_html", boom)
    run = full_run()
    report.write_reports(run, decide(run), tmp_path)
    page = (tmp_path / "report.html").read_text()
    assert "rendering this report failed" in page and "&lt;script&gt;" in page and "<script" not in page
    assert (tmp_path / "summary.md").exists() and (tmp_path / "report.md").exists()


def test_golden_and_resumed_runs():
    run = full_run()
    run.golden_error = "no golden recorded at goldens/x.json " + XSS
    run.golden_notes = ["golden recorded 2026-01-01 under fingerprint abc"]
    run.resumed_baselines, run.resumed_verdicts = 3, 2
    run.records[0].baseline_from = "golden"
    page, md = render(run)
    assert_self_contained(page)
    assert "The golden could not be used" in page and "&lt;script&gt;" in page and "<script" not in page
    assert "golden recorded 2026-01-01" in page and "3 baseline(s) and 2 verdict(s) reused" in page
    assert "baseline(s) from the golden are left out" in page and "golden baseline(s) left out" in md
    cats, prompts = view.speed_rows(run)
    assert run.records[0].prompt.id not in {p.name for p in prompts}


def test_a_long_broken_stream_stays_readable():
    """A 20,000-token stream that diverges early and that teacher-forced scoring rejects at every later
    position, with a 500,000-character output: the page stays bounded."""
    n = 20_000
    ids = [1 + i % 97 for i in range(n)]
    spec_ids = list(ids)
    spec_ids[2] = 500
    tf = rows(spec_ids)
    tf.top_ids[3:, :2] = tf.top_ids[3:, 1::-1].copy()  # from 3 on the target prefers the runner-up by 5 nats
    tf.top_logprobs[3:, 1] = tf.logprobs[3:] = TOP_LP - 5.0
    p = Prompt(id="long-1", category="code", lang="en", prompt="Prompt of long-1")
    base = _result(ids, rows(ids, {2: (500, 9.0625)}), "x" * 500_000, BASE_S)
    spec = _result(spec_ids, rows(spec_ids), decode(spec_ids[:100]), SPEC_S)
    v = compare("long-1", "code", base, spec, tf, threshold=THRESHOLD, max_new_tokens=n, stop_ids=[STOP],
                decode=decode, drift_nats=threshold().drift_nats)
    assert v.klass == "diverged" and len(v.tf_violations) == n - 3, v.reason
    run = full_run()
    run.records.append(PromptRecord(p, baseline=base, spec=spec, spec_tf=tf, verdict=v))
    page, md = render(run)
    assert len(page) < 200_000 and len(md) < view.MD_MAX_CHARS
    svg = page.split('id="margin-plot"')[1].split("</svg>")[0]
    flips = sum(1 for r in run.records if r.verdict.divergence is not None)
    later = sum(min(view.MAX_LATER_POINTS, sum(1 for t in r.verdict.tf_violations
                                                 if t.position > r.verdict.divergence.position))
                for r in run.records if r.verdict.divergence is not None)
    assert svg.count("<circle") <= 3 + 2 * flips + 2 * later
    shown = 20  # the card lists the first teacher-forced violations
    assert f"… and {len(v.tf_violations) - shown} more." in page
    assert f"({500_000 - view.FULL_TEXT_CHARS} more characters)" in page
