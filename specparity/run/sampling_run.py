"""``specparity sample``'s run: N samples per prompt from both sides, scored, transformed, judged.

Both sides are drawn through the engine's optional ``sample(requests, *, speculative, params)``
method (an engine without it is not applicable: it cannot be asked to sample). Every sampled
sequence — the baseline's and the speculative side's alike — is scored teacher-forced on the
baseline target (``engine.score``, or the engine's batched ``score_samples`` when it has one; under a
repetition penalty only ``score_samples`` knows the penalised rows), and the judge
(:mod:`specparity.judge.sampling`) compares the two sides' PIT values.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specparity.gate import exitcodes
from specparity.judge.sampling import DEFAULT_ALPHA, SamplingRunResult, ScoredSample, judge_sampling
from specparity.model.files import replace_whole
from specparity.model.prompts import Prompt
from specparity.model.sampling import SamplingParams
from specparity.model.types import DEFAULT_TOP_K, GenerationRequest, GenerationResult, TokenScores

SAMPLE_JSON = "sample.json"
SAMPLE_MD = "sample.md"


@dataclass(frozen=True)
class SamplingPlan:
    """What one sampling run draws: prompts, samples per prompt and side, tokens per sample, how."""

    prompts: tuple[Prompt, ...]
    samples: int
    max_new_tokens: int
    params: SamplingParams
    alpha: float = DEFAULT_ALPHA

    @property
    def channel(self) -> int:
        """The logprob channel scored: at least ``DEFAULT_TOP_K``, never narrower than the top-k."""
        return max(DEFAULT_TOP_K, self.params.top_k)


@dataclass
class SamplingRun:
    """A finished run: the judge's result and what the report says beside it."""

    engine: str
    plan: SamplingPlan
    result: SamplingRunResult
    fingerprint: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    accepted: int = 0
    proposed: int = 0
    verify_steps: int = 0
    wall_s: float = 0.0

    @property
    def exit_code(self) -> int:
        """0 pass, 1 fail; not applicable (nothing could be judged) is 3: no verdict was reached."""
        if self.result.verdict == "pass":
            return exitcodes.PASS
        if self.result.verdict == "fail":
            return exitcodes.GATE_FAILED
        return exitcodes.ENGINE_ERROR

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {
            "engine": self.engine, "verdict": self.result.verdict, "exit_code": self.exit_code,
            "params": p.params.to_json(), "samples": p.samples, "max_new_tokens": p.max_new_tokens,
            "channel": p.channel, "prompts": [pr.id for pr in p.prompts],
            "activity": {"proposed": self.proposed, "accepted": self.accepted, "verify_steps": self.verify_steps},
            "errors": self.errors, "wall_s": round(self.wall_s, 3), "fingerprint": self.fingerprint,
            "result": self.result.to_json(),
        }


def sampling_unsupported(engine: Any, params: SamplingParams) -> str | None:
    """Why ``engine`` cannot be judged on sampling (None: it can)."""
    if not callable(getattr(engine, "sample", None)):
        return (f"engine {getattr(engine, 'name', '?')!r} has no sample() method: it cannot be asked to sample "
                "(in-process sampling engines: docs/SAMPLING.md)")
    if params.repetition_penalty != 1.0 and not callable(getattr(engine, "score_samples", None)):
        return (f"engine {getattr(engine, 'name', '?')!r} cannot score under a repetition penalty (no "
                "score_samples()): run without --repetition-penalty")
    return None


def not_applicable(engine: str, plan: SamplingPlan, reason: str) -> SamplingRun:
    return SamplingRun(engine, plan, SamplingRunResult("not_applicable", reason, 0.0, 1.0, plan.alpha, (0, 0),
                                                       (0, 0), 0))


def _score(engine: Any, prompt_ids: list[int], outputs: list[list[int]], plan: SamplingPlan) -> list[TokenScores]:
    batched = getattr(engine, "score_samples", None)
    if callable(batched):
        return batched(prompt_ids, outputs, plan.channel, repetition_penalty=plan.params.repetition_penalty)
    return [engine.score(prompt_ids, out, plan.channel) for out in outputs]


def draw_side(engine: Any, plan: SamplingPlan, *, speculative: bool,
              say: Callable[[str], None] | None = None) -> tuple[list[ScoredSample], list[GenerationResult]]:
    """Every prompt's samples on one side, scored teacher-forced; failed requests are returned apart."""
    scored: list[ScoredSample] = []
    failed: list[GenerationResult] = []
    done: list[GenerationResult] = []
    side = "speculative" if speculative else "baseline"
    for prompt in plan.prompts:
        ids = engine.encode_prompt(prompt.prompt, prompt.messages_as_dicts())
        limit = prompt.max_new_tokens or plan.max_new_tokens
        limit = min(limit, plan.max_new_tokens)
        reqs = [GenerationRequest(f"{prompt.id}#{i}", ids, limit, top_k=plan.channel) for i in range(plan.samples)]
        results = engine.sample(reqs, speculative=speculative, params=plan.params)
        good = [r for r in results if r.error is None]
        failed += [r for r in results if r.error is not None]
        done += good
        for res, sc in zip(good, _score(engine, ids, [r.output_ids for r in good], plan)):
            pos = res.facts.get("block_positions") if speculative else None
            scored.append(ScoredSample(prompt.id, prompt.category, sc.token_ids, sc.top_ids, sc.top_logprobs,
                                       np.asarray(pos, dtype=np.int64) if pos is not None else None))
        if say:
            say(f"{side}: {prompt.id}: {len(good)} samples")
    return scored, failed + done


