"""The dependency lock (``ci/lock.txt``, ``ci/lock.py``): the install scripts take their versions from it,
it stays inside the package's ranges, and the tool says what moved. Offline: nothing here compiles a lock
or installs a package (``python3 ci/lock.py upgrade|newest`` do, with a registry)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from specparity.model.locations import REPO_ROOT

CI = REPO_ROOT / "ci"


@pytest.fixture(scope="module")
def lock_tool():
    spec = importlib.util.spec_from_file_location("ci_lock", CI / "lock.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ci_lock"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_committed_lock_pins_every_requirement_within_its_range(lock_tool):
    assert lock_tool.check_lock() == []
    pins = {p.name: p.version for p in lock_tool.read_lock(lock_tool.LOCK) if p.marker is None}
    pinned_torch = next(line for line in lock_tool.LOCK_IN.read_text().splitlines() if line.startswith("torch=="))
    assert f"torch=={pins['torch']}" == pinned_torch


def test_a_pin_outside_a_range_or_missing_is_named(lock_tool, tmp_path):
    lines = lock_tool.LOCK.read_text().splitlines()
    transformers = next(i for i, line in enumerate(lines) if line.startswith("transformers=="))
    jinja = next(i for i, line in enumerate(lines) if line.startswith("jinja2=="))
    lines[transformers] = "transformers==5.40.0"
    del lines[jinja]
    bad = tmp_path / "lock.txt"
    bad.write_text("\n".join(lines) + "\n")
    problems = lock_tool.check_lock(bad)
    assert any("transformers==5.40.0 is outside 'transformers>=5.15,<5.40'" in p for p in problems), problems
    assert any(p.startswith("lock.txt: jinja2 is required") for p in problems), problems


def test_a_line_that_is_no_pin_names_its_file_and_line(lock_tool, tmp_path):
    bad = tmp_path / "lock.txt"
    bad.write_text("# header\nnumpy>=2\n")
    with pytest.raises(SystemExit, match=r"lock.txt:2: expected 'name==version \[; marker\]', got 'numpy>=2'"):
        lock_tool.read_lock(bad)


def test_changes_are_listed_per_package(lock_tool, tmp_path):
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("numpy==2.2.6 ; python_full_version < '3.11'\nnumpy==2.4.6 ; python_full_version >= '3.11'\n"
                   "Jinja2==3.1.5\nrich==15.0.0\n")
    new.write_text("numpy==2.2.6 ; python_full_version < '3.11'\nnumpy==2.5.0 ; python_full_version >= '3.11'\n"
                   "jinja2==3.1.5\nurllib3==2.8.0\n")
    changes = lock_tool.describe_changes(lock_tool.versions(lock_tool.read_lock(old)),
                                         lock_tool.versions(lock_tool.read_lock(new)), "old", "new")
    assert changes[0] == "3 package(s) differ between old and new:"
    assert ("| numpy | 2.2.6 (python_full_version < '3.11'), 2.4.6 (python_full_version >= '3.11') | "
            "2.2.6 (python_full_version < '3.11'), 2.5.0 (python_full_version >= '3.11') |") in changes
    assert "| rich | 15.0.0 | (none) |" in changes and "| urllib3 | (none) | 2.8.0 |" in changes
    assert not any(row.startswith("| jinja2") for row in changes)
    assert lock_tool.describe_changes({"a": "1"}, {"a": "1"}, "x", "y") == ["No package differs between x and y."]


@pytest.mark.parametrize("script", ["install.sh", "pythons.sh"])
def test_the_install_scripts_refuse_a_lock_that_is_not_there_before_installing(script, tmp_path):
    proc = subprocess.run(["bash", str(CI / script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPECPARITY_LOCK": str(tmp_path / "nope.txt")})
    assert proc.returncode == 4, proc.stderr
    assert proc.stderr.strip() == (f"ci/{script}: SPECPARITY_LOCK: {tmp_path / 'nope.txt'} is not a file "
                                   "(expected a lock file or 'none')")


def test_ci_installs_from_the_lock(lock_tool):
    """``.ci/run`` runs ci/suite.sh, whose install steps read SPECPARITY_LOCK with ci/lock.txt as the default."""
    assert "bash ci/suite.sh" in (REPO_ROOT / ".ci" / "run").read_text()
    suite = (CI / "suite.sh").read_text()
    assert "bash ci/install.sh" in suite and "bash ci/pythons.sh" in suite
    for script in ("install.sh", "pythons.sh"):
        assert 'lock=${SPECPARITY_LOCK:-ci/lock.txt}' in (CI / script).read_text()
