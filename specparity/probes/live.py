"""Live probes, written against the engine protocol only so any engine can be probed.

Static probes predict; these confirm on a running engine. They use nothing but
``Engine.encode_prompt / generate / fingerprint`` (plus an optional ``health()``), so the same code
drives the in-process engines today and the server engines (SGLang, vLLM, llama.cpp) when they
land. What each one is for:

* ``first_decode``: SGLang accepts an unsupported quantized head at startup and dies on the first
  decode, so "the server is healthy" proves nothing until one real request has decoded.
* ``acceptance_floor``: a mis-scaled or half-loaded draft still produces correct text (the target
  verifies every token) and only shows up as collapsed acceptance.
* ``mamba_stress``: more concurrent requests sharing long prefixes than there are state slots; the
  engine must stay healthy, finish or cleanly fail every request, and keep its outputs.
* ``self_draft``: an engine whose draft *is* its target must accept every draft token, up to
  verify/decode rounding; a rejection where the target's margin is beyond its own noise is a bug in
  the verify path (:mod:`specparity.judge.invariance`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.engines.base import Engine
from specparity.model.types import Fingerprint, GenerationRequest, GenerationResult, accept_length
from specparity.probes.finding import Finding, fail, ok, unknown, warn

FIRST_DECODE = "first-decode"
ACCEPTANCE = "acceptance-floor"
STRESS = "mamba-stress"
SELF_DRAFT = "self-draft"

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List five prime numbers greater than 100, one per line.",
    "Translate 'good morning, how are you?' into French and Spanish.",
)
#: Absolute floor on mean accept length (bonus token included, so 1.0 = nothing accepted).
DEFAULT_FLOOR = 1.5
#: Fraction of the recorded accept length below which a run counts as collapsed.
DEFAULT_RELATIVE = 0.6


def _encode(engine: Engine, prompt: str) -> list[int]:
    """As a user turn through the engine's chat template (what a deployed server sees); raw text
    for an engine or tokenizer without one."""
    try:
        return engine.encode_prompt(None, [{"role": "user", "content": prompt}])
    except Exception:  # noqa: BLE001 - no chat template: fall back to a plain continuation
        return engine.encode_prompt(prompt, None)


def _requests(engine: Engine, prompts: Sequence[str], max_new_tokens: int, tag: str) -> list[GenerationRequest]:
    stops = tuple(engine.stop_token_ids())
    return [
        GenerationRequest(f"{tag}-{i}", _encode(engine, p), max_new_tokens, stops)
        for i, p in enumerate(prompts)
    ]


def _errors(results: Sequence[GenerationResult]) -> list[str]:
    return [f"{r.request_id}: {r.error}" for r in results if r.error or r.finish_reason == "error"]


def first_decode(engine: Engine, *, max_new_tokens: int = 8) -> Finding:
    """One real speculative decode right after start-up (SGLang fails here, not at /health)."""
    req = _requests(engine, PROMPTS[:1], max_new_tokens, "first-decode")
    try:
        results = engine.generate(req, speculative=True)
    except Exception as exc:  # an engine that raises is exactly what this probe looks for
        return fail(FIRST_DECODE, "the first speculative decode raised", [f"{type(exc).__name__}: {exc}"],
                    message=str(exc), action="see the lm-head probe: the target head may be unsupported by the selector")
    errs = _errors(results)
    if errs or not results:
        return fail(FIRST_DECODE, "the first speculative decode failed", errs or ["no result returned"],
                    message=errs[0] if errs else None,
                    action="see the lm-head probe: the target head may be unsupported by the selector")
    r = results[0]
    return ok(FIRST_DECODE, f"decoded {len(r.output_ids)} tokens ({r.finish_reason})",
              [f"{engine.name}: {r.text[:60]!r}", f"spec counters: {r.spec.source or 'n/a'}"])


def fingerprint_key(fp: Fingerprint) -> str:
    """The key an accept length is recorded under: engine, version, weights, spec config."""
    draft = fp.draft.sha256[:16] if fp.draft else "-"
    return (f"{fp.engine}=={fp.engine_version}|target={fp.target.sha256[:16]}|draft={draft}|"
            f"{fp.dtype}|{json.dumps(fp.spec_config, sort_keys=True)}")


def load_recorded(path: str | os.PathLike[str] | None, fp: Fingerprint) -> float | None:
    """The accept length recorded for this fingerprint in a JSON record file, if any."""
    if not path or not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    value = data.get("accept_length", {}).get(fingerprint_key(fp)) if isinstance(data, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def save_recorded(path: str | os.PathLike[str], fp: Fingerprint, value: float) -> None:
    """Record ``value`` for this fingerprint (other records are kept)."""
    p = Path(path)
    data: dict[str, Any] = json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}
    data.setdefault("accept_length", {})[fingerprint_key(fp)] = round(float(value), 4)
    p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def mean_accept_length(results: Sequence[GenerationResult]) -> tuple[float | None, int]:
    """:func:`~specparity.model.types.accept_length` over all results that report counters, and the step count."""
    reported = [r.spec for r in results if r.spec.available and r.spec.verify_steps]
    steps = sum(s.verify_steps for s in reported)
    return accept_length(sum(s.emitted for s in reported), steps), steps


def acceptance_floor(
    engine: Engine,
    *,
    prompts: Sequence[str] = PROMPTS,
    max_new_tokens: int = 48,
    floor: float = DEFAULT_FLOOR,
    recorded: float | None = None,
    relative: float = DEFAULT_RELATIVE,
) -> Finding:
    """Fail as "draft silently rejected" when mean accept length drops below the floor.

    The floor is ``floor`` and, when an accept length was recorded for this configuration,
    ``relative * recorded`` as well (whichever is higher).
    """
    results = engine.generate(_requests(engine, prompts, max_new_tokens, "accept"), speculative=True)
    errs = _errors(results)
    if errs:
        return fail(ACCEPTANCE, "speculative requests failed", errs)
    if not any(r.spec.available for r in results):
        return unknown(ACCEPTANCE, "engine reports no speculation counters",
                       [r.spec.source for r in results[:1]])
    mal, steps = mean_accept_length(results)
    sources = sorted({r.spec.source for r in results if r.spec.available})
    evidence = [f"{len(results)} prompts x {max_new_tokens} tokens, {steps} verify steps; counters: {', '.join(sources)}"]
    if mal is None and all(len(r.output_ids) <= 1 for r in results):
        return unknown(ACCEPTANCE, "every output ended at its first token: nothing was left to speculate on",
                       evidence)
    if mal is None:
        return fail(ACCEPTANCE, "speculation never ran (0 verify steps): the draft was not used",
                    evidence, action="check that the engine did not turn speculation off (vLLM #34497-style)")
    threshold, why = floor, f"absolute floor {floor}"
    if recorded is not None and relative * recorded > threshold:
        threshold, why = relative * recorded, f"{relative:g} x recorded {recorded:.3f}"
    evidence.append(f"mean accept length {mal:.3f} (bonus token included); threshold {threshold:.3f} = {why}")
    proposed = sum(r.spec.proposed for r in results)
    accepted = sum(r.spec.accepted for r in results)
    if proposed:
        evidence.append(f"accepted {accepted} of {proposed} proposed draft tokens ({accepted / proposed:.1%})")
    if mal < threshold:
        return fail(ACCEPTANCE, f"draft silently rejected: mean accept length {mal:.2f} < {threshold:.2f}", evidence,
                    action="see draft-fp8-scales and dflash2-format: a scale layout the engine does not load, or a "
                    "DFlash2 draft running as v1, produce correct text with collapsed acceptance")
    return ok(ACCEPTANCE, f"mean accept length {mal:.2f} >= {threshold:.2f}", evidence)


def _healthy(engine: Engine) -> tuple[bool, str]:
    health = getattr(engine, "health", None)
    if callable(health):
        try:
            return bool(health()), "health()"
        except Exception as exc:
            return False, f"health() raised {type(exc).__name__}: {exc}"
    try:
        probe = engine.generate(_requests(engine, PROMPTS[:1], 1, "health"), speculative=False)
    except Exception as exc:
        return False, f"1-token request raised {type(exc).__name__}: {exc}"
    return (bool(probe) and not _errors(probe)), "1-token request"


def _shared_prefix_requests(engine: Engine, n: int, prefix_tokens: int, max_new_tokens: int) -> list[GenerationRequest]:
    unit = engine.encode_prompt(
        "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly. ", None
    )
    prefix = (unit * (prefix_tokens // max(len(unit), 1) + 1))[:prefix_tokens]
    stops = tuple(engine.stop_token_ids())
    return [
        GenerationRequest(f"stress-{i}", prefix + engine.encode_prompt(f" Question {i}: what comes next?", None),
                          max_new_tokens, stops)
        for i in range(n)
    ]


def mamba_stress(
    engine: Engine, *, requests: int = 8, prefix_tokens: int = 512, max_new_tokens: int = 16
) -> Finding:
    """More concurrent shared-prefix requests than state slots: healthy, finished, unchanged.

    The baseline is each request decoded alone before the burst; the burst sends all of them in
    one ``generate`` call (a server engine submits them concurrently).
    """
    reqs = _shared_prefix_requests(engine, requests, prefix_tokens, max_new_tokens)
    baseline = {r.request_id: r for req in reqs for r in engine.generate([req], speculative=True)}
    evidence = [f"{requests} requests sharing a {prefix_tokens}-token prefix, {max_new_tokens} new tokens each"]
    try:
        burst = engine.generate(reqs, speculative=True)
    except Exception as exc:
        burst, raised = [], f"{type(exc).__name__}: {exc}"
    else:
        raised = None
    healthy, how = _healthy(engine)
    evidence.append(f"after the burst: {'healthy' if healthy else 'NOT healthy'} ({how})")
    if raised or not healthy:
        return fail(STRESS, "engine died under slot pressure" if not healthy else "the burst raised",
                    evidence + ([raised] if raised else []),
                    message=raised, action="see mamba-exhaustion: patch the donation path to skip, or raise "
                    "--max-mamba-cache-size / use --disable-radix-cache")
    if len(burst) != len(reqs):
        return fail(STRESS, f"{len(burst)} results for {len(reqs)} requests", evidence)
    errs = _errors(burst)
    unclean = [r.request_id for r in burst if r.finish_reason == "error" and not r.error]
    diffs = []
    for r in burst:
        base = baseline.get(r.request_id)
        if r.error or base is None or base.error:
            continue
        if r.output_ids != base.output_ids:
            at = next((i for i, (a, b) in enumerate(zip(r.output_ids, base.output_ids)) if a != b),
                      min(len(r.output_ids), len(base.output_ids)))
            diffs.append(f"{r.request_id}: differs from its solo run at output token {at}")
    if unclean:
        return fail(STRESS, "requests failed without an error message", evidence + unclean)
    if diffs:
        return fail(STRESS, f"{len(diffs)} outputs changed under slot pressure", evidence + diffs,
                    action="state corruption under eviction: compare with --disable-radix-cache")
    if errs:
        return warn(STRESS, f"{len(errs)} requests got a clean error; the rest match their solo runs", evidence + errs)
    return ok(STRESS, "every request finished and matches its solo run; engine still healthy", evidence)


def self_draft(engine: Engine, *, prompts: Sequence[str] = PROMPTS, max_new_tokens: int = 48) -> Finding:
    """Self-draft acceptance on a live engine whose draft is its target (``--draft`` = the target):
    every rejection is a place where verify and decode disagree; judged against the noise measured
    from the same engine (decode vs ``score()``), as the gate measures it."""
    from specparity.judge.calibration import Sample, calibrate
    from specparity.judge.invariance import self_draft_report
    from specparity.judge.noise import CalibrationError

    fp = engine.fingerprint()
    if fp.draft is None or not fp.draft.sha256 or fp.draft.sha256 != fp.target.sha256:
        drafted = f"{fp.draft.kind or fp.draft.path} ({fp.draft.sha256[:19] or 'no hash'})" if fp.draft else "none"
        return unknown(SELF_DRAFT, "the engine's draft is not its target", [f"target {fp.target.path}", f"draft {drafted}"],
                       action="run the engine with --draft set to the target's own weights (llama.cpp: -md the target GGUF)")
    reqs = _requests(engine, prompts, max_new_tokens, "self-draft")
    base, spec = engine.generate(reqs, speculative=False), engine.generate(reqs, speculative=True)
    errs = _errors(base) + _errors(spec)
    if errs:
        return fail(SELF_DRAFT, "a self-draft request failed", errs, message=errs[0])
    try:
        tf = [engine.score(r.prompt_ids, b.output_ids, r.top_k) for r, b in zip(reqs, base)]
        _, t = calibrate([Sample(r.request_id, b.output_ids, b.scores, x) for r, b, x in zip(reqs, base, tf)],
                         scorer=f"{engine.name} score()")
    except (CalibrationError, ValueError) as exc:
        return unknown(SELF_DRAFT, "the target's noise could not be measured", [str(exc)])
    rep = self_draft_report([(r.request_id, b, s, None) for r, b, s in zip(reqs, base, spec)], engine=fp.engine,
                            dtype=fp.dtype, threshold=t.nats, drift_bound=t.drift_nats or t.nats)
    status, why = rep.status()
    evidence = [f"accepted {rep.accepted}/{rep.proposed} draft tokens over {rep.verify_steps} verify steps, "
                f"{len(rep.rejections)} rejection(s) in {rep.tokens} tokens",
                f"near-tie threshold {t.nats:.3g} nats, drift bound {rep.drift_bound:.3g} (measured on these prompts)"]
    evidence += [f"{r.prompt_id} position {r.position}: baseline margin "
                 f"{'unknown' if r.baseline_margin is None else format(r.baseline_margin, '.4g')} ({r.against_noise})"
                 for r in rep.rejections[:5]]
    make = {"ok": ok, "warn": warn, "fail": fail}[status]
    return make(SELF_DRAFT, why, evidence,
                action="" if status == "ok" else "compare the verify kernel with the decode kernel at these positions")



# --------------------------------------------------------------------------- the list of live probes


@dataclass(frozen=True)
class LiveSettings:
    """What the live probes take besides the engine: ``specparity probe``'s ``--accept-*`` /
    ``--stress-requests``, the probe suite's ``--probe-*`` options. ``stress_requests`` 0 leaves
    the mamba stress probe out."""

    floor: float = DEFAULT_FLOOR
    relative: float = DEFAULT_RELATIVE
    recorded: float | None = None
    record_file: str | None = None
    stress_requests: int = 8


def _acceptance(engine: Engine, settings: LiveSettings) -> Finding:
    recorded = settings.recorded
    if recorded is None and settings.record_file:
        recorded = load_recorded(settings.record_file, engine.fingerprint())
    return acceptance_floor(engine, floor=settings.floor, recorded=recorded, relative=settings.relative)


#: Every live probe, by name, in the order they run: ``specparity probe --live-engine``, the probe
#: suite (one test each) and the policy file's ``allow_unknown`` read this table. A new live probe
#: adds its row here. A runner answers None when the settings leave its probe out.
LIVE_RUNNERS: dict[str, Callable[[Engine, LiveSettings], Finding | None]] = {
    FIRST_DECODE: lambda engine, settings: first_decode(engine),
    ACCEPTANCE: _acceptance,
    STRESS: lambda engine, settings: (mamba_stress(engine, requests=settings.stress_requests)
                                      if settings.stress_requests else None),
    SELF_DRAFT: lambda engine, settings: self_draft(engine),
}
#: Every live probe's name.
LIVE_PROBES = tuple(LIVE_RUNNERS)


def run_probe(name: str, engine: Engine, settings: LiveSettings) -> Finding | None:
    """The live probe ``name`` on ``engine``; None when ``settings`` leave it out."""
    return LIVE_RUNNERS[name](engine, settings)


def run_live(engine: Engine, settings: LiveSettings) -> list[Finding]:
    """Every live probe the settings do not leave out, in :data:`LIVE_PROBES` order."""
    return [f for f in (run_probe(name, engine, settings) for name in LIVE_PROBES) if f is not None]
