"""``specparity sweep``: the gate at several concurrency levels against the same servers.

* bad ``--levels`` and the options a sweep refuses are one line naming the option, exit 4, before
  anything loads; so is an in-process engine (it decodes one request at a time);
* SGLang fakes whose kernels flip answers decoded in a batch (``batch_flip_above``, both servers): a
  single gate run at the high concurrency passes (both sides flip alike), the sweep catches the flip
  as ``batch_flip`` and fails; with a threshold that covers the flip's margin it is a
  ``batch_flip_near_tie``, held to the gate's near-tie policy: ``--max-near-tie`` passes it, a
  threshold set by hand holds it to the fixed share (the budget from the data rests on a measured
  threshold: ``tests/test_judged_noise.py`` judges two recorded sides with it), ``--bit-exact`` and a
  declaration of deterministic inference fail it;
* a level that fails after an earlier one passed keeps the earlier level's journal and results;
* a real llama-server with two slots (live; skips without the build) sweeps 1 and 2 requests in flight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import Rule, SGLangServer
from fakes.backend import TARGET
from prompt_subsets import first_of_categories
from specparity.gate import exitcodes
from specparity.cli.commands import main
from specparity.cli.sweep import parse_levels
from specparity.run.sweep import LEVEL_DIR, SWEEP_JSON, SWEEP_MD
from specparity.model.locations import REPO_ROOT

#: Prompts per sweep: at most the highest level below, so every request of a phase is in flight at once.
PER_CATEGORY = {"math": 2, "code": 1}
#: Short streams: still several draft blocks, and a closest call to flip.
MAX_NEW = ("--max-new-tokens", "12")


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    chosen = first_of_categories(path, PER_CATEGORY)
    return path, chosen


def sweep(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["sweep", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def load_sweep(report: Path) -> dict:
    return json.loads((report / SWEEP_JSON).read_text())


def journal(report: Path, level: int) -> list[dict]:
    path = report / LEVEL_DIR.format(level=level) / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("levels, words", [
    ("1,x", "'x' is not an integer"),
    ("0,4", "0 is not a positive integer"),
    ("-1,4", "-1 is not a positive integer"),
    ("1,4,4", "4 given twice"),
    ("4", "one level only"),
    ("1,,4", "expected two or more distinct positive integers"),
])
def test_bad_levels_are_one_line_naming_the_option(capsys, tmp_path, levels, words):
    code, out, err = sweep(capsys, f"--levels={levels}", "--report", str(tmp_path / "r"))
    assert code == exitcodes.BAD_INPUT
    line = err.strip()
    assert "\n" not in line and line.startswith(f"specparity: error: --levels {levels}") and words in line, err
    assert not (tmp_path / "r").exists()  # refused before the report directory is even made


def test_levels_are_sorted():
    assert parse_levels("16,1,4") == (1, 4, 16)


@pytest.mark.parametrize("extra, flag", [
    (("--concurrency", "2"), "--concurrency"),
    (("--resume",), "--resume"),
    (("--report", ""), "--report"),
])
def test_options_a_sweep_sets_itself_are_refused(capsys, tmp_path, extra, flag):
    args = ["--levels", "1,4", "--report", str(tmp_path / "r"), *extra]
    code, _out, err = sweep(capsys, *args)
    assert code == exitcodes.BAD_INPUT and err.startswith(f"specparity: error: {flag}"), err


@pytest.mark.parametrize("engine", ["dflash", "hf"])
def test_in_process_engines_are_refused_before_loading(capsys, tmp_path, engine):
    """They decode one request at a time: every level would be concurrency 1, so no flip could show."""
    code, _out, err = sweep(capsys, "--levels", "1,4", "--engine", engine, "--report", str(tmp_path))
    assert code == exitcodes.BAD_INPUT
    assert f"engine {engine!r} serves one request at a time" in err and "--levels 1,4" in err, err
    assert not (tmp_path / LEVEL_DIR.format(level=1)).exists()


def test_a_level_above_what_the_servers_serve_is_refused_before_any_prompt(capsys, tmp_path, prompts):
    with SGLangServer() as base, SGLangServer(speculative=True) as spec:
        code, _out, err = sweep(capsys, "--levels", "1,4", "--engine", "sglang", "--baseline-url", base.url,
                                "--spec-url", spec.url, "--target", str(TARGET), "--engine-opt", "max_concurrency=2", "--prompts",
                                str(prompts[0]), *MAX_NEW, "--report", str(tmp_path))
        assert code == exitcodes.BAD_INPUT
        assert "--levels 1,4" in err and "serves at most 2 request(s) at once" in err and "max_concurrency=N" in err, err
        assert not any(s.n_predict > 1 for s in base.seen + spec.seen)  # no prompt ran
    assert not (tmp_path / LEVEL_DIR.format(level=1)).exists()


# --------------------------------------------------------------------------- batch-dependent flips (fakes)


def _servers(**knobs):
    return SGLangServer(**knobs), SGLangServer(speculative=True, **knobs)


def _gate_args(base: SGLangServer, spec: SGLangServer, prompt_file: Path, report: Path) -> list[str]:
    return ["--engine", "sglang", "--baseline-url", base.url, "--spec-url", spec.url, "--target", str(TARGET),
            "--prompts", str(prompt_file),
            "--calibration", "selected", *MAX_NEW, "--report", str(report)]


def test_a_batch_dependent_flip_is_caught_by_the_sweep_and_not_by_one_level(capsys, tmp_path, prompts):
    prompt_file, chosen = prompts
    high = len(chosen)
    base, spec = _servers(batch_flip_above=1)
    with base, spec:
        # one gate run at the high concurrency: both sides flip alike, so it passes
        code, out, err = main(["run", *_gate_args(base, spec, prompt_file, tmp_path / "single"), "--concurrency",
                               str(high)]), *capsys.readouterr()
        assert code == exitcodes.PASS, out + err
        assert spec.batch_flipped and base.batch_flipped, "the fakes never batched: nothing was tested"
        flipped_single = len(spec.batch_flipped)
        code, out, err = sweep(capsys, "--levels", f"1,{high}", *_gate_args(base, spec, prompt_file, tmp_path / "sw"))
    assert code == exitcodes.GATE_FAILED, out + err
    doc = load_sweep(tmp_path / "sw")
    low, top = doc["results"]
    # each level's own gate passes: the flip is invisible within a level
    assert low["status"] == top["status"] == "PASS", doc
    assert low["counts"]["exact"] == top["counts"]["exact"] == len(chosen)
    assert low["in_flight"] == 1 and top["in_flight"] == high
    assert low["accepted"] > 0 and low["verify_steps"] > 0 and low["accept_length"] > 1
    # the sweep sees every flipped prompt, and none is a near tie at the measured noise
    flips = top["flips"]
    assert len(flips) == flipped_single and all(f["klass"] == "batch_flip" and f["comparison"] == "diverged"
                                                for f in flips), flips
    assert top["flip_counts"]["batch_flip"] == len(flips) and top["compared"] == len(chosen)
    assert top["flip_threshold"] < 1.0  # the fp32 fixtures' measured noise, not a widened threshold
    assert any("beyond a near tie (batch_flip)" in f for f in doc["failures"])
    assert f"FAIL: level {high}: {len(flips)} prompt(s) differ from level 1 beyond a near tie" in out
    md = (tmp_path / "sw" / SWEEP_MD).read_text()
    assert "batch_flip" in md and all(f"`{f['prompt_id']}`" in md for f in flips)
    for level in (1, high):  # each level keeps its own journal and reports
        assert journal(tmp_path / "sw", level)[0]["concurrency"] == level
        assert (tmp_path / "sw" / LEVEL_DIR.format(level=level) / "summary.md").is_file()


#: The fixture target is confident (closest calls of 5-18 nats): a threshold that covers them.
WIDE = ("--near-tie-ceiling", "40", "--near-tie-nats", "39")


def test_a_batch_flip_within_the_threshold_is_a_near_tie_and_passes_a_fixed_share(capsys, tmp_path, prompts):
    """Every flip within the threshold is a near tie, and --max-near-tie 1 allows every prompt to be
    one: the sweep passes, and says by which policy."""
    prompt_file, chosen = prompts
    high = len(chosen)
    base, spec = _servers(batch_flip_above=1)
    with base, spec:
        code, out, err = sweep(capsys, "--levels", f"1,{high}", *_gate_args(base, spec, prompt_file, tmp_path), *WIDE,
                               "--max-near-tie", "1")
    assert code == exitcodes.PASS, out + err
    top = load_sweep(tmp_path)["results"][1]
    assert top["flips"] and all(f["klass"] == "batch_flip_near_tie" for f in top["flips"]), top
    assert top["flip_counts"]["batch_flip"] == 0
    assert f"batch_flip_near_tie {len(top['flips'])}" in out
    assert top["flip_budget_failure"] is None
    assert top["flip_budget"].startswith("near ties are allowed up to 100% of the prompts (--max-near-tie)")
    assert f"- level {high}: ok — {top['flip_budget']}" in (tmp_path / SWEEP_MD).read_text()


def test_batch_flips_within_a_hand_set_threshold_are_held_to_the_fixed_share(capsys, tmp_path, prompts):
    """Without --max-near-tie, flips within a threshold set by hand are held to the fixed share (25 % of
    the prompts), not to the budget from the data: the budget rests on the same measurement as the
    threshold, which --near-tie-nats replaces. Every prompt flips, so the sweep fails and says why."""
    prompt_file, chosen = prompts
    high = len(chosen)
    base, spec = _servers(batch_flip_above=1)
    with base, spec:
        code, out, err = sweep(capsys, "--levels", f"1,{high}", *_gate_args(base, spec, prompt_file, tmp_path), *WIDE)
    doc = load_sweep(tmp_path)
    top = doc["results"][1]
    ties = top["flip_counts"]["batch_flip_near_tie"]
    assert ties and top["flip_counts"]["batch_flip"] == 0, top
    why = "the near-tie threshold was set by --near-tie-nats, not measured"
    assert top["flip_budget"] == (f"near-tie flips that are not exact ties are allowed up to 25% of the prompts "
                                  f"({why}): this run has {ties} of {top['compared']} judged "
                                  f"({ties / top['compared']:.0%})")
    assert ties / top["compared"] > 0.25
    reason = top["flip_budget_failure"]
    assert reason.startswith(f"{ties}/{top['compared']} near-tie prompts that are not exact ties ") and why in reason
    assert code == exitcodes.GATE_FAILED, out + err
    assert any("fail the near-tie policy" in f for f in doc["failures"])


@pytest.mark.parametrize("policy", ["bit-exact", "declared"])
def test_batch_flips_within_the_threshold_fail_a_bit_exact_sweep(capsys, tmp_path, prompts, policy):
    """The same near-tie flips where the run must be bit-exact: under --bit-exact, or on servers that
    declare deterministic inference. The sweep fails with the gate's reason, where each level's own
    gate passes (both sides of a level flip alike)."""
    prompt_file, chosen = prompts
    high = len(chosen)
    base, spec = _servers(batch_flip_above=1, declares_deterministic=policy == "declared")
    extra = ("--bit-exact",) if policy == "bit-exact" else ()
    with base, spec:
        code, out, err = sweep(capsys, "--levels", f"1,{high}", *_gate_args(base, spec, prompt_file, tmp_path), *WIDE,
                               "--max-near-tie", "1", *extra)
    doc = load_sweep(tmp_path)
    low, top = doc["results"]
    # each level's own gate judges every prompt exact (both sides of a level flip alike); under
    # --bit-exact its hand-set threshold above every margin is a finding of its own, not a prompt's failure
    assert all(level["counts"].get("exact") == len(chosen) for level in (low, top)), doc
    ties = [f["prompt_id"] for f in top["flips"] if f["klass"] == "batch_flip_near_tie"]
    assert ties and top["flip_counts"]["batch_flip"] == 0, top
    assert code == exitcodes.GATE_FAILED, out + err
    reason = top["flip_budget_failure"]
    expected = {"bit-exact": f"--bit-exact: {len(ties)} near-tie flip(s) where bit-exactness is required: ",
                "declared": "engine declares deterministic inference (sglang /server_info "
                            "enable_deterministic_inference=true"}[policy]
    assert reason.startswith(expected) and all(pid in reason for pid in ties), reason
    line = f"level {high}: {len(ties)} batch_flip_near_tie against level 1 fail the near-tie policy: {reason}"
    assert line in doc["failures"] and f"FAIL: {line}" in out
    assert f"- level {high}: FAIL — " in (tmp_path / SWEEP_MD).read_text()


def test_a_later_level_that_fails_keeps_the_earlier_levels_results(tmp_path, prompts):
    """The speculative server starts answering HTTP 500 once level 1 is done: level 1's journal and
    its row in sweep.json stay, the later level fails, and the sweep fails."""
    from specparity.cli.option_table import GATE_OPTIONS
    from specparity.cli.options import build_setup
    from specparity.run.sweep import run_sweep, write_sweep

    prompt_file, chosen = prompts
    base, spec = _servers()
    with base, spec:
        raw = {o.dest: o.kwargs.get("default") for o in GATE_OPTIONS}
        args = _gate_args(base, spec, prompt_file, tmp_path)
        raw.update({"engine": "sglang", "baseline_url": [base.url], "spec_url": [spec.url], "prompts": [str(prompt_file)],
                    "target": str(TARGET), "calibration": "selected", "max_new_tokens": MAX_NEW[1], "report": args[-1]})
        setup = build_setup(raw, check_report=True)

        def say(msg: str) -> None:
            if msg.startswith("level 1: PASS"):
                spec.rules.append(Rule("http_500"))

        result = run_sweep(setup, (1, 2), say=say)
        write_sweep(result)
    assert result.exit_code == exitcodes.GATE_FAILED
    doc = load_sweep(tmp_path)
    assert [r["status"] for r in doc["results"]] == ["PASS", "FAIL"] and doc["complete"]
    assert doc["results"][1]["counts"]["error"] == len(chosen)
    verdicts = [x["verdict"]["class"] for x in journal(tmp_path, 1) if x["kind"] == "prompt"]
    assert verdicts == ["exact"] * len(chosen)
    assert any(x["kind"] == "verdict" and x["status"] == "PASS" for x in journal(tmp_path, 1))


# --------------------------------------------------------------------------- live llama.cpp


@pytest.mark.slow
def test_llamacpp_two_slots_sweep_passes_with_drafting_active(capsys, tmp_path, prompts):
    from llamacpp_fixtures import require_llamacpp

    require_llamacpp()
    prompt_file, chosen = prompts
    code, out, err = sweep(capsys, "--levels", "1,2", "--engine", "llamacpp", "--engine-opt", "parallel=2",
                           "--prompts", str(prompt_file), "--calibration", "selected", *MAX_NEW, "--report", str(tmp_path))
    assert code == exitcodes.PASS, out + err
    doc = load_sweep(tmp_path)
    assert [r["in_flight"] for r in doc["results"]] == [1, 2]
    for r in doc["results"]:
        assert r["status"] == "PASS" and r["counts"]["exact"] == len(chosen), r
        assert 0 < r["accepted"] <= r["proposed"], r
    top = doc["results"][1]
    assert top["compared"] == len(chosen) and top["flips"] == [], top


# --------------------------------------------------------------------------- exit codes 2 and 3


def test_a_server_that_refuses_connections_is_an_engine_error_and_stops_the_sweep(capsys, tmp_path, prompts):
    with SGLangServer() as base, SGLangServer(speculative=True, refuse=True) as spec:
        code, out, err = sweep(capsys, "--levels", "1,2,4", *_gate_args(base, spec, prompts[0], tmp_path))
    assert code == exitcodes.ENGINE_ERROR, out + err
    doc = load_sweep(tmp_path)
    assert [r["level"] for r in doc["results"]] == [1] and doc["results"][0]["status"] == "ERROR"
    assert not doc["complete"] and "level(s) 2, 4 were not run" in doc["stopped"]
    assert "connection refused" in out and "stopped: level 1 could not run" in out
    assert not (tmp_path / LEVEL_DIR.format(level=2)).exists()


def test_ctrl_c_in_a_level_keeps_the_finished_levels_and_exits_2(capsys, tmp_path, prompts, monkeypatch):
    """Ctrl-C during level 2's speculative phase: level 1 stays, level 2 is concluded as interrupted,
    sweep.json says INTERRUPTED, the command exits 2."""
    import specparity.run.runner as runner

    real = runner.run_gate

    def interrupting(msg: str) -> None:
        if msg.rpartition(": ")[2] == "exact":  # the first speculative verdict
            raise KeyboardInterrupt

    def run_gate(engine, prompts_, config, **kw):
        if config.concurrency == 2:
            kw["progress"] = interrupting
        return real(engine, prompts_, config, **kw)

    monkeypatch.setattr(runner, "run_gate", run_gate)
    base, spec = _servers()
    with base, spec:
        code, out, err = sweep(capsys, "--levels", "1,2", *_gate_args(base, spec, prompts[0], tmp_path))
    assert code == exitcodes.INTERRUPTED, out + err
    assert out.startswith("specparity sweep: INTERRUPTED — levels 1, 2 (interrupted in level 2)"), out
    doc = load_sweep(tmp_path)
    assert doc["status"] == "INTERRUPTED" and not doc["complete"]
    assert [r["status"] for r in doc["results"]] == ["PASS", "INTERRUPTED"]
    assert any(x["kind"] == "interrupted" for x in journal(tmp_path, 2))
    assert any(x["kind"] == "verdict" and x["status"] == "PASS" for x in journal(tmp_path, 1))
