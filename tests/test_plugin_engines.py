"""Plugin engines as a third party writes them: a folder outside the repository, run by the gate
with no extra flags.

The plugin is a :class:`~specparity.engines.inprocess.loop.SpeculativeLoop` (prompt lookup, written
with :func:`~specparity.engines.base.step_record`) over a ``TorchTarget``, importing a helper
from the module beside it. The gate must pass it, hand it the fixture target and draft when
``--target`` / ``--draft`` are not given, and apply ``--threads`` before its factory runs.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from inprocess import run_pytest
from specparity.gate import exitcodes
from specparity.engines import build_engine, check_options, resolve_factory
from specparity.engines.base import EngineInfo, EngineOptions
from specparity.model.locations import REPO_ROOT, fixture_dir

HELPERS = '''
"""Beside mine.py: imported as a sibling module (the plugin's folder is put on sys.path)."""


def lookup_drafts(context, k, ngram=2):
    """Prompt lookup: the k tokens that followed the last earlier occurrence of the context's
    final n-gram (fewer near the end, none without a match)."""
    if k <= 0 or len(context) <= ngram:
        return []
    tail = context[-ngram:]
    for start in range(len(context) - ngram - 1, -1, -1):
        if context[start:start + ngram] == tail:
            return list(context[start + ngram:start + ngram + k])
    return []
'''

MINE = '''
"""A third party's engine: prompt lookup verified by the target, full recompute per step."""

import json
import os
from pathlib import Path

import torch

from helpers import lookup_drafts
from specparity.engines.base import EngineInfo, EngineOptions, engine_factory, step_record
from specparity.engines.inprocess.loop import InProcessEngine, LoopOutput, TorchTarget

WIDTH = 3


class MyLoop:
    name = "mine"

    def run(self, target: TorchTarget, req) -> LoopOutput:
        stops = set(req.stop_token_ids or target.stop_token_ids())
        model = target.model
        context = list(req.prompt_ids)
        logits = model(input_ids=torch.tensor([context])).logits[0, -1]  # prefill: not a verify step
        out, rows, steps = [int(logits.argmax())], [logits], []
        context.append(out[0])
        while len(out) < req.max_new_tokens and out[-1] not in stops:
            budget = req.max_new_tokens - len(out)
            drafts = lookup_drafts(context, min(WIDTH, budget - 1))  # drafts + bonus fit the limit
            verify = model(input_ids=torch.tensor([context + drafts])).logits[0, len(context) - 1:]
            argmax = verify.argmax(-1).tolist()
            n = 0
            while n < len(drafts) and drafts[n] == argmax[n]:
                n += 1
            new = drafts[:n] + [argmax[n]]  # accepted drafts + the target's own token
            for i, t in enumerate(new):
                if t in stops:
                    new = new[:i + 1]
                    break
            new = new[:budget]
            steps.append(step_record(drafts, new, nominal_width=WIDTH, budget_before=budget, stop_ids=stops))
            rows += [verify[i] for i in range(len(new))]  # the row that chose each token
            out += new
            context += new
        return LoopOutput(out, rows, steps, "mine.py (prompt lookup)")

    def spec_config(self):
        return {"mode": "prompt_lookup", "num_draft_tokens": WIDTH}

    def draft_artifact(self):
        return None


def _record(options):
    seen = {"target": options.target, "draft": options.draft, "threads": torch.get_num_threads()}
    Path(__file__).with_name("seen.json").write_text(json.dumps(seen))


@engine_factory(EngineInfo("mine", spec_modes=("prompt_lookup",)))
def create(options: EngineOptions) -> InProcessEngine:
    _record(options)
    return InProcessEngine(TorchTarget.from_options(options), MyLoop())


def undeclared(options):
    """No declaration: defaults and --threads still apply; raises after recording (nothing to run)."""
    _record(options)
    raise RuntimeError("recorded")
'''


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    folder = tmp_path / "myengine"
    folder.mkdir()
    (folder / "helpers.py").write_text(textwrap.dedent(HELPERS))
    (folder / "mine.py").write_text(textwrap.dedent(MINE))
    return folder


def gate(plugin: Path, *args: str) -> tuple[int, str]:
    """``pytest suites/lossless …`` from the repository root (no PYTHONPATH, no --target), as a nested
    session: its exit status and everything it printed. The plugin's modules are forgotten afterwards
    and torch's thread count restored, as when that run's process ends."""
    import torch

    threads = torch.get_num_threads()
    try:
        return run_pytest("suites/lossless", *args, env={"PYTHONPATH": None})
    finally:
        torch.set_num_threads(threads)
        for name, module in list(sys.modules.items()):
            if Path(getattr(module, "__file__", None) or "/").parent == plugin:
                del sys.modules[name]


def test_plugin_outside_the_repo_passes_the_gate_with_no_extra_flags(plugin, tmp_path):
    report = tmp_path / "r"
    code, out = gate(plugin, "--engine", f"{plugin / 'mine.py'}:create", "--categories", "repeat", "--calibration",
                     "selected", "--max-new-tokens", "24", "--report", str(report))
    assert code == exitcodes.PASS, out[-3000:]
    assert "specparity lossless gate: PASS" in out, out[-3000:]
    assert (report / "summary.md").read_text().startswith("# specparity lossless gate: PASS")
    seen = json.loads((plugin / "seen.json").read_text())
    assert seen == {"target": str(fixture_dir("target")), "draft": str(fixture_dir("draft")), "threads": 1}


def test_threads_and_defaults_reach_an_undeclared_plugin(plugin):
    code, out = gate(plugin, "--engine", f"{plugin / 'mine.py'}:undeclared", "--threads", "2", "--max-new-tokens", "4")
    assert code == exitcodes.ENGINE_ERROR and "recorded" in out, out[-3000:]
    seen = json.loads((plugin / "seen.json").read_text())
    assert seen == {"target": str(fixture_dir("target")), "draft": str(fixture_dir("draft")), "threads": 2}


# ---------------------------------------------------------------------------- defaults, in-process
def _checked(spec: str, **kw) -> EngineOptions:
    factory = resolve_factory(spec)
    return check_options(factory, EngineOptions(**kw), spec)


def _declared(info: EngineInfo | None):
    def factory(options):
        return options

    if info is not None:
        factory.engine_info = info
    return factory


@pytest.mark.parametrize("spec, kw, draft", [
    ("hf", {}, "draft"),
    ("hf", {"spec_mode": "prompt_lookup"}, "draft"),  # ignored by prompt lookup
    ("dflash", {}, "dflash2"),
    ("dflash", {"spec_mode": "dflash1"}, "dflash1"),
    ("dflash", {"spec_mode": "dflash2"}, "dflash2"),
    (f"{REPO_ROOT / 'tests' / 'broken_dflash.py'}:create", {"spec_mode": "dflash1"}, "dflash1"),
    (f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create", {}, "draft"),
])
def test_builtin_and_test_engines_get_the_draft_of_their_spec_mode(spec, kw, draft):
    opts = _checked(spec, **kw)
    assert opts.target == str(fixture_dir("target"))
    assert opts.draft == str(fixture_dir(draft))


def test_defaults_never_override_given_models_and_skip_servers():
    given = _checked("hf", target="/some/target", draft="/some/draft")
    assert (given.target, given.draft) == ("/some/target", "/some/draft")
    only_draft = check_options(_declared(None), EngineOptions(draft="/d"), "x")
    assert (only_draft.target, only_draft.draft) == (str(fixture_dir("target")), "/d")
    server = _declared(EngineInfo("srv", dtypes=(), local_models=False, server=True))
    opts = check_options(server, EngineOptions(), "srv")
    assert opts.target is None and opts.draft is None


def test_server_engines_never_import_torch_for_threads():
    """``build_engine`` pins threads for in-process engines only; a server factory runs torch-free."""
    code = textwrap.dedent('''
        import sys
        from specparity.engines import build_engine
        from specparity.engines.base import EngineInfo, EngineOptions, engine_factory

        class Fake:
            name = "fake"
            def __getattr__(self, attr):
                return lambda *a, **k: None

        @engine_factory(EngineInfo("srv", dtypes=(), local_models=False, server=True))
        def srv(options):
            return Fake()

        build_engine(srv, EngineOptions(threads=2), "srv")
        print("torch" in sys.modules)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


def test_threads_are_applied_before_an_in_process_factory_runs():
    import torch

    before = torch.get_num_threads()
    seen = {}

    def factory(options):
        seen["threads"] = torch.get_num_threads()
        raise RuntimeError("stop here")

    try:
        with pytest.raises(RuntimeError, match="stop here"):
            build_engine(factory, EngineOptions(threads=2), "x")
        assert seen["threads"] == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_the_collector_is_paused_while_a_factory_loads_and_restored_after(enabled):
    """``build_engine`` keeps Python's cyclic collector off while the factory imports and loads
    (a heap that only grows then), and leaves it as it found it, also when the factory raises."""
    seen = []

    def factory(options):
        seen.append(gc.isenabled())
        raise RuntimeError("stop here")

    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        with pytest.raises(RuntimeError, match="stop here"):
            build_engine(factory, EngineOptions(), "x")
        assert seen == [False]
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()
