"""The Ray face (:mod:`specparity.run.ray_fleet`) piece by piece, without a cluster: seconds each, no GPU.

Ray is replaced by stand-ins placed in ``sys.modules['ray']`` or passed where the code takes ``ray``: the
pair actors of ``tests/test_fleet_reruns.py`` (:class:`FakeRay`, :class:`Actor`), extended here with a
cluster that places them, and a launch that records what it was asked. The server pairs are the
project's fake llama.cpp servers (:class:`fakes.LlamaCppServer`), so a whole run — its shards, the rerun of
what a lost pair left, the merge and ``ray.json`` — is the real gate over HTTP. Every message the face
prints or raises is compared whole. ``tests/test_ray_fleet.py`` runs the same face on a real two-node
cluster and kills a worker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import specparity.engines.server.engine as server_engine
import specparity.engines.server.http as http
import specparity.engines.server.launch as launch
import specparity.engines.server.llamacpp as llamacpp
import specparity.run.gate_command as gate_command
from fakes import LlamaCppServer
from fakes.backend import TARGET
from specparity.cli.options import build_setup
from specparity.engines import BUILTIN, resolve_factory
from specparity.engines.base import EngineInfo, EngineOptions
from specparity.model.gate_run import GateConfig
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.model.prompts import Prompt
from specparity.model.shards import Shard, ShardPlan, shard_of
from specparity.run import ray_fleet
from specparity.run.journal import JOURNAL, RESULTS_SCHEMA
from specparity.run.ray_fleet import (ALIVE_TIMEOUT_S, EXTRA_LINE, Fleet, PairAddress, PairLoss, RayOptions, ServerPair,
                                      ShardRun, check_ray_options, pair_loss, require_ray, shard_setup, start_pairs,
                                      stop_pairs, unfinished)
from specparity.run.setup import BadInput, GateSetup

from test_fleet_reruns import Actor, FakeRay, _Remote

LLAMACPP = resolve_factory("llamacpp")


def _inprocess(options):  # an engine factory that declares no server
    return None


def _server_plugin(options):  # a server engine named by module:factory (no launch code the face knows)
    return None


_inprocess.engine_info = EngineInfo("mine", server=False)
_server_plugin.engine_info = EngineInfo("plugged", server=True, local_models=False, dtypes=())


def _setup(engine: str = "llamacpp", factory: Any = LLAMACPP, *, options: EngineOptions | None = None,
           **config: Any) -> GateSetup:
    config.setdefault("report_dir", "report")
    return GateSetup(engine, factory, options or EngineOptions(), GateConfig(**config))


def _urls(n: int) -> EngineOptions:
    return EngineOptions(baseline_urls=tuple(f"http://b{i}:1" for i in range(n)),
                         spec_urls=tuple(f"http://s{i}:1" for i in range(n)))


def _refusal(setup: GateSetup, options: RayOptions | None = None) -> str:
    with pytest.raises(BadInput) as info:
        check_ray_options(setup, options or RayOptions("auto"))
    return str(info.value)


# --------------------------------------------------------------------------- require_ray, options


def test_without_ray_the_refusal_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(BadInput) as info:
        require_ray()
    assert str(info.value) == "--ray: needs Ray, which is not installed here (pip install 'specparity[ray]')"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert EXTRA_LINE == "pip install 'specparity[ray]'"


def test_with_ray_the_module_itself_is_returned(monkeypatch):
    fake = types.ModuleType("ray")
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert require_ray() is fake


def test_the_options_default_to_one_pair_per_node_without_gpus():
    options = RayOptions("auto")
    assert (options.address, options.pairs, options.gpus_per_pair, options.server_host) == ("auto", None, 0.0, None)
    assert ALIVE_TIMEOUT_S == 30.0


@pytest.mark.parametrize("factory", [_inprocess, lambda options: None], ids=["declared", "undeclared"])
def test_an_engine_that_runs_in_this_process_is_refused(factory):
    assert _refusal(_setup("mine.py:create", factory)) == (
        "--ray: engine 'mine.py:create' runs in this process; --ray places server pairs (--engine llamacpp, sglang "
        "or vllm with --preset, or --baseline-url/--spec-url pairs)")


def test_a_shard_resume_update_golden_or_no_report_is_refused():
    assert _refusal(_setup(shard=Shard(1, 3))) == (
        "--ray with --shard 1/3: --ray makes one shard per server pair itself; drop --shard (or run each shard "
        "without --ray)")
    assert _refusal(_setup(resume=True)) == (
        "--ray with --resume: a run over a cluster is started afresh and records no golden")
    assert _refusal(_setup(update_golden="update")) == (
        "--ray with --update-golden: a run over a cluster is started afresh and records no golden")
    for report in (None, ""):
        assert _refusal(_setup(report_dir=report)) == (
            "--ray: needs --report DIR (each shard's journal and the merged run are written there)")


def test_url_pairs_must_pair_up_and_agree_with_the_pair_count():
    uneven = dataclasses.replace(_urls(2), spec_urls=("http://s0:1",))
    assert _refusal(_setup(options=uneven)) == (
        "--ray with 2 --baseline-url and 1 --spec-url: give them in pairs (the i-th baseline with the i-th "
        "speculative server)")
    assert _refusal(_setup(options=_urls(2)), RayOptions("auto", pairs=3)) == (
        "--ray-pairs 3: the URLs give 2 pair(s); drop --ray-pairs")
    assert _refusal(_setup(options=_urls(2)), RayOptions("auto", pairs=1)) == (
        "--ray-pairs 1: the URLs give 2 pair(s); drop --ray-pairs")
    # URL pairs need no launch code: a server plugin the face cannot launch still runs over them
    for pairs in (None, 2):
        assert check_ray_options(_setup("mod:make", _server_plugin, options=_urls(2)), RayOptions("a", pairs)) is None


def test_launched_pairs_need_an_engine_with_launch_code(monkeypatch):
    for engine in ("llamacpp", "sglang", "vllm"):
        assert check_ray_options(_setup(engine, resolve_factory(engine)), RayOptions("auto")) is None
    assert _refusal(_setup("mod:make", _server_plugin)) == (
        "--ray: engine 'mod:make' declares no launch configuration a Ray node could start; give "
        "--baseline-url/--spec-url pairs")
    monkeypatch.setattr(llamacpp, "launch_configs", "not callable")
    assert _refusal(_setup()) == (
        "--ray: engine 'llamacpp' declares no launch configuration a Ray node could start; give "
        "--baseline-url/--spec-url pairs")
    monkeypatch.delattr(llamacpp, "launch_configs")
    assert _refusal(_setup()).startswith("--ray: engine 'llamacpp' declares no launch configuration")


def test_the_engine_module_is_a_builtin_engines_module_only():
    for name, target in BUILTIN.items():
        assert ray_fleet._engine_module(name) is sys.modules[target.split(":")[0]]
    assert ray_fleet._engine_module("llamacpp") is llamacpp
    assert ray_fleet._engine_module("specparity.engines.server.llamacpp:create") is None
    assert ray_fleet._engine_module("nope") is None


# --------------------------------------------------------------------------- the records


def test_a_pair_address_is_its_fields():
    url_pair = PairAddress(3, "http://b", "http://s")
    assert url_pair.to_json() == {"index": 3, "baseline_url": "http://b", "spec_url": "http://s", "node": "",
                                  "actor_pid": 0, "host": "", "head": False}
    placed = PairAddress(1, "http://b", "http://s", "n1", 42, "10.0.0.2", True)
    assert placed.to_json() == {"index": 1, "baseline_url": "http://b", "spec_url": "http://s", "node": "n1",
                                "actor_pid": 42, "host": "10.0.0.2", "head": True}


IDS = [f"p{i}" for i in range(12)]
CAL = [f"c{i}" for i in range(6)]


def test_a_shard_run_names_its_part_and_says_what_it_ran():
    plan = ShardPlan.of(Shard(1, 3), IDS, CAL)
    assert plan.runs and plan.calibrates and len(plan.runs) != len(plan.calibrates)
    part = ShardRun(plan, 2, "r/shards/1")
    assert (part.exit_code, part.error, part.retry_of) == (None, None, None)
    assert part.name == "shard 1/3"
    assert part.to_json() == {"shard": "1/3", "part": "shard", "pair": 2, "report": "r/shards/1",
                              "selected": len(plan.runs), "calibration": len(plan.calibrates), "exit_code": None,
                              "error": None, "cause": "", "keeps_errors": False}
    retry = ShardRun(plan.retry(plan.runs[:1], [], "pair 2: gone", keep_errors=True), 0, "r/shards/1-retry", 1,
                     "boom", "r/shards/1")
    assert retry.name == "rerun of shard 1/3"
    assert retry.to_json() == {"shard": "1/3", "part": "retry", "pair": 0, "report": "r/shards/1-retry",
                               "selected": 1, "calibration": 0, "exit_code": 1, "error": "boom",
                               "cause": "pair 2: gone", "keeps_errors": True}


def test_a_fleet_lists_its_pairs_losses_and_parts():
    empty = Fleet([])
    assert (empty.actors, empty.losses, empty.runs, empty.started_s, empty.lost) == ([], {}, [], 0.0, set())
    assert empty.to_json() == {"pairs": [], "lost_pairs": [], "losses": {}, "shards": [], "pairs_started_s": 0.0}
    pairs = [PairAddress(i, f"http://b{i}", f"http://s{i}") for i in range(3)]
    plan = ShardPlan.of(Shard(0, 3), IDS, None)
    fleet = Fleet(pairs, ["a0", "a1", "a2"], {2: PairLoss("gone"), 0: PairLoss("crashed", "spec")},
                  [ShardRun(plan, 1, "d")], 1.23456)
    assert fleet.lost == {0, 2}
    doc = fleet.to_json()
    assert doc == {"pairs": [p.to_json() for p in pairs], "lost_pairs": [0, 2], "losses": {"0": "crashed", "2": "gone"},
                   "shards": [ShardRun(plan, 1, "d").to_json()], "pairs_started_s": 1.235}
    assert list(doc["losses"]) == ["0", "2"]


def test_a_pair_loss_says_whether_a_server_exited():
    assert PairLoss("x").server is None and not PairLoss("x").server_exited
    assert PairLoss("x", "baseline").server_exited and PairLoss("x", "spec").server_exited


# --------------------------------------------------------------------------- the pair actor


class Proc:
    """A launched server as the pair actor drives it, recording each call in ``events``."""

    def __init__(self, role: str, events: list, fail: str | None = None, error: BaseException | None = None):
        self.role, self.events, self.fail, self.error = role, events, fail, error
        self.url = f"http://{role}:8000"
        self.env = {"KEEP": role}
        self.host: str | None = None
        self.die_with_parent = False
        self.running = True
        self.process: Any = None
        self.log_path: str | None = None

    def _do(self, what: str) -> None:
        self.events.append((self.role, what))
        if what == self.fail:
            raise self.error or RuntimeError(f"{self.role} failed to {what}")

    def spawn(self):
        self._do("spawn")

    def wait_ready(self):
        self._do("wait_ready")

    def start(self):
        self._do("start")

    def stop(self):
        self._do("stop")

    def alive(self) -> bool:
        return self.running


class Launch:
    """``launch_configs`` and ``launch_processes`` of the engine, recording what the pair actor asked."""

    def __init__(self, monkeypatch, **fail: Any):
        self.events: list = []
        self.configs: list = []
        self.processes: list = []
        self.procs = (Proc("baseline", self.events, **fail.get("baseline", {})),
                      Proc("spec", self.events, **fail.get("spec", {})))
        monkeypatch.setattr(llamacpp, "launch_configs", self._configs, raising=False)
        monkeypatch.setattr(server_engine, "launch_processes", self._processes)

    def _configs(self, options):
        self.configs.append(options)
        return ("LAUNCH-B", "LAUNCH-S")

    def _processes(self, options, launches, prefix):
        self.processes.append((options, launches, prefix))
        return self.procs


NODE = "node-b"


def _node_ray(monkeypatch, tmp_path, gpus=(), nodes=None, ip="192.168.0.9") -> types.ModuleType:
    """``ray`` inside a pair actor: its GPUs, its node id, the cluster's nodes, the node's own address (and the
    node's temporary directory: ``tmp_path``)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    fake = types.ModuleType("ray")
    fake.get_gpu_ids = lambda: list(gpus)
    fake.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: NODE)
    fake.nodes = lambda: list(nodes if nodes is not None else [
        {"NodeID": "node-a", "NodeManagerAddress": "10.0.0.1", "Resources": {"node:__internal_head__": 1.0}},
        {"NodeID": NODE, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0}}])
    fake.util = types.SimpleNamespace(get_node_ip_address=lambda: ip)
    monkeypatch.setitem(sys.modules, "ray", fake)
    return fake


