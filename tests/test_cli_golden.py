"""``specparity record``, ``compare`` and ``report`` run for real: exit codes, JSON, and a report
rebuilt from the journal alone; plus the committed golden still matches its prompt file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specparity import exitcodes
from specparity.fixtures import REPO_ROOT, fixture_dir
from specparity.golden import load_golden
from specparity.prompts import load_many

TESTS = REPO_ROOT / "tests"
SPECPARITY = str(Path(sys.executable).with_name("specparity"))
SELECT = ("--categories", "math", "--calibration", "selected")
COMMITTED = REPO_ROOT / "golden" / "dflash-float32.jsonl"


def cli(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS)}
    return subprocess.run([SPECPARITY, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


def test_committed_golden_matches_prompts_and_fixtures():
    from specparity.engines.common import artifact

    g = load_golden(COMMITTED)
    prompts = load_many([REPO_ROOT / "prompts" / "default.jsonl"])
    stale = [p.id for p in prompts if g.entry_for(p) is None]
    assert not stale, f"re-record {COMMITTED.name} (golden/README.md): prompts added or edited since: {stale}"
    assert g.fields["engine"] == "dflash" and g.fields["dtype"] == "float32"
    assert g.fields["target"]["sha256"] == artifact(fixture_dir("target"), "").sha256


@pytest.mark.slow
def test_record_compare_report(tmp_path):
    golden = tmp_path / "g.jsonl"
    rec = cli("record", "--golden", str(golden), *SELECT, "--report", "", "--json")
    assert rec.returncode == exitcodes.PASS, rec.stderr[-2000:]
    out = json.loads(rec.stdout)
    assert out["status"] == "PASS" and out["threshold"]["nats"] > 0 and len(load_golden(golden).entries) == 5

    again = cli("record", "--golden", str(golden), "--dtype", "bfloat16", *SELECT, "--report", "")
    assert again.returncode == exitcodes.GATE_FAILED and "--update-golden=force" in again.stdout

    report = tmp_path / "spec"
    run = cli("run", "--engine", f"{TESTS / 'broken_loops.py'}:create", "--engine-opt", "bug=short_crop", *SELECT,
              "--report", str(report), "--json")
    assert run.returncode == exitcodes.GATE_FAILED

    judged = cli("compare", str(golden), str(report), "--json")
    assert judged.returncode == exitcodes.GATE_FAILED, judged.stderr[-2000:]
    data = json.loads(judged.stdout)
    assert data["counts"]["diverged"] >= 1
    assert {p["prompt_id"] for p in data["prompts"]} == {p.id for p in load_many([REPO_ROOT / "prompts" / "default.jsonl"])
                                                        if p.category == "math"}
    same = cli("compare", str(golden), str(golden))
    assert same.returncode == exitcodes.PASS and "exact 5" in same.stdout

    (report / "summary.md").unlink()
    (report / "report.html").unlink(missing_ok=True)
    rebuilt = cli("report", str(report))
    assert rebuilt.returncode == exitcodes.GATE_FAILED and "FAIL" in rebuilt.stdout
    assert (report / "summary.md").is_file() and (report / "report.html").is_file()


def test_bad_inputs_are_one_line(tmp_path):
    missing = cli("compare", str(tmp_path / "nope.jsonl"), str(tmp_path))
    assert missing.returncode == exitcodes.BAD_INPUT and "OLD" in missing.stderr and "no such file" in missing.stderr
    (tmp_path / "results.jsonl").write_text('{"kind": "prompt"}\n')
    bad = cli("report", str(tmp_path))
    assert bad.returncode == exitcodes.BAD_INPUT and "results.jsonl:1:" in bad.stderr
    no_golden = cli("record", *SELECT)
    assert no_golden.returncode == exitcodes.BAD_INPUT and "--golden" in no_golden.stderr
