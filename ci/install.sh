#!/usr/bin/env bash
# Install specparity and everything its tests need into the current Python environment, at the versions
# the suite was last proven with: ci/lock.txt, as pip constraints (ci/lock.py compiles it from
# pyproject.toml's ranges and ci/lock.in; `python3 ci/lock.py upgrade` moves it on purpose).
#
# SPECPARITY_LOCK=FILE installs with another lock; SPECPARITY_LOCK=none the newest versions the ranges allow
# (`python3 ci/lock.py newest`), torch excepted: it stays at ci/lock.in's pin unless SPECPARITY_TORCH names
# another requirement. torch goes first, pinned: a looser requirement would pull a multi-GB CUDA build (the
# CPU wheel of 2.13.0 is what this machine class has on disk); pyproject's range admits it, so pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
lock=${SPECPARITY_LOCK:-ci/lock.txt}
if [ "$lock" = none ]; then
  pins=(--upgrade --upgrade-strategy eager)
  torch=${SPECPARITY_TORCH:-$(grep -E '^torch[=<>!~ ]' ci/lock.in)}
else
  [ -f "$lock" ] || { echo "ci/install.sh: SPECPARITY_LOCK: $lock is not a file (expected a lock file or 'none')" >&2; exit 4; }
  pins=(-c "$lock")
  torch=torch
fi
python -m pip install -q "${pins[@]}" pip "setuptools>=77"
python -m pip install -q "${pins[@]}" "$torch"
# Without build isolation: the package builds with the setuptools installed above, not whatever is newest.
python -m pip install -q "${pins[@]}" --no-build-isolation -e ".[torch,test,ray]"  # [torch]: the in-process engines; [test]: what the tests need; [ray]: the run over a Ray cluster (pyproject)
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
