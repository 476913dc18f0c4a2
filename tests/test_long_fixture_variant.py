"""The 128K variant of the long-context fixture (``tools/build_long_fixture.py --max-position-embeddings``):
the committed model's weights, a larger declared context, and the ``long`` arm then sizes its prompts to
131072 tokens instead of 32768."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

from child_signals import default_sigint
from specparity.engines.server.arm_knobs import long_prompt_tokens
from specparity.model.arms import LONG_MAX_TOKENS, LONG_MIN_TOKENS
from specparity.model.locations import REPO_ROOT, fixture_dir


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tool(out, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "build_long_fixture.py"), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300, preexec_fn=default_sigint)


def _build(out, *args: str) -> None:
    proc = _tool(out, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_128k_variant_is_the_same_model_with_a_larger_context(tmp_path):
    """Against a build of the committed configuration made here (the bytes of a seeded build are this
    torch's on this CPU)."""
    out, default = tmp_path / "long-128k", tmp_path / "long"
    _build(out, "--max-position-embeddings", str(LONG_MAX_TOKENS + 512))
    _build(default)
    committed = fixture_dir("long")
    assert _sha(out / "model.safetensors") == _sha(default / "model.safetensors")
    assert json.loads((default / "config.json").read_text()) == json.loads((committed / "config.json").read_text())
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == LONG_MAX_TOKENS + 512
    assert long_prompt_tokens(str(committed)) == LONG_MIN_TOKENS
    assert long_prompt_tokens(str(out)) == LONG_MAX_TOKENS


def test_a_context_below_one_is_refused(tmp_path):
    proc = _tool(tmp_path / "x", "--max-position-embeddings", "0")
    assert proc.returncode == 2 and "--max-position-embeddings: expected a positive integer, got 0" in proc.stderr
    assert not (tmp_path / "x").exists()
