"""Whether run-wide draft counters read around the speculative phase are this run's alone.

vLLM 0.11-0.13 skipped drafting for every request that asks for logprobs, which every gate request
does: a server decoding someone else's requests at the same time still moves its draft counters,
and "speculation active" would then be someone else's drafts. Pure: two readings
(:class:`~specparity.model.traffic.Traffic`) in, a reason out.
"""

from __future__ import annotations

from specparity.model.traffic import Traffic

#: The words every such reason starts with (the gate's activity rule quotes it).
OTHER_TRAFFIC = "activity unknown: other traffic on the server"


def unattributed(before: Traffic | None, after: Traffic | None) -> str | None:
    """Why the draft counters' deltas between ``before`` and ``after`` cannot be attributed to this
    run (None: the servers finished exactly the requests this run sent them, and generated exactly
    the tokens their answers carried).

    Without the servers' own counts (an engine that reads none, a server that does not expose
    them), nothing rules other traffic out: that is unknown too, never a pass."""
    if before is None or after is None:
        return (f"{OTHER_TRAFFIC} cannot be ruled out: the engine's run-wide draft counters come without the "
                "servers' count of finished requests and generated tokens")
    if None in (before.finished, before.generated, after.finished, after.generated):
        return (f"{OTHER_TRAFFIC} cannot be ruled out: the servers do not expose their count of finished requests "
                f"and generated tokens ({after.source or before.source})")
    finished = after.finished - before.finished
    generated = after.generated - before.generated
    own_finished = after.own_finished - before.own_finished
    own_generated = after.own_generated - before.own_generated
    if (finished, generated) == (own_finished, own_generated):
        return None
    return (f"{OTHER_TRAFFIC}: during the speculative phase the speculative servers finished {finished} request(s) "
            f"and generated {generated} token(s), this run sent them {own_finished} and got {own_generated} back "
            f"({after.source}); their draft counters may count another client's drafts, so they say nothing about "
            "this run's")
