"""Exit codes of every specparity command (``pytest suites/…``, ``specparity …``, ``ci/gate.sh``).

They coincide with pytest's own ``ExitCode`` values, so a CI script reads one table whichever
entry point it called; pytest's 5 (no tests collected) is never returned: nothing judged is a
gate failure (1). docs/ERRORS.md has the table per entry point and every refusal:

====  ==================  =========================================================================
code  name                meaning
====  ==================  =========================================================================
0     ``PASS``            the gate passed (probes: every probe ok or warn; unknown only where the
                          policy's ``allow_unknown`` names it)
1     ``GATE_FAILED``     the gate failed: a prompt diverged or errored, a run-level rule failed
                          (speculation inactive, near-tie budget, a path never taken under
                          ``--require-all-paths``), nothing was judged (an empty selection, nothing
                          in common), or a probe predicts a failure
2     ``INTERRUPTED``     interrupted (Ctrl-C or SIGTERM); the journal and summary say so
3     ``ENGINE_ERROR``    the harness or the engine could not run at all (an engine that fails to
                          load or start, no noise measured or calibration refused, reports that
                          could not be written, an internal error); no verdict was reached
4     ``BAD_INPUT``       bad input: an option, path, engine, prompt or policy file, named in one
                          line and checked before any model loads; a policy the engine's counters
                          cannot check
6     ``PROBE_UNKNOWN``   ``specparity probe`` only, without ``--policy``: no probe predicts a
                          failure, but at least one answered ``unknown`` (it could not check its
                          question): not a pass, and not a predicted failure either
====  ==================  =========================================================================

6 is outside pytest's codes (0–5) on purpose: no gate entry point returns it, and a CI script that
runs ``specparity probe`` tells an unchecked question from a pass and from a predicted failure.
"""

PASS = 0
GATE_FAILED = 1
INTERRUPTED = 2
ENGINE_ERROR = 3
BAD_INPUT = 4
PROBE_UNKNOWN = 6


def status_word(code: int, interrupted: bool = False) -> str:
    """The one word a multi-run outcome (``sweep``, ``arms``) prints and journals for its exit ``code``."""
    if interrupted:
        return "INTERRUPTED"
    return "PASS" if code == PASS else "FAIL"
