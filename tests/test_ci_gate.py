"""``ci/gate.sh``, the pre-merge gate, run for real: JUnit XML per suite, ``gate.json``, the policy
file, the worst exit code.

The lossless runs use the embedded engine on a few prompts (one of ``prompts/default.jsonl``'s code
prompts in a file of their own, ``--calibration selected``, few tokens: they only need the script's
paths). Where the subject is the policy's verdict in the suite's JUnit rather than the script, the
suite runs as the command the script's ``--dry-run`` prints, in this process. The probes
run on the fixtures against ``llamacpp==11434``, whose ``dflash2-format`` probe fails on the DFlash2
fixture draft (it reads the target's last layer, docs/notes/findings.md F9) — a real predicted failure.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from inprocess import run_cli
from llamacpp_fixtures import SUITE_PYTEST
from prompt_subsets import first_of_each, write_subset
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from tie_model import build_tie_model

GATE = REPO_ROOT / "ci" / "gate.sh"
POLICY = REPO_ROOT / "ci" / "policy.toml"
MODELS = REPO_ROOT / "fixtures" / "models"
#: The plugins the lossless suite never uses stay unloaded in its pytest (SUITE_PYTEST's ``-p no:…``).
NO_PLUGINS = SUITE_PYTEST[SUITE_PYTEST.index("no:cacheprovider") + 1:]
FAST_TAIL = ("--calibration", "selected", "--max-new-tokens", "8", *NO_PLUGINS)
#: The script has no default engine: the lossless suite runs the reference decoder on the fixtures.
ENGINE = ("--engine", "dflash")
#: The prompts of the near-tie policy test: the first six of the default file, where the tie-dense target's
#: bf16 ties lie on the greedy path (tests/test_bf16_near_ties.py decodes the same ones).
TIE_PROMPTS = tuple(json.loads(line)["id"] for line in (REPO_ROOT / "prompts" / "default.jsonl").read_text().splitlines()[1:7])
#: The probes that answer "unknown" for llama.cpp on the fixtures (it runs a GGUF conversion; no FP8 data).
LLAMACPP_UNKNOWN = ["draft-fp8-scales", "lm-head"]


def gate(*args: str | Path, cwd: Path, script: Path = GATE, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable, **env}
    full_env.pop("SPECPARITY_POLICY", None)
    return subprocess.run(["bash", str(script), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=full_env)


def script_lossless(*args: str | Path, cwd: Path) -> tuple[int, str]:
    """The lossless suite exactly as ``ci/gate.sh ARGS`` runs it (the command its ``--dry-run`` prints),
    run in this process (tests/inprocess.py): for tests whose subject is what the suite judges under a
    policy and writes to JUnit, not the script around it (which the other tests here run for real)."""
    dry = gate("--dry-run", "--suites", "lossless", *args, cwd=cwd)
    assert dry.returncode == 0, out(dry)
    (line,) = dry.stdout.splitlines()
    argv = shlex.split(line)
    return run_cli(*argv[argv.index("lossless"):], cwd=cwd)


def junit(path: Path) -> tuple[dict[str, int], list[ET.Element]]:
    root = ET.parse(path).getroot()
    suites = list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return counts, list(root.iter("testcase"))


def failed(cases: list[ET.Element]) -> list[str]:
    return sorted(c.get("name") for c in cases if c.find("failure") is not None)


def summary(report: Path) -> dict:
    return json.loads((report / "gate.json").read_text())


def write_policy(path: Path, **keys: object) -> Path:
    body = {"fail_on": ["diverged", "error", "drifted"], **keys}
    path.write_text("[gate]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in body.items()))
    return path


def out(proc: subprocess.CompletedProcess[str]) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="module")
def few(tmp_path_factory) -> tuple[Path, int]:
    """A prompt file of one code prompt, and how many prompts it holds."""
    path = tmp_path_factory.mktemp("prompts") / "code.jsonl"
    return path, len(first_of_each(path, ("code",)))


@pytest.fixture(scope="module")
def fast(few) -> tuple[str, ...]:
    """Lossless-suite arguments (after ``--``) for a quick real run on the ``few`` prompts."""
    return ("--prompts", str(few[0]), *FAST_TAIL)


def test_policy_file_is_the_documented_one():
    from specparity.gate.policy_file import load_policy

    policy = load_policy(POLICY)  # it parses, and says what its comments say
    assert (policy["drift_policy"], policy["min_accept_length"]) == ("fail", 1.5)
    assert "max_near_tie" not in policy  # unset: the near-tie budget follows the data
    assert policy["require_all_paths"] == 0 and policy["allow_unknown_activity"] is False
    assert not policy.get("bit_exact")  # near_tie is not in fail_on
    assert policy["allow_unknown"] == ()  # no probe may answer "unknown" until a reviewed change lists it


def test_dry_run_shows_each_suites_command(tmp_path):
    proc = gate("--dry-run", "--suites", "lossless,invariance,probes", "--engine", "hf", "--target", MODELS / "target",
                "--draft", MODELS / "draft", "--probe-engine", "sglang==0.5.23", "--report", "r", "--",
                "--categories", "math", cwd=tmp_path)
    assert proc.returncode == 0, out(proc)
    lossless, invariance, probes = proc.stdout.splitlines()
    report = tmp_path / "r"
    assert " lossless --engine hf " in lossless and f"--policy {POLICY}" in lossless
    assert f"--report {report}/lossless --junitxml {report}/junit/lossless.xml --categories math" in lossless
    assert f"{REPO_ROOT}/suites/invariance" in invariance and f"--draft {MODELS / 'target'}" in invariance
    assert "--categories" not in invariance  # extra args after -- go to the lossless suite only
    assert f"{REPO_ROOT}/suites/probes" in probes and "--probe-engine sglang==0.5.23" in probes
    assert f"--junitxml {report}/junit/probes.xml" in probes


def test_lossless_pass_writes_junit_reports_and_summary(tmp_path, fast, few):
    proc = gate(*ENGINE, "--report", "r", "--", *fast, cwd=tmp_path)
    assert proc.returncode == exitcodes.PASS, out(proc)
    report = tmp_path / "r"
    counts, cases = junit(report / "junit" / "lossless.xml")
    tests = few[1] + 1  # each prompt + the policy
    assert counts == {"tests": tests, "failures": 0, "errors": 0, "skipped": 0}
    assert sorted(c.get("name") for c in cases)[0] == "test_gate_policy"
    assert (report / "lossless" / "results.jsonl").is_file() and (report / "lossless" / "summary.md").is_file()
    assert "specparity lossless gate: PASS" in (report / "lossless.log").read_text()
    doc = summary(report)
    assert doc["exit_code"] == 0 and doc["policy"] == str(POLICY)  # ci/policy.toml beside the script by default
    assert doc["suites"]["lossless"] == {"exit_code": 0, "junit": str(report / "junit" / "lossless.xml"),
                                         "log": str(report / "lossless.log"), **counts}
    assert f"lossless    exit 0 (pass): {tests} tests, 0 failed" in proc.stdout


def test_acceptance_floor_of_the_policy_fails_the_gate(tmp_path, fast, few):
    policy = write_policy(tmp_path / "floor.toml", min_accept_length=99)
    code, output = script_lossless(*ENGINE, "--policy", policy, "--report", "r", "--", *fast, cwd=tmp_path)
    assert code == exitcodes.GATE_FAILED, output[-4000:]
    counts, cases = junit(tmp_path / "r" / "junit" / "lossless.xml")
    assert counts["tests"] == few[1] + 1 and counts["failures"] == 1
    assert failed(cases) == ["test_gate_policy"]
    (policy_case,) = [c for c in cases if c.get("name") == "test_gate_policy"]
    assert "acceptance floor" in policy_case.find("failure").get("message")


@pytest.mark.slow
def test_near_ties_pass_or_fail_by_policy(tmp_path):
    """bf16 near-tie flips, judged under the policy file: within the budget they pass; the same flips fail
    under a policy that lists near_tie in fail_on (bit-exact). The flips are made here, on any CPU: the
    tie-dense copy of the fixture target (tests/tie_model.py) ties exactly at most positions in bf16, and
    the hand-written loop keeps the draft's token at a tie (``tie_rule=draft``), so the speculative run
    takes the other side of ties the baseline broke toward the lower id. The allowing run decodes the
    first prompts of the default file; the strict run the prompts that flipped and one that did not (each
    prompt decodes on its own, so its flips do not depend on the others)."""
    target = tmp_path / "tie-target"
    build_tie_model(target)
    engine = ("--engine", f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create", "--target", target)
    prompts = tmp_path / "first.jsonl"
    kept = write_subset(prompts, lambda row: row["id"] in TIE_PROMPTS)
    assert len(kept) == len(TIE_PROMPTS)
    tail = ("--dtype", "bfloat16", "--engine-opt", "tie_rule=draft", "--calibration", "selected",
            "--max-new-tokens", "24", *NO_PLUGINS)
    code, output = script_lossless(*engine, "--policy", write_policy(tmp_path / "allow.toml", max_near_tie=1.0),
                                   "--report", "allow", "--", "--prompts", prompts, *tail, cwd=tmp_path)
    assert code == exitcodes.PASS, output[-4000:]
    verdicts = [json.loads(line) for line in (tmp_path / "allow" / "lossless" / "results.jsonl").read_text().splitlines()]
    classes = {v["verdict"]["prompt_id"]: v["verdict"]["class"] for v in verdicts if v.get("kind") == "prompt"}
    ties = sorted(p for p, c in classes.items() if c == "near_tie")
    assert ties, f"no near-tie flip on the tie-dense target in bf16 ({classes}): the near-tie path was not reached"
    assert set(classes.values()) <= {"exact", "near_tie"}, classes
    counts, _ = junit(tmp_path / "allow" / "junit" / "lossless.xml")
    assert counts["failures"] == 0

    keep = set(ties) | {next((p for p, c in classes.items() if c == "exact"), ties[0])}
    again = tmp_path / "again.jsonl"
    write_subset(again, lambda row: row["id"] in keep)
    strict = write_policy(tmp_path / "strict.toml", fail_on=["diverged", "error", "drifted", "near_tie"])
    code, output = script_lossless(*engine, "--policy", strict, "--report", "strict", "--", "--prompts", again, *tail,
                                   cwd=tmp_path)
    assert code == exitcodes.GATE_FAILED, output[-4000:]
    counts, cases = junit(tmp_path / "strict" / "junit" / "lossless.xml")
    assert counts["failures"] == len(ties) + 1
    assert failed(cases) == sorted([f"test_lossless[{t}]" for t in ties] + ["test_gate_policy"])


def test_worst_exit_code_over_the_suites_in_a_repository_without_the_checkout(tmp_path):
    """gate.sh copied into another repository: probes run as `specparity probe` (JUnit from its JSON),
    invariance cannot run there (4); the worst code wins and every suite is still reported."""
    ci = tmp_path / "ci"
    ci.mkdir()
    shutil.copy2(GATE, ci / "gate.sh")
    shutil.copy2(POLICY, ci / "policy.toml")
    probe_args = ("--target", MODELS / "target", "--draft", MODELS / "dflash2", "--probe-engine", "llamacpp==11434")
    proc = gate("--suites", "probes", *probe_args, "--report", "p", cwd=tmp_path, script=ci / "gate.sh")
    assert proc.returncode == exitcodes.GATE_FAILED, out(proc)
    counts, cases = junit(tmp_path / "p" / "junit" / "probes.xml")
    # ci/policy.toml allows no "unknown": llama.cpp's two unknown answers fail beside the predicted failure
    assert failed(cases) == sorted(["dflash2-format", *LLAMACPP_UNKNOWN]) and counts["tests"] == 5
    assert counts["skipped"] == 0
    assert json.loads((tmp_path / "p" / "probes.json").read_text())[0]["probe"] == "lm-head"

    proc = gate("--suites", "probes,invariance", *ENGINE, *probe_args, "--report", "both", cwd=tmp_path,
                script=ci / "gate.sh")
    assert proc.returncode == exitcodes.BAD_INPUT, out(proc)
    assert "suite invariance: suites/invariance is not shipped in the package" in proc.stderr
    doc = summary(tmp_path / "both")
    assert doc["exit_code"] == 4
    assert {k: v["exit_code"] for k, v in doc["suites"].items()} == {"probes": 1, "invariance": 4}
    assert doc["suites"]["invariance"]["junit"] is None


def test_probes_suite_of_the_checkout(tmp_path):
    """A policy that names llama.cpp's two unknown probes lets them skip; the predicted failure still fails."""
    policy = write_policy(tmp_path / "allow.toml", allow_unknown=LLAMACPP_UNKNOWN)
    proc = gate("--suites", "probes", "--target", MODELS / "target", "--draft", MODELS / "dflash2",
                "--probe-engine", "llamacpp==11434", "--policy", policy, "--report", "r", cwd=tmp_path)
    assert proc.returncode == exitcodes.GATE_FAILED, out(proc)
    counts, cases = junit(tmp_path / "r" / "junit" / "probes.xml")
    assert failed(cases) == ["test_static_probe[dflash2-format]"] and counts["failures"] == 1
    skipped = sorted(c.get("name") for c in cases if c.find("skipped") is not None and "static" in c.get("name"))
    assert skipped == [f"test_static_probe[{p}]" for p in LLAMACPP_UNKNOWN]


