"""Every module of the package compiles and imports without a warning, on every supported Python.

An invalid escape in a string or docstring (``"\\ "`` in a non-raw string) is a DeprecationWarning on
3.10 and 3.11, a SyntaxWarning printed at every import on 3.12 and 3.13, and an error in a later
Python. Compiling under ``warnings.simplefilter("error")`` turns either into an exception, so this
test fails on any supported version, not only on the ones that print it. Importing every module in
a child with ``-W error`` catches what compiling cannot (a warning raised while a module runs, or by
a library it imports).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import specparity

PACKAGE = Path(specparity.__file__).resolve().parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_modules():
    assert len(MODULES) > 1 and PACKAGE / "__init__.py" in MODULES


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_compiles_without_warnings(path: Path):
    source = path.read_text(encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            compile(source, str(path), "exec", dont_inherit=True)
        except (SyntaxError, SyntaxWarning, DeprecationWarning) as exc:
            pytest.fail(f"{path.relative_to(PACKAGE.parent)}: {type(exc).__name__}: {exc}", pytrace=False)


IMPORT_ALL = textwrap.dedent("""
    import importlib, sys
    names = sys.argv[1:]
    for name in names:
        importlib.import_module(name)
    print("imported", len(names))
""")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_imports_under_warnings_as_errors():
    """What importing runs (a warning at import time); compiling is :func:`test_compiles_without_warnings`'s
    (a cached .pyc of an unchanged module skips the compile-time warnings here)."""
    names = [_module_name(p) for p in MODULES]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run([sys.executable, "-W", "error", "-c", IMPORT_ALL, *names], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.strip() == f"imported {len(names)}"
