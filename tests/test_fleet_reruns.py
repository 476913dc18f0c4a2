"""A fleet rerun never hides a server crash: a pair lost because one of its servers exited keeps the ``error``
verdicts it left, with the rerun's class beside each; only a pair whose node or worker was lost is rerun away.

The Ray face's bookkeeping (:func:`specparity.run.ray_fleet.pair_loss`, ``_retries``) runs here against a
stand-in for Ray whose actors answer what their servers did; the merge reads journals written as the runner
writes them (``tests/test_run_state.py``). ``tests/test_ray_fleet.py`` kills a real worker on a real cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specparity.engines.base import EngineOptions
from specparity.gate.decision import decide
from specparity.model.gate_run import GateConfig, GatePolicy
from specparity.model.run_state import RunState
from specparity.model.shards import Shard, ShardPlan, shard_of
from specparity.run import ray_fleet
from specparity.run.merge import merge_dirs
from specparity.run.ray_fleet import Fleet, PairAddress, PairLoss, ShardRun, pair_loss
from specparity.run.setup import GateSetup

from test_run_state import THRESHOLD_NATS, _records, _write


class _Remote:
    def __init__(self, answer):
        self.answer = answer

    def remote(self):
        return self.answer


class Actor:
    """A pair actor that answers ``exited`` (or is gone: ``answer`` an exception)."""

    def __init__(self, answer):
        self.exited = _Remote(answer)


class FakeRay:
    @staticmethod
    def get(answer, timeout=None):
        if isinstance(answer, BaseException):
            raise answer
        return answer


def _fleet(*answers) -> Fleet:
    pairs = [PairAddress(i, f"http://b{i}", f"http://s{i}", actor_pid=100 + i) for i in range(len(answers))]
    return Fleet(pairs, [Actor(a) for a in answers])


def test_how_a_pair_was_lost_is_read_from_its_actor():
    fleet = _fleet({"baseline": None, "spec": None}, {"baseline": None, "spec": -11}, {"baseline": 1, "spec": None},
                   RuntimeError("actor died"))
    assert pair_loss(FakeRay, fleet, 0) is None
    assert pair_loss(FakeRay, fleet, 1) == PairLoss("its speculative server exited with code -11 while its node ran",
                                                    "spec")
    assert pair_loss(FakeRay, fleet, 2) == PairLoss("its baseline server exited with code 1 while its node ran",
                                                    "baseline")
    assert pair_loss(FakeRay, fleet, 3) == PairLoss("its node or worker was lost (RuntimeError)")
    assert not pair_loss(FakeRay, fleet, 3).server_exited


IDS = [f"p{i}" for i in range(12)]


def _part(tmp_path: Path, classes: list[str], verdicts_for: int) -> tuple[ShardPlan, Path]:
    """Shard 0 of 2 of the twelve prompts, its journal holding a verdict for the first ``verdicts_for`` of its
    prompts (the last of them ``error``), the rest never reached."""
    plan = ShardPlan.of(Shard(0, 2), IDS, None)
    records = [r for r in _records(classes, per_request=True) if r.prompt.id in plan.runs][:verdicts_for]
    records[-1].verdict.klass = "error"
    records[-1].verdict.reason = "HTTP 502: connection reset by the speculative server"
    path = tmp_path / "s0"
    config = GateConfig(near_tie_nats=THRESHOLD_NATS, shard=plan.shard)
    _write(path, config, RunState(), records, plan)
    return plan, path


@pytest.mark.parametrize("answer, keeps", [({"baseline": None, "spec": -11}, True), (RuntimeError("gone"), False)])
def test_a_server_that_exited_keeps_its_error_and_a_lost_node_is_rerun_away(tmp_path, answer, keeps):
    classes = ["exact"] * len(IDS)
    plan, shard0 = _part(tmp_path, classes, verdicts_for=2)
    fleet = _fleet(answer, {"baseline": None, "spec": None})
    part = ShardRun(plan, 0, str(shard0))
    setup = GateSetup("vllm", lambda options: None, EngineOptions(baseline_urls=("http://b0",), spec_urls=("http://s0",)),
                      GateConfig(near_tie_nats=THRESHOLD_NATS), prompts=[r.prompt for r in _records(classes, True)])
    (retry_setup, retry), = ray_fleet._retries(FakeRay, setup, fleet, [part], lambda _msg: None)
    assert retry.pair == 1 and retry.plan.keep_errors is keeps
    assert retry.plan.cause.startswith("pair 0: ")
    errored = [pid for pid in plan.runs[:2]][-1]
    assert retry.plan.runs == [errored, *plan.runs[2:]]  # the error and what was never reached are rerun either way
    assert fleet.to_json()["losses"] == {"0": retry.plan.cause.removeprefix("pair 0: ")}

    # the rerun on pair 1 judged every prompt exact; shard 1 ran on its own pair
    rerun = tmp_path / "s0-retry"
    _write(rerun, GateConfig(near_tie_nats=THRESHOLD_NATS, shard=plan.shard), RunState(),
           [r for r in _records(classes, True) if r.prompt.id in retry.plan.runs], retry.plan)
    other = ShardPlan.of(Shard(1, 2), IDS, None)
    _write(tmp_path / "s1", GateConfig(near_tie_nats=THRESHOLD_NATS, shard=other.shard), RunState(),
           [r for r in _records(classes, True) if r.prompt.id in other.runs], other)
    merged = merge_dirs([str(shard0), str(rerun), str(tmp_path / "s1")], str(tmp_path / "merged"))
    verdicts = {r.prompt.id: r.verdict for r in merged.run.records}
    decision = decide(merged.run, GatePolicy())
    if keeps:
        assert verdicts[errored].klass == "error"
        assert verdicts[errored].reason == (
            f"HTTP 502: connection reset by the speculative server [kept: {retry.plan.cause}; rerun on another server "
            f"pair ({rerun}): exact]")
        assert [pid for pid, v in verdicts.items() if v.klass != "exact"] == [errored]
        assert not decision.passed and any(errored in f for f in decision.failures)
    else:
        assert all(v.klass == "exact" for v in verdicts.values()) and decision.passed, decision.failures
    assert sorted(verdicts) == sorted(IDS) and all(shard_of(pid, 2) in (0, 1) for pid in verdicts)
