"""pytest integration: command-line options, the per-prompt parametrisation, the session run.

Loaded only where specparity's suites run, never into every pytest session of the environment: the
checkout's root ``conftest.py`` and the packaged suite's ``specparity/suite/conftest.py`` name it in
``pytest_plugins``, and the ``pytest11`` entry point (:mod:`specparity.plugin.autoload`) loads it
for ``-p specparity`` or ``--pyargs specparity.suite``. Its generic option names (``--engine``,
``--target``, ``--report`` …) would otherwise collide with another project's conftest.
``-p no:specparity`` leaves it inert wherever it is named: no option, no hook acts.

Every option is checked once in ``pytest_configure``, before any model
loads: a bad one is a single ``ERROR: specparity: …`` line and exit code 4
(:mod:`specparity.gate.exitcodes`). The whole suite runs once per session (baselines first, so the
near-tie threshold is fixed before any speculative output is seen); each
``test_lossless[<prompt id>]`` then asserts its own prompt's verdict and ``test_gate_policy`` the
run-level rules.

The gate's verdict decides the exit status however the tests were selected: with ``-k``, node ids
or ``--lf`` deselecting ``test_gate_policy``, a failed gate still exits 1 (``pytest_sessionfinish``).
Under pytest-xdist every gate test is sent to one worker (``--dist loadfile``, set automatically:
the gate's tests live in one file), so the gate runs once, writes one journal and one summary, and
its outcome is relayed to the controller, which prints it and sets the exit status.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specparity.gate import exitcodes
from specparity.cli.option_table import DEFAULT_REPORT, GATE_OPTIONS, SHARD_OPTIONS, add_gate_options, gate_dests, shard_dests
from specparity.cli.options import build_setup
from specparity.engines.libraries import configure_libraries
from specparity.plugin.autoload import ENTRY_POINT
from specparity.run import signals
from specparity.run.setup import BadInput, GateSetup

_SETUP_KEY = pytest.StashKey[GateSetup]()
_OUTCOME_KEY = pytest.StashKey[dict]()
#: Options build_setup reads (pytest ``dest`` names), declared once in option_table.
_GATE_OPTIONS = gate_dests() + shard_dests()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if pluginmanager.is_blocked(ENTRY_POINT):  # -p no:specparity: off, even where a conftest names the plugin
        return
    add_gate_options(lambda name, description: parser.getgroup(name, description).addoption,
                     GATE_OPTIONS + SHARD_OPTIONS)
    from specparity.plugin.probe_options import add_probe_options

    add_probe_options(parser)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


_ERROR_KEY = pytest.StashKey[str]()
_SIGTERM_KEY = pytest.StashKey[Any]()
#: Fixtures of the tests that need the gate's options (the lossless gate, invariance, sweeps).
GATE_FIXTURES = frozenset({"lossless_prompt", "gate_session", "invariance_case", "invariance", "sweep"})


def active(config: pytest.Config) -> bool:
    """Whether the gate's options are registered in this session (not under ``-p no:specparity``)."""
    return hasattr(config.option, _GATE_OPTIONS[0])


def gate_setup(config: pytest.Config) -> GateSetup:
    """The validated options of this session (built in ``pytest_configure``)."""
    if not active(config):
        raise pytest.UsageError("specparity: the gate's pytest plugin is off (-p no:specparity)")
    error = setup_error(config)
    if error is not None:
        raise pytest.UsageError(error)
    return config.stash[_SETUP_KEY]


def setup_error(config: pytest.Config) -> str | None:
    """Why the gate's options are bad, when that was deferred (see :func:`pytest_configure`)."""
    return config.stash.get(_ERROR_KEY, None)