def test_a_pair_actor_holds_what_it_was_given():
    options = EngineOptions(preset="p")
    pair = ServerPair("llamacpp", options, 4)
    assert (pair.engine, pair.options, pair.index, pair.host, pair.processes) == ("llamacpp", options, 4, None, [])
    assert ServerPair("vllm", options, 1, "10.1.1.1").host == "10.1.1.1"


@pytest.mark.parametrize("gpus, base, spec", [([0, 1, 2, 3], "0,1", "2,3"), ([0, 1, 2], "0", "1,2"), ([4, 5], "4", "5"),
                                              ([7], "7", "7")])
def test_a_pair_actor_splits_its_gpus_and_starts_its_servers_one_after_the_other(monkeypatch, tmp_path, gpus, base,
                                                                                  spec):
    _node_ray(monkeypatch, tmp_path, gpus)
    launch_ = Launch(monkeypatch)
    options = EngineOptions(preset="llamacpp-ngram-simple", extra={"keep": "x"}, log_dir="ignored")
    pair = ServerPair("llamacpp", options, 3)
    address = pair.start()
    (given,) = launch_.configs
    log_dir = Path(given.log_dir)
    assert log_dir.parent == tmp_path and log_dir.name.startswith("specparity-pair3-") and log_dir.is_dir()
    assert given == dataclasses.replace(options, extra={"keep": "x", "baseline_gpus": base, "spec_gpus": spec},
                                        log_dir=str(log_dir))
    assert options.extra == {"keep": "x"} and options.log_dir == "ignored"  # the actor's own options stay
    assert launch_.processes == [(given, ("LAUNCH-B", "LAUNCH-S"), "llamacpp-pair3")]
    b, s = launch_.procs
    assert (b.host, s.host, b.die_with_parent, s.die_with_parent) == ("10.0.0.2", "10.0.0.2", True, True)
    assert b.env == {"KEEP": "baseline", "CUDA_VISIBLE_DEVICES": base}
    assert s.env == {"KEEP": "spec", "CUDA_VISIBLE_DEVICES": spec}
    assert launch_.events == [("baseline", "start"), ("spec", "start")]
    assert pair.processes == [b, s]
    assert address == PairAddress(3, "http://baseline:8000", "http://spec:8000", NODE, os.getpid(), "10.0.0.2", False)


@pytest.mark.parametrize("gpus, extra", [([], {}), ([0, 1], {"baseline_gpus": "3"}), ([0, 1], {"spec_gpus": "2"})],
                         ids=["no-gpus", "baseline-given", "spec-given"])
def test_gpus_named_by_the_options_or_none_at_all_are_not_split(monkeypatch, tmp_path, gpus, extra):
    _node_ray(monkeypatch, tmp_path, gpus)
    launch_ = Launch(monkeypatch)
    ServerPair("llamacpp", EngineOptions(extra=dict(extra)), 0).start()
    (given,) = launch_.configs
    assert given.extra == extra
    b, s = launch_.procs
    assert b.env == {"KEEP": "baseline", **({"CUDA_VISIBLE_DEVICES": extra["baseline_gpus"]} if "baseline_gpus" in extra
                                           else {})}
    assert s.env == {"KEEP": "spec", **({"CUDA_VISIBLE_DEVICES": extra["spec_gpus"]} if "spec_gpus" in extra else {})}


def test_a_parallel_start_spawns_both_servers_before_waiting_for_either(monkeypatch, tmp_path):
    _node_ray(monkeypatch, tmp_path)
    launch_ = Launch(monkeypatch)
    ServerPair("llamacpp", EngineOptions(extra={"parallel_start": True}), 0).start()
    assert launch_.events == [("baseline", "spawn"), ("spec", "spawn"), ("baseline", "wait_ready"),
                              ("spec", "wait_ready")]


