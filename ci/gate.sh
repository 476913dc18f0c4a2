#!/usr/bin/env bash
# specparity pre-merge gate: run the chosen suites against one engine configuration, write a JUnit
# XML file per suite and the reports, and exit with the worst exit code.
#
#   ci/gate.sh [--suites lossless,invariance,probes] [--config FILE] [--engine NAME] [--preset NAME]
#              [--target DIR] [--draft DIR] [--policy FILE] [--report DIR] [--probe-engine NAME==VERSION]
#              [--dry-run] [-- EXTRA ARGS FOR THE LOSSLESS SUITE]
#
# Engine configuration: command-line options, else variables from the environment or from --config
# FILE (a bash file of assignments, sourced; command-line options win over it):
#   SPECPARITY_SUITES            suites to run (default: lossless)
#   SPECPARITY_ENGINE            the gate's --engine: dflash, hf, llamacpp, sglang, vllm, module:factory; required
#                                by the lossless and invariance suites (no default: the script never gates the
#                                fixture models by accident; --engine dflash without a target is the fixture demo)
#   SPECPARITY_PRESET            server engines: the launch preset (--preset; specparity/engines/server/presets.py)
#   SPECPARITY_TARGET            target model directory (or GGUF for llamacpp)
#   SPECPARITY_DRAFT             draft model directory
#   SPECPARITY_POLICY            the policy file (default: policy.toml beside this script, when it exists)
#   SPECPARITY_REPORT            report directory (default: reports/gate)
#   SPECPARITY_PROBE_ENGINE      probes: the engine and version the deploy runs (sglang==0.5.23, llamacpp==11434)
#   SPECPARITY_LOSSLESS_FLAGS    more flags for the lossless suite (word-split: --engine-opt k=v --categories math)
#   SPECPARITY_INVARIANCE_FLAGS  more flags for the invariance suite
#   SPECPARITY_PROBES_FLAGS      more flags for the probes suite, in pytest's form (--probe-live-engine=dflash,
#                                --probe-sglang-source=DIR, --probe-launch-flags=...); `specparity probe` gets them
#                                without the probe- prefix
#   SPECPARITY_SUITES_DIR        where suites/invariance and suites/probes live (default: ../suites beside this
#                                script, i.e. a specparity checkout); without it, probes run as `specparity probe`
#                                and invariance cannot run (exit 4)
#   PYTHON                       the interpreter that has specparity installed (default: python)
#
# Suites:
#   lossless    the gate itself, from the installed package (`specparity lossless`), with --policy;
#               report in <report>/lossless/ (summary.md, report.html, results.jsonl)
#   invariance  verify/decode invariance (suites/invariance; with an engine, its --draft is the target:
#               self-draft); report in <report>/invariance/
#   probes      engine-side probes (suites/probes, or `specparity probe --format json` outside a checkout);
#               needs SPECPARITY_PROBE_ENGINE and a target. A probe answering "unknown" fails unless the
#               policy file's allow_unknown names it (without a policy file, none is allowed)
# Always: <report>/junit/<suite>.xml, <report>/<suite>.log (the suite's output) and <report>/gate.json
# ({"exit_code": worst, "suites": {name: {"exit_code", "junit", "log", "tests", "failures", "errors", "skipped"}}}).
#
# Exit codes (specparity's, README "Exit codes"): 0 pass, 1 gate failure, 2 interrupted, 3 harness or
# engine error, 4 bad input (docs/ERRORS.md). The script exits with the WORST (highest) code over the
# suites; pytest's own 5 (no tests collected: a selection that matches nothing) counts as 1, a gate
# failure: nothing judged is never a pass. Every selected suite runs even after one failed, so each
# JUnit file and report is there to read.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"

die() {  # bad input of this script: one line, exit 4
    echo "ci/gate.sh: $*" >&2
    exit 4
}

