"""The concurrency sweep: one suite at several concurrency levels against the same engine.

A server batches what is in flight together, and kernels differ by batch size, so a prompt's output
can depend on what else the server was decoding — for the target alone (both sides of a level flip
alike, so every level's gate passes) or for speculation only (acceptance moves with the batch).
``specparity sweep --levels 1,4,16`` runs the whole gate at each level, lowest first, on one engine
built once (the same servers), each level journalled in its own directory (``REPORT/c1``,
``REPORT/c4`` …: a later level's failure never loses an earlier level's results), then judges each
level's speculative output against the lowest level's with the comparison of ``specparity compare
--old-side spec`` (:func:`specparity.run.sides.judge_sides`: the gate's classes, the threshold
from the lowest level's measured noise, the higher level's own noise capped and named as the judged
side's). A prompt whose output differs between two levels of one configuration
is a **batch flip**: ``batch_flip_near_tie`` when the comparison calls it a near tie (within the noise),
``batch_flip`` otherwise (a failure); identical tokens whose rows moved beyond the drift bound are a
``batch_drift`` (a failure under the default ``--drift-policy fail``). The near ties are held to the
gate's own near-tie policy through the comparison's decision: the budget from the data (or
``--max-near-tie``), and bit-exact under ``--bit-exact`` or the engine's declaration of deterministic
inference, as in a gate run.

In-process engines decode one request at a time (``Capabilities.max_concurrency`` 1; their
``generate_batch`` is plain decode only, for the batching invariance check), so every level would run
at concurrency 1: the sweep refuses them, as it refuses a level above what a server engine serves.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.model.files import replace_whole
from specparity.gate import exitcodes
from specparity.run.setup import BadInput, GateSetup
from specparity.run.gate_command import RunRefused

#: Where each level's journal and reports go, under the sweep's ``--report`` directory.
LEVEL_DIR = "c{level}"
SWEEP_JSON = "sweep.json"
SWEEP_MD = "sweep.md"
#: ``sweep.json``: the version of the document's layout (bumped on an incompatible change).
SWEEP_SCHEMA = 1
#: The sweep's own classes for a prompt that differs between two levels (comparison class -> sweep class).
FLIP_CLASSES = {"near_tie": "batch_flip_near_tie", "diverged": "batch_flip", "drifted": "batch_drift",
                "error": "unjudged"}


class LevelsUnsupported(RunRefused):
    """A level the built engine cannot serve at once: bad input (exit 4), before any prompt runs."""

    exit_code = exitcodes.BAD_INPUT


@dataclass
class BatchFlip:
    """One prompt whose speculative output at ``level`` is not the lowest level's."""

    prompt_id: str
    level: int
    klass: str  # a value of FLIP_CLASSES
    comparison: str  # the gate's class of the comparison (near_tie, diverged, drifted, error)
    position: int | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()


@dataclass
class LevelResult:
    """One level's gate run, its acceptance, and its flips against the lowest level."""

    level: int
    in_flight: int  # requests in flight per phase, as the run recorded it
    report_dir: str
    status: str
    exit_code: int
    counts: dict[str, int]
    failures: list[str]
    total: int
    proposed: int
    accepted: int
    verify_steps: int
    accept_length: float | None
    threshold: float | None
    #: Against the lowest level (empty for the lowest itself): prompts compared, the comparison's
    #: threshold, the flips, and why nothing could be compared (None: it could).
    compared: int = 0
    flip_threshold: float | None = None
    flips: list[BatchFlip] = field(default_factory=list)
    flip_error: str | None = None
    #: The gate's near-tie policy applied to the ``batch_flip_near_tie`` prompts (the budget from the
    #: data, ``--max-near-tie``, ``--bit-exact`` or the engine's declaration), in words, and why they
    #: fail it (None: they fit it).
    flip_budget: str | None = None
    flip_budget_failure: str | None = None

    def flip_counts(self) -> dict[str, int]:
        out = {k: 0 for k in dict.fromkeys(FLIP_CLASSES.values())}
        for f in self.flips:
            out[f.klass] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k != "flips"}, "flips": [f.to_json() for f in self.flips],
                "flip_counts": self.flip_counts()}


