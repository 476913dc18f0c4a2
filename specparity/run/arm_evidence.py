"""``specparity arms``: the judged phase of an arm and the proof read from it.

:class:`ArmEngine` wraps the engine an arm runs: when the judged phase starts, the speculative servers' prefix
caches are reset and their preemption counter read, so that the judged requests start cold and a counter's delta
covers them alone (the prefix-warm arm also sends each prompt once before it). :func:`collect_evidence` reads the
arm's proof from the judged requests' journalled facts and from the engine: its own condition, and that it is free
of the conditions the other arms set up. Nothing here runs a gate or writes a report.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from specparity.engines.server.arm_knobs import (
    cached_tokens_need,
    kv_cache_dtypes,
    no_preemption,
    no_prefix_cache,
    preemptions,
    prefix_cache_floor,
    prefix_cache_unit,
    prefix_full_hit,
    reset_prefix_caches,
    running_caps,
)
from specparity.model.arms import LONG_MIN_TOKENS

from specparity.run.arm_plan import ArmPlan, predict_mamba_slots

#: Suffix of a prefix-warm arm's warm-up request ids.
WARM_SUFFIX = "/warm"


@dataclass
class Evidence:
    """What the engine's counters said about an arm's condition: ``exercised`` True (proven), False
    (shown not to have happened, or not shown at all: the proof is missing), None (nothing to prove)."""

    exercised: bool | None
    lines: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the judged phase


@dataclass
class JudgedPhase:
    """What was done and read as the judged phase started: each speculative server's prefix-cache reset
    (url, reset, what it said) and their preemption counter then (None: unknown)."""

    reset: list[tuple[str, bool, str]] = field(default_factory=list)
    preemptions: int | None = None


class ArmEngine:
    """The engine as an arm runs it. When the judged phase starts — the first speculative request, once the
    speculative server has scored the calibration's tokens (cross-instance scoring, which its prefix cache
    keeps) — the speculative servers' prefix caches are reset (:func:`reset_prefix_caches`) and their
    preemption counter read, so that the judged requests start cold and a counter's delta covers them alone.
    With ``warm`` (the prefix-warm arm) every speculative request is preceded by the same prompt with one
    output token on the same server, so that the judged request finds its prompt cached. Everything else is
    the engine's."""

    def __init__(self, engine: Any, *, warm: bool = False):
        self._engine = engine
        self.warm = warm
        #: The warm-up answers, by the judged request's id.
        self.warm_results: dict[str, Any] = {}
        #: Set by the first speculative request (None: no speculative request was sent).
        self.judged_phase: JudgedPhase | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def warm_errors(self) -> dict[str, str]:
        """The warm-up answers' errors, by the judged request's id (a failed warm-up leaves it cold)."""
        return {rid: got.error for rid, got in self.warm_results.items() if got.error}

    def start_judged_phase(self) -> JudgedPhase:
        with self._lock:  # the first of the requests in flight resets; the others wait for it
            if self.judged_phase is None:
                phase = JudgedPhase()
                try:
                    phase.reset = reset_prefix_caches(self._engine)
                    phase.preemptions = preemptions(self._engine)
                except Exception as exc:  # noqa: BLE001 - the proofs then show what was not done
                    phase.reset.append(("", False, f"{type(exc).__name__}: {exc}"))
                self.judged_phase = phase
            return self.judged_phase

    def generate(self, requests: Sequence[Any], *, speculative: bool) -> list[Any]:
        if speculative:
            self.start_judged_phase()
            if self.warm:
                for req in requests:
                    warm = dataclasses.replace(req, request_id=req.request_id + WARM_SUFFIX, max_new_tokens=1)
                    self.warm_results[req.request_id] = self._engine.generate([warm], speculative=True)[0]
        return self._engine.generate(requests, speculative=speculative)


# --------------------------------------------------------------------------- evidence


@dataclass
class Check:
    """One condition read from the judged requests: ``ok`` True (shown as the arm needs it), False (shown
    otherwise, or not shown at all)."""

    ok: bool
    lines: list[str]
    facts: dict[str, Any] = field(default_factory=dict)


def _judged(run: Any) -> list[Any]:
    """The judged speculative requests that were answered (a failed one is the gate's error, not a proof)."""
    return [r for r in run.records if r.spec is not None and r.request is not None and not r.spec.error]


def _name(engine: Any) -> str:
    return str(getattr(engine, "name", "") or "")


