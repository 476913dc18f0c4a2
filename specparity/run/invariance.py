"""Runs behind the invariance reports (:mod:`specparity.judge.invariance`): a self-draft gate run, and
each prompt decoded alone and batched.

The self-draft run *is* a gate run (:func:`specparity.run.runner.run_gate`) on an engine whose draft is
the target, so its threshold, drift bound, scorer check and verdicts are the gate's own; the
report then reads where the verify pass rejected what decode proposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from specparity.judge.calibration import Sample, calibrate
from specparity.judge.compare import compare
from specparity.engines.base import Engine
from specparity.judge.invariance import BatchReport, SelfDraftReport, self_draft_report
from specparity.model.prompts import Prompt
from specparity.model.gate_run import GateConfig, GateRun
from specparity.run.runner import dispatch, request_for, run_gate
from specparity.model.types import Fingerprint, GenerationRequest, GenerationResult, TokenScores

#: How the gate names a scorer that is the engine's own ``score()`` (:func:`specparity.run.scoring.choose_scorer`).
_ENGINE_SCORER = "the engine ("


class InvarianceError(RuntimeError):
    """The measurement could not be made (the run failed before anything was compared)."""


def run_self_draft(engine: Engine, prompts: Sequence[Prompt], config: GateConfig, *,
                   kv_cache_dtype: str = "as the model", width: int | None = None) -> tuple[SelfDraftReport, GateRun]:
    """The gate over ``prompts`` on a self-drafting engine, and its self-draft report."""
    fp = engine.fingerprint()
    if fp.draft is not None and fp.draft.sha256 and fp.target.sha256 and fp.draft.sha256 != fp.target.sha256:
        raise InvarianceError(f"engine {fp.engine}: the draft ({fp.draft.path}) is not the target ({fp.target.path}); "
                              "a self-draft run needs --draft set to the target")
    run = run_gate(engine, prompts, config)
    if run.calibration_error or run.threshold is None:
        raise InvarianceError(run.calibration_error or run.fatal or "no threshold was measured")
    pairs = [(r.prompt.id, r.baseline, r.spec, r.verdict) for r in run.records if r.baseline and r.spec]
    report = self_draft_report(pairs, engine=fp.engine, dtype=fp.dtype, threshold=run.threshold.nats,
                               drift_bound=run.threshold.drift_nats or run.threshold.nats,
                               kv_cache_dtype=kv_cache_dtype, width=width)
    return report, run


@dataclass
class SoloRuns:
    """Plain decodes and their teacher-forced scores, keyed by request id, with the request each
    answered and the engine that made them: a gate run's baselines, reusable as a batching run's
    solo reference when (and only when) they answer the very same requests on the same target."""

    fingerprint: Fingerprint
    runs: dict[str, tuple[GenerationRequest, GenerationResult, TokenScores]]


def solo_runs(run: GateRun) -> SoloRuns | None:
    """A gate run's baselines as solo runs: those decoded by this run (not a golden or journal),
    without error, unconstrained (the gate hides a constraint's forced rows) and scored by the
    engine itself (what :func:`run_batching` scores with). None when the run has no fingerprint."""
    if run.fingerprint is None or not (run.scorer or "").startswith(_ENGINE_SCORER):
        return None
    runs = {r.request.request_id: (r.request, r.baseline, r.baseline_tf) for r in run.records
            if r.request is not None and r.request.constraint is None and r.baseline_from == "run"
            and r.baseline is not None and not r.baseline.error and r.baseline_tf is not None}
    return SoloRuns(run.fingerprint, runs)


def _plain_numerics(fp: Fingerprint) -> tuple[Any, ...]:
    """What decides a plain decode's numerics: all of the fingerprint but the draft and the
    speculative settings, which play no part in it."""
    return fp.engine, fp.engine_version, fp.target, fp.dtype, fp.extra


def _reused(engine: Engine, reqs: list[GenerationRequest], solo: SoloRuns | None
            ) -> tuple[list[GenerationResult], list[TokenScores]] | None:
    """The solo results and scores ``solo`` holds for exactly ``reqs`` on this engine's target and
    dtype, or None (then every solo run is made again)."""
    if solo is None:
        return None
    if _plain_numerics(engine.fingerprint()) != _plain_numerics(solo.fingerprint):
        return None
    found = [solo.runs.get(r.request_id) for r in reqs]
    if any(f is None or f[0] != r for f, r in zip(found, reqs)):
        return None
    return [f[1] for f in found], [f[2] for f in found]


def _batched(engine: Engine, reqs: list[GenerationRequest], batch_size: int) -> tuple[list[GenerationResult], str]:
    """Each request decoded inside a batch: one in-process batch per ``batch_size`` requests, or
    ``batch_size`` concurrent requests (a server batches what arrives together)."""
    batch = getattr(engine, "generate_batch", None)
    if callable(batch):
        out: list[GenerationResult] = []
        for i in range(0, len(reqs), batch_size):
            out += batch(reqs[i : i + batch_size])
        return out, f"in-process left-padded batches of {batch_size}"
    done = dict(dispatch(range(len(reqs)), lambda i: engine.generate([reqs[i]], speculative=False)[0], batch_size))
    return [done[i] for i in range(len(reqs))], f"{batch_size} concurrent requests to the server"


def run_batching(engine: Engine, prompts: Sequence[Prompt], config: GateConfig, batch_size: int,
                 precomputed: SoloRuns | None = None) -> BatchReport:
    """Every prompt alone (the reference), then inside batches; each batched output classified
    against the solo one with the gate's threshold, measured on the solo runs.

    ``precomputed``: solo runs already made (a self-draft gate run's baselines, :func:`solo_runs`);
    used when they answer exactly this run's requests on the same target and dtype, else ignored."""
    if batch_size < 2:
        raise ValueError(f"batch size: expected >= 2, got {batch_size}")
    stops = tuple(engine.stop_token_ids())
    reqs = [request_for(engine, p, config, stops) for p in prompts]
    reused = _reused(engine, reqs, precomputed)
    if reused is not None:
        solo, solo_tf = reused
    else:
        solo = [engine.generate([r], speculative=False)[0] for r in reqs]
        failed = [s for s in solo if s.error]
        if failed:
            raise InvarianceError(f"solo decode failed: {failed[0].request_id}: {failed[0].error}")
        solo_tf = [engine.score(r.prompt_ids, s.output_ids, r.top_k) for r, s in zip(reqs, solo)]
    _, threshold = calibrate([Sample(r.request_id, s.output_ids, s.scores, tf) for r, s, tf in zip(reqs, solo, solo_tf)],
                             scorer=f"{engine.name} score()", ceiling=config.near_tie_ceiling,
                             override=config.near_tie_nats, label=f"the {len(reqs)} solo runs")
    batched, how = _batched(engine, reqs, batch_size)
    fp = engine.fingerprint()
    report = BatchReport(fp.engine, fp.dtype, batch_size, how, threshold.nats)
    for p, r, s, tf, b in zip(prompts, reqs, solo, solo_tf, batched):
        b_tf: TokenScores | None = tf if b.output_ids == s.output_ids else (
            None if b.error else engine.score(r.prompt_ids, b.output_ids, r.top_k))
        report.verdicts.append(compare(p.id, p.category, s, b, b_tf, threshold=threshold.nats,
                                       max_new_tokens=r.max_new_tokens, stop_ids=stops, decode=engine.decode,
                                       baseline_tf=tf, drift_nats=threshold.drift_nats))
    return report


def table(reports: Sequence[Any]) -> list[str]:
    """Markdown rows of self-draft and batching reports (the suite prints and writes them)."""
    rows = []
    for rep in reports:
        status, why = rep.status()
        if isinstance(rep, SelfDraftReport):
            acc = f"{rep.acceptance:.4f}" if rep.acceptance is not None else "n/a"
            per = f"{rep.rejections_per_1k:.2f}" if rep.rejections_per_1k is not None else "n/a"
            margins = ", ".join(f"{r.baseline_margin:.3g}" if r.baseline_margin is not None else "?"
                                for r in rep.rejections[:6]) or "-"
            rows.append(f"| self-draft | {rep.engine} | {rep.dtype} | {rep.kv_cache_dtype} | {rep.width or '-'} | "
                        f"{rep.prompts} | {rep.tokens} | {rep.accepted}/{rep.proposed} ({acc}) | {len(rep.rejections)} "
                        f"({per}/1k) | {margins} | {rep.threshold:.3g} | {rep.outputs_differ} | {status}: {why} |")
        else:
            c = rep.classes
            rows.append(f"| batching | {rep.engine} | {rep.dtype} | - | batch {rep.batch_size} | {len(rep.verdicts)} | - | - | "
                        f"- | - | {rep.threshold:.3g} | {sum(n for k, n in c.items() if k != 'exact')} "
                        f"({', '.join(f'{k} {n}' for k, n in sorted(c.items()))}) | {status}: {why} |")
    return rows


TABLE_HEADER = [
    "| check | engine | dtype | KV cache | width | prompts | tokens | accepted/proposed | rejections | baseline margin "
    "at rejections (nats) | near-tie threshold | outputs ≠ plain decode | status |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]
