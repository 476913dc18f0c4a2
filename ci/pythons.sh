#!/usr/bin/env bash
# The torch-free tests on the oldest and the newest supported Python (pyproject's classifiers).
#
# A server gate needs no torch (`pip install specparity`), so each version gets a virtualenv of its
# own with `-e ".[test]"` and no torch, and runs the test files below: the judge, the readers, the
# layer rules, the launch argv, every module compiling and importing without a warning,
# check_lossless on engines' offline outputs, and a server gate with torch absent. Each must pass
# without torch; the rest runs in the main run (`pytest -n auto`). Files that start many child
# processes and test nothing version-specific stay out, to keep this step near two minutes.
#
# Usage: bash ci/pythons.sh [VERSION ...]   (default: 3.10 3.13). An interpreter is python<VERSION>
# on PATH, else pyenv's ~/.pyenv/versions/<VERSION>.*; a missing one fails (CI must not skip it).
# The dependencies of both versions install side by side, without compiling every module of
# transformers to bytecode (--no-compile: pip's compile step took three quarters of the install), at
# the versions of ci/lock.txt (SPECPARITY_LOCK as in ci/install.sh: another lock file, or none for the
# newest versions the ranges allow);
# the package itself (`-e . --no-deps`) one version at a time, so two builds never write the
# checkout's metadata at once; then the tests of both versions run side by side.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(3.10 3.13)
TESTS=(
  tests/test_jsonl.py
  tests/test_compare.py
  tests/test_checks.py
  tests/test_policy.py
  tests/test_prompts.py
  tests/test_launch.py
  tests/test_layers.py
  tests/test_sources_compile.py
  tests/test_api_engine_outputs.py
  tests/test_without_torch.py
)
export HF_HUB_OFFLINE=1

interpreter() {
  # python<v> on PATH if it runs (a pyenv shim for a version not selected does not), else pyenv's own
  local v=$1 candidate
  for candidate in "$(command -v "python$v" || true)" \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$v".*/bin/python 2>/dev/null | sort -V -r); do
    if [ -n "$candidate" ] && [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$v" ]; then
      echo "$candidate"
      return 0
    fi
  done
  echo "ci/pythons.sh: no Python $v (python$v on PATH or pyenv's versions/$v.*)" >&2
  return 1
}

# The runtime and test requirements, read from pyproject.toml (markers kept: tomli for 3.10).
requirements=$(mktemp)
logs=$(mktemp -d)
trap 'rm -rf "$requirements" "$logs"' EXIT
python3 - "$requirements" <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # the CI's own python3 is 3.11+, but be kind to a 3.10 one
    import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["test"])
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
EOF

lock=${SPECPARITY_LOCK:-ci/lock.txt}
pins=()
if [ "$lock" != none ]; then
  [ -f "$lock" ] || { echo "ci/pythons.sh: SPECPARITY_LOCK: $lock is not a file (expected a lock file or 'none')" >&2; exit 4; }
  pins=(-c "$lock")
fi

start=$SECONDS
pids=()
for v in "${VERSIONS[@]}"; do
  py=$(interpreter "$v")
  (
    "$py" -m venv --clear ".venv-py$v"
    ".venv-py$v/bin/python" -m pip install -q --no-compile "${pins[@]}" "setuptools>=77" -r "$requirements"
  ) >"$logs/install-$v.log" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "ci/pythons.sh: installing for Python ${VERSIONS[$i]} failed:" >&2
    grep -v "is ignored: it is neither a file nor a directory" "$logs/install-${VERSIONS[$i]}.log" >&2 || true
    failed=1
  fi
done
[ $failed -eq 0 ] || exit 1
for v in "${VERSIONS[@]}"; do
  ".venv-py$v/bin/python" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  if ".venv-py$v/bin/python" -c "import torch" 2>/dev/null; then
    echo "ci/pythons.sh: torch is importable in .venv-py$v: these tests must run without it" >&2
    exit 1
  fi
done
echo "ci/pythons.sh: installed Python ${VERSIONS[*]} in $((SECONDS - start)) s"

pids=()
for v in "${VERSIONS[@]}"; do
  ".venv-py$v/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" >"$logs/test-$v.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  v=${VERSIONS[$i]}
  if wait "${pids[$i]}"; then
    echo "ci/pythons.sh: Python $v: $(tail -n 1 "$logs/test-$v.log")"
  else
    echo "ci/pythons.sh: Python $v: the torch-free tests failed:" >&2
    cat "$logs/test-$v.log" >&2
    failed=1
  fi
done
echo "ci/pythons.sh: Python ${VERSIONS[*]} done in $((SECONDS - start)) s"
exit $failed
