"""Where the committed fixture models live, and a check that they are the ones the manifest names."""

from __future__ import annotations

import hashlib
from pathlib import Path

#: Repository root (the package is used from a checkout: ``pip install -e .``).
REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "fixtures"
MODELS = FIXTURES / "models"
MANIFEST = FIXTURES / "MANIFEST.sha256"


class FixtureError(RuntimeError):
    pass


def fixture_dir(name: str) -> Path:
    """``fixtures/models/<name>``; a clear error when it is missing (e.g. a non-editable install)."""
    path = MODELS / name
    if not (path / "config.json").is_file():
        raise FixtureError(
            f"{path}: fixture model {name!r} not found (expected config.json); run from a checkout "
            f"installed with `pip install -e .`, or rebuild with `python tools/build_fixtures.py`"
        )
    return path


def verify_manifest(manifest: Path = MANIFEST) -> list[str]:
    """Return one line per file whose sha256 differs from the manifest (empty: all good)."""
    problems = []
    for lineno, line in enumerate(manifest.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            digest, name = line.split(maxsplit=1)
        except ValueError:
            problems.append(f"{manifest}:{lineno}: expected '<sha256>  <path>'")
            continue
        path = manifest.parent / name.lstrip("*").strip()
        if not path.is_file():
            problems.append(f"{manifest}:{lineno}: {path} is missing")
            continue
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != digest:
            problems.append(f"{manifest}:{lineno}: {path}: sha256 {actual} != manifest {digest}")
    return problems
