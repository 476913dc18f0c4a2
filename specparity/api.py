"""The lossless comparison as a plain function, for a team's own test suite.

In the spirit of vLLM's ``check_outputs_equal`` (``tests/models/utils.py``), but with the gate's
classification instead of string equality: each (baseline, speculative) pair goes through
:func:`specparity.judge.compare.compare` and is ``exact``, ``near_tie``, ``drifted``, ``diverged`` or
``error``.
::

    from specparity.api import check_lossless, measure_threshold

    base = engine.generate(requests, speculative=False)
    spec = engine.generate(requests, speculative=True)
    tf = [engine.score(r.prompt_ids, s.output_ids, r.top_k) for r, s in zip(requests, spec)]
    noise = [(b.scores, engine.score(r.prompt_ids, b.output_ids, r.top_k)) for r, b in zip(requests, base)]
    check_lossless(base, spec, spec_scores=tf, threshold=measure_threshold(noise),
                   max_new_tokens=64, stop_token_ids=engine.stop_token_ids(), decode=engine.decode)

Without ``spec_scores`` (the target's teacher-forced scoring of each speculative output) a flip
cannot be shown to be a near tie, so only ``exact`` passes.

The outputs may be what the engine's offline API returned (:mod:`specparity.engines.offline_outputs`):
vLLM's ``(token_ids, text)`` and ``(token_ids, text, logprobs)`` tuples (its test runner's
``generate_greedy`` / ``generate_greedy_logprobs``) or ``RequestOutput`` objects, SGLang's offline
``Engine.generate`` dicts, plain token-id lists. An output that does not state its finish reason
is ``"stop"`` when its last token is a stop token, else ``"length"``; one without logprobs carries
none. The keywords of vLLM's ``check_outputs_equal`` work as well::

    check_lossless(outputs_0_lst=ref_outputs, outputs_1_lst=spec_outputs, name_0="ref", name_1="spec",
                   max_new_tokens=max_tokens, prompt_token_ids=prompt_ids)

(``prompt_token_ids``: ``generate_greedy`` puts each prompt's ids in front of its output's.)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence, Union

from specparity.engines.offline_outputs import OutputContext, to_result, unreported
from specparity.judge.compare import compare
from specparity.model.verdicts import Verdict
from specparity.judge.calibration import Sample, calibrate
from specparity.judge.noise import CalibrationError
from specparity.model.threshold import DEFAULT_CEILING_NATS, DEFAULT_MULTIPLIER, NearTieThreshold
from specparity.model.types import GenerationResult, TokenScores

#: A result, a token-id list, a vLLM tuple or output object, an SGLang output dict
#: (:mod:`specparity.engines.offline_outputs`).
Output = Union[GenerationResult, Sequence[int], tuple, dict, Any]
__all__ = ["LosslessError", "check_lossless", "measure_threshold"]


class LosslessError(AssertionError):
    """Raised by :func:`check_lossless`; ``verdicts`` holds every prompt's verdict, ``failed`` the
    ones that made it fail."""

    def __init__(self, message: str, verdicts: list[Verdict], failed: list[Verdict]):
        super().__init__(message)
        self.verdicts = verdicts
        self.failed = failed


def measure_threshold(
    pairs: Iterable[tuple[GenerationResult | TokenScores, TokenScores]], *, multiplier: float = DEFAULT_MULTIPLIER,
    ceiling: float = DEFAULT_CEILING_NATS,
) -> NearTieThreshold:
    """The near-tie threshold from the target's own numeric noise, as the gate measures it.

    ``pairs``: for each *baseline* output, its scores as decoded (a :class:`GenerationResult` or its
    ``scores``) and the teacher-forced scoring of the same tokens
    (``engine.score(prompt_ids, baseline.output_ids, top_k)``). Never measure it on the speculative
    run: a broken loop would inflate its own threshold. Calibrates as the gate does
    (:func:`specparity.judge.calibration.calibrate`); ``describe()`` on the result says how it was made.
    As in the gate, the teacher-forced scores are checked against the decoded ones first
    (:mod:`specparity.judge.calibration`: a scorer off by one position raises
    :class:`~specparity.judge.calibration.ScorerRefused`), and a threshold above ``ceiling`` raises
    :class:`~specparity.judge.noise.CalibrationError`.
    """
    pairs = [(d.scores if isinstance(d, GenerationResult) else d, tf) for d, tf in pairs]
    samples = [Sample(f"pair {i}", d.token_ids, d, tf) for i, (d, tf) in enumerate(pairs)]
    try:
        return calibrate(samples, scorer="the teacher-forced scores given", ceiling=ceiling, multiplier=multiplier)[1]
    except CalibrationError:
        raise
    except ValueError:
        raise ValueError(
            "measure_threshold: no baseline position was scored both ways (no pairs, empty outputs, or rows "
            "without shared alternatives); check_lossless(threshold=NATS) judges near ties by a number given by "
            "hand instead, but then checks no latent drift (no measured noise bounds it)"
        ) from None


def check_lossless(
    baselines: Sequence[Output] | None = None,
    specs: Sequence[Output] | None = None,
    *,
    max_new_tokens: int,
    threshold: float | NearTieThreshold | None = None,
    spec_scores: Sequence[TokenScores | None] | None = None,
    baseline_scores: Sequence[TokenScores | None] | None = None,
    stop_token_ids: Iterable[int] = (),
    decode: Callable[[Sequence[int]], str] | None = None,
    names: tuple[str, str] = ("baseline", "speculative"),
    allow_near_tie: bool = True,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    outputs_0_lst: Sequence[Output] | None = None,
    outputs_1_lst: Sequence[Output] | None = None,
    name_0: str | None = None,
    name_1: str | None = None,
) -> list[Verdict]:
    """Classify each (baseline, speculative) pair; raise :class:`LosslessError` (an
    ``AssertionError``) naming every pair that is not ``exact`` or ``near_tie`` (``exact`` only when
    ``allow_near_tie`` is false). Returns the verdicts, in order, when all pass.

    ``baselines`` / ``specs``: :class:`~specparity.model.types.GenerationResult` (its ``request_id``
    names the prompt) or plain token-id lists, the same number of each, generated with
    ``max_new_tokens`` and ``stop_token_ids`` (a list shorter than ``max_new_tokens`` must end on a
    stop token, as an engine's stream must). ``spec_scores[i]``: the target's teacher-forced
    scoring of ``specs[i]``'s tokens (``engine.score``), needed for a ``near_tie``: every token after
    the flip must still be the target's argmax. ``baseline_scores[i]``: the teacher-forced scoring of
    ``baselines[i]``, used for the margin where the baseline reported no row of its own (plain
    lists, or NaN rows). ``threshold``: the near-tie threshold in nats, or :func:`measure_threshold`'s
    result (which also brings the latent-drift bound the gate applies, where the noise module has
    one); required with ``spec_scores`` (it is never guessed). ``decode``: token ids -> text, for
    the message only. ``names``: how the message calls the two runs.

    Each output may also be an engine's own offline output (the module docstring lists them).
    ``prompt_token_ids[i]``: prompt ``i``'s ids, for outputs that hold them in front of the output's
    (vLLM's ``runner.generate_greedy``); they are dropped before judging. ``outputs_0_lst`` /
    ``outputs_1_lst`` / ``name_0`` / ``name_1``: vLLM's ``check_outputs_equal`` names for
    ``baselines`` / ``specs`` / ``names``.
    """
    baselines = _one_of("baselines", baselines, "outputs_0_lst", outputs_0_lst)
    specs = _one_of("specs", specs, "outputs_1_lst", outputs_1_lst)
    names = (name_0 if name_0 is not None else names[0], name_1 if name_1 is not None else names[1])
    if len(baselines) != len(specs):
        raise ValueError(f"check_lossless: {len(baselines)} {names[0]} outputs but {len(specs)} {names[1]} outputs")
    for label, seq in (("spec_scores", spec_scores), ("baseline_scores", baseline_scores)):
        if seq is not None and len(seq) != len(specs):
            raise ValueError(f"check_lossless: {label} has {len(seq)} entries for {len(specs)} prompts")
    if prompt_token_ids is not None and len(prompt_token_ids) != len(specs):
        raise ValueError(f"check_lossless: prompt_token_ids has {len(prompt_token_ids)} entries for {len(specs)} prompts")
    if max_new_tokens < 1:
        raise ValueError(f"check_lossless: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not specs:  # nothing judged is never a pass (the gate's rule, gate.decide)
        raise LosslessError(f"check_lossless: nothing judged: no ({names[0]}, {names[1]}) pair was given, and a "
                            "comparison that judges nothing never passes", [], [])
    scored = spec_scores is not None and any(s is not None for s in spec_scores)
    if threshold is None and scored:
        raise ValueError(
            "check_lossless: spec_scores given but no threshold: pass threshold=<nats> or measure it from the "
            "baseline with measure_threshold([(baseline, engine.score(prompt_ids, baseline.output_ids, top_k)), ...])"
        )
    drift = None
    if isinstance(threshold, NearTieThreshold):
        nats, how = threshold.nats, threshold.describe()
        drift = getattr(threshold, "drift_nats", None)  # a measured threshold also bounds latent drift
    elif threshold is None:
        nats, how = 0.0, "none given"
    else:
        nats = float(threshold)
        if not (math.isfinite(nats) and nats >= 0):  # inf would call any flip a near tie, NaN none
            raise ValueError(f"check_lossless: threshold must be a finite non-negative number of nats, got {threshold}")
        how = f"{nats:.4g} nats"
    stops = tuple(int(t) for t in stop_token_ids)
    show = decode or (lambda ids: " ".join(str(int(t)) for t in ids))

    verdicts: list[Verdict] = []
    for i, (b, s) in enumerate(zip(baselines, specs)):
        prompt = tuple(int(t) for t in prompt_token_ids[i]) if prompt_token_ids is not None else None
        base = _as_result(b, OutputContext(f"{names[0]}[{i}]", f"#{i}", stops, max_new_tokens, prompt, is_baseline=True))
        spec = _as_result(s, OutputContext(f"{names[1]}[{i}]", base.request_id, stops, max_new_tokens, prompt))
        extra = {"drift_nats": drift} if drift is not None else {}
        verdicts.append(compare(
            base.request_id, "", base, spec, spec_scores[i] if spec_scores is not None else None,
            threshold=nats, max_new_tokens=max_new_tokens, stop_ids=stops, decode=show,
            baseline_tf=baseline_scores[i] if baseline_scores is not None else None, **extra,
        ))
    passing = {"exact", "near_tie"} if allow_near_tie else {"exact"}
    failed = [(i, v) for i, v in enumerate(verdicts) if v.klass not in passing]
    if failed:
        raise LosslessError(_message(failed, len(verdicts), how, scored, allow_near_tie, names, decode is not None),
                            verdicts, [v for _, v in failed])
    return verdicts


def _one_of(name: str, value: Sequence[Output] | None, alias: str, alias_value: Sequence[Output] | None
            ) -> Sequence[Output]:
    """The outputs given under ``name`` or under vLLM's ``alias``: exactly one of the two."""
    if value is not None and alias_value is not None:
        raise TypeError(f"check_lossless: {name} and {alias} name the same outputs; give one of them")
    if value is None and alias_value is None:
        raise TypeError(f"check_lossless: missing the outputs: pass {name} (positional) or {alias}=")
    return value if value is not None else alias_value


def _as_result(out: Output, ctx: OutputContext) -> GenerationResult:
    """A :class:`GenerationResult` for any accepted output; rows the caller did not give are *not
    reported* (NaN), never a probability."""
    if isinstance(out, GenerationResult):
        n = len(out.output_ids)
        if len(out.scores) == n or out.error:
            return out
        if len(out.scores):
            raise ValueError(f"check_lossless: {ctx.label} has {len(out.scores)} score rows for {n} tokens")
        return GenerationResult(out.request_id, list(out.output_ids), out.text, out.finish_reason,
                                unreported(out.output_ids), out.spec, out.wall_s, out.error)
    return to_result(out, ctx)


def _message(failed: list[tuple[int, Verdict]], total: int, how: str, scored: bool, allow_near_tie: bool,
             names: tuple[str, str], decoded: bool) -> str:
    a, b = names
    width = max(len(a), len(b))
    lines = [f"{len(failed)} of {total} prompt(s) not lossless ({a} vs {b}; near-tie threshold: {how})"]
    if not scored and any(v.divergence is not None for _, v in failed):
        lines.append("  no spec_scores given: a flip cannot be shown to be a near tie, so only 'exact' can pass")
    for i, v in failed:
        head = f"prompt {i} (id {v.prompt_id!r}): {v.klass}"
        if v.klass == "near_tie" and not allow_near_tie:
            head += " (allow_near_tie=False)"
        d = v.divergence
        if d is not None:
            def tok(t):
                if t is None:
                    return "<end of stream>"
                return f"{t.id} {t.text!r}" if decoded else str(t.id)
            margin = "not known (see reason)" if d.baseline_margin is None else f"{d.baseline_margin:.6g} nats"
            head += (f" at position {d.position}: {a} token {tok(d.baseline_token)}, {b} token "
                     f"{tok(d.spec_token)}, {a} margin {margin}")
        lines.append(head)
        lines.append(f"    reason: {v.reason}")
        if d is not None and decoded:
            lines.append(f"    {a + ':':<{width + 1}} {d.context_before!r} + {d.baseline_after!r}")
            lines.append(f"    {b + ':':<{width + 1}} {d.context_before!r} + {d.spec_after!r}")
        elif d is None and v.klass != "error":
            lines.append(f"    lengths {v.baseline_len}/{v.spec_len}, finish {v.baseline_finish!r}/{v.spec_finish!r}")
    return "\n".join(lines)
