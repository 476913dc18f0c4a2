"""``specparity run --ray``: a shard per server pair on a Ray cluster, a lost worker's prompts rerun.

The live test starts a cluster of two nodes on this machine (``ray start --head`` and a second node with
``ray start --address``, one CPU each, no dashboard), gates llama-server pairs the cluster launches as
actors (one per node), freezes the servers of the pair on the second node once its shard has judged a
prompt, kills the worker process holding them, and shows that nothing is lost: the prompts that shard
finished are kept, the rest rerun on the other pair, every selected prompt is judged and the merged gate
passes; the killed pair's servers died with it. Skipped only when Ray is not importable (CI installs the ``[ray]`` extra); the
cluster is always stopped (``ray stop``).

Without Ray, ``--ray`` is one line naming the extra (exit 4).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from child_signals import default_sigint
from inprocess import run_cli
from llamacpp_fixtures import require_llamacpp
from specparity.engines.server.launch import free_port
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import load_prompts

HAVE_RAY = importlib.util.find_spec("ray") is not None
CATEGORIES = ("repeat", "code", "math", "list")
#: Each shard judges its prompts one at a time, so a kill after its first verdict lands mid-run.
GATE = ("--engine", "llamacpp", "--preset", "llamacpp-ngram-simple", "--categories", ",".join(CATEGORIES),
        "--max-new-tokens", "12", "--calibration", "selected", "--concurrency", "1", "--ray-server-host", "127.0.0.1")


def test_without_ray_the_option_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, text = run_cli("run", "--ray", "auto", "--engine", "llamacpp")
    errors = [ln for ln in text.splitlines() if ln.strip()]
    assert code == exitcodes.BAD_INPUT and len(errors) == 1, text
    assert errors[0] == "specparity: error: --ray: needs Ray, which is not installed here (pip install 'specparity[ray]')"


#: The ``ray`` command of this environment.
RAY = str(Path(sys.executable).with_name("ray"))


def _ray(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, *args], capture_output=True, text=True, timeout=120, env=env,
                          preexec_fn=default_sigint)


@pytest.fixture()
def cluster():
    """A head node and a worker node on this machine; ``ray stop`` afterwards, whatever happened."""
    if not HAVE_RAY:
        pytest.skip("ray is not importable (pip install 'specparity[ray]')")
    require_llamacpp()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    temp = tempfile.mkdtemp(prefix="sp-ray-")  # short: Ray's socket paths must fit in 107 bytes
    try:
        head = _ray("start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                    "--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}", env=env)
        assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
        worker = _ray("start", f"--address=127.0.0.1:{port}", "--num-cpus=1", "--node-ip-address=127.0.0.1", env=env)
        assert worker.returncode == 0, worker.stdout[-2000:] + worker.stderr[-2000:]
        yield f"127.0.0.1:{port}", env
    finally:
        # SIGKILL to every Ray process at once; `ray stop` then polls for several seconds that they are
        # gone, which this worker need not wait for
        subprocess.Popen([RAY, "stop", "--force"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=default_sigint,
                         start_new_session=True)


def _wait_for(what: str, check, deadline: float, proc: subprocess.Popen):
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _journal(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for row in path.read_text().splitlines():
        try:
            out.append(json.loads(row))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def _children(pid: int) -> list[int]:
    """The direct child processes of ``pid`` (the pair actor's two servers), from ``/proc``."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            continue
    return out


def _refused(url: str) -> bool:
    import urllib.request

    try:
        urllib.request.urlopen(f"{url}/health", timeout=5)
    except OSError:
        return True
    return False


@pytest.mark.slow
def test_a_worker_killed_mid_run_loses_no_prompt(cluster, tmp_path):
    address, env = cluster
    report = tmp_path / "report"
    cmd = [str(Path(sys.executable).with_name("specparity")), "run", "--ray", address, *GATE, "--report", str(report)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 240
        placed = _wait_for("the pairs to start", lambda: (report / "ray.json").is_file()
                           and json.loads((report / "ray.json").read_text()), deadline, proc)
        assert len(placed["pairs"]) == 2 and len({p["node"] for p in placed["pairs"]}) == 2, placed
        victim = next(p for p in placed["pairs"] if not p["head"])
        shard_dir = report / "shards" / str(victim["index"])
        before = _wait_for("a verdict of the worker node's shard", lambda: [
            x for x in _journal(shard_dir / "results.jsonl") if x["kind"] == "prompt"], deadline, proc)
        # Freeze the pair's servers at once, so the shard cannot judge the rest of its prompts while the
        # machine is busy; then kill the worker process (its servers die with it).
        servers = _children(victim["actor_pid"])
        for pid in servers:
            os.kill(pid, signal.SIGSTOP)
        frozen = _journal(shard_dir / "results.jsonl")
        os.kill(victim["actor_pid"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == exitcodes.PASS, out[-4000:]
    wanted = [p.id for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category in CATEGORIES]
    merged = {x["prompt"]["id"]: x["verdict"] for x in _journal(report / "results.jsonl") if x["kind"] == "prompt"}
    assert sorted(merged) == sorted(wanted)
    assert all(v["class"] in ("exact", "near_tie") for v in merged.values()), merged
    fleet = json.loads((report / "ray.json").read_text())
    assert fleet["lost_pairs"] == [victim["index"]]
    parts = {(s["shard"], s["part"]): s for s in fleet["shards"]}
    label = f"{victim['index']}/2"
    assert len(servers) == 2, servers
    planned = [x for x in frozen if x["kind"] == "shard"][-1]["runs"]
    assert len([x for x in frozen if x["kind"] == "prompt"]) < len(planned), "the shard ended before the kill"
    retry = parts[(label, "retry")]
    assert retry["pair"] != victim["index"] and retry["selected"] > 0
    # what the lost pair finished was kept, the rest rerun: together the shard's prompts, once each
    shard_plan = [x for x in _journal(shard_dir / "results.jsonl") if x["kind"] == "shard"][-1]
    retry_plan = [x for x in _journal(Path(retry["report"]) / "results.jsonl") if x["kind"] == "shard"][-1]
    kept = {x["prompt"]["id"] for x in _journal(shard_dir / "results.jsonl")
            if x["kind"] == "prompt" and x["verdict"]["class"] != "error"}
    assert {x["prompt"]["id"] for x in before} <= kept
    assert kept and not kept & set(retry_plan["runs"]) and kept | set(retry_plan["runs"]) == set(shard_plan["runs"])
    assert len(retry_plan["runs"]) == retry["selected"]
    # the killed worker's servers died with it (parent-death signal), the others were stopped at the end
    assert all(_refused(victim[key]) for key in ("baseline_url", "spec_url"))
    assert all(_refused(p[key]) for p in placed["pairs"] for key in ("baseline_url", "spec_url"))
    summary = (report / "summary.md").read_text()
    assert "1 of them rerun(s) on another server pair after a pair was lost" in summary
