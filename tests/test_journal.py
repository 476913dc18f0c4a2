"""Every report rebuilds from the journal alone: ``load_run`` gives back the run the gate judged."""

from __future__ import annotations

import pytest

from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.gate.decision import decide
from specparity.run.journal import JournalError, load_run, read_journal
from specparity.model.prompts import load_many
from specparity.model.gate_run import GateConfig
from specparity.report.render import render_summary_md
from specparity.run.runner import conclude, run_gate


#: Prompts per category of the run whose journal is rebuilt, and its token budget: enough for the
#: broken loop to leave exact, drifted and diverged prompts in the journal, not a measurement.
PER_CATEGORY, MAX_NEW_TOKENS = 2, 24


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    from specparity.model.locations import REPO_ROOT

    out = tmp_path_factory.mktemp("journal")
    every = load_many([REPO_ROOT / "prompts" / "default.jsonl"])
    prompts = [p for c in ("math", "code") for p in [q for q in every if q.category == c][:PER_CATEGORY]]
    engine = load_engine(f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create",
                         EngineOptions(extra={"bug": "short_crop"}))
    try:
        run = run_gate(engine, prompts, GateConfig(report_dir=str(out), max_new_tokens=MAX_NEW_TOKENS))
    finally:
        engine.close()
    return run, conclude(run), out


def test_rebuilt_run_decides_and_reports_the_same(broken_run):
    run, decision, out = broken_run
    rebuilt = load_run(out)
    again = decide(rebuilt)
    assert again.to_json() == decision.to_json()
    assert decision.counts["diverged"] > 0, "the broken loop must give the journal something to rebuild"
    assert [r.verdict.to_json() for r in rebuilt.records] == [r.verdict.to_json() for r in run.records]
    assert rebuilt.threshold.to_json() == run.threshold.to_json()
    # one in-process instance: no noise between two instances to measure, and the summary says so
    assert rebuilt.threshold.cross is None and rebuilt.threshold.describe_cross().startswith("not applicable")
    assert "- Cross-instance noise: not applicable" in (out / "summary.md").read_text()
    assert rebuilt.coverage.to_json() == run.coverage.to_json()
    assert rebuilt.fingerprint.to_json() == run.fingerprint.to_json()
    assert render_summary_md(rebuilt, again) == (out / "summary.md").read_text()


def test_a_half_written_last_line_is_ignored(broken_run, tmp_path):
    _run, decision, out = broken_run
    lines = (out / "results.jsonl").read_text().splitlines()
    cut = tmp_path / "results.jsonl"
    cut.write_text("\n".join(lines[:-3]) + "\n" + lines[-3][: len(lines[-3]) // 2])
    journal = read_journal(cut)
    assert "verdict" not in journal.segment_kinds and "timings" not in journal.segment_kinds
    assert len(load_run(cut).records) == len(_run.records)


def test_a_corrupted_line_names_file_and_line(broken_run, tmp_path):
    _run, _decision, out = broken_run
    lines = (out / "results.jsonl").read_text().splitlines()
    bad = tmp_path / "results.jsonl"
    bad.write_text("\n".join(lines[:2] + ["{oops"] + lines[2:]) + "\n")
    with pytest.raises(JournalError, match=r"results.jsonl:3: not JSON"):
        read_journal(bad)
    bad.write_text("\n".join(lines[:2] + ['{"kind": "telemetry"}'] + lines[2:]) + "\n")
    with pytest.raises(JournalError, match=r"results.jsonl:3: kind 'telemetry': expected one of"):
        read_journal(bad)


@pytest.mark.parametrize("field, flag, before, after", [
    ("scorer_model", "--scorer-model", "/models/a", "/models/b"),
    ("near_tie_ceiling", "--near-tie-ceiling", 2.0, 5.0),
    ("near_tie_nats", "--near-tie-nats", None, 0.5),
])
def test_resume_refuses_a_scorer_or_threshold_setting_that_changed(tmp_path, field, flag, before, after):
    """The scorer's weights and the ceiling decide what the finished prompts were judged by: a resumed
    run under others would mix two judgements in one journal."""
    from dataclasses import replace

    from specparity.run.journal import Journal
    from specparity.run.setup import BadInput
    from specparity.cli.options import check_resumable

    old = replace(GateConfig(), **{field: before})
    journal = Journal(tmp_path / "results.jsonl", {"config": old.to_json()})
    check_resumable(journal, replace(GateConfig(), **{field: before}))  # the same: resumable
    with pytest.raises(BadInput) as exc:
        check_resumable(journal, replace(GateConfig(), **{field: after}))
    assert str(exc.value) == (f"--resume: {flag} differs from the interrupted run's ({before!r} there, {after!r} now); "
                              "resume with the same options or start a new run")
