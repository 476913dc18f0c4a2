"""A run split into shards (``--shard I/N``) and merged back (``specparity merge``) is the run.

* a prompt's shard is a pure function of its id: the shards are disjoint, cover every prompt, do not
  depend on the order of the prompt files, and spread independently of the CRC-32 that shares one
  shard's prompts out over its own fleet of URLs;
* on the embedded ``dflash`` engine, two shards merged give the unsharded run's per-prompt classes (in
  its order), its threshold, drift bound and flip rate exactly, and its verdict; the merged directory is
  a journal ``specparity report`` rebuilds;
* a merge of journals that are not one run is refused, each problem on its own line (exit 4): another
  engine fingerprint, a missing shard, a shard given twice;
* a shard that stopped early loses nothing: its unfinished prompts are ``error`` verdicts naming why.
"""

from __future__ import annotations

import json
import random
import shutil
import zlib
from pathlib import Path

import pytest

from inprocess import run_cli
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import load_prompts
from specparity.model.shards import Shard, ShardError, shard_of

DEFAULT = REPO_ROOT / "prompts" / "default.jsonl"
#: Few categories and a short limit keep the three runs cheap; the noise is still measured on every
#: prompt of the prompt file (--calibration suite), so the shards also split calibration-only prompts.
ARGS = ("--categories", "math,code,repeat", "--max-new-tokens", "16")


def lines(report: Path) -> list[dict]:
    return [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]


def judged(report: Path) -> dict[str, tuple[str, str]]:
    """prompt id -> (class, rule), in journal order."""
    return {x["prompt"]["id"]: (x["verdict"]["class"], x["verdict"]["rule"]) for x in lines(report) if x["kind"] == "prompt"}


def last(report: Path, kind: str) -> dict:
    return [x for x in lines(report) if x["kind"] == kind][-1]


def test_every_prompt_falls_in_one_shard_whatever_the_order():
    ids = [p.id for p in load_prompts(DEFAULT).prompts]
    for count in range(1, 6):
        shards = [[pid for pid in ids if Shard(i, count).holds(pid)] for i in range(count)]
        assert sorted(pid for s in shards for pid in s) == sorted(ids)  # disjoint and covering
        shuffled = random.Random(count).sample(ids, len(ids))
        assert {pid: shard_of(pid, count) for pid in shuffled} == {pid: shard_of(pid, count) for pid in ids}
    two = [[pid for pid in ids if shard_of(pid, 2) == i] for i in range(2)]
    assert all(two), two  # both shards hold prompts of the default file


def test_a_shard_still_spreads_over_its_own_fleet():
    """The fleet of URLs inside one shard picks a server by CRC-32; the shard hash must not decide it too."""
    ids = [p.id for p in load_prompts(DEFAULT).prompts]
    for index in range(2):
        mine = [pid for pid in ids if shard_of(pid, 2) == index]
        assert {zlib.crc32(pid.encode()) % 2 for pid in mine} == {0, 1}, mine


