"""Where the committed fixture models and the default prompt suites live, and a check that the
models are the ones the manifest names.

From a checkout (``pip install -e .``) everything is under the repository root. An installed wheel
carries no fixture models (a model directory is then always given: ``--target``) but does carry the
prompt suites: ``setup.py`` copies ``prompts/*.jsonl`` into ``specparity/_prompts/`` at build time,
and :func:`prompt_file` finds them in either place.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: Repository root when the package is used from a checkout (``pip install -e .``); in an installed
#: wheel this is ``site-packages``, where neither ``fixtures/`` nor ``prompts/`` exist.
REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = REPO_ROOT / "fixtures"
MODELS = FIXTURES / "models"
MANIFEST = FIXTURES / "MANIFEST.sha256"
#: The canonical prompt suites (documented in ``prompts/README.md``) ...
CHECKOUT_PROMPTS = REPO_ROOT / "prompts"
#: ... and their copy inside an installed wheel (written by ``setup.py`` at build time, never in the source tree).
PACKAGED_PROMPTS = Path(__file__).resolve().parents[1] / "_prompts"


class FixtureError(RuntimeError):
    pass


def in_checkout() -> bool:
    """Whether the package runs from a specparity checkout (the fixture manifest is beside it)."""
    return MANIFEST.is_file()


def fixture_dir(name: str) -> Path:
    """``fixtures/models/<name>``; a clear one-line error when it is missing."""
    path = MODELS / name
    if not (path / "config.json").is_file():
        if not in_checkout():
            raise FixtureError(
                f"fixture model {name!r} not available: the installed specparity package carries no fixture "
                "models (only a checkout has fixtures/models); give local model directories (--target DIR, --draft DIR)"
            )
        raise FixtureError(
            f"{path}: fixture model {name!r} not found (expected config.json); rebuild it with "
            "`python tools/build_fixtures.py`"
        )
    return path


#: The fingerprint note of a run on the committed fixture models (the documented demo).
FIXTURE_NOTE = "fixture models (the committed fixtures/models demo; give --target to gate your own model)"


def is_fixture_model(path: str | Path | None) -> bool:
    """Whether ``path`` is one of the committed fixture models (a directory under ``fixtures/models``)
    or its GGUF conversion in the cache (``<cache>/gguf/<manifest key>/``)."""
    if not path:
        return False
    p = Path(path).resolve()
    roots = [MODELS.resolve()]
    if in_checkout():
        from specparity.model.cache import user_cache_dir

        roots.append((user_cache_dir() / "gguf" / hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:16]).resolve())
    return any(p == r or r in p.parents for r in roots)


def fixture_note(path: str | Path | None) -> dict[str, str]:
    """``{"models": FIXTURE_NOTE}`` for a fingerprint's ``extra`` when ``path`` is a fixture, else ``{}``."""
    return {"models": FIXTURE_NOTE} if is_fixture_model(path) else {}


def prompt_file(name: str) -> Path:
    """A prompt suite shipped with specparity (``default.jsonl``, ``near_tie.jsonl``): ``prompts/<name>``
    in a checkout, else the copy an installed wheel carries."""
    checkout = CHECKOUT_PROMPTS / name
    return checkout if checkout.is_file() else PACKAGED_PROMPTS / name


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