usage() {
    sed -n '2,/^set -uo pipefail/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ---------------------------------------------------------------- options
declare -A CLI=()
EXTRA=()
DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --suites|--config|--engine|--preset|--target|--draft|--policy|--report|--probe-engine)
            [[ $# -ge 2 && -n "$2" ]] || die "$1: expected a value"
            CLI["$1"]="$2"; shift 2 ;;
        --suites=*|--config=*|--engine=*|--preset=*|--target=*|--draft=*|--policy=*|--report=*|--probe-engine=*)
            CLI["${1%%=*}"]="${1#*=}"; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die "$1: unknown option (ci/gate.sh --help lists them; gate flags go after --)" ;;
    esac
done

CONFIG="${CLI[--config]:-${SPECPARITY_CONFIG:-}}"
if [[ -n "$CONFIG" ]]; then
    [[ -f "$CONFIG" ]] || die "--config $CONFIG: no such file (expected a bash file of SPECPARITY_* assignments)"
    # shellcheck disable=SC1090
    . "$CONFIG" || die "--config $CONFIG: sourcing it failed"
fi

SUITES="${CLI[--suites]:-${SPECPARITY_SUITES:-lossless}}"
ENGINE="${CLI[--engine]:-${SPECPARITY_ENGINE:-}}"
PRESET="${CLI[--preset]:-${SPECPARITY_PRESET:-}}"
TARGET="${CLI[--target]:-${SPECPARITY_TARGET:-}}"
DRAFT="${CLI[--draft]:-${SPECPARITY_DRAFT:-}}"
REPORT="${CLI[--report]:-${SPECPARITY_REPORT:-reports/gate}}"
PROBE_ENGINE="${CLI[--probe-engine]:-${SPECPARITY_PROBE_ENGINE:-}}"
POLICY="${CLI[--policy]:-${SPECPARITY_POLICY:-}}"
if [[ -z "$POLICY" && -f "$HERE/policy.toml" ]]; then
    POLICY="$HERE/policy.toml"
fi
[[ -z "$POLICY" || -f "$POLICY" ]] || die "--policy $POLICY: no such file (expected a TOML policy, see ci/policy.toml)"
SUITES_DIR="${SPECPARITY_SUITES_DIR:-}"
if [[ -z "$SUITES_DIR" && -f "$HERE/../suites/invariance/conftest.py" ]]; then
    SUITES_DIR="$(cd "$HERE/../suites" && pwd)"
fi

read -ra LOSSLESS_FLAGS <<< "${SPECPARITY_LOSSLESS_FLAGS:-}"
read -ra INVARIANCE_FLAGS <<< "${SPECPARITY_INVARIANCE_FLAGS:-}"
read -ra PROBES_FLAGS <<< "${SPECPARITY_PROBES_FLAGS:-}"

IFS=',' read -ra SELECTED <<< "$SUITES"
[[ ${#SELECTED[@]} -gt 0 ]] || die "--suites '$SUITES': expected a comma-separated list of lossless, invariance, probes"
for s in "${SELECTED[@]}"; do
    case "$s" in
        lossless|invariance|probes) ;;
        *) die "--suites: unknown suite '$s' (expected lossless, invariance, probes)" ;;
    esac
done

for s in "${SELECTED[@]}"; do
    if [[ -z "$ENGINE" && ( "$s" == lossless || "$s" == invariance ) ]]; then
        die "suite $s: no engine configured; set SPECPARITY_ENGINE (or --engine: dflash, hf, llamacpp, sglang, vllm, module:factory) and SPECPARITY_TARGET (--target)"
    fi
done

JUNIT="$REPORT/junit"
mkdir -p "$JUNIT" || die "--report $REPORT: cannot create the report directory"
REPORT="$(cd "$REPORT" && pwd)"
JUNIT="$REPORT/junit"
# the probes judge "unknown" by the policy's allow_unknown; without a policy file, an empty one allows none
PROBE_POLICY="$POLICY"
if [[ -z "$PROBE_POLICY" && ",$SUITES," == *",probes,"* ]]; then
    PROBE_POLICY="$REPORT/probes-policy.toml"
    printf '# written by ci/gate.sh: no policy file given, so no probe may answer "unknown"\n[gate]\nallow_unknown = []\n' > "$PROBE_POLICY"
fi

# ---------------------------------------------------------------- one command per suite
ENGINE_ARGS=()
PROBES_VIA_CLI=0
[[ -n "$ENGINE" ]] && ENGINE_ARGS+=(--engine "$ENGINE")
[[ -n "$PRESET" ]] && ENGINE_ARGS+=(--preset "$PRESET")
[[ -n "$TARGET" ]] && ENGINE_ARGS+=(--target "$TARGET")

suite_command() {  # fills CMD for suite $1; returns 4 (with a line on stderr) when it cannot run here
    local suite="$1"
    CMD=()
    case "$suite" in
        lossless)
            CMD=("$PYTHON" -c 'import sys; from specparity.cli.commands import console_main; sys.exit(console_main())' lossless
                 "${ENGINE_ARGS[@]}")
            [[ -n "$DRAFT" ]] && CMD+=(--draft "$DRAFT")
            [[ -n "$POLICY" ]] && CMD+=(--policy "$POLICY")
            CMD+=(--report "$REPORT/lossless" --junitxml "$JUNIT/lossless.xml" "${LOSSLESS_FLAGS[@]}" "${EXTRA[@]}") ;;
        invariance)
            if [[ -z "$SUITES_DIR" || ! -d "$SUITES_DIR/invariance" ]]; then
                echo "ci/gate.sh: suite invariance: suites/invariance is not shipped in the package; set SPECPARITY_SUITES_DIR to a specparity checkout's suites/" >&2
                return 4
            fi
            CMD=("$PYTHON" -m pytest "$SUITES_DIR/invariance" --rootdir "$PWD" "${ENGINE_ARGS[@]}")
            # an engine under test drafts for itself: its draft is the target (flags below may override)
            [[ -n "$ENGINE" && -n "$TARGET" ]] && CMD+=(--draft "$TARGET")
            CMD+=(--report "$REPORT" --junitxml "$JUNIT/invariance.xml" "${INVARIANCE_FLAGS[@]}") ;;
        probes)
            if [[ -z "$PROBE_ENGINE" || -z "$TARGET" ]]; then
                echo "ci/gate.sh: suite probes: needs SPECPARITY_PROBE_ENGINE (--probe-engine name==version, e.g. sglang==0.5.23) and a target (--target DIR)" >&2
                return 4
            fi
            if [[ -n "$SUITES_DIR" && -d "$SUITES_DIR/probes" ]]; then
                CMD=("$PYTHON" -m pytest "$SUITES_DIR/probes" --rootdir "$PWD" --target "$TARGET"
                     --probe-engine "$PROBE_ENGINE" --policy "$PROBE_POLICY")
                [[ -n "$DRAFT" ]] && CMD+=(--draft "$DRAFT")
                CMD+=(--junitxml "$JUNIT/probes.xml" "${PROBES_FLAGS[@]}")
            else  # installed package only: the probe command, its JSON turned into JUnit below
                PROBES_VIA_CLI=1
                CMD=("$PYTHON" -c 'import sys; from specparity.cli.commands import console_main; sys.exit(console_main())' probe
                     --target "$TARGET" --engine "$PROBE_ENGINE" --policy "$PROBE_POLICY")
                [[ -n "$DRAFT" ]] && CMD+=(--draft "$DRAFT")
                CMD+=(--format json)
                for flag in "${PROBES_FLAGS[@]}"; do  # pytest's --probe-X is the probe command's --X
                    CMD+=("${flag/#--probe-/--}")
                done
            fi ;;
    esac
}

