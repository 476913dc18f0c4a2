"""A failing prompt is replayed against the same servers and the run says how often its failure reproduces.

* an intermittent divergence (the SGLang fake flips only its first answer) fails the run, and its replays
  show the baseline's output each time: "reproduced 0 of 3";
* a speculative request that fails once (HTTP 500 on one request) is an ``error`` that reproduces 0 times; one
  that fails on every try reproduces 3 of 3;
* a loop that diverges every time (a broken in-process loop, ``--replay 2``) reproduces 2 of 2; in-process
  engines are not replayed unless asked;
* the verdict stands whichever way the replays go, the journal holds them on ``replay`` lines, the summary and
  the prompt's reproducer say them, and ``specparity report`` rebuilds them from the journal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import SGLangServer
from fakes.backend import TARGET
from fakes.faults import Rule
from inprocess import run_cli
from prompt_subsets import first_of_categories
from specparity.engines.server.engine import HFTokenizer
from specparity.gate import exitcodes
from specparity.model.replay import DEFAULT_SERVER_REPLAYS, MAX_REPLAYED_PROMPTS, Replay
from specparity.model.locations import REPO_ROOT

MAX_NEW = 12


def lines(report: Path, kind: str) -> list[dict]:
    return [x for x in map(json.loads, (report / "results.jsonl").read_text().splitlines()) if x["kind"] == kind]


def classes(report: Path) -> dict[str, str]:
    return {x["prompt"]["id"]: x["verdict"]["class"] for x in lines(report, "prompt")}


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    return path, first_of_categories(path, {"math": 2, "code": 1})


def sglang_run(base, spec, prompt_file: Path, report: Path, *extra: str) -> tuple[int, str]:
    return run_cli("run", "--engine", "sglang", "--baseline-url", base.url, "--spec-url", spec.url, "--target", TARGET,
                   "--prompts", prompt_file, "--calibration", "selected", "--max-new-tokens", str(MAX_NEW),
                   "--concurrency", "1", "--report", report, *extra)


def test_an_intermittent_divergence_is_replayed_and_does_not_come_back(tmp_path, prompts):
    prompt_file, chosen = prompts
    with SGLangServer() as base, SGLangServer(speculative=True, near_tie_flips=1) as spec:
        code, out = sglang_run(base, spec, prompt_file, tmp_path / "r")
    assert code == exitcodes.GATE_FAILED, out[-3000:]
    failing = [pid for pid, klass in classes(tmp_path / "r").items() if klass == "diverged"]
    assert len(failing) == 1 and len(spec.flipped) == 1, (classes(tmp_path / "r"), out[-2000:])
    (line,) = lines(tmp_path / "r", "replay")
    assert line["prompt_id"] == failing[0]
    replay = Replay.from_json(line)
    assert (replay.tries, replay.same, replay.baseline, replay.other, replay.failed) == (DEFAULT_SERVER_REPLAYS, 0,
                                                                                          DEFAULT_SERVER_REPLAYS, 0, 0)
    said = (f"reproduced 0 of {DEFAULT_SERVER_REPLAYS} replay(s) against the same servers (the same speculative "
            f"output came again); otherwise {DEFAULT_SERVER_REPLAYS} the baseline's output; the verdict stands either way")
    assert replay.describe() == said
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert f"Replayed: {said}." in summary
    readme = next((tmp_path / "r" / "reproducers").glob("*/README.md")).read_text()
    assert f"How often it comes back: {said}." in readme
    # the run's counters and verdict were read before the replays: the verdict line is the run's
    verdict = lines(tmp_path / "r", "verdict")[-1]
    assert verdict["status"] == "FAIL" and verdict["counts"]["diverged"] == 1
    code, rebuilt = run_cli("report", tmp_path / "r")
    assert code == exitcodes.GATE_FAILED and (tmp_path / "r" / "summary.md").read_text() == summary


class FailsOnce(SGLangServer):
    """Fails only the first request its rules pick (the prompt's judged request), then answers it."""

    fired = False

    def _pick_fault(self, body):
        fault = super()._pick_fault(body)
        if fault is None or self.fired:
            return None
        self.fired = True
        return fault


@pytest.mark.parametrize("always", [False, True])
def test_a_failed_speculative_request_is_replayed_and_says_whether_it_fails_again(tmp_path, prompts, always):
    prompt_file, chosen = prompts
    tok = HFTokenizer(str(TARGET))
    victim = chosen[0]
    ids = tok.encode_prompt(victim.prompt, victim.messages_as_dicts())
    server = SGLangServer if always else FailsOnce
    with SGLangServer() as base, server(speculative=True, rules=[Rule("http_500", prompt=ids, n_predict=MAX_NEW)]) as spec:
        code, out = sglang_run(base, spec, prompt_file, tmp_path / "r", "--replay", "3")
    assert code == exitcodes.GATE_FAILED, out[-3000:]
    assert classes(tmp_path / "r")[victim.id] == "error"
    (line,) = lines(tmp_path / "r", "replay")
    replay = Replay.from_json(line)
    assert replay.of_error and replay.tries == 3
    if always:
        assert (replay.failed, replay.baseline, replay.reproduced) == (3, 0, 3)
        assert replay.describe() == ("reproduced 3 of 3 replay(s) against the same servers (the request failed again); "
                                     "the verdict stands either way")
        assert "HTTP 500" in replay.first_error
    else:
        assert (replay.failed, replay.baseline, replay.reproduced) == (0, 3, 0)


def test_an_in_process_loop_that_diverges_every_time_reproduces_each_replay(tmp_path):
    prompt_file = tmp_path / "p.jsonl"
    chosen = first_of_categories(prompt_file, {"math": 2})
    loop = ("--engine", f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create", "--engine-opt", "bug=accept_unverified",
            "--prompts", prompt_file, "--calibration", "selected", "--max-new-tokens", "24")
    code, out = run_cli("run", *loop, "--report", tmp_path / "none")
    assert code == exitcodes.GATE_FAILED and not lines(tmp_path / "none", "replay")  # in process: none by default
    code, out = run_cli("run", *loop, "--replay", "2", "--report", tmp_path / "two")
    assert code == exitcodes.GATE_FAILED, out[-2000:]
    failing = [pid for pid, klass in classes(tmp_path / "two").items() if klass == "diverged"]
    replays = {x["prompt_id"]: Replay.from_json(x) for x in lines(tmp_path / "two", "replay")}
    assert failing and sorted(replays) == sorted(failing[:MAX_REPLAYED_PROMPTS]) and len(chosen) >= len(failing)
    assert all((r.tries, r.same, r.reproduced) == (2, 2, 2) for r in replays.values()), replays


def test_a_negative_replay_count_is_refused_before_anything_loads(tmp_path):
    code, out = run_cli("run", "--replay", "-1", "--report", tmp_path / "r")
    assert code == exitcodes.BAD_INPUT
    assert out.strip().splitlines()[-1].endswith("--replay -1: expected an integer >= 0"), out
