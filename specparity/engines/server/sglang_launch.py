"""How the ``sglang`` engine launches SGLang: the typed launch (:class:`SGLangLaunch`: ``python -m
sglang.launch_server``, its flags and environment) and the two launches of a preset.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar


from specparity.engines.base import (
    EngineOptions,
)
from specparity.engines.server.launch import GPU_STARTUP_TIMEOUT_S, LaunchConfig
from specparity.engines.server.presets import preset_launch_values


#: ``--speculative-algorithm`` names SGLang resolves (case-insensitive; 0.5.23
#: ``speculative/spec_info.py:32-66``; 0.5.19 lacks ``UNO``). Not enforced: plugins may register more.
ALGORITHMS = ("DFLASH", "UNO", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "STANDALONE", "NGRAM", "NEXTN")


#: ``--cuda-graph-backend-prefill`` choices (0.5.19 also has ``tc_piecewise``, which 0.5.23 rejects).
CUDA_GRAPH_BACKENDS = ("full", "breakable", "disabled", "tc_piecewise")


MAMBA_SSM_DTYPES = ("float32", "bfloat16", "float16")


SPEC_KEYS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_draft_tokens",
             "speculative_num_steps", "speculative_eagle_topk", "speculative_draft_model_quantization",
             "speculative_dflash_block_size")


@dataclass
class SGLangLaunch(LaunchConfig):
    """Typed ``python -m sglang.launch_server`` flags (host and port are added by
    :class:`~specparity.engines.server.launch.ServerProcess`).

    Field names are ``ServerArgs`` field names; the CLI flag is ``--`` + the name with ``_`` → ``-``
    (``arg_groups/arg_utils.py:288-290`` in 0.5.23, ``:218`` in 0.5.19). ``None`` / ``False`` leave a
    flag out (the server's default). ``python``: the interpreter that has SGLang (default: this one)."""

    startup_timeout_s: ClassVar[float] = GPU_STARTUP_TIMEOUT_S

    model_path: str
    context_length: int | None = None
    mem_fraction_static: float | None = None
    max_mamba_cache_size: int | None = None
    mamba_ssm_dtype: str | None = None
    cuda_graph_backend_prefill: str | None = None
    kv_cache_dtype: str | None = None
    page_size: int | None = None
    language_only: bool = False
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_draft_model_quantization: str | None = None
    max_running_requests: int | None = None
    enable_deterministic_inference: bool = False
    tp_size: int | None = None
    dp_size: int | None = None
    pp_size: int | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)
    python: str | None = None

    @property
    def program(self) -> list[str]:
        return [self.python or sys.executable, "-m", "sglang.launch_server"]

    def validate(self) -> None:
        spec_fields = [k for k in ("speculative_draft_model_path", "speculative_num_draft_tokens",
                                   "speculative_num_steps", "speculative_eagle_topk",
                                   "speculative_draft_model_quantization") if getattr(self, k) is not None]
        if not self.speculative_algorithm and spec_fields:
            raise ValueError(f"{spec_fields[0]} is set but speculative_algorithm is not")
        if (self.speculative_algorithm or "").upper() == "DFLASH" and not self.speculative_draft_model_path:
            raise ValueError("speculative_algorithm DFLASH needs speculative_draft_model_path (a draft)")
        if self.mamba_ssm_dtype is not None and self.mamba_ssm_dtype not in MAMBA_SSM_DTYPES:
            raise ValueError(f"mamba_ssm_dtype {self.mamba_ssm_dtype!r}: expected one of {', '.join(MAMBA_SSM_DTYPES)}")
        if self.cuda_graph_backend_prefill is not None and self.cuda_graph_backend_prefill not in CUDA_GRAPH_BACKENDS:
            raise ValueError(f"cuda_graph_backend_prefill {self.cuda_graph_backend_prefill!r}: expected one of "
                             f"{', '.join(CUDA_GRAPH_BACKENDS)}")

    def args(self) -> list[str]:
        self.validate()
        a = ["--model-path", self.model_path]
        if self.speculative_algorithm:
            a += ["--speculative-algorithm", self.speculative_algorithm]
            for key in ("speculative_draft_model_path", "speculative_draft_model_quantization",
                        "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
                value = getattr(self, key)
                if value is not None:
                    a += ["--" + key.replace("_", "-"), str(value)]
        for key in ("context_length", "mem_fraction_static", "max_running_requests", "max_mamba_cache_size",
                    "mamba_ssm_dtype", "kv_cache_dtype", "page_size", "tp_size", "dp_size", "pp_size"):
            value = getattr(self, key)
            if value is not None:
                a += ["--" + key.replace("_", "-"), str(value)]
        if self.cuda_graph_backend_prefill is not None:
            a.append(f"--cuda-graph-backend-prefill={self.cuda_graph_backend_prefill}")
        if self.language_only:
            a.append("--language-only")
        if self.enable_deterministic_inference:
            a.append("--enable-deterministic-inference")
        return a + list(self.extra)

    def spec_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"speculative_algorithm": self.speculative_algorithm}
        for key in SPEC_KEYS[1:6] + ("kv_cache_dtype", "enable_deterministic_inference"):
            value = getattr(self, key, None)
            if value is not None:
                out[key] = value
        return out


def launch_configs(options: EngineOptions) -> tuple[SGLangLaunch, SGLangLaunch]:
    """The baseline and speculative launches of ``--preset``, overridden by explicit options (ValueError)."""
    preset, base, spec = preset_launch_values("sglang", options.preset, target=options.target, draft=options.draft)
    ex = options.extra
    common: dict[str, Any] = {}
    for key in ("tp_size", "dp_size", "pp_size"):
        if key in ex:
            common[key] = ex[key]
    if "deterministic" in ex:
        common["enable_deterministic_inference"] = bool(ex["deterministic"])
    if ex.get("python"):
        common["python"] = ex["python"]
    common["extra"] = tuple(ex.get("server_args") or ())
    base, spec = {**base, **common}, {**spec, **common}
    if options.num_draft_tokens is not None:
        if not spec.get("speculative_algorithm"):
            raise ValueError(f"--num-draft-tokens: preset {preset.name} launches no speculative algorithm")
        spec["speculative_num_draft_tokens"] = options.num_draft_tokens
    return SGLangLaunch.pair(preset.name, base, spec)