# probe JSON (stdin) -> JUnit XML ($1): fail -> failure, unknown -> skipped, ok / warn -> passed
PROBE_JUNIT='
import json, sys, xml.etree.ElementTree as ET
verdicts = json.load(sys.stdin)
suite = ET.Element("testsuite", name="specparity probes", tests=str(len(verdicts)))
counts = {"failures": 0, "skipped": 0}
for v in verdicts:
    case = ET.SubElement(suite, "testcase", classname="specparity.probes", name=v["probe"])
    text = "\n".join([v.get("summary") or ""] + list(v.get("evidence") or []) + ([v["action"]] if v.get("action") else []))
    if v["status"] == "fail":
        counts["failures"] += 1
        ET.SubElement(case, "failure", message=v.get("summary") or "").text = text
    elif v["status"] == "unknown":
        counts["skipped"] += 1
        ET.SubElement(case, "skipped", message=v.get("summary") or "")
    else:
        ET.SubElement(case, "system-out").text = v["status"] + ": " + text
for key, n in counts.items():
    suite.set(key, str(n))
suite.set("errors", "0")
root = ET.Element("testsuites")
root.append(suite)
ET.ElementTree(root).write(sys.argv[1], encoding="utf-8", xml_declaration=True)
'

declare -A CODES=()
WORST=0
for suite in "${SELECTED[@]}"; do
    log="$REPORT/$suite.log"
    if ! suite_command "$suite"; then
        CODES[$suite]=4
    elif [[ $DRY_RUN -eq 1 ]]; then
        printf '%q ' "${CMD[@]}"; echo
        CODES[$suite]=0
    else
        echo "=== specparity gate: $suite"
        if [[ "$suite" == probes && $PROBES_VIA_CLI -eq 1 ]]; then
            "${CMD[@]}" > "$REPORT/probes.json" 2> "$log"
            code=$?
            cat "$log" >&2
            if [[ -s "$REPORT/probes.json" ]] && "$PYTHON" -c "$PROBE_JUNIT" "$JUNIT/probes.xml" < "$REPORT/probes.json"; then
                "$PYTHON" -c 'import json, sys; [print("%8s  %s: %s" % (v["status"], v["probe"], v["summary"])) for v in json.load(open(sys.argv[1]))]' "$REPORT/probes.json"
            fi
        else
            "${CMD[@]}" 2>&1 | tee "$log"
            code=${PIPESTATUS[0]}
        fi
        if [[ $code -eq 5 ]]; then  # pytest: no tests collected: nothing judged, never a pass
            echo "ci/gate.sh: suite $suite: no test collected (the selection matched nothing): nothing judged, a gate failure" >&2
            code=1
        fi
        CODES[$suite]=$code
    fi
    (( CODES[$suite] > WORST )) && WORST=${CODES[$suite]}