def _server(engine: Any) -> bool:
    return callable(getattr(engine, "every_server", None))


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _shared(judged: Sequence[Any]) -> dict[str, int]:
    """{request id: the longest prefix its prompt shares with another judged request's prompt and answer}:
    what the prefix cache may hold for it from the run's other judged requests, which any server reuses
    (a chat template's opening tokens). In sorted order the longest shared prefix is a neighbour's, so each
    prompt is compared with the nearest other request on either side of where it sorts."""
    seqs = sorted((tuple(r.request.prompt_ids) + tuple(r.spec.output_ids), i) for i, r in enumerate(judged))
    out = {}
    for i, r in enumerate(judged):
        prompt = tuple(r.request.prompt_ids)
        at = bisect.bisect_left(seqs, (prompt, -1))
        left = next((seqs[j][0] for j in range(at - 1, -1, -1) if seqs[j][1] != i), ())
        right = next((seqs[j][0] for j in range(at, len(seqs)) if seqs[j][1] != i), ())
        out[r.request.request_id] = max(_common(prompt, left), _common(prompt, right))
    return out


def _cache_off(engine: Any) -> str | None:
    """Why no request of ``engine`` reads a prefix cache (None: its requests may)."""
    if not _server(engine):
        return "the engine runs in process: no prefix cache"
    why = no_prefix_cache(engine)
    return f"{_name(engine)}: {why}" if why else None


def _reset_line(phase: JudgedPhase | None) -> list[str]:
    if phase is None or not phase.reset:
        return []
    failed = [(url, said) for url, ok, said in phase.reset if not ok]
    if not failed:
        return [f"prefix cache reset on the speculative server(s) before the judged requests "
                f"({', '.join(url for url, _ok, _said in phase.reset)})"]
    return ["prefix cache NOT reset before the judged requests: "
            + "; ".join(f"{url or '?'}: {said[:160]}" for url, said in failed)]


def _cached(judged: Sequence[Any]) -> dict[str, int | None]:
    return {r.request.request_id: r.spec.facts.get("cached_tokens") for r in judged}


def _unknown_line(engine: Any, n: int) -> str:
    need = cached_tokens_need(engine)
    return f"{n} judged answer(s) carried no cached-token count" + (f" ({need})" if need else "")


def cold_check(engine: Any, judged: Sequence[Any]) -> Check:
    """Free of the prefix-warm arm's condition: every judged speculative request found nothing cached beyond
    the prefix it shares with another judged request (:func:`_shared`; below one cache unit that is nothing)."""
    off = _cache_off(engine)
    if off:
        return Check(True, [f"cold by construction ({off})"], {"cached_tokens": None})
    cached = _cached(judged)
    unknown = [rid for rid, n in cached.items() if n is None]
    if not judged or unknown:
        return Check(False, [_unknown_line(engine, len(unknown)) if unknown else "no speculative request was answered"],
                     {"cached_tokens": cached})
    shared = _shared(judged)
    facts = {"cached_tokens": cached, "shared_prefix": shared}
    warm = {rid: n for rid, n in cached.items() if n > shared[rid]}
    if warm:
        return Check(False, [f"not cold: {len(warm)} of {len(cached)} judged request(s) found more cached than they "
                             "share with another judged prompt: "
                             + ", ".join(f"{rid} {n} (shares {shared[rid]})" for rid, n in list(warm.items())[:6])],
                     facts)
    nothing = sum(1 for n in cached.values() if n == 0)
    if nothing == len(cached):
        return Check(True, [f"cold: none of the {len(cached)} judged request(s) found anything cached"], facts)
    return Check(True, [f"cold: {nothing} of {len(cached)} judged request(s) found nothing cached, the others only a "
                        f"prefix shared with another judged prompt (at most {max(cached.values())} tokens)"], facts)


