"""A fourth server engine touches only its own module and one registry row.

``tests/toy_engine.py`` is a server engine the package has never heard of: one row in
``specparity.engines.BUILTIN`` makes it ``--engine toy``. Through it, against the vLLM fake, the gate
runs and passes, ``specparity arms`` runs the default arm and ``prefix-warm`` (which catches a bug only a
prefix-cache hit shows) and refuses the arms its descriptor does not declare, naming why, and the failing
arm's reproducer, run as a user runs it, shows the divergence again. Nothing in the package names the toy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import VLLMServer
from fakes.backend import TARGET
from prompt_subsets import first_of_categories
from specparity.cli.commands import main
from specparity.engines import BUILTIN
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.report.reproducers import REPRODUCERS

#: The vLLM fake as the toy's servers run: cached prompt tokens in every answer, dev mode's routes.
AS_RUN = {"prompt_tokens_details": True, "dev_mode": True}


@pytest.fixture
def toy(monkeypatch):
    """The registry row, and nothing else."""
    monkeypatch.setitem(BUILTIN, "toy", str(Path(__file__).with_name("toy_engine.py")) + ":create")
    return "toy"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    return path, first_of_categories(path, {"math": 2, "code": 2})


def _args(engine, base, spec, prompt_file, report):
    return ["--engine", engine, "--baseline-url", base.url, "--spec-url", spec.url, "--target", str(TARGET),
            "--prompts", str(prompt_file), "--calibration", "selected", "--max-new-tokens", "12", "--report", str(report)]


def test_the_gate_runs_through_a_registered_fourth_engine(toy, prompts, tmp_path, capsys):
    prompt_file, chosen = prompts
    with VLLMServer(**AS_RUN) as base, VLLMServer(speculative=True, **AS_RUN) as spec:
        code = main(["run", *_args(toy, base, spec, prompt_file, tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == exitcodes.PASS, out
    run = json.loads((tmp_path / "run" / "results.jsonl").read_text().splitlines()[0])
    assert run["kind"] == "run" and run["fingerprint"]["engine"] == toy, run.get("fingerprint")
    assert len(spec.seen) >= len(chosen)


def test_two_arms_and_a_reproducer_through_a_fourth_engine(toy, prompts, tmp_path, capsys):
    prompt_file, chosen = prompts
    report = tmp_path / "arms"
    with VLLMServer(**AS_RUN) as base, VLLMServer(speculative=True, prefix_hit_bug=True, **AS_RUN) as spec:
        code = main(["arms", *_args(toy, base, spec, prompt_file, report), "--arms", "default,prefix-warm"])
        out = capsys.readouterr().out
        assert spec.arm_flipped, "no answer was a prefix-cache hit: nothing was tested"
        rows = {r["arm"]: r for r in json.loads((report / "arms.json").read_text())["results"]}
        assert rows["default"]["status"] == "PASS", rows["default"]
        assert rows["prefix-warm"]["status"] == "FAIL" and rows["prefix-warm"]["evidence"]["exercised"] is True
        assert code == exitcodes.GATE_FAILED, out
        # the failing arm's reproducer, a child process with the standard library only, shows it again
        folders = [d for d in (report / "prefix-warm" / REPRODUCERS).iterdir() if d.is_dir()]
        assert folders, "the failing arm wrote no reproducer"
        script = (folders[0] / "repro.py").read_text()
        assert 'block = answer["choices"][0]["logprobs"]' in script  # the toy's own parser
        done = subprocess.run([sys.executable, "-I", str(folders[0] / "repro.py")], capture_output=True, text=True,
                              timeout=120)
        position = json.loads((folders[0] / "streams.json").read_text())["verdict"]["first_difference"]
        assert done.returncode == 1, done.stdout + done.stderr  # the prompt is still cached: the bug shows again
        assert f"first differing output position: {position}" in done.stdout, done.stdout


def test_an_arm_the_fourth_engine_does_not_declare_is_refused_naming_why(toy, tmp_path, capsys):
    code = main(["arms", "--engine", toy, "--baseline-url", "http://127.0.0.1:9", "--spec-url", "http://127.0.0.1:10",
                 "--target", str(TARGET), "--arms", "preempt", "--prelaunched", "--report", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == exitcodes.BAD_INPUT
    assert "the toy server has no such knob" in err and "(it supports: default, prefix-warm)" in err, err


def test_nothing_in_the_package_names_the_fourth_engine():
    hits = [str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "specparity").rglob("*.py")
            if "toy_engine" in p.read_text(encoding="utf-8") or '"toy"' in p.read_text(encoding="utf-8")]
    assert not hits, hits
