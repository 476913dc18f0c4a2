"""``specparity arms``: the lossless gate once per configuration arm, against one engine and one prompt set.

Each arm (:mod:`specparity.model.arms`) is a full gate run with its own engine — the servers launched
with the arm's knobs (:mod:`specparity.engines.server.arm_knobs`) — journalled in ``REPORT/<arm>/``
as it goes, so a later arm's failure never loses an earlier arm's results. Around each run the arm's
proof is read from the engine's own counters (preemptions, cached prompt tokens, the determinism
declaration, the KV cache dtype, prompt token counts); an arm whose proof is missing ends
``NOT EXERCISED``, a failure (exit 1), never a pass. All plans are made before the first arm runs, so
an arm the engine cannot set up is refused (exit 4) before any request.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.engines.server.arm_knobs import (
    ArmLaunch,
    ArmSetupError,
    ArmSizing,
    arm_launch,
    kv_cache_dtypes,
    long_prompt_tokens,
    preemptions,
    prefix_cache_floor,
    request_facts,
    requests_in_flight,
)
from specparity.gate import exitcodes
from specparity.model.files import replace_whole
from specparity.model.arms import ARMS, LONG_MIN_TOKENS, NOT_EXERCISED, Arm
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
    """Each prompt's token count, with the tokenizer the server engine sends (llama.cpp tokenizes on the
    server: its character count, an upper bound)."""
    if engine == "llamacpp":
        return tuple(len(p.prompt or "") + sum(len(c) for _, c in (p.messages or ())) for p in prompts)
    from specparity.engines.server.engine import HFTokenizer, resolve_tokenizer_dir

    tok = HFTokenizer(resolve_tokenizer_dir(setup.engine_options, engine))
    return tuple(len(tok.encode_prompt(p.prompt, p.messages_as_dicts())) for p in prompts)


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
    allows, sized with the tokenizer the gate sends (llama.cpp tokenizes on the server: its prompts are
    sized by the generator's own estimate, and bounded by characters)."""
    if engine == "llamacpp":
        made = [long_context_prompt(LONG_MIN_TOKENS, seed=seed) for seed in range(LONG_PROMPTS)]
        size = LONG_MIN_TOKENS
    else:
        size = long_prompt_tokens(setup.engine_options.target)
        made = [sized_long_prompt(size, seed, lambda p: _prompt_tokens(setup, engine, [p])[0])
                for seed in range(LONG_PROMPTS)]
    return [dataclasses.replace(p, id=f"longctx-en-{size}-s{seed}") for seed, p in enumerate(made)]


def plan_arms(setup: GateSetup, arms: Sequence[Arm], *, prelaunched: bool = False) -> list[ArmPlan]:
    """Every arm's plan; :class:`BadInput` (one line naming the arm and the missing knob) for an arm this
    engine, its servers or its model cannot run — before any model loads or request is sent."""
    engine, server = engine_kind(setup)
    if not server:
        gpu = [a.name for a in arms if a.name != "default"]
        if gpu:
            raise BadInput(f"--arms {','.join(gpu)}: engine {setup.engine_spec!r} runs in process; these arms change "
                           "a GPU server's launch (vllm, sglang; llama.cpp: default, long) — only 'default' runs here")
    options = setup.engine_options
    urls = bool(options.baseline_urls)
    if urls and not prelaunched:
        needs = [a for a in arms if a.launch]
        if needs:
            a = needs[0]
            raise BadInput(f"--arms {a.name}: it changes the servers' launch ({a.changes.get(engine, 'n/a')}), which "
                           "the gate cannot do to servers at --baseline-url/--spec-url; use --preset, or launch them "
                           "so yourself and pass --prelaunched")
    plans = []
    for arm in arms:
        if server and engine not in arm.engines:
            raise BadInput(f"--arms {arm.name}: engine {engine!r} cannot run it: {arm.unsupported.get(engine, '')} "
                           f"(it supports: {', '.join(a.name for a in ARMS.values() if engine in a.engines)})")
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
                sizing = ArmSizing(_prompt_tokens(setup, engine, sent), _max_new(setup, sent),
                                   requests_in_flight(options))
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
        text = launch.describe() if not urls else (
            f"servers at the URLs, as launched (the arm expects: {launch.describe()})" if arm.launch else "nothing")
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


# --------------------------------------------------------------------------- request-level change


class PrefixWarmEngine:
    """The engine, with every speculative request preceded by the same prompt with one output token on
    the same server, so that the judged request finds its prefix cached. Everything else is the engine's."""

    def __init__(self, engine: Any):
        self._engine = engine
        #: The warm-up answers' errors, by request id (a failed warm-up leaves the judged one cold).
        self.warm_errors: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, requests: Sequence[Any], *, speculative: bool) -> list[Any]:
        if speculative:
            for req in requests:
                warm = dataclasses.replace(req, request_id=req.request_id + WARM_SUFFIX, max_new_tokens=1)
                got = self._engine.generate([warm], speculative=True)[0]
                if got.error:
                    self.warm_errors[req.request_id] = got.error
        return self._engine.generate(requests, speculative=speculative)


