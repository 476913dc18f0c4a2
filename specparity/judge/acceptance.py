"""Acceptance of two recorded runs, per category and per draft position, with an interval.

An engine upgrade that keeps every output exact can still halve the speed-up (an accept length of
3.19 becoming 2.66): the gate's exactness check passes it, so acceptance is compared on its own.
Acceptance varies a lot from prompt to prompt, so a difference is only reported as a regression
when it is larger than the spread of the prompts explains: the interval of the difference comes
from a paired bootstrap over the prompts both runs hold (each resample draws prompts with
replacement and computes both runs' ratio estimates on the same draw), seeded so a rerun prints
the same numbers. Per draft position ``d`` (how often the draft token at ``d`` was accepted, from
the engine's per-step records) a Wilson binomial interval is shown.

Prompts whose output is a repetition loop or recites the prompt (:mod:`specparity.judge.artefacts`) are
flagged; every table is shown with them and without them, and the rule is applied without them.
Pure: it takes per-prompt counters and token ids, no engine, no journal reader.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from specparity.judge.artefacts import artefact
from specparity.model.types import SpecStats

#: Largest drop of the mean accept length (tokens per verify step) ``compare`` accepts by default.
DEFAULT_MAX_ACCEPT_DROP = 0.25
#: Bootstrap resamples, the seed and the interval's coverage (one place for each).
RESAMPLES = 2000
SEED = 0
LEVEL = 0.95
#: A row is judged only with at least this many prompts: a bootstrap over fewer has too few distinct
#: resamples and understates the spread (3 prompts give 10), so a category of 3 prompts would fail
#: on one prompt's change.
MIN_PROMPTS = 5
#: Metrics: what a row compares, as (numerator, denominator) of a per-prompt ratio estimate.
ACCEPT_LENGTH = "accept_length"
ACCEPT_RATE = "acceptance_rate"
METRIC_WORDS = {ACCEPT_LENGTH: "mean accept length (tokens per verify step, bonus included)",
                ACCEPT_RATE: "acceptance rate (accepted / proposed draft tokens)"}


@dataclass
class PromptAcceptance:
    """One prompt's speculation counters; ``positions[d]`` = (drafts proposed at position d,
    accepted at d), None when the engine reports totals only."""

    prompt_id: str
    category: str
    proposed: int
    accepted: int
    verify_steps: int
    emitted: int
    positions: list[tuple[int, int]] | None = None
    artefact: str | None = None

    def ratio(self, metric: str) -> tuple[int, int]:
        return (self.emitted, self.verify_steps) if metric == ACCEPT_LENGTH else (self.accepted, self.proposed)


def positions_of(stats: SpecStats) -> list[tuple[int, int]] | None:
    """Per draft position (proposed, accepted), from the per-step records: a step that proposed
    ``p`` and accepted ``a`` drafts proposed at positions 0..p-1 and accepted at 0..a-1 (acceptance
    is a prefix). None for an engine that reports totals only."""
    if stats.steps is None:
        return None
    width = max((s.proposed for s in stats.steps), default=0)
    out = [[0, 0] for _ in range(width)]
    for s in stats.steps:
        for d in range(s.proposed):
            out[d][0] += 1
        for d in range(min(s.accepted, s.proposed)):
            out[d][1] += 1
    return [(p, a) for p, a in out]


def prompt_acceptance(prompt_id: str, category: str, stats: SpecStats, prompt_ids: Sequence[int] | None,
                      output_ids: Sequence[int]) -> PromptAcceptance | None:
    """The acceptance of one speculative request, flagged when its output is an artefact; None
    when the engine reported no counters for it."""
    if not stats.available:
        return None
    return PromptAcceptance(prompt_id, category, stats.proposed, stats.accepted, stats.verify_steps, stats.emitted,
                            positions_of(stats), artefact(prompt_ids, output_ids))


@dataclass
class AcceptanceSet:
    """A run's acceptance per prompt; ``missing`` says why there is none (then "not recorded")."""

    label: str
    prompts: dict[str, PromptAcceptance] = field(default_factory=dict)
    missing: str | None = None


@dataclass
class Row:
    """One category (or ``all``): both runs' estimates on the common prompts and the difference."""

    category: str
    prompts: int
    old: float | None
    new: float | None
    low: float | None = None  # interval of new - old
    high: float | None = None
    failed: bool = False

    @property
    def delta(self) -> float | None:
        return None if self.old is None or self.new is None else self.new - self.old


