"""Exit codes of every specparity command (``pytest suites/…``, ``specparity …``).

They coincide with pytest's own ``ExitCode`` values, so a CI script reads one table whichever
entry point it called:

====  ==================  =========================================================================
code  name                meaning
====  ==================  =========================================================================
0     ``PASS``            the gate passed (probes: every probe ok, warn or unknown)
1     ``GATE_FAILED``     the gate failed: a prompt diverged or errored, a run-level rule failed
                          (speculation inactive, near-tie budget, a path never taken under
                          ``--require-all-paths``), or a probe predicts a failure
2     ``INTERRUPTED``     interrupted (Ctrl-C); the journal and summary say so
3     ``ENGINE_ERROR``    the harness or the engine could not run at all (an engine that fails to
                          load or start, an internal error); no verdict was reached
4     ``BAD_INPUT``       bad input: an option, path, engine or prompt file, named in one line and
                          checked before any model loads
====  ==================  =========================================================================
"""

PASS = 0
GATE_FAILED = 1
INTERRUPTED = 2
ENGINE_ERROR = 3
BAD_INPUT = 4
