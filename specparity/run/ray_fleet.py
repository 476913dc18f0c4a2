"""``specparity run --ray ADDRESS``: one gate shard per server pair of a Ray cluster, then the merge.

A thin face over the same run (``pip install 'specparity[ray]'``): Ray only places the servers. Each
server pair is either a pair of running servers (``--baseline-url``/``--spec-url``, the i-th of each) or
a :class:`ServerPair` actor that launches the preset's two servers on its node with the engine's own
launch code (:func:`specparity.engines.server.engine.launch_processes`), one pair per node by default
(Ray's ``SPREAD`` placement). This process then runs shard ``i`` of the prompts (``--shard i/N``,
:mod:`specparity.model.shards`) against pair ``i``, every shard side by side, each journalled under
``REPORT/shards/i``; so the journals live where the run was started, and a lost node costs no finished
result. A pair lost mid-run (its actor or node gone, its servers not answering) has its unfinished
prompts — selected prompts without a verdict or with an ``error``, calibration prompts without a
measured baseline — rerun once, in full (baseline and speculative run, so a prompt still meets one
pair), on another live pair (``REPORT/shards/i-retry``); what that rerun cannot finish is an ``error``
in the merged journal, never dropped. How the pair was lost decides what the rerun may replace
(:func:`pair_loss`): a lost node or worker (its actor no longer answers) is rerun away; a pair lost because
one of its servers exited while its node ran keeps its prompts' ``error`` verdicts, with the rerun's class
beside each — a speculative server that crashes is what the gate is for, and a passing rerun elsewhere must
not hide it. :mod:`specparity.run.merge` then makes ``REPORT`` the run's.

``REPORT/ray.json`` says where each pair ran (node, actor pid, URLs), which pairs were lost and which
shards were rerun where; it is written once the pairs are up, and again at the end, each time replaced
whole, so a watcher polling it (a dashboard, the fleet test) never reads a half-written file.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.engines.base import EngineOptions
from specparity.model.files import replace_whole
from specparity.model.prompts import Prompt
from specparity.model.shards import Shard, ShardPlan
from specparity.run.journal import JOURNAL, JournalError, read_journal
from specparity.run.merge import MergedRun, merge_dirs
from specparity.run.setup import BadInput, GateSetup, shard_share

EXTRA_LINE = "pip install 'specparity[ray]'"
#: Seconds to wait for a pair actor to answer whether its servers still run.
ALIVE_TIMEOUT_S = 30.0


def require_ray() -> Any:
    """The ``ray`` module, or :class:`BadInput` naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise BadInput(f"--ray: needs Ray, which is not installed here ({EXTRA_LINE})") from None
    return ray


@dataclass
class RayOptions:
    """What ``--ray`` and its companions asked for, checked."""

    address: str
    #: Server pairs to launch from the preset (None: one per live node); with URLs, the URL pairs.
    pairs: int | None = None
    #: GPUs each pair actor asks Ray for (its two servers split them: the baseline the first half).
    gpus_per_pair: float = 0.0
    #: Where a launched pair's servers listen (None: the address its node was started with).
    server_host: str | None = None


def check_ray_options(setup: GateSetup, ray: RayOptions) -> None:
    """Refuse before anything starts what the Ray face cannot do (:class:`BadInput`, one line)."""
    from specparity.engines import SERVER_ENGINES, engine_info

    info = engine_info(setup.factory)
    options, config = setup.engine_options, setup.config
    if info is None or not info.server:
        raise BadInput(f"--ray: engine {setup.engine_spec!r} runs in this process; --ray places server pairs "
                       f"(--engine {', '.join(SERVER_ENGINES[:-1])} or {SERVER_ENGINES[-1]} with --preset, or "
                       "--baseline-url/--spec-url pairs)")
    if config.shard is not None:
        raise BadInput(f"--ray with --shard {config.shard.label}: --ray makes one shard per server pair itself; "
                       "drop --shard (or run each shard without --ray)")
    for flag, given in (("--resume", config.resume), ("--update-golden", config.update_golden)):
        if given:
            raise BadInput(f"--ray with {flag}: a run over a cluster is started afresh and records no golden")
    if not config.report_dir:
        raise BadInput("--ray: needs --report DIR (each shard's journal and the merged run are written there)")
    if options.baseline_urls:
        if len(options.baseline_urls) != len(options.spec_urls):
            raise BadInput(f"--ray with {len(options.baseline_urls)} --baseline-url and {len(options.spec_urls)} "
                           "--spec-url: give them in pairs (the i-th baseline with the i-th speculative server)")
        if ray.pairs is not None and ray.pairs != len(options.baseline_urls):
            raise BadInput(f"--ray-pairs {ray.pairs}: the URLs give {len(options.baseline_urls)} pair(s); drop "
                           "--ray-pairs")
        return
    module = _engine_module(setup.engine_spec)
    if module is None or not callable(getattr(module, "launch_configs", None)):
        raise BadInput(f"--ray: engine {setup.engine_spec!r} declares no launch configuration a Ray node could start; "
                       "give --baseline-url/--spec-url pairs")


