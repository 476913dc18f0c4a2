"""Goldens: the format's checks (every way a golden can be wrong is one ``file:line`` line), atomic
writes, never a silent overwrite or a silent pass, and the two comparison modes run for real."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.run.golden import (
    GoldenError,
    Recorded,
    baseline_key,
    digest,
    load_golden,
    write_golden,
)
from specparity.run.journal import read_journal
from specparity.model.prompts import Prompt
from specparity.model.types import ArtifactId, Fingerprint, GenerationResult, SpecStats, TokenScores
from inprocess import run_pytest
from prompt_subsets import SHORT, first_of_categories

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
#
# On a few prompts of the default suite with a short token budget (tests/prompt_subsets.py): each
# step takes the same path through the gate as on the whole suite. The pytest gate runs (as a nested
# session in this process) where the test is about it (recording a golden, judging a broken loop
# against one); the other steps call `specparity run`, which takes the same options through the same
# runner.


def gate(*args: str) -> tuple[int, str]:
    """``pytest suites/lossless ARGS``: its exit status and everything it printed."""
    return run_pytest("-q", "suites/lossless", *args)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``specparity run ARGS`` in this process: its exit code and what it printed on stdout."""
    from specparity.cli import commands as cli

    code = cli.main(["run", *args])
    return code, capsys.readouterr().out


def kinds(report: Path) -> list[str]:
    return [json.loads(x)["kind"] for x in (report / "results.jsonl").read_text().splitlines()]


@dataclass(frozen=True)
class GoldenRun:
    """A golden recorded by the pytest gate for the math prompts of a small prompt file that holds
    other categories too (recorded for calibration only)."""

    prompts_file: Path
    prompts: list[Prompt]
    golden: Path
    options: tuple[str, ...]


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory) -> GoldenRun:
    root = tmp_path_factory.mktemp("golden-run")
    prompts_file = root / "prompts.jsonl"
    prompts = first_of_categories(prompts_file, {"math": 2, "code": 1})
    options = ("--prompts", str(prompts_file), "--categories", "math", *SHORT)
    golden = root / "golden" / "dflash.jsonl"
    code, out = gate(*options, "--golden", str(golden), "--update-golden", "--report", str(root / "r1"))
    assert code == exitcodes.PASS, out[-3000:]
    assert "recorded" in out and "from this run's baselines" in out
    return GoldenRun(prompts_file, prompts, golden, options)


@pytest.mark.slow
def test_record_then_compare_spec_runs(tmp_path, capsys, golden_run):
    options = golden_run.options
    code, out = run(capsys, *options, "--golden", str(tmp_path / "none" / "g.jsonl"), "--report", str(tmp_path / "r0"))
    assert code == exitcodes.GATE_FAILED
    assert "no golden recorded there (a missing golden is a failure, never a pass)" in out

    golden = tmp_path / "dflash.jsonl"  # the steps below rewrite it: a copy of the recorded one
    shutil.copyfile(golden_run.golden, golden)
    g = load_golden(golden)
    math = sum(p.category == "math" for p in golden_run.prompts)
    assert 0 < math < len(golden_run.prompts), "the prompt file holds prompts outside the selection"
    assert sorted(g.entries) == sorted(p.id for p in golden_run.prompts), \
        "the whole calibration set is recorded (the noise is measured on it)"

    # another speculative config against the same golden: no baseline decodes, same classes
    code, out = run(capsys, *options, "--golden", str(golden), "--num-draft-tokens", "4", "--report", str(tmp_path / "r2"))
    assert code == exitcodes.PASS, out[-3000:]
    assert "baseline" not in kinds(tmp_path / "r2") and "calibration" not in kinds(tmp_path / "r2")
    assert f"exact {math}," in out and "golden: baselines read from" in out

    # a dtype change is another baseline: refused in spec mode, never overwritten without force
    code, out = run(capsys, *options, "--golden", str(golden), "--dtype", "bfloat16", "--report", str(tmp_path / "r3"))
    assert code == exitcodes.GATE_FAILED
    assert "recorded under another engine fingerprint (dtype 'float32' → 'bfloat16')" in out
    before = golden.read_bytes()
    code, out = run(capsys, *options, "--golden", str(golden), "--dtype", "bfloat16", "--update-golden",
                    "--report", str(tmp_path / "r4"))
    assert code == exitcodes.GATE_FAILED and "pass --update-golden=force" in out
    assert golden.read_bytes() == before

    # an engine upgrade (here: fp32 → bf16) judged against the golden with the same classes
    code, out = run(capsys, *options, "--golden", str(golden), "--dtype", "bfloat16", "--golden-mode", "baseline",
                    "--report", str(tmp_path / "r5"))
    assert code == exitcodes.PASS, out[-3000:]
    journal = read_journal(tmp_path / "r5")
    assert journal.judged and all(line["baseline_from"] == "golden" for line in journal.judged.values())
    assert "golden: new baselines (no speculation) judged against" in out

    code, out = run(capsys, *options, "--golden", str(golden), "--dtype", "bfloat16", "--update-golden=force",
                    "--report", str(tmp_path / "r6"))
    assert code == exitcodes.PASS, out[-3000:]
    assert load_golden(golden).fields["dtype"] == "bfloat16"


@pytest.mark.slow
def test_broken_loop_against_golden_diverges(tmp_path, capsys):
    golden = tmp_path / "loop.jsonl"
    common = ("--categories", "math", *SHORT, "--engine", LOOPS, "--golden", str(golden), "--calibration", "selected")
    assert run(capsys, *common, "--update-golden", "--report", str(tmp_path / "r1"))[0] == exitcodes.PASS
    code, out = gate(*common, "--engine-opt", "bug=short_crop", "--report", str(tmp_path / "r2"))
    assert code == exitcodes.GATE_FAILED, out[-3000:]
    assert "diverged" in out and "baseline" not in kinds(tmp_path / "r2")


@pytest.mark.slow
def test_prompt_missing_from_golden_is_an_error(tmp_path, capsys, golden_run):
    # one more code prompt than the golden holds: that prompt is an error, the others are judged
    more = first_of_categories(tmp_path / "more.jsonl", {"math": 2, "code": 2})
    recorded_ids = set(load_golden(golden_run.golden).entries)
    absent = {p.id for p in more} - recorded_ids
    assert absent and absent < {p.id for p in more}
    code, out = run(capsys, "--prompts", str(tmp_path / "more.jsonl"), "--categories", "math,code", *SHORT,
                    "--calibration", "selected", "--golden", str(golden_run.golden), "--report", str(tmp_path / "r2"),
                    "--json")
    assert code == exitcodes.GATE_FAILED, out[-3000:]
    verdicts = {p["id"]: p for p in json.loads(out)["prompts"]}
    assert set(verdicts) == {p.id for p in more}
    assert {pid for pid, v in verdicts.items() if v["class"] == "error"} == absent
    assert all("no golden for this prompt" in verdicts[pid]["reason"] for pid in absent)
