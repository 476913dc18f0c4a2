"""A real tokenizer's library chatter stays off the console unless the run is verbose.

transformers logs "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer …" the first time a
BPE tokenizer whose config asks for that cleanup decodes (many published tokenizer configs do). The
fixture tokenizer with that one setting changed triggers it. Loaded the way the server engines load
it (:class:`specparity.engines.server.engine.HFTokenizer`), after the gate's library settings
(:func:`specparity.engines.libraries.configure_libraries`), nothing reaches stderr; verbose, the
line is there (so the config does trigger it). Then ``specparity run`` end to end, against the
llama.cpp emulator with that tokenizer encoding the prompts, without and with ``--verbose``. Each
case is a fresh child interpreter: transformers prints each such warning once per process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fakes import LlamaCppServer
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT, fixture_dir

#: The words of transformers' warning (``tokenization_utils_tokenizers.py``).
WARNING = "clean_up_tokenization_spaces"

LOAD_AND_DECODE = textwrap.dedent("""
    import sys
    from specparity.engines.libraries import configure_libraries
    configure_libraries(verbose=sys.argv[2] == "verbose")
    from specparity.engines.server.engine import HFTokenizer
    tok = HFTokenizer(sys.argv[1])
    ids = tok.tok.encode("Hello , world . How are you ?")
    print(repr(tok.tok.decode(ids)))
""")


@pytest.fixture(scope="module")
def cleanup_tokenizer(tmp_path_factory) -> Path:
    """The fixture target's tokenizer with ``clean_up_tokenization_spaces: true``."""
    out = tmp_path_factory.mktemp("tok")
    src = fixture_dir("target")
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    return out


def _child(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY", "PYTHONWARNINGS")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_the_server_engines_tokenizer_decodes_quietly(cleanup_tokenizer, verbose):
    proc = _child("-c", LOAD_AND_DECODE, str(cleanup_tokenizer), "verbose" if verbose else "quiet")
    assert proc.returncode == 0, proc.stderr
    assert "Hello" in proc.stdout
    if verbose:
        assert WARNING in proc.stderr, proc.stderr
    else:
        assert proc.stderr == "", proc.stderr


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_a_server_gate_run_prints_no_library_lines(cleanup_tokenizer, tmp_path, verbose):
    report = tmp_path / "report"
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        proc = _child("-m", "specparity.cli.commands", "run", "--engine", "llamacpp", "--baseline-url", base.url,
                      "--spec-url", spec.url, "--engine-opt", f"tokenizer={cleanup_tokenizer}", "--categories", "math",
                      "--max-new-tokens", "16", "--calibration", "selected", "--report", str(report),
                      *(["--verbose"] if verbose else []))
    assert proc.returncode == exitcodes.PASS, proc.stdout + proc.stderr
    assert (WARNING in proc.stderr) is verbose, proc.stderr
    if not verbose:
        assert proc.stderr == "", proc.stderr