def run_sampling(engine: Any, plan: SamplingPlan, say: Callable[[str], None] | None = None) -> SamplingRun:
    """Draw, score and judge (module docstring)."""
    name = str(getattr(engine, "name", "?"))
    why = sampling_unsupported(engine, plan.params)
    if why:
        return not_applicable(name, plan, why)
    t0 = time.perf_counter()
    base, base_results = draw_side(engine, plan, speculative=False, say=say)
    spec, spec_results = draw_side(engine, plan, speculative=True, say=say)
    errors = [f"{r.request_id}: {r.error}" for r in base_results + spec_results if r.error is not None]
    result = judge_sampling(base, spec, temperature=plan.params.temperature, top_k=plan.params.top_k,
                            alpha=plan.alpha, seed=plan.params.seed)
    if errors and result.verdict == "pass":
        result.verdict = "fail"
        result.reason = f"{len(errors)} request(s) failed in the engine (first: {errors[0]})"
    run = SamplingRun(name, plan, result, errors=errors, wall_s=time.perf_counter() - t0)
    for r in spec_results:
        if r.spec.available:
            run.proposed += r.spec.proposed
            run.accepted += r.spec.accepted
            run.verify_steps += r.spec.verify_steps
    try:
        run.fingerprint = engine.fingerprint().to_json()
    except Exception:  # noqa: BLE001 - the fingerprint is for the report; a run is judged without it
        run.fingerprint = None
    if result.verdict == "pass" and not run.accepted:  # a run that never speculated proves nothing
        result.verdict = "fail"
        result.reason = ("speculation inactive: no draft token was accepted" if run.verify_steps else
                         "speculation activity unknown: the speculative side reported no verify step")
    return run


# --------------------------------------------------------------------------- output


def terminal_lines(run: SamplingRun) -> list[str]:
    r = run.result
    head = {"pass": "PASS", "fail": "FAIL", "not_applicable": "NOT APPLICABLE"}[r.verdict]
    lines = [f"{head}: sampling ({run.engine}): {r.reason}"]
    if r.verdict != "not_applicable":
        p = run.plan.params
        lines.append(f"T={p.temperature:g} top_k={p.top_k} repetition_penalty={p.repetition_penalty:g} "
                     f"samples/prompt={run.plan.samples} prompts={len(run.plan.prompts)}; accepted {run.accepted} "
                     f"of {run.proposed} draft tokens in {run.verify_steps} verify steps")
    return lines


def markdown(run: SamplingRun) -> str:
    """``sample.md``: the verdict, the per-position deviations, per prompt and category, the histograms."""
    r, p = run.result, run.plan.params
    out = [f"# Sampling: {r.verdict.upper().replace('_', ' ')}", "", r.reason, "",
           f"Engine `{run.engine}`; temperature {p.temperature:g}, top-k {p.top_k}, repetition penalty "
           f"{p.repetition_penalty:g}, seed {p.seed}; {run.plan.samples} samples per prompt and side, at most "
           f"{run.plan.max_new_tokens} tokens each, {len(run.plan.prompts)} prompts; alpha {r.alpha:g} "
           f"(Bonferroni over {r.family_size} tests). Values: {r.values_per_side[0]} baseline, "
           f"{r.values_per_side[1]} speculative.", ""]

    def table(title: str, rows: Sequence[Any]) -> None:
        if not rows:
            return
        out.extend([f"## {title}", "", "| slice | speculative values | baseline values | KS D | p | mean (spec) | "
                    "mean (base) | tested |", "|---|---|---|---|---|---|---|---|"])
        for d in rows:
            out.append(f"| {d.key} | {d.n_speculative} | {d.n_baseline} | {d.statistic:.4f} | {d.p_value:.3g} | "
                       f"{d.mean_speculative:.4f} | {d.mean_baseline:.4f} | {'yes' if d.tested else 'no'} |")
        out.append("")

    table("Pooled", [r.pooled] if r.pooled else [])
    table("Per position in the verify step", r.positions)
    if r.consecutive:
        c = r.consecutive
        out.extend(["## Consecutive tokens", "",
                    f"Chi-square {c.statistic:.1f} over {c.cells} (prompt, token, next token) cells "
                    f"({c.pairs_per_side[0]} baseline, {c.pairs_per_side[1]} speculative pairs) against the "
                    f"permutation null's mean {c.null_mean:.1f} (sd {c.null_sd:.1f}, {c.permutations} "
                    f"permutations): p {c.p_value:.3g} (tested).", ""])
    table("Per prompt", r.prompts)
    table("Per category", r.categories)
    if r.histogram:
        out.extend(["## Value histogram", "", "| bin | baseline | speculative |", "|---|---|---|"])
        n = len(r.histogram["baseline"])
        for i, (a, b) in enumerate(zip(r.histogram["baseline"], r.histogram["speculative"])):
            out.append(f"| [{i / n:.1f}, {(i + 1) / n:.1f}) | {a} | {b} |")
        out.append("")
    if r.outside:
        out.extend(["## Tokens outside the top-k", ""] +
                    [f"- prompt {pid}, output position {i}: token {tok}" for pid, i, tok in r.outside[:20]] + [""])
    if run.errors:
        out.extend(["## Failed requests", ""] + [f"- {e}" for e in run.errors[:20]] + [""])
    return "\n".join(out)


def write_sampling(run: SamplingRun, report_dir: str | Path) -> list[Path]:
    """``sample.json`` and ``sample.md`` in ``report_dir``, each replaced whole."""
    root = Path(report_dir)
    root.mkdir(parents=True, exist_ok=True)
    return [replace_whole(root / SAMPLE_JSON, json.dumps(run.to_json(), indent=1, default=str) + "\n"),
            replace_whole(root / SAMPLE_MD, markdown(run))]
