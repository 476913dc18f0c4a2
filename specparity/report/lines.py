"""What a gate run's outcome says in sentences: the terminal table and the lines the summary and the reports
share (the per-category counts, the near-tie threshold and its policy in words, the drift bound, the scorer's
check, prompts nobody reported, structured output). They render the gate's decision and the judge's figures, as
measured; nothing here decides or recomputes them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence


from specparity.model.verdicts import CLASSES, TIE_BREAK_WORDS
from specparity.model.locations import fixture_note
from specparity.gate.decision import (GateDecision, coarse_channel, near_tie_policy, reject_share, ties_free)
from specparity.model.threshold import DRIFT_MULTIPLIER
from specparity.model.gate_run import GateRun, PromptRecord


@dataclass
class CategoryRow:
    name: str
    n: int
    exact: int
    near_tie: int
    drifted: int
    diverged: int
    error: int
    proposed: int
    accepted: int
    verify_steps: int
    accept_length: str


def category_rows(run: GateRun) -> list[CategoryRow]:
    rows = []
    for cat in run.categories():
        recs = [r for r in run.records if r.prompt.category == cat]
        classes = [r.verdict.klass for r in recs if r.verdict]
        act = run.activity(cat)
        mal = act.mean_accept_length
        rows.append(
            CategoryRow(
                cat,
                len(recs),
                classes.count("exact"),
                classes.count("near_tie"),
                classes.count("drifted"),
                classes.count("diverged"),
                classes.count("error"),
                act.proposed,
                act.accepted,
                act.verify_steps,
                f"{mal:.2f}" if mal is not None else "n/a",
            )
        )
    return rows


def unreported_line(run: GateRun) -> str:
    """Rows the engine left out by the protocol (``top_ids`` all −1: allowed, never judged), counted
    per side; "" when there are none. A reported row with a non-finite number is an error instead."""
    counts = {"baseline": [0, 0], "speculative": [0, 0], "teacher-forced": [0, 0]}
    for r in run.records:
        # a speculative stream identical to the baseline's is scored once (the run reuses the baseline's rows; a
        # run rebuilt from its journal holds them twice): counted once, so the rebuilt report says the same
        same = r.spec is not None and r.baseline is not None and r.spec.output_ids == r.baseline.output_ids
        sides = (("baseline", r.baseline.scores if r.baseline is not None else None),
                 ("speculative", r.spec.scores if r.spec is not None else None),
                 ("teacher-forced", r.baseline_tf),
                 ("teacher-forced", r.spec_tf if r.spec_tf is not r.baseline_tf and not same else None))
        for side, scores in sides:
            if scores is not None and len(scores):
                counts[side][0] += int(scores.unreported_positions().size)
                counts[side][1] += len(scores)
    if not any(n for n, _ in counts.values()):
        return ""
    return ", ".join(f"{side} {n} of {total}" for side, (n, total) in counts.items() if total) + (
        " rows not reported by the engine (top_ids −1: allowed, not judged)")


def drift_line(run: GateRun) -> str:
    """How latent drift was checked, in one line (the summary and the terminal say it)."""
    bound = run.threshold.drift_nats if run.threshold else None
    if bound is None:
        return "not checked (no noise was measured)"
    judged = [r.verdict for r in run.records if r.verdict is not None and r.verdict.drift is not None]
    unchecked = sum(1 for v in judged if v.drift.checked == 0)
    worst = max((v.drift.max_nats for v in judged if v.drift.max_nats is not None), default=None)
    th = run.threshold
    figures = th.cross_figures()
    between = (f"between the two up to {figures[1].cap:.3g} nats (the allowance)" if figures and figures[1].excess
               else "between the two")
    basis = (f"{DRIFT_MULTIPLIER:g} × the measured max |Δmargin|, within the baseline's instance or {between}, "
             f"whatever --near-tie-nats says")
    if th.drift_held:
        basis = (f"held at the ceiling {th.ceiling:g} nats: {basis} is {DRIFT_MULTIPLIER * (th.noise_max or 0.0):.3g}, "
                 f"and a row that moved further than the ceiling is not numeric noise")
    line = f"bound {bound:.3g} nats ({basis}); rows compared on {len(judged) - unchecked} prompt(s)"
    if worst is not None:
        line += f", largest drift {worst:.3g} nats"
    if unchecked:
        line += (f"; not checked on {unchecked} prompt(s): the engine reported no per-position logprobs for the "
                 f"speculative run there")
    return line


#: Mantissa bits (with the implicit one) of the logit dtypes whose spacing tells the logits' magnitude.
_MANTISSA = {"bfloat16": 8, "bf16": 8, "float16": 11, "fp16": 11, "half": 11}


def _magnitude_words(quantum: float, dtype: str | None) -> str:
    """", bf16 logits of magnitude 16–32": what a row's spacing says about its logits, when the dtype
    is one whose spacing is coarse enough to read (bf16, fp16)."""
    bits = _MANTISSA.get((dtype or "").lower())
    if bits is None:
        return ""
    lo = quantum * 2 ** (bits - 1)
    return f", {dtype} logits of magnitude {lo:g}–{2 * lo:g}"


def near_tie_lines(run: GateRun, decision: GateDecision) -> list[str]:
    """What the near-tie flips were, in lines the summary and the terminal print: how many split at
    exact ties and how each side broke them, the others' margins in ulps, and the flips the
    baseline's own numerics predict. Empty when no prompt flipped and nothing was predicted."""
    flips = [r.verdict for r in run.records if r.verdict is not None and r.verdict.klass == "near_tie"
             and r.verdict.divergence is not None]
    exp = decision.flip_expectation
    lines: list[str] = []
    ties = [v.divergence for v in flips if v.divergence.tie]
    if ties:
        base = Counter(d.baseline_break for d in ties)
        spec = Counter(d.spec_break for d in ties)
        say = lambda c: "; ".join(f"{TIE_BREAK_WORDS.get(k, k)} at {n}" for k, n in c.most_common())  # noqa: E731
        head = (f"exact ties: {len(ties)} flip(s) where both tokens are the baseline row's argmax" if ties_free(run)
                else f"reported ties: {len(ties)} flip(s) at a margin of 0 at the channel's resolution, not exact ties "
                     f"and counted with the other flips ({coarse_channel(run)})")
        lines.append(f"{head} — the speculative run took {say(spec)}; the baseline's decode took {say(base)}")
    others = [v.divergence for v in flips if not v.divergence.tie]
    if others:
        dtype = run.fingerprint.dtype if run.fingerprint else None
        by_ulp = Counter((round(d.margin_ulps), d.ulp_nats) for d in others if d.margin_ulps is not None)
        parts = [f"{n} × {u:g} ulp{'s' if u != 1 else ''} of {q:g}{_magnitude_words(q, dtype)}"
                 for (u, q), n in sorted(by_ulp.items())]
        rest = [d.baseline_margin for d in others if d.margin_ulps is None and d.baseline_margin is not None]
        if rest:
            parts.append(f"{len(rest)} at {', '.join(f'{m:.3g}' for m in sorted(rest)[:8])} nats "
                         f"(no resolution: continuous logits)")
        lines.append(f"other near-tie flips: {len(others)}, margins " + "; ".join(parts))
    if exp is not None and (flips or exp.expected > 0):
        lines.append(f"flip budget: {exp.describe()}; {exp.rate.describe()}")
    return lines


