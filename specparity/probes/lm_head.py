"""Probe: can the engine's DFlash2 selector read the *target's* lm_head?

The DFlash2 selector multiplies draft hidden states with the target ``lm_head.weight`` (or the
tied embedding). A quantized head is packed bytes, not a matrix, so engines either apply the
head's quantization method (SGLang >= 0.5.19, for methods it supports), refuse (vLLM), or do not
have DFlash2 at all (SGLang <= 0.5.18). SGLang does not refuse at startup: the error kills the
scheduler on the first decode, which is why this probe also has a live part (``live.first_decode``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specparity.probes.checkpoints import (
    DENSE_FLOAT_DTYPES,
    FP8_DTYPES,
    QUANT_SIBLINGS,
    Checkpoint,
    QuantDecl,
    TensorInfo,
    module_of,
)
from specparity.probes.version_facts import (
    HEAD_ABSENT,
    HEAD_UNQUANTIZED,
    SGLANG_MODELOPT_FP8_HEAD_ATTRS,
    EngineSpec,
    selector_rule,
)
from specparity.probes.finding import Finding, fail, ok, unknown, warn

PROBE = "lm-head"
DFLASH2_ARCH = "DFlash2DraftModel"

#: head kind -> (SGLang quant method class the target loader would attach, vLLM class) — the
#: names an operator will see in logs; "?" where the class depends on the kernel picked at runtime.
_METHOD_NAMES = {
    "fp8": ("Fp8LinearMethod", "Fp8LinearMethod"),
    "fp8-block": ("Fp8LinearMethod", "Fp8LinearMethod"),
    "modelopt-fp8": ("ModelOptFp8LinearMethod", "ModelOptFp8LinearMethod"),
    "nvfp4": ("ModelOptFp4LinearMethod", "ModelOptNvFp4LinearMethod"),
    "compressed-tensors": ("CompressedTensorsLinearMethod", "CompressedTensorsLinearMethod"),
    "int4-packed": ("CompressedTensorsLinearMethod", "CompressedTensorsLinearMethod"),
    "gptq": ("GPTQ(Marlin)LinearMethod", "GPTQMarlinLinearMethod"),
    "awq": ("AWQ(Marlin)LinearMethod", "AWQMarlinLinearMethod"),
    "int8": ("?", "?"),
}


@dataclass
class HeadInfo:
    """The target's output head as stored: which tensors, and what they say about its format."""

    module: str
    tied: bool
    tensors: dict[str, TensorInfo]
    kind: str  # dense | fp8 | fp8-block | modelopt-fp8 | nvfp4 | int4-packed | gptq | awq | int8 | gguf | missing | unknown
    detail: str = ""

    @property
    def dense(self) -> bool:
        return self.kind == "dense"

    def evidence(self) -> list[str]:
        what = f"tied embedding {self.module}" if self.tied else self.module
        lines = [f"target head = {what}: {self.kind}" + (f" ({self.detail})" if self.detail else "")]
        lines += [t.describe() for _, t in sorted(self.tensors.items())]
        return lines


def _classify(sibs: dict[str, TensorInfo], decl: QuantDecl) -> tuple[str, str]:
    weight = sibs.get("weight")
    quant_sibs = sorted(k for k in sibs if k in QUANT_SIBLINGS)
    if "qweight" in sibs:
        return ("awq" if decl.method == "awq" else "gptq"), f"qweight {sibs['qweight'].dtype}"
    if "weight_packed" in sibs:
        packed = sibs["weight_packed"]
        if "weight_global_scale" in sibs or packed.dtype == "U8":
            return "nvfp4", f"weight_packed {packed.dtype} + {', '.join(quant_sibs)}"
        return "int4-packed", f"weight_packed {packed.dtype}"
    if weight is None:
        return "unknown", "no weight tensor"
    if weight.dtype in FP8_DTYPES:
        if "weight_scale_inv" in sibs:
            return "fp8-block", "weight_scale_inv"
        if decl.method == "modelopt":
            return "modelopt-fp8", ", ".join(quant_sibs) or "no scale"
        if decl.method == "compressed-tensors":
            return "compressed-tensors", "FP8 " + (", ".join(quant_sibs) or "no scale")
        return "fp8", ", ".join(quant_sibs) or "no scale"
    if weight.dtype == "U8" and "weight_scale" in sibs:
        return "nvfp4", f"U8 weight + {', '.join(quant_sibs)}"
    if weight.dtype == "I8":
        return "int8", ", ".join(quant_sibs) or "no scale"
    if weight.dtype in DENSE_FLOAT_DTYPES and not quant_sibs:
        return "dense", weight.dtype
    if weight.dtype in DENSE_FLOAT_DTYPES:
        return "unknown", f"{weight.dtype} weight next to quantization tensors {quant_sibs}"
    return "unknown", f"weight dtype {weight.dtype}"


