"""Runs a prompt suite through an engine and classifies every prompt.

Two phases, so the near-tie threshold is fixed before any speculative output is seen:

1. every prompt greedily without speculation, then teacher-forced scoring of the same tokens —
   the difference is the target's own numeric noise, from which the threshold is derived;
2. every prompt with speculation, teacher-forced scoring of the speculative output under its own
   prefix, and the comparison.

Each finished prompt is written to ``results.jsonl`` at once, so a later failure (an engine
crash, a dead server) never loses finished results.
"""

from __future__ import annotations

import json
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence

from specparity.compare import Verdict, compare
from specparity.coverage import Coverage
from specparity.engines.base import Engine
from specparity.gate import DEFAULT_MAX_NEW_TOKENS, GateConfig
from specparity.noise import NearTieThreshold, derive_threshold, measure_noise
from specparity.prompts import Prompt
from specparity.types import Fingerprint, GenerationRequest, GenerationResult, TokenScores

RESULTS_SCHEMA = "specparity.results/1"


@dataclass
class PromptRecord:
    prompt: Prompt
    request: GenerationRequest | None = None
    baseline: GenerationResult | None = None
    baseline_tf: TokenScores | None = None
    spec: GenerationResult | None = None
    spec_tf: TokenScores | None = None
    verdict: Verdict | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "prompt",
            "prompt": self.prompt.to_json(),
            "prompt_ids": list(self.request.prompt_ids) if self.request else None,
            "max_new_tokens": self.request.max_new_tokens if self.request else None,
            "baseline": self.baseline.to_json() if self.baseline else None,
            "spec": self.spec.to_json() if self.spec else None,
            "spec_tf": self.spec_tf.to_json() if self.spec_tf is not None else None,
            "verdict": self.verdict.to_json() if self.verdict else None,
        }


@dataclass
class Activity:
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    emitted: int = 0
    reported_requests: int = 0

    @property
    def mean_accept_length(self) -> float | None:
        return self.emitted / self.verify_steps if self.verify_steps else None

    def add(self, result: GenerationResult) -> None:
        s = result.spec
        if not s.available:
            return
        self.reported_requests += 1
        self.proposed += s.proposed
        self.accepted += s.accepted
        self.verify_steps += s.verify_steps
        self.emitted += sum(x.emitted for x in s.steps) if s.steps is not None else s.accepted + s.verify_steps


@dataclass
class GateRun:
    fingerprint: Fingerprint | None
    config: GateConfig
    records: list[PromptRecord]
    threshold: NearTieThreshold | None = None
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    coverage: Coverage = field(default_factory=Coverage)
    fatal: str | None = None

    def activity(self, category: str | None = None) -> Activity:
        act = Activity()
        for r in self.records:
            if r.spec is not None and (category is None or r.prompt.category == category):
                act.add(r.spec)
        return act

    def categories(self) -> list[str]:
        return sorted({r.prompt.category for r in self.records})

    def record(self, prompt_id: str) -> PromptRecord:
        for r in self.records:
            if r.prompt.id == prompt_id:
                return r
        raise KeyError(prompt_id)


