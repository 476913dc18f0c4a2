"""What a verdict is: a prompt's class and the evidence behind it (the first difference, later teacher-forced
violations, drift), as the judge (:mod:`specparity.judge.compare`) makes it and journals, goldens and
reports read it back. Plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Klass = Literal["exact", "near_tie", "drifted", "diverged", "error"]


CLASSES: tuple[Klass, ...] = ("exact", "near_tie", "drifted", "diverged", "error")


#: Which rule of :func:`compare` decided a verdict's class, in the order compare() tries them; the
#: checks a report shows (:mod:`specparity.judge.checks`) follow it. "" for a verdict made elsewhere (a
#: prompt that was never compared) or journalled before verdicts recorded it.
Rule = Literal["", "failed", "broken_finish", "baseline_stop_rule", "finish_mismatch", "stream_problem",
               "own_row_rejected", "drift", "identical", "length_mismatch", "margin_unreported",
               "margin_outside_top_k", "margin_over_threshold", "later_unscored", "later_not_argmax",
               "drift_before_split", "split_gap", "near_tie"]


TieBreak = Literal["", "lower_id", "higher_id", "draft", "own_argmax", "unknown"]

#: How each way of breaking a tie is said in reports.
TIE_BREAK_WORDS = {
    "lower_id": "the lower token id",
    "higher_id": "the higher token id",
    "draft": "the draft token (its verify row ties the two)",
    "own_argmax": "its own argmax (its row is not tied: its computation came out one way)",
    "unknown": "unknown (no row or step records there)",
}


@dataclass
class TokenView:
    """A token for display: id plus decoded text."""

    id: int
    text: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "text": self.text}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "TokenView | None":
        return cls(int(data["id"]), str(data["text"])) if data is not None else None


@dataclass
class Divergence:
    """The first position where the speculative stream leaves the baseline."""

    position: int
    baseline_token: TokenView | None  # None: the baseline ended here
    spec_token: TokenView | None  # None: the speculative run ended here
    #: logprob_base(baseline token) − logprob_base(spec token), under the baseline's scores.
    baseline_margin: float | None
    #: rank of the spec token in the baseline's top-k (None: outside the top-k).
    spec_rank_in_baseline: int | None
    #: logprob_spec(spec token) − logprob_spec(baseline token), under the spec run's own scores.
    spec_margin: float | None
    baseline_rank_in_spec: int | None
    context_before: str
    baseline_after: str
    spec_after: str
    #: (baseline position, spec position) where the streams re-align for good, or None if never.
    remerge: tuple[int, int] | None
    #: Where the baseline margin comes from: the baseline's own decode rows, or — when the engine
    #: did not report that row (e.g. llama.cpp) — the teacher-forced scoring of the baseline.
    margin_source: str = "decode"
    #: An exact tie: the baseline margin is 0 at the reported precision, both tokens are its row's
    #: argmax and greedy decoding allows either (:mod:`specparity.judge.resolution`).
    tie: bool = False
    #: The resolution (ulp, nats) of the baseline row the margin was read from: the largest power of
    #: two every difference in that row is a multiple of (None: continuous, e.g. float32 logits).
    ulp_nats: float | None = None
    #: At an exact tie, how each side broke it: ``lower_id`` / ``higher_id`` (the baseline), and for the
    #: speculative side also ``draft``, ``own_argmax`` or ``unknown`` (resolution.TIE_BREAK_WORDS).
    baseline_break: str = ""
    spec_break: str = ""

    @property
    def margin_ulps(self) -> float | None:
        """The baseline margin in ulps of its row (None: no margin or no resolution)."""
        if self.baseline_margin is None or self.ulp_nats is None:
            return None
        return abs(self.baseline_margin) / self.ulp_nats

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "baseline_token": self.baseline_token.to_json() if self.baseline_token else None,
            "spec_token": self.spec_token.to_json() if self.spec_token else None,
            "baseline_margin": self.baseline_margin,
            "spec_rank_in_baseline": self.spec_rank_in_baseline,
            "spec_margin": self.spec_margin,
            "baseline_rank_in_spec": self.baseline_rank_in_spec,
            "context_before": self.context_before,
            "baseline_after": self.baseline_after,
            "spec_after": self.spec_after,
            "remerge": list(self.remerge) if self.remerge else None,
            "margin_source": self.margin_source,
            "tie": self.tie,
            "ulp_nats": self.ulp_nats,
            "baseline_break": self.baseline_break,
            "spec_break": self.spec_break,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Divergence":
        fields = {**data, "baseline_token": TokenView.from_json(data["baseline_token"]),
                  "spec_token": TokenView.from_json(data["spec_token"]),
                  "remerge": tuple(data["remerge"]) if data.get("remerge") else None}
        return cls(**fields)


@dataclass
class TFViolation:
    """A speculative token that is not the target's argmax under its own prefix (teacher-forced)."""

    position: int
    spec_token: int
    target_argmax: int
    margin: float | None  # logprob(argmax) − logprob(spec token); None: spec token outside top-k

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "spec_token": self.spec_token,
            "target_argmax": self.target_argmax,
            "margin": self.margin,
        }


