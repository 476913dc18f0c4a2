"""Who judges the tokens: the teacher-forced scorer a gate run uses, chosen explicitly.

The comparison needs the target's distribution at every position of a token stream under that
stream's own prefix, computed in one prefill-style pass (like a verify pass). An engine declares
whether it can (``Capabilities.scoring``); the answer to each case is explicit and the report says
which scorer judged:

* ``engine`` — the engine's own ``score()`` (in-process: one forward pass; llama.cpp: one
  ``n_predict: 1`` request per position on the baseline server; SGLang: prompt logprobs; vLLM:
  ``prompt_logprobs``).
* ``embedded`` — transformers on the same weights in float32 (``--scorer-model HF_DIR``), for an
  engine that cannot score at all. A different implementation: the measured noise then includes
  the difference between the two, which widens the near-tie threshold — said in the report.

``auto`` picks ``engine`` when the engine can score, else ``embedded`` when a model is given, else
it is an engine error that names both options.

An engine of two server instances (baseline and speculative, :class:`~specparity.engines.server.engine.ServerEngine`)
that can score also gets a scorer on the *speculative* server (:attr:`Scorer.spec_side`): its scoring
path runs the target alone, so scoring the baseline's tokens there measures what differs between the
two instances (graph capture, batch shapes), which the calibration adds to the noise
(:mod:`specparity.judge.noise`). An in-process engine is one instance: nothing to add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specparity.engines.base import capabilities_of
from specparity.model.types import TokenScores

SCORERS = ("auto", "engine", "embedded")


class ScorerError(RuntimeError):
    pass


ScoreFn = Callable[[Sequence[int], Sequence[int], int], TokenScores]

#: What the summary says when there is no second instance to measure.
ONE_INSTANCE = "not applicable: one engine instance computes both the baseline and the speculative run"


@dataclass
class Scorer:
    description: str
    score: ScoreFn
    close: Callable[[], None] = lambda: None
    #: The same scoring on the speculative server (None: one instance, or it cannot score).
    spec_side: ScoreFn | None = None
    #: Why ``spec_side`` is None ("" when it is set).
    spec_side_note: str = ONE_INSTANCE


def _spec_side(engine: Any, can_score: bool) -> tuple[ScoreFn | None, str]:
    """The engine's scorer on its speculative server, if it has two instances and can score there."""
    view = getattr(engine, "on_speculative_side", None)
    if not callable(view):
        return None, ONE_INSTANCE
    if not can_score:
        return None, (f"not measured: engine {engine.name!r} cannot score teacher-forced, so the speculative server "
                      "cannot score the baseline's tokens")
    why_not = getattr(engine, "cross_instance_unmeasured", "")
    if why_not:
        return None, f"not measured: {why_not}"
    return view().score, ""


def choose_scorer(engine: Any, mode: str, model: str | None) -> Scorer:
    if mode not in SCORERS:
        raise ScorerError(f"--scorer {mode!r}: expected one of {', '.join(SCORERS)}")
    can = capabilities_of(engine).scoring
    if mode == "engine" or (mode == "auto" and can):
        if not can:
            raise ScorerError(f"--scorer engine: engine {engine.name!r} cannot score teacher-forced "
                              "(pass --scorer embedded --scorer-model HF_DIR)")
        what = getattr(engine, "scorer_description", None) or "one teacher-forced pass"
        other, note = _spec_side(engine, can)
        return Scorer(f"the engine ({engine.name}): {what}", engine.score, spec_side=other, spec_side_note=note)
    if not model:
        raise ScorerError(f"engine {engine.name!r} cannot score teacher-forced: pass --scorer embedded "
                          "--scorer-model HF_DIR (the same weights in Hugging Face format)")
    from specparity.engines.inprocess.loop import TorchTarget

    target = TorchTarget(model, dtype_name="float32")
    note = ("not measured: the tokens are scored by the embedded scorer, on neither server"
            if callable(getattr(engine, "on_speculative_side", None)) else ONE_INSTANCE)
    return Scorer(
        f"embedded transformers (float32) on {model}: a different implementation than the engine, so the "
        "measured noise includes the difference between them",
        target.score,
        target.close,
        spec_side_note=note,
    )