def warm_check(plan: ArmPlan, engine: Any, judged: Sequence[Any], run: Any) -> Check:
    """The prefix-warm arm's condition: every judged speculative request whose prompt can be cached at all
    had a warm-up that succeeded and found at least what a prompt cached whole is answered with
    (:func:`prefix_full_hit`: all but the last prompt token, in whole cache units; the unit read from the
    server)."""
    name = _name(engine) or plan.setup.engine_spec
    unit, source = prefix_cache_unit(engine, name)
    spec_config = run.fingerprint.spec_config if getattr(run, "fingerprint", None) is not None else None
    floor, why_short = prefix_cache_floor(name, spec_config, unit)
    warm_results = getattr(engine, "warm_results", {})
    cached = _cached(judged)
    need = {r.request.request_id: prefix_full_hit(name, int(r.spec.facts.get("prompt_tokens") or
                                                            len(r.request.prompt_ids)), unit, spec_config)
            for r in judged}
    short = [rid for rid, n in need.items() if n <= 0]
    counted = [rid for rid in cached if rid not in short]
    failed = {rid: warm_results[rid].error for rid in counted if rid in warm_results and warm_results[rid].error}
    missing = [rid for rid in counted if rid not in warm_results]
    unknown = [rid for rid in counted if cached[rid] is None]
    cold = {rid: cached[rid] for rid in counted
            if rid not in failed and rid not in missing and cached[rid] is not None and cached[rid] < need[rid]}
    facts = {"cached_tokens": cached, "needed": need, "cache_unit": unit, "cache_unit_source": source,
             "warm_up_errors": failed}
    lines = [f"cached prompt tokens per judged speculative request (cache unit {unit} tokens, {source}): "
             + (", ".join(f"{rid} {n if n is not None else 'unknown'}/{need[rid]}" for rid, n in cached.items())
                or "none")]
    if short:
        lines.append(f"{len(short)} prompt(s) shorter than {why_short} ({floor} tokens), which nothing can be cached "
                     f"for, are not counted: {', '.join(short[:8])}")
    if not counted:
        why = "no speculative request was judged" if not judged else "no judged prompt is long enough to be cached"
        return Check(False, lines + [why], facts)
    if failed:
        lines.append(f"warm-up failed for {len(failed)} prompt(s), which are not warm: "
                     + "; ".join(f"{k}: {v}" for k, v in list(failed.items())[:3]))
    if missing:
        lines.append(f"{len(missing)} prompt(s) were sent no warm-up: {', '.join(missing[:8])}")
    if unknown:
        lines.append(_unknown_line(engine, len(unknown)))
    if cold:
        lines.append(f"{len(cold)} judged request(s) found less than their whole prompt cached: "
                     + ", ".join(f"{rid} {n} of {need[rid]}" for rid, n in list(cold.items())[:6]))
    ok = not (failed or missing or unknown or cold)
    if ok:
        lines.append(f"warm: each of the {len(counted)} judged request(s) long enough found its whole prompt cached")
    return Check(ok, lines, facts)


def _preemption_counts(engine: Any, judged: Sequence[Any], phase: JudgedPhase | None) -> tuple[int | None, str, dict]:
    """(preemptions of the judged speculative requests, how they were counted, facts): the answers' own count
    where every one carries it (SGLang ``num_retractions``); else the speculative servers' counter over the
    judged phase alone, from its first speculative request to the end of the run, after the cross-instance
    scoring (vLLM: no answer says it); None when neither can be read."""
    if not _server(engine):
        return 0, "the engine runs in process: nothing is preempted", {}
    why = no_preemption(engine)
    if why:
        return 0, f"{_name(engine)}: {why}", {}
    per = {r.request.request_id: r.spec.facts.get("preemptions") for r in judged}
    if judged and all(n is not None for n in per.values()):
        hit = {rid: n for rid, n in per.items() if n}
        return (sum(per.values()), "per judged request (" + (", ".join(f"{rid} {n}" for rid, n in hit.items())
                                                                 or "none") + ")",
                {"preemptions_per_request": per})
    before = phase.preemptions if phase is not None else None
    after = preemptions(engine) if before is not None else None
    if before is None or after is None:
        return None, f"no preemption counter read from the speculative servers ({_name(engine) or '?'}: unknown)", {}
    return after - before, "on the speculative servers during the judged requests (counter delta)", {}


def preempt_check(engine: Any, judged: Sequence[Any], phase: JudgedPhase | None, *, want: bool) -> Check:
    """``want``: the preempt arm's condition (judged requests were preempted); else free of it (none was)."""
    n, how, facts = _preemption_counts(engine, judged, phase)
    facts = {"preemptions": n, **facts}
    if n is None:
        return Check(False, [how], facts)
    if want:
        return Check(n > 0, [f"preemptions of the judged requests: {n}, {how}"], facts)
    return Check(n == 0, [f"not preempted: {how}" if n == 0 else
                          f"preempted: {n} preemption(s) of the judged requests, {how}"], facts)


