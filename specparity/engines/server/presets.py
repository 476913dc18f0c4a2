"""Launch presets as data: real deployments' SGLang launches, and the llama.cpp ones CI runs.

A preset names one engine kind and two launch configurations — ``baseline`` (no speculation) and
``spec`` — as field values of that engine's typed launch config (``LlamaServerLaunch``,
``SGLangLaunch``, ``VLLMLaunch``). :data:`PRESETS` is one table, a row per preset, written with one
constructor per engine (:func:`llamacpp`, :func:`sglang`, :func:`vllm`) that holds what that
engine's presets share, so each row says only its name, description, speculative settings and source. ``@target`` and ``@draft`` are filled from ``--target`` /
``--draft`` (or, for llama.cpp, the fixture GGUFs). Field values, not argv strings: each
adapter's launch config turns them into argv, and those argv are unit-tested.

SGLang presets reproduce the launch commands of two deployments flag for flag (each preset's
``source`` says which; ``tests/test_sglang_offline.py`` holds the commands and checks the argv); where
a deployment's configuration came without its flags, the preset says "inferred".
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


#: Both llama.cpp launches: the target, a 4K context, one slot.
_LLAMA_COMMON = {"model": "@target", "ctx_size": 4096, "parallel": 1}
#: A 128K-context SGLang 0.5.19 launch on one 32 GB card (hybrid Mamba target, INT4; fp8 KV cache).
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
#: A 32K-context SGLang launch of an FP8 target serving 16 requests at once.
_SG_32K = {"model_path": "@target", "context_length": 32768, "max_running_requests": 16, "mamba_ssm_dtype": "bfloat16"}
#: An SGLang launch with the server's defaults, for the generic presets (host-specific flags such as the
#: attention backend or the memory fraction go in ``--engine-opt server_args``).
_SG_PLAIN = {"model_path": "@target"}
#: SGLang's DFlash2 speculation with the ``--draft`` model, block 8.
_SG_DFLASH = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "@draft",
              "speculative_num_draft_tokens": 8}
#: vLLM presets: the fraction of the GPU's memory each of the two launches may take
#: (``--gpu-memory-utilization``), so that baseline and speculative server fit one GPU together.
VLLM_GPU_FRACTION = 0.3


def llamacpp(name: str, description: str, **spec: Any) -> Preset:
    """A llama.cpp preset: both launches :data:`_LLAMA_COMMON`, the speculative one adding ``spec``."""
    return Preset(name, "llamacpp", description, baseline=dict(_LLAMA_COMMON), spec={**_LLAMA_COMMON, **spec})


def sglang(name: str, description: str, common: dict[str, Any], *, source: str = "", **spec: Any) -> Preset:
    """An SGLang preset: both launches ``common``, the speculative one adding ``spec`` (none: the
    same launch twice)."""
    return Preset(name, "sglang", description, baseline=dict(common), spec={**common, **spec}, source=source)


def vllm(name: str, description: str, speculative_config: dict[str, Any], *, source: str = "") -> Preset:
    """A vLLM preset: both launches the target on :data:`VLLM_GPU_FRACTION` of the GPU, the
    speculative one with ``speculative_config`` (``--speculative-config``)."""
    common = {"model": "@target", "gpu_memory_utilization": VLLM_GPU_FRACTION}
    return Preset(name, "vllm", f"{description}; {VLLM_GPU_FRACTION:g} of the GPU per launch", baseline=common,
                  spec={**common, "speculative_config": speculative_config}, source=source)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # ---------------------------------------------------------------- llama.cpp (CPU, CI)
        llamacpp("llamacpp-draft-simple", "standalone draft model, 4 draft tokens",
                 spec_type="draft-simple", draft="@draft", draft_n_max=4),
        llamacpp("llamacpp-ngram-simple", "n-gram lookup (n=3, m=8: the server's defaults 12/48 never draft on "
                 "short prompts)",
                 spec_type="ngram-simple", ngram_size_n=3, ngram_size_m=8),
        llamacpp("llamacpp-ngram-map-k", "n-gram map (n=3, m=8)",
                 spec_type="ngram-map-k", ngram_size_n=3, ngram_size_m=8),
        llamacpp("llamacpp-draft-mtp", "the target's own MTP head (no draft model), 4 draft tokens "
                 "(fixtures/models/hybrid carries one)",
                 spec_type="draft-mtp", draft_n_max=4),
        llamacpp("llamacpp-draft-dflash", "DFlash2 block-diffusion draft (7 draft tokens = block 8 - 1; llama.cpp's "
                 "own default is 3)",
                 spec_type="draft-dflash", draft="@draft", draft_n_max=7),
        # ---------------------------------------------------------------- SGLang (GPU; real deployments)
        sglang("sglang-dflash2-128k", "DFlash2, 128K context, single stream, fp8 KV",
               _SG_128K, **_SG_DFLASH,
               source="a DFlash2 deployment's launch command (SGLang 0.5.19, one RTX 4080 SUPER 32 GB)"),
        sglang("sglang-dflash2-128k-dual", "DFlash2, 128K context, two streams",
               {**_SG_128K, "max_running_requests": 2, "max_mamba_cache_size": 10}, **_SG_DFLASH,
               source="the same deployment's two-stream configuration (flags inferred: under speculation a "
                      "request takes 5 mamba state slots, so two streams need --max-mamba-cache-size 10)"),
        sglang("sglang-nospec-128k", "no speculation, 128K context (the 128K deployment's control); the spec side "
               "is the same launch, so the gate checks run-to-run identity",
               _SG_128K, source="the DFlash2 deployment's launch command without speculation"),
        sglang("sglang-mtp", "built-in MTP head run as EAGLE, 3 steps, top-k 1, 4 draft tokens",
               _SG_32K, speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
               speculative_num_draft_tokens=4,
               source="an MTP deployment's SGLang launch command (FP8 target, 32K context)"),
        sglang("sglang-dflash2-fp8", "DFlash2 with an FP8 draft (draft quantization fp8), 32K context",
               _SG_32K, **_SG_DFLASH, speculative_draft_model_quantization="fp8",
               source="the same deployment's DFlash2 SGLang launch command"),
        sglang("sglang-ngram", "n-gram lookup (NGRAM), 4 draft tokens; the server's other defaults",
               _SG_PLAIN, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
        sglang("sglang-standalone", "a standalone draft model (--draft), 3 steps, top-k 1, 4 draft tokens; the "
               "server's other defaults",
               _SG_PLAIN, speculative_algorithm="STANDALONE", speculative_draft_model_path="@draft",
               speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4),
        # ---------------------------------------------------------------- vLLM (GPU)
        # Both launches share one GPU unless --engine-opt baseline_gpus/spec_gpus part them: each takes
        # VLLM_GPU_FRACTION of it (vLLM's default 0.9 each cannot start twice on one device; measured
        # live with vLLM 0.26.0). A larger model needs its own fraction: --engine-opt
        # server_args="--gpu-memory-utilization 0.45" (the later flag wins) or one GPU per side.
        vllm("vllm-mtp", "MTP, 3 speculative tokens (as deployed with an INT8 W8A8 target and a BF16 MTP head)",
             {"method": "mtp", "num_speculative_tokens": 3},
             source="the MTP deployment's vLLM runs (INT8/INT4 targets; no launch flags given, so inferred)"),
        vllm("vllm-ngram", "n-gram prompt lookup, 4 speculative tokens",
             {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
        vllm("vllm-draft-model", "a standalone draft model (--draft), 4 speculative tokens",
             {"method": "draft_model", "model": "@draft", "num_speculative_tokens": 4}),
        vllm("vllm-eagle3", "an EAGLE-3 head (--draft), 4 speculative tokens",
             {"method": "eagle3", "model": "@draft", "num_speculative_tokens": 4}),
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
    """Replace ``@target`` / ``@draft`` with the given paths, in nested values too (vLLM's
    ``speculative_config``); ValueError when one is needed but absent."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            value = fill(value, target=target, draft=draft)
        elif value == "@target":
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
