"""How the ``vllm`` engine launches vLLM: the typed launch (:class:`VLLMLaunch`: ``vllm serve`` or the API server
module, its flags and environment), the two launches of a preset, and what differs between vLLM versions
(:class:`VLLMApi`, the per-request speculation metrics flag).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


from specparity.engines.base import (
    EngineOptions,
)
from specparity.engines.server.launch import GPU_STARTUP_TIMEOUT_S, LaunchConfig
from specparity.engines.server.presets import fill, preset_launch_values
from specparity.model.packages import installed_package_dir
from specparity.engines.server.vllm_wire import version_tuple


PER_REQUEST_METRICS = ("none", "summary", "detailed")


ENTRYPOINTS = ("serve", "api_server")


#: Releases seen without ``--per-request-spec-decode-metrics`` (0.26.0 live; 0.27.x, reported downstream
#: of vllm#48915, which added it) and the oldest one read with it (0.33.0 source); between: unknown.
PER_REQUEST_ABSENT = ((0, 26), (0, 27))


PER_REQUEST_READ_IN = (0, 33)


#: The text whose presence in the installed ``vllm/engine/arg_utils.py`` shows the flag exists.
PER_REQUEST_ARG = "per_request_spec_decode_metrics"


@dataclass(frozen=True)
class VLLMApi:
    """What one vLLM version does differently, as far as it was seen or read; ``None``: unknown.

    ``per_request_metrics``: ``--per-request-spec-decode-metrics`` exists (absent in 0.26.0: the
    draft counters are then the ``/metrics`` deltas); ``min_p_refused_with_spec``: a speculative
    server answers 400 to ``min_p > 1e-5`` on a greedy request (0.33.0 source) — 0.26.0 accepts it
    (greedy resets ``min_p`` before the check). The gate sends ``min_p 0`` either way."""

    version: str | None
    per_request_metrics: bool | None
    min_p_refused_with_spec: bool | None

    @classmethod
    def of(cls, version: str | None) -> "VLLMApi":
        v = version_tuple(version)
        if v is not None and v in PER_REQUEST_ABSENT:
            return cls(version, False, False)
        if v is not None and v >= PER_REQUEST_READ_IN:
            return cls(version, True, True)
        return cls(version, None, None)

    def describe(self) -> str:
        """One line for the report: which behaviour the adapter saw and expects."""
        if self.version is None:
            return "vLLM version unknown (/version unreadable): draft counters from /metrics"
        if self.per_request_metrics is False:
            return (f"vLLM {self.version}: no per-request speculation metrics (no --per-request-spec-decode-metrics); "
                    "draft counters from /metrics deltas; min_p accepted under greedy")
        if self.per_request_metrics:
            return (f"vLLM {self.version}: per-request speculation metrics with --per-request-spec-decode-metrics, "
                    "else /metrics deltas; min_p > 1e-5 refused under speculation")
        return (f"vLLM {self.version}: not checked against this version; draft counters from /metrics unless the "
                "answers carry metrics")


def installed_has_per_request_flag() -> bool | None:
    """Whether the vLLM importable here (the one a launch starts) has ``--per-request-spec-decode-metrics``,
    read from its ``vllm/engine/arg_utils.py`` without importing it; None when vLLM is not importable here."""
    pkg = installed_package_dir("vllm")
    if pkg is None:
        return None
    path = pkg / "engine" / "arg_utils.py"
    try:
        return PER_REQUEST_ARG in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def drop_unsupported_per_request(launch: "VLLMLaunch", supported: bool | None) -> str | None:
    """Never pass ``--per-request-spec-decode-metrics`` to a vLLM without it (0.26.0 refuses to start):
    the launch goes ahead without it and the counters come from ``/metrics``. Returns the note that
    says so, or None when nothing was dropped (flag absent, supported, or not checkable here)."""
    asked = launch.per_request_spec_decode_metrics
    if asked in (None, "none") or supported is not False:
        return None
    launch.per_request_spec_decode_metrics = None
    return (f"per_request_metrics={asked} not passed: the installed vLLM has no --per-request-spec-decode-metrics; "
            "draft counters from /metrics deltas")


def vllm_binary() -> str:
    """The ``vllm`` console script beside this interpreter, else ``vllm`` from PATH."""
    local = Path(sys.executable).parent / "vllm"
    return str(local) if local.is_file() else "vllm"


@dataclass
class VLLMLaunch(LaunchConfig):
    """Typed ``vllm serve`` flags (host and port are added by
    :class:`~specparity.engines.server.launch.ServerProcess`).

    ``speculative_config`` goes to ``--speculative-config`` as JSON (``vllm/engine/arg_utils.py:1864``);
    ``batch_invariant`` sets the environment variable ``VLLM_BATCH_INVARIANT=1`` (``vllm/envs.py:638``:
    there is no flag). ``entrypoint``: ``serve`` (``vllm serve MODEL``) or ``api_server``
    (``python -m vllm.entrypoints.openai.api_server --model MODEL``)."""

    model: str
    speculative_config: dict[str, Any] | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    max_logprobs: int | None = None
    per_request_spec_decode_metrics: str | None = None
    batch_invariant: bool = False
    entrypoint: str = "serve"
    #: ``VLLM_SERVER_DEV_MODE=1``: the server answers ``/server_info`` (its config, the KV cache dtype, its
    #: environment), which is how the gate reads back what a launch set.
    dev_mode: bool = False
    extra: tuple[str, ...] = field(default_factory=tuple)

    startup_timeout_s: ClassVar[float] = GPU_STARTUP_TIMEOUT_S

    def validate(self) -> None:
        if self.entrypoint not in ENTRYPOINTS:
            raise ValueError(f"entrypoint {self.entrypoint!r}: expected one of {', '.join(ENTRYPOINTS)}")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, dict):
                raise ValueError("speculative_config: expected a JSON object")
            n = self.speculative_config.get("num_speculative_tokens")
            if n is not None and (not isinstance(n, int) or n < 1):
                raise ValueError(f"speculative_config.num_speculative_tokens {n!r}: expected an integer >= 1")
        pr = self.per_request_spec_decode_metrics
        if pr is not None and pr not in PER_REQUEST_METRICS:
            raise ValueError(f"per_request_spec_decode_metrics {pr!r}: expected one of "
                             f"{', '.join(PER_REQUEST_METRICS)}")
        if pr not in (None, "none") and not self.speculative_config:
            raise ValueError("per_request_spec_decode_metrics needs speculative_config (vllm/config/vllm.py:1734-1741)")

    @property
    def program(self) -> list[str]:
        if self.entrypoint == "api_server":
            return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        return [vllm_binary(), "serve"]

    def args(self) -> list[str]:
        self.validate()
        a = ["--model", self.model] if self.entrypoint == "api_server" else [self.model]
        if self.speculative_config:
            a += ["--speculative-config", json.dumps(self.speculative_config, separators=(",", ":"))]
        for key in ("served_model_name", "max_model_len", "tensor_parallel_size", "pipeline_parallel_size",
                    "data_parallel_size", "gpu_memory_utilization", "max_logprobs", "per_request_spec_decode_metrics"):
            value = getattr(self, key)
            if value is not None:
                a += ["--" + key.replace("_", "-"), str(value)]
        return a + list(self.extra)

    def env(self) -> dict[str, str]:
        out = {"VLLM_BATCH_INVARIANT": "1"} if self.batch_invariant else {}
        if self.dev_mode:
            out["VLLM_SERVER_DEV_MODE"] = "1"
        return out

    def spec_config(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.speculative_config or {})
        if self.batch_invariant:
            out["VLLM_BATCH_INVARIANT"] = "1"
        return out


def launch_configs(options: EngineOptions) -> tuple[VLLMLaunch, VLLMLaunch]:
    """The baseline and speculative launches of ``--preset``, overridden by explicit options (ValueError)."""
    preset, base, spec = preset_launch_values("vllm", options.preset, target=options.target, draft=options.draft)
    if isinstance(spec.get("speculative_config"), dict):
        sc = fill(spec["speculative_config"], target=options.target, draft=options.draft)
        if options.num_draft_tokens is not None:
            sc["num_speculative_tokens"] = options.num_draft_tokens
        spec["speculative_config"] = sc
    elif options.num_draft_tokens is not None:
        raise ValueError(f"--num-draft-tokens: preset {preset.name} launches no speculative_config")
    ex = options.extra
    common: dict[str, Any] = {"extra": tuple(ex.get("server_args") or ())}
    for opt, key in (("max_logprobs", "max_logprobs"), ("served_model_name", "served_model_name"),
                     ("entrypoint", "entrypoint"), ("tensor_parallel_size", "tensor_parallel_size"),
                     ("pipeline_parallel_size", "pipeline_parallel_size"), ("data_parallel_size", "data_parallel_size")):
        if opt in ex:
            common[key] = ex[opt]
    if "batch_invariant" in ex:
        common["batch_invariant"] = bool(ex["batch_invariant"])
    if "dev_mode" in ex:
        common["dev_mode"] = bool(ex["dev_mode"])
    base, spec = {**base, **common}, {**spec, **common}
    if "per_request_metrics" in ex:
        spec["per_request_spec_decode_metrics"] = ex["per_request_metrics"]
    return VLLMLaunch.pair(preset.name, base, spec)