def most_alive(judged: Sequence[Any]) -> int | None:
    """The most judged requests alive on the server at once, from each answer's server-side times (received to
    finished; a request that finished the instant another arrived is not alive with it); None when an answer
    lacks them."""
    events = []
    for r in judged:
        start, end = r.spec.facts.get("received_ts"), r.spec.facts.get("finished_ts")
        if start is None or end is None:
            return None
        events += [(float(start), 1), (float(end), -1)]
    alive = most = 0
    for _t, step in sorted(events):  # at one instant, finishing (-1) sorts before arriving (+1)
        alive += step
        most = max(most, alive)
    return most


def _predicted_line(target: str | None, url: str, info: dict[str, Any]) -> str:
    """What the mamba-slots probe predicts for the server's own flags and version, in words."""
    from specparity.probes.mamba_slots import LaunchFlags
    from specparity.probes.version_facts import parse_version

    try:
        version = parse_version(str(info.get("version"))) if info.get("version") else None
    except ValueError:
        version = None
    flags = LaunchFlags.from_server_info(info)
    prediction = predict_mamba_slots(target, flags, version)
    if prediction is None:
        return f"{url}: the mamba-slots probe predicts nothing (the target is not a hybrid)"
    if prediction.cap is None:
        cap = "with max_mamba_cache_size unset, no cap it can tell (the pool is sized from memory)"
    else:
        cap = f"with max_mamba_cache_size {flags.max_mamba_cache_size}, a cap of {prediction.cap}"
    return (f"{url}: the mamba-slots probe predicts {prediction.slots_per_request} state slots per request "
            f"({prediction.strategy}) and, {cap} (sglang {info.get('version') or 'version unknown'})")


def _or_unknown(value: Any) -> str:
    return "unknown" if value is None else str(value)


def slots_check(engine: Any, judged: Sequence[Any], in_flight: int, target: str | None) -> Check:
    """The mamba-slots arm's condition: the speculative servers run fewer requests at once than the run sends
    (``/server_info``), and more judged requests were alive on them at once than they run (:func:`most_alive`),
    so the rest waited for a state slot. Retractions of the judged requests are said, not required."""
    caps = running_caps(engine)
    capacity = sum(cap for _url, cap, _info in caps if cap is not None)
    facts: dict[str, Any] = {"running_caps": {url: cap for url, cap, _info in caps}, "requests_in_flight": in_flight}
    lines = [f"running-request cap as each speculative server says (/server_info effective_max_running_requests_"
             f"per_dp): {', '.join(f'{url} {_or_unknown(cap)}' for url, cap, _ in caps) or 'none'}"]
    lines += [_predicted_line(target, url, info) for url, _cap, info in caps if info]
    if not caps or any(cap is None for _url, cap, _info in caps):
        return Check(False, lines + ["the running-request cap is unknown: nothing shows a slot ran out"], facts)
    if capacity >= in_flight:
        return Check(False, lines + [f"not capped: the speculative server(s) run {capacity} request(s) at once, the "
                                     f"run sends {in_flight}"], facts)
    alive = most_alive(judged)
    facts["most_alive"] = alive
    if alive is None:
        return Check(False, lines + ["the judged answers carry no meta_info.request_received_ts / request_finished_ts "
                                     "(SGLang answers them with --enable-metrics): nothing shows a request waited"],
                     facts)
    if alive <= capacity:
        return Check(False, lines + [f"at most {alive} judged request(s) alive on the server(s) at once, within what "
                                     f"they run ({capacity}): none waited for a slot"], facts)
    return Check(True, lines + [f"{alive} judged requests alive at once on server(s) that run {capacity}: at least "
                                f"{alive - capacity} waited for a state slot"], facts)


def _launch_conditions(engine: Any, judged: Sequence[Any], run: Any) -> Check:
    """The default arm free of the launch-level arms' conditions, where the run shows them: determinism
    declared, an fp8 KV cache, prompts of the long arm's size. Unknown is said, not failed."""
    lines: list[str] = []
    bad: list[str] = []
    if getattr(run, "deterministic", None):
        bad.append(f"determinism declared ({run.deterministic}): the deterministic arm's condition")
    dtypes = kv_cache_dtypes(engine) if _server(engine) else []
    fp8 = [f"{role} {url}" for role, url, d in dtypes if d is not None and d.startswith("fp8")]
    if fp8:
        bad.append(f"an fp8 KV cache on {', '.join(fp8)}: the fp8-kv arm's condition")
    unknown = [f"{role} {url}" for role, url, d in dtypes if d is None]
    if unknown:
        lines.append(f"KV cache dtype unknown on {', '.join(unknown)}")
    long = [r.request.request_id for r in judged if len(r.request.prompt_ids) >= LONG_MIN_TOKENS]
    if long:
        bad.append(f"{len(long)} prompt(s) of {LONG_MIN_TOKENS}+ tokens: the long arm's condition")
    return Check(not bad, bad + lines, {"kv_cache_dtype": dtypes} if dtypes else {})