@pytest.mark.parametrize("host, nodes, ip, where, head", [
    ("10.9.9.9", None, "192.168.0.9", "10.9.9.9", False),  # --ray-server-host wins
    (None, [{"NodeID": NODE, "NodeManagerAddress": "10.0.0.5", "Resources": {"node:__internal_head__": 1.0}}],
     "192.168.0.9", "10.0.0.5", True),
    (None, [{"NodeID": NODE, "NodeManagerAddress": "", "Resources": None}], "192.168.0.7", "192.168.0.7", False),
    (None, [{"NodeID": "node-a", "NodeManagerAddress": "10.0.0.1", "Resources": {"node:__internal_head__": 1.0}}],
     "192.168.0.8", "192.168.0.8", False),  # its node not listed: the address Ray says this process has
], ids=["server-host", "head-node", "no-manager-address", "node-not-listed"])
def test_a_pair_listens_where_its_node_is_reached(monkeypatch, tmp_path, host, nodes, ip, where, head):
    _node_ray(monkeypatch, tmp_path, nodes=nodes, ip=ip)
    launch_ = Launch(monkeypatch)
    address = ServerPair("llamacpp", EngineOptions(), 2, host).start()
    assert (address.host, address.head, address.node) == (where, head, NODE)
    assert [p.host for p in launch_.procs] == [where, where]


@pytest.mark.parametrize("extra, fail", [({}, ("spec", "start")), ({"parallel_start": 1}, ("baseline", "wait_ready")),
                                         ({"parallel_start": 1}, ("spec", "spawn"))])