def scorer_check_line(run: GateRun) -> str:
    c = run.scorer_check
    if not c:
        return "not run"
    if not c["clear_positions"]:
        return "nothing to check: no baseline position had a clear margin"
    verdict = "passed" if c["passed"] else "FAILED"
    return (f"{verdict}: the scorer's argmax is the baseline's token at {c['clear_positions'] - c['disagreements']} of "
            f"{c['clear_positions']} positions whose decode margin exceeds {c['clear_nats']:g} nats")


def terminal_lines(run: GateRun, decision: GateDecision) -> list[str]:
    """The per-class summary pytest prints at the end of ``pytest suites/lossless``."""
    c = decision.counts
    lines = [
        f"specparity lossless gate: {decision.status} — "
        + ", ".join(f"{k} {c[k]}" for k in CLASSES) + f" ({len(run.records)} prompts)",
    ]
    if run.fingerprint:
        fp = run.fingerprint
        lines.append(f"engine {fp.engine} [{fp.dtype}] spec {fp.spec_config}")
        note = fixture_note(fp.target.path).get("models")
        if note:
            lines.append(f"models: {note}")
    lines += [f"golden: {note}" for note in getattr(run, "golden_notes", None) or []]
    lines += [f"fleet: {note}" for note in getattr(run, "fleet_notes", None) or []]
    resumed = (getattr(run, "resumed_baselines", 0) or 0, getattr(run, "resumed_verdicts", 0) or 0)
    if any(resumed):
        lines.append(f"resumed: {resumed[0]} baseline(s) and {resumed[1]} verdict(s) from the interrupted run's journal")
    if run.threshold:
        lines.append(f"near-tie threshold: {run.threshold.describe()}")
        lines.append(f"cross-instance noise: {run.threshold.describe_cross()}")
        lines.append(f"latent drift: {drift_line(run)}")
    if unreported_line(run):
        lines.append(f"unreported rows: {unreported_line(run)}")
    if structured_line(run.records):
        lines.append(f"structured output: {structured_line(run.records)}")
    if run.scorer_check:
        lines.append(f"scorer check: {scorer_check_line(run)}")
    if run.scorer:
        lines.append(f"scorer: {run.scorer}")
    if run.concurrency > 1:
        lines.append(f"concurrency: {run.concurrency} requests in flight per phase")
    lines.append(f"near-tie policy: {near_tie_policy(run)}")
    lines += near_tie_lines(run, decision)
    act = run.activity()
    if act.reported_requests:
        mal = act.mean_accept_length
        lines.append(
            f"speculation: {act.accepted}/{act.proposed} draft tokens accepted over {act.verify_steps} verify steps"
            + (f", accept length {mal:.2f}" if mal is not None else "")
        )
    forced = reject_share(run)
    if forced is not None:
        lines.append(f"forced rejection: {forced.describe()}")
    header = f"  {'category':<14}{'n':>4}{'exact':>7}{'tie':>5}{'drift':>6}{'div':>5}{'err':>5}{'accept len':>12}"
    lines.append(header)
    for row in category_rows(run):
        lines.append(
            f"  {row.name:<14}{row.n:>4}{row.exact:>7}{row.near_tie:>5}{row.drifted:>6}{row.diverged:>5}{row.error:>5}"
            f"{row.accept_length:>12}"
        )
    taken = run.coverage.taken()
    if run.coverage.requests_with_steps:
        lines.append("paths (steps/prompts): " + ", ".join(f"{k} {v}/{run.coverage.prompts[k]}" for k, v in taken.items()))
    else:
        lines.append("paths: unknown (the engine reports no per-step records)")
    lines += [f"FAIL: {f}" for f in decision.failures]
    lines += [f"warning: {w}" for w in decision.warnings]
    return lines


def structured_line(records: Sequence[PromptRecord]) -> str:
    """One line on the constrained prompts of a run for the terminal and the summary ("" when none):
    how many of each kind, and the JSON-schema outputs' checks on each side."""
    checked = [r.verdict.constraint for r in records if r.verdict is not None and r.verdict.constraint]
    if not checked:
        return ""
    parts = []
    schema = [c for c in checked if c["kind"] == "json_schema"]
    if schema:
        def tally(side: str) -> str:
            counts: dict[str, int] = {}
            for c in schema:
                status = (c.get(side) or {}).get("status", "not run")
                counts[status] = counts.get(status, 0) + 1
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))

        broken = sum(1 for c in schema if c.get("problem"))
        parts.append(f"{len(schema)} JSON-schema prompt(s): baseline {tally('baseline')}; speculative {tally('spec')}"
                     + (f"; {broken} broke their schema under speculation" if broken else ""))
    grammar = len(checked) - len(schema)
    if grammar:
        parts.append(f"{grammar} grammar prompt(s): constrained (judged by token identity)")
    return "; ".join(parts) + "; rows the constraint chose over the argmax are not judged on"