def _combine(phase: JudgedPhase | None, *checks: Check) -> Evidence:
    """The checks as one proof, with the line on the prefix-cache reset that started the judged phase."""
    lines = [line for c in checks for line in c.lines] + _reset_line(phase)
    facts: dict[str, Any] = {"prefix_cache_reset": phase.reset} if phase is not None and phase.reset else {}
    for c in checks:
        facts.update(c.facts)
    return Evidence(all(c.ok for c in checks), lines, facts)


def collect_evidence(plan: ArmPlan, engine: Any, run: Any, phase: JudgedPhase | None = None) -> Evidence:
    """What the judged requests and the engine prove about ``plan``'s arm, after its run: the arm's own
    condition, and that it is free of the conditions of the arms that the run's own requests can bring
    about (a warm prefix cache, preemption); the default arm is also free of the launch-level ones."""
    name = plan.arm.name
    phase = phase if phase is not None else getattr(engine, "judged_phase", None)
    judged = _judged(run)
    if name == "default":
        return _combine(phase, cold_check(engine, judged), preempt_check(engine, judged, phase, want=False),
                        _launch_conditions(engine, judged, run))
    if name == "deterministic":
        if run.deterministic:
            own = Check(True, [f"deterministic on both sides: {run.deterministic}; judged bit-exact"],
                        {"deterministic": run.deterministic})
        else:
            said = run.deterministic_partial or "no server declared it"
            own = Check(False, [f"determinism not declared on every server of both sides ({said})"],
                        {"deterministic": None, "partial": run.deterministic_partial})
    elif name == "preempt":
        return _combine(phase, preempt_check(engine, judged, phase, want=True), cold_check(engine, judged))
    elif name == "prefix-warm":
        return _combine(phase, warm_check(plan, engine, judged, run), preempt_check(engine, judged, phase, want=False))
    elif name == "mamba-slots":  # a request retracted for a slot is part of the condition: said, not refused
        n, how, counted = _preemption_counts(engine, judged, phase)
        said = Check(True, [how if n is None else f"retractions of the judged requests: {n}, {how}"],
                     {"preemptions": n, **counted})
        return _combine(phase, slots_check(engine, judged, plan.setup.config.concurrency or 1,
                                           plan.setup.engine_options.target), cold_check(engine, judged), said)
    elif name == "fp8-kv":
        said = kv_cache_dtypes(engine)
        ok = bool(said) and all(d is not None and d.startswith("fp8") for _, _, d in said)
        where = ", ".join(f"{role} {url}: {d or 'unknown'}" for role, url, d in said)
        own = Check(ok, [f"KV cache dtype as each server says: {where}"], {"kv_cache_dtype": said})
    elif name == "long":
        sizes = {r.request.request_id: int(r.spec.facts.get("prompt_tokens") or len(r.request.prompt_ids))
                 for r in judged}
        counted = all(r.spec.facts.get("prompt_tokens") is not None for r in judged)
        source = "the server's count" if counted else "the prompts' encoding"
        short = [rid for rid, n in sizes.items() if n < LONG_MIN_TOKENS]
        lines = [f"prompt tokens per judged prompt ({source}): " +
                 (", ".join(f"{rid} {n}" for rid, n in sizes.items()) or "none")]
        if short:
            lines.append(f"{len(short)} prompt(s) below {LONG_MIN_TOKENS} tokens")
        own = Check(bool(sizes) and not short, lines, {"prompt_tokens": sizes})
    else:
        return Evidence(False, [f"no proof known for arm {name}"])
    return _combine(phase, own, cold_check(engine, judged), preempt_check(engine, judged, phase, want=False))


def bias_line(run: Any) -> str | None:
    """The decode/prefill bias over the calibration samples' rows (the fp8-kv arm's own line)."""
    from specparity.judge.bias import decode_prefill_bias

    pairs = [(r.baseline.scores, r.baseline_tf) for r in [*run.records, *run.calibration_records]
             if r.baseline is not None and not r.baseline.error and r.baseline_tf is not None]
    bias = decode_prefill_bias(pairs)
    if bias is None:
        return None
    noise = f"; the noise threshold is {run.threshold.nats:.4g} nats" if run.threshold is not None else ""
    return bias.describe() + noise
