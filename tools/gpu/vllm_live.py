#!/usr/bin/env python3
"""The lossless gate against live vLLM servers on one GPU host: every speculative method the fixtures
can feed, eager and CUDA-graph mode, several concurrency levels against the same servers, batch
invariance, a broken speculative configuration and a server killed mid-run; then one markdown table.

Run from the checkout's root on a host where ``vllm`` runs (``tools/gpu/vllm_live.sh`` sets the
environment; ``tools/gpu/vllm-0.26.0/`` brings vLLM 0.26.0 to a host without network)::

    vllm_live.sh serve [NAME ...]      start the servers of the plan (setsid: they outlive this command)
    vllm_live.sh run   [--background]  the gate runs (matrix, batch invariance, broken config, fault)
    vllm_live.sh wait                  until a background run finished (or --timeout)
    vllm_live.sh table                 WORK/table.md and WORK/summaries/ from the journals
    vllm_live.sh stop                  stop every server this tool started

Everything lands in ``WORK`` (``--work``, default ``$SPECPARITY_LIVE_WORK`` or
``/tmp/specparity-vllm-live``): ``servers.json`` (name, port, process group, log), ``logs/``,
``reports/<run>/`` (the gate's journal and reports), ``runs.jsonl`` (one line per gate run or
comparison) and ``table.md``.

Each (mode, method) pair runs its concurrency levels one after another against the same two
servers, then ``specparity compare --old-side spec`` judges the speculative outputs of the lowest
level against each higher one. Eager pairs and graph pairs run side by side (separate baselines),
so a baseline only ever serves one gate at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[2]
FIXTURES = CHECKOUT / "fixtures" / "models"
TARGET = FIXTURES / "target"
DEFAULT_WORK = os.environ.get("SPECPARITY_LIVE_WORK", "/tmp/specparity-vllm-live")
#: Per server: a fixed KV cache (1 GiB) and a memory fraction that only vLLM's start-up check reads,
#: so that every server of the plan fits one GPU side by side.
COMMON_ARGS = ["--max-model-len", "2048", "--gpu-memory-utilization", "0.06", "--kv-cache-memory-bytes",
               str(1 << 30), "--host", "127.0.0.1"]
CONCURRENCY = (1, 8, 32)
GATE_TIMEOUT_S = 300
#: Extra arguments for every gate run (``run --gate-args "--categories math"``), set by main().
GATE_ARGS: list[str] = []
#: The acceptance floor of the broken-configuration run: a working draft of the fixture target
#: accepts 2–4.5 tokens per verify step; a draft of another model about 1.
BROKEN_FLOOR = 1.2
#: Fault run: kill the speculative server once this many prompts were judged.
KILL_AFTER_PROMPTS = 10


@dataclass
class Server:
    name: str
    mode: str  # eager | graphs | graphs-bi
    method: str  # baseline, ngram, draft_model, dflash, ...
    port: int
    model: str
    spec: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    purpose: str = "matrix"  # matrix | broken | fault | attempt
    pid: int | None = None
    log: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        a = ["vllm", "serve", self.model, "--port", str(self.port), *COMMON_ARGS]
        if self.mode == "eager":
            a.append("--enforce-eager")
        if self.spec:
            a += ["--speculative-config", json.dumps(self.spec, separators=(",", ":"))]
        return a


def plan(work: Path) -> list[Server]:
    """Every server the runs need. Methods the fixtures feed: ngram and ngram_gpu (no draft),
    draft_model (fixtures/models/draft), dflash (fixtures/models/dflash1), eagle3
    (fixtures/models/eagle3); attempts whose launch
    outcome is itself the result: dflash with the DFlash2 draft, suffix, MTP on the GDN hybrid."""
    draft, dflash1, dflash2 = str(FIXTURES / "draft"), str(FIXTURES / "dflash1"), str(FIXTURES / "dflash2")
    eagle3 = str(FIXTURES / "eagle3")
    hybrid = str(FIXTURES / "hybrid")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    specs = {
        "ngram": ngram,
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 4},
        "dflash": {"method": "dflash", "model": dflash1, "num_speculative_tokens": 7},
        "ngram_gpu": {**ngram, "method": "ngram_gpu"},
        "eagle3": {"method": "eagle3", "model": eagle3, "num_speculative_tokens": 4},
    }
    t = str(TARGET)
    dev = {"VLLM_SERVER_DEV_MODE": "1"}
    bi = {**dev, "VLLM_BATCH_INVARIANT": "1"}
    out = [Server("e-baseline", "eager", "baseline", 8100, t, env=dev)]
    out += [Server(f"e-{m}", "eager", m, 8101 + i, t, s, env=dev) for i, (m, s) in enumerate(specs.items())]
    out += [
        Server("e-suffix", "eager", "suffix", 8115, t, {"method": "suffix", "num_speculative_tokens": 4}, dev,
               "attempt"),
        Server("e-dflash2", "eager", "dflash2", 8116, t, {"method": "dflash", "model": dflash2,
                                                           "num_speculative_tokens": 7}, dev, "attempt"),
        Server("e-broken", "eager", "draft_model (another model)", 8117, t,
               {"method": "draft_model", "model": str(work / "other-draft"), "num_speculative_tokens": 4}, dev,
               "broken"),
        Server("e-victim", "eager", "ngram", 8118, t, ngram, dev, "fault"),
        Server("e-hybrid", "eager", "baseline", 8120, hybrid, None, dev, "attempt"),
        Server("e-mtp", "eager", "mtp", 8121, hybrid, {"method": "mtp", "num_speculative_tokens": 2}, dev, "attempt"),
    ]
    out.append(Server("g-baseline", "graphs", "baseline", 8200, t, env=dev))
    out += [Server(f"g-{m}", "graphs", m, 8201 + i, t, s, env=dev) for i, (m, s) in enumerate(specs.items())]
    out.append(Server("bi-baseline", "graphs-bi", "baseline", 8300, t, env=bi))
    out.append(Server("bi-ngram", "graphs-bi", "ngram", 8301, t, ngram, env=bi))
    return out


# ---------------------------------------------------------------------------------------------- servers


def health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except Exception:  # noqa: BLE001 - any failure: not healthy
        return None


def ready(s: Server | None, timeout_s: float = 300.0) -> bool:
    """Whether a server answers /health, waiting while its process still starts (CUDA-graph
    servers compile for a minute or more)."""
    if s is None:
        return False
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if health(s.url) == 200:
            return True
        if not alive(s.pid):
            return False
        time.sleep(2)
    return health(s.url) == 200


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def load_servers(work: Path) -> dict[str, Server]:
    path = work / "servers.json"
    if not path.exists():
        return {}
    return {d["name"]: Server(**d) for d in json.loads(path.read_text())}


def save_servers(work: Path, servers: dict[str, Server]) -> None:
    (work / "servers.json").write_text(json.dumps([asdict(s) for s in servers.values()], indent=1))


def make_other_draft(work: Path) -> Path:
    """A draft of another model for the broken-configuration run: the fixture draft's architecture
    and tokenizer with freshly initialised weights (seed 0) — it shares nothing with the target."""
    out = work / "other-draft"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    src = FIXTURES / "draft"
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def serve(work: Path, names: list[str], wait_s: float) -> int:
    (work / "logs").mkdir(parents=True, exist_ok=True)
    servers = load_servers(work)
    wanted = [s for s in plan(work) if not names or s.name in names]
    if any(s.purpose == "broken" for s in wanted):
        try:
            make_other_draft(work)
        except Exception as exc:  # noqa: BLE001 - reported, the other servers still start
            print(f"SERVE other-draft: could not be built ({type(exc).__name__}: {exc})")
    for s in wanted:
        old = servers.get(s.name)
        if old is not None and alive(old.pid):
            print(f"SERVE {s.name}: already running (pid {old.pid})")
            continue
        s.log = str(work / "logs" / f"server-{s.name}.log")
        env = {**os.environ, **s.env}
        with open(s.log, "w") as log:
            log.write("$ " + " ".join(s.argv()) + "\n")
            log.flush()
            proc = subprocess.Popen(s.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=CHECKOUT, start_new_session=True)
        s.pid = proc.pid
        servers[s.name] = s
    save_servers(work, servers)
    t0 = time.time()
    pending = list(wanted)
    while pending and time.time() - t0 < wait_s:
        pending = [s for s in pending if health(servers[s.name].url) != 200 and alive(servers[s.name].pid)]
        time.sleep(2)
    print(f"SERVE: {time.time() - t0:.0f} s")
    for s in wanted:  # the launch outcome, for the table (a server that did not start is a result too)
        s = servers[s.name]
        ok = health(s.url) == 200
        record(work, {"kind": "launch", "run": s.name, "mode": s.mode, "method": s.method, "healthy": ok,
                      "spec": s.spec, "error": None if ok else launch_error(log_path(work, s))})
    return print_status(work)


def print_status(work: Path) -> int:
    servers = load_servers(work)
    for s in servers.values():
        h = health(s.url)
        state = "healthy" if h == 200 else ("starting" if alive(s.pid) else "exited")
        print(f"SERVER {s.name:14s} {s.mode:9s} {s.method:28s} :{s.port} {state}")
        if state == "exited" and s.log:
            print("   " + " | ".join(launch_error(Path(s.log))))
    return 0


def log_path(work: Path, s: Server) -> Path:
    """A server's log, also when WORK was moved (an unpacked archive)."""
    path = Path(s.log or "")
    return path if path.exists() else work / "logs" / path.name


