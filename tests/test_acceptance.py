"""Acceptance regression (``specparity compare``) and cross-implementation parity (``specparity
parity``), on real runs of the hf engine over the fixture target.

The regression is a *lossless* one: the fixture draft with seeded noise added to its weights
proposes worse tokens, the target still decides every token, so the gate passes it exact — only
acceptance falls. ``compare`` must catch that beyond its interval (exit 1), and must not fail on a
slighter perturbation whose drop stays within the prompts' spread.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specparity.gate import exitcodes
from specparity.judge.acceptance import (AcceptanceSet, PromptAcceptance, compare_runs, lines, paired_interval,
                                   positions_of, wilson)
from specparity.judge.artefacts import recites_prompt, repetition_loop
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.gate.decision import judge_acceptance
from specparity.model.types import SpecStats, StepRecord
from prompt_subsets import first_of_categories

#: Relative scale of the seeded noise added to every draft weight: one that lowers acceptance well
#: beyond the prompts' spread, one whose effect stays within it (measured: docs/ACCEPTANCE.md).
WORSE, SLIGHT = 0.3, 0.1
TOKENS = ("--max-new-tokens", "24")
COMMITTED = REPO_ROOT / "golden" / "dflash-float32.jsonl"


def perturbed_draft(dst: Path, scale: float) -> Path:
    """The fixture draft with seeded Gaussian noise of ``scale`` × each tensor's spread added."""
    import torch
    from safetensors.torch import load_file, save_file

    src = fixture_dir("draft")
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    noisy = {k: (v + scale * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
             if v.is_floating_point() and v.numel() > 1 else v for k, v in weights.items()}
    save_file(noisy, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    from specparity.cli import commands as cli

    code = cli.main(list(args))
    return code, capsys.readouterr().out


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``specparity ARGS`` in this process: its exit code and its one-line refusal on stderr."""
    from specparity.cli import commands as cli

    code = cli.main(list(args))
    return code, capsys.readouterr().err


# --------------------------------------------------------------------------- pure parts


def test_repetition_loop_and_recited_prompt_are_flagged_and_plain_text_is_not():
    assert repetition_loop([5, 6, 7] * 6) and "period 3" in repetition_loop([5, 6, 7] * 6)
    assert repetition_loop(list(range(10)) + [1, 2] * 6)  # a loop over the last half
    assert repetition_loop(list(range(24))) is None
    assert repetition_loop([1, 2, 3, 4] + [9, 9, 9]) is None  # too short to be a loop
    prompt = list(range(100, 140))
    assert recites_prompt(prompt, prompt[5:25])
    assert recites_prompt(prompt, list(range(20))) is None
    assert recites_prompt(prompt, prompt[0:8] + list(range(30))) is None  # one span, not most of the output


def test_positions_come_from_the_step_records_and_totals_only_say_unknown():
    steps = [StepRecord(4, 4, 5), StepRecord(4, 1, 2), StepRecord(2, 0, 1, "limit")]
    assert positions_of(SpecStats.from_steps(steps, "test")) == [(3, 2), (3, 1), (2, 1), (2, 1)]
    assert positions_of(SpecStats(True, proposed=10, accepted=5, verify_steps=3)) is None


def test_interval_is_seeded_and_wilson_bounds_the_rate():
    old = [(5, 1), (9, 2), (4, 1), (12, 3), (7, 2)]
    new = [(4, 1), (8, 2), (3, 1), (10, 3), (6, 2)]
    first = paired_interval(old, new)
    assert first == paired_interval(old, new)
    assert first[0] <= first[1] < 0
    assert paired_interval(old[:1], new[:1]) is None
    lo, hi = wilson(8, 10)
    assert lo < 0.8 < hi and wilson(0, 0) is None


def _set(label: str, values: dict[str, tuple[int, int]], category: str = "c") -> AcceptanceSet:
    return AcceptanceSet(label, {pid: PromptAcceptance(pid, category, 4 * s, e - s, s, e) for pid, (e, s) in
                                 values.items()})


def test_noise_level_differences_do_not_fail_and_a_consistent_drop_does():
    import random

    rnd = random.Random(1)
    old = {f"p{i}": (rnd.randint(20, 40), 8) for i in range(12)}
    jitter = {pid: (e + rnd.choice((-2, -1, 0, 1, 2)), s) for pid, (e, s) in old.items()}
    drop = {pid: (e - 6, s) for pid, (e, s) in old.items()}
    calm = judge_acceptance(compare_runs(_set("a", old), _set("b", jitter)), max_drop=0.25)
    assert not calm.failures, calm.rows
    bad = judge_acceptance(compare_runs(_set("a", old), _set("b", drop)), max_drop=0.25)
    assert [r.category for r in bad.decided_on if r.failed] == ["c", "all"], bad.failures
    text = "\n".join(lines(bad))
    assert "no prompt flagged" in text and text.count("**beyond**") == 2
    lenient = judge_acceptance(compare_runs(_set("a", old), _set("b", drop)), max_drop=1.0)
    assert not lenient.failures  # a drop of 0.75 tokens is within max_accept_drop 1


def test_missing_acceptance_is_not_recorded_and_fails_nothing():
    c = judge_acceptance(compare_runs(AcceptanceSet("old", missing="baselines only"), _set("b", {"p": (9, 2)})),
                         max_drop=0.25)
    assert c.not_recorded and "not recorded" in c.not_recorded and not c.failures


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three gate runs of the hf engine on a few prompts: the fixture draft (recording a golden
    with its acceptance), a much worse and a slightly worse copy of it. The exit codes and where
    the journals are."""
    from specparity.cli import commands as cli

    tmp = tmp_path_factory.mktemp("acceptance")
    prompts = tmp / "prompts.jsonl"
    first_of_categories(prompts, {"code": 3, "math": 3, "logic": 2, "summary": 2, "repeat": 2})
    common = ("run", "--engine", "hf", "--prompts", str(prompts), "--calibration", "selected", *TOKENS)
    out = {"dir": tmp, "prompts": prompts, "golden": tmp / "golden.jsonl"}
    out["old_rc"] = cli.main([*common, "--report", str(tmp / "old"), "--golden", str(out["golden"]),
                              "--update-golden"])
    for name, scale in (("worse", WORSE), ("slight", SLIGHT)):
        draft = perturbed_draft(tmp / f"draft-{name}", scale)
        out[f"{name}_rc"] = cli.main([*common, "--draft", str(draft), "--report", str(tmp / name)])
    # the same fixture draft under a second implementation: the hand-written loop of tests/broken_loops.py
    loop = ("--engine", f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create")
    out["loop_rc"] = cli.main([*common, *loop, "--report", str(tmp / "loop")])
    return out


def test_a_worse_draft_passes_the_gate_and_fails_compare(runs, capsys):
    assert runs["old_rc"] == runs["worse_rc"] == exitcodes.PASS  # lossless: every prompt exact
    code, out = main(capsys, "compare", str(runs["dir"] / "old"), str(runs["dir"] / "worse"), "--json")
    data = json.loads(out)
    assert code == exitcodes.GATE_FAILED, data["failures"]
    assert data["counts"]["exact"] == len(data["prompts"])  # the streams are identical: only acceptance fell
    overall = data["acceptance"]["without_flagged"][-1] if data["acceptance"]["without_flagged"] else \
        data["acceptance"]["rows"][-1]
    assert overall["category"] == "all" and overall["failed"] and overall["high"] < 0
    assert any(f.startswith("acceptance all:") for f in data["failures"])
    assert data["acceptance"]["positions"], "the hf engine reports per-step records"
    report = runs["dir"] / "compare-report"
    code, text = main(capsys, "compare", str(runs["dir"] / "old"), str(runs["dir"] / "worse"), "--report", str(report))
    assert code == exitcodes.GATE_FAILED and "rule: FAIL when NEW is more than max_accept_drop 0.25" in text
    assert "per draft position" in text and "**beyond**" in text
    assert "**beyond**" in (report / "acceptance.md").read_text(encoding="utf-8")
    assert "FAIL: acceptance all:" in text and "acceptance all:" in (report / "summary.md").read_text(encoding="utf-8")


def test_a_slight_perturbation_within_the_spread_passes(runs, capsys):
    assert runs["slight_rc"] == exitcodes.PASS
    code, out = main(capsys, "compare", str(runs["dir"] / "old"), str(runs["dir"] / "slight"), "--json")
    data = json.loads(out)
    assert code == exitcodes.PASS, data["failures"]
    assert not data["acceptance"]["failures"] and data["acceptance"]["rows"][-1]["category"] == "all"
    # the same journal on both sides: no difference at all
    code, out = main(capsys, "compare", str(runs["dir"] / "old"), str(runs["dir"] / "old"), "--json")
    assert code == exitcodes.PASS and json.loads(out)["acceptance"]["rows"][-1]["delta"] == 0


def test_the_golden_keeps_acceptance_and_an_old_golden_says_not_recorded(runs, capsys, tmp_path):
    from specparity.run.golden import digest

    code, out = main(capsys, "compare", str(runs["golden"]), str(runs["dir"] / "worse"), "--json")
    assert code == exitcodes.GATE_FAILED and json.loads(out)["acceptance"]["failures"]
    # the same golden as a version without the field wrote it: the streams are judged, acceptance is not
    stripped = []
    for line in runs["golden"].read_text(encoding="utf-8").splitlines():
        obj = {k: v for k, v in json.loads(line).items() if k not in ("sha256", "acceptance")}
        stripped.append(json.dumps({**obj, "sha256": digest(obj)}, ensure_ascii=False))
    assert len(stripped) > 1 and "acceptance" in runs["golden"].read_text(encoding="utf-8")
    old = tmp_path / "old-golden.jsonl"
    old.write_text("\n".join(stripped) + "\n", encoding="utf-8")
    code, out = main(capsys, "compare", str(old), str(runs["dir"] / "worse"))
    assert code == exitcodes.PASS, out[-3000:]
    assert "acceptance: acceptance not recorded" in out
    # a policy that names max_accept_drop asks for the check: a comparison that cannot make it fails
    policy = tmp_path / "policy.toml"
    policy.write_text("[gate]\nmax_accept_drop = 0.25\n", encoding="utf-8")
    code, out = main(capsys, "compare", str(old), str(runs["dir"] / "worse"), "--policy", str(policy), "--json")
    data = json.loads(out)
    assert code == exitcodes.GATE_FAILED, data["failures"]
    assert data["counts"]["exact"] == len(data["prompts"])  # the streams pass: only the unchecked rule fails
    assert data["failures"] == [
        f"acceptance not recorded — golden {old}: the golden has no acceptance (recorded before it was kept, or by "
        f"specparity record --baselines-only, which does not speculate): the policy {policy}:2 names "
        "max_accept_drop 0.25, and a comparison that cannot check it fails (record the golden with `specparity "
        "record`, which keeps the speculative run's acceptance, or compare journals of speculative runs whose "
        "engine counts per request)"]
    code, out = main(capsys, "compare", str(old), str(runs["dir"] / "worse"), "--max-accept-drop", "1")
    assert code == exitcodes.GATE_FAILED and "--max-accept-drop names max_accept_drop 1, and a comparison" in out


def test_the_documented_flow_record_then_compare_fails_on_an_acceptance_drop(runs, capsys, tmp_path):
    """README's CI flow: `specparity record --golden G` once, a later run, `specparity compare G RUN`.
    The recorded golden keeps the speculative run's acceptance, so a lossless but much worse draft
    fails the comparison on acceptance alone."""
    from specparity.run.golden import load_golden

    golden = tmp_path / "recorded.jsonl"
    code, out = main(capsys, "record", "--engine", "hf", "--prompts", str(runs["prompts"]), "--calibration",
                     "selected", *TOKENS, "--golden", str(golden), "--report", "", "--json")
    doc = json.loads(out)
    assert code == exitcodes.PASS, doc
    entries = load_golden(golden).entries
    assert doc["acceptance"] == f"recorded for {len(entries)} of {len(entries)} prompt(s) (the speculative run's " \
                                "per-request counters)"
    assert all(e.spec is not None and e.spec.available for e in entries.values())
    code, out = main(capsys, "compare", str(golden), str(runs["dir"] / "worse"), "--json")
    data = json.loads(out)
    assert code == exitcodes.GATE_FAILED, data["failures"]
    assert data["counts"]["exact"] == len(data["prompts"])  # lossless: acceptance alone fails it
    assert any(f.startswith("acceptance all:") for f in data["failures"]), data["failures"]
    # the same flow recorded without acceptance says so, and cannot fail on it
    bare = tmp_path / "bare.jsonl"
    code, out = main(capsys, "record", "--engine", "hf", "--prompts", str(runs["prompts"]), "--calibration",
                     "selected", *TOKENS, "--golden", str(bare), "--report", "", "--baselines-only")
    assert code == exitcodes.PASS and "acceptance: not recorded (--baselines-only)" in out
    assert all(e.spec is None for e in load_golden(bare).entries.values())
    code, out = main(capsys, "compare", str(bare), str(runs["dir"] / "worse"))
    assert code == exitcodes.PASS and "acceptance: acceptance not recorded" in out


def test_policy_file_and_flag_set_the_allowed_drop(runs, capsys, tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("[gate]\nmax_accept_drop = 10\n", encoding="utf-8")
    old, worse = str(runs["dir"] / "old"), str(runs["dir"] / "worse")
    assert main(capsys, "compare", old, worse, "--policy", str(policy))[0] == exitcodes.PASS
    assert main(capsys, "compare", old, worse, "--policy", str(policy), "--max-accept-drop", "0.25")[0] == \
        exitcodes.GATE_FAILED
    policy.write_text("[gate]\nmax_near_tie = 0.25\nmax_accept_drop = -1\n", encoding="utf-8")
    code, err = refused(capsys, "compare", old, worse, "--policy", str(policy))
    assert code == exitcodes.BAD_INPUT and f"{policy}:3: max_accept_drop: expected a number >= 0" in err
    code, err = refused(capsys, "compare", old, worse, "--max-accept-drop", "-1")
    assert code == exitcodes.BAD_INPUT and err.strip() == \
        "specparity: error: --max-accept-drop: expected a number >= 0 (tokens per verify step), got '-1'"


def test_totals_only_journal_says_positions_unknown(runs, capsys, tmp_path):
    src = runs["dir"] / "slight" / "results.jsonl"
    edited = []
    for line in src.read_text(encoding="utf-8").splitlines():
        obj = json.loads(line)
        if obj["kind"] == "prompt" and obj.get("spec"):
            obj["spec"]["spec"].pop("steps", None)
        edited.append(json.dumps(obj))
    (tmp_path / "results.jsonl").write_text("\n".join(edited) + "\n", encoding="utf-8")
    code, out = main(capsys, "compare", str(runs["dir"] / "old"), str(tmp_path))
    assert code == exitcodes.PASS, out[-2000:]
    assert "positions unknown for journal" in out and "(the engine reports totals only)" in out


def test_parity_command(runs, capsys):
    old, worse, slight = (str(runs["dir"] / n) for n in ("old", "worse", "slight"))
    code, out = main(capsys, "parity", old, slight)
    assert code == exitcodes.PASS and out.startswith("specparity parity: PASS"), out
    code, out = main(capsys, "parity", old, worse, "--json")
    data = json.loads(out)
    assert code == exitcodes.GATE_FAILED and data["status"] == "FAIL" and data["metric"] == "acceptance_rate"
    assert any(f.startswith("acceptance all:") for f in data["failures"])
    assert main(capsys, "parity", old, worse, "--tolerance", "1")[0] == exitcodes.PASS
    code, err = refused(capsys, "parity", old, worse, "--tolerance", "2")
    assert code == exitcodes.BAD_INPUT and err.startswith("specparity: error: --tolerance: expected a difference")


def test_the_same_draft_under_two_implementations_agrees(runs, capsys):
    """transformers' assisted generation (hf) and a hand-written draft-and-verify loop run the same
    draft: parity passes; the hand loop against the worse draft does not."""
    assert runs["loop_rc"] == exitcodes.PASS
    hf, loop, worse = (str(runs["dir"] / n) for n in ("old", "loop", "worse"))
    code, out = main(capsys, "parity", hf, loop, "--json")
    data = json.loads(out)
    assert code == exitcodes.PASS, data["failures"]
    overall = data["rows"][-1]
    assert overall["category"] == "all" and abs(overall["delta"]) <= 0.1
    assert main(capsys, "parity", loop, worse)[0] == exitcodes.GATE_FAILED


def test_parity_refuses_a_run_without_acceptance(runs, capsys, tmp_path):
    code, err = refused(capsys, "parity", str(runs["dir"] / "old"), str(runs["golden"].parent / "nowhere"))
    assert code == exitcodes.BAD_INPUT and "RUN_B" in err
    code, err = refused(capsys, "parity", str(COMMITTED), str(runs["dir"] / "old"))
    assert code == exitcodes.BAD_INPUT and "RUN_A" in err and "no acceptance to compare" in err
