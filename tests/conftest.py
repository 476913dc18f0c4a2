"""Shared fixtures for the harness's own tests: the committed models and small prompt subsets."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specparity.engines.base import EngineOptions  # noqa: E402
from specparity.model.locations import REPO_ROOT, fixture_dir  # noqa: E402
from specparity.model.prompts import Prompt, load_prompts  # noqa: E402

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"


@pytest.fixture(scope="session")
def default_prompts() -> list[Prompt]:
    return load_prompts(DEFAULT_PROMPTS).prompts


@pytest.fixture(scope="session")
def hf_options() -> EngineOptions:
    return EngineOptions(target=str(fixture_dir("target")), draft=str(fixture_dir("draft")), spec_mode="draft")


def _cost_rank(item: pytest.Item) -> int:
    """0 for the project's own suites (each is one session-long gate run), 1 for tests marked
    ``slow``, 2 for the rest."""
    if "suites" in item.path.parts:
        return 0
    return 1 if item.get_closest_marker("slow") else 2


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown to a session run with -p no:xdist
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker more than the CPUs this process may run on. About a fifth of the suite's
    test time is spent waiting (servers starting and stopping, the fakes' batch windows, timeouts
    being shown to fire), which one more worker fills: on the 2-core machine three workers finished the
    suite in 219 s where two took 235 s (docs/PERFORMANCE.md). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still
    decides where it is set (pytest-xdist reads it)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus + 1


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, hand the files out in the order :func:`pytest_collection_modifyitems`
    leaves them: xdist's default for scoped distribution reorders them by their number of tests,
    which sends a file of one long test (the fp8 flips) last."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long runs first (a stable sort: each file keeps its own order). Under pytest-xdist the files
    are handed to the workers in this order (``--dist loadfile``), so a long file never starts last
    and keeps one worker busy after the other has finished. A file ranks by its costliest test and
    stays in one piece."""
    rank: dict[object, int] = {}
    for item in items:
        rank[item.path] = min(rank.get(item.path, 2), _cost_rank(item))
    items.sort(key=lambda item: rank[item.path])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Take everything imported and collected so far out of the cyclic garbage collector's sight.

    Each full collection otherwise walks all of it again, whether Python starts it or pytest does
    (twice at the end of every nested session, tests/inprocess.py): about 0.15 s each time, a third
    of a one-prompt gate run in this process. The model code every in-process engine imports at its
    first load (the fixture target's architecture in transformers, as ``AutoModelForCausalLM`` resolves
    it: for its Qwen3, with torch's compiler stack and sympy, about a thousand modules) is imported
    first, so that it is frozen too rather than walked by every later collection: that cut the
    collector's time in the engine-heavy test files from 5.0 s to 1.6 s (docs/PERFORMANCE.md).
    Objects made later are collected as usual. Without torch (the torch-free runs of ``.ci/run``)
    there is no model code to import."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    if importlib.util.find_spec("torch") is not None:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(fixture_dir("target")), local_files_only=True))]
    gc.collect()
    gc.freeze()
