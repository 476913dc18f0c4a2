"""Acceptance parity across implementations: is each engine running the draft it was given?

Losslessness says nothing about the draft: a DFlash2 draft silently run as DFlash v1, a dropped
selector or mis-scaled FP8 weights keep the output exact and only lower acceptance. Running the
*same* draft on the *same* prompts under two implementations (the reference ``dflash`` decoder and
llama.cpp's ``draft-dflash``, say) and comparing their per-category acceptance catches that: the
two should agree up to the few tokens where their numerics differ.

``specparity parity RUN_A RUN_B`` (:func:`parity`) compares two journals per prompt: per category
the acceptance rates with the paired bootstrap interval of their difference
(:mod:`specparity.judge.acceptance`), failing where they differ by more than the tolerance *and* the
interval excludes 0. :func:`compare_acceptance` compares run-wide per-category totals
(:class:`~specparity.model.gate_run.Activity`) without an interval, for callers holding only those. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from specparity.judge.acceptance import ACCEPT_RATE, AcceptanceSet, Comparison, compare_runs
from specparity.model.gate_run import Activity

#: Largest accepted difference of acceptance rates (accepted / proposed draft tokens), absolute.
DEFAULT_TOLERANCE = 0.10


@dataclass
class ParityRow:
    category: str
    rate_a: float | None
    rate_b: float | None
    accept_length_a: float | None
    accept_length_b: float | None

    @property
    def gap(self) -> float | None:
        if self.rate_a is None or self.rate_b is None:
            return None
        return abs(self.rate_a - self.rate_b)


@dataclass
class ParityResult:
    rows: list[ParityRow]
    overall: ParityRow
    tolerance: float

    @property
    def failures(self) -> list[str]:
        out = []
        for row in [*self.rows, self.overall]:
            if row.gap is None:
                out.append(f"{row.category}: no acceptance reported by one side")
            elif row.gap > self.tolerance:
                out.append(f"{row.category}: acceptance {row.rate_a:.3f} vs {row.rate_b:.3f} differs by "
                           f"{row.gap:.3f} > {self.tolerance:.2f}")
        return out

    def table(self, name_a: str, name_b: str) -> list[str]:
        def f(x: float | None, fmt: str = ".3f") -> str:
            return "n/a" if x is None else format(x, fmt)

        lines = [f"| category | acceptance {name_a} | acceptance {name_b} | gap | accept length {name_a} | "
                 f"accept length {name_b} |", "|---|---:|---:|---:|---:|---:|"]
        for r in [*self.rows, self.overall]:
            lines.append(f"| {r.category} | {f(r.rate_a)} | {f(r.rate_b)} | {f(r.gap)} | "
                         f"{f(r.accept_length_a, '.2f')} | {f(r.accept_length_b, '.2f')} |")
        return lines


def compare_acceptance(a: Mapping[str, Activity], b: Mapping[str, Activity], *,
                       tolerance: float = DEFAULT_TOLERANCE) -> ParityResult:
    """Per-category acceptance of two runs of the same draft; categories present on both sides."""
    rows = []
    total_a, total_b = Activity(), Activity()
    for cat in sorted(set(a) & set(b)):
        x, y = a[cat], b[cat]
        rows.append(ParityRow(cat, x.acceptance_rate, y.acceptance_rate, x.mean_accept_length, y.mean_accept_length))
        for total, act in ((total_a, x), (total_b, y)):
            total.proposed += act.proposed
            total.accepted += act.accepted
            total.verify_steps += act.verify_steps
            total.emitted += act.emitted
            total.reported_requests += act.reported_requests
    overall = ParityRow("all", total_a.acceptance_rate, total_b.acceptance_rate, total_a.mean_accept_length,
                        total_b.mean_accept_length)
    return ParityResult(rows, overall, tolerance)


def parity(a: AcceptanceSet, b: AcceptanceSet, *, tolerance: float = DEFAULT_TOLERANCE) -> Comparison:
    """Acceptance rates of the same draft under two implementations, per category, judged against
    ``tolerance`` (:func:`specparity.gate.decision.judge_acceptance`)."""
    from specparity.gate.decision import judge_acceptance

    return judge_acceptance(compare_runs(a, b, metric=ACCEPT_RATE), tolerance=tolerance)
