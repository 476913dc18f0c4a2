"""pytest integration: command-line options, the per-prompt parametrisation, the session run.

The root ``conftest.py`` loads this plugin, so ``pytest suites/lossless --engine … --prompts …``
works from a checkout. The whole suite runs once per session (baselines first, so the near-tie
threshold is fixed before any speculative output is seen); each ``test_lossless[<prompt id>]``
then asserts its own prompt's verdict and ``test_gate_policy`` the run-level rules.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from specparity.engines.base import EngineOptions
from specparity.fixtures import REPO_ROOT
from specparity.gate import DEFAULT_MAX_NEAR_TIE, GateConfig, GateDecision, decide
from specparity.prompts import Prompt, PromptFileError, load_many

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"
DEFAULT_REPORT = "reports/lossless"
#: The embedded engine used when --engine is not given.
DEFAULT_ENGINE = "dflash"
_RUN_KEY = pytest.StashKey[Any]()
_PROMPTS_KEY = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("specparity", "specparity lossless gate")
    g.addoption("--engine", default=None, help="engine: dflash (default), hf, module:factory or path/to/file.py:factory "
                "(suites/probes: name==version, e.g. sglang==0.5.19)")
    g.addoption("--target", default=None, help="target model directory (default: the committed fixture)")
    g.addoption("--draft", default=None, help="draft model directory (default: the engine's fixture draft)")
    g.addoption("--spec-mode", default=None, help="speculative method inside the engine (dflash: dflash2, dflash1; hf: draft, prompt_lookup)")
    g.addoption("--num-draft-tokens", type=int, default=None, help="draft width / block size")
    g.addoption("--dtype", default="float32", help="in-process engines: float32, bfloat16, float16")
    g.addoption("--threads", type=int, default=1, help="torch threads for in-process engines (default 1)")
    g.addoption("--engine-opt", action="append", default=[], metavar="KEY=VALUE", help="extra engine option")
    g.addoption("--prompts", action="append", default=[], help="prompt JSONL file(s) (default prompts/default.jsonl)")
    g.addoption("--categories", default=None, help="comma-separated categories to run")
    g.addoption("--max-new-tokens", type=int, default=None, help="override every prompt's max_new_tokens")
    g.addoption("--near-tie-nats", type=float, default=None, help="near-tie threshold in nats (default: measured)")
    g.addoption("--max-near-tie", type=float, default=DEFAULT_MAX_NEAR_TIE, help="allowed fraction of near-tie prompts")
    g.addoption("--bit-exact", action="store_true", help="demand bit-exactness (same as pytest's --strict)")
    g.addoption("--require-all-paths", action="store_true", help="fail when a speculative path was never taken")
    g.addoption("--allow-unknown-activity", action="store_true",
                help="do not fail when the engine reports no draft counters")
    g.addoption("--top-k", type=int, default=8, help="alternatives recorded per position (>= 5)")
    g.addoption("--report", default=DEFAULT_REPORT, help=f"report directory (default {DEFAULT_REPORT})")
    try:
        from specparity.pytest_options import add_probe_options
    except ImportError:
        return
    add_probe_options(parser)


def _usage(msg: str) -> pytest.UsageError:
    return pytest.UsageError(f"specparity: {msg}")


def engine_options(config: pytest.Config) -> EngineOptions:
    extra: dict[str, str] = {}
    for item in config.getoption("engine_opt"):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _usage(f"--engine-opt {item!r}: expected KEY=VALUE")
        extra[key] = value
    return EngineOptions(
        target=config.getoption("target"),
        draft=config.getoption("draft"),
        spec_mode=config.getoption("spec_mode"),
        dtype=config.getoption("dtype"),
        num_draft_tokens=config.getoption("num_draft_tokens"),
        threads=config.getoption("threads"),
        extra=extra,
    )


def gate_config(config: pytest.Config) -> GateConfig:
    cats = config.getoption("categories")
    try:
        return GateConfig(
            prompts=[str(p) for p in (config.getoption("prompts") or [DEFAULT_PROMPTS])],
            categories=[c.strip() for c in cats.split(",") if c.strip()] if cats else None,
            max_new_tokens=config.getoption("max_new_tokens"),
            near_tie_nats=config.getoption("near_tie_nats"),
            max_near_tie=config.getoption("max_near_tie"),
            strict=bool(config.getoption("bit_exact") or config.getoption("strict", default=False)),
            report_dir=config.getoption("report") or None,
            top_k=config.getoption("top_k"),
            require_all_paths=config.getoption("require_all_paths"),
            allow_unknown_activity=config.getoption("allow_unknown_activity"),
        )
    except ValueError as exc:
        raise _usage(str(exc)) from None


def selected_prompts(config: pytest.Config) -> list[Prompt]:
    """Prompts for this session, loaded once at collection; a bad file is a usage error."""
    if _PROMPTS_KEY in config.stash:
        return config.stash[_PROMPTS_KEY]
    gc = gate_config(config)
    try:
        prompts = load_many(gc.prompts)
    except PromptFileError as exc:
        raise _usage(str(exc)) from None
    if gc.categories:
        known = {p.category for p in prompts}
        unknown = sorted(set(gc.categories) - known)
        if unknown:
            raise _usage(f"--categories: unknown {unknown}; the prompt files have {sorted(known)}")
        prompts = [p for p in prompts if p.category in gc.categories]
    config.stash[_PROMPTS_KEY] = prompts
    return prompts


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "lossless_prompt" in metafunc.fixturenames:
        prompts = selected_prompts(metafunc.config)
        metafunc.parametrize("lossless_prompt", prompts, ids=[p.id for p in prompts])


class SessionRun:
    """Holds the one gate run of a pytest session and its decision."""

    def __init__(self, run: Any, decision: GateDecision, report_paths: list[Path]):
        self.run = run
        self.decision = decision
        self.report_paths = report_paths


@pytest.fixture(scope="session")
def gate_session(request: pytest.FixtureRequest) -> SessionRun:
    from specparity.engines import EngineLoadError, load_engine
    from specparity.report import write_reports
    from specparity.runner import run_gate

    config = request.config
    gc = gate_config(config)
    prompts = selected_prompts(config)
    # Run only the prompts whose tests were collected (``-k``/node ids), or all of them.
    wanted = {
        item.callspec.params["lossless_prompt"].id
        for item in request.session.items
        if hasattr(item, "callspec") and "lossless_prompt" in item.callspec.params
    }
    if wanted:
        prompts = [p for p in prompts if p.id in wanted]
    engine_name = config.getoption("engine") or DEFAULT_ENGINE
    try:
        engine = load_engine(engine_name, engine_options(config))
    except (EngineLoadError, ValueError, OSError) as exc:
        pytest.fail(f"specparity: cannot load engine {engine_name!r}: {exc}", pytrace=False)
    try:
        run = run_gate(engine, prompts, gc)
    finally:
        engine.close()
    decision = decide(run, gc)
    paths: list[Path] = []
    if gc.report_dir:
        paths = [write_reports(run, decision, gc.report_dir), Path(gc.report_dir) / "results.jsonl"]
    session = SessionRun(run, decision, paths)
    config.stash[_RUN_KEY] = session
    return session


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    session = config.stash.get(_RUN_KEY, None)
    if session is None:
        return
    from specparity.report import terminal_lines

    terminalreporter.section("specparity")
    for line in terminal_lines(session.run, session.decision):
        terminalreporter.write_line(line)
    for p in session.report_paths:
        terminalreporter.write_line(f"report: {p}")