@dataclass
class SweepResult:
    levels: tuple[int, ...]
    report_dir: str
    drift_policy: str = "fail"
    results: list[LevelResult] = field(default_factory=list)
    interrupted: bool = False
    #: Why the sweep stopped before its last level (None: it did not): a level that could not run at
    #: all (exit 3: the engine or its servers failed) leaves nothing for a later level on the same servers.
    stopped: str | None = None

    @property
    def complete(self) -> bool:
        return not self.interrupted and len(self.results) == len(self.levels)

    def failures(self) -> list[str]:
        """Why the sweep fails, beyond each level's own gate: batch flips that are not near ties."""
        out = []
        lowest = self.levels[0]
        for r in self.results:
            for klass, what in (("batch_flip", "differ from level {lo} beyond a near tie"),
                                ("batch_drift", "keep level {lo}'s tokens but their logprobs moved beyond the drift bound")):
                if klass == "batch_drift" and self.drift_policy == "warn":
                    continue
                hit = [f for f in r.flips if f.klass == klass]
                if hit:
                    shown = "; ".join(f"{f.prompt_id} ({f.reason})" for f in hit[:3]) + ("; …" if len(hit) > 3 else "")
                    out.append(f"level {r.level}: {len(hit)} prompt(s) {what.format(lo=lowest)} ({klass}): {shown}")
            if r.flip_budget_failure:
                n = r.flip_counts()["batch_flip_near_tie"]
                out.append(f"level {r.level}: {n} batch_flip_near_tie against level {lowest} fail the near-tie "
                           f"policy: {r.flip_budget_failure}")
            if r.flip_error:
                out.append(f"level {r.level}: not compared with level {lowest}: {r.flip_error}")
        return out

    @property
    def exit_code(self) -> int:
        """The worst over the levels (as ci/gate.sh over its suites), and a failure for a batch flip."""
        if self.interrupted:
            return exitcodes.INTERRUPTED
        worst = max((r.exit_code for r in self.results), default=exitcodes.PASS)
        if self.failures():
            worst = max(worst, exitcodes.GATE_FAILED)
        return worst

    @property
    def status(self) -> str:
        return exitcodes.status_word(self.exit_code, self.interrupted)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SWEEP_SCHEMA, "status": self.status, "exit_code": self.exit_code,
                "levels": list(self.levels), "complete": self.complete, "stopped": self.stopped, "report": self.report_dir,
                "failures": self.failures(), "results": [r.to_json() for r in self.results]}


def level_dir(root: str | os.PathLike[str], level: int) -> Path:
    return Path(root) / LEVEL_DIR.format(level=level)


def _level_result(level: int, run: Any, decision: Any, out: Path) -> LevelResult:
    act = run.activity()
    return LevelResult(level=level, in_flight=run.concurrency, report_dir=str(out),
                       status="ERROR" if decision.engine_error else decision.status, exit_code=decision.exit_code,
                       counts=dict(decision.counts), failures=list(decision.failures), total=len(run.records),
                       proposed=act.proposed, accepted=act.accepted, verify_steps=act.verify_steps,
                       accept_length=act.mean_accept_length,
                       threshold=run.threshold.nats if run.threshold is not None else None)