def _engine_module(spec: str) -> Any:
    from specparity.engines import BUILTIN

    target = BUILTIN.get(spec)
    return importlib.import_module(target.rpartition(":")[0]) if target else None


@dataclass
class PairAddress:
    """Where one server pair serves, and what runs it (``actor_pid`` 0: servers given by URL)."""

    index: int
    baseline_url: str
    spec_url: str
    node: str = ""
    actor_pid: int = 0
    host: str = ""
    #: Whether the pair runs on the cluster's head node.
    head: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ServerPair:
    """A Ray actor (made with ``ray.remote(ServerPair)``): the preset's baseline and speculative server of one
    pair, launched on the actor's node, listening on the node's address, and killed with the actor (their
    parent-death signal), so a lost node or actor is a lost pair, never a pair left serving unseen."""

    def __init__(self, engine: str, options: EngineOptions, index: int, host: str | None = None):
        self.engine = engine
        self.options = options
        self.index = index
        self.host = host
        self.processes: list[Any] = []

    def start(self) -> PairAddress:
        import ray

        from specparity.engines.server.engine import gpu_env, launch_processes

        options = self.options
        gpus = [str(g) for g in ray.get_gpu_ids()]
        if gpus and not (options.extra.get("baseline_gpus") or options.extra.get("spec_gpus")):
            half = max(1, len(gpus) // 2)
            base, spec = gpus[:half], gpus[half:] or gpus[:half]
            options = dataclasses.replace(options, extra={**options.extra, "baseline_gpus": ",".join(base),
                                                          "spec_gpus": ",".join(spec)})
        log_dir = tempfile.mkdtemp(prefix=f"specparity-pair{self.index}-")
        options = dataclasses.replace(options, log_dir=log_dir)
        launches = _engine_module(self.engine).launch_configs(options)
        node = ray.get_runtime_context().get_node_id()
        mine = next((n for n in ray.nodes() if n["NodeID"] == node), {})
        # the address the node was started with (ray start --node-ip-address), where the run reaches it
        host = self.host or mine.get("NodeManagerAddress") or ray.util.get_node_ip_address()
        head = "node:__internal_head__" in (mine.get("Resources") or {})
        procs = launch_processes(options, launches, f"{self.engine}-pair{self.index}")
        for proc, role in zip(procs, ("baseline", "spec")):
            proc.host, proc.die_with_parent = host, True
            proc.env = {**proc.env, **gpu_env(options, role)}
        self.processes = list(procs)
        try:
            if options.extra.get("parallel_start"):
                for proc in procs:
                    proc.spawn()
                for proc in procs:
                    proc.wait_ready()
            else:
                for proc in procs:
                    proc.start()
        except BaseException:
            self.stop()
            raise
        return PairAddress(self.index, procs[0].url, procs[1].url, node, os.getpid(), host, head)

    def alive(self) -> bool:
        return bool(self.processes) and all(p.alive() for p in self.processes)

    def exited(self) -> dict[str, int | None]:
        """Each server's exit code by role (None: still running), so a server that died on its own is told
        from a lost node or worker (then the actor does not answer at all)."""
        return {role: (None if proc.alive() else (proc.process.poll() if proc.process is not None else -1))
                for proc, role in zip(self.processes, ("baseline", "spec"))}

    def logs(self) -> dict[str, str]:
        """Each server's log, for the run's report directory on the machine that started the run."""
        out = {}
        for p in self.processes:
            if p.log_path is not None and Path(p.log_path).is_file():
                out[Path(p.log_path).name] = Path(p.log_path).read_text(encoding="utf-8", errors="replace")
        return out

    def stop(self) -> None:
        for p in self.processes:
            p.stop()


@dataclass
class ShardRun:
    """One shard's part: the pair it ran on, its directory, how it ended."""

    plan: ShardPlan
    pair: int
    report_dir: str
    exit_code: int | None = None
    error: str | None = None
    retry_of: str | None = None

    @property
    def name(self) -> str:
        return f"{'rerun of ' if self.plan.part == 'retry' else ''}shard {self.plan.shard.label}"

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.plan.shard.label, "part": self.plan.part, "pair": self.pair, "report": self.report_dir,
                "selected": len(self.plan.runs), "calibration": len(self.plan.calibrates),
                "exit_code": self.exit_code, "error": self.error, "cause": self.plan.cause,
                "keeps_errors": self.plan.keep_errors}


