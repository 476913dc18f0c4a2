#!/usr/bin/env bash
# The whole suite in the active virtualenv, as CI runs it: install (ci/lock.txt, or SPECPARITY_LOCK),
# the llama-server build and GGUFs, a headless browser, the torch-free tests on the oldest and the
# newest supported Python, then the README's test command. `.ci/run` calls it in a fresh .venv;
# `python3 ci/lock.py upgrade|newest` call it in their own virtualenvs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
# A real llama-server for the live llama.cpp tests (built once per machine, cached by version and
# flags outside the checkout) and the fixture GGUFs; the tests must then find both, not skip.
bash ci/llamacpp.sh
# A real headless browser for the triage report's browser test (tests/test_report_browser.py), from
# Debian's registry; the test fails instead of skipping when it is required.
bash ci/browser.sh
export SPECPARITY_REQUIRE_BROWSER=1
export SPECPARITY_REQUIRE_LLAMACPP=1
export HF_HUB_OFFLINE=1
# Python's default: compiled modules are kept. Some CI images set PYTHONDONTWRITEBYTECODE=1, and then
# every process (each xdist worker, each child gate run, each nested pytest session) compiles the
# package again and pytest rewrites every test module again: collecting the suite takes 7 s instead
# of 2.7 s on the 2-core VM, per worker (docs/PERFORMANCE.md).
unset PYTHONDONTWRITEBYTECODE
# CI has a package registry: a test that needs one must fail, not skip, when it cannot reach it.
export SPECPARITY_REQUIRE_REGISTRY=1
# The torch-free tests on the oldest and the newest supported Python (3.10, 3.13), each in a
# virtualenv of its own without torch, as a team gating a server installs specparity (2-3 minutes on
# the 2-core VM).
bash ci/pythons.sh 3.10 3.13
# The README's test command (the whole suite: harness tests, lossless gate on the embedded engine and
# on a real llama-server, probes, sweeps).
pytest -n auto