@pytest.mark.parametrize("error", [RuntimeError("no port"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_pair_that_fails_to_start_stops_both_servers(monkeypatch, tmp_path, extra, fail, error):
    _node_ray(monkeypatch, tmp_path)
    role, step = fail
    launch_ = Launch(monkeypatch, **{role: {"fail": step, "error": error}})
    pair = ServerPair("llamacpp", EngineOptions(extra=extra), 0)
    with pytest.raises(type(error)) as info:
        pair.start()
    assert info.value is error
    assert pair.processes == list(launch_.procs)
    assert launch_.events[-2:] == [("baseline", "stop"), ("spec", "stop")]
    assert launch_.events[-3] == (role, step)


def test_a_pair_reports_its_servers(tmp_path):
    events: list = []
    pair = ServerPair("llamacpp", EngineOptions(), 0)
    assert not pair.alive() and pair.exited() == {} and pair.logs() == {}  # nothing launched
    b, s = Proc("baseline", events), Proc("spec", events)
    pair.processes = [b, s]
    assert pair.alive()
    assert pair.exited() == {"baseline": None, "spec": None}
    s.running, s.process = False, types.SimpleNamespace(poll=lambda: -9)
    assert not pair.alive()
    assert pair.exited() == {"baseline": None, "spec": -9}
    b.running = False  # never spawned: no process to ask
    assert pair.exited() == {"baseline": -1, "spec": -9}
    b.running, s.running = True, True
    (tmp_path / "base.log").write_bytes("début\n".encode() + b"\xff")
    b.log_path = str(tmp_path / "base.log")
    s.log_path = tmp_path / "missing.log"
    assert pair.logs() == {"base.log": "début\n\ufffd"}
    s.log_path = str(tmp_path / "spec.log")
    (tmp_path / "spec.log").write_text("spec log", encoding="utf-8")
    assert pair.logs() == {"base.log": "début\n\ufffd", "spec.log": "spec log"}
    pair.stop()
    assert events == [("baseline", "stop"), ("spec", "stop")]


# --------------------------------------------------------------------------- a cluster that places pair actors


class _Call(_Remote):
    """An actor method: ``remote()`` logs the call and hands back its answer (an exception: ``ray.get`` raises)."""

    def __init__(self, answer, log: list, name: str):
        super().__init__(answer)
        self.log, self.name = log, name

    def remote(self, *args):
        self.log.append(self.name)
        return self.answer


class PairActor(Actor):
    """A :class:`ServerPair` actor as the run reaches it: what ``start``, ``exited`` and ``logs`` answer."""

    def __init__(self, start: Any = None, exited: Any = None, logs: Any = None, stop: Any = None):
        super().__init__({"baseline": None, "spec": None} if exited is None else exited)
        self.calls: list = []
        self.start = _Call(start, self.calls, "start")
        self.logs = _Call({} if logs is None else logs, self.calls, "logs")
        self.stop = _Call(stop, self.calls, "stop")
        self.made: tuple = ()


class Cluster(FakeRay):
    """``ray`` as the run drives it: its nodes, the actors it places (``actors``, in order), ``get`` with its
    timeout, ``kill``, ``init`` and ``shutdown``; every call logged in ``calls``."""

    def __init__(self, actors=(), nodes=({"Alive": True},), kill_fails: bool = False):
        self.actors, self._nodes, self.kill_fails = list(actors), list(nodes), kill_fails
        self.calls: list = []
        self.placed: list = []

    def nodes(self):
        return self._nodes

    def remote(self, cls):
        self.calls.append(("remote", cls))
        cluster = self

        class Placement:
            def options(self, **kw):
                cluster.calls.append(("options", kw))
                return self

            def remote(self, *args):
                actor = cluster.actors[len(cluster.placed)]
                actor.made = args
                cluster.placed.append(actor)
                return actor

        return Placement()

    def get(self, answer, timeout=None):
        self.calls.append(("get", timeout))
        return FakeRay.get(answer)

    def kill(self, actor):
        self.calls.append(("kill", actor))
        if self.kill_fails:
            raise RuntimeError("already dead")

    def init(self, **kw):
        self.calls.append(("init", kw))

    def shutdown(self):
        self.calls.append(("shutdown",))


class Clock:
    """``time`` for :func:`start_pairs`: ``perf_counter`` answers each value in turn."""

    def __init__(self, *values: float):
        self.values = list(values)

    def perf_counter(self) -> float:
        return self.values.pop(0)


def _said() -> tuple[list[str], Any]:
    lines: list[str] = []
    return lines, lines.append


def test_url_pairs_are_the_urls_given_in_order():
    setup = _setup(options=_urls(3))
    lines, say = _said()
    fleet = start_pairs(None, setup, RayOptions("auto"), say)  # Ray is not asked anything
    assert fleet == Fleet([PairAddress(i, f"http://b{i}:1", f"http://s{i}:1") for i in range(3)])
    assert lines == []


def _actor_setup(preset: str | None = "llamacpp-ngram-simple") -> GateSetup:
    return _setup(options=EngineOptions(preset=preset, log_dir="report/servers", extra={"tokenizer": "t"}))


@pytest.mark.parametrize("nodes, pairs, count", [
    ([{"Alive": True}, {"Alive": False}, {"Alive": True}, {}], None, 2),
    ([{"Alive": True}], None, 1),
    ([{"Alive": False}], None, 1),
    ([{"Alive": True}], 3, 3),
])
def test_one_pair_actor_per_live_node_unless_a_count_is_given(monkeypatch, nodes, pairs, count):
    monkeypatch.setattr(ray_fleet, "time", Clock(5.25, 7.5))
    actors = [PairActor(start=PairAddress(i, f"http://b{i}", f"http://s{i}", f"n{i}", 10 + i)) for i in range(count)]
    ray = Cluster(actors, nodes)
    setup = _actor_setup()
    lines, say = _said()
    fleet = start_pairs(ray, setup, RayOptions("auto", pairs, 0.5, "10.1.1.1"), say)
    assert fleet.pairs == [a.start.answer for a in actors] and fleet.actors == actors
    assert fleet.losses == {} and fleet.started_s == 2.25
    options = [{"num_cpus": 1, "num_gpus": 0.5, "scheduling_strategy": "SPREAD", "max_restarts": 0}] * count
    assert ray.calls == [("remote", ServerPair), *[("options", o) for o in options], *[("get", None)] * count]
    unlogged = dataclasses.replace(setup.engine_options, log_dir=None)
    assert [a.made for a in actors] == [("llamacpp", unlogged, i, "10.1.1.1") for i in range(count)]
    assert [a.calls for a in actors] == [["start"]] * count
    assert lines == [f"ray: launching {count} server pair(s) of --preset llamacpp-ngram-simple"]


def test_a_pair_that_does_not_come_up_is_lost_and_said(monkeypatch):
    monkeypatch.setattr(ray_fleet, "time", Clock(1.0, 4.0))
    up = PairAddress(0, "http://b0", "http://s0")
    actors = [PairActor(start=up), PairActor(start=RuntimeError("no GPU left\nsecond line")),
              PairActor(start=ValueError()), PairActor(start=PairAddress(3, "http://b3", "http://s3"))]
    lines, say = _said()
    fleet = start_pairs(Cluster(actors), _actor_setup(None), RayOptions("auto", 4), say)
    assert fleet.pairs == [up, actors[3].start.answer] and fleet.actors == actors
    assert fleet.losses == {1: PairLoss("it did not come up"), 2: PairLoss("it did not come up")}
    assert fleet.started_s == 3.0
    assert lines == ["ray: launching 4 server pair(s) of --preset (default)", "ray: pair 1: RuntimeError: no GPU left",
                     "ray: pair 2: ValueError: "]


def test_no_pair_up_stops_every_actor_and_says_why(monkeypatch):
    monkeypatch.setattr(ray_fleet, "time", Clock(1.0, 2.0))
    actors = [PairActor(start=RuntimeError("out of memory")), PairActor(start=OSError("port taken"))]
    ray = Cluster(actors)
    lines, say = _said()
    with pytest.raises(RuntimeError) as info:
        start_pairs(ray, _actor_setup(), RayOptions("auto", 2), say)
    assert str(info.value) == "ray: no server pair came up: pair 0: RuntimeError: out of memory; pair 1: OSError: port taken"
    assert lines == ["ray: launching 2 server pair(s) of --preset llamacpp-ngram-simple"]
    assert [a.calls for a in actors] == [["start", "stop"]] * 2  # no logs asked: none are kept
    assert [c for c in ray.calls if c[0] == "kill"] == [("kill", a) for a in actors]


# --------------------------------------------------------------------------- how a pair was lost


def test_a_loss_already_known_is_answered_without_asking():
    loss = PairLoss("it did not come up")
    fleet = Fleet([PairAddress(0, "http://b", "http://s")], [object()], {0: loss})
    assert pair_loss(None, fleet, 0) is loss


class GetTimeoutError(Exception):
    pass


@pytest.mark.parametrize("exited, loss", [
    ({"baseline": None, "spec": None}, None),
    ({"baseline": None, "spec": -11}, PairLoss("its speculative server exited with code -11 while its node ran", "spec")),
    ({"baseline": 0, "spec": None}, PairLoss("its baseline server exited with code 0 while its node ran", "baseline")),
    ({"baseline": 1, "spec": 9}, PairLoss("its speculative server exited with code 9 while its node ran", "spec")),
    (GetTimeoutError("no answer in 30 s"), PairLoss("its node or worker was lost (GetTimeoutError)")),
    (RuntimeError("actor died"), PairLoss("its node or worker was lost (RuntimeError)")),
])
def test_a_pair_actor_answers_which_of_its_servers_exited(exited, loss):
    actors = [PairActor(), PairActor(exited=exited), PairActor(exited=RuntimeError("not this one"))]
    ray = Cluster(actors)
    fleet = Fleet([PairAddress(i, f"http://b{i}", f"http://s{i}") for i in range(3)], actors)
    assert pair_loss(ray, fleet, 1) == loss
    assert ray.calls == [("get", 30.0)]
    assert pair_loss(ray, fleet, 0) is None


def test_a_url_pair_is_lost_by_which_servers_answer_health():
    with LlamaCppServer() as b, LlamaCppServer(speculative=True) as s, LlamaCppServer(refuse=True) as db, \
            LlamaCppServer(speculative=True, refuse=True) as ds:
        pairs = [PairAddress(4, b.url, s.url), PairAddress(7, b.url, ds.url), PairAddress(2, db.url, s.url),
                 PairAddress(5, db.url, ds.url)]
        fleet = Fleet(pairs)
        refused = {url: f"GET {url}/health: connection refused" for url in (db.url, ds.url)}
        assert pair_loss(None, fleet, 4) is None
        assert pair_loss(None, fleet, 7) == PairLoss(
            f"its speculative server stopped answering ({refused[ds.url]}) while its node ran", "spec")
        assert pair_loss(None, fleet, 2) == PairLoss(
            f"its baseline server stopped answering ({refused[db.url]}) while its node ran", "baseline")
        assert pair_loss(None, fleet, 5) == PairLoss(
            f"neither of its servers answers ({refused[db.url]}; {refused[ds.url]}): its machine or network was lost")
        assert ray_fleet._unhealthy(b.url) is None
        assert ray_fleet._unhealthy(db.url) == refused[db.url]


def test_a_health_check_asks_once_within_short_timeouts_and_closes(monkeypatch):
    made: list = []

    class Recording(http.Endpoint):
        def __init__(self, url, **kw):
            super().__init__(url, **kw)
            made.append((url, kw))

        def close(self):
            made.append("closed")
            super().close()

    monkeypatch.setattr(http, "Endpoint", Recording)
    with LlamaCppServer() as server:
        assert ray_fleet._unhealthy(server.url) is None
    assert made == [(server.url, {"read_timeout_s": 10.0, "connect_timeout_s": 5.0, "connect_retries": 0}), "closed"]

    def broken(endpoint):
        raise http.ServerError("health: malformed answer")

    made.clear()
    monkeypatch.setattr(launch, "health_ok", broken)
    assert ray_fleet._unhealthy("http://127.0.0.1:9") == "health: malformed answer"
    assert made[-1] == "closed"


# --------------------------------------------------------------------------- stopping the pairs


def test_stopping_keeps_each_pairs_logs_and_survives_lost_actors(tmp_path):
    actors = [PairActor(logs={"a-baseline.log": "début", "a-spec.log": "spec"}),
              PairActor(logs=RuntimeError("actor gone")),
              PairActor(logs={}, stop=RuntimeError("node gone")),
              PairActor(logs={"d-spec.log": "d"})]
    ray = Cluster(actors, kill_fails=True)
    logs = tmp_path / "report" / "servers"
    stop_pairs(ray, Fleet([], actors), logs)
    assert [a.calls for a in actors] == [["logs", "stop"], ["logs"], ["logs", "stop"], ["logs", "stop"]]
    assert sorted(p.name for p in logs.iterdir()) == ["a-baseline.log", "a-spec.log", "d-spec.log"]
    assert (logs / "a-baseline.log").read_bytes() == "début".encode("utf-8")
    assert (logs / "a-spec.log").read_text() == "spec" and (logs / "d-spec.log").read_text() == "d"
    assert [c for c in ray.calls if c[0] == "kill"] == [("kill", a) for a in actors]
    assert [c for c in ray.calls if c[0] == "get"] == [("get", 30.0)] * 7


def test_stopping_without_a_log_directory_asks_for_no_logs(tmp_path):
    actors = [PairActor(logs={"x.log": "x"}), PairActor()]
    ray = Cluster(actors)
    stop_pairs(ray, Fleet([], actors), None)
    assert [a.calls for a in actors] == [["stop"], ["stop"]]
    assert ray.calls == [("get", 30.0), ("kill", actors[0]), ("get", 30.0), ("kill", actors[1])]
    stop_pairs(ray, Fleet([], [PairActor(logs={})]), tmp_path / "none")
    assert not (tmp_path / "none").exists()  # made only for a log to keep


# --------------------------------------------------------------------------- a shard's part


def _prompts(ids) -> list[Prompt]:
    return [Prompt(pid, "math", "en", prompt=f"say {pid}") for pid in ids]


def test_a_parts_setup_is_the_runs_narrowed_to_its_prompts_pair_and_directory():
    options = EngineOptions(preset="llamacpp-ngram-simple", log_dir="report/servers", extra={"tokenizer": "t"},
                            request_timeout=9.0)
    setup = GateSetup("llamacpp", LLAMACPP, options, GateConfig(report_dir="report", max_new_tokens=7),
                      _prompts(IDS), _prompts(CAL), resume=object(), policy_origin={"k": "v"}, counters_pending=True)
    plan = ShardPlan.of(Shard(1, 2), IDS, CAL)
    pair = PairAddress(5, "http://b5", "http://s5")
    chosen = tuple(_prompts(plan.runs))
    part = shard_setup(setup, plan, chosen, tuple(_prompts(plan.calibrates)), pair, "report/shards/1")
    assert part.engine_options == dataclasses.replace(options, baseline_urls=("http://b5",), spec_urls=("http://s5",),
                                                      preset=None, log_dir=str(Path("report/shards/1/servers")))
    assert part.config == dataclasses.replace(setup.config, shard=Shard(1, 2), report_dir="report/shards/1")
    assert part.prompts == list(chosen) and isinstance(part.prompts, list)
    assert part.calibration == _prompts(plan.calibrates) and isinstance(part.calibration, list)
    assert part.plan is plan and part.resume is None
    assert (part.engine_spec, part.factory, part.golden, part.policy_origin, part.counters_pending) == (
        "llamacpp", LLAMACPP, None, {"k": "v"}, True)
    assert setup.engine_options is options and setup.config.shard is None and setup.plan is None  # the run's own
    assert shard_setup(setup, plan, chosen, None, pair, "d").calibration is None
    assert shard_setup(setup, plan, chosen, (), pair, "d").calibration == []


def test_a_part_keeps_its_exit_code_or_its_error(monkeypatch):
    given: list = []

    def execute(setup):
        given.append(setup)
        if setup == "raises":
            raise ValueError("engine did not load\nsecond line")
        return types.SimpleNamespace(decision=types.SimpleNamespace(exit_code=1, status="FAIL"))

    monkeypatch.setattr(gate_command, "execute", execute)
    plan = ShardPlan.of(Shard(0, 2), IDS, None)
    lines, say = _said()
    part = ShardRun(plan, 4, "d")
    ray_fleet._run_part("runs", part, say)
    assert (part.exit_code, part.error) == (1, None)
    retry = ShardRun(plan.retry(plan.runs, []), 1, "d-retry")
    ray_fleet._run_part("raises", retry, say)
    assert (retry.exit_code, retry.error) == (None, "ValueError: engine did not load\nsecond line")
    assert given == ["runs", "raises"]
    assert lines == ["ray: shard 0/2 on pair 4: FAIL (the part's own verdict)",
                     "ray: rerun of shard 0/2 on pair 1: ValueError: engine did not load\nsecond line"]


# --------------------------------------------------------------------------- what a part left unfinished


def _journal(path: Path, *lines: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "run", "schema": RESULTS_SCHEMA}, *lines]
    (path / JOURNAL).write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(path)


def _judged(pid: str, klass: str | None) -> dict:
    return {"kind": "prompt", "prompt": {"id": pid}, "verdict": {} if klass is None else {"class": klass}}


def _baseline(pid: str, kind: str = "baseline", baseline: Any = ("tokens",), tf: Any = "scores") -> dict:
    base = {"token_ids": list(baseline)} if isinstance(baseline, tuple) else baseline
    return {"kind": kind, "prompt_id": pid, "baseline": base, "baseline_tf": tf}


def test_a_part_without_a_journal_left_everything_unfinished(tmp_path):
    plan = ShardPlan(Shard(0, 2), IDS, CAL, ["p1", "p2"], ["c1", "p2"])
    assert unfinished(str(tmp_path / "never-written"), plan) == (["p1", "p2"], ["c1", "p2"])
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / JOURNAL).write_text('{"kind": "nonsense"}\n')
    assert unfinished(str(tmp_path / "torn"), plan) == (["p1", "p2"], ["c1", "p2"])
    assert unfinished(_journal(tmp_path / "empty"), plan) == (["p1", "p2"], ["c1", "p2"])


def test_unfinished_prompts_are_those_without_a_verdict_or_with_an_error(tmp_path):
    runs = ["p0", "p1", "p2", "p3", "p4"]
    plan = ShardPlan(Shard(0, 2), IDS, None, runs, [])
    report = _journal(tmp_path / "s", _judged("p0", "exact"), _judged("p1", "error"), _judged("p2", None),
                      _judged("p4", "diverged"), _judged("p9", "error"))
    assert unfinished(report, plan) == (["p1", "p2", "p3"], [])
    # a later line of a prompt is the one that counts
    report = _journal(tmp_path / "t", _judged("p0", "error"), _judged("p0", "near_tie"), _judged("p1", "exact"),
                      _judged("p1", "error"), _judged("p2", "drifted"), _judged("p3", "exact"), _judged("p4", "exact"))
    assert unfinished(report, plan) == (["p1"], [])


def test_calibration_prompts_are_unfinished_until_their_baseline_is_measured(tmp_path):
    calibrates = ["p0", "p1", "c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7"]
    plan = ShardPlan(Shard(0, 2), IDS, CAL, ["p0", "p1"], calibrates)
    report = _journal(
        tmp_path / "s",
        _judged("p0", "exact"), _judged("p1", "error"),  # a selected prompt counts as its verdict says
        _baseline("c0", "calibration"),  # measured on its own
        _baseline("c1"),  # measured as a baseline
        _baseline("c2", baseline={}),  # no baseline
        _baseline("c3", baseline={"error": "HTTP 500"}),  # the baseline failed
        _baseline("c4", tf=None),  # not scored
        _baseline("c5", tf={}),  # scored (an empty row is still a score)
        _baseline("c6", "calibration", baseline=None), _baseline("c6"),  # its calibration line is the one read
        # c7: never reached
    )
    assert unfinished(report, plan) == (["p1"], ["p1", "c2", "c3", "c4", "c6", "c7"])


def test_a_shard_journal_is_one_with_its_shard_line(tmp_path):
    assert not ray_fleet._shard_journal(str(tmp_path / "never-written"))
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / JOURNAL).write_text('{"kind": "nonsense"}\n')
    assert not ray_fleet._shard_journal(str(tmp_path / "torn"))
    ended = tmp_path / "ended"  # the engine never started: the journal says only how the run ended
    ended.mkdir()
    (ended / JOURNAL).write_text(json.dumps({"kind": "fatal", "error": "baseline endpoint unhealthy"}) + "\n")
    assert not ray_fleet._shard_journal(str(ended))
    assert not ray_fleet._shard_journal(_journal(tmp_path / "whole", _judged("p0", "exact")))
    plan = ShardPlan.of(Shard(0, 2), IDS, None)
    assert ray_fleet._shard_journal(_journal(tmp_path / "shard", {"kind": "shard", **plan.to_json()}))