def launch_error(log: Path, n: int = 3) -> list[str]:
    """The last error lines of a server log (why a launch failed)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ["(no log)"]
    hits = []
    for line in lines:
        if "ulimit" in line or not any(w in line for w in ("Error:", "error:", "not supported", "is required")):
            continue
        text = re.sub(r"^\(\w+ pid=\d+\)\s*", "", line)  # vLLM's "(APIServer pid=N) LEVEL date [file:line] "
        text = re.sub(r"^(INFO|WARNING|ERROR|DEBUG) \S+ \S+ \[[^\]]+\]\s*", "", text).strip()
        hits.append(text.split(" Supported architectures:")[0][:300])  # not the registry's 400 names
    return hits[-n:] or [line[:300] for line in lines[-n:]]


def stop(work: Path) -> int:
    for s in load_servers(work).values():
        if alive(s.pid):
            try:
                os.killpg(s.pid, signal.SIGTERM)
            except OSError:
                pass
    return 0


# ---------------------------------------------------------------------------------------------- gate runs


def record(work: Path, row: dict[str, Any]) -> None:
    with open(work / "runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def gate(work: Path, name: str, base: Server, spec: Server, concurrency: int, *extra: str,
         label: dict[str, Any] | None = None) -> dict[str, Any]:
    """One ``pytest suites/lossless`` run against two running servers; its row for runs.jsonl."""
    report = work / "reports" / name
    if report.exists():
        shutil.rmtree(report)
    argv = [sys.executable, "-m", "pytest", "suites/lossless", "-q", "-p", "no:cacheprovider", "--engine", "vllm",
            "--baseline-url", base.url, "--spec-url", spec.url, "--engine-opt", f"tokenizer={base.model}",
            "--engine-opt", f"max_concurrency={max(CONCURRENCY)}", "--concurrency", str(concurrency),
            "--report", str(report), *GATE_ARGS, *extra]
    t0 = time.time()
    with open(work / "logs" / f"gate-{name}.txt", "w") as out:
        try:
            rc = subprocess.run(argv, cwd=CHECKOUT, stdout=out, stderr=subprocess.STDOUT,
                                timeout=GATE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row = {"kind": "gate", "run": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "concurrency": concurrency,
           "baseline": base.name, "spec": spec.name, "args": list(extra), **(label or {})}
    row.update(journal_summary(report / "results.jsonl"))
    record(work, row)
    print(f"GATE {name}: rc={rc} {row.get('status')} {row.get('counts')} in {row['wall_s']} s", flush=True)
    return row


def journal_summary(path: Path) -> dict[str, Any]:
    """Verdict, class counts, counters, threshold and timings from a gate journal."""
    if not path.exists():
        return {"status": "no journal"}
    out: dict[str, Any] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        kind = r.get("kind")
        if kind == "verdict":
            out.update(status=r.get("status"), counts=r.get("counts"), failures=r.get("failures"),
                       warnings=r.get("warnings"))
        elif kind == "aggregate_counters":
            out["counters"] = {k: r.get(k) for k in ("proposed", "accepted", "verify_steps", "error")}
        elif kind == "threshold":
            noise, cross = r.get("noise") or {}, r.get("cross_instance") or {}
            out["threshold"] = {"nats": r.get("nats"), "drift_nats": r.get("drift_nats"),
                                "noise_max": noise.get("max_abs_delta"), "cross_max": cross.get("max_abs_delta"),
                                "cross_note": r.get("cross_instance_note"), "description": r.get("description")}
        elif kind == "run":
            fp = r.get("fingerprint") or {}
            out["engine"] = {"version": fp.get("engine_version"), "dtype": fp.get("dtype"),
                             "spec_config": fp.get("spec_config"),
                             "deterministic": (r.get("capabilities") or {}).get("deterministic")}
        elif kind == "prompt":
            out["judged"] = out.get("judged", 0) + 1
    c = out.get("counters") or {}
    if c.get("verify_steps"):
        out["accept_length"] = round(1 + (c.get("accepted") or 0) / c["verify_steps"], 2)
    return out


def compare(work: Path, old: str, new: str) -> dict[str, Any]:
    """``specparity compare OLD NEW --old-side spec``: the speculative outputs of two levels."""
    argv = [sys.executable, "-c", "import sys; from specparity.cli.commands import main; sys.exit(main())", "compare",
            str(work / "reports" / old), str(work / "reports" / new), "--old-side", "spec", "--json"]
    p = subprocess.run(argv, cwd=CHECKOUT, capture_output=True, text=True, timeout=120)
    (work / "logs" / f"compare-{old}-vs-{new}.txt").write_text(p.stdout + p.stderr)
    row = {"kind": "compare", "old": old, "new": new, "rc": p.returncode}
    try:
        data = json.loads(p.stdout)
        row["status"] = data.get("status") or ("PASS" if data.get("passed") else "FAIL")
        row["counts"] = data.get("counts")
    except ValueError:
        row["status"] = f"rc {p.returncode}"
        row["tail"] = (p.stdout + p.stderr)[-400:]
    record(work, row)
    print(f"COMPARE {old} vs {new}: {row['status']} {row.get('counts')}", flush=True)
    return row


def pair_runs(work: Path, servers: dict[str, Server], mode: str, levels: tuple[int, ...],
              methods: set[str] | None = None) -> None:
    """Every healthy speculative server of ``mode`` against the baseline of the same model (the
    fixture target, or the hybrid for MTP), at each level, then the comparisons between levels."""
    bases = [s for s in servers.values() if s.mode == mode and s.method == "baseline" and ready(s)]
    if not bases:
        print(f"RUN {mode}: no healthy baseline, nothing run", flush=True)
        return
    for s in servers.values():
        if s.mode != mode or s.method == "baseline" or s.purpose not in ("matrix", "attempt"):
            continue
        if methods and s.method not in methods:
            continue
        base = next((b for b in bases if b.model == s.model), None)
        if base is None:
            print(f"RUN {s.name}: no healthy baseline of {s.model}, skipped", flush=True)
            continue
        if not ready(s):
            print(f"RUN {s.name}: not healthy, skipped", flush=True)
            continue
        names = []
        for n in levels:
            name = f"{s.name}-c{n}"
            gate(work, name, base, s, n, label={"mode": mode, "method": s.method})
            names.append(name)
        for other in names[1:]:
            compare(work, names[0], other)


def batch_invariant_run(work: Path, servers: dict[str, Server]) -> None:
    base, spec = servers.get("bi-baseline"), servers.get("bi-ngram")
    if not ready(base) or not ready(spec):
        print("RUN batch invariance: servers not healthy, skipped", flush=True)
        return
    gate(work, "bi-ngram-c8", base, spec, 8, label={"mode": "graphs + VLLM_BATCH_INVARIANT=1", "method": "ngram"})


def broken_run(work: Path, servers: dict[str, Server]) -> None:
    base, spec = servers.get("e-baseline"), servers.get("e-broken")
    if not ready(base) or not ready(spec):
        why = "not started" if not spec else ("healthy" if health(spec.url) == 200 else "refused to start: " +
                                              " | ".join(launch_error(Path(spec.log or ""))))
        record(work, {"kind": "note", "run": "e-broken", "status": f"broken config {why}"})
        print(f"RUN broken: {why}", flush=True)
        return
    policy = work / "floor.toml"
    policy.write_text(f"[gate]\nmin_accept_length = {BROKEN_FLOOR}\n")
    gate(work, "e-broken-c8", base, spec, 8, "--policy", str(policy),
         label={"mode": "eager", "method": spec.method, "note": f"acceptance floor {BROKEN_FLOOR}"})


def fault_run(work: Path, servers: dict[str, Server]) -> None:
    """Kill the live speculative server (its whole process group, SIGKILL) once some prompts were
    judged: the journal must keep them, the rest must be ``error``, the gate must exit 1 promptly."""
    base, victim = servers.get("e-baseline"), servers.get("e-victim")
    if not ready(base) or not ready(victim):
        print("RUN fault: servers not healthy, skipped", flush=True)
        return
    name = "e-fault-c1"
    report = work / "reports" / name
    journal = report / "results.jsonl"
    killed: dict[str, Any] = {}

    def killer() -> None:
        t0 = time.time()
        while time.time() - t0 < GATE_TIMEOUT_S:
            n = sum(1 for line in journal.read_text().splitlines() if '"kind": "prompt"' in line) \
                if journal.exists() else 0
            if n >= KILL_AFTER_PROMPTS:
                killed.update(at=time.time(), judged_before=n)
                os.killpg(victim.pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    row = gate(work, name, base, victim, 1, label={"mode": "eager", "method": "ngram (server killed)"})
    th.join(timeout=5)
    if killed:
        end = time.time()
        row2 = {"kind": "fault", "run": name, "judged_before_kill": killed["judged_before"],
                "gate_exit_after_kill_s": round(end - killed["at"], 1), "rc": row["rc"],
                "counts": row.get("counts"), "status": row.get("status")}
    else:
        row2 = {"kind": "fault", "run": name, "status": "server not killed (too few prompts judged)", "rc": row["rc"]}
    record(work, row2)
    print(f"FAULT: {row2}", flush=True)


def preset_run(work: Path, preset: str, *extra: str) -> int:
    """The gate launching both servers itself (``--preset``) on the fixture target, eager, with
    ``per_request_metrics=summary`` asked for: a vLLM without that flag must still launch (the adapter
    drops it and says so) and both launches must fit one GPU with the preset's memory fraction."""
    name = f"preset-{preset}"
    report = work / "reports" / name
    if report.exists():
        shutil.rmtree(report)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pytest", "suites/lossless", "-q", "-p", "no:cacheprovider", "--engine", "vllm",
            "--preset", preset, "--target", str(TARGET), "--engine-opt", "per_request_metrics=summary",
            "--engine-opt", "server_args=--enforce-eager --max-model-len 2048", "--engine-opt", "startup_timeout=300",
            "--report", str(report), *GATE_ARGS, *extra]
    t0 = time.time()
    with open(work / "logs" / f"gate-{name}.txt", "w") as out:
        try:
            rc = subprocess.run(argv, cwd=CHECKOUT, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row = {"kind": "gate", "run": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "concurrency": 8,
           "mode": "eager, both launched by the gate", "method": f"ngram (--preset {preset})"}
    row.update(journal_summary(report / "results.jsonl"))
    record(work, row)
    print(f"GATE {name}: rc={rc} {row.get('status')} {row.get('counts')} in {row['wall_s']} s", flush=True)
    return 0 if rc == 0 else 1


def probe_scoring(work: Path, prompts: int = 3) -> int:
    """Score the same tokens on every healthy server of the fixture target: each server's
    ``prompt_logprobs`` argmax against the tokens a baseline decoded (a scorer the gate cannot use
    shows here, with the bodies kept under WORK/probe/ for a look or a test)."""
    sys.path.insert(0, str(CHECKOUT))
    from specparity.engines.server.engine import HFTokenizer
    from specparity.engines.server.vllm_wire import completion_body

    servers = [s for s in load_servers(work).values() if s.model == str(TARGET) and health(s.url) == 200]
    ref = next((s for s in servers if s.method == "baseline"), None)
    if ref is None:
        print("PROBE: no healthy baseline of the fixture target")
        return 1
    out = work / "probe"
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(str(TARGET))
    rows = [r for r in (json.loads(line) for line in (CHECKOUT / "prompts" / "default.jsonl").read_text().splitlines()
                        if line.strip()) if "id" in r][:prompts]
    model = json.loads(urllib.request.urlopen(ref.url + "/v1/models", timeout=30).read())["data"][0]["id"]

    def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=120).read())

    for row in rows:
        ids = tok.encode_prompt(row.get("prompt"), row.get("messages"))
        body = completion_body(model, ids, int(row.get("max_new_tokens", 48)), tok.stop_token_ids(), logprobs=None,
                               top_k=0)
        cont = post(ref.url, body)["choices"][0]["token_ids"]
        score = completion_body(model, ids + cont, 1, (), logprobs=None, top_k=0, prompt_logprobs=1)
        for s in servers:
            try:
                answer = post(s.url, score)
            except Exception as exc:  # noqa: BLE001 - reported per server
                print(f"PROBE {row['id']} {s.name}: {type(exc).__name__}: {exc}")
                continue
            pl = answer["choices"][0]["prompt_logprobs"]
            top = [max(r.items(), key=lambda kv: kv[1]["logprob"])[0] for r in pl[len(ids):]]
            agree = sum(int(a) == b for a, b in zip(top, cont))
            (out / f"{s.name}-{row['id']}.json").write_text(json.dumps({"request": score, "response": answer}))
            r = {"kind": "probe", "run": f"probe-{s.name}-{row['id']}", "server": s.name, "mode": s.mode,
                 "method": s.method, "prompt": row["id"], "argmax_equal": agree, "positions": len(cont),
                 "first_rows_argmax": top[:8], "tokens": cont[:8]}
            record(work, r)
            print(f"PROBE {row['id']} {s.name:14s} argmax = baseline's token at {agree}/{len(cont)}", flush=True)
    return 0


