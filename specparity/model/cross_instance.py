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
within the baseline's instance alone. A cross-instance figure beyond the cap is a finding: the rest
is reported, never excused.
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
class CrossFigure:
    """One noise figure (the threshold's, or the drift bound's largest over every pair) measured
    within the baseline's instance and between the two instances."""

    what: str
    within: float
    cross: float

    @property
    def cap(self) -> float:
        return cross_instance_cap(self.within)

    @property
    def accepted(self) -> float:
        """The part of the cross-instance figure the allowance takes."""
        return min(self.cross, self.cap)

    @property
    def excess(self) -> bool:
        """Whether the speculative server differs by more than the allowance takes."""
        return self.cross > self.cap

    def describe(self, first: bool) -> str:
        """"cross-instance X nats vs within-instance Y (what; the allowance takes Z)", shorter after the first."""
        if first:
            return (f"cross-instance {self.cross:.3g} nats vs within-instance {self.within:.3g} ({self.what}; the "
                    f"allowance takes {self.cap:.3g})")
        return f"{self.cross:.3g} vs {self.within:.3g} ({self.what}; {self.cap:.3g})"


#: The two comparisons a calibration makes, in words: which rows, from which server (a calibration
#: problem's spot names one, :func:`specparity.judge.calibration.widest_difference`).
COMPARISONS = {
    "cross": "the baseline's tokens scored teacher-forced on the baseline server and on the speculative server",
    "within": "the baseline server's own decode rows and its teacher-forced scoring of the same tokens",
}

#: What decides a server's numerics, for the advice a finding gives.
NUMERICS = "dtype, quantization, KV cache dtype, attention backend, tensor-parallel size"


def excess_finding(figures: list[CrossFigure], moved: str = "") -> str | None:
    """The finding (one line) when a figure exceeds its cap, else None."""
    over = [f for f in figures if f.excess]
    if not over:
        return None
    figures_words = ", ".join(f.describe(i == 0) for i, f in enumerate(over))
    return (f"the speculative server's target computes differently: {figures_words}"
            f"{'; ' + moved if moved else ''}. The threshold and the drift bound take the cross-instance noise only "
            f"up to the larger of {CROSS_INSTANCE_NATS:g} nats and {CROSS_INSTANCE_FACTOR:g} × the within-instance "
            f"figure; compare what decides the two servers' numerics ({NUMERICS}, speculative settings that reach "
            f"the target's kernels)")
