"""``specparity arms``: the lossless gate once per configuration arm, against one engine and one prompt set.

Each arm (:mod:`specparity.model.arms`) is a full gate run with its own engine — the servers launched
with the arm's knobs (:mod:`specparity.engines.server.arm_knobs`) — journalled in ``REPORT/<arm>/``
as it goes, so a later arm's failure never loses an earlier arm's results. The judged speculative
requests start from an empty prefix cache (:class:`ArmEngine`), and the arm's proof is read from them —
each answer's cached prompt tokens and preemptions, journalled with it — and from the engine (the
determinism declaration, the KV cache dtype, a preemption counter over the judged requests alone): the
arm's own condition, and that it is free of the conditions other arms set up. An arm whose proof is
missing ends ``NOT EXERCISED``, a failure (exit 1), never a pass. All plans are made before the first arm
runs, so an arm the engine cannot set up is refused (exit 4) before any request.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.engines.server.arm_knobs import (
    ArmLaunch,
    ArmSetupError,
    ArmSizing,
    arm_changes,
    arm_launch,
    cached_tokens_need,
    descriptor_of,
    kv_cache_dtypes,
    long_prompt_tokens,
    no_preemption,
    no_prefix_cache,
    preemptions,
    prefix_cache_floor,
    prefix_cache_unit,
    prefix_full_hit,
    requests_in_flight,
    reset_prefix_caches,
    running_caps,
    supported_arms,
    unsupported_reason,
)
from specparity.gate import exitcodes
from specparity.model.files import replace_whole
from specparity.model.arms import LONG_MIN_TOKENS, NOT_EXERCISED, Arm
from specparity.model.prompts import Prompt, long_context_prompt
from specparity.run.gate_command import RunRefused
from specparity.run.setup import BadInput, GateSetup

ARMS_JSON = "arms.json"
ARMS_MD = "arms.md"
#: Each arm's proof, written into its directory beside its journal as soon as it finishes.
ARM_JSON = "arm.json"
ARMS_SCHEMA = 1
#: Long-arm prompts per run (each is tens of thousands of tokens: a few prove the path).
LONG_PROMPTS = 2
#: Suffix of a prefix-warm arm's warm-up request ids.
WARM_SUFFIX = "/warm"


class ArmRefused(RunRefused):
    """An arm refused before any request: bad input, exit 4."""

    exit_code = exitcodes.BAD_INPUT


@dataclass
class ArmPlan:
    """One arm as it will run: the setup (engine options with the arm's knobs, prompts, config) and
    the launch change it made."""

    arm: Arm
    setup: GateSetup
    launch: ArmLaunch
    #: The launch change in words: what was applied, or, on running servers, what the arm expects of them.
    launch_text: str = ""


@dataclass
class Evidence:
    """What the engine's counters said about an arm's condition: ``exercised`` True (proven), False
    (shown not to have happened, or not shown at all: the proof is missing), None (nothing to prove)."""

    exercised: bool | None
    lines: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class ArmResult:
    arm: str
    report_dir: str
    launch: str
    gate_status: str
    exit_code: int
    counts: dict[str, int]
    failures: list[str]
    total: int
    proposed: int
    accepted: int
    accept_length: float | None
    threshold: float | None
    threshold_source: str
    evidence: Evidence
    bias: str | None = None
    #: Wall seconds of the arm's parts: ``launch`` (its engine: both servers started), ``gate`` (the run),
    #: ``total`` (launch, run, proof and shutdown) — what ``benchmarks/arms_wall.py`` reads.
    wall_s: dict[str, float] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.gate_status in ("ERROR", "INTERRUPTED"):
            return self.gate_status
        if self.evidence.exercised is False:
            return NOT_EXERCISED
        return self.gate_status

    @property
    def final_exit(self) -> int:
        if self.evidence.exercised is False:
            return max(self.exit_code, exitcodes.GATE_FAILED)
        return self.exit_code

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self).items() if k != "evidence"}
        return {**out, "status": self.status, "exit_code": self.final_exit, "gate_exit_code": self.exit_code,
                "evidence": dataclasses.asdict(self.evidence)}


@dataclass
class ArmsResult:
    engine: str
    arms: tuple[str, ...]
    report_dir: str
    results: list[ArmResult] = field(default_factory=list)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return exitcodes.INTERRUPTED
        return max((r.final_exit for r in self.results), default=exitcodes.GATE_FAILED)

    @property
    def status(self) -> str:
        if self.interrupted:
            return "INTERRUPTED"
        return "PASS" if self.exit_code == exitcodes.PASS else "FAIL"

    def to_json(self) -> dict[str, Any]:
        return {"schema": ARMS_SCHEMA, "status": self.status, "exit_code": self.exit_code, "engine": self.engine,
                "arms": list(self.arms), "report": self.report_dir, "results": [r.to_json() for r in self.results]}


# --------------------------------------------------------------------------- planning (before anything runs)


def engine_kind(setup: GateSetup) -> tuple[str, bool]:
    """(engine name, whether it is a server engine)."""
    from specparity.engines import engine_info

    info = engine_info(setup.factory)
    return (info.name if info is not None else setup.engine_spec), bool(info is not None and info.server)


def _prompt_tokens(setup: GateSetup, engine: str, prompts: Sequence[Prompt]) -> tuple[int, ...]:
    """Each prompt's token count, with the tokenizer the server engine sends (an engine that tokenizes on the
    server, llama.cpp: its character count, an upper bound)."""
    if _on_server(engine):
        return tuple(len(p.prompt or "") + sum(len(c) for _, c in (p.messages or ())) for p in prompts)
    from specparity.engines.server.engine import HFTokenizer, resolve_tokenizer_dir

    tok = HFTokenizer(resolve_tokenizer_dir(setup.engine_options, engine))
    return tuple(len(tok.encode_prompt(p.prompt, p.messages_as_dicts())) for p in prompts)


def _on_server(engine: str) -> bool:
    """Whether ``engine`` is sent text and tokenizes on the server (its descriptor says)."""
    d = descriptor_of(engine)
    return bool(d is not None and d.tokenizes_on_server)


def _max_new(setup: GateSetup, prompts: Sequence[Prompt]) -> tuple[int, ...]:
    from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS

    return tuple(setup.config.max_new_tokens or p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS for p in prompts)


#: How far above the long arm's size a prompt sized with the target's tokenizer may come out (tokens).
LONG_FIT_TOKENS = 64


def sized_long_prompt(size: int, seed: int, count: Callable[[Prompt], int]) -> Prompt:
    """A needle-in-a-haystack prompt of ``size`` to ``size`` + :data:`LONG_FIT_TOKENS` tokens as
    ``count`` (the target's tokenizer) measures it: the generator's characters-per-token guess is off by
    2x between tokenizers (1.8 characters a token on the fixture's, 4 on large BPE vocabularies), so the
    haystack is rescaled by what was measured until it fits (a prompt that still does not is refused by
    the plan's context check, naming its length)."""
    ask = size
    prompt = long_context_prompt(ask, seed=seed)
    for _ in range(4):
        n = count(prompt)
        if size <= n <= size + LONG_FIT_TOKENS:
            break
        ask = max(16, round(ask * (size + LONG_FIT_TOKENS / 2) / max(n, 1)))
        prompt = long_context_prompt(ask, seed=seed)
    return prompt


def long_prompts(setup: GateSetup, engine: str) -> list[Prompt]:
    """The long arm's prompts: :data:`LONG_PROMPTS` needle-in-a-haystack prompts of the size the target
    allows, sized with the tokenizer the gate sends (an engine that tokenizes on the server, llama.cpp: its
    prompts are sized by the generator's own estimate, and bounded by characters)."""
    if _on_server(engine):
        made = [long_context_prompt(LONG_MIN_TOKENS, seed=seed) for seed in range(LONG_PROMPTS)]
        size = LONG_MIN_TOKENS
    else:
        size = long_prompt_tokens(setup.engine_options.target)
        made = [sized_long_prompt(size, seed, lambda p: _prompt_tokens(setup, engine, [p])[0])
                for seed in range(LONG_PROMPTS)]
    return [dataclasses.replace(p, id=f"longctx-en-{size}-s{seed}") for seed, p in enumerate(made)]


def _hybrid_checkpoint(target: str | None) -> Any:
    """``--target``'s config as the mamba-slots probe reads it (a checkpoint of its config alone) when the target
    has linear-attention layers (a recurrent state per request: mamba state slots on SGLang); None when it has
    none or its ``config.json`` is unreadable."""
    from specparity.probes.checkpoints import Checkpoint
    from specparity.probes.mamba_slots import linear_layer_report

    try:
        config = json.loads((Path(target or "") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    checkpoint = Checkpoint(Path(target or ""), config, {})
    return checkpoint if linear_layer_report(checkpoint)[0] else None


def target_is_hybrid(target: str | None) -> bool:
    """Whether ``--target`` has linear-attention layers (:func:`_hybrid_checkpoint`); False when unreadable."""
    return _hybrid_checkpoint(target) is not None


def _installed_version(package: str, python: str | None) -> tuple[int, ...] | None:
    """The version of ``package`` the servers will run: that of ``--engine-opt python`` (asked in a child process:
    an engine often lives in another environment), else the one installed here; None when neither says."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    from specparity.probes.version_facts import parse_version

    try:
        if python:
            ask = f"import importlib.metadata as m; print(m.version({package!r}))"
            text = subprocess.run([python, "-c", ask], capture_output=True, text=True, timeout=120,
                                  check=True).stdout.strip().splitlines()[-1]
        else:
            text = version(package)
        return parse_version(text)
    except (PackageNotFoundError, ValueError, IndexError, OSError, subprocess.SubprocessError):
        return None


def predict_mamba_slots(target: str | None, flags: Any, version: tuple[int, ...] | None) -> Any:
    """The mamba-slots probe's :class:`~specparity.probes.mamba_slots.SlotPrediction` for a hybrid ``target``
    launched with ``flags`` (:class:`~specparity.probes.mamba_slots.LaunchFlags`) on SGLang ``version`` (None:
    the newest version read); None for a target that is not a hybrid."""
    from specparity.probes.mamba_slots import predict_slots
    from specparity.probes.version_facts import newest_mamba_read, sglang_mamba_sizing

    checkpoint = _hybrid_checkpoint(target)
    if checkpoint is None:
        return None
    sizing = sglang_mamba_sizing(version if version is not None and version[:3] >= (0, 5, 17) else newest_mamba_read())
    return predict_slots(checkpoint, flags, sizing, {}) if sizing else None


def mamba_slots_per_request(setup: GateSetup, engine: str) -> int | None:
    """The state slots one request of the speculative launch takes (the mamba-slots probe, on the flags the
    speculative server is launched with and the engine version it runs, else the newest version read); None
    when the target is not a hybrid or the engine cannot set up the mamba-slots arm."""
    from specparity.probes.mamba_slots import LaunchFlags

    d = descriptor_of(engine)
    if d is None or not d.supports("mamba-slots"):
        return None
    options = setup.engine_options
    argv: list[str] = [str(a) for a in (options.extra.get("server_args") or ())]
    try:
        if d.spec_launch_args is not None:
            argv = list(d.spec_launch_args(options))
    except (ValueError, KeyError, TypeError):
        pass  # servers at URLs, or no preset: the flags given are all there is
    version = _installed_version(d.package, options.extra.get("python")) if d.package else None
    prediction = predict_mamba_slots(options.target, LaunchFlags.parse(argv), version)
    return prediction.slots_per_request if prediction is not None else None


def plan_arms(setup: GateSetup, arms: Sequence[Arm], *, prelaunched: bool = False) -> list[ArmPlan]:
    """Every arm's plan; :class:`BadInput` (one line naming the arm and the missing knob) for an arm this
    engine, its servers or its model cannot run — before any model loads or request is sent."""
    engine, server = engine_kind(setup)
    if not server:
        gpu = [a.name for a in arms if a.name != "default"]
        if gpu:
            from specparity.engines import SERVER_ENGINES

            raise BadInput(f"--arms {','.join(gpu)}: engine {setup.engine_spec!r} runs in process; these arms change "
                           f"a GPU server's launch (--engine {', '.join(SERVER_ENGINES)}) — only 'default' runs here")
    options = setup.engine_options
    urls = bool(options.baseline_urls)
    if urls and not prelaunched:
        needs = [a for a in arms if a.launch]
        if needs:
            a = needs[0]
            raise BadInput(f"--arms {a.name}: it changes the servers' launch ({arm_changes(engine, a.name)}), which "
                           "the gate cannot do to servers at --baseline-url/--spec-url; use --preset, or launch them "
                           "so yourself and pass --prelaunched")
    plans = []
    for arm in arms:
        if server and arm.name not in supported_arms(engine):
            raise BadInput(f"--arms {arm.name}: engine {engine!r} cannot run it: {unsupported_reason(engine, arm.name)} "
                           f"(it supports: {', '.join(supported_arms(engine))})")
        config = setup.config
        prompts = list(setup.prompts)
        calibration = setup.calibration
        try:
            if arm.name == "long":
                prompts = long_prompts(setup, engine)
                calibration = None
            if not server:
                launch = ArmLaunch()
            else:
                sent = [*prompts, *(calibration or ())]  # every prompt a server of this arm is sent
                slots = mamba_slots_per_request(setup, engine) if arm.hybrid else None
                sizing = ArmSizing(_prompt_tokens(setup, engine, sent), _max_new(setup, sent),
                                   requests_in_flight(options), slots)
                launch = arm_launch(engine, arm.name, sizing, options)
        except ArmSetupError as exc:
            raise BadInput(str(exc) if str(exc).startswith("--arms") else f"--arms {exc}") from None
        except ValueError as exc:
            raise BadInput(f"--arms {arm.name}: {exc}") from None
        out = str(Path(config.report_dir or "reports/arms") / arm.name)
        config = dataclasses.replace(config, report_dir=out,
                                     concurrency=launch.concurrency if launch.concurrency else config.concurrency)
        arm_options = options if urls else launch.apply(options)
        arm_options = dataclasses.replace(arm_options, log_dir=out)
        expects = launch.describe()
        text = expects if not urls else (
            f"servers at the URLs, as launched (the arm expects: {expects})" if expects != "nothing" else "nothing")
        plans.append(ArmPlan(arm, dataclasses.replace(setup, engine_options=arm_options, config=config,
                                                      prompts=prompts, calibration=calibration), launch, text))
        if server and not urls:  # the launch the arm asks for must be one the engine accepts (its own checks)
            from specparity.engines import engine_info

            info = engine_info(setup.factory)
            try:
                if info is not None and info.check is not None:
                    info.check(arm_options)
            except ValueError as exc:
                raise BadInput(f"--arms {arm.name}: {exc}") from None
    return plans


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


# --------------------------------------------------------------------------- running


def _result(plan: ArmPlan, run: Any, decision: Any, evidence: Evidence) -> ArmResult:
    act = run.activity()
    th = run.threshold
    return ArmResult(plan.arm.name, plan.setup.config.report_dir or "", plan.launch_text,
                     "ERROR" if decision.engine_error else decision.status, decision.exit_code, dict(decision.counts),
                     list(decision.failures), len(run.records), act.proposed, act.accepted, act.mean_accept_length,
                     th.nats if th is not None else None, th.source if th is not None else "none",
                     evidence, bias_line(run) if plan.arm.name == "fp8-kv" else None)


def _not_run(plan: ArmPlan, why: str) -> ArmResult:
    return ArmResult(plan.arm.name, plan.setup.config.report_dir or "", plan.launch_text, "ERROR",
                     exitcodes.ENGINE_ERROR, {}, [why], 0, 0, 0, None, None, "none", Evidence(None, ["not run"]))


def write_arm(result: ArmResult) -> None:
    """The arm's proof beside its journal (``arm.json``) and at the end of its ``summary.md``."""
    out = Path(result.report_dir)
    replace_whole(out / ARM_JSON, json.dumps(result.to_json(), indent=1, default=str) + "\n")
    summary = out / "summary.md"
    if summary.exists():
        lines = [f"## Arm {result.arm}: {result.status}", "", f"- launch: {result.launch}"]
        lines += [f"- proof: {line}" for line in result.evidence.lines]
        if result.bias:
            lines.append(f"- {result.bias}")
        with summary.open("a", encoding="utf-8") as f:
            f.write("\n" + "\n".join(lines) + "\n")


def run_arms(plans: Sequence[ArmPlan], engine_name: str, report_dir: str, *,
             say: Callable[[str], None] | None = None) -> ArmsResult:
    """Every planned arm in turn, each on its own engine; ``arms.json`` / ``arms.md`` rewritten after each.
    An arm whose engine cannot start is reported (exit 3) and the next one still runs; Ctrl-C raises
    :class:`specparity.run.runner.GateInterrupted` after the partial arm is written."""
    from specparity.run.gate_command import EngineLoadFailed, load_engine
    from specparity.run.runner import GateInterrupted, conclude, run_gate

    tell = say or (lambda _msg: None)
    result = ArmsResult(engine_name, tuple(p.arm.name for p in plans), report_dir)
    for plan in plans:
        s = plan.setup
        tell(f"arm {plan.arm.name}: {len(s.prompts)} prompt(s); launch: {plan.launch_text}; journal "
             f"{s.config.report_dir}")
        t0 = time.perf_counter()
        wall: dict[str, float] = {}
        try:
            engine = load_engine(s)
        except EngineLoadFailed as exc:
            arm = _not_run(plan, str(exc))
            arm.wall_s = {"launch": time.perf_counter() - t0, "total": time.perf_counter() - t0}
            result.results.append(arm)
            write_arm(arm)
            write_arms(result)
            tell(arm_line(arm))
            continue
        wall["launch"] = time.perf_counter() - t0
        try:
            engine = ArmEngine(engine, warm=plan.arm.name == "prefix-warm")
            t_gate = time.perf_counter()
            try:
                run = run_gate(engine, s.prompts, s.config, calibration=s.calibration, golden=s.golden)
            except GateInterrupted as stopped:
                result.interrupted = True
                arm = _result(plan, stopped.run, conclude(stopped.run), Evidence(None, ["interrupted"]))
                result.results.append(arm)
                write_arm(arm)
                write_arms(result)
                stopped.arms = result  # type: ignore[attr-defined] - for the face to show the partial table
                raise
            wall["gate"] = time.perf_counter() - t_gate
            decision = conclude(run)
            try:
                evidence = collect_evidence(plan, engine, run, engine.judged_phase)
            except Exception as exc:  # noqa: BLE001 - a proof that cannot be read is a missing proof
                evidence = Evidence(False, [f"the proof could not be read: {type(exc).__name__}: {exc}"])
            arm = _result(plan, run, decision, evidence)
        finally:
            engine.close()
        arm.wall_s = {**wall, "total": time.perf_counter() - t0}
        result.results.append(arm)
        write_arm(arm)
        write_arms(result)
        tell(arm_line(arm))
    return result


# --------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def _classes(r: ArmResult) -> str:
    from specparity.model.verdicts import CLASSES

    return ", ".join(f"{k} {r.counts.get(k, 0)}" for k in CLASSES)


def _acceptance(r: ArmResult) -> str:
    return f"{r.accepted}/{r.proposed} (accept length {_fmt(r.accept_length, '.3f')})"


def arm_line(r: ArmResult) -> str:
    return (f"arm {r.arm}: {r.status} — {_classes(r)} ({r.total} prompts); accepted/proposed {_acceptance(r)}; "
            f"threshold {_fmt(r.threshold)} nats ({r.threshold_source}); proof: {'; '.join(r.evidence.lines)}")


def terminal_lines(arms: ArmsResult) -> list[str]:
    lines = [f"specparity arms: {arms.status} — engine {arms.engine}, arms {', '.join(arms.arms)}"
             + ("" if len(arms.results) == len(arms.arms) else f" ({len(arms.results)} of {len(arms.arms)} run)")]
    header = ("arm", "classes", "accepted/proposed", "threshold (source)", "proof", "verdict")
    rows = [(r.arm, _classes(r), _acceptance(r), f"{_fmt(r.threshold)} ({r.threshold_source})",
             "; ".join(r.evidence.lines), r.status) for r in arms.results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    widths[4] = min(widths[4], 60)
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for row in rows:
        cells = [c if i != 4 or len(c) <= 60 else c[:57] + "..." for i, c in enumerate(row)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    for r in arms.results:
        if r.bias:
            lines.append(f"arm {r.arm}: {r.bias}")
        lines += [f"FAIL: arm {r.arm}: {f}" for f in r.failures]
        if r.status == NOT_EXERCISED:
            lines.append(f"FAIL: arm {r.arm}: not exercised — {'; '.join(r.evidence.lines)}")
    return lines


def arms_markdown(arms: ArmsResult) -> str:
    out = [f"# specparity arms — {arms.status}", "", f"Engine {arms.engine}; each arm is a full gate run with its own "
           "journal and reports (`<arm>/`); its proof is read from the judged requests and the engine, with the "
           "proof that it is free of the other arms' conditions (an arm not proven is NOT EXERCISED, a failure).",
           "",
           "| arm | launch | classes | accepted/proposed | threshold (source) | proof | verdict |", "|---|---|---|---|---|---|---|"]
    for r in arms.results:
        out.append(f"| {r.arm} | {r.launch} | {_classes(r)} | {_acceptance(r)} | {_fmt(r.threshold)} "
                   f"({r.threshold_source}) | {'; '.join(r.evidence.lines).replace('|', '/')} | {r.status} |")
    extra = [f"- arm {r.arm}: {r.bias}" for r in arms.results if r.bias]
    extra += [f"- arm {r.arm}: {f}" for r in arms.results for f in r.failures]
    if extra:
        out += ["", "## Notes and failures", ""] + extra
    out += ["", "Per arm: " + ", ".join(f"[{r.arm}/summary.md]({r.arm}/summary.md)" for r in arms.results), ""]
    return "\n".join(out)


def write_arms(arms: ArmsResult) -> list[Path]:
    """``arms.json`` and ``arms.md`` in the run's directory, each replaced whole."""
    root = Path(arms.report_dir)
    return [replace_whole(root / ARMS_JSON, json.dumps(arms.to_json(), indent=1, default=str) + "\n"),
            replace_whole(root / ARMS_MD, arms_markdown(arms))]
