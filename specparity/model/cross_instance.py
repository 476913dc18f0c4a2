"""How much of the noise between two server instances the gate's allowance takes, and what is left over.

Two server instances of one configuration differ by a few bf16 logit steps (graph capture, batch
shapes): measured 0.156 nats between vLLM servers with CUDA graphs and 0.219 (near pairs; 0.406 over
every pair, with 0.25 within one instance) between SGLang ones, while each agreed with itself. Only
the speculative server can show that difference, so the gate scores the baseline's tokens
teacher-forced on both servers (prefill against prefill) and lets the threshold and the drift bound
cover it. But anything else the speculative server's target computes differently — another KV cache
dtype or quantization, a speculative setting that reaches the target's kernels — shows in the same
figure, and a figure the judged side measures must never widen its own allowance without limit.

So the allowance takes the cross-instance figure only up to a cap the speculative side cannot move:
the larger of :data:`CROSS_INSTANCE_NATS` (what two instances of one configuration are allowed to
differ by, whatever either measures) and :data:`CROSS_INSTANCE_FACTOR` × the same figure measured
within the baseline's instance alone. Beyond the cap the rest is reported, never excused.

**Nothing judged widens its allowance without a word.** Any such figure above the reference's own by
more than the channel resolves (``tolerance``: the channel's step, never below float32's) widened the
threshold or the drift bound it is judged against, inside the cap or not, so it is a finding with both
figures and what the allowance became (:func:`judged_finding`). The same rule holds for the other
figure a judged side measures: the noise of the judged run's own baselines when ``specparity compare``
and the concurrency sweep judge one recorded run against another (:data:`JUDGED_SIDE`; the
reference's samples calibrate, the judged side's enter only as this figure). One rule, two sources:
:class:`Source` says which, in words.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Two steps of a bf16 logit between 16 and 32 (0.125 each): above every cross-instance figure
#: recorded on live servers whose within-instance figure was 0 (vLLM CUDA graphs: 0.156), below a
#: target whose every logprob moves by 0.15 nats (0.3 per margin).
CROSS_INSTANCE_NATS = 0.25

#: A server whose own decode and teacher-forced rows differ by w may differ from another instance by
#: twice that (SGLang 0.5.17: 0.406 nats over every pair between instances, 0.25 within one).
CROSS_INSTANCE_FACTOR = 2.0


def cross_instance_cap(within: float) -> float:
    """The most of a cross-instance figure the allowance takes, given the same figure within the
    baseline's instance."""
    return max(CROSS_INSTANCE_NATS, CROSS_INSTANCE_FACTOR * max(0.0, within))


@dataclass(frozen=True)
class Source:
    """Where a figure measured on the judged side comes from, in the words of its finding."""

    name: str  # the figure: "cross-instance"
    base: str  # the reference's figure it is compared with: "within-instance"
    head: str  # the finding's opening
    judged: str  # who measured it: "the speculative server"
    moved: str  # where its pairs moved
    numerics: str  # what decides the numerics compared


#: What decides a server's numerics, for the advice a finding gives.
NUMERICS = "dtype, quantization, KV cache dtype, attention backend, tensor-parallel size"

#: The speculative server's teacher-forced rows against the baseline server's (a gate run).
CROSS_INSTANCE = Source("cross-instance", "within-instance", "the speculative server's target computes differently",
                        "the speculative server", "between the two servers",
                        f"the two servers' numerics ({NUMERICS}, speculative settings that reach the target's kernels)")
#: The judged run's own decode rows against its teacher-forced rows (``compare``, the sweep).
JUDGED_SIDE = Source("judged-side", "reference",
                     "the judged side's own two computations of its tokens differ more than the reference's",
                     "the judged side", "between the judged side's decode and its teacher-forced scoring",
                     f"the two runs' numerics ({NUMERICS}, batch shapes)")


@dataclass(frozen=True)
class CrossFigure:
    """One noise figure (the threshold's, or the drift bound's largest over every pair) measured on the
    reference (``within``) and on the judged side (``cross``: between the two instances, or the judged
    run's own), with the channel's ``tolerance`` and where the judged figure came from."""

    what: str
    within: float
    cross: float
    tolerance: float = 0.0
    source: Source = CROSS_INSTANCE

    @property
    def cap(self) -> float:
        return cross_instance_cap(self.within)

    @property
    def accepted(self) -> float:
        """The part of the judged figure the allowance takes."""
        return min(self.cross, self.cap)

    @property
    def excess(self) -> bool:
        """Whether the judged side differs by more than the allowance takes."""
        return self.cross > self.cap

    @property
    def above(self) -> bool:
        """Whether the judged figure sits above the reference's by more than the channel resolves: the
        allowance took more than the reference alone gives."""
        return self.cross - self.within > self.tolerance

    def describe(self, first: bool) -> str:
        """"cross-instance X nats vs within-instance Y (what; the allowance takes Z)", shorter after the first."""
        if first:
            return (f"{self.source.name} {self.cross:.3g} nats vs {self.source.base} {self.within:.3g} ({self.what}; "
                    f"the allowance takes {self.accepted:.3g})")
        return f"{self.cross:.3g} vs {self.within:.3g} ({self.what}; {self.accepted:.3g})"


#: The two comparisons a calibration makes, in words: which rows, from which server (a calibration
#: problem's spot names one, :func:`specparity.judge.calibration.widest_difference`).
COMPARISONS = {
    "cross": "the baseline's tokens scored teacher-forced on the baseline server and on the speculative server",
    "within": "the baseline server's own decode rows and its teacher-forced scoring of the same tokens",
}

def judged_finding(figures: list[CrossFigure], moved: str = "", widened: str = "") -> str | None:
    """The finding (one line) when a judged figure sits above the reference's (:attr:`CrossFigure.above`),
    inside the cap or beyond it, else None: both figures, what the allowance took, where the pairs
    ``moved``, and what it ``widened`` (the threshold and the drift bound with and without it)."""
    over = [f for f in figures if f.above]
    if not over:
        return None
    src = over[0].source
    figures_words = ", ".join(f.describe(i == 0) for i, f in enumerate(over))
    effect = (f" A figure measured on {src.judged} widened the allowance it is judged against: {widened}."
              if widened else "")
    return (f"{src.head}: {figures_words}{'; ' + moved if moved else ''}.{effect} The threshold and the drift bound "
            f"take the {src.name} noise only up to the larger of {CROSS_INSTANCE_NATS:g} nats and "
            f"{CROSS_INSTANCE_FACTOR:g} × the {src.base} figure; compare what decides {src.numerics}")