def test_unknown_probe_is_not_green_without_the_policys_allowance(tmp_path):
    """With no policy file at all (the script copied without ci/policy.toml), a probe answering unknown
    fails the probes suite: the script then allows none."""
    ci = tmp_path / "ci"
    ci.mkdir()
    shutil.copy2(GATE, ci / "gate.sh")
    args = ("--suites", "probes", "--target", MODELS / "target", "--draft", MODELS / "dflash2",
            "--probe-engine", "llamacpp==11434", "--report", "r")
    proc = gate(*args, cwd=tmp_path, script=ci / "gate.sh", SPECPARITY_SUITES_DIR=str(REPO_ROOT / "suites"))
    assert proc.returncode == exitcodes.GATE_FAILED, out(proc)
    counts, cases = junit(tmp_path / "r" / "junit" / "probes.xml")
    assert failed(cases) == sorted(f"test_static_probe[{p}]" for p in ["dflash2-format", *LLAMACPP_UNKNOWN])
    failure = next(c for c in cases if c.get("name") == "test_static_probe[lm-head]").find("failure")
    assert "lm-head: unknown, and the policy" in failure.get("message")
    assert 'add "lm-head" to allow_unknown' in failure.text


def test_no_engine_configured_is_refused(tmp_path, fast):
    """Without --engine / SPECPARITY_ENGINE the script refuses (it never gates the fixture models by
    accident), in one line saying what to set, before any suite runs."""
    proc = gate("--report", "r", "--", *fast, cwd=tmp_path, SPECPARITY_ENGINE="")
    assert proc.returncode == exitcodes.BAD_INPUT, out(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("ci/gate.sh: suite lossless: no engine configured; set SPECPARITY_ENGINE"), line
    assert not (tmp_path / "r" / "lossless").exists()


def test_selection_that_matches_nothing_fails(tmp_path):
    """-k matching no prompt: nothing judged is a gate failure (1), never pytest's 5 or a pass."""
    proc = gate(*ENGINE, "--report", "r", "--", "-k", "no_such_test", cwd=tmp_path)
    assert proc.returncode == exitcodes.GATE_FAILED, out(proc)
    assert "nothing judged" in proc.stdout + proc.stderr
    doc = summary(tmp_path / "r")
    assert doc["exit_code"] == 1 and doc["suites"]["lossless"]["exit_code"] == 1


@pytest.mark.parametrize("args, code, fragment", [
    (("--suites", "lossless,nope"), 4, "--suites: unknown suite 'nope'"),
    (("--policy", "missing.toml"), 4, "--policy missing.toml: no such file"),
    (("--suites", "probes"), 4, "suite probes: needs SPECPARITY_PROBE_ENGINE"),
    (("--frobnicate",), 4, "--frobnicate: unknown option"),
    (("--", "--max-near-tie", "3"), 4, "--max-near-tie 3: expected a number in [0, 1]"),  # from the suite
])
def test_bad_input_exits_4(tmp_path, args, code, fragment):
    proc = gate(*ENGINE, "--report", "r", *args, cwd=tmp_path)
    assert proc.returncode == code, out(proc)
    assert fragment in proc.stdout + proc.stderr


def test_bad_policy_key_is_bad_input_of_the_suite(tmp_path, fast):
    policy = tmp_path / "typo.toml"
    policy.write_text("[gate]\nmax_near_ties = 0.1\n")
    proc = gate(*ENGINE, "--policy", policy, "--report", "r", "--", *fast, cwd=tmp_path)
    assert proc.returncode == exitcodes.BAD_INPUT, out(proc)
    assert f"{policy}:2: max_near_ties: unknown key" in proc.stdout + proc.stderr
    assert summary(tmp_path / "r")["suites"]["lossless"]["exit_code"] == 4
