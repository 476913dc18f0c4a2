#!/usr/bin/env python3
"""Write a copy of the fixture target whose output distribution is less peaked (no training).

    python tools/gpu/flat_target.py --out DIR [--factor 0.5] [--mode norm|lm_head|blocks] [--src fixtures/models/target]
    python tools/gpu/flat_target.py --measure [--factors 1,0.5,0.3] [--modes norm,blocks] [--configs fp32,bf16,bf16-fp8]
                                [--engines hf,dflash] [--prompts prompts/default.jsonl] [--work /tmp/flat-measure]

Modes (all deterministic: the same input gives the same bytes):

* ``norm`` (default): the final RMSNorm weight (``model.norm.weight``) times ``factor``. The fixture
  ties ``lm_head`` to ``embed_tokens`` (``tie_word_embeddings: true``), so scaling the head would
  change the embeddings too; the final norm feeds only the head, so every logit is multiplied by
  ``factor`` exactly in real arithmetic: a softmax temperature of ``1 / factor``. Margins (logprob
  differences) shrink by ``factor``; the argmax — and so every greedy output and every accepted
  draft token — is unchanged.
* ``lm_head``: ``lm_head.weight`` times ``factor`` (only for an untied head; refused when tied).
* ``blocks``: the residual writes of the last ``--layers`` decoder layers (``self_attn.o_proj`` and
  ``mlp.down_proj``) times ``factor``: the model itself changes (outputs differ from the fixture's),
  not just its temperature.

Why ``norm`` alone does not make more near ties: the decode-vs-teacher-forced noise that sets the
threshold passes through the same final norm, so it scales by ``factor`` too; the ratio of margin
to threshold is unchanged. For ``factor`` a power of two the scaled model computes bit-for-bit the
same logits times ``factor`` in bf16 as in fp32, so the same prompts flip; other factors only
re-draw the rounding. What ``norm`` changes is the absolute scale (a threshold measured at
1 / factor of the fixture's, far below the 2-nat ceiling) — see ``--measure`` and the numbers it
prints.

``--measure`` runs the lossless gate (specparity's own ``run_gate``) on this CPU for every
(mode, factor, config, engine) — configs ``fp32``, ``bf16``, ``bf16-fp8`` (fp8 e4m3 KV cache,
per-tensor scales), ``bf16-fp8-head`` (per-head scales) — and prints one table row each: classes, the measured threshold,
accept length. The model copies go to ``--work``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: --measure configurations: name -> (dtype, kv_cache_dtype, kv_scales)
CONFIGS = {"fp32": ("float32", None, None), "bf16": ("bfloat16", None, None),
           "bf16-fp8": ("bfloat16", "fp8_e4m3", "per_tensor"), "bf16-fp8-head": ("bfloat16", "fp8_e4m3", "per_head")}
DEFAULT_SRC = REPO / "fixtures" / "models" / "target"
MODES = ("norm", "lm_head", "blocks")
WEIGHTS = "model.safetensors"
INFO = "flat_target.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with sorted keys: the writer's own key order (a hash
    map) varies from run to run, and the same model must give the same bytes. Data offsets are
    relative to the end of the header, so only the header changes."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])


def scaled_tensors(config: dict, names: list[str], mode: str, layers: int) -> list[str]:
    """The tensor names ``mode`` multiplies, for a model with ``config`` and tensors ``names``.
    Raises ValueError when the mode does not fit the model."""
    if mode == "norm":
        want = ["model.norm.weight"]
    elif mode == "lm_head":
        if config.get("tie_word_embeddings", False):
            raise ValueError("--mode lm_head: the target ties lm_head to embed_tokens (tie_word_embeddings: true); "
                             "scaling it would scale the embeddings too: use --mode norm")
        want = ["lm_head.weight"]
    elif mode == "blocks":
        n = int(config["num_hidden_layers"])
        if not 1 <= layers <= n:
            raise ValueError(f"--layers: expected 1..{n}, got {layers}")
        want = [f"model.layers.{i}.{t}.weight" for i in range(n - layers, n) for t in ("self_attn.o_proj", "mlp.down_proj")]
    else:
        raise ValueError(f"--mode: expected one of {', '.join(MODES)}, got {mode!r}")
    missing = [w for w in want if w not in names]
    if missing:
        raise ValueError(f"the target has no tensor {missing[0]} (mode {mode})")
    return want


def write_flat_target(out: str | Path, factor: float, *, src: str | Path = DEFAULT_SRC, mode: str = "norm",
                      layers: int = 1) -> Path:
    """Copy ``src`` (a Hugging Face model directory with one ``model.safetensors``) to ``out`` with
    the tensors of ``mode`` multiplied by ``factor`` (computed in float32, stored in their own
    dtype). Returns ``out``. Every other file is copied byte for byte."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not factor > 0:
        raise ValueError(f"--factor: expected a number > 0, got {factor}")
    src, out = Path(src), Path(out)
    weights = src / WEIGHTS
    if not weights.is_file():
        raise ValueError(f"{src}: no {WEIGHTS} (a single-file safetensors model is expected)")
    config = json.loads((src / "config.json").read_text())
    with safe_open(str(weights), framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    targets = scaled_tensors(config, list(tensors), mode, layers)
    for name in targets:
        t = tensors[name]
        tensors[name] = (t.to(torch.float32) * float(factor)).to(t.dtype).contiguous()
    if out.resolve() == src.resolve():
        raise ValueError("--out must differ from --src")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in (WEIGHTS, INFO):
            shutil.copyfile(f, out / f.name)
    info = {"source": str(src), "source_sha256": _sha256(weights), "mode": mode, "factor": float(factor),
            "layers": layers if mode == "blocks" else None, "scaled": targets,
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}
    metadata.update({"format": metadata.get("format", "pt"), "specparity_flat_target": json.dumps(info, sort_keys=True)})
    tmp = out / (WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    _canonical_header(tmp)
    tmp.replace(out / WEIGHTS)
    (out / INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------------------- measuring
def measure(args: argparse.Namespace) -> list[dict]:
    """Gate runs on this CPU over (mode, factor, dtype, engine); prints and returns one row each."""
    sys.path.insert(0, str(REPO))
    from specparity.engines import default_draft_fixture, load_engine
    from specparity.engines.base import EngineOptions
    from specparity.model.prompts import load_prompts
    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import conclude, run_gate

    prompts = load_prompts(args.prompts).prompts
    work = Path(args.work)
    rows = []
    header = ("| mode | factor | config | engine | exact | near_tie | drifted | diverged | error | threshold (nats) | "
              "max |Δmargin| | min baseline margin | accept length | gate | s |")
    print(header)
    print("|" + "---|" * 15)
    for mode in args.modes:
        for factor in args.factors:
            model = str(DEFAULT_SRC) if factor == 1.0 else str(
                write_flat_target(work / f"{mode}-{factor:g}", factor, mode=mode, layers=args.layers))
            for config in args.configs:
                dtype, kv, scales = CONFIGS[config]
                for engine_name in args.engines:
                    t0 = time.perf_counter()
                    # a named target never gets a fixture draft silently: the flat target is the fixture
                    # target's weights rescaled, so the fixture drafts serve it
                    draft = REPO / "fixtures" / "models" / default_draft_fixture(
                        "dflash2" if engine_name == "dflash" else "draft")
                    engine = load_engine(engine_name, EngineOptions(target=model, draft=str(draft), dtype=dtype,
                                                                    kv_cache_dtype=kv,
                                                                    extra={"kv_scales": scales} if scales else {}))
                    cfg = GateConfig(prompts=[str(args.prompts)], max_new_tokens=args.max_new_tokens,
                                     report_dir=str(work / "runs" / f"{Path(args.prompts).stem}-{mode}-{factor:g}-{config}-{engine_name}"))
                    try:
                        run = run_gate(engine, prompts, cfg, calibration=prompts)
                        decision = conclude(run)
                    finally:
                        engine.close()
                    margins = [float(r.baseline.scores.top_logprobs[i, 0] - r.baseline.scores.top_logprobs[i, 1])
                               for r in run.records if r.baseline and not r.baseline.error and r.baseline.scores.k >= 2
                               for i in range(len(r.baseline.scores))]
                    act = run.activity()
                    row = {"mode": mode, "factor": factor, "config": config, "engine": engine_name,
                           "prompts": Path(args.prompts).name, **decision.counts,
                           "threshold": run.threshold.nats if run.threshold else None,
                           "max_abs_delta": (run.threshold.noise.max_abs_delta
                                             if run.threshold and run.threshold.noise else None),
                           "min_margin": min(margins) if margins else None,
                           "accept_length": act.mean_accept_length, "status": decision.status,
                           "calibration_error": run.calibration_error, "seconds": round(time.perf_counter() - t0, 1)}
                    rows.append(row)
                    fmt = lambda v: "n/a" if v is None else f"{v:.4g}"  # noqa: E731
                    print(f"| {mode} | {factor:g} | {config} | {engine_name} | {row.get('exact', 0)} | {row.get('near_tie', 0)} | "
                          f"{row.get('drifted', 0)} | {row.get('diverged', 0)} | {row.get('error', 0)} | {fmt(row['threshold'])} | "
                          f"{fmt(row['max_abs_delta'])} | {fmt(row['min_margin'])} | {fmt(row['accept_length'])} | "
                          f"{row['status']} | {row['seconds']} |", flush=True)
    (work / f"measure-{Path(args.prompts).stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output model directory")
    ap.add_argument("--factor", type=float, default=0.5, help="multiplier (default 0.5)")
    ap.add_argument("--mode", choices=MODES, default="norm")
    ap.add_argument("--layers", type=int, default=1, help="--mode blocks: how many last layers (default 1)")
    ap.add_argument("--src", default=str(DEFAULT_SRC), help="source model directory (default: the fixture target)")
    ap.add_argument("--measure", action="store_true", help="run the gate for several factors on this machine")
    ap.add_argument("--factors", default="1,0.5,0.3", help="--measure: comma-separated factors (1 = the fixture)")
    ap.add_argument("--modes", default="norm", help="--measure: comma-separated modes")
    ap.add_argument("--configs", default="fp32,bf16", help=f"--measure: comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--engines", default="hf,dflash")
    ap.add_argument("--prompts", default=str(REPO / "prompts" / "default.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--work", default="/tmp/flat-measure")
    args = ap.parse_args(argv)
    if args.measure:
        args.factors = [float(x) for x in args.factors.split(",")]
        args.modes = args.modes.split(",")
        args.configs = args.configs.split(",")
        unknown = [c for c in args.configs if c not in CONFIGS]
        if unknown:
            ap.error(f"--configs: unknown {unknown[0]!r} (known: {', '.join(CONFIGS)})")
        args.engines = args.engines.split(",")
        measure(args)
        return 0
    if not args.out:
        ap.error("--out is required (or --measure)")
    out = write_flat_target(args.out, args.factor, src=args.src, mode=args.mode, layers=args.layers)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
