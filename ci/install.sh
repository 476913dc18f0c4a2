#!/usr/bin/env bash
# Install specparity and everything its tests need into the current Python environment.
# torch first, pinned: a looser requirement would pull a multi-GB CUDA build (the CPU wheel of
# 2.13.0 is what this machine class has on disk); pyproject's range admits it, so pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip "setuptools>=77"
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[torch,test,ray]"  # [torch]: the in-process engines; [test]: what the tests need; [ray]: the run over a Ray cluster (pyproject)
# dflash (the DFlash/DFlash2 reference decoder) without its pins: its [local] extra pins torch
# and transformers exactly, and its base requirements (datasets, tqdm, requests ==) are only
# used by its benchmark module, which specparity never imports. See docs/DFLASH.md.
python -m pip install -q --no-deps dflash==0.1.0
# `pip check` must pass except for dflash's own pins, left out on purpose above: any other broken
# requirement fails the install.
broken=$(python -m pip check 2>&1 | grep -v '^dflash 0\.1\.0 ' | grep -v '^No broken requirements' || true)
if [ -n "$broken" ]; then
  echo "ci/install.sh: pip check found broken requirements:" >&2
  echo "$broken" >&2
  exit 1
fi
