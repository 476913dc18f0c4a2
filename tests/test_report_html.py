"""The triage report (report.html, report.md) on constructed runs: no engine, no browser.

Self-contained (nothing fetched), everything from a run escaped, every non-exact prompt explained
from its verdict alone, and nothing missing from a run (no threshold, no fingerprint, an
interrupted or fatal run, prompts without a speculative result) crashes the rendering.
"""

from __future__ import annotations

import re
from html import unescape
from html.parser import HTMLParser

import pytest

from specparity import report
from specparity.compare import Divergence, Drift, TFViolation, TokenView, Verdict
from specparity.gate import decide
from specparity.noise import NearTieThreshold, NoiseStats
from specparity.prompts import Prompt
from specparity.records import GateConfig, GatePolicy, GateRun, PromptRecord
from specparity.runner import ResultsWriter
from specparity.types import ArtifactId, Fingerprint, GenerationResult, SpecStats, StepRecord, TokenScores

XSS = "<script>alert('x')</script>"


def _result(rid, ids, text, wall=0.5, steps=None, error=None, finish="length"):
    spec = SpecStats.from_steps(steps, "test steps") if steps is not None else SpecStats.unavailable("baseline")
    return GenerationResult(rid, list(ids), text, finish, TokenScores.empty(), spec, wall_s=wall, error=error)


def _record(pid, category, klass, reason, *, div=None, tf=(), drift=None, text="hello world", spec_text=None,
            threshold=0.25, spec=True, verdict=True, steps=None, error=None):
    p = Prompt(id=pid, category=category, lang="en", prompt=f"Prompt of {pid}")
    base = _result(pid, range(10), text, wall=0.5)
    sres = None
    if spec:
        sres = _result(pid, range(10), spec_text if spec_text is not None else text, wall=0.25,
                       steps=steps if steps is not None else [StepRecord(4, 2, 3), StepRecord(4, 4, 5)], error=error)
    v = None
    if verdict:
        v = Verdict(pid, category, klass, reason, divergence=div, tf_violations=list(tf), baseline_len=10,
                    spec_len=10, baseline_finish="length", spec_finish="length", threshold=threshold, drift=drift)
    return PromptRecord(p, baseline=base, spec=sres, verdict=v)


def _div(position=3, margin=0.0625, spec_margin=0.01, a=("1", 21), b=("2", 22), remerge=(5, 5),
         context="count: 4, 22, ", after_a="13, 7", after_b="23, 7", source="decode"):
    return Divergence(position, TokenView(a[1], a[0]), TokenView(b[1], b[0]), margin, 1, spec_margin, 1,
                      context, after_a, after_b, remerge, source)


def _fingerprint(extra=None):
    return Fingerprint("hf", "transformers 5.24.0", ArtifactId("/models/target", "a" * 64, "Qwen3ForCausalLM"),
                       ArtifactId("/models/draft", "b" * 64, "Qwen3ForCausalLM"), "bfloat16",
                       {"mode": "draft", "num_draft_tokens": 4}, extra if extra is not None else
                       {"attn_implementation": "sdpa", "kv_cache_dtype": "fp8_e4m3"})


def _threshold(nats=0.25, source="override"):
    return NearTieThreshold(nats, source, NoiseStats(0.167, 0.12, 400, 3000), 1.5, 2.0, "the 5 prompt(s) that ran")


def full_run(**kw) -> GateRun:
    """A run with one prompt of every class, an fp8-style near tie at margin 0.0625 <= 0.25."""
    recs = [
        _record("ok-1", "math", "exact", "identical token ids and finish reason"),
        _record("tie-1", "code", "near_tie", "position 3: '1' vs '2', baseline margin 0.0625 <= threshold 0.25",
                div=_div(), tf=[TFViolation(7, 30, 31, 0.02)],
                drift=Drift(0.668, 0.05, None, 0, 3)),
        _record("div-1", "code", "diverged", "position 2: baseline margin 9.06 nats between '1' and '8' exceeds",
                div=_div(2, 9.0625, None, remerge=None), tf=[TFViolation(4, 11, 12, None)]),
        _record("drift-1", "math", "drifted", "identical token ids, but drift",
                drift=Drift(0.668, 4.1, 2, 3, 9)),
        _record("err-1", "logic", "error", "speculative run failed: RuntimeError: boom", error="RuntimeError: boom"),
        _record("xss-" + XSS, "zz" + XSS, "diverged", "reason " + XSS,
                div=_div(1, 3.0, 0.5, a=(XSS, 5), b=("<b>", 6), context=XSS, after_a=XSS + " tail",
                         after_b="<b> tail"), text="out " + XSS, spec_text="spec " + XSS),
    ]
    run = GateRun(_fingerprint(), GateConfig(near_tie_nats=0.25, policy=GatePolicy(max_near_tie=1.0)), recs,
                  threshold=_threshold(), **kw)
    for r in recs:
        if r.spec is not None:
            run.coverage.add(r.spec.spec)
    run.timings.update({"baseline_decode": 3.0, "spec_decode": 1.5, "total": 6.0})
    run.scorer = "the engine: one teacher-forced pass"
    return run


