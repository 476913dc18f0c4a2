"""One exit-code table for every entry point (docs/ERRORS.md, :mod:`specparity.gate.exitcodes`).

Each (entry point, code) pair is either produced here, produced by a named test elsewhere (a run
that is slow to start twice: a real Ctrl-C, a full ``ci/gate.sh`` run, the bad-input commands of
``tests/test_bad_input.py``), produced here by ``ci/gate.sh``'s own ``specparity lossless`` (the script
runs its lossless suite as that command and records the suite's exit code in ``gate.json``), or
impossible for a reason this file states;
:func:`test_every_code_of_every_entry_point_is_accounted_for` checks that these together cover the
whole table. Runs are tiny: one prompt, ``--calibration selected``, a few tokens. A real process for
one case of each command that is a process (``pytest suites/lossless`` and ``specparity lossless``
judging nothing: pytest's own exit 5 must not become the process's status) and for ``ci/gate.sh``
(a shell script); the other ``pytest`` and ``specparity lossless`` cases run the same command in
this process (tests/inprocess.py), the rest through ``cli.main``, and the ``specparity run``
outcomes that make the journals for ``specparity report`` are the ``specparity run`` cases
themselves.
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Callable

import pytest

from bad_inputs import CASES as BAD_INPUTS, END_TO_END
from child_signals import default_sigint
from inprocess import QUIET_PLUGINS, run_cli, run_pytest
from specparity.cli import commands as cli
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT

TESTS = REPO_ROOT / "tests"
ENGINES = TESTS / "exit_code_engines.py"
PROMPT_ID = "repeat-en-001"
#: Its id in the one-prompt file: no golden holds it (``compare --only-common`` then has nothing in common).
RENAMED = "exit-codes-001"
GOLDEN = REPO_ROOT / "golden" / "dflash-float32.jsonl"
FIXTURES = REPO_ROOT / "fixtures" / "models"

ENTRY_POINTS = ("pytest suites/lossless", "specparity run", "specparity lossless", "specparity compare",
                "specparity report", "specparity merge", "specparity probe", "ci/gate.sh", "api.check_lossless")
CODES = (exitcodes.PASS, exitcodes.GATE_FAILED, exitcodes.INTERRUPTED, exitcodes.ENGINE_ERROR, exitcodes.BAD_INPUT,
         exitcodes.PROBE_UNKNOWN)

#: Codes an entry point cannot end with, and why (docs/ERRORS.md says the same).
IMPOSSIBLE = {
    **{(entry, exitcodes.PROBE_UNKNOWN): "only `specparity probe` answers a question it could not check; a gate's "
                                         "unknown (activity, a skipped check) is a failure or, allowed, a warning"
       for entry in ENTRY_POINTS if entry != "specparity probe"},
    ("api.check_lossless", exitcodes.INTERRUPTED): "a function, not a process: Ctrl-C is the caller's KeyboardInterrupt",
    ("api.check_lossless", exitcodes.ENGINE_ERROR): "it runs no engine: the caller built the outputs it compares",
}

#: Codes produced by another test (node ids, checked to exist).
ELSEWHERE = {
    ("pytest suites/lossless", exitcodes.INTERRUPTED):
        "tests/test_no_silent_pass.py::test_ctrl_c_in_the_speculative_phase_leaves_no_stale_verdict",
    ("specparity run", exitcodes.INTERRUPTED): "tests/test_cli.py::test_ctrl_c_exits_2_after_showing_the_partial_run",
    ("ci/gate.sh", exitcodes.PASS): "tests/test_ci_gate.py::test_lossless_pass_writes_junit_reports_and_summary",
    # the same run: its lossless suite is `specparity lossless`, whose own exit 0 gate.json records
    ("specparity lossless", exitcodes.PASS): "tests/test_ci_gate.py::test_lossless_pass_writes_junit_reports_and_summary",
    ("ci/gate.sh", exitcodes.GATE_FAILED): "tests/test_ci_gate.py::test_selection_that_matches_nothing_fails",
    ("ci/gate.sh", exitcodes.BAD_INPUT): "tests/test_ci_gate.py::test_no_engine_configured_is_refused",
    # one stderr line and exit 4 from the real command (`pytest suites/lossless …`, `specparity lossless …`)
    ("pytest suites/lossless", exitcodes.BAD_INPUT): "tests/test_bad_input.py::test_bad_input_end_to_end",
    ("specparity lossless", exitcodes.BAD_INPUT): "tests/test_bad_input.py::test_bad_input_end_to_end",
    # the merge of shard journals (its own file builds the shards once for all of them)
    ("specparity merge", exitcodes.PASS): "tests/test_shards.py::test_two_shards_merged_are_the_unsharded_run",
    ("specparity merge", exitcodes.GATE_FAILED): "tests/test_shards.py::test_a_shard_killed_mid_run_loses_nothing",
    ("specparity merge", exitcodes.INTERRUPTED): "tests/test_shards.py::test_ctrl_c_during_a_merge_exits_2",
    ("specparity merge", exitcodes.ENGINE_ERROR): "tests/test_shards.py::test_a_merged_calibration_refused_exits_3",
    ("specparity merge", exitcodes.BAD_INPUT): "tests/test_shards.py::test_merging_another_fingerprint_is_refused",
}

#: Codes of ``specparity lossless`` produced by the ``ci/gate.sh`` case of the same code: the script
#: runs its lossless suite as exactly that command (the one :func:`specparity_lossless` runs) and the
#: case checks the suite's own exit code in ``gate.json`` and its output in the suite's log.
THROUGH_GATE = {
    ("specparity lossless", exitcodes.INTERRUPTED): ("ci/gate.sh", exitcodes.INTERRUPTED),
    ("specparity lossless", exitcodes.ENGINE_ERROR): ("ci/gate.sh", exitcodes.ENGINE_ERROR),
}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def one_prompt(tmp_path_factory) -> Path:
    lines = (REPO_ROOT / "prompts" / "default.jsonl").read_text().splitlines()
    chosen = [line for line in lines[1:] if line.strip() and json.loads(line)["id"] == PROMPT_ID]
    assert len(chosen) == 1
    path = tmp_path_factory.mktemp("prompts") / "one.jsonl"
    line = json.dumps({**json.loads(chosen[0]), "id": RENAMED})
    path.write_text('{"specparity_prompts": 1, "description": "one prompt for the exit-code tests"}\n' + line + "\n")
    return path


def gate_argv(prompts: Path, report: Path, *extra: str) -> list[str]:
    return ["--prompts", str(prompts), "--calibration", "selected", "--max-new-tokens", "12", "--report", str(report),
            *extra]


def policy(path: Path, **keys: object) -> Path:
    body = {"fail_on": ["diverged", "error", "drifted"], **keys}
    path.write_text("[gate]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in body.items()))
    return path


def main(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


def process(*argv: str | Path, cwd: Path = REPO_ROOT) -> tuple[int, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS)]),
           "PYTHON": sys.executable}
    env.pop("SPECPARITY_POLICY", None)
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, env=env,
                          preexec_fn=default_sigint)
    return proc.returncode, proc.stdout + proc.stderr


def pytest_lossless(*args: str | Path) -> tuple[int, str]:
    return process(sys.executable, "-m", "pytest", "suites/lossless", "-q", "-p", "no:cacheprovider", *args)


def specparity_lossless(*args: str | Path) -> tuple[int, str]:
    return process(sys.executable, "-c", "import sys; from specparity.cli.commands import main; sys.exit(main())",
                   "lossless", "-q", "-p", "no:cacheprovider", *args)


def pytest_lossless_here(*args: str | Path) -> tuple[int, str]:
    """:func:`pytest_lossless` in this process."""
    return run_pytest("suites/lossless", "-q", *args)


def specparity_lossless_here(*args: str | Path) -> tuple[int, str]:
    """:func:`specparity_lossless` in this process."""
    return run_cli("lossless", "-q", *QUIET_PLUGINS, *args)


def captured_main(*argv: str) -> tuple[int, str]:
    """``cli.main`` with its stdout and stderr, outside a test's ``capsys`` (a module fixture)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue() + err.getvalue()


