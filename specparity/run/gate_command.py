"""One gate run from validated options: the engine built, the run made, the decision taken.

Every face that runs the gate — the pytest plugin's session fixture, ``specparity run`` and
``specparity record`` — calls :func:`execute`, so goldens, ``--resume`` and the policy behave the
same whichever started the run. The face only chooses the prompts (pytest: the collected ones) and
how progress and the outcome are shown.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.gate import exitcodes
from specparity.gate.decision import GateDecision
from specparity.run.setup import GateSetup
from specparity.model.prompts import Prompt
from specparity.model.gate_run import GateRun


class RunRefused(RuntimeError):
    """The run stopped before any prompt ran; ``exit_code`` says why (the faces print one line)."""

    exit_code = exitcodes.ENGINE_ERROR


class EngineLoadFailed(RunRefused):
    """The engine could not be built: no verdict, exit code 3."""

    exit_code = exitcodes.ENGINE_ERROR


class ReportWriteFailed(RunRefused):
    """The run finished but its verdict or reports could not be written (the directory vanished, the
    disk filled up): a harness error, exit code 3; the message says the verdict that was reached."""

    exit_code = exitcodes.ENGINE_ERROR


def write_failed(where: str, exc: OSError, status: str) -> ReportWriteFailed:
    """The one wording of a failed report write, for every face that writes reports (``where``: the
    option and directory, e.g. ``--report DIR``)."""
    return ReportWriteFailed(f"{where}: writing the verdict and reports failed "
                             f"({type(exc).__name__}: {exc.strerror or exc}); the gate's verdict was {status}")


class PolicyUnsupported(RunRefused):
    """A rule the built engine's counters cannot check (an engine that declares its counters only
    once built, e.g. a plugin): refused as bad input, exit code 4, before any prompt runs."""

    exit_code = exitcodes.BAD_INPUT


@dataclass
class SessionResult:
    run: GateRun
    decision: GateDecision
    #: Files the run wrote (summary, reports, journal, golden), for the face to print.
    paths: list[Path] = field(default_factory=list)


def load_engine(setup: GateSetup) -> Any:
    """Build the engine from the validated setup; a failure raises :class:`EngineLoadFailed` with one line."""
    from specparity.engines import build_engine

    try:
        return build_engine(setup.factory, setup.engine_options, setup.engine_spec)
    except Exception as exc:  # noqa: BLE001 - any load failure: one line, exit code 3, nothing to gate
        raise EngineLoadFailed(f"cannot load engine {setup.engine_spec!r}: {type(exc).__name__}: {exc}") from None


def _check_counters(setup: GateSetup, engine: Any) -> None:
    """The counter-dependent rules, once an engine that did not declare its counters is built."""
    from specparity.engines.base import capabilities_of
    from specparity.run.setup import BadInput, check_counters

    try:
        check_counters(setup.config.policy, capabilities_of(engine).counters, setup.engine_spec, setup.policy_origin)
    except BadInput as exc:
        engine.close()
        raise PolicyUnsupported(str(exc)) from None


def engine_record(spec: str, options: Any) -> dict[str, Any]:
    """``GateConfig.engine``: the ``--engine`` spec and the checked options as JSON (a value JSON
    cannot hold is kept as its text), a plugin file and local model paths made absolute, so the
    record names the same files from any directory."""
    module, sep, attr = spec.rpartition(":")
    if sep and module.endswith(".py") and Path(module).is_file():
        spec = f"{Path(module).resolve()}:{attr}"
    values = json.loads(json.dumps(dataclasses.asdict(options), default=str))
    for key in ("target", "draft"):
        if values.get(key) and Path(values[key]).exists():
            values[key] = str(Path(values[key]).resolve())
    return {"spec": spec, "options": values}


def report_paths(setup: GateSetup) -> list[Path]:
    return report_paths_of(setup.config.report_dir)


def report_paths_of(out: str | None) -> list[Path]:
    """The files a run writes into its report directory ``out`` (none without one)."""
    from specparity.report.render import DERIVED_FILES
    from specparity.report.reproducers import INDEX, REPRODUCERS
    from specparity.run.runner import JOURNAL

    return [Path(out) / name for name in (*DERIVED_FILES, f"{REPRODUCERS}/{INDEX}", JOURNAL)] if out else []


def execute(setup: GateSetup, prompts: Sequence[Prompt] | None = None, *,
            progress: Callable[[str], None] | None = None,
            on_finish: Callable[[SessionResult], None] | None = None) -> SessionResult:
    """Run the gate on ``prompts`` (default: every selected prompt of ``setup``) and conclude it.

    Ctrl-C raises :class:`specparity.run.runner.GateInterrupted` after ``on_finish`` has seen the partial
    run's result (the journal and reports then say it was interrupted)."""
    from specparity.run.runner import GateInterrupted, conclude, run_gate

    chosen = list(setup.prompts if prompts is None else prompts)
    engine = load_engine(setup)
    if setup.counters_pending:
        _check_counters(setup, engine)

    def finish(run: GateRun) -> SessionResult:
        try:
            decision = conclude(run)
        except OSError as exc:
            from specparity.gate.decision import decide

            raise write_failed(f"--report {setup.config.report_dir}", exc, decide(run).status) from None
        result = SessionResult(run, decision, report_paths(setup))
        if on_finish is not None:
            on_finish(result)
        return result

    config = dataclasses.replace(setup.config, engine=engine_record(setup.engine_spec, setup.engine_options))
    try:
        run = run_gate(engine, chosen, config, calibration=setup.calibration, progress=progress,
                       golden=setup.golden, resume=setup.resume, plan=setup.plan)
    except GateInterrupted as stopped:
        finish(stopped.run)
        raise
    finally:
        engine.close()
    return finish(run)
