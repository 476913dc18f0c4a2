"""Installing specparity leaves other projects' pytest sessions alone.

pytest loads every ``pytest11`` entry point of the environment into every session. A project whose
``conftest.py`` declares options with the generic names the gate uses (``--device``, ``--dtype``,
``--engine``, ``--target``, ``--report``) must run as if specparity were not installed, while the
gate still loads where it is asked for (``--pyargs specparity.suite``, ``-p specparity``). Each
case is a child ``pytest`` of the current environment (where specparity is installed, entry point
included) in a folder outside the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specparity.cli.option_table import gate_dests
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.model.prompts import load_prompts

#: The foreign project's options: names the gate also uses, with the values its tests must see.
THEIRS = {"device": "cuda:3", "dtype": "bfloat16", "engine": "ours", "target": "tiny-model", "report": "their-report"}

#: A server gate, only collected (no server is contacted): it needs no torch, so these tests run in
#: the torch-free environments of .ci/run too.
SERVER_GATE = ("--engine", "vllm", "--baseline-url", "http://127.0.0.1:9", "--spec-url", "http://127.0.0.1:10",
               "--target", str(fixture_dir("target")), "--categories", "code")

FOREIGN_CONFTEST = '''
import pytest

NAMES = {names!r}


def pytest_addoption(parser):
    for name in NAMES:
        parser.addoption(f"--{{name}}", default=None)


@pytest.fixture
def their_options(pytestconfig):
    return {{name: pytestconfig.getoption(name) for name in NAMES}}
'''

FOREIGN_TEST = '''
import json
from pathlib import Path


def test_their_options_reach_their_test(their_options):
    Path("seen.json").write_text(json.dumps(their_options))
'''


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest ARGS`` in a child, from ``cwd``, as a shell in that folder would run it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_PLUGINS")
           and not k.startswith("PYTEST_XDIST")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _foreign_project(root: Path) -> Path:
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(FOREIGN_CONFTEST.format(names=tuple(THEIRS)))
    (root / "test_theirs.py").write_text(FOREIGN_TEST)
    return root


def test_a_project_declaring_the_same_option_names_runs_green(tmp_path):
    assert REPO_ROOT not in tmp_path.parents
    project = _foreign_project(tmp_path / "engine-team")
    argv = [arg for name, value in THEIRS.items() for arg in (f"--{name}", value)]
    proc = _pytest(project, "-q", *argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((project / "seen.json").read_text()) == THEIRS


def test_a_foreign_session_gets_none_of_the_gates_options(tmp_path):
    project = _foreign_project(tmp_path / "engine-team")
    proc = _pytest(project, "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    gate_only = [dest for dest in gate_dests() if dest not in THEIRS]
    assert gate_only
    assert not [dest for dest in gate_only if f"--{dest.replace('_', '-')}" in proc.stdout], proc.stdout[-3000:]


def test_the_gate_still_loads_where_it_is_named(tmp_path):
    """``--pyargs specparity.suite`` collects one test per prompt and the policy test; ``-p specparity``
    brings the options."""
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    proc = _pytest(empty, "-q", "--collect-only", "--pyargs", "specparity.suite", *SERVER_GATE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line.split("::", 1)[1] for line in proc.stdout.splitlines() if "::" in line]
    code = [p.id for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category == "code"]
    assert code and ids == [f"test_lossless[{pid}]" for pid in code] + ["test_gate_policy"], proc.stdout[-3000:]
    helped = _pytest(empty, "-p", "specparity", "--help")
    assert helped.returncode == 0 and "--near-tie-nats" in helped.stdout, helped.stderr[-3000:]


def test_a_team_names_the_plugin_in_its_rootdir_conftest(tmp_path):
    """docs/ADOPTING.md: a re-exporting test file plus ``pytest_plugins`` in the rootdir conftest."""
    repo = tmp_path / "engine-team"
    (repo / "tests").mkdir(parents=True)
    (repo / "pytest.ini").write_text("[pytest]\n")
    (repo / "conftest.py").write_text('pytest_plugins = ["specparity.plugin.pytest_plugin"]\n')
    (repo / "tests" / "test_specparity_gate.py").write_text(
        "from specparity.suite.test_lossless import test_gate_policy, test_lossless  # noqa: F401\n")
    proc = _pytest(repo, "-q", "--collect-only", "tests/test_specparity_gate.py", *SERVER_GATE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [line.split("::", 1)[1] for line in proc.stdout.splitlines() if "::" in line]
    code = [p.id for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category == "code"]
    assert sorted(ids) == sorted([f"test_lossless[{pid}]" for pid in code] + ["test_gate_policy"]), proc.stdout[-3000:]