def batch_flips(lowest: int, low_dir: Path, result: LevelResult, setup: GateSetup, level_run: Any = None) -> None:
    """``result``'s speculative output judged against the lowest level's (``specparity compare
    --old-side spec``), its flips and the comparison's near-tie verdict recorded on ``result``.

    The flips within the noise are judged as a gate run's near ties are (:func:`specparity.gate.decision.decide`
    on the comparison): the budget from the data (or ``--max-near-tie``), bit-exact under
    ``--bit-exact`` or where the engine declares deterministic inference (``level_run``'s
    declaration: every level runs on the one engine)."""
    from specparity.run.sides import judge_sides, load_side

    config = setup.config
    try:
        old = load_side(str(low_dir), f"level {lowest}", "spec")
        new = load_side(result.report_dir, f"level {result.level}", "spec")
    except BadInput as exc:
        result.flip_error = str(exc)
        return
    if not old.streams:
        result.flip_error = f"level {lowest} has no speculative output to compare with"
        return
    policy = config.policy
    run, decision = judge_sides(old, new, str(low_dir), near_tie_nats=config.near_tie_nats,
                                near_tie_ceiling=config.near_tie_ceiling, max_near_tie=policy.max_near_tie,
                                drift_policy=policy.drift, bit_exact=policy.bit_exact,
                                deterministic=getattr(level_run, "deterministic", None),
                                deterministic_unknown=getattr(level_run, "deterministic_unknown", None),
                                unknown_fails=policy.unknown_fails)
    if run.threshold is None:
        result.flip_error = f"no threshold for the comparison: {run.calibration_error}"
        return
    result.flip_threshold = run.threshold.nats
    if decision.near_tie_budget is not None:
        result.flip_budget = decision.near_tie_budget.text
    result.flip_budget_failure = decision.near_tie_failure
    for rec in run.records:
        v = rec.verdict
        if v is None or v.klass == "exact":
            result.compared += v is not None
            continue
        result.compared += v.klass != "error"
        result.flips.append(BatchFlip(v.prompt_id, result.level, FLIP_CLASSES[v.klass], v.klass,
                                      v.divergence.position if v.divergence is not None else None, v.reason))


def run_sweep(setup: GateSetup, levels: Sequence[int], *, say: Callable[[str], None] | None = None) -> SweepResult:
    """Every level, lowest first, on one engine; ``sweep.json`` / ``sweep.md`` rewritten after each.

    Raises :class:`LevelsUnsupported` (exit 4) before any prompt runs when a level exceeds what the
    engine serves at once; Ctrl-C raises :class:`specparity.run.runner.GateInterrupted` after the partial
    level is concluded and the sweep's files say INTERRUPTED."""
    from specparity.engines.base import capabilities_of
    from specparity.run.runner import GateInterrupted, run_gate
    from specparity.run.gate_command import _check_counters, load_engine

    tell = say or (lambda _msg: None)
    root = setup.config.report_dir or ""
    sweep = SweepResult(tuple(levels), root, setup.config.policy.drift or "fail")
    engine = load_engine(setup)
    try:
        if setup.counters_pending:
            _check_counters(setup, engine)
        _check_levels(setup, engine, capabilities_of(engine).max_concurrency, sweep.levels)
        for level in sweep.levels:
            out = level_dir(root, level)
            config = dataclasses.replace(setup.config, concurrency=level, report_dir=str(out))
            tell(f"level {level}: {len(setup.prompts)} prompt(s), {level} request(s) in flight; journal {out}")
            try:
                run = run_gate(engine, setup.prompts, config, calibration=setup.calibration, golden=setup.golden)
            except GateInterrupted as stopped:
                sweep.interrupted = True
                sweep.results.append(_level_result(level, stopped.run, _conclude(stopped.run, out), out))
                write_sweep(sweep)
                stopped.sweep = sweep  # type: ignore[attr-defined] - for the face to show the partial sweep
                raise
            result = _level_result(level, run, _conclude(run, out), out)
            if level != sweep.levels[0]:
                batch_flips(sweep.levels[0], level_dir(root, sweep.levels[0]), result, setup, run)
            sweep.results.append(result)
            if result.exit_code == exitcodes.ENGINE_ERROR and level != sweep.levels[-1]:
                rest = ", ".join(str(n) for n in sweep.levels if n > level)
                sweep.stopped = (f"level {level} could not run (the engine or its servers failed: {level_dir(root, level)}"
                                 f"/summary.md says why), so level(s) {rest} were not run on the same servers")
            write_sweep(sweep)
            tell(level_line(result, sweep.levels[0]))
            if sweep.stopped:
                break
    finally:
        engine.close()
    return sweep