def run_all(work: Path, levels: tuple[int, ...], methods: set[str] | None = None) -> int:
    """The matrix of both modes side by side; with ``methods``, only those methods' pairs (no broken-config,
    fault or batch-invariance run)."""
    servers = load_servers(work)
    (work / "logs").mkdir(parents=True, exist_ok=True)

    def eager_runs() -> None:
        pair_runs(work, servers, "eager", levels, methods)
        if not methods:
            broken_run(work, servers)
            fault_run(work, servers)

    def graph_runs() -> None:
        pair_runs(work, servers, "graphs", levels, methods)
        if not methods:
            batch_invariant_run(work, servers)

    eager = threading.Thread(target=eager_runs)
    graphs = threading.Thread(target=graph_runs)
    try:
        eager.start()
        graphs.start()
        eager.join()
        graphs.join()
        return table(work)
    finally:  # `wait` returns once this exists, also after a crash (the log says why)
        (work / "run.done").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


# ---------------------------------------------------------------------------------------------- table


def table(work: Path) -> int:
    rows = [json.loads(line) for line in (work / "runs.jsonl").read_text().splitlines()] \
        if (work / "runs.jsonl").exists() else []
    gates = [r for r in rows if r["kind"] == "gate"]
    order = {"eager": 0, "graphs": 1}
    gates.sort(key=lambda r: (r.get("purpose_rank", 0), str(r.get("method")), order.get(r.get("mode"), 2),
                              r.get("concurrency") or 0))
    for r in gates:  # the journal is the record: re-read it (a newer summary reads more of it)
        journal = work / "reports" / r["run"] / "results.jsonl"
        if journal.exists():
            r.update(journal_summary(journal))
    lines = ["| method | mode | concurrency | verdict | exact / near_tie / drifted / diverged / error | "
             "accepted / proposed (verify steps) | accept length | noise in one server / between the two, "
             "threshold (nats) | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in gates:
        c = r.get("counts") or {}
        counts = " / ".join(str(c.get(k, "?")) for k in ("exact", "near_tie", "drifted", "diverged", "error"))
        k = r.get("counters") or {}
        acc = f"{k.get('accepted')} / {k.get('proposed')} ({k.get('verify_steps')})" if k else "n/a"
        t = r.get("threshold") or {}
        noise = (f"{_g(t.get('noise_max'))} / {_g(t.get('cross_max'))}, {_g(t.get('nats'))}"
                 if t and t.get("nats") is not None else "n/a")
        verdict = r.get("status") or f"rc {r.get('rc')}"
        lines.append(f"| {r.get('method')} | {r.get('mode')} | {r.get('concurrency')} | {verdict} (exit {r.get('rc')}) | "
                     f"{counts} | {acc} | {r.get('accept_length', 'n/a')} | {noise} | {r.get('wall_s')} |")
    comps = [r for r in rows if r["kind"] == "compare"]
    if comps:
        lines += ["", "| speculative outputs, lower vs higher concurrency | verdict | counts |", "|---|---|---|"]
        for r in comps:
            lines.append(f"| {r['old']} → {r['new']} | {r['status']} (exit {r['rc']}) | {r.get('counts')} |")
    probes = [r for r in rows if r["kind"] == "probe"]
    if probes:
        lines += ["", "| scoring probe: server | mode | prompt | prompt_logprobs argmax = the baseline's token |",
                  "|---|---|---|---|"]
        lines += [f"| {r['server']} | {r['mode']} | {r['prompt']} | {r['argmax_equal']} / {r['positions']} |"
                  for r in probes]
    other = [r for r in rows if r["kind"] in ("fault", "note")]
    if other:
        lines += [""] + [f"- {r['kind']} {r.get('run')}: " + json.dumps({k: v for k, v in r.items()
                                                                          if k not in ('kind', 'run')})
                         for r in other]
    launches = {r["run"]: r for r in rows if r["kind"] == "launch"}  # the last outcome of each server
    down = [r for r in launches.values() if not r["healthy"]]
    if down:
        lines += ["", "Servers that did not start (launch outcome, the log's last error lines):"]
        lines += [f"- {r['run']} ({r['method']}, {r['mode']}, speculative config {json.dumps(r.get('spec'))}): "
                  + " | ".join(r.get("error") or []) for r in down]
    (work / "table.md").write_text("\n".join(lines) + "\n")
    summaries = work / "summaries"
    summaries.mkdir(exist_ok=True)
    for r in gates:
        src = work / "reports" / r["run"] / "summary.md"
        if src.exists():
            shutil.copy(src, summaries / f"{r['run']}.md")
    print("\n".join(lines))
    return 0


def pack(work: Path, out: Path) -> int:
    """Everything a run produced except model weights, as archives small enough to move one by one:
    ``vllm-live.tar.gz`` (logs, summaries, reports without their journals), ``journals-eager.tar.gz``
    and ``journals-other.tar.gz`` (the gate journals, ``results.jsonl``), plus the table and rows."""
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    archives = {name: tarfile.open(out / name, "w:gz")
                for name in ("vllm-live.tar.gz", "journals-eager.tar.gz", "journals-other.tar.gz")}
    for path in sorted(work.rglob("*")):
        rel = path.relative_to(work)
        if not path.is_file() or rel.parts[0] == "other-draft":
            continue
        if path.name == "results.jsonl":
            name = "journals-eager.tar.gz" if rel.parts[1].startswith("e-") else "journals-other.tar.gz"
        else:
            name = "vllm-live.tar.gz"
        archives[name].add(path, arcname=f"vllm-live/{rel}")
    for name, tar in archives.items():
        tar.close()
        print(f"PACK: {out / name} {(out / name).stat().st_size // 1024} KiB")
    for name in ("table.md", "runs.jsonl"):
        if (work / name).exists():
            shutil.copy(work / name, out / name)
    return 0


def _g(x: Any) -> str:
    return "n/a" if x is None else f"{float(x):.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=DEFAULT_WORK)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("names", nargs="*")
    p.add_argument("--wait", type=float, default=420.0, help="seconds to wait for /health")
    sub.add_parser("status")
    p = sub.add_parser("run")
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--background", action="store_true", help="detach (setsid) and return at once")
    p.add_argument("--gate-args", default="", help="extra arguments for every gate run, as one string")
    p.add_argument("--methods", default="", help="only these methods' pairs, comma-separated (e.g. eagle3)")
    p = sub.add_parser("wait")
    p.add_argument("--timeout", type=float, default=540.0)
    sub.add_parser("table")
    p = sub.add_parser("preset", help="the gate launching both servers with a vllm preset (both on this GPU)")
    p.add_argument("name", nargs="?", default="vllm-ngram")
    p = sub.add_parser("probe", help="score the same tokens on every healthy server (prompt_logprobs argmax)")
    p.add_argument("--prompts", type=int, default=3)
    p = sub.add_parser("pack")
    p.add_argument("out", help="folder for vllm-live.tar.gz (journals, logs, summaries), table.md and runs.jsonl")
    sub.add_parser("stop")
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.cmd == "serve":
        return serve(work, args.names, args.wait)
    if args.cmd == "status":
        return print_status(work)
    if args.cmd == "run":
        levels = tuple(int(x) for x in args.concurrency.split(","))
        GATE_ARGS[:] = shlex.split(args.gate_args)
        if args.background:
            (work / "run.done").unlink(missing_ok=True)
            log = open(work / "logs" / "run.txt", "w") if (work / "logs").exists() else subprocess.DEVNULL
            subprocess.Popen([sys.executable, __file__, "--work", str(work), "run", "--concurrency", args.concurrency,
                              "--gate-args", args.gate_args, "--methods", args.methods],
                             cwd=CHECKOUT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
            print(f"RUN: started in the background; log {work / 'logs' / 'run.txt'}")
            return 0
        return run_all(work, levels, {m for m in args.methods.split(",") if m})
    if args.cmd == "wait":
        t0 = time.time()
        while not (work / "run.done").exists() and time.time() - t0 < args.timeout:
            time.sleep(5)
        done = (work / "run.done").exists()
        print(f"WAIT: {'done' if done else 'still running'} after {time.time() - t0:.0f} s")
        return 0 if done else 1
    if args.cmd == "table":
        return table(work)
    if args.cmd == "preset":
        return preset_run(work, args.name)
    if args.cmd == "probe":
        return probe_scoring(work, args.prompts)
    if args.cmd == "pack":
        return pack(work, Path(args.out))
    if args.cmd == "stop":
        return stop(work)
    return 2


if __name__ == "__main__":
    sys.exit(main())