# --------------------------------------------------------------------------- evidence


def _before(plan: ArmPlan, engine: Any) -> dict[str, Any]:
    if plan.arm.name == "preempt":
        return {"preemptions": preemptions(engine)}
    return {}


def collect_evidence(plan: ArmPlan, engine: Any, run: Any, before: dict[str, Any]) -> Evidence:
    """What the engine's counters prove about ``plan``'s arm, after its run."""
    name = plan.arm.name
    judged = [r for r in run.records if r.spec is not None and r.request is not None]
    ids = [r.request.request_id for r in judged]
    if name == "default":
        return Evidence(None, ["nothing to prove"])
    if name == "deterministic":
        if run.deterministic:
            return Evidence(True, [f"deterministic on both sides: {run.deterministic}; judged bit-exact"],
                            {"deterministic": run.deterministic})
        said = run.deterministic_partial or "no server declared it"
        return Evidence(False, [f"determinism not declared on every server of both sides ({said})"],
                        {"deterministic": None, "partial": run.deterministic_partial})
    if name == "preempt":
        after = preemptions(engine)
        b = before.get("preemptions")
        if after is None or b is None:
            return Evidence(False, [f"no preemption counter read from the speculative servers "
                                    f"({getattr(engine, 'name', '?')}: unknown)"], {"preemptions": None})
        delta = after - b
        return Evidence(delta > 0, [f"preemptions on the speculative servers during the run: {delta}"],
                        {"preemptions": delta})
    if name == "prefix-warm":
        cached = request_facts(engine, ids, speculative=True, key="cached_tokens")
        warm_errors = getattr(engine, "warm_errors", {})
        # a prompt too short for the cache to hold any of it (vLLM caches whole blocks, recomputes the last
        # prompt token, and for EAGLE-like drafts the last matched block) neither proves nor disproves it
        spec_config = run.fingerprint.spec_config if run.fingerprint is not None else None
        floor, why_short = prefix_cache_floor(plan.setup.engine_spec, spec_config)
        length = {r.request.request_id: len(r.request.prompt_ids) for r in judged}
        short = [rid for rid in cached if length.get(rid, 0) < floor]
        cached_long = {rid: n for rid, n in cached.items() if rid not in short}
        cold = [rid for rid, n in cached_long.items() if not n]
        unknown = [rid for rid, n in cached.items() if n is None]
        lines = ["cached prompt tokens per judged speculative request: "
                 + (", ".join(f"{rid} {n if n is not None else 'unknown'}" for rid, n in cached.items()) or "none")]
        if warm_errors:
            lines.append(f"warm-up failed for {len(warm_errors)} prompt(s): " +
                         "; ".join(f"{k}: {v}" for k, v in list(warm_errors.items())[:3]))
        if short:
            lines.append(f"{len(short)} prompt(s) shorter than {why_short} ({floor} tokens), which nothing can "
                         f"be cached for, are not counted: {', '.join(short[:8])}")
        if not ids or not cached_long:
            why = "no speculative request was judged" if not ids else "no judged prompt is long enough to be cached"
            return Evidence(False, lines + [why], {"cached_tokens": cached})
        if unknown:
            lines.append(f"{len(unknown)} answer(s) carried no cached-token count (vLLM needs "
                         "--enable-prompt-tokens-details)")
        elif cold:
            lines.append(f"{len(cold)} judged request(s) found nothing cached")
        return Evidence(not cold, lines, {"cached_tokens": cached})
    if name == "fp8-kv":
        said = kv_cache_dtypes(engine)
        ok = bool(said) and all(d is not None and d.startswith("fp8") for _, _, d in said)
        where = ", ".join(f"{role} {url}: {d or 'unknown'}" for role, url, d in said)
        return Evidence(ok, [f"KV cache dtype as each server says: {where}"], {"kv_cache_dtype": said})
    if name == "long":
        counted = request_facts(engine, ids, speculative=True, key="prompt_tokens")
        sizes = {rid: (n if n is not None else len(r.request.prompt_ids)) for (rid, n), r in zip(counted.items(), judged)}
        source = "the server's count" if all(n is not None for n in counted.values()) else "the prompts' encoding"
        short = [rid for rid, n in sizes.items() if n < LONG_MIN_TOKENS]
        lines = [f"prompt tokens per judged prompt ({source}): " +
                 (", ".join(f"{rid} {n}" for rid, n in sizes.items()) or "none")]
        if short:
            lines.append(f"{len(short)} prompt(s) below {LONG_MIN_TOKENS} tokens")
        return Evidence(bool(sizes) and not short, lines, {"prompt_tokens": sizes})
    return Evidence(False, [f"no proof known for arm {name}"])


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
            if plan.arm.name == "prefix-warm":
                engine = PrefixWarmEngine(engine)
            before = _before(plan, engine)
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
                evidence = collect_evidence(plan, engine, run, before)
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
           "journal and reports (`<arm>/`); its proof is read from the engine's own counters (an arm not proven "
           "is NOT EXERCISED, a failure).", "",
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