def _conclude(run: Any, out: Path) -> Any:
    """The level's decision, its journal's verdict line and reports; a failed write is a harness error (exit 3)."""
    from specparity.run.runner import conclude
    from specparity.run.gate_command import write_failed

    try:
        return conclude(run)
    except OSError as exc:
        from specparity.gate.decision import decide

        raise write_failed(f"--report {out}", exc, decide(run).status) from None


#: ``--engine-opt`` keys that raise how many requests an engine serves at once (llama.cpp's slots of
#: its launches; the requests in flight of the others), as the engines declare them.
SERVES_OPTIONS = ("parallel", "max_concurrency")


def _one_at_a_time(setup: GateSetup, levels: Sequence[int]) -> str:
    from specparity.engines import SERVER_ENGINES

    return (f"--levels {','.join(map(str, levels))}: engine {setup.engine_spec!r} serves one request at a time "
            f"(in-process engines decode one prompt at a time), so every level would run at concurrency 1; sweep a "
            f"server engine ({', '.join(SERVER_ENGINES)}), or measure in-process batching with "
            f"`pytest suites/invariance`")


def _raise_serves(setup: GateSetup) -> str:
    """How to raise what this engine serves: the option its :class:`EngineInfo` declares for it."""
    from specparity.engines import engine_info

    options = getattr(engine_info(setup.factory), "options", None) or {}
    keys = [key for key in SERVES_OPTIONS if key in options]
    return f"--engine-opt {keys[0]}=N" if keys else "what the engine serves"


def check_engine(setup: GateSetup, levels: Sequence[int]) -> None:
    """Before anything loads: the built-in in-process engines (dflash, hf) serve one request at a time
    (a plugin declares what it serves only once built: :func:`run_sweep` checks it then)."""
    from specparity.engines import BUILTIN, engine_info

    info = engine_info(setup.factory)
    if setup.engine_spec in BUILTIN and info is not None and not info.server:
        raise BadInput(_one_at_a_time(setup, levels))


def _check_levels(setup: GateSetup, engine: Any, serves: int, levels: Sequence[int]) -> None:
    over = [n for n in levels if n > serves]
    if not over:
        return
    given = ",".join(map(str, levels))
    if serves <= 1:
        raise LevelsUnsupported(_one_at_a_time(setup, levels))
    raise LevelsUnsupported(
        f"--levels {given}: engine {setup.engine_spec!r} serves at most {serves} request(s) at once, so level(s) "
        f"{', '.join(map(str, over))} would run at {serves}; raise what it serves ({_raise_serves(setup)}) or sweep "
        f"levels up to {serves}")


# --------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "n/a" if x is None else format(x, spec)


def acceptance_text(r: LevelResult) -> str:
    rate = f" ({r.accepted / r.proposed:.3f})" if r.proposed else ""
    return (f"accepted/proposed {r.accepted}/{r.proposed}{rate}, verify steps {r.verify_steps}, "
            f"accept length {_fmt(r.accept_length, '.3f')}")


def level_line(r: LevelResult, lowest: int) -> str:
    from specparity.model.verdicts import CLASSES

    counts = ", ".join(f"{k} {r.counts.get(k, 0)}" for k in CLASSES)
    line = f"level {r.level}: {r.status} — {counts} ({r.total} prompts); {acceptance_text(r)}"
    if r.level != lowest:
        if r.flip_error:
            line += f"; vs level {lowest}: not compared ({r.flip_error})"
        else:
            fc = r.flip_counts()
            line += (f"; vs level {lowest}: " + ", ".join(f"{k} {fc[k]}" for k in fc) +
                     f" of {r.compared} compared (threshold {_fmt(r.flip_threshold)} nats)")
    return line


def _progress(sweep: SweepResult) -> str:
    if sweep.interrupted and sweep.results:
        return f" (interrupted in level {sweep.results[-1].level})"
    return "" if sweep.complete else f" ({len(sweep.results)} of {len(sweep.levels)} run)"