#: The `specparity run` cases whose reports are the journals: (exit code, extra options).
RUNS = ((exitcodes.PASS, ()), (exitcodes.GATE_FAILED, ("--policy", "{floor}")),
        (exitcodes.ENGINE_ERROR, ("--engine", f"{ENGINES}:no_baseline")))


@dataclass
class Journals:
    """Report directories per exit code, and what each `specparity run` that made one ended with
    and printed (the `specparity run` cases check those; `specparity report` rebuilds the journals)."""

    dirs: dict[int, Path]
    runs: dict[int, tuple[int, str]]


@pytest.fixture(scope="module")
def journals(tmp_path_factory, one_prompt) -> Journals:
    """Report directories of finished runs ending 0, 1 (an acceptance floor), 2 (interrupted) and 3
    (no noise measured), made in-process by `specparity run`; `specparity report` rebuilds each."""
    root = tmp_path_factory.mktemp("journals")
    out: dict[int, Path] = {}
    runs: dict[int, tuple[int, str]] = {}
    floor = policy(root / "floor.toml", min_accept_length=99)
    for code, extra in RUNS:
        report = root / str(code)
        extra = tuple(a.replace("{floor}", str(floor)) for a in extra)
        runs[code] = captured_main("run", *gate_argv(one_prompt, report), *extra)
        out[code] = report
    # an interrupted run's journal: the finished run's lines up to the end of its prompts, then Ctrl-C
    interrupted = root / "2"
    interrupted.mkdir()
    lines = [json.loads(x) for x in (out[exitcodes.PASS] / "results.jsonl").read_text().splitlines()]
    kept = [x for x in lines if x["kind"] not in ("timings", "verdict", "aggregate_counters")]
    kept.append({"kind": "interrupted", "finished_prompts": 1})
    (interrupted / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept))
    out[exitcodes.INTERRUPTED] = interrupted
    return Journals(out, runs)


