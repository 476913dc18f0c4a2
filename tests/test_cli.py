"""``specparity run``: the gate without pytest — exit codes, ``--json``, the progress bar, ``--help``.

Runs are in-process (``cli.main``) on two short prompts with ``--calibration selected`` so each
takes a few seconds; Ctrl-C and ``specparity lossless`` run as real processes.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from child_signals import default_sigint
from specparity.cli import commands as cli
from specparity.gate import exitcodes
from specparity.model.verdicts import CLASSES
from specparity.model.locations import REPO_ROOT
from specparity.cli.option_table import GATE_OPTIONS

TESTS = REPO_ROOT / "tests"
BROKEN_LOOPS = f"{TESTS / 'broken_loops.py'}:create"
#: Two in-distribution prompts of the default suite (one full-accept heavy, one with a stop token).
PROMPT_IDS = ("repeat-en-001", "code-en-001")
JSON_KEYS = {"schema", "status", "exit_code", "passed", "counts", "total", "failures", "warnings", "decision",
             "threshold", "near_tie_policy", "fingerprint", "activity", "prompts", "report"}


@pytest.fixture(scope="module")
def two_prompts(tmp_path_factory) -> Path:
    lines = (REPO_ROOT / "prompts" / "default.jsonl").read_text().splitlines()
    chosen = [line for line in lines[1:] if line.strip() and json.loads(line)["id"] in PROMPT_IDS]
    assert len(chosen) == len(PROMPT_IDS)
    path = tmp_path_factory.mktemp("prompts") / "two.jsonl"
    path.write_text('{"specparity_prompts": 1, "description": "two prompts for the CLI tests"}\n' + "\n".join(chosen) + "\n")
    return path


def gate_args(prompts: Path, report: Path, *extra: str) -> list[str]:
    return ["run", "--prompts", str(prompts), "--calibration", "selected", "--max-new-tokens", "16",
            "--report", str(report), *extra]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_no_progress_bar(err: str) -> None:
    """Nothing rich draws (bar glyphs, cursor control) and no transformers loading bars."""
    assert "━" not in err and "\x1b[" not in err and "Loading weights" not in err, err[-2000:]


# --------------------------------------------------------------------------- exit codes


def test_pass_exits_0_with_the_summary_and_the_report(capsys, two_prompts, tmp_path):
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r"))
    assert code == exitcodes.PASS, out + err
    lines = out.splitlines()
    assert lines[0].startswith("specparity lossless gate: PASS") and "(2 prompts)" in lines[0]
    assert any(line.startswith("near-tie threshold:") for line in lines)
    assert f"report: {tmp_path / 'r' / 'results.jsonl'}" in lines
    final = json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[-1])
    assert final["kind"] == "verdict" and final["status"] == "PASS"
    assert_no_progress_bar(err)  # stderr is not a TTY under capsys


def test_quiet_prints_only_the_verdict(capsys, two_prompts, tmp_path):
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--quiet"))
    assert code == exitcodes.PASS
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith("specparity lossless gate: PASS")
    assert_no_progress_bar(err)


def test_gate_failure_exits_1(capsys, two_prompts, tmp_path):
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--engine", BROKEN_LOOPS,
                                                "--engine-opt", "bug=inactive"))
    assert code == exitcodes.GATE_FAILED, out + err
    assert out.startswith("specparity lossless gate: FAIL")
    assert any(line.startswith("FAIL: speculation inactive") for line in out.splitlines()), out


def test_engine_that_cannot_load_exits_3_in_one_line(capsys, two_prompts, tmp_path):
    plugin = tmp_path / "boom_engine.py"
    plugin.write_text("def create(options):\n    raise RuntimeError('the GPU is on fire')\n")
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--engine", f"{plugin}:create"))
    assert code == exitcodes.ENGINE_ERROR
    assert out == ""
    assert err.count("\n") == 1 and "cannot load engine" in err and "the GPU is on fire" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, fragment", [
    (("--max-near-tie", "3"), "--max-near-tie 3: expected a number in [0, 1]"),
    (("--categories", "nosuch"), "--categories: unknown nosuch"),
    (("--engine", "nosuch"), "--engine 'nosuch'"),
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
])
def test_bad_input_exits_4_in_one_line(capsys, two_prompts, tmp_path, argv, fragment):
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r"), *argv)
    assert code == exitcodes.BAD_INPUT
    assert out == ""
    assert fragment in err, err
    assert "Traceback" not in err
    if argv[0] != "--no-such-flag":  # argparse adds its usage line; our own errors are one line
        assert err.count("\n") == 1, err


def test_ctrl_c_exits_2_after_showing_the_partial_run(two_prompts, tmp_path):
    """A real SIGINT in the speculative phase (tests/fault_engines.py): exit 2, the summary says INTERRUPTED."""
    exe = Path(sys.executable).with_name("specparity")
    proc = subprocess.run([str(exe), *gate_args(two_prompts, tmp_path / "r", "--engine",
                                                f"{TESTS / 'fault_engines.py'}:interrupting",
                                                "--engine-opt", "interrupt_after=2")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          preexec_fn=default_sigint)
    assert proc.returncode == exitcodes.INTERRUPTED, proc.stdout + proc.stderr
    assert proc.stdout.startswith("specparity lossless gate: INTERRUPTED"), proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == "specparity: interrupted (Ctrl-C or SIGTERM)"
    assert (tmp_path / "r" / "summary.md").read_text().startswith("# specparity lossless gate: INTERRUPTED")


# --------------------------------------------------------------------------- --json


def test_json_is_one_document_on_stdout(capsys, two_prompts, tmp_path):
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--json"))
    assert code == exitcodes.PASS, out + err
    doc = json.loads(out)  # the whole of stdout: nothing else was printed there
    assert set(doc) == JSON_KEYS
    assert doc["schema"] == cli.RUN_JSON_SCHEMA
    assert (doc["status"], doc["exit_code"], doc["passed"]) == ("PASS", 0, True)
    assert list(doc["counts"]) == list(CLASSES) and sum(doc["counts"].values()) == doc["total"] == 2
    assert doc["decision"]["status"] == "PASS" and doc["decision"]["counts"] == doc["counts"]
    assert doc["failures"] == [] and isinstance(doc["warnings"], list)
    assert doc["threshold"]["source"] == "measured" and doc["threshold"]["nats"] > 0
    assert doc["fingerprint"]["engine"] == "dflash"
    assert doc["activity"]["accepted"] > 0 and doc["activity"]["mean_accept_length"] > 1
    assert sorted(p["id"] for p in doc["prompts"]) == sorted(PROMPT_IDS)
    for p in doc["prompts"]:
        assert set(p) == {"id", "category", "class", "reason", "position"} and p["class"] in CLASSES
    assert doc["report"]["dir"] == str(tmp_path / "r")
    assert str(tmp_path / "r" / "results.jsonl") in doc["report"]["files"]
    assert all(Path(f).is_file() for f in doc["report"]["files"])
    assert_no_progress_bar(err)


def test_json_failure_names_the_failures(capsys, two_prompts, tmp_path):
    code, out, _ = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--json", "--engine", BROKEN_LOOPS,
                                              "--engine-opt", "bug=inactive"))
    doc = json.loads(out)
    assert code == doc["exit_code"] == exitcodes.GATE_FAILED
    assert doc["status"] == "FAIL" and not doc["passed"]
    assert any(f.startswith("speculation inactive") for f in doc["failures"])


def test_json_without_a_run_still_says_status_and_exit_code(capsys, two_prompts, tmp_path):
    code, out, err = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--json", "--top-k", "2"))
    assert code == exitcodes.BAD_INPUT
    assert json.loads(out) == {"schema": cli.RUN_JSON_SCHEMA, "status": "BAD_INPUT", "exit_code": 4, "passed": False,
                               "error": "--top-k 2: expected an integer >= 5"}
    assert "--top-k 2" in err
    plugin = tmp_path / "boom_engine.py"
    plugin.write_text("def create(options):\n    raise RuntimeError('no GPU')\n")
    code, out, _ = run_cli(capsys, *gate_args(two_prompts, tmp_path / "r", "--json", "--engine", f"{plugin}:create"))
    doc = json.loads(out)
    assert code == doc["exit_code"] == exitcodes.ENGINE_ERROR and doc["status"] == "ERROR" and "no GPU" in doc["error"]


# --------------------------------------------------------------------------- progress bar


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty, json_out, quiet, wanted", [
    (True, False, False, True),
    (False, False, False, False),  # CI logs, pipes
    (True, True, False, False),  # --json: stdout must stay one document
    (True, False, True, False),
])
def test_progress_only_for_a_terminal(tty, json_out, quiet, wanted):
    args = cli.build_parser().parse_args(["run", *(["--json"] if json_out else []), *(["--quiet"] if quiet else [])])
    assert cli._progress_wanted(args, _Stream(tty)) is wanted


def test_progress_bar_counts_each_phase_from_the_runners_messages():
    from rich.console import Console

    stream = _Stream(True)
    bar = cli.GateProgress(3, 2, console=Console(file=stream, force_terminal=True, width=100))
    with bar:
        for msg in ("baseline a-1: 16 tokens", "baseline a-2: 3 tokens ERROR boom", "baseline cal-1: 16 tokens",
                    "near-tie threshold: 3e-05 nats, measured", "a-1: exact", "a-2: error", "something else: 12"):
            bar(msg)
    assert bar.counts == {"baseline": 3, "speculative": 2}
    tasks = {t.description: t for t in bar.bar.tasks}
    assert tasks["baseline"].completed == tasks["baseline"].total == 3
    assert tasks["speculative"].completed == tasks["speculative"].total == 2
    assert "━" in stream.getvalue()  # drawn on the (fake) terminal, not on stdout


# --------------------------------------------------------------------------- parser


def test_help_lists_the_exit_codes(capsys):
    assert cli.main(["--help"]) == exitcodes.PASS
    out = capsys.readouterr().out
    assert "exit codes" in out
    for code, word in ((0, "pass"), (1, "gate failure"), (2, "interrupted"), (3, "harness or engine error"),
                       (4, "bad input")):
        assert f"  {code}  {word}" in out, out
    for command in ("run", "lossless", "probe"):
        assert command in out


def test_run_has_every_gate_option():
    parser = cli.build_parser()
    run_help = parser._subparsers._group_actions[0].choices["run"].format_help()
    for spec in GATE_OPTIONS:
        assert spec.flag in run_help, spec.flag
    assert "--json" in run_help and "--quiet" in run_help and "exit codes" in run_help
    args = parser.parse_args(["run", "--engine", "hf", "--prompts", "a.jsonl", "--prompts", "b.jsonl",
                              "--require-all-paths", "--report", ""])
    assert (args.engine, args.prompts, args.require_all_paths, args.report) == ("hf", ["a.jsonl", "b.jsonl"], 1, "")
    assert parser.parse_args(["run"]).prompts == []  # append defaults are not shared between parses


def test_commands_is_a_tuple_others_extend(monkeypatch, capsys):
    """A module adds a command by extending ``cli.COMMANDS``: ``main`` parses that command's own options,
    refuses bad ones with 4, passes its exit code through, and keeps every built-in command."""
    seen = []

    def add_hello_command(sub):
        hello = sub.add_parser("hello")
        hello.add_argument("--name", required=True)
        hello.set_defaults(func=lambda args: seen.append(args.name) or exitcodes.GATE_FAILED)

    assert isinstance(cli.COMMANDS, tuple)
    builtin = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert {"run", "record", "compare", "report", "probe"} <= builtin
    monkeypatch.setattr(cli, "COMMANDS", cli.COMMANDS + (add_hello_command,))
    assert cli.main(["hello", "--name", "x"]) == exitcodes.GATE_FAILED and seen == ["x"]
    assert cli.main(["hello"]) == exitcodes.BAD_INPUT and seen == ["x"]
    assert "--name" in capsys.readouterr().err
    assert set(cli.build_parser()._subparsers._group_actions[0].choices) == builtin | {"hello"}


def test_lossless_runs_the_packaged_module_with_the_callers_rootdir(tmp_path):
    """One real ``specparity lossless`` process (the console script hands its arguments to pytest): the
    header names the caller's directory as rootdir, the collected tree the packaged gate module."""
    exe = Path(sys.executable).with_name("specparity")
    proc = subprocess.run([str(exe), "lossless", "--collect-only", "-p", "no:cacheprovider", "--categories", "code"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.strip() for line in proc.stdout.splitlines()]
    assert f"rootdir: {tmp_path}" in lines, proc.stdout
    assert "<Module test_lossless.py>" in lines, proc.stdout
    ids = [line[len("<Function "):-1] for line in lines if line.startswith("<Function ")]
    assert ids[0] == "test_lossless[code-en-001]" and ids[-1] == "test_gate_policy", proc.stdout