def terminal_lines(sweep: SweepResult) -> list[str]:
    lowest = sweep.levels[0]
    lines = [f"specparity sweep: {sweep.status} — levels {', '.join(map(str, sweep.levels))}" + _progress(sweep)]
    lines += [level_line(r, lowest) for r in sweep.results]
    lines += [f"FAIL: level {r.level}: {f}" for r in sweep.results for f in r.failures]
    lines += [f"FAIL: {f}" for f in sweep.failures()]
    if sweep.stopped:
        lines.append(f"stopped: {sweep.stopped}")
    return lines


def sweep_markdown(sweep: SweepResult) -> str:
    from specparity.model.verdicts import CLASSES

    lowest = sweep.levels[0]
    out = [f"# specparity sweep — {sweep.status}", "",
           f"Levels (requests in flight per phase): {', '.join(map(str, sweep.levels))}{_progress(sweep)}.",
           f"Each level is a full gate run with its own journal and reports (`{LEVEL_DIR.format(level='N')}/`); "
           f"each level's speculative output is judged against level {lowest}'s with the gate's classes "
           "(`specparity compare --old-side spec`): a prompt whose output differs is a batch flip.", "",
           "| level | in flight | gate | " + " | ".join(CLASSES) + " | accepted/proposed | verify steps | accept length "
           f"| threshold (nats) | vs level {lowest}: batch_flip_near_tie | batch_flip | batch_drift | compared |",
           "|" + "---|" * (11 + len(CLASSES))]
    for r in sweep.results:
        fc = r.flip_counts()
        vs = (["-"] * 4 if r.level == lowest else ["n/a"] * 3 + [f"not compared: {r.flip_error}"] if r.flip_error
              else [str(fc["batch_flip_near_tie"]), str(fc["batch_flip"]), str(fc["batch_drift"]),
                    f"{r.compared} (threshold {_fmt(r.flip_threshold)})"])
        out.append(f"| {r.level} | {r.in_flight} | {r.status} | " + " | ".join(str(r.counts.get(k, 0)) for k in CLASSES)
                   + f" | {r.accepted}/{r.proposed} | {r.verify_steps} | {_fmt(r.accept_length, '.3f')} | "
                   f"{_fmt(r.threshold)} | " + " | ".join(vs) + " |")
    flips = [f for r in sweep.results for f in r.flips]
    if flips:
        out += ["", f"## Prompts that differ from level {lowest}", "", "| prompt | level | class | position | reason |",
                "|---|---|---|---|---|"]
        out += [f"| `{f.prompt_id}` | {f.level} | {f.klass} | {'-' if f.position is None else f.position} | "
                f"{f.reason.replace('|', '/')} |" for f in flips]
    budgets = [r for r in sweep.results if r.flip_budget]
    if budgets:
        out += ["", f"## Near-tie policy of the flips against level {lowest}", "",
                "The gate's near-tie policy applied to each level's `batch_flip_near_tie` prompts (the budget from "
                "the data, `--max-near-tie`, `--bit-exact` or the engine's declaration of deterministic inference):",
                ""]
        out += [f"- level {r.level}: {'FAIL' if r.flip_budget_failure else 'ok'} — {r.flip_budget}" for r in budgets]
    fails = [f"level {r.level}: {f}" for r in sweep.results for f in r.failures] + sweep.failures()
    if fails:
        out += ["", "## Failures", ""] + [f"- {f}" for f in fails]
    if sweep.stopped:
        out += ["", f"Stopped: {sweep.stopped}."]
    out += ["", "Per level: " + ", ".join(f"[{LEVEL_DIR.format(level=r.level)}/summary.md]"
                                        f"({LEVEL_DIR.format(level=r.level)}/summary.md)" for r in sweep.results), ""]
    return "\n".join(out)


def write_sweep(sweep: SweepResult) -> list[Path]:
    """``sweep.json`` and ``sweep.md`` in the sweep's directory, each replaced whole (never half written)."""
    root = Path(sweep.report_dir)
    return [replace_whole(root / SWEEP_JSON, json.dumps(sweep.to_json(), indent=1, default=str) + "\n"),
            replace_whole(root / SWEEP_MD, sweep_markdown(sweep))]
