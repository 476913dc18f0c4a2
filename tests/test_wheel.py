"""specparity installed from its wheel, in someone else's repository: no checkout, no fixtures beside it.

Builds the wheel from a copy of the sources (the checkout gets no ``build/``), installs it with
``--no-deps`` into a fresh virtualenv outside the checkout that sees the heavy dependencies (torch,
transformers, dflash …) of the current environment through a ``.pth`` line instead of reinstalling
them, and runs the gate from an empty "engine team" folder: ``specparity run``, ``specparity
lossless``, plain ``pytest --pyargs specparity.suite`` through the ``pytest11`` entry point, a broken loop of the team's own,
and a missing ``--target``. The checkout's fixture models are passed explicitly, as a team passes
its own models.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from llamacpp_fixtures import SUITE_PYTEST
from prompt_subsets import first_of_each
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import load_prompts

pytestmark = pytest.mark.slow

#: What the wheel is built from (pyproject.toml's metadata, setup.py's prompt copy, MANIFEST.in).
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "prompts", "specparity")
MODELS = REPO_ROOT / "fixtures" / "models"
TARGET, DFLASH2_DRAFT, HF_DRAFT = MODELS / "target", MODELS / "dflash2", MODELS / "draft"
#: Two code prompts (a file of their own in the team's repository, see ``installed``), noise measured on them.
FAST = ("--prompts", "code.jsonl", "--calibration", "selected", "--max-new-tokens", "16")
#: The installed plugins the lossless suite never uses stay unloaded in its pytest.
NO_PLUGINS = SUITE_PYTEST[SUITE_PYTEST.index("no:cacheprovider") + 1:]


def _setuptools_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version("setuptools").split(".")[:2] if part.isdigit())
    except PackageNotFoundError:
        return ()


class Installed:
    """A virtualenv with the wheel installed, and an empty repository to run in."""

    def __init__(self, root: Path):
        self.root = root
        self.venv = root / "venv"
        self.bin = self.venv / "bin"
        self.python = self.bin / "python"
        self.repo = root / "engine-team-repo"
        self.repo.mkdir()

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update(PATH=f"{self.bin}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(self.venv), HF_HUB_OFFLINE="1")
        return env

    def run(self, *argv: str | Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(a) for a in argv], cwd=self.repo, env=self.env(), capture_output=True, text=True,
                              timeout=timeout)


def _check(proc: subprocess.CompletedProcess[str], code: int = 0) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == code, f"exit {proc.returncode} (expected {code})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    assert REPO_ROOT not in root.parents, "the install must live outside the checkout"
    src, dist = root / "src", root / "dist"
    src.mkdir()
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    # the installed setuptools when it can build this pyproject (no download); else pip's isolated build
    # fetches one from the package registry
    isolation = ["--no-build-isolation"] if _setuptools_version() >= (77,) else []
    _check(subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w",
                           str(dist), str(src)], capture_output=True, text=True, timeout=300))
    (wheel,) = dist.glob("specparity-*.whl")

    inst = Installed(root)
    _check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(inst.venv)], capture_output=True,
                          text=True, timeout=120))
    (site,) = inst.venv.glob("lib/python*/site-packages")
    # The current environment's packages, after the new venv's own: torch etc. are found there, while
    # the wheel installed into the new venv comes first. Its .pth files are not processed, so the
    # checkout's editable finder (__editable__*.pth) does not come along.
    (site / "_current_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _check(inst.run(inst.python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", "--no-index", wheel))
    first_of_each(inst.repo / "code.jsonl", ("code",), per_category=2)
    return inst


def test_the_wheel_is_what_runs(installed):
    proc = _check(installed.run(installed.python, "-c", "import json, specparity, specparity.cli.options as o, "
                                "specparity.model.locations as f; print(json.dumps([specparity.__file__, str(o.DEFAULT_PROMPTS), "
                                "f.in_checkout()]))"))
    module, prompts, in_checkout = json.loads(proc.stdout)
    assert Path(module).is_relative_to(installed.venv), module
    assert Path(prompts) == Path(module).parent / "_prompts" / "default.jsonl" and Path(prompts).is_file()
    assert not in_checkout
    assert Path(shutil.which("specparity", path=installed.env()["PATH"]) or "").is_relative_to(installed.venv)


def test_run_passes_and_writes_the_report_where_asked(installed):
    proc = _check(installed.run("specparity", "run", "--target", TARGET, "--draft", DFLASH2_DRAFT, *FAST,
                                "--report", "out"))
    assert proc.stdout.startswith("specparity lossless gate: PASS"), proc.stdout
    assert (installed.repo / "out" / "results.jsonl").is_file()
    assert (installed.repo / "out" / "summary.md").is_file()
    assert "report: out/results.jsonl" in proc.stdout


def test_missing_target_is_one_line_naming_target(installed):
    proc = _check(installed.run("specparity", "run", "--categories", "code"), exitcodes.BAD_INPUT)
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "--target" in proc.stderr, proc.stderr


def test_lossless_under_pytest_from_the_installed_package(installed):
    junit = installed.repo / "lossless.xml"
    proc = _check(installed.run("specparity", "lossless", "--target", TARGET, "--draft", DFLASH2_DRAFT, *FAST,
                                "--report", "out-lossless", "--junitxml", junit, "-p", "no:cacheprovider", *NO_PLUGINS))
    assert "specparity lossless gate: PASS" in proc.stdout, proc.stdout[-2000:]
    assert f"rootdir: {installed.repo}" in proc.stdout
    cases = ET.parse(junit).getroot().iter("testcase")
    names = sorted(c.get("name") for c in cases)
    code = len(load_prompts(installed.repo / "code.jsonl").prompts)
    assert names[0] == "test_gate_policy" and len(names) == 1 + code  # the policy test and one per prompt
    assert (installed.repo / "out-lossless" / "results.jsonl").is_file()


def test_plain_pytest_loads_the_plugin_through_its_entry_point(installed):
    # `--pyargs specparity.suite` loads the plugin through the pytest11 entry point; `-p specparity` names it
    # (needed only without autoloading).
    # Collection is where the plugin shows (its options parse, one test per prompt): the gate running to
    # PASS under pytest from the installed package is test_lossless_under_pytest_from_the_installed_package's.
    proc = _check(installed.run(installed.python, "-m", "pytest", "-p", "specparity", "--pyargs", "specparity.suite",
                                "--target", TARGET, "--draft", DFLASH2_DRAFT, *FAST, "-q", "--collect-only",
                                "-p", "no:cacheprovider", *NO_PLUGINS))
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    prompts = [p.id for p in load_prompts(installed.repo / "code.jsonl").prompts]
    assert {i.split("::")[0].rsplit("/", 1)[-1] for i in ids} == {"test_lossless.py"}, proc.stdout[-2000:]
    assert [i.split("::")[1] for i in ids] == [f"test_lossless[{pid}]" for pid in prompts] + ["test_gate_policy"], \
        proc.stdout[-2000:]  # one per prompt, then the policy test
    assert f"{len(ids)} tests collected" in proc.stdout, proc.stdout[-2000:]
    # -p specparity brings the options; a plain session of the team's repository has none of them (they
    # would collide with its own conftest's), nor has -p no:specparity beside --pyargs specparity.suite
    helps = [installed.run(installed.python, "-m", "pytest", *extra, "--help").stdout
             for extra in (("-p", "specparity"), (), ("-p", "no:specparity", "--pyargs", "specparity.suite"))]
    assert "--near-tie-nats" in helps[0] and "--near-tie-nats" not in helps[1] + helps[2]


def test_the_teams_own_tests_still_run_with_specparity_installed(installed):
    (installed.repo / "test_theirs.py").write_text("def test_theirs():\n    assert 1 + 1 == 2\n")
    proc = _check(installed.run(installed.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_theirs.py"))
    assert "1 passed" in proc.stdout
    # the gate's own suite without a target is still one line, exit 4, before any model loads
    gate = _check(installed.run(installed.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
                                "specparity.suite"), exitcodes.BAD_INPUT)
    assert "--target" in gate.stderr + gate.stdout


def test_a_broken_loop_of_the_team_fails_the_gate(installed):
    shutil.copy2(REPO_ROOT / "tests" / "broken_loops.py", installed.repo / "our_loop.py")
    proc = _check(installed.run("specparity", "run", "--engine", "our_loop.py:create", "--engine-opt", "bug=inactive",
                                "--target", TARGET, "--draft", HF_DRAFT, *FAST, "--report", "out-broken"),
                  exitcodes.GATE_FAILED)
    assert proc.stdout.startswith("specparity lossless gate: FAIL") and "speculation inactive" in proc.stdout


def test_the_llamacpp_commands_ship_in_the_wheel(installed):
    """`specparity llamacpp build|convert` run from the wheel alone: the packaged build script (the
    same file the checkout's tools/llamacpp/build_llama_server.sh runs, hence the same key), the
    converter's options, and bad options as one line with exit 4."""
    proc = _check(installed.run(installed.python, "-c", "from specparity.engines.server.llamacpp_build import "
                                "BUILD_SCRIPT; print(BUILD_SCRIPT)"))
    script = Path(proc.stdout.strip())
    assert script.is_relative_to(installed.venv) and script.is_file(), script
    key = _check(installed.run("specparity", "llamacpp", "build", "--print-key")).stdout.strip()
    checkout = subprocess.run(["bash", str(REPO_ROOT / "tools" / "llamacpp" / "build_llama_server.sh"), "--print-key"],
                              capture_output=True, text=True, env=installed.env(), timeout=60)
    assert checkout.returncode == 0 and key == checkout.stdout.strip(), (key, checkout.stdout, checkout.stderr)
    assert "--print-key" in _check(installed.run("specparity", "llamacpp", "build", "--help")).stdout
    assert "--outtype" in _check(installed.run("specparity", "llamacpp", "convert", "--help")).stdout
    for argv, named in ((("build", "--no-such-option"), "--no-such-option"), (("build", "--backend", "rocm"), "rocm"),
                        (("convert", "--outtype", "q3"), "q3"), (("convert",), "--model")):
        proc = _check(installed.run("specparity", "llamacpp", *argv), exitcodes.BAD_INPUT)
        assert proc.stdout == "" and proc.stderr.count("\n") == 1 and named in proc.stderr, (argv, proc.stderr)