def _names_gate_suite(config: pytest.Config) -> bool:
    """Whether the command line (or testpaths) names a folder that holds gate suites."""
    for arg in config.args:
        parts = Path(str(arg).split("::")[0]).parts
        if "suites" in parts or "suite" in parts or str(arg).startswith("specparity.suite"):
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    if not active(config):
        return
    # the libraries' warnings and log lines only under -v (pytest's own verbosity)
    configure_libraries(verbose=config.getoption("verbose", 0) > 0)
    # SIGTERM (a CI timeout) ends the session as Ctrl-C does: fixtures torn down, launched servers stopped
    config.stash[_SIGTERM_KEY] = signals.install()
    raw = {name: config.getoption(name) for name in _GATE_OPTIONS}
    # A report directory the user named is created and proven writable now; the default one when
    # the run starts (so `pytest tests/` does not create it).
    check_report = bool(raw["report"]) and raw["report"] != DEFAULT_REPORT and not _is_worker(config)
    try:
        config.stash[_SETUP_KEY] = build_setup(raw, check_report=check_report)
    except BadInput as exc:
        # A repository's conftest may load the plugin for a whole tree: its other tests must not
        # fail because the gate has no --target there. Bad gate
        # options fail now when the command names a gate suite, else once a gate test is collected
        # (pytest_collection_modifyitems); either way one line, exit 4, before any model loads.
        if _names_gate_suite(config):
            raise pytest.UsageError(f"specparity: {exc}") from None
        config.stash[_ERROR_KEY] = f"specparity: {exc}"
    _configure_xdist(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    signals.restore(config.stash.get(_SIGTERM_KEY, None))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    error = setup_error(config)
    if error is not None and any(GATE_FIXTURES & set(getattr(item, "fixturenames", ())) for item in items):
        raise pytest.UsageError(error)


def _configure_xdist(config: pytest.Config) -> None:
    """Keep the gate on one worker: its two phases need every baseline before any speculative run.

    The gate's tests (and the sweep's) each live in one file, so ``--dist loadfile`` keeps each
    session run on one worker while other files spread over the rest. (xdist's ``loadgroup`` would
    be the natural choice, but it renames ``Item._nodeid``, which pytest 9 no longer reads.)
    """
    if not config.pluginmanager.hasplugin("xdist") or _is_worker(config):
        return
    dist = config.getoption("dist", default="no")
    if dist == "each":
        raise pytest.UsageError("specparity: --dist each would run the whole gate on every worker; "
                                "use -n N with --dist load, loadfile or loadscope")
    if dist in ("load", "worksteal", "loadgroup"):
        config.option.dist = "loadfile"
    config.stash.setdefault(_OUTCOME_KEY, _new_outcome())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "lossless_prompt" in metafunc.fixturenames and active(metafunc.config):
        prompts = [] if setup_error(metafunc.config) else gate_setup(metafunc.config).prompts
        metafunc.parametrize("lossless_prompt", prompts, ids=[p.id for p in prompts])


# --------------------------------------------------------------------------- outcome and exit status


def _new_outcome() -> dict[str, Any]:
    return {"exit": exitcodes.PASS, "sections": []}


def _outcome(config: pytest.Config) -> dict[str, Any]:
    return config.stash.setdefault(_OUTCOME_KEY, _new_outcome())


def report_section(config: pytest.Config, title: str, lines: list[str]) -> None:
    """A section for the terminal summary; relayed to the controller under xdist."""
    _outcome(config)["sections"].append([title, list(lines)])


def require_exit(config: pytest.Config, code: int) -> None:
    """The session must exit with at least ``code`` (gate failed: 1, engine error: 3), whatever
    tests were selected and whatever they reported."""
    out = _outcome(config)
    out["exit"] = max(out["exit"], code)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """(xdist controller) collect a worker's gate outcome."""
    relayed = getattr(node, "workeroutput", {}).get("specparity")
    if not relayed:
        return
    out = _outcome(node.config)
    seen = out.setdefault("relayed_from", [])
    worker = node.gateway.id
    if worker not in seen:  # xdist may report a node down twice
        seen.append(worker)
        out["exit"] = max(out["exit"], relayed["exit"])
        out["sections"].extend(relayed["sections"])


_DESELECTED_KEY = pytest.StashKey[bool]()
#: The line an empty selection of gate tests ends with (exit 1: nothing judged is never a pass).
NOTHING_SELECTED = ("FAIL: nothing judged: the selection (-k, -m, node ids or --lf) left no gate test to run; "
                    "select at least one prompt (a run that judges nothing never passes)")


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Remember that gate tests were deselected, so an empty selection fails instead of pytest's 5."""
    for item in items:
        if active(item.config) and GATE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.config.stash[_DESELECTED_KEY] = True
            return


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if (not _is_worker(config) and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED
            and config.stash.get(_DESELECTED_KEY, False)):
        report_section(config, "specparity", [NOTHING_SELECTED])
        session.exitstatus = exitcodes.GATE_FAILED
        return
    out = config.stash.get(_OUTCOME_KEY, None)
    if out is None:
        return
    if _is_worker(config):
        config.workeroutput["specparity"] = out
        return
    if out["exit"] and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = max(int(session.exitstatus), out["exit"])


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _is_worker(config):
        return
    out = config.stash.get(_OUTCOME_KEY, None)
    for title, lines in (out or {}).get("sections", []):
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)


# --------------------------------------------------------------------------- the gate's session run


class SessionRun:
    """Holds the one gate run of a pytest session and its decision."""

    def __init__(self, run: Any, decision: Any, report_paths: list[Path]):
        self.run = run
        self.decision = decision
        self.report_paths = report_paths


def collected_prompt_ids(session: pytest.Session) -> set[str]:
    """Prompt ids whose tests were collected (``-k``/node ids), empty when none are parametrised."""
    return {
        item.callspec.params["lossless_prompt"].id
        for item in session.items
        if hasattr(item, "callspec") and "lossless_prompt" in item.callspec.params
    }


@pytest.fixture(scope="session")
def gate_session(request: pytest.FixtureRequest) -> SessionRun:
    from specparity.report.lines import terminal_lines
    from specparity.run.gate_command import RunRefused, SessionResult, execute

    config = request.config
    setup = gate_setup(config)
    wanted = collected_prompt_ids(request.session)
    prompts = [p for p in setup.prompts if p.id in wanted] if wanted else setup.prompts

    def show(result: SessionResult) -> None:
        report_section(config, "specparity", terminal_lines(result.run, result.decision)
                       + [f"report: {p}" for p in result.paths if p.exists()])
        require_exit(config, result.decision.exit_code)

    try:
        result = execute(setup, prompts, on_finish=show)
    except RunRefused as exc:
        pytest.exit(f"specparity: {exc}", returncode=exc.exit_code)
    return SessionRun(result.run, result.decision, result.paths)
