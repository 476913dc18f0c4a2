"""The package's layers (docs/CONTRIBUTING.md): a module imports only from its own layer or lower ones.

Read from the source (every ``import``, at module level or inside a function), so a lazy import that
reaches upward fails here as plainly as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import specparity

PACKAGE = Path(specparity.__file__).parent
#: Lowest first. ``api`` (the public functions) and ``suite`` (the packaged gate suite) are faces.
LAYERS = ("model", "judge", "engines", "probes", "gate", "report", "run", "cli", "plugin", "api", "suite")


def layer_of(module: str) -> str:
    """``specparity.judge.compare`` -> ``judge``; ``specparity`` itself -> ``model`` (it holds nothing)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "model"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported specparity module) for every import in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("specparity"):
            if node.module == "specparity":
                out += [(node.lineno, f"specparity.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("specparity")]
    return out


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out.append((name, path))
    return out


def test_every_module_belongs_to_a_layer():
    strays = [name for name, _ in modules() if name != "specparity" and layer_of(name) not in LAYERS]
    assert not strays, f"modules outside the layers {LAYERS}: {strays}"


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_a_higher_layer(layer):
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for name, path in modules():
        if name == "specparity" or layer_of(name) != layer:
            continue
        for line, target in imports(path):
            if rank.get(layer_of(target), -1) > rank[layer]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {target}")
    assert not upward, "\n".join(upward)


def test_the_report_takes_from_the_judge_only_its_checks():
    """The report renders the checks the judge and the gate made (``specparity.judge.checks``); it
    imports no other judge module, so it cannot re-derive a verdict."""
    report = PACKAGE / "report"
    reached = sorted({f"{path.relative_to(PACKAGE.parent)}:{line}: {target}"
                      for path in report.rglob("*.py") for line, target in imports(path)
                      if layer_of(target) == "judge" and target != "specparity.judge.checks"})
    assert not reached, "\n".join(reached)