@dataclass
class Drift:
    """The speculative run's own rows against the baseline's over the tokens they share.

    ``max_nats``: the largest |Δmargin| at any compared position (None: no position had a row on
    both sides — an engine that reports no per-position logprobs for its speculative run);
    ``start``: the first position above ``bound`` (None: within it); ``over``: how many positions
    are above it; ``checked``: positions compared.
    """

    bound: float
    max_nats: float | None
    start: int | None
    over: int
    checked: int

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "Drift | None":
        return cls(**data) if data is not None else None

    def describe(self) -> str:
        return (
            f"the speculative run's own logprobs drift from the baseline's by up to {self.max_nats:.4g} nats "
            f"from position {self.start} ({self.over} of {self.checked} positions above the drift bound {self.bound:.3g})"
        )


@dataclass
class Verdict:
    prompt_id: str
    category: str
    klass: Klass
    reason: str
    divergence: Divergence | None = None
    tf_violations: list[TFViolation] = field(default_factory=list)
    baseline_len: int = 0
    spec_len: int = 0
    baseline_finish: str = ""
    spec_finish: str = ""
    threshold: float = 0.0
    drift: Drift | None = None  # None: no drift bound (nothing measured) or the run failed
    #: A constrained prompt's output checks (:func:`specparity.judge.structured.judge_constraint`): kind,
    #: baseline and spec ``{status, why}``, and ``problem`` when speculation broke the constraint.
    constraint: dict[str, Any] | None = None
    #: The rule that decided the class (journalled, so a report names it without judging again).
    rule: Rule = ""
    #: The first position whose token the speculative run's own verify row rejected, when that
    #: decided the class (``rule == "own_row_rejected"``).
    rejected_at: int | None = None
    #: Whether the speculative stream was scored teacher-forced (its later tokens were checked); not
    #: journalled: a run rebuilt from its journal has the scores themselves (``PromptRecord.spec_tf``).
    later_scored: bool = False

    @property
    def stream_problem(self) -> bool:
        """The speculative stream broke the loop's own contract (a token past a stop or past the limit)."""
        return self.rule == "stream_problem"

    @property
    def own_row_rejected(self) -> bool:
        """The speculative run emitted a token its own verify row rejected."""
        return self.rule == "own_row_rejected"

    @property
    def own_row_rejected_at_split(self) -> bool:
        """The first such token is the one at the first difference."""
        return (self.own_row_rejected and self.divergence is not None
                and self.rejected_at == self.divergence.position)

    @property
    def later_unscored(self) -> bool:
        """A near-tie flip whose later tokens could not be checked: no teacher-forced scores."""
        return self.rule == "later_unscored"

    @property
    def margin_unknown_explained(self) -> bool:
        """The class was decided without a baseline margin at the split (the speculative stream
        broke its contract first, or the margin is unknown): the reason says why it is missing."""
        return self.rule in ("stream_problem", "margin_unreported", "margin_outside_top_k")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_id": self.prompt_id,
            "category": self.category,
            "class": self.klass,
            "reason": self.reason,
            "divergence": self.divergence.to_json() if self.divergence else None,
            "tf_violations": [v.to_json() for v in self.tf_violations],
            "baseline_len": self.baseline_len,
            "spec_len": self.spec_len,
            "baseline_finish": self.baseline_finish,
            "spec_finish": self.spec_finish,
            "threshold": self.threshold,
            "drift": self.drift.to_json() if self.drift else None,
            "rule": self.rule,
            "rejected_at": self.rejected_at,
        }
        if self.constraint is not None:
            out["constraint"] = self.constraint
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Verdict":
        """The inverse of :meth:`to_json` (reports are rebuilt from the journal alone)."""
        div = data.get("divergence")
        return cls(
            prompt_id=data["prompt_id"], category=data["category"], klass=data["class"], reason=data["reason"],
            divergence=Divergence.from_json(div) if div else None,
            tf_violations=[TFViolation(**v) for v in data.get("tf_violations", [])],
            baseline_len=data.get("baseline_len", 0), spec_len=data.get("spec_len", 0),
            baseline_finish=data.get("baseline_finish", ""), spec_finish=data.get("spec_finish", ""),
            threshold=data.get("threshold", 0.0), drift=Drift.from_json(data.get("drift")),
            constraint=data.get("constraint"), rule=data.get("rule", ""), rejected_at=data.get("rejected_at"),
        )
