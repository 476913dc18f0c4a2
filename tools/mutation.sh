#!/usr/bin/env bash
# Mutation testing of the verdict code (specparity/judge/, specparity/gate/, specparity/model/threshold.py)
# and of the run-level code (specparity/run/merge.py, ray_fleet.py, arm_runs.py, arm_plan.py, arm_evidence.py and
# specparity/model/run_state.py), against the unit-level tests named in pyproject.toml's
# [tool.mutmut] table (pytest ignores that table; `pytest -n auto` is unchanged).
#
#   bash tools/mutation.sh                                  # every mutant (hours on 2 cores)
#   bash tools/mutation.sh "specparity.judge.compare.*"     # only the mutants matching the patterns
#   bash tools/mutation.sh "specparity.run.*"               # the run-level files only
#   bash tools/mutation.sh --score                          # print the score of what has run so far
#
# Not part of CI. mutmut works in ./mutants/ (ignored by git) and keeps each mutant's result there,
# so a second run only tests mutants without a result, and a run with patterns re-tests those.
# One worker at the lowest priority: the machine's other work keeps its timing.
# Needs `pip install mutmut` (3.x) in the active environment. docs/notes/mutation.md has the last
# score and why each survivor is equivalent.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

if [ "${1:-}" != "--score" ]; then
  nice -n 19 mutmut run --max-children 1 "$@" || true
fi

# The score per part, from mutmut's result files (exit code 1: a test failed, the mutant is killed;
# 0: survived; 33: no selected test reaches the function; -24/24 or 36: timeout; None: not run yet).
python3 - <<'EOF'
import collections, glob, json

PARTS = {"judge": "mutants/specparity/judge/", "gate": "mutants/specparity/gate/",
         "threshold": "mutants/specparity/model/threshold.py", "run": "mutants/specparity/run/",
         "run_state": "mutants/specparity/model/run_state.py"}
WORDS = {1: "killed", 0: "survived", 33: "no tests", None: "not run"}
try:  # which functions the selected tests reach: a "no tests" result for one of them is stale
    covered = {f for f, t in json.load(open("mutants/mutmut-stats.json"))["tests_by_mangled_function_name"].items() if t}
except (OSError, KeyError, ValueError):
    covered = set()
total = collections.Counter()
survivors = []
for meta in sorted(glob.glob("mutants/specparity/**/*.py.meta", recursive=True)):  # per file first
    codes = json.load(open(meta))["exit_code_by_key"]
    if not codes:
        continue
    words = collections.Counter()
    for key, code in codes.items():
        if code == 33 and key.rsplit("__mutmut_", 1)[0] in covered:
            code = None
        words[WORDS.get(code, "timeout" if code in (-24, 24, 36, -9) else f"exit {code}")] += 1
    ran = sum(n for w, n in words.items() if w != "not run")
    print(f"  {meta[len('mutants/specparity/'):-len('.meta')]:32} {len(codes):4} mutants, {ran:4} run, "
          f"{words['killed'] + words['timeout']:4} killed ({words['timeout']} by timeout), {words['survived']} survived")
for name, prefix in PARTS.items():
    counts = collections.Counter()
    for meta in sorted(glob.glob("mutants/specparity/**/*.py.meta", recursive=True)):
        if not meta.startswith(prefix):
            continue
        for key, code in json.load(open(meta))["exit_code_by_key"].items():
            if code == 33 and key.rsplit("__mutmut_", 1)[0] in covered:
                code = None
            word = WORDS.get(code, "timeout" if code in (-24, 24, 36, -9) else f"exit {code}")
            counts[word] += 1
            if word in ("survived", "no tests"):
                survivors.append(f"{word}: {key}")
    run = sum(n for w, n in counts.items() if w != "not run")
    killed = counts["killed"] + counts["timeout"]
    score = f"{killed}/{run} = {100 * killed / run:.1f} %" if run else "nothing run"
    print(f"{name:10} {score:22} {dict(counts)}")
    total.update(counts)
run = sum(n for w, n in total.items() if w != "not run")
killed = total["killed"] + total["timeout"]
print(f"{'all':10} {killed}/{run} = {100 * killed / max(run, 1):.1f} % of the mutants run "
      f"({total['not run']} not run)")
print("\n".join(survivors))
EOF
