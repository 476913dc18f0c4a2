"""Goldens: the format's checks (every way a golden can be wrong is one ``file:line`` line), atomic
writes, never a silent overwrite or a silent pass, and the two comparison modes run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specparity import exitcodes
from specparity.fixtures import REPO_ROOT
from specparity.golden import (
    GoldenError,
    Recorded,
    baseline_key,
    digest,
    load_golden,
    write_golden,
)
from specparity.journal import read_journal
from specparity.prompts import Prompt
from specparity.types import ArtifactId, Fingerprint, GenerationResult, SpecStats, TokenScores

TESTS = REPO_ROOT / "tests"
LOOPS = f"{TESTS / 'broken_loops.py'}:create"


def fingerprint(dtype: str = "float32", **extra) -> Fingerprint:
    return Fingerprint("dflash", "dflash 0.1.0", ArtifactId("/m/target", "sha256:abc", "Qwen3ForCausalLM"),
                       ArtifactId("/m/draft", "sha256:def", "DFlash2DraftModel"), dtype, {"block_size": 8},
                       {"threads": 1, "baseline_urls": ["http://127.0.0.1:1"], **extra})


def scores(ids: list[int], k: int = 8) -> TokenScores:
    n = len(ids)
    top = np.stack([np.array([t] + [t + 1 + j for j in range(k - 1)]) for t in ids]) if n else np.zeros((0, k), int)
    lp = -np.arange(k, dtype=np.float32)[None, :].repeat(n, axis=0) * 0.5
    return TokenScores(ids, lp[:, 0] if n else [], top, lp)


def recorded(pid: str, ids: list[int]) -> Recorded:
    prompt = Prompt(pid, "math", "en", prompt=f"prompt {pid}")
    result = GenerationResult(pid, ids, "text", "length", scores(ids), SpecStats.unavailable("x"))
    return Recorded(prompt, [1, 2, 3], len(ids), result, scores(ids))


def write(path: Path, fp: Fingerprint | None = None) -> None:
    write_golden(path, fp or fingerprint(), [recorded("a-1", [5, 6, 7]), recorded("b-1", [9, 10])],
                 prompt_files=[], top_k=8)


def test_round_trip(tmp_path):
    path = tmp_path / "g.jsonl"
    write(path)
    g = load_golden(path)
    assert sorted(g.entries) == ["a-1", "b-1"]
    e = g.entries["a-1"]
    assert e.baseline.output_ids == [5, 6, 7] and e.prompt_ids == [1, 2, 3] and e.max_new_tokens == 3
    assert np.allclose(e.tf.top_logprobs, scores([5, 6, 7]).top_logprobs)
    assert g.key == baseline_key(fingerprint())
    assert g.entry_for(Prompt("a-1", "math", "en", prompt="prompt a-1")) is e
    assert g.entry_for(Prompt("a-1", "math", "en", prompt="edited")) is None, "same id, other prompt: no entry"
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_baseline_key_ignores_draft_spec_config_and_urls():
    a = fingerprint()
    b = Fingerprint(a.engine, a.engine_version, a.target, ArtifactId("/other", "sha256:999", "x"), a.dtype,
                    {"block_size": 4}, {"threads": 1, "baseline_urls": ["http://127.0.0.1:2"]})
    assert baseline_key(a) == baseline_key(b)
    assert baseline_key(a) != baseline_key(fingerprint("bfloat16"))
    assert baseline_key(a) != baseline_key(fingerprint(kv_cache_dtype="fp8_e4m3"))


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _rewrite(path: Path, lines: list[dict], *, reseal: bool) -> None:
    out = []
    for obj in lines:
        if reseal:
            obj = {k: v for k, v in obj.items() if k != "sha256"}
            obj["sha256"] = digest(obj)
        out.append(json.dumps(obj))
    path.write_text("\n".join(out) + "\n")


@pytest.mark.parametrize("edit, reseal, expected", [
    (lambda ls: ls[1]["output_ids"].__setitem__(0, 6), False, ":2: sha256: the line's content does not match its hash"),
    (lambda ls: ls[0]["baseline_fields"].__setitem__("dtype", "bfloat16"), False, ":1: sha256:"),
    (lambda ls: ls[1].pop("sha256"), False, ":2: sha256: missing"),
    (lambda ls: ls[1]["output_ids"].append(99), True, ":2: max_new_tokens: 3 for 4 output tokens"),
    (lambda ls: ls[1].__setitem__("max_new_tokens", 9) or ls[1]["output_ids"].append(9), True,
     ":2: scores: 3 rows for 4 output tokens"),
    (lambda ls: ls[1]["tf"].__setitem__("top_ids", ls[1]["tf"]["top_ids"][:1]), True, ":2: tf: expected top-k rows"),
    (lambda ls: ls[1].__setitem__("finish_reason", "eos"), True, ":2: finish_reason: expected one of stop, length"),
    (lambda ls: ls[2].__setitem__("prompt", ls[1]["prompt"]), True, ":3: prompt_sha256: does not match"),
    (lambda ls: ls.append(ls[1]), False, ":4: prompt.id: duplicate id 'a-1' (first recorded at line 2)"),
    (lambda ls: ls[1]["prompt"].pop("category"), True, ":2: category"),
    (lambda ls: ls[0]["baseline_fields"].__setitem__("dtype", "bfloat16"), True, ":1: baseline_key: not the hash"),
    (lambda ls: ls[1].__setitem__("output_ids", [5, 6, -7]), True, ":2: output_ids: expected a list of token ids"),
])
def test_hand_edits_fail_with_file_and_line(tmp_path, edit, reseal, expected):
    path = tmp_path / "g.jsonl"
    write(path)
    lines = _lines(path)
    edit(lines)
    _rewrite(path, lines, reseal=reseal)
    with pytest.raises(GoldenError) as err:
        load_golden(path)
    assert f"{path}{expected}" in str(err.value) if expected.startswith(":") else expected in str(err.value)


def test_truncated_golden(tmp_path):
    path = tmp_path / "g.jsonl"
    write(path)
    text = path.read_text()
    path.write_text(text[: len(text) - 40])
    with pytest.raises(GoldenError, match=r"g.jsonl:3: not JSON"):
        load_golden(path)


def test_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "g.jsonl"
    write(path)
    before = path.read_bytes()

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write(path, fingerprint("bfloat16"))
    assert path.read_bytes() == before, "a failed write leaves the old golden whole"
    assert [p.name for p in tmp_path.iterdir()] == ["g.jsonl"], "no temporary file is left behind"


def test_keep_merges_prompts_not_recorded_now(tmp_path):
    path = tmp_path / "g.jsonl"
    write(path)
    old = load_golden(path)
    n = write_golden(path, fingerprint(), [recorded("c-1", [1])], prompt_files=[], top_k=8, keep=old)
    assert n == 3 and sorted(load_golden(path).entries) == ["a-1", "b-1", "c-1"]


# --------------------------------------------------------------------------- end to end (real engines)


def gate(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "suites/lossless", "--categories", "math",
           *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(TESTS)}
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)


def kinds(report: Path) -> list[str]:
    return [json.loads(x)["kind"] for x in (report / "results.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_record_then_compare_spec_runs(tmp_path, default_prompts):
    golden = tmp_path / "golden" / "dflash.jsonl"
    missing = gate("--golden", str(golden), "--report", str(tmp_path / "r0"))
    assert missing.returncode == exitcodes.GATE_FAILED
    assert "no golden recorded there (a missing golden is a failure, never a pass)" in missing.stdout

    rec = gate("--golden", str(golden), "--update-golden", "--report", str(tmp_path / "r1"))
    assert rec.returncode == exitcodes.PASS, rec.stdout[-3000:]
    g = load_golden(golden)
    assert len(g.entries) == len(default_prompts), "the whole calibration set is recorded (the noise is measured on it)"

    # another speculative config against the same golden: no baseline decodes, same classes
    other = gate("--golden", str(golden), "--num-draft-tokens", "4", "--report", str(tmp_path / "r2"))
    assert other.returncode == exitcodes.PASS, other.stdout[-3000:]
    assert "baseline" not in kinds(tmp_path / "r2") and "calibration" not in kinds(tmp_path / "r2")
    math = sum(p.category == "math" for p in default_prompts)
    assert f"exact {math}," in other.stdout and "golden: baselines read from" in other.stdout

    # a dtype change is another baseline: refused in spec mode, never overwritten without force
    bf16 = gate("--golden", str(golden), "--dtype", "bfloat16", "--report", str(tmp_path / "r3"))
    assert bf16.returncode == exitcodes.GATE_FAILED
    assert "recorded under another engine fingerprint (dtype 'float32' → 'bfloat16')" in bf16.stdout
    before = golden.read_bytes()
    over = gate("--golden", str(golden), "--dtype", "bfloat16", "--update-golden", "--report", str(tmp_path / "r4"))
    assert over.returncode == exitcodes.GATE_FAILED and "pass --update-golden=force" in over.stdout
    assert golden.read_bytes() == before

    # an engine upgrade (here: fp32 → bf16) judged against the golden with the same classes
    upgrade = gate("--golden", str(golden), "--dtype", "bfloat16", "--golden-mode", "baseline",
                   "--report", str(tmp_path / "r5"))
    assert upgrade.returncode == exitcodes.PASS, upgrade.stdout[-3000:]
    journal = read_journal(tmp_path / "r5")
    assert all(line["baseline_from"] == "golden" for line in journal.judged.values())
    assert "golden: new baselines (no speculation) judged against" in upgrade.stdout

    forced = gate("--golden", str(golden), "--dtype", "bfloat16", "--update-golden=force", "--report", str(tmp_path / "r6"))
    assert forced.returncode == exitcodes.PASS
    assert load_golden(golden).fields["dtype"] == "bfloat16"


@pytest.mark.slow
def test_broken_loop_against_golden_diverges(tmp_path):
    golden = tmp_path / "loop.jsonl"
    common = ("--engine", LOOPS, "--golden", str(golden), "--calibration", "selected")
    assert gate(*common, "--update-golden", "--report", str(tmp_path / "r1")).returncode == exitcodes.PASS
    broken = gate(*common, "--engine-opt", "bug=short_crop", "--report", str(tmp_path / "r2"))
    assert broken.returncode == exitcodes.GATE_FAILED
    assert "diverged" in broken.stdout and "baseline" not in kinds(tmp_path / "r2")


@pytest.mark.slow
def test_prompt_missing_from_golden_is_an_error(tmp_path):
    golden = tmp_path / "g.jsonl"
    assert gate("--golden", str(golden), "--update-golden", "--calibration", "selected",
                "--report", str(tmp_path / "r1")).returncode == exitcodes.PASS
    # math is in the golden, code is not: the code prompts are errors, the math prompts are judged
    more = gate("--golden", str(golden), "--categories", "math,code", "--calibration", "selected",
                "--report", str(tmp_path / "r2"))
    assert more.returncode == exitcodes.GATE_FAILED, more.stdout[-3000:]
    assert "no golden for this prompt" in more.stdout
