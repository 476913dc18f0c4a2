"""Probes: the draft's FP8 scale layout, and whether a DFlash2 draft will really run as DFlash2.

Both failures are silent. An engine picks the FP8 scale layout from the *config* alone; a scale
tensor whose name matches no parameter is dropped and the parameter keeps its fill value
(SGLang: ``torch.finfo(float32).min``), so the draft loads "successfully" and the target rejects
almost every token it proposes. Likewise a DFlash2 checkpoint whose config lacks the
``DFlash2DraftModel`` architecture or the ``dflash_config`` keys loads as DFlash v1: the
convolution and selector tensors are ignored and nothing is logged.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

from specparity.probes.checkpoints import (
    FP8_DTYPES,
    Checkpoint,
    QuantDecl,
    TensorInfo,
    iter_linear_weights,
    module_of,
)
from specparity.probes.version_facts import FP8_SUPPORT, HEAD_ABSENT, EngineSpec, dflash2_loading_sources, selector_rule
from specparity.probes.finding import Finding, fail, ok, unknown

FP8_PROBE = "draft-fp8-scales"
DFLASH2_PROBE = "dflash2-format"
DFLASH_ARCHS = frozenset({"DFlashDraftModel", "DFlash2DraftModel"})
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
#: Modules a DFlash engine builds as plain layers (no quant method): FP8 bytes there are cast,
#: never scaled. SGLang: ``self.fc = nn.Linear`` and ``nn.Parameter`` conv/selector weights.
_PLAIN_MODULES = re.compile(r"(^|\.)(fc|hidden_norm|norm|candidate_selector(\..*)?|(attention|mlp)_conv(\..*)?)$")
SILENT = "will load but accept ~nothing"
LOUD = "fails loudly at load (scale shape mismatch)"


@dataclass
class ScaleLayout:
    """A scale layout: ``tensor`` (scalar), ``channel`` ([out,1]), ``block`` ([ceil(out/bn), ceil(in/bk)]), ``none``."""

    kind: str
    scale_name: str | None
    block: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = None

    def describe(self, with_shape: bool = True) -> str:
        if self.kind == "none":
            return "no scale tensor"
        blk = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        shape = f" {list(self.shape)}" if self.shape is not None and with_shape else ""
        return f"{self.kind}{blk} '{self.scale_name}'{shape}"


def _block_of(weight: TensorInfo, scale: TensorInfo) -> tuple[int, int] | None:
    """The block size a 2-D scale implies for a 2-D weight (128 preferred when consistent)."""
    if len(weight.shape) != 2 or len(scale.shape) != 2 or 0 in scale.shape:
        return None
    (out, inp), (a, b) = weight.shape, scale.shape
    dims = []
    for n, s in ((out, a), (inp, b)):
        if math.ceil(n / 128) == s:
            dims.append(128)
        else:
            dims.append(math.ceil(n / s))
    if math.ceil(out / dims[0]) != a or math.ceil(inp / dims[1]) != b:
        return None
    return dims[0], dims[1]


def stored_layout(ckpt: Checkpoint, weight: TensorInfo) -> ScaleLayout:
    """The scale layout actually stored next to ``weight``."""
    sibs = ckpt.siblings(module_of(weight.name))
    for name in ("weight_scale_inv", "weight_scale"):
        scale = sibs.get(name)
        if scale is None:
            continue
        out = weight.shape[0] if weight.shape else 0
        if scale.is_scalar:
            return ScaleLayout("tensor", name, shape=scale.shape)
        if scale.shape in ((out, 1), (out,)) and out > 1:
            return ScaleLayout("channel", name, shape=scale.shape)
        block = _block_of(weight, scale)
        if block is not None:
            return ScaleLayout("block", name, block, scale.shape)
        return ScaleLayout("other", name, shape=scale.shape)
    return ScaleLayout("none", None)


def declared_layout(decl: QuantDecl, weight: TensorInfo, module: str | None = None) -> ScaleLayout | None:
    """What the config makes the engine allocate for ``weight``'s module (None: not quantized).

    ``module`` is the name the engine matches the ignore list against (default: the tensor's path).
    """
    module = module_of(weight.name) if module is None else module
    if not decl.covers(module):
        return None
    out, inp = weight.shape if len(weight.shape) == 2 else (0, 0)

    def block(bn: int, bk: int, name: str) -> ScaleLayout:
        return ScaleLayout("block", name, (bn, bk), (math.ceil(out / bn), math.ceil(inp / bk)))

    if decl.method == "fp8":
        if decl.weight_block_size:
            return block(*decl.weight_block_size, "weight_scale_inv")
        return ScaleLayout("tensor", "weight_scale", shape=())
    if decl.method == "compressed-tensors":
        if decl.strategy == "block" and decl.block_structure:
            return block(*decl.block_structure, "weight_scale")
        if decl.strategy == "channel":
            return ScaleLayout("channel", "weight_scale", shape=(out, 1))
        if decl.strategy == "tensor":
            return ScaleLayout("tensor", "weight_scale", shape=())
        return ScaleLayout("other", "weight_scale")
    if decl.method == "modelopt" and str(decl.algo).upper() == "FP8":
        return ScaleLayout("tensor", "weight_scale", shape=())
    return ScaleLayout("other", None)


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def _declared_text(decl: QuantDecl) -> str:
    if decl.method is None:
        return "no quantization_config"
    if decl.method == "fp8":
        return f"quant_method=fp8, weight_block_size={list(decl.weight_block_size) if decl.weight_block_size else None}"
    if decl.method == "compressed-tensors":
        blk = list(decl.block_structure) if decl.block_structure else None
        return f"compressed-tensors strategy={decl.strategy!r} block_structure={blk}"
    return f"quant_method={decl.method}" + (f" quant_algo={decl.algo}" if decl.algo else "")


def _same_shape(stored: ScaleLayout, want: ScaleLayout) -> bool:
    got = tuple(stored.shape or ())
    if want.kind == "tensor":
        return math.prod(got) == 1
    if want.kind == "channel" and want.shape:
        return got in ((want.shape[0], 1), (want.shape[0],))
    return want.shape is None or got == tuple(want.shape)


def _finding(weight: TensorInfo, stored: ScaleLayout, want: ScaleLayout | None, plain: bool) -> tuple[str, str, str] | None:
    """(problem, consequence, source tag) for one linear weight, or None when stored matches declared.

    The problem text names layouts, not shapes, so that one line covers every module it applies to.
    """
    is_fp8 = weight.dtype in FP8_DTYPES
    if plain:
        return ("FP8 weight in a plain linear layer the engine never scales", SILENT, "plain") if is_fp8 else None
    if want is None:
        return ("FP8 weight in a module the config leaves unquantized", SILENT, "layouts") if is_fp8 else None
    if not is_fp8:
        if want.kind in ("tensor", "channel", "block"):
            return (f"{weight.dtype} weight where the config declares FP8 ({want.describe(False)}); add the module to "
                    "the ignore list", SILENT, "layouts")
        return None
    if want.kind == "other":
        return None
    if stored.kind == "none":
        return (f"no scale stored; the engine allocates {want.describe(False)} and keeps its fill value", SILENT, "layouts")
    if stored.scale_name != want.scale_name:
        return (f"stores {stored.describe(False)} but the config declares {want.describe(False)}: the stored scale "
                "name matches no parameter and is dropped", SILENT, "dropped")
    if stored.kind != want.kind or not _same_shape(stored, want):
        return (f"stores {stored.describe(False)} but the config declares {want.describe(False)}", LOUD, "layouts")
    return None


def probe_fp8_scales(draft: Checkpoint | None, engine: EngineSpec) -> Finding:
    """Stored FP8 scale layout vs the config's declaration vs what the engine loads."""
    if draft is None:
        return unknown(FP8_PROBE, "no draft given")
    decl = draft.quant()
    is_dflash = bool(DFLASH_ARCHS & set(draft.architectures)) or (
        "fc.weight" in draft.tensors and "hidden_norm.weight" in draft.tensors)
    findings: dict[tuple[str, str, str], list[TensorInfo]] = defaultdict(list)
    layouts: dict[str, list[TensorInfo]] = defaultdict(list)
    support = FP8_SUPPORT.get(engine.name)
    # SGLang builds a (non-Nemotron) DFlash draft's layers with an empty prefix, so its linears are
    # named "qkv_proj"/"o_proj"/… and an ignore entry is matched against the bare shard name
    # ("q_proj"): sglang 0.5.19 srt/models/dflash.py:598-602 (layer prefix "" unless Nemotron 3.5), and
    # srt/layers/quantization/utils.py:48 _module_path_match / :70 is_layer_skipped.
    bare_names = engine.name == "sglang" and is_dflash
    for weight in iter_linear_weights(draft):
        module = module_of(weight.name)
        plain = is_dflash and bool(_PLAIN_MODULES.search(module))
        stored = stored_layout(draft, weight)
        engine_module = module.split(".")[-1] if bare_names else module
        if weight.dtype in FP8_DTYPES:
            layouts[stored.describe(False).split(" '")[0]].append(weight)
            if support is not None and stored.kind not in support.layouts | {"none"} and not plain:
                findings[(f"{engine} loads FP8 scales as {sorted(support.layouts)} only; stored {stored.kind}",
                          SILENT, "layouts")].append(weight)
        result = _finding(weight, stored, declared_layout(decl, weight, engine_module), plain)
        if result is not None:
            problem, consequence, tag = result
            if bare_names and decl.covers(module) != decl.covers(engine_module):
                problem += " (the ignore list names per-layer paths; SGLang's DFlash draft matches the bare name)"
                tag = "bare-names"
            findings[(problem, consequence, tag)].append(weight)
    n_fp8 = sum(len(ws) for ws in layouts.values())
    evidence = [f"draft config: {_declared_text(decl)} ({decl.source or 'config.json'})"]
    evidence += [f"stored {kind}: {len(ws)} FP8 tensors, e.g. {ws[0].describe()}" for kind, ws in sorted(layouts.items())]
    if support is None:
        return unknown(FP8_PROBE, f"no FP8 loading data for {engine.name}", evidence)
    if not findings:
        evidence.append(support.sources["layouts"])
        if n_fp8 == 0:
            return ok(FP8_PROBE, "draft has no FP8 tensors; nothing to mis-scale", evidence, engine_independent=True)
        return ok(FP8_PROBE, f"all {n_fp8} FP8 tensors store the layout the config declares, and {engine} loads it",
                  evidence)
    tags = {"layouts"}
    for (problem, consequence, tag), ws in sorted(findings.items()):
        tags.add(tag)
        first = ws[0]
        sibs = draft.siblings(module_of(first.name))
        scale = next((sibs[n].describe() for n in ("weight_scale_inv", "weight_scale") if n in sibs), "no scale")
        modules = sorted({_pattern(module_of(w.name)) for w in ws})
        evidence.append(f"{problem} [{consequence}]: {len(ws)} tensors in {', '.join(modules)}; "
                        f"e.g. {first.describe()}; {scale}")
    if decl.method == "compressed-tensors":
        tags.add("compressed-tensors")
    evidence += [support.sources[t] for t in ("layouts", "compressed-tensors", "dropped", "plain", "bare-names")
                 if t in tags and t in support.sources]
    total = sum(len(ws) for ws in findings.values())
    silent = any(consequence == SILENT for (_, consequence, _) in findings)
    return fail(
        FP8_PROBE,
        f"{total} draft tensors disagree with the declared FP8 layout: " + (SILENT if silent else LOUD),
        evidence,
        action="make config and tensors agree: set quantization_config.weight_block_size=[128,128] for "
        "'weight_scale_inv' block scales (or re-export per-tensor 'weight_scale'), list BF16 modules in the "
        "ignore list (bare names such as 'q_proj' for SGLang DFlash drafts), and keep plain layers (DFlash fc, "
        "selector, conv) in BF16",
        live_only="the accept-length collapse itself: run the acceptance-floor probe",
    )


def _draft_keys(draft: Checkpoint) -> tuple[dict[str, object], list[str]]:
    dcfg = draft.config.get("dflash_config")
    dcfg = dcfg if isinstance(dcfg, dict) else {}
    top_level_only = [k for k in DFLASH2_KEYS if k not in dcfg and k in draft.config]
    return dcfg, top_level_only


def _v2_shape_problems(draft: Checkpoint, dcfg: dict[str, object]) -> list[str]:
    """Shapes the keys imply vs shapes stored (SGLang ``DFlashGroupedConv`` / ``CandidateSelector``)."""
    problems = []
    text = draft.text_config()
    hidden, vocab = text.get("hidden_size"), text.get("vocab_size")
    k, g, r = dcfg.get("conv_kernel_size"), dcfg.get("conv_group_size"), dcfg.get("selector_rank")
    if not all(type(x) is int and x > 0 for x in (hidden, vocab, k, g, r)):
        return problems
    expect = {
        "base_kernel": (2, k, hidden),
        "kernel_projection.weight": (2 * k * (hidden // g), hidden),
    }
    for name, t in sorted(draft.tensors.items()):
        if "_conv." in name:
            for suffix, shape in expect.items():
                if name.endswith(suffix) and t.shape != shape:
                    problems.append(f"{t.describe()} expected {list(shape)} from dflash_config")
        elif name.startswith("candidate_selector."):
            if "codebook" in name and t.shape != (vocab, r):
                problems.append(f"{t.describe()} expected {[vocab, r]} (vocab_size, selector_rank)")
            if "hidden_projection" in name and t.shape != (r, hidden):
                problems.append(f"{t.describe()} expected {[r, hidden]} (selector_rank, hidden_size)")
    if hidden % g:
        problems.append(f"conv_group_size={g} does not divide hidden_size={hidden}")
    return problems


#: llama.cpp target graphs that also expose the input of the layer *after* the last
#: (``res->t_layer_inp[n_layer]``): deepseek4.cpp, nemotron-h.cpp, mimo2.cpp in build 11434.
LLAMACPP_FINAL_LAYER_ARCHS = ("Deepseek", "NemotronH", "MiMo")
LLAMACPP_LAYER_MESSAGE = 'GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor is null") failed'


def llamacpp_feature_layers(draft: Checkpoint, target: Checkpoint | None) -> Finding | None:
    """llama.cpp reads a DFlash draft's features as layer *inputs*: its converter writes
    ``target_layer_ids + 1`` (``conversion/qwen.py:800``) and the Qwen3 / Qwen3.5 / Llama graphs set
    ``t_layer_inp[il]`` only for ``il < n_layer`` (``src/models/qwen3.cpp:72``, ``qwen35.cpp:160``,
    ``llama.cpp:127``), so a draft that reads the target's last layer aborts the server on the first
    request (``src/llama-graph.cpp:1413``). Measured: the fixture DFlash2 draft (layers [0, 2, 3] of
    a 4-layer Qwen3) kills llama-server 11434 that way; the reference dflash decoder runs it."""
    dcfg, _ = _draft_keys(draft)
    layers = dcfg.get("target_layer_ids") or draft.config.get("target_layer_ids")
    n_layers = (target.text_config().get("num_hidden_layers") if target is not None else None) \
        or draft.config.get("num_target_layers")
    if not isinstance(layers, list) or not layers or not isinstance(n_layers, int):
        return None
    archs = target.architectures if target is not None else []
    evidence = [f"draft target_layer_ids={layers}; target has {n_layers} layers"
                + (f" ({archs})" if archs else ""),
                "llama.cpp build 11434: conversion/qwen.py:800 writes dflash.target_layers = target_layer_ids + 1; "
                "src/models/qwen3.cpp:72 / qwen35.cpp:160 / llama.cpp:127 set t_layer_inp[il] for il < n_layer "
                "only; src/llama-graph.cpp:1413 asserts the tensor exists"]
    if max(int(i) for i in layers) < n_layers - 1:
        return None
    if any(any(a.startswith(prefix) for prefix in LLAMACPP_FINAL_LAYER_ARCHS) for a in archs):
        return None
    return fail(DFLASH2_PROBE, f"the draft reads the target's last layer ({n_layers - 1}): llama.cpp aborts on the "
                "first request", evidence, message=LLAMACPP_LAYER_MESSAGE,
                action="use a draft whose target_layer_ids are all < num_hidden_layers - 1, or serve it with "
                "SGLang / the reference dflash decoder (both read the last layer)")


def probe_dflash2_format(draft: Checkpoint | None, engine: EngineSpec, target: Checkpoint | None = None) -> Finding:
    """Will this draft run as DFlash2 (architecture + the four keys + conv/selector tensors)?"""
    if draft is None:
        return unknown(DFLASH2_PROBE, "no draft given")
    if engine.name == "llamacpp" and (DFLASH_ARCHS & set(draft.architectures)):
        blocked = llamacpp_feature_layers(draft, target)
        if blocked is not None:
            return blocked
    archs = draft.architectures
    dcfg, top_only = _draft_keys(draft)
    conv = sorted(n for n in draft.tensors if "_conv." in n)
    selector = sorted(n for n in draft.tensors if n.startswith("candidate_selector."))
    has_v2_tensors = bool(conv or selector)
    is_v2_arch = "DFlash2DraftModel" in archs
    missing = [k for k in DFLASH2_KEYS if not dcfg.get(k)]
    evidence = [
        f"architectures={archs}",
        "dflash_config: " + ", ".join(f"{k}={dcfg.get(k)!r}" for k in DFLASH2_KEYS),
        f"conv tensors: {len(conv)}" + (f", e.g. {draft.tensors[conv[0]].describe()}" if conv else ""),
        f"selector tensors: {len(selector)}" + (f", e.g. {draft.tensors[selector[0]].describe()}" if selector else ""),
    ]
    if top_only:
        evidence.append(f"{top_only} are top-level keys; SGLang reads them only inside dflash_config")
    if not (DFLASH_ARCHS & set(archs)) and not has_v2_tensors and "dflash_config" not in draft.config:
        return ok(DFLASH2_PROBE, "not a DFlash draft; nothing to check", evidence, engine_independent=True)
    rule = selector_rule(engine) if engine.name in ("sglang", "vllm") else None
    if engine.name == "llamacpp":
        evidence.append("llama.cpp reads block size, conv kernel/group size and selector rank/top-k from GGUF "
                        "metadata written by its converter (conversion/qwen.py)")
    if rule is not None and rule.policy == HEAD_ABSENT:
        evidence += rule.cite(engine.version)
    evidence += dflash2_loading_sources(engine)
    if not is_v2_arch and not has_v2_tensors:
        return ok(DFLASH2_PROBE, "DFlash v1 draft (no conv/selector tensors, architecture not DFlash2)", evidence)
    if rule is not None and rule.policy == HEAD_ABSENT:
        if is_v2_arch:
            return fail(DFLASH2_PROBE, f"{engine} has no DFlash2DraftModel: the draft fails to load", evidence,
                        message="Model architectures ['DFlash2DraftModel'] are not supported for now.",
                        action="upgrade to sglang>=0.5.19 (DFlash2: PR #35371, quantized-head selector: PR #35496)")
        return fail(DFLASH2_PROBE, f"{engine} has no DFlash2: the draft will silently run as DFlash v1", evidence,
                    action="upgrade to sglang>=0.5.19 and declare architectures=['DFlash2DraftModel']",
                    live_only="the lower accept length of v1: run the acceptance-floor probe")
    if has_v2_tensors and not is_v2_arch:
        conv_built = "conv_kernel_size" not in missing and "conv_group_size" not in missing
        dropped = "candidate_selector.* tensors are dropped; " + (
            "convolutions are built from dflash_config (v1 + conv, no selector)" if conv_built
            else "conv tensors are dropped too")
        return fail(
            DFLASH2_PROBE,
            "DFlash2 tensors present but architectures lacks 'DFlash2DraftModel': will silently run as DFlash v1",
            evidence + ([f"{dropped} (SGLang DFlashDraftModel.load_weights: '# Ignore unexpected weights')"]
                        if engine.name == "sglang" else []),
            action="set architectures=['DFlash2DraftModel'] and dflash_config "
            "{conv_kernel_size, conv_group_size, selector_rank, selector_top_k} in the draft config.json",
            live_only="the accept length it loses: run the acceptance-floor probe",
        )
    if missing:
        loud = "selector_rank" in missing and engine.name == "sglang"
        return fail(
            DFLASH2_PROBE,
            f"architecture is DFlash2DraftModel but dflash_config lacks {missing}: "
            + ("fails at load" if loud else "convolutions silently skipped (runs as DFlash v1 + selector)"),
            evidence,
            message="DFlash selector draft requires dflash_config.selector_rank." if loud else None,
            action="add the missing keys inside dflash_config (reference: kernel 2, group 16, rank 256, top-k 16)",
        )
    if not conv or not selector:
        return fail(
            DFLASH2_PROBE,
            f"config declares DFlash2 but the checkpoint lacks {'conv' if not conv else 'selector'} tensors: "
            "the engine keeps their init values (identity conv, zero codebooks) and accepts little",
            evidence,
            action="use a complete DFlash2 export (layers.*.{attention,mlp}_conv.*, candidate_selector.*)",
        )
    problems = _v2_shape_problems(draft, dcfg)
    if problems:
        return fail(DFLASH2_PROBE, "DFlash2 tensor shapes disagree with dflash_config: fails at load", evidence + problems,
                    action="fix dflash_config to match the exported tensors (or re-export)")
    return ok(DFLASH2_PROBE, "complete DFlash2 draft: architecture, the four dflash_config keys and conv/selector tensors", evidence)