@pytest.mark.parametrize("text", ["3/2", "2/2", "-1/2", "0/0", "1", "a/b", "1/2/3", ""])
def test_bad_shard_values_are_refused(text):
    with pytest.raises(ShardError, match="expected I/N with 0 <= I < N"):
        Shard.parse(text)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One unsharded run and its two shards, on the embedded engine."""
    root = tmp_path_factory.mktemp("shards")
    out = {"whole": root / "whole", "0": root / "s0", "1": root / "s1"}
    code, text = run_cli("run", *ARGS, "--report", out["whole"], "-q")
    assert code == 0, text[-3000:]
    for index in ("0", "1"):
        code, text = run_cli("run", *ARGS, "--shard", f"{index}/2", "--report", out[index], "-q")
        assert code in (exitcodes.PASS, exitcodes.GATE_FAILED), text[-3000:]
    return out


def test_shards_are_disjoint_cover_the_run_and_name_their_prompts(runs):
    whole = judged(runs["whole"])
    plans = [last(runs[i], "shard") for i in ("0", "1")]
    assert plans[0]["prompts"] == plans[1]["prompts"] == list(whole)
    selected = [set(judged(runs[i])) for i in ("0", "1")]
    assert not selected[0] & selected[1] and selected[0] | selected[1] == set(whole)
    assert [set(p["runs"]) for p in plans] == selected
    # the calibration prompts (every prompt of the file) are named, and each shard measured its own
    everything = [p.id for p in load_prompts(DEFAULT).prompts]
    assert plans[0]["calibration"] == everything
    for plan, index in zip(plans, ("0", "1")):
        measured = {x["prompt_id"] for x in lines(runs[index]) if x["kind"] in ("baseline", "calibration")}
        assert measured == set(plan["calibrates"]) == {pid for pid in everything if shard_of(pid, 2) == int(index)}


def test_two_shards_merged_are_the_unsharded_run(runs, tmp_path):
    merged = tmp_path / "merged"
    code, text = run_cli("merge", runs["0"], runs["1"], "--report", merged)
    whole_verdict = last(runs["whole"], "verdict")
    assert code == whole_verdict["exit_code"], text[-3000:]
    assert list(judged(merged).items()) == list(judged(runs["whole"]).items())
    a, b = last(runs["whole"], "threshold"), last(merged, "threshold")
    for key in ("nats", "drift_nats", "noise", "flip_rate", "cross_instance_note", "calibration"):
        assert a[key] == b[key], key
    assert last(merged, "verdict")["status"] == whole_verdict["status"]
    # a prompt is judged again exactly where its shard's own threshold or drift bound was not the run's
    again = sum(len(judged(runs[i])) for i in ("0", "1")
                if (last(runs[i], "threshold")["nats"], last(runs[i], "threshold")["drift_nats"]) != (b["nats"], b["drift_nats"]))
    assert f"{again} prompt(s) judged again under it, {len(judged(merged)) - again} kept" in text, text[-3000:]
    for name in ("summary.md", "report.md", "report.html"):
        assert (merged / name).is_file()
    assert "merged from 2 journal(s) of 2 shard(s)" in (merged / "summary.md").read_text()
    code, rebuilt = run_cli("report", merged)
    assert code == whole_verdict["exit_code"], rebuilt[-2000:]
    assert rebuilt.splitlines()[0] == text.splitlines()[0]


def _edit_run_line(report: Path, edit) -> None:
    path = report / "results.jsonl"
    rows = path.read_text().splitlines()
    head = json.loads(rows[0])
    edit(head)
    path.write_text("\n".join([json.dumps(head), *rows[1:]]) + "\n")


def test_merging_another_fingerprint_is_refused(runs, tmp_path):
    other = tmp_path / "s1"
    shutil.copytree(runs["1"], other)
    _edit_run_line(other, lambda head: head["fingerprint"].update(dtype="bfloat16"))
    code, text = run_cli("merge", runs["0"], other, "--report", tmp_path / "merged")
    assert code == exitcodes.BAD_INPUT, text[-2000:]
    errors = [ln for ln in text.splitlines() if ln.startswith("specparity: error: ")]
    assert len(errors) == 1 and "engine fingerprint differs" in errors[0] and "dtype" in errors[0], text[-2000:]
    assert not (tmp_path / "merged" / "results.jsonl").exists()


def test_a_missing_or_repeated_shard_is_refused_on_its_own_line(runs, tmp_path):
    code, text = run_cli("merge", runs["0"], "--report", tmp_path / "m1")
    assert code == exitcodes.BAD_INPUT
    missing = [ln for ln in text.splitlines() if "missing shard 1/2" in ln]
    expected = len(last(runs["1"], "shard")["calibrates"])
    assert len(missing) == 1 and f"{len(judged(runs['1']))} selected" in missing[0], text[-2000:]
    assert f"{expected - len(judged(runs['1']))} calibration-only" in missing[0]
    twice = tmp_path / "again"
    shutil.copytree(runs["0"], twice)
    code, text = run_cli("merge", runs["0"], twice, runs["1"], "--report", tmp_path / "m2")
    assert code == exitcodes.BAD_INPUT
    assert [ln for ln in text.splitlines() if "shard 0/2 given twice" in ln], text[-2000:]


def test_a_shard_killed_mid_run_loses_nothing(runs, tmp_path):
    """A journal cut after its first judged prompt (the process killed there): the merge keeps what it
    finished and makes every other prompt of that shard an error naming why; the gate fails."""
    cut = tmp_path / "s1"
    shutil.copytree(runs["1"], cut)
    rows = (cut / "results.jsonl").read_text().splitlines()
    first = next(i for i, r in enumerate(rows) if json.loads(r)["kind"] == "prompt")
    (cut / "results.jsonl").write_text("\n".join(rows[:first + 1]) + "\n")
    code, text = run_cli("merge", runs["0"], cut, "--report", tmp_path / "merged")
    assert code == exitcodes.GATE_FAILED, text[-2000:]
    merged = {x["prompt"]["id"]: x["verdict"] for x in lines(tmp_path / "merged") if x["kind"] == "prompt"}
    assert list(merged) == list(judged(runs["whole"]))  # every prompt is there, in the run's order
    lost = [pid for pid in judged(runs["1"]) if pid != json.loads(rows[first])["prompt"]["id"]]
    assert lost and all(merged[pid]["class"] == "error" and "not finished: shard 1/2" in merged[pid]["reason"]
                        for pid in lost), {pid: merged[pid] for pid in lost}
    assert sum(v["class"] == "error" for v in merged.values()) == len(lost)


def test_two_server_noise_is_journalled_and_merged(tmp_path):
    """Two server instances a few bf16 steps apart (SGLang emulators): each shard journals the speculative
    server's scores of its calibration baselines, and the merge measures the cross-instance figure of the
    whole run from them, as one unsharded run does."""
    from fakes import SGLangServer
    from fakes.backend import TARGET
    from fakes.gate import run_lossless

    step = 0.0625  # one bf16 logit step for logits between 8 and 16
    with SGLangServer() as base, SGLangServer(speculative=True, instance_noise_nats=step) as spec:
        reports = {name: tmp_path / name for name in ("whole", "0", "1")}
        for name, extra in (("whole", ()), ("0", ("--shard", "0/2")), ("1", ("--shard", "1/2"))):
            proc, _ = run_lossless("sglang", base.url, spec.url, reports[name], "--target", str(TARGET), *extra,
                                   in_process=True)
            assert proc.returncode in (exitcodes.PASS, exitcodes.GATE_FAILED), (proc.stdout + proc.stderr)[-3000:]
    for name in ("0", "1"):
        cross = [x for x in lines(reports[name]) if x["kind"] == "cross_instance"]
        assert {x["prompt_id"] for x in cross} == set(last(reports[name], "shard")["runs"])
        assert all(x.get("scores") for x in cross)
    code, text = run_cli("merge", reports["0"], reports["1"], "--report", tmp_path / "merged")
    assert code == last(reports["whole"], "verdict")["exit_code"], text[-3000:]
    a, b = last(reports["whole"], "threshold"), last(tmp_path / "merged", "threshold")
    assert a["cross_instance"] is not None and a["cross_instance"]["max_abs_delta"] >= step
    for key in ("nats", "drift_nats", "noise", "cross_instance", "flip_rate"):
        assert a[key] == b[key], key
    # a server engine journals prompts as they finish (requests in flight); the merge in prompt-file order
    assert judged(tmp_path / "merged") == judged(reports["whole"])


def test_a_merged_calibration_refused_exits_3(runs, tmp_path):
    """Shards whose own noise passed a ceiling the run's does not: the merge refuses to judge (exit 3), as
    one run would, and the journal says why."""
    copies = []
    for index in ("0", "1"):
        copy = tmp_path / f"s{index}"
        shutil.copytree(runs[index], copy)
        ceiling = last(runs["whole"], "threshold")["nats"] / 2  # below the run's measured threshold
        _edit_run_line(copy, lambda head: head["config"].update(near_tie_ceiling=ceiling))
        copies.append(copy)
    code, text = run_cli("merge", *copies, "--report", tmp_path / "merged")
    assert code == exitcodes.ENGINE_ERROR, text[-2000:]
    refused = last(tmp_path / "merged", "calibration_refused")["error"]
    assert "exceeds the ceiling" in refused and refused in (tmp_path / "merged" / "summary.md").read_text()


def test_ctrl_c_during_a_merge_exits_2(runs, tmp_path, monkeypatch):
    import specparity.run.merge as merge

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(merge, "merge_parts", interrupted)
    code, text = run_cli("merge", runs["0"], runs["1"], "--report", tmp_path / "merged")
    assert code == exitcodes.INTERRUPTED and "interrupted" in text, text[-2000:]
