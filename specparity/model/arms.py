"""Configuration arms: the one list of the run configurations ``specparity arms`` knows.

An arm is a named change to an engine's launch or requests (prefix caching warmed, KV cache too small
to hold every request at once, fp8 KV cache, deterministic kernels, very long prompts) plus the proof,
read from the judged requests or the engine, that the change happened — and that the other arms'
conditions did not: the default arm is shown free of all of them. Speculative-decoding bugs cluster in these
configurations, which engine CIs rarely run; a lossless gate run on the default configuration passes
them. Each arm is data here, named without any engine: which engines can set it up, with what knobs and
what proof, each engine's descriptor says (:class:`~specparity.engines.server.descriptor.ServerDescriptor`,
read through :mod:`specparity.engines.server.arm_knobs`); the orchestration is :mod:`specparity.run.arm_runs`,
and every other module reads this registry (one place for the list).

An arm whose proof is missing ends ``not exercised``, which fails: a condition the judged requests and the
engine do not show never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A long arm's prompts are at least this many tokens (the failures it looks for start past 16K).
LONG_MIN_TOKENS = 32768
#: A long arm's prompts where the target's ``max_position_embeddings`` allows.
LONG_MAX_TOKENS = 131072


@dataclass(frozen=True)
class Arm:
    """One configuration arm.

    ``launch``: the arm changes how servers are launched (with ``--baseline-url`` / ``--spec-url`` it runs
    only under ``--prelaunched``); ``hybrid``: the arm needs a hybrid target (linear-attention layers with a
    recurrent state per request), and is run without ``--arms`` only for one. What it changes and what proves
    it, per engine, are the engine's (its descriptor's arm knobs)."""

    name: str
    description: str
    launch: bool
    hybrid: bool = False


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("default", "the preset as it is; its judged requests start from an empty prefix cache", launch=False),
        Arm("deterministic", "the engine's deterministic / batch-invariant switch on both sides; the run is "
            "bit-exact (a near tie fails)", launch=True),
        Arm("preempt", "a KV cache too small for every request in flight, so requests are preempted "
            "mid-speculation; concurrency raised to what the engine serves", launch=True),
        Arm("prefix-warm", "every prompt sent once to the speculative server (max_tokens 1) before the judged "
            "request, so the judged one is a prefix-cache hit; judged against the cold baseline", launch=False),
        Arm("fp8-kv", "fp8 KV cache on both sides; the summary states the decode/prefill bias on its own line",
            launch=True),
        Arm("long", f"prompts of >= {LONG_MIN_TOKENS} tokens (needle in a haystack), the context raised to fit; "
            f"{LONG_MAX_TOKENS} where the target's max_position_embeddings allows", launch=True),
        Arm("mamba-slots", "a hybrid target's mamba state cache sized below the requests in flight: the server "
            "caps its running requests under the run's concurrency, so judged requests wait (or are retracted) for "
            "a state slot; concurrency raised to what the engine serves", launch=True, hybrid=True),
    )
}

#: Arms' verdicts beyond the gate's: the condition was not proven by the engine's counters.
NOT_EXERCISED = "NOT EXERCISED"


def arm_names() -> tuple[str, ...]:
    return tuple(ARMS)


def parse_arm_names(text: str) -> tuple[Arm, ...]:
    """``--arms a,b``: known names, each once. ValueError, one line. (Which arms an engine runs when ``--arms``
    is not given is the engine's: :func:`specparity.engines.server.arm_knobs.parse_arms`.)"""
    names = [n.strip() for n in str(text).split(",")]
    if not str(text).strip() or any(not n for n in names):
        raise ValueError(f"--arms {text!r}: expected arm names separated by commas (known: {', '.join(ARMS)})")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ValueError(f"--arms {text}: unknown arm {unknown[0]!r} (known: {', '.join(ARMS)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--arms {text}: {', '.join(twice)} given twice")
    return tuple(ARMS[n] for n in names)
