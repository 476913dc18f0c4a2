"""``specparity record``, ``compare`` and ``report`` run for real: exit codes, JSON, and a report
rebuilt from the journal alone; plus the committed golden still matches its prompt file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.run.golden import load_golden
from specparity.model.prompts import load_many
from prompt_subsets import SHORT

TESTS = REPO_ROOT / "tests"
SPECPARITY = str(Path(sys.executable).with_name("specparity"))
SELECT = ("--categories", "math", "--calibration", "selected")
COMMITTED = REPO_ROOT / "golden" / "dflash-float32.jsonl"


def cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    # the checkout under test first: the console script alone would import whichever copy pip installed
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS)])}
    return subprocess.run([SPECPARITY, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def test_committed_golden_matches_prompts_and_fixtures():
    from specparity.engines.common import artifact

    g = load_golden(COMMITTED)
    prompts = load_many([REPO_ROOT / "prompts" / "default.jsonl"])
    stale = [p.id for p in prompts if g.entry_for(p) is None]
    assert not stale, f"re-record {COMMITTED.name} (golden/README.md): prompts added or edited since: {stale}"
    assert g.fields["engine"] == "dflash" and g.fields["dtype"] == "float32"
    assert g.fields["target"]["sha256"] == artifact(fixture_dir("target"), "").sha256


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``specparity ARGS`` in this process (the console script calls the same ``main``): its exit code
    and what it printed on stdout."""
    from specparity.cli import commands as cli_main

    code = cli_main.main(list(args))
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_record_compare_report(tmp_path, capsys, default_prompts):
    # the console script end to end once (recording); the other commands in-process, on 12 tokens a prompt
    golden = tmp_path / "g.jsonl"
    rec = cli("record", "--golden", str(golden), *SELECT, *SHORT, "--report", "", "--json")
    assert rec.returncode == exitcodes.PASS, rec.stderr[-2000:]
    out = json.loads(rec.stdout)
    assert out["status"] == "PASS" and out["threshold"]["nats"] > 0
    math = sum(p.category == "math" for p in default_prompts)
    assert len(load_golden(golden).entries) == math

    code, again = main(capsys, "record", "--golden", str(golden), "--dtype", "bfloat16", *SELECT, *SHORT, "--report", "")
    assert code == exitcodes.GATE_FAILED and "--update-golden=force" in again

    report = tmp_path / "spec"
    code, _ = main(capsys, "run", "--engine", f"{TESTS / 'broken_loops.py'}:create", "--engine-opt", "bug=short_crop",
                   *SELECT, *SHORT, "--report", str(report), "--json")
    assert code == exitcodes.GATE_FAILED

    code, judged = main(capsys, "compare", str(golden), str(report), "--json")
    assert code == exitcodes.GATE_FAILED, judged[-2000:]
    data = json.loads(judged)
    assert data["counts"]["diverged"] >= 1
    assert {p["prompt_id"] for p in data["prompts"]} == {p.id for p in load_many([REPO_ROOT / "prompts" / "default.jsonl"])
                                                        if p.category == "math"}
    code, same = main(capsys, "compare", str(golden), str(golden))
    assert code == exitcodes.PASS and f"exact {math}," in same

    (report / "summary.md").unlink()
    (report / "report.html").unlink(missing_ok=True)
    code, rebuilt = main(capsys, "report", str(report))
    assert code == exitcodes.GATE_FAILED and "FAIL" in rebuilt
    assert (report / "summary.md").is_file() and (report / "report.html").is_file()


def test_bad_inputs_are_one_line(tmp_path, capsys):
    """Each is refused before any model loads (in this process: the exit code and what went to stderr)."""
    from specparity.cli import commands as cli_main

    def refused(*args: str) -> str:
        code = cli_main.main(list(args))
        err = capsys.readouterr().err
        assert code == exitcodes.BAD_INPUT, err
        return err

    err = refused("compare", str(tmp_path / "nope.jsonl"), str(tmp_path))
    assert "OLD" in err and "no such file" in err
    (tmp_path / "results.jsonl").write_text('{"kind": "prompt"}\n')
    assert "results.jsonl:1:" in refused("report", str(tmp_path))
    assert "--golden" in refused("record", *SELECT)


# --------------------------------------------------------------------------- compare: errors and activity


@pytest.fixture(scope="module")
def journal(tmp_path_factory) -> Path:
    """A real journal: two math prompts gated in-process by `specparity run` (dflash on the fixtures)."""
    from specparity.cli import commands as cli_main

    root = tmp_path_factory.mktemp("journal")
    lines = (REPO_ROOT / "prompts" / "default.jsonl").read_text().splitlines()
    chosen = [line for line in lines[1:] if line.strip() and json.loads(line)["category"] == "math"][:2]
    prompts = root / "two.jsonl"
    prompts.write_text(lines[0] + "\n" + "\n".join(chosen) + "\n")
    assert cli_main.main(["run", "--prompts", str(prompts), "--calibration", "selected", "--max-new-tokens", "12",
                          "--report", str(root / "r"), "--quiet"]) == exitcodes.PASS
    return root / "r" / "results.jsonl"


def _rewrite(journal: Path, out: Path, edit) -> Path:
    """A copy of ``journal`` with each line passed through ``edit`` (which returns a list of lines)."""
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    out.write_text("".join(json.dumps(y) + "\n" for x in lines for y in edit(x)))
    return out