# --------------------------------------------------------------------------- the reruns


def _lost_fleet(answers: list, losses: dict | None = None) -> Fleet:
    """Pairs 0 … n-1, each an actor answering ``exited`` (an exception: its node or worker is gone)."""
    pairs = [PairAddress(i, f"http://b{i}", f"http://s{i}", actor_pid=100 + i) for i in range(len(answers))]
    return Fleet(pairs, [PairActor(exited=a) for a in answers], dict(losses or {}))


ALIVE = {"baseline": None, "spec": None}


def _parts(tmp_path: Path, pairs: list[int], count: int, calibration: list[str] | None, finished=()) -> list[ShardRun]:
    """Shard i of ``count`` on pair ``pairs[i]``, its journal holding a verdict for ``finished`` prompts."""
    out = []
    for slot, pair in enumerate(pairs):
        plan = ShardPlan.of(Shard(slot, count), IDS, calibration)
        report = _journal(tmp_path / "shards" / str(slot), *[_judged(pid, "exact") for pid in plan.runs
                                                             if pid in finished])
        out.append(ShardRun(plan, pair, report))
    return out


def _run_setup(calibration: list[str] | None = None) -> GateSetup:
    return GateSetup("llamacpp", LLAMACPP, _urls(2), GateConfig(report_dir="report"), _prompts(IDS),
                     _prompts(calibration) if calibration is not None else None)


def test_a_part_on_a_live_pair_is_not_rerun(tmp_path):
    fleet = _lost_fleet([ALIVE, ALIVE])
    lines, say = _said()
    parts = _parts(tmp_path, [0, 1], 2, None)
    assert ray_fleet._retries(Cluster(), _run_setup(), fleet, parts, say) == []
    assert fleet.losses == {} and lines == []


