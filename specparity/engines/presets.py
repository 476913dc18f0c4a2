"""Launch presets as data: the field reports' configurations, and the llama.cpp ones CI runs.

A preset names one engine kind and two launch configurations — ``baseline`` (no speculation) and
``spec`` — as field values of that engine's typed launch config (``LlamaServerLaunch``,
``SGLangLaunch``, ``VLLMLaunch``). ``@target`` and ``@draft`` are filled from ``--target`` /
``--draft`` (or, for llama.cpp, the fixture GGUFs). Field values, not argv strings: each
adapter's launch config turns them into argv, and those argv are unit-tested.

SGLang presets reproduce ``shared/seeds/`` (field reports 000 and 003) flag for flag; where a
report names a configuration without its flags, the preset says "inferred".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    engine: str
    description: str
    baseline: dict[str, Any]
    spec: dict[str, Any]
    source: str = ""
    #: Options the engine uses besides the launch (e.g. prompts that need long contexts).
    notes: tuple[str, ...] = field(default_factory=tuple)


_LLAMA_COMMON = {"model": "@target", "ctx_size": 4096, "parallel": 1}
_SG_128K = {
    "model_path": "@target",
    "context_length": 131072,
    "mem_fraction_static": 0.92,
    "max_mamba_cache_size": 5,
    "mamba_ssm_dtype": "bfloat16",
    "cuda_graph_backend_prefill": "disabled",
    "kv_cache_dtype": "fp8_e4m3",
    "page_size": 1,
    "language_only": True,
}
_SG_DFLASH = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "@draft",
              "speculative_num_draft_tokens": 8}
#: vLLM presets: the fraction of the GPU's memory each of the two launches may take
#: (``--gpu-memory-utilization``), so that baseline and speculative server fit one GPU together.
VLLM_GPU_FRACTION = 0.3
_VLLM_SHARE = {"gpu_memory_utilization": VLLM_GPU_FRACTION}
_SG_32K = {"model_path": "@target", "context_length": 32768, "max_running_requests": 16, "mamba_ssm_dtype": "bfloat16"}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # ---------------------------------------------------------------- llama.cpp (CPU, CI)
        Preset("llamacpp-draft-simple", "llamacpp", "standalone draft model, 4 draft tokens",
               baseline=dict(_LLAMA_COMMON),
               spec={**_LLAMA_COMMON, "spec_type": "draft-simple", "draft": "@draft", "draft_n_max": 4}),
        Preset("llamacpp-ngram-simple", "llamacpp", "n-gram lookup (n=3, m=8: the server's defaults 12/48 never "
               "draft on short prompts)",
               baseline=dict(_LLAMA_COMMON),
               spec={**_LLAMA_COMMON, "spec_type": "ngram-simple", "ngram_size_n": 3, "ngram_size_m": 8}),
        Preset("llamacpp-ngram-map-k", "llamacpp", "n-gram map (n=3, m=8)",
               baseline=dict(_LLAMA_COMMON),
               spec={**_LLAMA_COMMON, "spec_type": "ngram-map-k", "ngram_size_n": 3, "ngram_size_m": 8}),
        Preset("llamacpp-draft-mtp", "llamacpp", "the target's own MTP head (no draft model), 4 draft tokens "
               "(fixtures/models/hybrid carries one)",
               baseline=dict(_LLAMA_COMMON),
               spec={**_LLAMA_COMMON, "spec_type": "draft-mtp", "draft_n_max": 4}),
        Preset("llamacpp-draft-dflash", "llamacpp", "DFlash2 block-diffusion draft (7 draft tokens = block 8 - 1; "
               "llama.cpp's own default is 3)",
               baseline=dict(_LLAMA_COMMON),
               spec={**_LLAMA_COMMON, "spec_type": "draft-dflash", "draft": "@draft", "draft_n_max": 7}),
        # ---------------------------------------------------------------- SGLang (GPU; field reports)
        Preset("sglang-dflash2-128k", "sglang", "DFlash2, 128K context, single stream, fp8 KV (field report 000)",
               baseline=dict(_SG_128K), spec={**_SG_128K, **_SG_DFLASH},
               source="shared/seeds/000: launch command in section 2 (sglang 0.5.19, RTX 4080 SUPER 32G)"),
        Preset("sglang-dflash2-128k-dual", "sglang", "DFlash2, 128K context, two streams (field report 000)",
               baseline={**_SG_128K, "max_running_requests": 2, "max_mamba_cache_size": 10},
               spec={**_SG_128K, **_SG_DFLASH, "max_running_requests": 2, "max_mamba_cache_size": 10},
               source="shared/seeds/000 'dflash-128k-dual' (flags inferred: two streams need "
                      "--max-mamba-cache-size 10, section 6 trap 4)"),
        Preset("sglang-nospec-128k", "sglang", "no speculation, 128K context (field report 000's control); the "
               "spec side is the same launch, so the gate checks run-to-run identity",
               baseline=dict(_SG_128K), spec=dict(_SG_128K),
               source="shared/seeds/000 'nospec-128k'"),
        Preset("sglang-mtp", "sglang", "built-in MTP head run as EAGLE, 3 steps, top-k 1, 4 draft tokens "
               "(field report 003)",
               baseline=dict(_SG_32K),
               spec={**_SG_32K, "speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                     "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4},
               source="shared/seeds/003: 'SGLang · MTP' launch command"),
        Preset("sglang-dflash2-fp8", "sglang", "DFlash2 with an FP8 draft (draft quantization fp8), 32K context "
               "(field report 003)",
               baseline=dict(_SG_32K),
               spec={**_SG_32K, **_SG_DFLASH, "speculative_draft_model_quantization": "fp8"},
               source="shared/seeds/003: 'SGLang · DFlash2' launch command"),
        # ---------------------------------------------------------------- vLLM (GPU)
        # Both launches share one GPU unless --engine-opt baseline_gpus/spec_gpus part them: each takes
        # VLLM_GPU_FRACTION of it (vLLM's default 0.9 each cannot start twice on one device; measured
        # live with vLLM 0.26.0). A larger model needs its own fraction: --engine-opt
        # server_args="--gpu-memory-utilization 0.45" (the later flag wins) or one GPU per side.
        Preset("vllm-mtp", "vllm", f"MTP, 3 speculative tokens (field report 003: INT8 W8A8 with MTP-BF16 draft); "
               f"{VLLM_GPU_FRACTION:g} of the GPU per launch",
               baseline={"model": "@target", **_VLLM_SHARE},
               spec={"model": "@target", **_VLLM_SHARE,
                     "speculative_config": {"method": "mtp", "num_speculative_tokens": 3}},
               source="shared/seeds/003 INT8/INT4 rows (vLLM, MTP only; flags inferred)"),
        Preset("vllm-ngram", "vllm", f"n-gram prompt lookup, 4 speculative tokens; {VLLM_GPU_FRACTION:g} of the GPU "
               "per launch",
               baseline={"model": "@target", **_VLLM_SHARE},
               spec={"model": "@target", **_VLLM_SHARE,
                     "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}}),
    )
}


def presets_for(engine: str) -> list[str]:
    return sorted(name for name, p in PRESETS.items() if p.engine == engine)


def get_preset(engine: str, name: str) -> Preset:
    """The preset ``name`` for ``engine``; ValueError naming the known ones otherwise."""
    p = PRESETS.get(name)
    if p is None or p.engine != engine:
        raise ValueError(f"--preset {name!r}: not a preset of engine {engine!r} (known: {', '.join(presets_for(engine))})")
    return p


def fill(values: dict[str, Any], *, target: str | None, draft: str | None) -> dict[str, Any]:
    """Replace ``@target`` / ``@draft`` with the given paths; ValueError when one is needed but absent."""
    out = {}
    for key, value in values.items():
        if value == "@target":
            if not target:
                raise ValueError(f"this preset needs --target (for {key})")
            value = target
        elif value == "@draft":
            if not draft:
                raise ValueError(f"this preset needs --draft (for {key})")
            value = draft
        out[key] = value
    return out


def preset_launch_values(engine: str, name: str | None, *, target: str | None,
                         draft: str | None) -> tuple[Preset, dict[str, Any], dict[str, Any]]:
    """(preset, baseline values, speculative values) with ``@target``/``@draft`` filled; every
    error names ``--preset``."""
    preset = get_preset(engine, name or "")
    try:
        return preset, fill(preset.baseline, target=target, draft=draft), fill(preset.spec, target=target, draft=draft)
    except ValueError as exc:
        raise ValueError(f"--preset {preset.name}: {exc}") from None
