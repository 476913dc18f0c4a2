"""The decision: a run's verdicts and the policy (``policy_file``) in, pass/fail with reasons and one
exit code (``exitcodes``) out; cross-engine acceptance parity. May import: ``model``, ``judge``,
``probes`` (probe findings a policy can require).
"""