@dataclass
class PositionRow:
    position: int
    old: tuple[int, int] | None  # (proposed, accepted)
    new: tuple[int, int] | None


@dataclass
class Comparison:
    """Two runs' acceptance; ``rows`` with every common prompt, ``clean`` without the flagged ones."""

    metric: str
    old_label: str
    new_label: str
    rows: list[Row]
    clean: list[Row]
    flagged: dict[str, str]
    positions: list[PositionRow] | None
    positions_note: str = ""
    rule: str = ""
    failures: list[str] = field(default_factory=list)
    not_recorded: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def decided_on(self) -> list[Row]:
        """The rows the rule is applied to: without flagged prompts (with them when all are flagged)."""
        return self.clean if self.clean and self.clean[-1].prompts else self.rows

    def to_json(self) -> dict[str, Any]:
        def rows(rs: list[Row]) -> list[dict[str, Any]]:
            return [{**vars(r), "delta": r.delta} for r in rs]

        return {"metric": self.metric, "old": self.old_label, "new": self.new_label, "rule": self.rule,
                "not_recorded": self.not_recorded, "rows": rows(self.rows), "without_flagged": rows(self.clean),
                "flagged": self.flagged, "failures": self.failures, "notes": self.notes,
                "positions": None if self.positions is None else [
                    {"position": p.position, "old": p.old, "new": p.new} for p in self.positions],
                "resamples": RESAMPLES, "seed": SEED, "level": LEVEL}


def _ratio(pairs: Iterable[tuple[int, int]]) -> float | None:
    num = den = 0
    for a, b in pairs:
        num += a
        den += b
    return num / den if den else None


def paired_interval(old: Sequence[tuple[int, int]], new: Sequence[tuple[int, int]], *, seed: int = SEED,
                    resamples: int = RESAMPLES, level: float = LEVEL) -> tuple[float, float] | None:
    """Percentile interval of ``ratio(new) - ratio(old)`` under a paired bootstrap over prompts
    (``old[i]`` and ``new[i]`` are the same prompt's (numerator, denominator)); None with fewer
    than two prompts (no spread to measure)."""
    import numpy as np

    n = len(old)
    if n < 2:
        return None
    o, w = np.asarray(old, dtype=float), np.asarray(new, dtype=float)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = w[idx, 0].sum(1) / w[idx, 1].sum(1) - o[idx, 0].sum(1) / o[idx, 1].sum(1)
    diff = diff[np.isfinite(diff)]
    if not len(diff):
        return None
    tail = (1 - level) / 2 * 100
    return float(np.percentile(diff, tail)), float(np.percentile(diff, 100 - tail))


def wilson(successes: int, trials: int, level: float = LEVEL) -> tuple[float, float] | None:
    """Wilson score interval of a binomial rate (sound at rates near 0 or 1 and few trials)."""
    if trials <= 0:
        return None
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    p = successes / trials
    den = 1 + z * z / trials
    mid = (p + z * z / (2 * trials)) / den
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def _rows(old: AcceptanceSet, new: AcceptanceSet, ids: list[str], metric: str) -> list[Row]:
    cats = sorted({old.prompts[i].category for i in ids})
    out = []
    for cat in [*cats, "all"]:
        sel = [i for i in ids if cat == "all" or old.prompts[i].category == cat]
        a = [old.prompts[i].ratio(metric) for i in sel]
        b = [new.prompts[i].ratio(metric) for i in sel]
        ci = paired_interval(a, b)
        out.append(Row(cat, len(sel), _ratio(a), _ratio(b), *(ci or (None, None))))
    return out


def _positions(old: AcceptanceSet, new: AcceptanceSet, ids: list[str]) -> tuple[list[PositionRow] | None, str]:
    def total(s: AcceptanceSet) -> list[tuple[int, int]] | None:
        acc: list[list[int]] = []
        for i in ids:
            pos = s.prompts[i].positions
            if pos is None:
                return None
            for d, (p, a) in enumerate(pos):
                if d >= len(acc):
                    acc.append([0, 0])
                acc[d][0] += p
                acc[d][1] += a
        return [(p, a) for p, a in acc]

    a, b = total(old), total(new)
    unknown = [s.label for s, t in ((old, a), (new, b)) if t is None]
    if a is None and b is None:
        return None, "positions unknown: neither run has per-step records (the engines report totals only)"
    width = max(len(a or []), len(b or []))
    rows = [PositionRow(d, a[d] if a and d < len(a) else None, b[d] if b and d < len(b) else None) for d in range(width)]
    return rows, (f"positions unknown for {', '.join(unknown)} (the engine reports totals only)" if unknown else "")


