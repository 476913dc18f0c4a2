"""``benchmarks/suite_durations.py`` reads pytest's ``--durations=0`` table and closing line right."""

from __future__ import annotations

import importlib.util

from specparity.model.locations import REPO_ROOT

OUTPUT = """\
============================= slowest durations ==============================
40.71s call     tests/test_fp8_flips.py::test_fp8_kv_cache_flips_are_near_ties
2.50s setup    tests/test_ci_gate.py::test_lossless_pass_writes_junit_reports_and_summary
1.25s call     tests/test_ci_gate.py::test_lossless_pass_writes_junit_reports_and_summary
0.75s call     tests/test_ci_gate.py::test_bad_input_exits_4[args0-4---suites: unknown suite 'nope']
0.01s teardown suites/lossless/test_lossless.py::test_gate_policy
=========================== short test summary info ============================
SKIPPED [1] suites/probes/test_probes.py:21: live probe
======= 1 failed, 942 passed, 10 skipped, 1 xfailed in 299.45s (0:04:59) =======
"""


def _module():
    spec = importlib.util.spec_from_file_location("suite_durations", REPO_ROOT / "benchmarks" / "suite_durations.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seconds_and_tests_per_file_and_the_closing_line():
    bench = _module()
    seconds, tests = bench.per_file(OUTPUT)
    assert seconds == {"tests/test_fp8_flips.py": 40.71, "tests/test_ci_gate.py": 4.5,
                       "suites/lossless/test_lossless.py": 0.01}
    assert tests == {"tests/test_fp8_flips.py": 1, "tests/test_ci_gate.py": 2, "suites/lossless/test_lossless.py": 1}
    assert bench.closing_line(OUTPUT) == "1 failed, 942 passed, 10 skipped, 1 xfailed"
    assert bench.closing_line("no summary").startswith("(no summary line")
