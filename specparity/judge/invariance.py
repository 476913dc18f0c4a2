"""Verify/decode invariance: where, and how often, the verify pass and plain decode disagree.

Every near-tie flip has one root: the verify pass computes a row with M = k + 1 tokens, plain decode
computes the same row with M = 1, and nothing guarantees the same bits. A one-ULP difference at a
position whose top-2 margin is ULP-sized flips the token, and greedy decoding follows it.

Two measurements, both pure functions over results (the runs are made by :mod:`specparity.run.runner`
or a live probe):

* **Self-draft.** The target drafts for itself (transformers' assisted generation with the target
  as assistant, llama.cpp ``-md`` with the target's own GGUF, a plugin loop with ``--draft`` set to
  the target). In exact arithmetic every draft token is accepted, so every rejection is a place
  where verify and decode disagree. For each rejection the baseline's own margin at that position
  is compared with the measured noise: within it, the rejection is arithmetic; beyond the drift
  bound (4 × the measured noise, :mod:`specparity.judge.noise`), verify and decode disagree by more than
  any rounding can explain — a bug in the verify path.
* **Batching.** The same prompt decoded alone and inside a batch (an in-process left-padded
  batch, or concurrent requests to a server's parallel slots), each batched output classified
  against the solo one with the gate's own :func:`~specparity.judge.compare.compare`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from specparity.judge.compare import first_mismatch
from specparity.model.verdicts import Verdict
from specparity.model.types import GenerationResult

#: A self-draft run's status: every draft accepted / rejections within the noise or at a margin
#: unknown / beyond it.
STATUSES = ("ok", "warn", "fail")


def rejection_positions(result: GenerationResult) -> list[int]:
    """Output positions of the first rejected draft token of each verify step that rejected one.

    Steps follow the counter contract (:mod:`specparity.engines.base`): the tokens before the first
    step (a plain prefill's) are ``len(output) - sum(emitted)``; a step starting at ``p`` that
    accepted ``a`` drafts put its own token at ``p + a``, where the draft wanted another.
    """
    steps = result.spec.steps or []
    pos = len(result.output_ids) - sum(s.emitted for s in steps)
    out = []
    for s in steps:
        if s.accepted < s.proposed and s.emitted > s.accepted:
            out.append(pos + s.accepted)
        pos += s.emitted
    return out


@dataclass
class Rejection:
    """One place where the self-draft's verify pass refused a draft token."""

    prompt_id: str
    position: int
    #: The baseline's top-1 minus top-2 logprob at this position (None: the output already
    #: differed from the baseline before it, or the engine did not report that row).
    baseline_margin: float | None
    #: ``within`` the near-tie threshold, ``noise`` below the drift bound, ``beyond`` it, ``unknown``.
    against_noise: str
    output_differs: bool  # the prompt's speculative output differs from plain decode

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass
class SelfDraftReport:
    """Self-draft acceptance and rejections of one configuration (engine, dtype, KV dtype, width)."""

    engine: str
    dtype: str
    kv_cache_dtype: str
    width: int | None
    prompts: int
    tokens: int
    proposed: int  # draft tokens the verify pass judged (a block cut by a stop or the limit: up to the cut)
    accepted: int
    verify_steps: int
    threshold: float  # the near-tie threshold (nats)
    drift_bound: float  # beyond this a rejection is not arithmetic
    rejections: list[Rejection] = field(default_factory=list)
    classes: dict[str, int] = field(default_factory=dict)  # the gate's verdicts against plain decode
    reported: bool = True  # the engine reported speculation counters at all
    located: bool = True  # ... per verify step, so each rejection has a position

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def rejections_per_1k(self) -> float | None:
        return 1000.0 * len(self.rejections) / self.tokens if self.tokens else None

    @property
    def outputs_differ(self) -> int:
        return sum(n for k, n in self.classes.items() if k != "exact")

    def status(self) -> tuple[str, str]:
        """(``ok`` | ``warn`` | ``fail``, why)."""
        if not self.reported:
            return "warn", "the engine reports no speculation counters: acceptance is unknown"
        if not self.proposed:
            return "fail", "no draft token was proposed: the self-draft never ran"
        if not self.located and self.accepted < self.proposed:
            bad = {k: n for k, n in self.classes.items() if k in ("diverged", "drifted", "error")}
            if bad:
                return "fail", f"outputs not lossless against plain decode: {bad}"
            return "warn", (f"{self.proposed - self.accepted} draft token(s) rejected; the engine reports totals only, "
                            "so where (and at which margins) is unknown")
        beyond = [r for r in self.rejections if r.against_noise == "beyond"]
        bad = {k: n for k, n in self.classes.items() if k in ("diverged", "drifted", "error")}
        if beyond:
            r = beyond[0]
            return "fail", (f"{len(beyond)} rejection(s) where the baseline's margin exceeds the drift bound "
                            f"{self.drift_bound:.3g} nats (first: {r.prompt_id} position {r.position}, margin "
                            f"{r.baseline_margin:.4g}): verify and decode disagree beyond the target's noise")
        if bad:
            return "fail", f"outputs not lossless against plain decode: {bad}"
        unknown = [r for r in self.rejections if r.against_noise == "unknown"]
        if unknown:
            r = unknown[0]
            known = len(self.rejections) - len(unknown)
            return "warn", (f"{len(self.rejections)} rejection(s), margin unknown at {len(unknown)} (first: "
                            f"{r.prompt_id} position {r.position}: the output had already left plain decode there, or "
                            f"the engine reported no row), so those are not shown to be arithmetic"
                            + (f"; the other {known} at a margin within the target's noise" if known else ""))
        if self.rejections:
            return "warn", (f"{len(self.rejections)} rejection(s), each at a margin within the target's noise: "
                            f"verify and decode round differently there (arithmetic, not a bug)")
        return "ok", "every draft token accepted: verify and decode agree on every position"

    def to_json(self) -> dict[str, Any]:
        status, why = self.status()
        return {**{k: v for k, v in vars(self).items() if k != "rejections"},
                "rejections": [r.to_json() for r in self.rejections], "acceptance": self.acceptance,
                "rejections_per_1k": self.rejections_per_1k, "outputs_differ": self.outputs_differ,
                "status": status, "why": why}


def _margin(result: GenerationResult, position: int) -> float | None:
    s = result.scores
    if position >= len(s) or not s.reported(position) or s.k < 2:
        return None
    return float(s.top_logprobs[position, 0] - s.top_logprobs[position, 1])


def self_draft_report(
    pairs: Sequence[tuple[str, GenerationResult, GenerationResult, Verdict | None]],
    *,
    engine: str,
    dtype: str,
    threshold: float,
    drift_bound: float,
    kv_cache_dtype: str = "as the model",
    width: int | None = None,
) -> SelfDraftReport:
    """The report over ``(prompt id, baseline, self-draft result, verdict)``; the verdict is the gate's
    classification of the self-draft output against the baseline (None: not classified)."""
    rep = SelfDraftReport(engine, dtype, kv_cache_dtype, width, 0, 0, 0, 0, 0, threshold, drift_bound)
    classes: Counter = Counter()
    for prompt_id, base, spec, verdict in pairs:
        if spec.error or base.error:
            classes["error"] += 1
            continue
        rep.prompts += 1
        rep.tokens += len(spec.output_ids)
        if verdict is not None:
            classes[verdict.klass] += 1
        if not spec.spec.available:
            rep.reported = False
            continue
        rep.accepted += spec.spec.accepted
        rep.verify_steps += spec.spec.verify_steps
        if spec.spec.steps is None:  # totals only (llama.cpp, SGLang): acceptance, no positions
            rep.located = False
            rep.proposed += spec.spec.proposed
            continue
        # drafts after a cut were dropped, not rejected: they count as neither
        rep.proposed += sum(s.accepted if s.cut else s.proposed for s in spec.spec.steps)
        differs = spec.output_ids != base.output_ids
        split = first_mismatch(base.output_ids, spec.output_ids)
        split = len(base.output_ids) if split is None else split
        for pos in rejection_positions(spec):
            margin = _margin(base, pos) if pos <= split else None
            against = ("unknown" if margin is None else "within" if margin <= threshold
                       else "noise" if margin <= drift_bound else "beyond")
            rep.rejections.append(Rejection(prompt_id, pos, margin, against, differs))
    rep.classes = dict(classes)
    return rep


@dataclass
class BatchReport:
    """Each prompt decoded alone and inside a batch, classified like the gate classifies."""

    engine: str
    dtype: str
    batch_size: int
    how: str  # "in-process left-padded batch" / "N concurrent requests to the server"
    threshold: float
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def classes(self) -> dict[str, int]:
        return dict(Counter(v.klass for v in self.verdicts))

    def status(self) -> tuple[str, str]:
        bad = [v for v in self.verdicts if v.klass in ("diverged", "drifted", "error")]
        if bad:
            return "fail", f"{len(bad)} prompt(s) change beyond a near tie when batched: " + ", ".join(
                f"{v.prompt_id} ({v.klass}: {v.reason})" for v in bad[:3])
        ties = [v for v in self.verdicts if v.klass == "near_tie"]
        if ties:
            return "warn", f"{len(ties)} prompt(s) flip at a near tie when batched (not batch-invariant)"
        return "ok", "every prompt identical alone and batched"

    def to_json(self) -> dict[str, Any]:
        status, why = self.status()
        return {"engine": self.engine, "dtype": self.dtype, "batch_size": self.batch_size, "how": self.how,
                "threshold": self.threshold, "classes": self.classes, "status": status, "why": why,
                "verdicts": [v.to_json() for v in self.verdicts]}