@pytest.mark.parametrize("calibration", [None, CAL], ids=["selected", "own-set"])
def test_a_lost_workers_unfinished_prompts_rerun_on_a_live_pair(tmp_path, calibration):
    fleet = _lost_fleet([ALIVE, RuntimeError("actor died")])
    parts = _parts(tmp_path, [0, 1], 2, calibration)
    finished = parts[1].plan.runs[:1]
    _journal(Path(parts[1].report_dir), _judged(finished[0], "exact"))
    assert len(parts[1].plan.runs) > 1 and (calibration is None or parts[1].plan.calibrates)
    setup = _run_setup(calibration)
    lines, say = _said()
    ((retry_setup, retry),) = ray_fleet._retries(Cluster(), setup, fleet, parts, say)
    what = "its node or worker was lost (RuntimeError)"
    assert fleet.losses == {1: PairLoss(what)}
    runs = parts[1].plan.runs[1:]
    calibrates = parts[1].plan.calibrates
    plan = parts[1].plan.retry(runs, calibrates, f"pair 1: {what}", keep_errors=False)
    assert retry == ShardRun(plan, 0, f"{parts[1].report_dir}-retry", retry_of=parts[1].report_dir)
    by_id = {p.id: p for p in setup.prompts + (setup.calibration or [])}
    assert retry_setup == shard_setup(setup, plan, [by_id[pid] for pid in runs],
                                      [by_id[pid] for pid in calibrates] if calibration is not None else None,
                                      fleet.pairs[0], retry.report_dir)
    assert lines == [f"ray: pair 1 was lost ({what}); rerunning {len(runs)} prompt(s) and {len(calibrates)} "
                     f"calibration prompt(s) of shard 1/2 on pair 0"]


def test_a_pair_lost_to_a_server_that_exited_keeps_its_error_verdicts(tmp_path):
    fleet = _lost_fleet([{"baseline": None, "spec": 139}, ALIVE])
    parts = _parts(tmp_path, [0, 1], 2, None)
    lines, say = _said()
    ((_, retry),) = ray_fleet._retries(Cluster(), _run_setup(), fleet, parts, say)
    what = "its speculative server exited with code 139 while its node ran"
    assert fleet.losses == {0: PairLoss(what, "spec")}
    assert retry.plan == parts[0].plan.retry(parts[0].plan.runs, [], f"pair 0: {what}", keep_errors=True)
    assert retry.pair == 1
    assert lines == [f"ray: pair 0 was lost ({what}); rerunning {len(parts[0].plan.runs)} prompt(s) and 0 calibration "
                     "prompt(s) of shard 0/2 on pair 1; its error verdicts stand"]


def test_lost_parts_go_round_the_live_pairs_and_a_finished_one_is_not_rerun(tmp_path):
    # five pairs: 0, 2 and 3 lost, 1 and 4 live; the part on pair 0 had finished every prompt
    gone = RuntimeError("gone")
    fleet = _lost_fleet([gone, ALIVE, gone, gone, ALIVE])
    parts = _parts(tmp_path, [0, 2, 3, 1, 4], 5, None)
    assert all(p.plan.runs for p in parts), "every shard needs a prompt"
    _journal(Path(parts[0].report_dir), *[_judged(pid, "exact") for pid in parts[0].plan.runs])
    lines, say = _said()
    retries = ray_fleet._retries(Cluster(), _run_setup(), fleet, parts, say)
    assert sorted(fleet.losses) == [0, 2, 3]
    # the lost parts in turn round the live pairs [1, 4]: pair 0's (finished: no rerun, but it takes its turn),
    # pair 2's on pair 4, pair 3's on pair 1
    assert [(r.retry_of, r.pair) for _, r in retries] == [(parts[1].report_dir, 4), (parts[2].report_dir, 1)]
    assert len(lines) == 2


def test_with_no_live_pair_left_the_unfinished_prompts_are_said_and_not_rerun(tmp_path):
    fleet = _lost_fleet([RuntimeError("gone"), {"baseline": 1, "spec": None}])
    parts = _parts(tmp_path, [0, 1], 2, None)
    lines, say = _said()
    assert ray_fleet._retries(Cluster(), _run_setup(), fleet, parts, say) == []
    assert lines == [
        f"ray: pair 0 was lost (its node or worker was lost (RuntimeError)) and no pair is left to rerun shard 0/2: "
        f"{len(parts[0].plan.runs)} prompt(s) stay unfinished",
        f"ray: pair 1 was lost (its baseline server exited with code 1 while its node ran) and no pair is left to rerun "
        f"shard 1/2: {len(parts[1].plan.runs)} prompt(s) stay unfinished"]


def test_a_loss_at_start_stays_as_it_was_and_a_live_pairs_part_is_not_rerun(tmp_path):
    up = PairAddress(1, "http://b1", "http://s1")
    fleet = Fleet([up], [PairActor(exited=RuntimeError("never")), PairActor()], {0: PairLoss("it did not come up")})
    parts = _parts(tmp_path, [1], 1, None)
    ray = Cluster()
    assert ray_fleet._retries(ray, _run_setup(), fleet, parts, lambda line: None) == []
    assert fleet.losses == {0: PairLoss("it did not come up")} and ray.calls == [("get", 30.0)]


# --------------------------------------------------------------------------- the parts side by side


def test_every_part_runs_at_once_on_its_own_thread(monkeypatch):
    # more parts than a thread pool's default size (32 at most), as on a cluster of many nodes
    work = [(f"setup-{i:02}", ShardRun(ShardPlan.of(Shard(0, 1), IDS, None), i, f"r{i}")) for i in range(40)]
    together = threading.Barrier(len(work), timeout=60)  # passes only when every part is running
    seen: list = []

    def run_part(setup, part, say):
        together.wait()
        seen.append((setup, part.report_dir, threading.current_thread().name.rsplit("_", 1)[0], say))

    monkeypatch.setattr(ray_fleet, "_run_part", run_part)
    say = object()
    ray_fleet._side_by_side(work, say)
    assert sorted(seen) == [(s, p.report_dir, "specparity-shard", say) for s, p in work]
    ray_fleet._side_by_side([], say)  # nothing to run: no thread, no error


def test_an_interrupted_wait_returns_at_once_without_waiting_for_the_other_parts(monkeypatch):
    started, release, still_running = threading.Event(), threading.Event(), []

    def run_part(setup, part, say):
        if setup == "first":
            started.wait(timeout=60)
            raise KeyboardInterrupt
        started.set()
        still_running.append(release.wait(timeout=60))  # True: released by the test, not timed out

    monkeypatch.setattr(ray_fleet, "_run_part", run_part)
    plan = ShardPlan.of(Shard(0, 2), IDS, None)
    with pytest.raises(KeyboardInterrupt):
        ray_fleet._side_by_side([("first", ShardRun(plan, 0, "a")), ("second", ShardRun(plan, 1, "b"))], None)
    release.set()
    for thread in [t for t in threading.enumerate() if t.name.startswith("specparity-shard")]:
        thread.join()
    assert still_running == [True]


#: Four threads load the fixture tokenizer at once in a fresh interpreter, as the shards of a run build their
#: engines side by side; prints how many failed, and the first failure.
SIDE_BY_SIDE_TOKENIZERS = """
import sys, threading
from specparity.engines.common import load_tokenizer
failed = []
def load():
    try:
        load_tokenizer(sys.argv[1])
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
threads = [threading.Thread(target=load) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(failed), *failed[:1])
"""


