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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specparity.engines.base import capabilities_of
from specparity.types import TokenScores

SCORERS = ("auto", "engine", "embedded")


class ScorerError(RuntimeError):
    pass


@dataclass
class Scorer:
    description: str
    score: Callable[[Sequence[int], Sequence[int], int], TokenScores]
    close: Callable[[], None] = lambda: None


def choose_scorer(engine: Any, mode: str, model: str | None) -> Scorer:
    if mode not in SCORERS:
        raise ScorerError(f"--scorer {mode!r}: expected one of {', '.join(SCORERS)}")
    can = capabilities_of(engine).scoring
    if mode == "engine" or (mode == "auto" and can):
        if not can:
            raise ScorerError(f"--scorer engine: engine {engine.name!r} cannot score teacher-forced "
                              "(pass --scorer embedded --scorer-model HF_DIR)")
        what = getattr(engine, "scorer_description", None) or "one teacher-forced pass"
        return Scorer(f"the engine ({engine.name}): {what}", engine.score)
    if not model:
        raise ScorerError(f"engine {engine.name!r} cannot score teacher-forced: pass --scorer embedded "
                          "--scorer-model HF_DIR (the same weights in Hugging Face format)")
    from specparity.engines.inprocess import TorchTarget

    target = TorchTarget(model, dtype_name="float32")
    return Scorer(
        f"embedded transformers (float32) on {model}: a different implementation than the engine, so the "
        "measured noise includes the difference between them",
        target.score,
        target.close,
    )