@dataclass
class Fleet:
    """The pairs of one Ray run and what became of them."""

    pairs: list[PairAddress]
    actors: list[Any] = field(default_factory=list)
    #: Pairs lost (or never up), and how.
    losses: dict[int, PairLoss] = field(default_factory=dict)
    runs: list[ShardRun] = field(default_factory=list)
    started_s: float = 0.0

    @property
    def lost(self) -> set[int]:
        return set(self.losses)

    def to_json(self) -> dict[str, Any]:
        return {"pairs": [p.to_json() for p in self.pairs], "lost_pairs": sorted(self.lost),
                "losses": {str(i): loss.what for i, loss in sorted(self.losses.items())},
                "shards": [r.to_json() for r in self.runs], "pairs_started_s": round(self.started_s, 3)}


def start_pairs(ray: Any, setup: GateSetup, options: RayOptions, say: Callable[[str], None]) -> Fleet:
    """The server pairs: the URL pairs given, or one :class:`ServerPair` actor per pair, started side by side."""
    eo = setup.engine_options
    if eo.baseline_urls:
        return Fleet([PairAddress(i, b, s) for i, (b, s) in enumerate(zip(eo.baseline_urls, eo.spec_urls))])
    count = options.pairs or max(1, sum(1 for n in ray.nodes() if n.get("Alive")))
    actor_cls = ray.remote(ServerPair)
    t0 = time.perf_counter()
    actors = [actor_cls.options(num_cpus=1, num_gpus=options.gpus_per_pair, scheduling_strategy="SPREAD",
                                max_restarts=0).remote(setup.engine_spec, dataclasses.replace(eo, log_dir=None), i,
                                                        options.server_host)
              for i in range(count)]
    say(f"ray: launching {count} server pair(s) of --preset {eo.preset or '(default)'}")
    pairs, failed = [], []
    for i, actor in enumerate(actors):
        try:
            pairs.append(ray.get(actor.start.remote()))
        except Exception as exc:  # noqa: BLE001 - a pair that did not come up serves no shard
            failed.append(f"pair {i}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    fleet = Fleet(pairs, actors)
    fleet.losses = {i: PairLoss("it did not come up") for i in range(count) if not any(p.index == i for p in pairs)}
    fleet.started_s = time.perf_counter() - t0
    if not pairs:
        stop_pairs(ray, fleet, None)
        raise RuntimeError("ray: no server pair came up: " + "; ".join(failed))
    for line in failed:
        say(f"ray: {line}")
    return fleet


@dataclass(frozen=True)
class PairLoss:
    """How a server pair was lost: its node or worker (``server`` None: the actor did not answer, or neither
    server does), or one of its servers (``baseline`` or ``spec``) exited or stopped answering while the rest
    ran — an engine failure the run keeps (:attr:`ShardPlan.keep_errors`), never one it reruns away."""

    what: str
    server: str | None = None

    @property
    def server_exited(self) -> bool:
        return self.server is not None


def pair_loss(ray: Any, fleet: Fleet, index: int) -> PairLoss | None:
    """Whether pair ``index`` still serves (None), else how it was lost: its actor answers which of its servers
    exited (URL pairs: which do not answer ``/health``)."""
    if index in fleet.losses:
        return fleet.losses[index]
    if fleet.actors:
        try:
            exited = ray.get(fleet.actors[index].exited.remote(), timeout=ALIVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the actor or its node is gone (ActorDiedError, GetTimeoutError …)
            return PairLoss(f"its node or worker was lost ({type(exc).__name__})")
        down = {role: code for role, code in exited.items() if code is not None}
    else:
        pair = next(p for p in fleet.pairs if p.index == index)
        down = {role: problem for role, problem in (("baseline", _unhealthy(pair.baseline_url)),
                                                    ("spec", _unhealthy(pair.spec_url))) if problem}
        if len(down) == 2:
            return PairLoss(f"neither of its servers answers ({down['baseline']}; {down['spec']}): its machine or "
                            "network was lost")
    if not down:
        return None
    role = "spec" if "spec" in down else "baseline"
    server = "speculative server" if role == "spec" else "baseline server"
    how = f"exited with code {down[role]}" if fleet.actors else f"stopped answering ({down[role]})"
    return PairLoss(f"its {server} {how} while its node ran", role)


def _unhealthy(url: str) -> str | None:
    """Why the server at ``url`` does not answer ``/health`` (None: it does)."""
    from specparity.engines.server.http import Endpoint, ServerError
    from specparity.engines.server.launch import health_ok

    endpoint = Endpoint(url, read_timeout_s=10.0, connect_timeout_s=5.0, connect_retries=0)
    try:
        return health_ok(endpoint)
    except ServerError as exc:
        return str(exc)
    finally:
        endpoint.close()


def stop_pairs(ray: Any, fleet: Fleet, logs_to: Path | None) -> None:
    """Stop every pair actor (and with it its servers), keeping their logs under ``logs_to``."""
    for i, actor in enumerate(fleet.actors):
        try:
            if logs_to is not None:
                for name, text in ray.get(actor.logs.remote(), timeout=ALIVE_TIMEOUT_S).items():
                    logs_to.mkdir(parents=True, exist_ok=True)
                    (logs_to / name).write_text(text, encoding="utf-8")
            ray.get(actor.stop.remote(), timeout=ALIVE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a lost actor has nothing left to stop
            pass
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001
            pass


def shard_setup(setup: GateSetup, plan: ShardPlan, prompts: Sequence[Prompt], calibration: Sequence[Prompt] | None,
                pair: PairAddress, report_dir: str) -> GateSetup:
    """The whole run's setup narrowed to one part: its prompts, its journal directory, pair ``pair``'s URLs."""
    options = dataclasses.replace(setup.engine_options, baseline_urls=(pair.baseline_url,), spec_urls=(pair.spec_url,),
                                  preset=None, log_dir=str(Path(report_dir) / "servers"))
    config = dataclasses.replace(setup.config, shard=plan.shard, report_dir=report_dir)
    return dataclasses.replace(setup, engine_options=options, config=config, prompts=list(prompts),
                               calibration=list(calibration) if calibration is not None else None, plan=plan,
                               resume=None)


def _run_part(setup: GateSetup, part: ShardRun, say: Callable[[str], None]) -> None:
    from specparity.run.gate_command import execute

    try:
        result = execute(setup)
        part.exit_code = result.decision.exit_code
        say(f"ray: {part.name} on pair {part.pair}: {result.decision.status} (the part's own verdict)")
    except Exception as exc:  # noqa: BLE001 - the part's journal keeps what finished; the merge says the rest
        part.error = f"{type(exc).__name__}: {exc}"
        say(f"ray: {part.name} on pair {part.pair}: {part.error}")


def _shard_journal(report_dir: str) -> bool:
    """Whether ``report_dir`` holds a shard's journal (its ``shard`` line written)."""
    try:
        return "shard" in read_journal(Path(report_dir) / JOURNAL).last
    except JournalError:
        return False


def unfinished(report_dir: str, plan: ShardPlan) -> tuple[list[str], list[str]]:
    """What a part left unfinished: selected prompts without a verdict or with an ``error``, and calibration
    prompts without a measured baseline (read from its journal; everything when it holds none)."""
    try:
        journal = read_journal(Path(report_dir) / JOURNAL)
    except JournalError:
        return list(plan.runs), list(plan.calibrates)

    def measured(line: dict[str, Any] | None) -> bool:
        base = (line or {}).get("baseline") or {}
        return bool(base) and not base.get("error") and (line or {}).get("baseline_tf") is not None

    runs = [pid for pid in plan.runs
            if ((journal.judged.get(pid) or {}).get("verdict") or {}).get("class") in (None, "error")]
    calibrates = [pid for pid in plan.calibrates if pid in runs or (
        pid not in plan.runs and not measured(journal.calibration.get(pid) or journal.baselines.get(pid)))]
    return runs, calibrates


def run_on_ray(setup: GateSetup, options: RayOptions, say: Callable[[str], None]) -> tuple[MergedRun, Fleet]:
    """The whole run over the cluster at ``options.address``: pairs up, one shard each, reruns of what a lost
    pair left, the merge into ``setup.config.report_dir`` (the verdict line and reports are the caller's)."""
    ray = require_ray()
    check_ray_options(setup, options)
    out = Path(setup.config.report_dir or ".")
    ray.init(address=options.address, log_to_driver=False)
    fleet: Fleet | None = None
    try:
        fleet = start_pairs(ray, setup, options, say)
        pairs = fleet.pairs
        replace_whole(out / "ray.json", json.dumps(fleet.to_json(), indent=1))
        count = len(pairs)
        work: list[tuple[GateSetup, ShardRun]] = []
        for slot, pair in enumerate(pairs):
            config = dataclasses.replace(setup.config, shard=Shard(slot, count))
            try:
                plan, prompts, calibration = shard_share(config, setup.prompts, setup.calibration)
            except BadInput:
                continue  # a shard that holds no prompt: nothing to run on this pair
            report_dir = str(out / "shards" / str(slot))
            part = ShardRun(plan, pair.index, report_dir)
            work.append((shard_setup(setup, plan, prompts, calibration, pair, report_dir), part))
        fleet.runs = [part for _, part in work]
        _side_by_side(work, say)
        retries = _retries(ray, setup, fleet, [part for _, part in work], say)
        if retries:
            fleet.runs += [part for _, part in retries]
            _side_by_side(retries, say)
        replace_whole(out / "ray.json", json.dumps(fleet.to_json(), indent=1))
        # a part whose pair was gone before its engine started left no shard journal (none, or only how it
        # ended): its rerun holds every prompt of it, and the merge reads the rerun alone
        rerun = {part.retry_of for part in fleet.runs if part.retry_of}
        merged = merge_dirs([part.report_dir for part in fleet.runs
                             if part.report_dir not in rerun or _shard_journal(part.report_dir)], str(out),
                            tokenizer=setup.engine_options.extra.get("tokenizer"))
        return merged, fleet
    finally:
        if fleet is not None:
            stop_pairs(ray, fleet, out / "servers")
        ray.shutdown()


def _side_by_side(work: Sequence[tuple[GateSetup, ShardRun]], say: Callable[[str], None]) -> None:
    """Run every part at once, one thread each; on Ctrl-C stop waiting at once (the caller then stops
    the pairs, and the parts' requests end with their servers; their journals keep what finished)."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(work)), thread_name_prefix="specparity-shard")
    try:
        for future in [pool.submit(_run_part, s, part, say) for s, part in work]:
            future.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _retries(ray: Any, setup: GateSetup, fleet: Fleet, parts: Sequence[ShardRun],
             say: Callable[[str], None]) -> list[tuple[GateSetup, ShardRun]]:
    """For each part whose pair was lost: a rerun of what it left unfinished on another live pair (once). A pair
    lost to one of its servers exiting keeps its ``error`` verdicts (the rerun is shown beside them); only a
    lost node or worker is rerun away."""
    for part in parts:
        loss = pair_loss(ray, fleet, part.pair)
        if loss is not None:
            fleet.losses[part.pair] = loss
    live = [p for p in fleet.pairs if p.index not in fleet.lost]
    by_id = {p.id: p for p in setup.prompts}
    calibration_by_id = {p.id: p for p in setup.calibration or []}
    out: list[tuple[GateSetup, ShardRun]] = []
    for n, part in enumerate(p for p in parts if p.pair in fleet.lost):
        runs, calibrates = unfinished(part.report_dir, part.plan)
        if not runs and not calibrates:
            continue
        if not live:
            say(f"ray: pair {part.pair} was lost ({fleet.losses[part.pair].what}) and no pair is left to rerun shard "
                f"{part.plan.shard.label}: "
                f"{len(runs)} prompt(s) stay unfinished")
            continue
        pair = live[n % len(live)]
        loss = fleet.losses[part.pair]
        plan = part.plan.retry(runs, calibrates, f"pair {part.pair}: {loss.what}", keep_errors=loss.server_exited)
        calibration = ([calibration_by_id[pid] for pid in calibrates]
                       if setup.calibration is not None else None)
        report_dir = f"{part.report_dir}-retry"
        retry = ShardRun(plan, pair.index, report_dir, retry_of=part.report_dir)
        say(f"ray: pair {part.pair} was lost ({loss.what}); rerunning {len(runs)} prompt(s) and {len(calibrates)} "
            f"calibration prompt(s) of shard {part.plan.shard.label} on pair {pair.index}"
            + ("; its error verdicts stand" if loss.server_exited else ""))
        out.append((shard_setup(setup, plan, [by_id[pid] for pid in runs], calibration, pair, report_dir), retry))
    return out