done

# ---------------------------------------------------------------- summary
[[ $DRY_RUN -eq 1 ]] && exit "$WORST"
SUMMARY='
import json, os, sys, xml.etree.ElementTree as ET
report, worst, policy = sys.argv[1], int(sys.argv[2]), sys.argv[3]
suites = {}
for item in sys.argv[4:]:
    name, code = item.split("=")
    junit = os.path.join(report, "junit", name + ".xml")
    entry = {"exit_code": int(code), "junit": junit if os.path.isfile(junit) else None,
             "log": os.path.join(report, name + ".log")}
    if entry["junit"]:
        root = ET.parse(junit).getroot()
        for key in ("tests", "failures", "errors", "skipped"):
            entry[key] = sum(int(s.get(key, 0)) for s in root.iter("testsuite"))
    suites[name] = entry
doc = {"exit_code": worst, "policy": policy or None, "suites": suites}
with open(os.path.join(report, "gate.json"), "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
names = {0: "pass", 1: "gate failure", 2: "interrupted", 3: "harness or engine error", 4: "bad input"}
print("=== specparity gate summary")
for name, e in suites.items():
    counts = "no JUnit file"
    if e["junit"]:
        counts = "%d tests, %d failed, %d errors, %d skipped" % (e["tests"], e["failures"], e["errors"], e["skipped"])
    print("  %-11s exit %d (%s): %s" % (name, e["exit_code"], names.get(e["exit_code"], "?"), counts))
print("  worst: exit %d (%s); reports in %s" % (worst, names.get(worst, "?"), report))
'
ARGS=()
for suite in "${SELECTED[@]}"; do ARGS+=("$suite=${CODES[$suite]}"); done
"$PYTHON" -c "$SUMMARY" "$REPORT" "$WORST" "$POLICY" "${ARGS[@]}" || echo "ci/gate.sh: could not summarize the JUnit files" >&2
exit "$WORST"
