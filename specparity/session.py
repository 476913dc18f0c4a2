"""One gate run from validated options: the engine built, the run made, the decision taken.

Every face that runs the gate — the pytest plugin's session fixture, ``specparity run`` and
``specparity record`` — calls :func:`execute`, so goldens, ``--resume`` and the policy behave the
same whichever started the run. The face only chooses the prompts (pytest: the collected ones) and
how progress and the outcome are shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity import exitcodes
from specparity.gate import GateDecision
from specparity.options import GateSetup
from specparity.prompts import Prompt
from specparity.records import GateRun


class EngineLoadFailed(RuntimeError):
    """The engine could not be built: no verdict, exit code 3."""

    exit_code = exitcodes.ENGINE_ERROR


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


def report_paths(setup: GateSetup) -> list[Path]:
    from specparity.report import DERIVED_FILES
    from specparity.runner import JOURNAL

    out = setup.config.report_dir
    return [Path(out) / name for name in (*DERIVED_FILES, JOURNAL)] if out else []


def execute(setup: GateSetup, prompts: Sequence[Prompt] | None = None, *,
            progress: Callable[[str], None] | None = None,
            on_finish: Callable[[SessionResult], None] | None = None) -> SessionResult:
    """Run the gate on ``prompts`` (default: every selected prompt of ``setup``) and conclude it.

    Ctrl-C raises :class:`specparity.runner.GateInterrupted` after ``on_finish`` has seen the partial
    run's result (the journal and reports then say it was interrupted)."""
    from specparity.runner import GateInterrupted, conclude, run_gate

    chosen = list(setup.prompts if prompts is None else prompts)
    engine = load_engine(setup)

    def finish(run: GateRun) -> SessionResult:
        result = SessionResult(run, conclude(run), report_paths(setup))
        if on_finish is not None:
            on_finish(result)
        return result

    try:
        run = run_gate(engine, chosen, setup.config, calibration=setup.calibration, progress=progress,
                       golden=setup.golden, resume=setup.resume)
    except GateInterrupted as stopped:
        finish(stopped.run)
        raise
    finally:
        engine.close()
    return finish(run)
