"""The baseline is what it claims: a greedy decode under the run's stop set and token limit.

Every prompt is judged against its baseline, so a baseline that is not what the run assumes makes
every verdict meaningless, and the fault is the configuration's, not the speculative loop's. Two
checks, both over every measured baseline (selected and calibration-only prompts), run after
calibration and before anything speculative:

* **the stop rule** — a ``stop`` finish ends on a stop id, no token follows a stop id, a ``length``
  finish holds exactly ``max_new_tokens`` tokens. A stop set that is not the model's (a
  tokenizer-only directory gives ``[1]`` where the model ends turns with 5) breaks it on both
  sides identically, and the comparison would otherwise blame speculation;
* **greedy** — the emitted token is the argmax of the baseline's own decode row, up to the measured
  near-tie threshold. Beyond it the engine is sampling, applying penalties or a logit processor.
  Rows the engine did not report are skipped.

Either break is a property of the whole run (the same stop set, limit and sampling settings serve
every request), so the run is refused as a calibration is — nothing judged, exit 3 — with one line
that names the evidence: how many prompts or positions, and the first.
"""

from __future__ import annotations

from typing import Callable, Sequence

from specparity.judge.compare import own_row_rejections, stop_rule_problem
from specparity.model.threshold import FLOOR_NATS
from specparity.model.gate_run import PromptRecord


def _measured(records: Sequence[PromptRecord]) -> list[PromptRecord]:
    return [r for r in records if r.request is not None and r.baseline is not None and not r.baseline.error]


def stop_rule_refusal(records: Sequence[PromptRecord], decode: Callable[[Sequence[int]], str] | None = None) -> str | None:
    """Why the baselines cannot be judged against under the run's stop set and limit (None: they can)."""
    measured = _measured(records)
    broken = [(r, p) for r in measured
              if (p := stop_rule_problem(r.baseline, r.request.max_new_tokens, r.request.stop_token_ids, decode))]
    if not broken:
        return None
    rec, problem = broken[0]
    limit = problem.startswith(("emitted", "finish_reason is 'length'"))  # the limit, not the stop set
    fix = ("the engine did not honour the token limit the run asked for (it stopped short of it or ran past it): "
           "check the server's own cap on new tokens and its context size against --max-new-tokens" if limit else
           "the stop ids come from the model's generation_config.json (GGUF: its end-of-generation tokens): give the "
           "model's own directory or file, not a tokenizer-only one")
    return (f"the baseline breaks the stop rule on {len(broken)} of {len(measured)} prompt(s), so the stop set or token "
            f"limit this run uses is not the engine's (a configuration error, not a speculation bug): first "
            f"{rec.prompt.id}: {problem}; {fix}")


def greedy_refusal(records: Sequence[PromptRecord], threshold: float,
                   decode: Callable[[Sequence[int]], str] | None = None) -> str | None:
    """Why the baselines are not greedy decodes (None: every reported row's argmax was emitted, up to
    ``threshold`` — the measured near-tie threshold — or float resolution, whichever is larger)."""
    tolerance = max(threshold, FLOOR_NATS)
    measured = _measured(records)
    found = [(r, own_row_rejections(r.baseline.output_ids, r.baseline.scores, tolerance)) for r in measured]
    found = [(r, bad) for r, bad in found if bad]
    if not found:
        return None
    rec, bad = found[0]
    t = bad[0]
    show = (lambda tok: f"{tok} {decode([tok])!r}") if decode else str
    return (f"the baseline is not a greedy decode: at {sum(len(b) for _, b in found)} position(s) of {len(found)} of "
            f"{len(measured)} prompt(s) the emitted token is not the argmax of its own decode row beyond the near-tie "
            f"threshold {tolerance:.3g} nats (first {rec.prompt.id} position {t.position}: emitted {show(t.spec_token)}, "
            f"its row prefers {show(t.target_argmax)} by {t.margin:.4g} nats): the engine samples, applies a penalty or "
            f"a logit processor; configure greedy decoding (temperature 0, no repetition/presence/frequency penalty, "
            f"no logit processor or bias)")


def baseline_refusal(records: Sequence[PromptRecord], threshold: float | None,
                     decode: Callable[[Sequence[int]], str] | None = None) -> str | None:
    """The stop rule, then (with a threshold) greedy: the first reason the run cannot judge, or None."""
    return stop_rule_refusal(records, decode) or (
        greedy_refusal(records, threshold, decode) if threshold is not None else None)
