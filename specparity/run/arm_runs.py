"""``specparity arms``: the lossless gate once per configuration arm, against one engine and one prompt set.

The plans are :mod:`specparity.run.arm_plan`'s, the judged phase and the proof :mod:`specparity.run.arm_evidence`'s;
this module runs the plans one after the other, writes each arm's proof and the arms' table, and says the outcome.

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

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.gate import exitcodes
from specparity.model.files import replace_whole
from specparity.model.arms import NOT_EXERCISED
from specparity.run.gate_command import RunRefused
from specparity.run.arm_evidence import ArmEngine, Evidence, bias_line, collect_evidence
from specparity.run.arm_plan import ArmPlan

ARMS_JSON = "arms.json"
ARMS_MD = "arms.md"
#: Each arm's proof, written into its directory beside its journal as soon as it finishes.
ARM_JSON = "arm.json"
ARMS_SCHEMA = 1


class ArmRefused(RunRefused):
    """An arm refused before any request: bad input, exit 4."""

    exit_code = exitcodes.BAD_INPUT


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
        return exitcodes.status_word(self.exit_code, self.interrupted)

    def to_json(self) -> dict[str, Any]:
        return {"schema": ARMS_SCHEMA, "status": self.status, "exit_code": self.exit_code, "engine": self.engine,
                "arms": list(self.arms), "report": self.report_dir, "results": [r.to_json() for r in self.results]}


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