def _compare(capsys, *args: str) -> tuple[int, dict]:
    from specparity.cli import commands as cli_main

    code = cli_main.main(["compare", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_compare_of_a_journal_with_itself_passes(capsys, journal):
    code, doc = _compare(capsys, str(journal), str(journal))
    assert code == exitcodes.PASS, doc
    assert {p["class"] for p in doc["prompts"]} == {"exact"}


@pytest.mark.parametrize("only_common", [False, True])
def test_compare_keeps_news_errored_prompts_as_errors(capsys, tmp_path, journal, only_common):
    """A prompt that errored in NEW is an error naming NEW's cause, never dropped (also under --only-common)."""
    ids = [x["prompt"]["id"] for x in map(json.loads, journal.read_text().splitlines()) if x["kind"] == "prompt"]

    def fail_first(line):
        if line["kind"] == "prompt" and line["prompt"]["id"] == ids[0]:
            line["spec"]["error"] = "HTTP 500 from the speculative server"
        return [line]

    new = _rewrite(journal, tmp_path / "new.jsonl", fail_first)
    code, doc = _compare(capsys, str(journal), str(new), *(["--only-common"] if only_common else []))
    assert code == exitcodes.GATE_FAILED, doc
    verdicts = {p["prompt_id"]: p for p in doc["prompts"]}
    assert set(verdicts) == set(ids)
    assert verdicts[ids[0]]["class"] == "error"
    assert verdicts[ids[0]]["reason"].startswith("errored in NEW") and "HTTP 500" in verdicts[ids[0]]["reason"]
    assert verdicts[ids[1]]["class"] == "exact"


def test_compare_applies_the_activity_rule_to_news_speculative_output(capsys, tmp_path, journal):
    """NEW's journal holds only run-wide aggregate counters (as a vLLM run's does), and they show no draft
    accepted: speculation inactive, a failure. The same journal without any counters is "activity
    unknown", a failure as in the gate: nothing shows it speculated; allowed only by the policy's
    allow_unknown_activity or by NEW's own run having allowed it. Counters that other traffic on
    the server may have moved are unknown too."""
    def aggregate_only(accepted):
        def edit(line):
            if line["kind"] == "prompt":
                line["spec"]["spec"] = {"available": False, "source": "aggregate only"}
            if line["kind"] == "verdict" and accepted is not None:
                return [{"kind": "aggregate_counters", "available": True, "proposed": 40, "accepted": accepted,
                         "verify_steps": 20, "source": "run-wide counters"}, line]
            return [line]
        return edit

    inactive = _rewrite(journal, tmp_path / "inactive.jsonl", aggregate_only(0))
    code, doc = _compare(capsys, str(journal), str(inactive))
    assert code == exitcodes.GATE_FAILED, doc
    assert any(f.startswith("speculation inactive") for f in doc["failures"]), doc["failures"]

    active = _rewrite(journal, tmp_path / "active.jsonl", aggregate_only(30))
    assert _compare(capsys, str(journal), str(active))[0] == exitcodes.PASS

    silent = _rewrite(journal, tmp_path / "silent.jsonl", aggregate_only(None))
    code, doc = _compare(capsys, str(journal), str(silent))
    assert code == exitcodes.GATE_FAILED, doc
    assert doc["failures"] == ["speculation activity unknown: the engine reported no draft counters for any request"]
    policy = tmp_path / "allow.toml"
    policy.write_text("[gate]\nallow_unknown_activity = true\n")
    code, doc = _compare(capsys, str(journal), str(silent), "--policy", str(policy))
    assert code == exitcodes.PASS and any("activity unknown" in w for w in doc["warnings"]), doc

    def allowed_run(line):
        if line["kind"] == "run":
            line["config"]["policy"]["allow_unknown_activity"] = True
        return [line]

    allowed = _rewrite(silent, tmp_path / "allowed.jsonl", allowed_run)
    code, doc = _compare(capsys, str(journal), str(allowed))
    assert code == exitcodes.PASS and any("activity unknown" in w for w in doc["warnings"]), doc

    def shared(line):
        out = aggregate_only(30)(line)
        for x in out:
            if x["kind"] == "aggregate_counters":
                x["unattributed"] = "activity unknown: other traffic on the server: 6 finished, 5 sent"
        return out

    crowded = _rewrite(journal, tmp_path / "crowded.jsonl", shared)
    code, doc = _compare(capsys, str(journal), str(crowded))
    assert code == exitcodes.GATE_FAILED, doc
    assert doc["failures"] == ["speculation activity unknown: other traffic on the server: 6 finished, 5 sent"]


def test_compare_only_common_with_nothing_in_common_fails(capsys, tmp_path, journal):
    def rename(line):
        if line["kind"] in ("prompt", "baseline", "calibration"):
            line["prompt"]["id"] = "other-" + line["prompt"]["id"]
            for key in ("prompt_id",):
                if key in line:
                    line[key] = line["prompt"]["id"]
            if line.get("verdict"):
                line["verdict"]["prompt_id"] = line["prompt"]["id"]
            for side in ("baseline", "spec"):
                if line.get(side) and "request_id" in line[side]:
                    line[side]["request_id"] = line["prompt"]["id"]
        return [line]

    other = _rewrite(journal, tmp_path / "other.jsonl", rename)
    code, doc = _compare(capsys, str(journal), str(other), "--only-common")
    assert code == exitcodes.GATE_FAILED, doc
    assert doc["prompts"] == [] and any(f.startswith("nothing judged") for f in doc["failures"])