def test_parts_load_their_tokenizers_side_by_side():
    """transformers resolves its names on their first import; the parts' first imports come at once."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE_TOKENIZERS, str(fixture_dir("target"))], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "0", proc.stdout


def test_ctrl_c_starts_no_part_still_waiting_for_a_thread(monkeypatch):
    """A part that had not started when Ctrl-C came never starts (the pairs are being stopped)."""

    started, submitted, release, interrupted = (threading.Event() for _ in range(4))
    ran, fired = [], []

    class Busy(ThreadPoolExecutor):  # one thread: the second part waits for it
        def __init__(self, max_workers=None, **kw):
            super().__init__(max_workers=1, **kw)
            self.given = 0

        def submit(self, *args, **kw):
            future = super().submit(*args, **kw)
            self.given += 1
            if self.given == 2:
                submitted.set()
            return future

    def run_part(setup, part, say):
        ran.append(setup)
        if setup == "first":
            started.set()
            release.wait(timeout=60)

    def on_sigint(signum, frame):  # Ctrl-C, once: a signal landing just before the wait began is sent again
        if not fired:
            fired.append(signum)
            raise KeyboardInterrupt

    def ctrl_c():  # once both parts are handed to the pool, the first running, the second waiting
        started.wait(timeout=60)
        submitted.wait(timeout=60)
        while not interrupted.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            interrupted.wait(0.05)

    monkeypatch.setattr(ray_fleet, "ThreadPoolExecutor", Busy)
    monkeypatch.setattr(ray_fleet, "_run_part", run_part)
    plan = ShardPlan.of(Shard(0, 2), IDS, None)
    previous = signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=ctrl_c)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ray_fleet._side_by_side([("first", ShardRun(plan, 0, "a")), ("second", ShardRun(plan, 1, "b"))], None)
    finally:
        interrupted.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)
        release.set()
    for thread in [t for t in threading.enumerate() if t.name.startswith("specparity-shard")]:
        thread.join()
    assert ran == ["first"]


#: A pair's logs read and kept under a locale that is not UTF-8 (``LC_ALL=C``, no coercion): the servers write
#: UTF-8 whatever the node's locale, and the logs are read and kept as UTF-8. Prints what was read and kept.
LOGS_UNDER_C_LOCALE = r"""
import json, locale, sys, types
from pathlib import Path
from specparity.run.ray_fleet import Fleet, ServerPair, stop_pairs
assert locale.getpreferredencoding(False).upper() not in ("UTF-8", "UTF8"), locale.getpreferredencoding(False)
root = Path(sys.argv[1])
(root / "spec.log").write_bytes("caf\u00e9\n".encode("utf-8"))
pair = ServerPair("llamacpp", None, 0)
pair.processes = [types.SimpleNamespace(log_path=str(root / "spec.log"))]
read = pair.logs()

class Ray:
    stopped = False
    @staticmethod
    def get(answer, timeout=None):
        return answer() if callable(answer) else answer
    @staticmethod
    def kill(actor):
        pass

class Call:
    def __init__(self, answer):
        self.answer = answer
    def remote(self):
        return self.answer

def stop():
    Ray.stopped = True