def find_head(target: Checkpoint) -> HeadInfo:
    """Locate the head: ``*lm_head.*`` tensors, else the tied input embedding, else GGUF / missing."""
    decl = target.quant()
    heads = sorted(
        {module_of(n) for n in target.tensors if module_of(n).split(".")[-1] == "lm_head"},
        key=lambda m: ("mtp" in m, len(m), m),
    )
    if heads:
        sibs = target.siblings(heads[0])
        kind, detail = _classify(sibs, decl)
        return HeadInfo(heads[0], False, sibs, kind, detail)
    tie = target.text_config().get("tie_word_embeddings")
    embeds = sorted((module_of(n) for n in target.tensors if n.endswith("embed_tokens.weight")), key=len)
    if embeds and tie is not False:
        sibs = target.siblings(embeds[0])
        kind, detail = _classify(sibs, decl)
        return HeadInfo(embeds[0], True, sibs, kind, detail)
    if target.gguf_files:
        return HeadInfo("output.weight", False, {}, "gguf", f"GGUF files {target.gguf_files}")
    return HeadInfo("lm_head", False, {}, "missing", f"no lm_head tensor; tie_word_embeddings={tie!r}")


def draft_uses_selector(draft: Checkpoint | None) -> tuple[bool, str]:
    """Whether the engine will run the DFlash2 selector for this draft (it keys on the architecture)."""
    if draft is None:
        return False, "no draft given"
    archs = draft.architectures
    if DFLASH2_ARCH in archs:
        return True, f"draft architectures={archs}"
    return False, f"draft architectures={archs} (the selector runs only for {DFLASH2_ARCH})"


def _config_note(target: Checkpoint, head: HeadInfo) -> list[str]:
    decl = target.quant()
    if decl.method is None:
        return []
    covered = decl.covers(head.module.split(".")[-1] if not head.tied else head.module)
    said = "quantized" if covered else "left dense"
    note = [f"{decl.source}: quant_method={decl.method}; the head is {said} by the declaration (ignore={decl.ignore})"]
    if covered is False and not head.dense and head.kind != "missing":
        note.append("config says the head is dense but its tensors are quantized: the loader will misread it")
    return note


def probe_lm_head(target: Checkpoint, draft: Checkpoint | None, engine: EngineSpec) -> Finding:
    """Predict whether the target head works under this engine's DFlash2 selector."""
    head = find_head(target)
    uses, why = draft_uses_selector(draft)
    evidence = head.evidence() + _config_note(target, head) + [why]
    if head.kind == "missing":
        return unknown(PROBE, "no output head found in the target checkpoint", evidence,
                       action="check that the target directory is complete (lm_head.weight or tied embed_tokens.weight)")
    if engine.name == "llamacpp":
        return unknown(PROBE, "llama.cpp runs a GGUF conversion; this probe reads safetensors heads only", evidence)
    rule = selector_rule(engine)
    if rule is None:
        return unknown(PROBE, f"no capability data for {engine} (SGLang sources read: 0.5.17-0.5.23)", evidence)
    evidence += rule.cite(engine.version)
    if rule.policy == HEAD_ABSENT:
        if not uses:
            return ok(PROBE, f"{engine} has no DFlash2; this draft does not use the selector", evidence)
        return unknown(PROBE, f"{engine} has no DFlash2 selector at all (see dflash2-format)", evidence)
    verdict_if_broken = fail if uses else warn
    scope = "" if uses else " (no DFlash2 draft in use: this matters once one is)"
    if head.dense:
        return ok(PROBE, f"target head is dense {head.detail}: the DFlash2 selector can read it{scope}", evidence)
    sg_method, vllm_method = _METHOD_NAMES.get(head.kind, ("?", "?"))
    if rule.policy == HEAD_UNQUANTIZED or head.kind == "gguf":
        method_name = "GGUFLinearMethod" if head.kind == "gguf" else vllm_method
        message = rule.message.format(quant_method=method_name) if rule.message else None
        if head.kind == "gguf" and engine.name == "sglang":
            evidence.append("a GGUF head registers 'qweight', no 'weight' (srt/layers/quantization/gguf.py "
                            "GGUFLinearMethod.create_weights), so should_apply_lm_head_quant_method is False")
        return verdict_if_broken(
            PROBE,
            f"quantized target head ({head.kind}) is refused by the {engine} DFlash2 selector{scope}",
            evidence,
            message=message,
            action="serve a target whose lm_head is BF16/FP16 (e.g. add lm_head to the quantization ignore list "
            "and re-export), or use a non-DFlash2 draft",
            live_only=f"the exact failure point ({rule.fails_at})",
        )
    if head.kind == "modelopt-fp8":
        missing = [a for a in SGLANG_MODELOPT_FP8_HEAD_ATTRS if a not in head.tensors]
        if missing:
            return verdict_if_broken(
                PROBE,
                f"ModelOpt FP8 head lacks {missing}: the selector will not apply ModelOptFp8LinearMethod{scope}",
                evidence + ["should_apply_lm_head_quant_method requires F8_E4M3 weight with weight_scale and input_scale"],
                message=rule.message,
                action="export the head with static input_scale, or keep lm_head dense (exclude_modules: [lm_head])",
                live_only=f"the crash itself ({rule.fails_at})",
            )
    if head.kind in _METHOD_NAMES:
        return ok(
            PROBE,
            f"quantized head ({head.kind}) is applied through lm_head.quant_method ({sg_method}) by {engine}{scope}",
            evidence,
            live_only="that the head's quant method really is applied: send one real decode after /health "
            f"(SGLang only fails on the first decode, with: {rule.message})",
        )
    return unknown(PROBE, f"head format not recognised ({head.detail})", evidence,
                   live_only=f"whether {engine} accepts it: run one real decode ({rule.fails_at})")
