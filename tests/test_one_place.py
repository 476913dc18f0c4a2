"""One place for each list: engine names, live probes, the files the docs name.

* The CLI modules hold no list of built-in engine names: they read them from the registry
  (``specparity/engines/__init__.py``), so an engine added there shows up in every message.
* The probe suite runs one test per live probe of ``LIVE_PROBES``, and ``specparity probe`` runs them
  through the same table.
* Every ``golden/*.jsonl`` the package or the docs name exists, and the package, the README and
  the prompt and golden READMEs cite nothing a user cannot open.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from inprocess import run_pytest
from specparity.engines import BUILTIN, SERVER_ENGINES, engine_info, resolve_factory
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.probes import live

PACKAGE = REPO_ROOT / "specparity"


def test_server_engines_are_the_registrys_servers():
    servers = tuple(name for name in BUILTIN if engine_info(resolve_factory(name)).server)
    assert servers and SERVER_ENGINES == servers


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _engine_lists(path: Path) -> list[str]:
    """String constants (docstrings aside) naming two or more built-in server engines, and tuples or
    lists of two or more engine-name strings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    words = [re.compile(rf"\b{re.escape(name)}\b") for name in SERVER_ENGINES]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if sum(bool(w.search(node.value)) for w in words) >= 2:
                found.append(f"{path.name}:{node.lineno}: {node.value[:80]!r}")
        elif isinstance(node, (ast.Tuple, ast.List)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in BUILTIN]
            if len(names) >= 2:
                found.append(f"{path.name}:{node.lineno}: {names}")
    return found


def test_the_cli_reads_engine_names_from_the_registry():
    modules = sorted((PACKAGE / "cli").glob("*.py"))
    assert modules
    found = [hit for path in modules for hit in _engine_lists(path)]
    assert not found, "engine names written out in the CLI instead of read from specparity.engines:\n" + "\n".join(found)


#: Where an engine's name may be written: the registry, each engine's own modules (its adapter, its
#: descriptor, its build and conversion tooling and its ``specparity llamacpp`` command), the presets table, and the
#: probes, whose per-version engine facts are read from each engine's source.
OWN_MODULES = ("engines/__init__.py", "engines/server/presets.py", "cli/llamacpp.py")


def _own(path: Path) -> bool:
    rel = path.relative_to(PACKAGE).as_posix()
    engine_file = rel.startswith("engines/server/") and any(
        Path(rel).name.startswith(name) for name in SERVER_ENGINES)
    return rel in OWN_MODULES or rel.startswith("probes/") or engine_file


def _engine_branches(path: Path) -> list[str]:
    """Comparisons with a server engine's name (``engine == "sglang"``, ``name in ("vllm", ...)``); a command
    word in an argv list (``specparity llamacpp``) is not an engine."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [c.value for side in sides for c in ([side] if isinstance(side, ast.Constant) else
                                                         side.elts if isinstance(side, (ast.Tuple, ast.Set)) else [])
                     if isinstance(c, ast.Constant) and c.value in SERVER_ENGINES]
            if names:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_package_names_a_server_engine_only_in_its_own_modules():
    """What is engine-specific is the engine's (its descriptor): the generic code (arms, reproducers, the run,
    the report, the CLI) neither branches on an engine's name nor types out a list of engines."""
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if not _own(p)]
    assert len(modules) > 50
    found = [hit for path in modules for hit in (*_engine_branches(path), *_engine_lists(path))]
    assert not found, "engine names outside the engines' own modules:\n" + "\n".join(found)


def test_the_probe_suite_has_one_test_per_live_probe():
    code, out = run_pytest("suites/probes", "--collect-only", "-q", "--probe-engine", "sglang==0.5.19",
                           "--target", str(fixture_dir("target")), "--draft", str(fixture_dir("dflash2")))
    assert code == 0, out
    ids = {line.split("::", 1)[1] for line in out.splitlines() if "::test_live_probe[" in line}
    assert ids == {f"test_live_probe[{name}]" for name in live.LIVE_PROBES}, out


def test_run_live_runs_every_probe_of_the_table_and_leaves_out_what_the_settings_do(monkeypatch):
    ran = []
    table = {name: (lambda engine, settings, name=name: ran.append(name) or name) for name in live.LIVE_PROBES}
    table[live.STRESS] = lambda engine, settings: None  # left out
    monkeypatch.setattr(live, "LIVE_RUNNERS", table)
    assert live.run_live(object(), live.LiveSettings()) == [n for n in live.LIVE_PROBES if n != live.STRESS]
    assert ran == [n for n in live.LIVE_PROBES if n != live.STRESS]


def _texts(*globs: str) -> list[Path]:
    return sorted(p for g in globs for p in REPO_ROOT.glob(g) if p.is_file())


def test_every_golden_file_named_exists():
    """Any golden the package's messages name, and the project's own (``golden/dflash-*``) wherever
    the docs name them (``golden/mine.jsonl`` in an example is the reader's file)."""
    named = {(path, m.group(0)) for path in _texts("specparity/**/*.py")
             for m in re.finditer(r"golden/[\w.-]+\.jsonl", path.read_text(encoding="utf-8"))}
    named |= {(path, m.group(0)) for path in _texts("README.md", "docs/**/*.md")
              for m in re.finditer(r"golden/dflash-[\w.-]+\.jsonl", path.read_text(encoding="utf-8"))}
    assert named
    missing = sorted(f"{path.relative_to(REPO_ROOT)}: {name}" for path, name in named if not (REPO_ROOT / name).is_file())
    assert not missing, missing


#: Material a user cannot open, cited as if they could.
UNOPENABLE = re.compile(r"field[ -]reports?\b|shared/seeds|SPECPARITY_SEEDS|seed(?:s)? 00\d", re.IGNORECASE)


@pytest.mark.parametrize("glob", ["specparity/**/*.py", "README.md", "prompts/README.md", "golden/README.md"])
def test_no_citation_of_material_a_user_cannot_open(glob):
    hits = [f"{path.relative_to(REPO_ROOT)}:{i}: {line.strip()[:100]}"
            for path in _texts(glob) for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if UNOPENABLE.search(line)]
    assert not hits, hits