actor = types.SimpleNamespace(logs=Call(read), stop=Call(stop))
stop_pairs(Ray, Fleet([], [actor]), root / "kept")
print(json.dumps({"read": read, "kept": (root / "kept" / "spec.log").read_bytes().hex(), "stopped": Ray.stopped}))
"""


def test_logs_are_utf8_whatever_the_locale(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), "LC_ALL": "C", "LANG": "C",
           "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run([sys.executable, "-c", LOGS_UNDER_C_LOCALE, str(tmp_path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == {"read": {"spec.log": "caf\u00e9\n"}, "kept": "café\n".encode("utf-8").hex(),
                                       "stopped": True}


# --------------------------------------------------------------------------- whole runs over fake servers


class Recorder:
    """Wraps a function of :mod:`specparity.run.ray_fleet`, keeping what each call was given."""

    def __init__(self, monkeypatch, name: str, keep=lambda *args, **kw: (args, kw)):
        self.real, self.keep, self.calls = getattr(ray_fleet, name), keep, []
        monkeypatch.setattr(ray_fleet, name, self)

    def __call__(self, *args, **kw):
        self.calls.append(self.keep(*args, **kw))
        return self.real(*args, **kw)


def _calibration_file(tmp_path: Path) -> Path:
    """The math prompts (the ones selected) and the list prompts (calibration only) of the default file."""
    rows = (REPO_ROOT / "prompts" / "default.jsonl").read_text(encoding="utf-8").splitlines()
    chosen = [row for row in rows[1:] if json.loads(row).get("category") in ("math", "list")]
    path = tmp_path / "calibration.jsonl"
    path.write_text("\n".join([rows[0], *chosen]) + "\n", encoding="utf-8")
    return path


def _url_run_setup(report: Path, servers: list[tuple[Any, Any]], **raw: Any) -> GateSetup:
    options = {"engine": "llamacpp", "baseline_url": [b.url for b, _ in servers],
               "spec_url": [s.url for _, s in servers], "engine_opt": [f"tokenizer={TARGET}"], "categories": "math",
               "max_new_tokens": "16", "calibration": "selected", "report": str(report), **raw}
    return build_setup(options, check_report=True)


def _fake_ray(monkeypatch, cluster: Any = None) -> Any:
    cluster = cluster or Cluster()
    monkeypatch.setitem(sys.modules, "ray", cluster)
    return cluster


def _classes(merged) -> dict[str, str]:
    return {r.prompt.id: r.verdict.klass for r in merged.run.records}


def test_a_run_over_url_pairs_gives_each_pair_a_shard_and_merges_them(monkeypatch, tmp_path):
    ray = _fake_ray(monkeypatch)
    writes = Recorder(monkeypatch, "replace_whole", lambda path, text: (Path(path), text))
    merges = Recorder(monkeypatch, "merge_dirs")
    stops = Recorder(monkeypatch, "stop_pairs", lambda ray_, fleet, logs_to: (ray_, logs_to))
    report = tmp_path / "report"
    lines, say = _said()
    with LlamaCppServer() as b0, LlamaCppServer(speculative=True) as s0, LlamaCppServer() as b1, \
            LlamaCppServer(speculative=True) as s1:
        setup = _url_run_setup(report, [(b0, s0), (b1, s1)], calibration=str(_calibration_file(tmp_path)))
        merged, fleet = ray_fleet.run_on_ray(setup, RayOptions("ray://head:10001"), say)
    ids, calibration = [p.id for p in setup.prompts], [p.id for p in setup.calibration]
    assert _classes(merged) == {pid: "exact" for pid in ids}
    assert sorted(r.prompt.id for r in merged.run.calibration_records) == sorted(set(calibration) - set(ids))
    assert ray.calls == [("init", {"address": "ray://head:10001", "log_to_driver": False}), ("shutdown",)]
    assert stops.calls == [(ray, report / "servers")]
    plans = [ShardPlan.of(Shard(i, 2), ids, calibration) for i in range(2)]
    assert all(p.runs and p.calibrates for p in plans)
    assert [(r.plan, r.pair, r.report_dir, r.exit_code, r.error, r.retry_of) for r in fleet.runs] == [
        (plans[i], i, str(report / "shards" / str(i)), 0, None, None) for i in range(2)]
    assert fleet.pairs == [PairAddress(0, b0.url, s0.url), PairAddress(1, b1.url, s1.url)] and fleet.losses == {}
    assert sorted(lines) == [f"ray: shard {i}/2 on pair {i}: PASS (the part's own verdict)" for i in range(2)]
    # ray.json: once the pairs are up (no part yet), then at the end, each time whole
    up = {"pairs": [p.to_json() for p in fleet.pairs], "lost_pairs": [], "losses": {}, "shards": [],
          "pairs_started_s": 0.0}
    assert writes.calls == [(report / "ray.json", json.dumps(up, indent=1)),
                            (report / "ray.json", json.dumps(fleet.to_json(), indent=1))]
    assert (report / "ray.json").read_text() == json.dumps(fleet.to_json(), indent=1)
    assert merges.calls == [(([r.report_dir for r in fleet.runs], str(report)), {"tokenizer": str(TARGET)})]
    assert [json.loads(x)["prompt"]["id"] for x in (report / JOURNAL).read_text().splitlines()
            if json.loads(x)["kind"] == "prompt"] == ids


def test_a_pair_whose_shard_holds_no_prompt_runs_nothing(monkeypatch, tmp_path):
    _fake_ray(monkeypatch)
    report = tmp_path / "report"
    with LlamaCppServer() as b0, LlamaCppServer(speculative=True) as s0, LlamaCppServer() as b1, \
            LlamaCppServer(speculative=True) as s1:
        setup = _url_run_setup(report, [(b0, s0), (b1, s1)])
        setup.prompts = [p for p in setup.prompts if shard_of(p.id, 2) == 1][:1]  # shard 0 holds none
        merged, fleet = ray_fleet.run_on_ray(setup, RayOptions("auto"), lambda line: None)
    (only,) = setup.prompts
    (part,) = fleet.runs
    assert part.plan == ShardPlan.of(Shard(1, 2), [only.id], None)
    assert (part.pair, part.report_dir) == (1, str(report / "shards" / "1"))
    assert not (report / "shards" / "0").exists()
    assert _classes(merged) == {only.id: "exact"}


def _retry_of(fleet: Fleet) -> ShardRun:
    (retry,) = [r for r in fleet.runs if r.plan.part == "retry"]
    return retry


def test_a_pair_gone_before_its_shard_started_has_the_whole_shard_rerun(monkeypatch, tmp_path):
    _fake_ray(monkeypatch)
    report = tmp_path / "report"
    lines, say = _said()
    with LlamaCppServer() as b0, LlamaCppServer(speculative=True) as s0, LlamaCppServer(refuse=True) as b1, \
            LlamaCppServer(speculative=True, refuse=True) as s1:
        setup = _url_run_setup(report, [(b0, s0), (b1, s1)], calibration=str(_calibration_file(tmp_path)))
        merged, fleet = ray_fleet.run_on_ray(setup, RayOptions("auto"), say)
    ids, calibration = [p.id for p in setup.prompts], [p.id for p in setup.calibration]
    what = (f"neither of its servers answers (GET {b1.url}/health: connection refused; GET {s1.url}/health: "
            "connection refused): its machine or network was lost")
    assert fleet.losses == {1: PairLoss(what)}
    lost = fleet.runs[1]
    retry = _retry_of(fleet)
    assert lost.plan.calibrates
    assert retry == ShardRun(lost.plan.retry(lost.plan.runs, lost.plan.calibrates, f"pair 1: {what}"), 0,
                             str(report / "shards" / "1-retry"), 0, None, lost.report_dir)
    assert f"ray: pair 1 was lost ({what}); rerunning {len(lost.plan.runs)} prompt(s) and " \
           f"{len(lost.plan.calibrates)} calibration prompt(s) of shard 1/2 on pair 0" in lines
    assert "ray: rerun of shard 1/2 on pair 0: PASS (the part's own verdict)" in lines
    # every prompt judged once, on the pair left; ray.json says what was lost and rerun where
    assert _classes(merged) == {pid: "exact" for pid in ids}
    assert sorted(r.prompt.id for r in merged.run.calibration_records) == sorted(set(calibration) - set(ids))
    doc = json.loads((report / "ray.json").read_text())
    assert doc == fleet.to_json() and doc["lost_pairs"] == [1] and doc["losses"] == {"1": what}
    assert [(s["shard"], s["part"], s["pair"]) for s in doc["shards"]] == [("0/2", "shard", 0), ("1/2", "shard", 1),
                                                                           ("1/2", "retry", 0)]


def test_a_speculative_server_that_dies_mid_run_keeps_its_errors_beside_the_rerun(monkeypatch, tmp_path):
    _fake_ray(monkeypatch)
    report = tmp_path / "report"
    lines, say = _said()
    with LlamaCppServer() as b0, LlamaCppServer(speculative=True) as s0, LlamaCppServer() as b1, \
            LlamaCppServer(speculative=True, die_after=0) as s1:
        setup = _url_run_setup(report, [(b0, s0), (b1, s1)])
        merged, fleet = ray_fleet.run_on_ray(setup, RayOptions("auto"), say)
    what = f"its speculative server stopped answering (GET {s1.url}/health: connection refused) while its node ran"
    assert fleet.losses == {1: PairLoss(what, "spec")}
    lost, retry = fleet.runs[1], _retry_of(fleet)
    assert retry.plan == lost.plan.retry(lost.plan.runs, [], f"pair 1: {what}", keep_errors=True)
    assert retry.pair == 0 and retry.exit_code == 0
    assert f"ray: pair 1 was lost ({what}); rerunning {len(lost.plan.runs)} prompt(s) and 0 calibration prompt(s) " \
           "of shard 1/2 on pair 0; its error verdicts stand" in lines
    classes = _classes(merged)
    assert classes == {p.id: ("error" if p.id in lost.plan.runs else "exact") for p in setup.prompts}
    kept = f" [kept: pair 1: {what}; rerun on another server pair ({report / 'shards' / '1-retry'}): exact]"
    assert all(r.verdict.reason.endswith(kept) for r in merged.run.records if r.prompt.id in lost.plan.runs)


def test_a_run_over_pair_actors_launches_them_and_keeps_their_logs(monkeypatch, tmp_path):
    report = tmp_path / "report"
    lines, say = _said()
    with LlamaCppServer() as b0, LlamaCppServer(speculative=True) as s0, LlamaCppServer() as b2, \
            LlamaCppServer(speculative=True) as s2:
        actors = [PairActor(start=PairAddress(0, b0.url, s0.url, "n0", 100), logs={"pair0-baseline.log": "zero"}),
                  PairActor(start=RuntimeError("no GPU")),
                  PairActor(start=PairAddress(2, b2.url, s2.url, "n2", 102), logs={"pair2-spec.log": "two"})]
        ray = _fake_ray(monkeypatch, Cluster(actors, [{"Alive": True}] * 3))
        setup = _url_run_setup(report, [(b0, s0)])
        setup.engine_options = dataclasses.replace(setup.engine_options, baseline_urls=(), spec_urls=(),
                                                   preset="llamacpp-ngram-simple")
        merged, fleet = ray_fleet.run_on_ray(setup, RayOptions("auto", gpus_per_pair=1.0), say)
    ids = [p.id for p in setup.prompts]
    assert _classes(merged) == {pid: "exact" for pid in ids}
    assert fleet.losses == {1: PairLoss("it did not come up")} and fleet.pairs == [actors[0].start.answer,
                                                                                   actors[2].start.answer]
    # two pairs up: two shards, the second on pair 2, its directory named by its slot
    assert [(r.plan.shard, r.pair, r.report_dir) for r in fleet.runs] == [
        (Shard(0, 2), 0, str(report / "shards" / "0")), (Shard(1, 2), 2, str(report / "shards" / "1"))]
    assert lines[:2] == ["ray: launching 3 server pair(s) of --preset llamacpp-ngram-simple",
                         "ray: pair 1: RuntimeError: no GPU"]
    assert sorted(lines[2:]) == ["ray: shard 0/2 on pair 0: PASS (the part's own verdict)",
                                 "ray: shard 1/2 on pair 2: PASS (the part's own verdict)"]
    assert [a.calls for a in actors] == [["start", "logs", "stop"], ["start", "logs", "stop"],
                                         ["start", "logs", "stop"]]
    assert {p.name: p.read_text() for p in (report / "servers").iterdir()} == {"pair0-baseline.log": "zero",
                                                                               "pair2-spec.log": "two"}
    assert ray.calls[-1] == ("shutdown",) and ray.calls[0] == ("init", {"address": "auto", "log_to_driver": False})
    doc = json.loads((report / "ray.json").read_text())
    assert doc["lost_pairs"] == [1] and doc["losses"] == {"1": "it did not come up"}


def test_a_run_refused_or_without_pairs_starts_nothing_or_shuts_ray_down(monkeypatch, tmp_path):
    stops = Recorder(monkeypatch, "stop_pairs")
    ray = _fake_ray(monkeypatch)
    with pytest.raises(BadInput) as info:
        ray_fleet.run_on_ray(_setup(shard=Shard(0, 2)), RayOptions("auto"), lambda line: None)
    assert str(info.value).startswith("--ray with --shard 0/2: ")
    assert ray.calls == []
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(BadInput, match=r"^--ray: needs Ray"):
        ray_fleet.run_on_ray(_setup(), RayOptions("auto"), lambda line: None)
    ray = _fake_ray(monkeypatch, Cluster([PairActor(start=RuntimeError("no GPU"))]))
    with pytest.raises(RuntimeError, match=r"^ray: no server pair came up: pair 0: RuntimeError: no GPU$"):
        ray_fleet.run_on_ray(_setup(report_dir=str(tmp_path / "r")), RayOptions("auto"), lambda line: None)
    assert ray.calls[0] == ("init", {"address": "auto", "log_to_driver": False}) and ray.calls[-1] == ("shutdown",)
    assert len(stops.calls) == 1  # start_pairs stopped its actors; no fleet is left to stop
    assert not (tmp_path / "r" / "ray.json").exists()
