"""Gating a server needs no torch: an engine team checking a remote SGLang, vLLM or llama.cpp server
installs specparity without it (torch is the ``specparity[torch]`` extra, for the in-process engines).

Each run is a child Python in which ``import torch`` fails (``sys.modules["torch"] = None``), so a
server engine that pulled torch in anywhere, at import or at run time, fails here. The llama.cpp fake
answers from captured bodies without torch too (:mod:`fakes.replay`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from fakes import LlamaCppServer
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT, fixture_dir

#: The child: torch cannot be imported (unless its first argument is ``--torch-installed``); after the
#: run it says whether any torch module got loaded.
CHILD = textwrap.dedent("""
    import sys
    if sys.argv[1:2] == ["--torch-installed"]:
        del sys.argv[1]
    else:
        sys.modules["torch"] = None
    from specparity.cli.commands import main
    code = main(sys.argv[1:])
    loaded = sorted(name for name, mod in sys.modules.items() if mod is not None and name.split(".")[0] == "torch")
    print("TORCH MODULES:", loaded)
    sys.exit(code)
""")


def run_child(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_server_gate_runs_without_torch(tmp_path: Path) -> None:
    report = tmp_path / "report"
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        proc = run_child("run", "--engine", "llamacpp", "--baseline-url", base.url, "--spec-url", spec.url,
                         "--engine-opt", f"tokenizer={fixture_dir('target')}", "--categories", "math",
                         "--max-new-tokens", "16", "--calibration", "selected", "--report", str(report))
    assert proc.returncode == exitcodes.PASS, proc.stdout + proc.stderr
    assert "TORCH MODULES: []" in proc.stdout
    assert (report / "summary.md").read_text().startswith("# specparity lossless gate: PASS")


def test_a_server_gate_never_imports_an_installed_torch(tmp_path: Path) -> None:
    """With torch installed too, gating the llama.cpp fixture demo (prompts encoded by the fixture's
    own tokenizer) loads none of it: nothing a server engine does needs torch, and importing it
    costs seconds at every start."""
    report = tmp_path / "report"
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        proc = run_child("--torch-installed", "run", "--engine", "llamacpp", "--baseline-url", base.url,
                         "--spec-url", spec.url, "--engine-opt", f"tokenizer={fixture_dir('target')}",
                         "--categories", "math", "--max-new-tokens", "16", "--calibration", "selected",
                         "--report", str(report))
    assert proc.returncode == exitcodes.PASS, proc.stdout + proc.stderr
    assert "TORCH MODULES: []" in proc.stdout


def test_an_in_process_engine_without_torch_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    proc = run_child("run", "--engine", "dflash", "--max-new-tokens", "4", "--report", str(tmp_path / "r"))
    assert proc.returncode == exitcodes.BAD_INPUT, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "needs torch" in lines[0] and "specparity[torch]" in lines[0], proc.stderr
    assert not (tmp_path / "r").exists()


def test_the_tokenizer_is_the_one_autotokenizer_picks(tmp_path: Path, default_prompts) -> None:
    """``load_tokenizer`` skips AutoTokenizer (and its torch import) only where AutoTokenizer would load
    the generic fast class anyway; a directory that names another class still gets that class."""
    from transformers import AutoTokenizer

    from specparity.engines.common import load_tokenizer
    from specparity.model.prompts import encode_prompt

    named = tmp_path / "named"
    shutil.copytree(fixture_dir("target"), named, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((named / "tokenizer_config.json").read_text())
    (named / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    for directory in (fixture_dir("target"), named):
        ours, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        assert type(ours) is type(auto), directory
        for p in default_prompts:
            assert encode_prompt(ours, p.prompt, p.messages_as_dicts()) == encode_prompt(auto, p.prompt, p.messages_as_dicts())
    assert type(load_tokenizer(named)).__name__ != type(load_tokenizer(fixture_dir("target"))).__name__
