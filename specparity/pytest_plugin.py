"""pytest integration: command-line options, the per-prompt parametrisation, the session run.

The root ``conftest.py`` loads this plugin, so ``pytest suites/lossless --engine … --prompts …``
works from a checkout. Every option is checked once in ``pytest_configure``, before any model
loads: a bad one is a single ``ERROR: specparity: …`` line and exit code 4
(:mod:`specparity.exitcodes`). The whole suite runs once per session (baselines first, so the
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

import os
from pathlib import Path
from typing import Any

import pytest

from specparity import exitcodes
from specparity.options import (
    DEFAULT_ENGINE,
    DEFAULT_REPORT,
    BadInput,
    GateSetup,
    build_setup,
)
from specparity.noise import DEFAULT_CEILING_NATS
from specparity.records import DEFAULT_MAX_NEAR_TIE
from specparity.types import DEFAULT_TOP_K

_SETUP_KEY = pytest.StashKey[GateSetup]()
_OUTCOME_KEY = pytest.StashKey[dict]()
#: Options build_setup reads (pytest ``dest`` names).
_GATE_OPTIONS = (
    "engine", "target", "draft", "spec_mode", "num_draft_tokens", "dtype", "threads", "engine_opt", "prompts",
    "categories", "max_new_tokens", "near_tie_nats", "max_near_tie", "bit_exact", "allow_near_tie",
    "require_all_paths", "allow_unknown_activity", "top_k", "report", "baseline_url", "spec_url", "preset",
    "concurrency", "request_timeout", "scorer", "scorer_model", "near_tie_ceiling", "calibration", "drift_policy",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("specparity", "specparity lossless gate")
    g.addoption("--engine", default=None,
                help=f"engine: {DEFAULT_ENGINE} (default), hf, module:factory or path/to/file.py:factory")
    g.addoption("--target", default=None, help="target model directory (default: the committed fixture)")
    g.addoption("--draft", default=None, help="draft model directory (default: the engine's fixture draft)")
    g.addoption("--spec-mode", default=None, help="speculative method inside the engine (dflash: dflash2, dflash1; hf: draft, prompt_lookup)")
    g.addoption("--num-draft-tokens", default=None, help="draft width / block size (integer >= 1)")
    g.addoption("--dtype", default="float32", help="in-process engines: float32, bfloat16, float16")
    g.addoption("--threads", default=1, help="torch threads for in-process engines (default 1)")
    g.addoption("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                help="engine-specific option; unknown keys are refused, naming the ones the engine knows")
    g.addoption("--prompts", action="append", default=[], help="prompt JSONL file(s) (default prompts/default.jsonl)")
    g.addoption("--categories", default=None, help="comma-separated categories to run")
    g.addoption("--max-new-tokens", default=None, help="override every prompt's max_new_tokens")
    g.addoption("--near-tie-nats", default=None, help="near-tie threshold in nats (default: measured)")
    g.addoption("--max-near-tie", default=DEFAULT_MAX_NEAR_TIE, help="allowed fraction of near-tie prompts")
    g.addoption("--bit-exact", action="store_true", help="demand bit-exactness: a near-tie flip fails (the default "
                "when the engine declares deterministic / batch-invariant inference for both sides)")
    g.addoption("--allow-near-tie", action="store_true", help="allow near ties up to --max-near-tie even when the "
                "engine declares deterministic inference (which otherwise makes the gate bit-exact)")
    g.addoption("--require-all-paths", nargs="?", const=1, default=0, metavar="N",
                help="fail when a speculative path is taken on fewer than N prompts (N defaults to 1)")
    g.addoption("--near-tie-ceiling", default=None, metavar="NATS",
                help=f"refuse a measured near-tie threshold above this (default {DEFAULT_CEILING_NATS:g} nats)")
    g.addoption("--calibration", default="suite", metavar="SET",
                help="what the noise is measured on: suite (every prompt of the prompt files, default), "
                "selected (only the prompts that run), or a prompt file")
    g.addoption("--drift-policy", default="fail", help="a drifted prompt (identical tokens, rows beyond the "
                "noise): fail (default) or warn")
    g.addoption("--allow-unknown-activity", action="store_true",
                help="do not fail when the engine reports no draft counters")
    g.addoption("--top-k", default=DEFAULT_TOP_K, help="alternatives recorded per position (>= 5)")
    g.addoption("--report", default=DEFAULT_REPORT, help=f"report directory (default {DEFAULT_REPORT}; '' for none)")
    s = parser.getgroup("specparity servers", "specparity: engines behind HTTP (llamacpp, sglang, vllm)")
    s.addoption("--baseline-url", action="append", default=[], metavar="URL",
                help="a running server without speculation (repeatable: several shard the prompts)")
    s.addoption("--spec-url", action="append", default=[], metavar="URL",
                help="a running server with speculation (repeatable)")
    s.addoption("--preset", default=None, help="a named launch configuration to start both servers "
                "(specparity.engines.presets; llamacpp default: llamacpp-draft-simple)")
    s.addoption("--concurrency", default=None, help="requests in flight per phase (default: what the engine serves)")
    s.addoption("--request-timeout", default=None, help="seconds one request may take (default 300)")
    s.addoption("--scorer", default="auto", help="teacher-forced scorer: auto, engine, embedded")
    s.addoption("--scorer-model", default=None, help="HF model directory for --scorer embedded")
    from specparity.pytest_options import add_probe_options

    add_probe_options(parser)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def gate_setup(config: pytest.Config) -> GateSetup:
    """The validated options of this session (built in ``pytest_configure``)."""
    return config.stash[_SETUP_KEY]


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raw = {name: config.getoption(name) for name in _GATE_OPTIONS}
    # A report directory the user named is created and proven writable now; the default one when
    # the run starts (so `pytest tests/` does not create it).
    check_report = bool(raw["report"]) and raw["report"] != DEFAULT_REPORT and not _is_worker(config)
    try:
        config.stash[_SETUP_KEY] = build_setup(raw, check_report=check_report)
    except BadInput as exc:
        raise pytest.UsageError(f"specparity: {exc}") from None
    _configure_xdist(config)


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
    if "lossless_prompt" in metafunc.fixturenames:
        prompts = gate_setup(metafunc.config).prompts
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
    out = _outcome(node.config)
    seen = out.setdefault("relayed_from", [])
    worker = node.gateway.id
    if relayed and worker not in seen:  # xdist may report a node down twice
        seen.append(worker)
        out["exit"] = max(out["exit"], relayed["exit"])
        out["sections"].extend(relayed["sections"])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
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


def load_session_engine(config: pytest.Config) -> Any:
    """Build the engine from the validated setup; a failure is an engine error (exit 3), not a gate
    verdict."""
    from specparity.engines import build_engine

    setup = gate_setup(config)
    try:
        return build_engine(setup.factory, setup.engine_options, setup.engine_spec)
    except Exception as exc:  # noqa: BLE001 - any load failure: one line, exit code 3, nothing to gate
        pytest.exit(f"specparity: cannot load engine {setup.engine_spec!r}: {type(exc).__name__}: {exc}",
                    returncode=exitcodes.ENGINE_ERROR)


@pytest.fixture(scope="session")
def gate_session(request: pytest.FixtureRequest) -> SessionRun:
    from specparity.report import terminal_lines
    from specparity.runner import JOURNAL, GateInterrupted, conclude, run_gate

    config = request.config
    setup = gate_setup(config)
    gc = setup.config
    wanted = collected_prompt_ids(request.session)
    prompts = [p for p in setup.prompts if p.id in wanted] if wanted else setup.prompts
    engine = load_session_engine(config)

    def finish(run: Any) -> SessionRun:
        decision = conclude(run)
        paths = [Path(gc.report_dir) / "summary.md", Path(gc.report_dir) / JOURNAL] if gc.report_dir else []
        report_section(config, "specparity",
                       terminal_lines(run, decision) + [f"report: {p}" for p in paths])
        require_exit(config, decision.exit_code)
        return SessionRun(run, decision, paths)

    try:
        run = run_gate(engine, prompts, gc, calibration=setup.calibration)
    except GateInterrupted as stopped:
        finish(stopped.run)
        raise
    finally:
        engine.close()
    return finish(run)