def compare_runs(old: AcceptanceSet, new: AcceptanceSet, *, metric: str = ACCEPT_LENGTH) -> Comparison:
    """Both runs' acceptance on the prompts they both hold, per category and overall, with the
    paired bootstrap interval of the difference (no pass/fail: :mod:`specparity.gate.decision` decides)."""
    missing = [f"{s.label}: {s.missing}" for s in (old, new) if s.missing]
    if missing:
        return Comparison(metric, old.label, new.label, [], [], {}, None,
                          not_recorded="acceptance not recorded — " + "; ".join(missing))
    ids = [i for i in old.prompts if i in new.prompts]
    notes = []
    only = len(old.prompts) + len(new.prompts) - 2 * len(ids)
    if only:
        notes.append(f"{only} prompt(s) with acceptance on one side only are left out")
    if not ids:
        return Comparison(metric, old.label, new.label, [], [], {}, None,
                          not_recorded="acceptance not comparable — no prompt has counters on both sides", notes=notes)
    flagged = {}
    for i in ids:
        why = old.prompts[i].artefact or new.prompts[i].artefact
        if why:
            flagged[i] = why
    clean = [i for i in ids if i not in flagged]
    positions, pos_note = _positions(old, new, ids)
    return Comparison(metric, old.label, new.label, _rows(old, new, ids, metric),
                      _rows(old, new, clean, metric) if clean else [], flagged, positions, pos_note, notes=notes)


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _table(rows: list[Row], old: str, new: str) -> list[str]:
    lines = [f"| category | prompts | {old} | {new} | Δ ({new} − {old}) | {LEVEL:.0%} interval of Δ | |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ci = "n/a (fewer than 2 prompts)" if r.low is None else f"[{r.low:+.3f}, {r.high:+.3f}]"
        if r.low is not None and r.prompts < MIN_PROMPTS:
            ci += f" (not judged: fewer than {MIN_PROMPTS} prompts)"
        d = "n/a" if r.delta is None else f"{r.delta:+.3f}"
        lines.append(f"| {r.category} | {r.prompts} | {_f(r.old)} | {_f(r.new)} | {d} | {ci} | "
                     f"{'**beyond**' if r.failed else ''} |")
    return lines


def _rate(pa: tuple[int, int] | None) -> str:
    if pa is None or not pa[0]:
        return "n/a"
    lo, hi = wilson(pa[1], pa[0]) or (0.0, 0.0)
    return f"{pa[1] / pa[0]:.3f} [{lo:.3f}, {hi:.3f}] ({pa[1]}/{pa[0]})"


def lines(c: Comparison, old: str = "OLD", new: str = "NEW") -> list[str]:
    """The comparison in words and markdown tables (the terminal and ``acceptance.md`` print it)."""
    if c.not_recorded:
        return [f"acceptance: {c.not_recorded}", *c.notes]
    out = [f"acceptance — {METRIC_WORDS[c.metric]}; {old} = {c.old_label}, {new} = {c.new_label}",
           f"interval: {LEVEL:.0%} paired bootstrap over prompts ({RESAMPLES} resamples, seed {SEED}); rows of "
           f"fewer than {MIN_PROMPTS} prompts are shown, not judged",
           *([f"rule: {c.rule}"] if c.rule else []), *c.notes, "", "with every prompt:",
           *_table(c.rows if c.flagged else c.decided_on, old, new)]
    if c.flagged:
        out += ["", f"without the {len(c.flagged)} flagged prompt(s) (the rule is applied to this table):"
                if c.clean else f"every one of the {len(c.flagged)} prompts is flagged: the rule is applied with them",
                *(_table(c.clean, old, new) if c.clean else []), "", "flagged prompts (measurement artefacts):",
                *[f"- {pid}: {why}" for pid, why in c.flagged.items()]]
    else:
        out += ["no prompt flagged as a repetition loop or a recited prompt"]
    if c.positions is None:
        out += ["", c.positions_note]
    else:
        out += ["", f"per draft position (accepted / proposed at that position, {LEVEL:.0%} Wilson interval):",
                f"| position | {old} | {new} |", "|---:|---|---|",
                *[f"| {p.position} | {_rate(p.old)} | {_rate(p.new)} |" for p in c.positions]]
        if c.positions_note:
            out.append(c.positions_note)
    return out