# --------------------------------------------------------------------------- cases


def _pytest_pass(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return pytest_lossless_here(*gate_argv(one_prompt, tmp_path / "r")), "specparity lossless gate: PASS"


def _pytest_nothing_selected(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return pytest_lossless(*gate_argv(one_prompt, tmp_path / "r"), "-k", "no_such_prompt"), "nothing judged"


def _pytest_cannot_load(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return (pytest_lossless_here(*gate_argv(one_prompt, tmp_path / "r"), "--engine", f"{ENGINES}:unloadable"),
            "the accelerator is gone")


def _run_pass(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return journals.runs[exitcodes.PASS], "specparity lossless gate: PASS"


def _run_floor(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return journals.runs[exitcodes.GATE_FAILED], "acceptance floor"


def _run_no_noise(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return journals.runs[exitcodes.ENGINE_ERROR], "no baseline could be decoded and scored"


def _run_report_write_fails(tmp_path, capsys, one_prompt, journals, monkeypatch):
    import specparity.run.runner

    def disk_full(run, decision, report_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(specparity.run.runner, "write_reports", disk_full)
    code, text = main(capsys, "run", *gate_argv(one_prompt, tmp_path / "r"))
    assert "the gate's verdict was PASS" in text  # the verdict reached is said, not lost
    assert json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[-1])["status"] == "PASS"
    return (code, text), "writing the verdict and reports failed (OSError: No space left on device)"


def _run_paths_on_request_totals(tmp_path, capsys, one_prompt, journals, monkeypatch):
    """Counters known only once the plugin is built: refused then, before any prompt runs (no journal)."""
    code, text = main(capsys, "run", *gate_argv(one_prompt, tmp_path / "r"), "--engine",
                      f"{ENGINES}:request_totals", "--require-all-paths", "2")
    assert not (tmp_path / "r" / "results.jsonl").exists()
    return (code, text), "--require-all-paths 2: engine"


def _lossless_nothing_selected(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return specparity_lossless(*gate_argv(one_prompt, tmp_path / "r"), "-k", "no_such_prompt"), "nothing judged"


def _lossless_nothing_collected_without_the_plugin(tmp_path, capsys, one_prompt, journals, monkeypatch):
    """pytest's own 5 never escapes `specparity lossless`, even when the plugin cannot map it."""
    return specparity_lossless_here("-p", "no:specparity", "-k", "no_such_prompt"), "nothing judged"


def _compare_pass(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return main(capsys, "compare", str(GOLDEN), str(GOLDEN)), "PASS"


def _compare_nothing_in_common(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return (main(capsys, "compare", str(GOLDEN), str(journals.dirs[exitcodes.PASS]), "--only-common"),
            "nothing judged")


def _compare_interrupted(tmp_path, capsys, one_prompt, journals, monkeypatch):
    import specparity.run.sides

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specparity.run.sides, "load_side", ctrl_c)
    return main(capsys, "compare", str(GOLDEN), str(GOLDEN)), "interrupted (Ctrl-C or SIGTERM)"


def _compare_report_write_fails(tmp_path, capsys, one_prompt, journals, monkeypatch):
    import specparity.report.render

    def disk_full(run, decision, report_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(specparity.report.render, "write_reports", disk_full)
    return (main(capsys, "compare", str(GOLDEN), str(GOLDEN), "--report", str(tmp_path / "c")),
            "writing the verdict and reports failed")


def _compare_bad_input(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return main(capsys, "compare", str(GOLDEN), str(tmp_path / "missing.jsonl")), "NEW"


def _report(code: int) -> Callable:
    def case(tmp_path, capsys, one_prompt, journals, monkeypatch):
        status = {0: "PASS", 1: "FAIL", 2: "INTERRUPTED", 3: "FAIL"}[code]
        return main(capsys, "report", str(journals.dirs[code]), "--out", str(tmp_path / "out")), f"gate: {status}"

    return case


def _report_bad_input(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return main(capsys, "report", str(tmp_path / "nowhere")), "nowhere"


PROBE = ("probe", "--target", str(FIXTURES / "target"), "--draft", str(FIXTURES / "dflash2"))


def _probe_pass(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return main(capsys, *PROBE, "--engine", "sglang==0.5.23"), "dflash2-format"


def _probe_unknown_not_allowed(tmp_path, capsys, one_prompt, journals, monkeypatch):
    """llama.cpp's lm-head probe answers unknown: a failure under a policy that does not name it."""
    strict = policy(tmp_path / "strict.toml", allow_unknown=["draft-fp8-scales"])
    code, text = main(capsys, *PROBE, "--engine", "llamacpp==11434", "--policy", str(strict), "--format", "json")
    statuses = {v["probe"]: v["status"] for v in json.loads(text[:text.rindex("]") + 1])}
    assert statuses["lm-head"] == "fail" and statuses["draft-fp8-scales"] == "unknown"
    return (code, text), "unknown, and the policy"


def _probe_unknown(tmp_path, capsys, one_prompt, journals, monkeypatch):
    """llama.cpp's lm-head and fp8-scale probes answer unknown for a standalone draft, none fails:
    without a policy that is the probe's own code, never a pass."""
    code, text = main(capsys, "probe", "--target", str(FIXTURES / "target"), "--draft", str(FIXTURES / "draft"),
                      "--engine", "llamacpp==11434", "--format", "json")
    statuses = {v["probe"]: v["status"] for v in json.loads(text[:text.rindex("]") + 1])}
    assert "unknown" in statuses.values() and "fail" not in statuses.values(), statuses
    return (code, text), '"status": "unknown"'


def _probe_interrupted(tmp_path, capsys, one_prompt, journals, monkeypatch):
    import specparity.probes.inputs

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specparity.probes.inputs, "prepare", ctrl_c)
    return main(capsys, *PROBE, "--engine", "sglang==0.5.23"), "interrupted (Ctrl-C or SIGTERM)"


def _probe_live_engine_fails(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return (main(capsys, *PROBE, "--engine", "sglang==0.5.23", "--live-engine", f"{ENGINES}:unloadable"),
            "the accelerator is gone")


def _probe_bad_input(tmp_path, capsys, one_prompt, journals, monkeypatch):
    return main(capsys, *PROBE, "--engine", "sglang"), "sglang"


def gate_lossless(report: Path, code: int, fragment: str) -> None:
    """The lossless suite under ``ci/gate.sh`` (``specparity lossless``) ended with ``code`` itself and
    said ``fragment`` (:data:`THROUGH_GATE`)."""
    doc = json.loads((report / "gate.json").read_text())
    log = (report / "lossless.log").read_text()
    assert doc["suites"]["lossless"]["exit_code"] == code, (doc, log[-3000:])
    assert fragment in log and "Traceback" not in log, log[-3000:]


def _gate_interrupted(tmp_path, capsys, one_prompt, journals, monkeypatch):
    """A suite interrupted under the script: its 2 is the worst code, which the script exits with."""
    result = process("bash", REPO_ROOT / "ci" / "gate.sh", "--engine", f"{TESTS / 'fault_engines.py'}:interrupting",
                     "--report", tmp_path / "g", "--", *gate_argv(one_prompt, tmp_path / "unused")[:-2],
                     "--engine-opt", "interrupt_after=1", cwd=tmp_path)
    gate_lossless(tmp_path / "g", exitcodes.INTERRUPTED, "specparity lossless gate: INTERRUPTED")
    return result, "worst: exit 2"


def _gate_engine_error(tmp_path, capsys, one_prompt, journals, monkeypatch):
    result = process("bash", REPO_ROOT / "ci" / "gate.sh", "--engine", f"{ENGINES}:unloadable", "--report",
                     tmp_path / "g", "--", "--prompts", one_prompt, "--calibration", "selected", cwd=tmp_path)
    gate_lossless(tmp_path / "g", exitcodes.ENGINE_ERROR, "cannot load engine")
    return result, "worst: exit 3"


def _api(code: int) -> Callable:
    """check_lossless returns (0), raises LosslessError, an AssertionError (1: a failed or empty
    comparison) or ValueError (4: arguments it cannot use)."""
    from specparity.api import LosslessError, check_lossless

    def case(tmp_path, capsys, one_prompt, journals, monkeypatch):
        try:
            if code == exitcodes.PASS:
                check_lossless([[5, 6, 7]], [[5, 6, 7]], max_new_tokens=3)
            elif code == exitcodes.GATE_FAILED:
                check_lossless([], [], max_new_tokens=3)
            else:
                check_lossless([[5, 6, 7]], [], max_new_tokens=3)
        except LosslessError as exc:
            return (exitcodes.GATE_FAILED, str(exc)), "nothing judged"
        except ValueError as exc:
            return (exitcodes.BAD_INPUT, str(exc)), "1 baseline outputs but 0 speculative outputs"
        return (exitcodes.PASS, "returned"), "returned"

    return case


CASES: dict[tuple[str, int], list[Callable]] = {
    ("pytest suites/lossless", 0): [_pytest_pass],
    ("pytest suites/lossless", 1): [_pytest_nothing_selected],
    ("pytest suites/lossless", 3): [_pytest_cannot_load],
    ("specparity run", 0): [_run_pass],
    ("specparity run", 1): [_run_floor],
    ("specparity run", 3): [_run_no_noise, _run_report_write_fails],
    ("specparity run", 4): [_run_paths_on_request_totals],
    ("specparity lossless", 1): [_lossless_nothing_selected, _lossless_nothing_collected_without_the_plugin],
    ("specparity compare", 0): [_compare_pass],
    ("specparity compare", 1): [_compare_nothing_in_common],
    ("specparity compare", 2): [_compare_interrupted],
    ("specparity compare", 3): [_compare_report_write_fails],
    ("specparity compare", 4): [_compare_bad_input],
    ("specparity report", 0): [_report(0)],
    ("specparity report", 1): [_report(1)],
    ("specparity report", 2): [_report(2)],
    ("specparity report", 3): [_report(3)],
    ("specparity report", 4): [_report_bad_input],
    ("specparity probe", 0): [_probe_pass],
    ("specparity probe", 1): [_probe_unknown_not_allowed],
    ("specparity probe", 2): [_probe_interrupted],
    ("specparity probe", 3): [_probe_live_engine_fails],
    ("specparity probe", 4): [_probe_bad_input],
    ("specparity probe", 6): [_probe_unknown],
    ("ci/gate.sh", 2): [_gate_interrupted],
    ("ci/gate.sh", 3): [_gate_engine_error],
    ("api.check_lossless", 0): [_api(0)],
    ("api.check_lossless", 1): [_api(1)],
    ("api.check_lossless", 4): [_api(4)],
}


def test_every_code_of_every_entry_point_is_accounted_for():
    table = set(product(ENTRY_POINTS, CODES))
    here, elsewhere, impossible, gate = set(CASES), set(ELSEWHERE), set(IMPOSSIBLE), set(THROUGH_GATE)
    parts = (here, elsewhere, impossible, gate)
    assert sum(map(len, parts)) == len(set().union(*parts)), "a pair is accounted for twice"
    assert here | elsewhere | impossible | gate == table, sorted(table - here - elsewhere - impossible - gate)
    assert set(THROUGH_GATE.values()) <= here and all(e == "ci/gate.sh" for e, _ in THROUGH_GATE.values())
    # the bad-input commands that run for real include each entry point they stand for here
    shown = [c.shown() for c in BAD_INPUTS if c.id in END_TO_END]
    for entry, code in ELSEWHERE:
        if code == exitcodes.BAD_INPUT and "test_bad_input.py" in ELSEWHERE[entry, code]:
            assert any(s.startswith(entry + " ") for s in shown), (entry, shown)
    for node in ELSEWHERE.values():
        path, name = node.split("::")
        defined = {f.name for f in ast.parse((REPO_ROOT / path).read_text()).body if isinstance(f, ast.FunctionDef)}
        assert name in defined, node


@pytest.mark.parametrize("entry, code, case", [(e, c, f) for (e, c), fs in CASES.items() for f in fs],
                         ids=[f"{e}-{c}-{f.__name__.strip('_')}" for (e, c), fs in CASES.items() for f in fs])
def test_exit_code(entry, code, case, tmp_path, capsys, one_prompt, journals, monkeypatch):
    (got, text), fragment = case(tmp_path, capsys, one_prompt, journals, monkeypatch)
    assert got == code, text[-3000:]
    assert fragment in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