class ResultsWriter:
    """Appends one JSON line per finished unit of work and flushes it immediately."""

    def __init__(self, report_dir: str | None):
        self._fh: IO[str] | None = None
        if report_dir:
            Path(report_dir).mkdir(parents=True, exist_ok=True)
            self._fh = open(Path(report_dir) / "results.jsonl", "w", encoding="utf-8")

    def write(self, obj: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _timed(timings: dict[str, float], key: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        timings[key] += time.perf_counter() - t0


def _generate_one(engine: Engine, req: GenerationRequest, speculative: bool) -> GenerationResult:
    """An engine that raises instead of returning ``failed`` still yields a result for this prompt."""
    try:
        results = engine.generate([req], speculative=speculative)
        if len(results) != 1:
            return GenerationResult.failed(req.request_id, f"engine returned {len(results)} results for 1 request")
        return results[0]
    except Exception as exc:  # noqa: BLE001
        return GenerationResult.failed(req.request_id, f"{type(exc).__name__}: {exc}")


def _score(engine: Engine, req: GenerationRequest, result: GenerationResult) -> tuple[TokenScores | None, str | None]:
    if result.error:
        return None, None
    try:
        return engine.score(req.prompt_ids, result.output_ids, req.top_k), None
    except Exception as exc:  # noqa: BLE001
        return None, f"teacher-forced scoring failed: {type(exc).__name__}: {exc}"


def run_gate(
    engine: Engine,
    prompts: Sequence[Prompt],
    config: GateConfig,
    *,
    progress: Callable[[str], None] | None = None,
) -> GateRun:
    """Run both phases over ``prompts``; never raises for a per-prompt failure."""
    say = progress or (lambda _msg: None)
    writer = ResultsWriter(config.report_dir)
    run = GateRun(fingerprint=None, config=config, records=[PromptRecord(p) for p in prompts])
    t_start = time.perf_counter()
    try:
        run.fingerprint = engine.fingerprint()
        writer.write(
            {"kind": "run", "schema": RESULTS_SCHEMA, "fingerprint": run.fingerprint.to_json(), "config": config.to_json()}
        )
        stop_ids = tuple(engine.stop_token_ids())
        tf_errors: dict[str, str] = {}
        # Phase 1: baselines and the target's own noise.
        for rec in run.records:
            p = rec.prompt
            try:
                ids = engine.encode_prompt(p.prompt, p.messages_as_dicts())
            except Exception as exc:  # noqa: BLE001
                rec.baseline = GenerationResult.failed(p.id, f"encoding the prompt failed: {type(exc).__name__}: {exc}")
                continue
            max_new = config.max_new_tokens or p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
            rec.request = GenerationRequest(p.id, ids, max_new, stop_ids, config.top_k)
            rec.baseline = _timed(run.timings, "baseline_decode", lambda: _generate_one(engine, rec.request, False))
            rec.baseline_tf, err = _timed(run.timings, "tf_scoring", lambda: _score(engine, rec.request, rec.baseline))
            if err:
                tf_errors[p.id] = err
            writer.write({"kind": "baseline", "prompt_id": p.id, "baseline": rec.baseline.to_json()})
            say(f"baseline {p.id}: {len(rec.baseline.output_ids)} tokens" + (f" ERROR {rec.baseline.error}" if rec.baseline.error else ""))
        noise = measure_noise(
            (r.baseline.scores, r.baseline_tf) for r in run.records if r.baseline is not None and r.baseline_tf is not None
        )
        run.threshold = derive_threshold(noise, config.near_tie_nats)
        writer.write({"kind": "threshold", **run.threshold.to_json()})
        say(f"near-tie threshold: {run.threshold.describe()}")
        # Phase 2: speculative runs, classified as they finish.
        for rec in run.records:
            p = rec.prompt
            if rec.request is None:
                rec.verdict = Verdict(p.id, p.category, "error", rec.baseline.error if rec.baseline else "not run")
                writer.write(rec.to_json())
                continue
            rec.spec = _timed(run.timings, "spec_decode", lambda: _generate_one(engine, rec.request, True))
            rec.spec_tf, err = _timed(run.timings, "tf_scoring", lambda: _score(engine, rec.request, rec.spec))
            err = err or tf_errors.get(p.id)
            run.coverage.add(rec.spec.spec)
            rec.verdict = _timed(
                run.timings,
                "comparison",
                lambda: compare(
                    p.id,
                    p.category,
                    rec.baseline,
                    rec.spec,
                    rec.spec_tf,
                    threshold=run.threshold.nats,
                    max_new_tokens=rec.request.max_new_tokens,
                    stop_ids=stop_ids,
                    decode=engine.decode,
                ),
            )
            if err and rec.verdict.klass != "diverged":
                rec.verdict.klass, rec.verdict.reason = "error", err
            writer.write(rec.to_json())
            say(f"{p.id}: {rec.verdict.klass}")
    except Exception as exc:  # noqa: BLE001 - keep what finished, report the rest as not run
        run.fatal = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"
        writer.write({"kind": "fatal", "error": run.fatal})
    finally:
        run.timings["total"] = time.perf_counter() - t_start
        writer.close()
    return run