def render(run):
    decision = decide(run)
    return report.render_report_html(run, decision), report.render_report_md(run, decision)


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
    assert sorted(a["data-class"] for a in cards) == ["diverged", "diverged", "drifted", "error", "near_tie"]
    assert page.count('<mark class="split base"') == 3 and page.count('<mark class="split spec"') == 3
    # speed: 10 tokens in 0.5 s without, 0.25 s with speculation
    assert "20.0" in page and "40.0" in page and "2.00×" in page
    # fingerprint and in-process launch
    assert "fp8_e4m3" in page and "in-process engine" in page
    assert "a" * 64 in page
    assert run.threshold.describe().split(";")[0] in page
    assert md.startswith("## specparity lossless gate: **FAIL**")


def test_near_tie_flip_is_explained_in_words():
    """An fp8 KV-cache near tie (margin 0.0625, one bf16 step) must be explainable from the report alone."""
    page, md = render(full_run())
    card = unescape(page.split('id="p-tie-1"')[1].split('class="card')[0])
    assert "baseline margin 0.0625 nats ≤ near-tie threshold 0.25 nats" in card
    assert "0.939× the probability" in card  # exp(-0.0625)
    assert "inside the measured noise itself" in card  # 0.0625 <= measured max 0.167
    assert "every later speculative token is the target's argmax under its own prefix within the threshold" in card
    assert "no latent drift before the split" in card
    assert "re-merge" in card and "baseline position 5" in card
    assert "near ties are allowed up to 100% of the prompts" in card
    assert "0.0625 ≤ threshold 0.25" in card  # the margin table says it too
    details = md.split("<code>tie-1</code>")[1].split("</details>")[0]
    assert "margin 0.0625 nats ≤ threshold 0.25" in md
    assert "✅ baseline margin 0.0625 nats ≤ near-tie threshold 0.25 nats" in details
    assert "```text" in details and "⟦1⟧" in details and "⟦2⟧" in details


def test_diverged_flip_says_which_check_failed():
    page, _ = render(full_run())
    card = unescape(page.split('id="p-div-1"')[1].split('class="card')[0])
    assert "baseline margin 9.062 nats > near-tie threshold 0.25 nats" in card
    assert "outside the top-k" in card and "do not re-merge" in card


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
        run.records.append(_record("late-1", "math", "", "", verdict=False, spec=False))
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
    cats, prompts = report.speed_rows(run)
    total = cats[-1]
    assert total.name == "total"
    timed = [r for r in run.records if r.spec is not None and not r.spec.error]
    assert total.prompts == len(timed) and total.base_tokens == 10 * len(timed)
    assert total.base_tps == pytest.approx(20.0) and total.spec_tps == pytest.approx(40.0)
    assert total.speedup == pytest.approx(2.0)
    assert total.accept_length == pytest.approx(run.activity().mean_accept_length)
    assert {p.name for p in prompts} == {r.prompt.id for r in timed}
    bars = report.accept_bars(run)
    assert [b.category for b in bars] == run.categories()


def test_markdown_pr_comment():
    run = full_run()
    _, md = render(run)
    assert md.count("<details>") == md.count("</details>") == 6  # five non-exact prompts + calibration
    assert "| category | exact | near_tie | drifted | diverged | error | prompts |" in md
    assert "| category | prompts | no spec tok/s | spec tok/s | speedup | accept length | acceptance |" in md
    assert "| **total** |" in md and "2.00×" in md
    class_rows = md.split("| category | exact")[1].split("\n\n")[0].splitlines()
    assert len(class_rows) == 1 + len(run.categories()) + 1 + 1  # header rest, separator, categories, total
    assert len({row.count("|") - row.count("\\|") for row in class_rows[1:]}) == 1  # escaped pipes stay in a cell


def test_markdown_stays_under_a_comment_limit():
    run = full_run()
    base = run.records[2]
    for i in range(200):
        rec = _record(f"many-{i:03d}", "code", "diverged", "x" * 400, div=_div(2, 9.0, None, remerge=None))
        run.records.append(rec)
    md = report.render_report_md(run, decide(run))
    assert len(md) <= report.MD_MAX_CHARS and "more non-exact prompt(s): see `report.html`" in md
    assert base.prompt.id in md


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
    def boom(run, decision):
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
    cats, prompts = report.speed_rows(run)
    assert run.records[0].prompt.id not in {p.name for p in prompts}


def test_a_long_broken_stream_stays_readable():
    """A 128K-token stream that violates at every position: the page stays bounded."""
    run = full_run()
    rec = run.records[2]
    rec.verdict.tf_violations = [TFViolation(i, 1, 2, 5.0) for i in range(3, 20_000)]
    rec.baseline.text = "x" * 500_000
    page, md = render(run)
    assert len(page) < 200_000 and len(md) < report.MD_MAX_CHARS
    svg = page.split('id="margin-plot"')[1].split("</svg>")[0]
    assert svg.count("<circle") <= 3 + 6 + 2 * report.MAX_LATER_POINTS + 3
    assert "… and 19977 more." in page and "(496000 more characters)" in page
