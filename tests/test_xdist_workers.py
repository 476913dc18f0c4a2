"""``-n auto`` in this repository: one pytest-xdist worker more than the CPUs (``tests/conftest.py``),
``PYTEST_XDIST_AUTO_NUM_WORKERS`` left to pytest-xdist, and a session without xdist (``-p no:xdist``,
as mutation testing runs the tests) still starts: the hook is optional there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from child_signals import default_sigint
from specparity.model.locations import REPO_ROOT


def _tests_conftest():
    """``tests/conftest.py`` as a module of its own (``conftest`` alone may name the root one)."""
    spec = importlib.util.spec_from_file_location("tests_conftest", REPO_ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_auto_is_one_worker_more_than_the_cpus(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    assert _tests_conftest().pytest_xdist_auto_num_workers(None) == len(os.sched_getaffinity(0)) + 1


def test_the_environment_variable_is_left_to_xdist(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert _tests_conftest().pytest_xdist_auto_num_workers(None) is None


def test_a_session_without_xdist_starts():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only",
                           "-q", "tests/test_policy_file.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=default_sigint, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_policy_file.py::" in proc.stdout
