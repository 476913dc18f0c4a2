"""``pytest suites/probes``: one test per probe; fail = predicted failure, skip = unknown.

The suite runs as a nested pytest session (tests/inprocess.py) over a scratch copy of ``suites/probes`` with a stand-in root
conftest that declares ``--engine/--target/--draft`` the way the project's root conftest does and
calls :func:`specparity.plugin.probe_options.add_probe_options`, so this test does not depend on the
root conftest's other options. Offline: synthetic checkpoints, no server.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import xml.etree.ElementTree as ET
from collections import Counter

import pytest

import probe_artifacts as pa
from inprocess import run_pytest
from specparity.probes.live import LIVE_PROBES, SELF_DRAFT

ROOT = Path(__file__).resolve().parents[1]
STAND_IN_CONFTEST = '''
from specparity.plugin.probe_options import add_probe_options

def pytest_addoption(parser):
    for name in ("engine", "target", "draft"):
        parser.addoption(f"--{name}", default=None)
    add_probe_options(parser)
'''


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("suite")
    shutil.copytree(ROOT / "suites" / "probes", root / "suites" / "probes",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "conftest.py").write_text(STAND_IN_CONFTEST)
    (root / "pytest.ini").write_text("[pytest]\n")
    return root


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("suite-ckpt")
    return {
        "target": pa.dense_target(d / "t"),
        "fp8_head": pa.fp8_head_target(d / "q"),
        "draft": pa.dflash2_draft(d / "d"),
        "draft_as_v1": pa.dflash2_draft(d / "v1", arch="DFlashDraftModel"),
    }


def outcomes(junit: Path) -> dict[str, str]:
    """Test name -> passed / failed / skipped / error, from a JUnit XML report (not the summary
    line, whose wording and counts are pytest's to change)."""
    out = {}
    for case in ET.parse(junit).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "skipped", "error")]
        out[case.get("name")] = {"failure": "failed", "skipped": "skipped", "error": "error"}.get(
            kinds[0] if kinds else "", "passed")
    return out


@dataclass
class SuiteRun:
    """What one ``pytest`` run of the suite gave: exit status, everything printed, and each test's outcome."""

    returncode: int
    output: str
    outcomes: dict[str, str] = field(default_factory=dict)


def run_suite(scratch: Path, *args: str) -> SuiteRun:
    """The probe suite under the stand-in conftest; ``.outcomes`` maps each test to its outcome."""
    junit = scratch / "junit.xml"
    junit.unlink(missing_ok=True)
    # -p no:specparity: the installed plugin (pytest11 entry point) would register the gate's
    # options too; the stand-in conftest plays a checkout without the gate
    code, out = run_pytest(str(scratch / "suites" / "probes"), "-q", "-rfEs", "-p", "no:specparity",
                           "--rootdir", str(scratch), "-c", str(scratch / "pytest.ini"), f"--junitxml={junit}",
                           *map(str, args), cwd=scratch)
    return SuiteRun(code, out, outcomes(junit) if junit.is_file() else {})


LIVE = {f"test_live_probe[{name}]" for name in LIVE_PROBES}
SELF_DRAFT_TEST = f"test_live_probe[{SELF_DRAFT}]"


def tally(proc) -> Counter:
    return Counter(proc.outcomes.values())


def static(proc) -> dict[str, str]:
    return {name: o for name, o in proc.outcomes.items() if name not in LIVE}


def test_passing_pair(scratch, dirs):
    proc = run_suite(scratch, "--target", dirs["target"], "--draft", dirs["draft"], "--probe-engine", "sglang==0.5.19")
    assert proc.returncode == 0, proc.output
    assert set(static(proc).values()) == {"passed"} and static(proc), proc.outcomes
    assert {proc.outcomes[name] for name in LIVE} == {"skipped"}
    assert "live probe: pass --probe-live-engine" in proc.output


def test_failing_pair_fails_with_evidence(scratch, dirs):
    proc = run_suite(scratch, "--target", dirs["fp8_head"], "--draft", dirs["draft_as_v1"], "--probe-engine", "vllm==0.11.0")
    assert proc.returncode == 1
    out = proc.output
    assert "FAILED" in out and "test_static_probe[dflash2-format]" in out
    assert "silently run as DFlash v1" in out
    assert "architectures=['DFlashDraftModel']" in out
    # the DFlash v1 draft does not use the selector: the quantized head only warns
    failed = [name for name, o in proc.outcomes.items() if o == "failed"]
    assert failed == ["test_static_probe[dflash2-format]"], proc.outcomes
    assert proc.outcomes["test_static_probe[lm-head]"] == "passed"
    assert "UserWarning: [warn] lm-head: quantized target head (fp8-block)" in out


def test_selected_without_inputs_is_a_usage_error(scratch):
    """`pytest suites/probes` with no --probe-engine: a CI job that forgot it must not go green."""
    proc = run_suite(scratch)
    assert proc.returncode == 4, proc.output
    assert any(line.startswith("ERROR: specparity: suites/probes needs --probe-engine name==version and "
                               "--target DIR") for line in proc.output.splitlines()), proc.output


def test_collected_with_the_whole_suite_without_inputs_skips_with_a_reason(scratch):
    junit = scratch / "junit-all.xml"
    code, out = run_pytest(str(scratch), "-q", "-rs", "-p", "no:specparity", "--rootdir", str(scratch),
                           "-c", str(scratch / "pytest.ini"), f"--junitxml={junit}", cwd=scratch)
    found = outcomes(junit)
    assert code == 0 and found and set(found.values()) == {"skipped"}, out
    assert "probes need --target DIR and --probe-engine" in out


def test_hostile_input_fails_in_one_line(scratch, dirs, tmp_path):
    pa.raw_safetensors(tmp_path / "model.safetensors", b"{nope")
    (tmp_path / "config.json").write_text("{}")
    proc = run_suite(scratch, "--target", dirs["target"], "--draft", tmp_path, "--probe-engine", "sglang==0.5.19")
    assert proc.returncode == 1
    assert "bad probe input:" in proc.output and "header: invalid JSON" in proc.output
    assert "Traceback" not in proc.output


def test_live_probes_through_the_suite(scratch, dirs):
    proc = run_suite(scratch, "--target", dirs["target"], "--draft", dirs["draft"], "--probe-engine", "sglang==0.5.19",
                     "--probe-live-engine", "probe_artifacts:copy_draft_engine", "--probe-stress-requests", "3")
    assert proc.returncode == 0, proc.output
    # the copy-draft engine's draft is not its target: the self-draft probe says so and skips
    assert {o for n, o in proc.outcomes.items() if n != SELF_DRAFT_TEST} == {"passed"}, proc.outcomes
    assert proc.outcomes[SELF_DRAFT_TEST] == "skipped" and LIVE <= set(proc.outcomes)


def test_with_the_project_root_conftest(dirs, tmp_path):
    """The same suite under the repository's own root conftest (which registers the options)."""
    junit = tmp_path / "junit.xml"
    code, out = run_pytest("suites/probes", "-q", "--target", str(dirs["target"]), "--draft", str(dirs["draft_as_v1"]),
                           "--probe-engine", "sglang==0.5.19", f"--junitxml={junit}", cwd=ROOT)
    assert code == 1, out
    found = outcomes(junit)
    assert [n for n, o in found.items() if o == "failed"] == ["test_static_probe[dflash2-format]"], found
    assert {found[name] for name in LIVE} == {"skipped"}
    assert "silently run as DFlash v1" in out
