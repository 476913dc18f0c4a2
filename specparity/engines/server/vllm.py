"""The ``vllm`` engine: vLLM's OpenAI ``/v1/completions`` over HTTP, two running servers or two launches.

Facts below come from the Python source of the **vLLM 0.33.0** wheel (and 0.11.0–0.15.0 for the
speculation/logprobs history); ``docs/ENGINE_APIS.md`` has the ``file:line`` of each. They were
checked against a live **vLLM 0.26.0** on one H200 (bodies recorded in ``tests/data/vllm-0.26.0/``,
the live table in ``docs/SERVERS.md``); where 0.26 differs (:class:`VLLMApi`) the adapter reads
``/version`` and says which behaviour it saw.

* **Request.** ``POST /v1/completions`` with the prompt as token ids (used as-is), ``max_tokens``,
  ``n 1``, and *every* sampling knob explicit — unset ones are filled from the model's
  ``generation_config.json`` (``--generation-config auto``), which would silently turn greedy into
  sampling: ``temperature 0``, ``top_p 1``, ``top_k`` 0 (vLLM >= 0.11 reads 0 as "disabled" and
  quietly accepts -1; older releases only -1), ``min_p 0`` (``min_p > 1e-5`` is a 400 with
  speculation), neutral penalties, ``min_tokens 0``, ``ignore_eos false`` and the request's
  ``stop_token_ids``. ``logprobs: k`` (capped by the server's ``--max-logprobs``, default 20 →
  ``Capabilities.top_k``), ``return_tokens_as_token_ids: true`` (every token and top-logprob key is
  ``"token_id:<id>"``: exact, collision-free — decoded-string keys collapse distinct ids) and
  ``return_token_ids: true`` (``choices[0].token_ids``, cross-checked against the logprob tokens).
* **Answer.** ``choices[0]``: ``finish_reason`` ``stop`` / ``length`` (``abort`` / ``error`` /
  ``repetition`` are errors), ``token_ids`` (the stop token included; ``text`` never has it),
  ``logprobs.token_logprobs[i]`` and ``logprobs.top_logprobs[i]`` — a dict in engine order, the
  sampled token first, then ranks 1..k (k + 1 keys when the sampled token is outside the top k),
  sorted here by descending logprob and cut to k.
* **Counters.** vLLM reports no per-request draft counters by default: they are the Prometheus
  counters ``vllm:spec_decode_num_draft_tokens_total``, ``..._num_accepted_tokens_total`` and
  ``..._num_drafts_total`` on ``GET /metrics``, summed over their labels (``model_name``,
  ``engine``) and over the speculative endpoints, read before and after the speculative phase
  (``Capabilities.counters == "aggregate"``, :meth:`VLLMEngine.activity_counters`). The counters
  are fed per engine step, asynchronously to the HTTP answers, so each read waits until two
  consecutive reads agree. A phase in which they did not move fails the gate as "speculation
  inactive" — what vLLM 0.11–0.13 did to logprob requests under the ngram/suffix proposers
  (skipped drafting silently). A server started with ``--per-request-spec-decode-metrics`` also
  answers ``metrics.speculative_decoding`` per request; those are used as per-request totals.
* **Scoring** (teacher-forced, on the *baseline* server): ``prompt + continuation`` with
  ``prompt_logprobs: k`` and ``max_tokens 1``; ``choices[0].prompt_logprobs`` is ``[null, {"<id>":
  {"logprob", "rank", "decoded_token"}, ...}, ...]``, the actual token first, then ranks 1..k.
* **Batch invariance** is the environment variable ``VLLM_BATCH_INVARIANT=1`` only (no flag, not
  visible on ``/version``, ``/v1/models`` or ``system_fingerprint``); ``Capabilities.deterministic``
  says so when both launches set it, or when every ``VLLM_SERVER_DEV_MODE=1`` server of both sides
  shows it on ``/server_info``; the gate is then bit-exact. Only one side: reported, not strict.
* **Fingerprint.** A dev-mode ``/server_info`` holds the whole ``SpeculativeConfig`` (7 KB in 0.26.0,
  with the nested target/draft model and parallel configs and their run-specific ports): only its
  stable part (:func:`stable_spec_config`: method, draft model, token counts, n-gram and suffix
  settings…) enters the fingerprint, so goldens and ``--resume`` match across launches. The dtype
  ``torch.bfloat16`` is reported as ``bfloat16``.
* **Versions** (:class:`VLLMApi`). vLLM 0.26.0 (live): no ``--per-request-spec-decode-metrics`` (a
  launch asking for it is started without it, counters come from ``/metrics``), ``min_p`` accepted
  on a greedy speculative request, no ``weight_versions`` / ``usage.completion_tokens_details``,
  ``system_fingerprint`` ``vllm-0.26.0-nohash``. None of that changes what the gate sends or reads.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from specparity.engines.base import (
    Capabilities,
    EngineInfo,
    EngineOptions,
    OptionSpec,
    engine_factory,
    parse_bool,
    parse_positive_int,
)
from specparity.engines.server.vllm_descriptor import DESCRIPTOR
from specparity.engines.server.http import Endpoint, ServerError
from specparity.engines.server.traffic import TrafficTally
from specparity.engines.server.wire import WireFormat
from specparity.engines.server.launch import GPU_STARTUP_TIMEOUT_S, LaunchConfig
from specparity.engines.server.presets import fill, preset_launch_values
from specparity.engines.common import artifact
from specparity.engines.server.engine import (
    INFO_TIMEOUT_S,
    HFTokenizer,
    ServerEngine,
    check_server_flags,
    concurrency,
    declared_on_every_server,
    declaration_unknown,
    named_errors,
    resolve_tokenizer_dir,
    server_options,
    start_sessions,
)
from specparity.model.packages import installed_package_dir
from specparity.model.constraints import CONSTRAINT_FIELDS, Constraint
from specparity.model.traffic import Traffic
from specparity.model.types import ArtifactId, GenerationRequest, GenerationResult, SpecStats, TokenScores

#: ``--max-logprobs`` default (``vllm/config/model.py:286``).
DEFAULT_MAX_LOGPROBS = 20
#: The counters read around the speculative phase: our name -> exposed sample name.
SPEC_COUNTERS = {
    "proposed": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "verify_steps": "vllm:spec_decode_num_drafts_total",
}
#: What the servers served, read with the draft counters (``tests/data/vllm/metrics_after.txt``, and the
#: live 0.26.0 bodies): our name -> exposed sample name, summed over labels (``finished_reason`` too).
TRAFFIC_COUNTERS = {
    "finished": "vllm:request_success_total",
    "generated": "vllm:generation_tokens_total",
}
SPEC_FAMILY_PREFIX = "vllm:spec_decode_"
PER_REQUEST_METRICS = ("none", "summary", "detailed")
ENTRYPOINTS = ("serve", "api_server")
#: Seconds between two /metrics reads while waiting for the counters to settle, and the most reads.
SETTLE_INTERVAL_S = 0.25
SETTLE_READS = 12
#: Releases seen without ``--per-request-spec-decode-metrics`` (0.26.0 live; 0.27.x, reported downstream
#: of vllm#48915, which added it) and the oldest one read with it (0.33.0 source); between: unknown.
PER_REQUEST_ABSENT = ((0, 26), (0, 27))
PER_REQUEST_READ_IN = (0, 33)
#: The text whose presence in the installed ``vllm/engine/arg_utils.py`` shows the flag exists.
PER_REQUEST_ARG = "per_request_spec_decode_metrics"
#: Words in the keys of a served ``SpeculativeConfig`` that change from launch to launch.
RUN_SPECIFIC_WORDS = ("port", "addr", "_ip", "rank", "seed", "instance")


def version_tuple(version: str | None) -> tuple[int, int] | None:
    """``"0.26.0"`` → ``(0, 26)``; None when unreadable."""
    try:
        major, minor = (int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return None
    return major, minor


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


def stable_spec_config(config: Any) -> dict[str, Any]:
    """The launch-independent part of a served ``SpeculativeConfig`` (dev-mode ``/server_info``):
    the scalar settings that are set (method, model, num_speculative_tokens, prompt_lookup_*,
    suffix_decoding_*, rejection/draft sampling…), without the nested target/draft model and parallel
    configs (7 KB in 0.26.0, with ports that change per launch) and without private or run-specific
    keys. Goldens and ``--resume`` compare fingerprints, so this must not change between launches."""
    if not isinstance(config, dict):
        return {}
    out: dict[str, Any] = {}
    for key in sorted(config):
        value = config[key]
        if key.startswith("_") or value is None or isinstance(value, (dict, list, tuple)):
            continue
        if any(word in key for word in RUN_SPECIFIC_WORDS):
            continue
        out[key] = value
    return out


def normalise_dtype(dtype: Any) -> str | None:
    """``torch.bfloat16`` (vLLM's ``model_config.dtype`` on ``/server_info``) → ``bfloat16``."""
    if dtype is None:
        return None
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


#: Where a dev-mode ``/server_info`` ``vllm_config`` says what decides how the target computes (the paths of
#: the recorded 0.26.0 body, ``tests/data/vllm-0.26.0/server_info_ngram.json``): every server of both sides
#: must report the same (:meth:`ServerEngine.check_same_target`).
NUMERICS_PATHS = ("model_config.dtype", "model_config.quantization", "cache_config.cache_dtype",
                  "attention_config.backend", "parallel_config.tensor_parallel_size",
                  "parallel_config.pipeline_parallel_size")


def reported_numerics(vllm_config: Any) -> dict[str, Any]:
    """{path: value} of :data:`NUMERICS_PATHS` that ``vllm_config`` reports (dtype without ``torch.``; a
    null quantization as "none"; a null attention backend is not a report: vLLM chose it and says no
    more); empty without a dev-mode ``/server_info``."""
    out: dict[str, Any] = {}
    for path in NUMERICS_PATHS:
        section, key = path.split(".")
        part = vllm_config.get(section) if isinstance(vllm_config, dict) else None
        if isinstance(part, dict) and part.get(key) is not None:
            out[path] = normalise_dtype(part[key]) if path == "model_config.dtype" else part[key]
        elif isinstance(part, dict) and key in part and path == "model_config.quantization":
            out[path] = "none"  # vLLM resolves it from the checkpoint: null is unquantized weights
    return out


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


# ---------------------------------------------------------------------------------------------- launch


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


OPTIONS = {
    **server_options("vLLM", "vllm serve", startup_timeout_s=VLLMLaunch.startup_timeout_s,
                     concurrency_note="; a run or sweep may raise it up to the max_num_seqs every server reports "
                                      "on its dev-mode /server_info"),
    "max_logprobs": OptionSpec(f"the servers' --max-logprobs (default {DEFAULT_MAX_LOGPROBS}); launches pass it on",
                               parse=parse_positive_int),
    "served_model_name": OptionSpec("the model name sent in requests (default: the first id of GET /v1/models)"),
    "tensor_parallel_size": OptionSpec("launches: --tensor-parallel-size for both launches", parse=parse_positive_int),
    "pipeline_parallel_size": OptionSpec("launches: --pipeline-parallel-size for both launches",
                                         parse=parse_positive_int),
    "data_parallel_size": OptionSpec("launches: --data-parallel-size for both launches", parse=parse_positive_int),
    "batch_invariant": OptionSpec("launches: set VLLM_BATCH_INVARIANT=1 for both servers (true/false)", parse=parse_bool),
    "dev_mode": OptionSpec("launches: set VLLM_SERVER_DEV_MODE=1 for both servers, so /server_info shows their config "
                           "(true/false)", parse=parse_bool),
    "per_request_metrics": OptionSpec("launches: --per-request-spec-decode-metrics on the speculative server "
                                      "(per-request draft counters)", choices=PER_REQUEST_METRICS),
    "entrypoint": OptionSpec("launches: 'serve' (vllm serve MODEL) or 'api_server' (python -m "
                             "vllm.entrypoints.openai.api_server)", choices=ENTRYPOINTS),
}


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


def check_options(options: EngineOptions) -> None:
    """Everything the vllm engine needs, checked before anything launches (ValueError, one line)."""
    check_server_flags(options, "vllm")
    resolve_tokenizer_dir(options, "vllm")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ValueError("--engine vllm: reading vLLM's /metrics draft counters needs the prometheus_client package, "
                         "which is not installed (pip install prometheus_client)")
    if options.preset:
        launch_configs(options)


INFO = EngineInfo("vllm", options=OPTIONS, dtypes=(), local_models=False, check=check_options, server=True, descriptor=DESCRIPTOR,
                  counters="aggregate", constraints=CONSTRAINT_FIELDS,
                  force_reject_note="newer vLLM's rejection_sample_method synthetic with synthetic_acceptance_length 1 "
                  "is not wired here yet (untested); see docs/FORCE_REJECT.md")


# ---------------------------------------------------------------------------------------------- wire format


def top_k_disabled(version: str | None) -> int:
    """The ``top_k`` value meaning "no top-k": 0 from vLLM 0.11 on (read in 0.11.0 and 0.33.0, which also
    quietly accept -1), -1 for older or unknown versions (accepted by every version read)."""
    v = version_tuple(version)
    return -1 if v is None else (0 if v >= (0, 11) else -1)


#: ``structured_outputs`` key of each prompt constraint (``StructuredOutputsParams`` in 0.26 and 0.33;
#: the old top-level ``guided_json`` / ``guided_grammar`` are gone from both).
CONSTRAINT_KEYS = {"json_schema": "json", "grammar": "grammar"}


def completion_body(model: str | None, prompt_ids: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int],
                    *, logprobs: int | None, top_k: int, prompt_logprobs: int | None = None,
                    constraint: Constraint | None = None) -> dict[str, Any]:
    """The ``/v1/completions`` body: token-id prompt, greedy with every knob explicit, logprobs by id;
    a prompt's output constraint as ``structured_outputs`` (:data:`CONSTRAINT_KEYS`)."""
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    body.update({
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(max_tokens),
        "n": 1,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": int(top_k),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "logprobs": logprobs,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
    })
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = int(prompt_logprobs)
    if constraint is not None:
        body["structured_outputs"] = {CONSTRAINT_KEYS[constraint.kind]: constraint.value()}
    return body


def request_body(req: GenerationRequest, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body of one generation request; ``facts``: the served ``model`` name and
    the server version's ``top_k`` value meaning "no top-k" (:meth:`VLLMEngine.request_facts`)."""
    return completion_body(facts.get("model"), req.prompt_ids, req.max_new_tokens, req.stop_token_ids,
                           logprobs=req.top_k, top_k=int(facts["top_k"]), constraint=req.constraint)


def score_body(prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int,
               facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` body that scores ``continuation_ids`` teacher-forced: prompt + continuation
    as the prompt, one new token, ``prompt_logprobs`` k (:func:`parse_prompt_logprobs` reads it)."""
    return completion_body(facts.get("model"), [*prompt_ids, *continuation_ids], 1, (), logprobs=None,
                           top_k=int(facts["top_k"]), prompt_logprobs=top_k)


WIRE = WireFormat("/v1/completions", request_body, score=score_body)


def parse_token_key(key: str) -> int:
    """``"token_id:1587"`` → 1587 (ValueError for a decoded-string key: ``return_tokens_as_token_ids`` ignored)."""
    if not isinstance(key, str) or not key.startswith("token_id:"):
        raise ValueError(f"token {key!r} is not 'token_id:<id>': the server ignored return_tokens_as_token_ids")
    return int(key[len("token_id:"):])


def parse_logprobs_block(block: dict[str, Any], k: int) -> tuple[list[int], TokenScores]:
    """``choices[i].logprobs`` (with ``return_tokens_as_token_ids``) → (token ids, scores)."""
    tokens = block["tokens"]
    ids = [parse_token_key(t) for t in tokens]
    n = len(ids)
    lps, tops = block["token_logprobs"], block["top_logprobs"]
    if len(lps) != n or len(tops) != n:
        raise ValueError(f"logprobs block: {n} tokens, {len(lps)} token_logprobs, {len(tops)} top_logprobs")
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    for i in range(n):
        logprobs[i] = math.nan if lps[i] is None else float(lps[i])
        row = tops[i]
        if not row:
            continue
        # engine order: the sampled token first, then ranks 1..k; sorting is stable, so equal logprobs
        # keep that order. With the sampled token outside the top k the row has k + 1 keys.
        alts = sorted(((parse_token_key(key), float(v)) for key, v in row.items()), key=lambda t: -t[1])
        for j, (tid, lp) in enumerate(alts[:k]):
            top_ids[i, j], top_lp[i, j] = tid, lp
    return ids, TokenScores(np.asarray(ids, np.int64), logprobs, top_ids, top_lp)


def parse_completion(body: Any, k: int) -> tuple[list[int], str, TokenScores, dict[str, Any]]:
    """A ``/v1/completions`` answer for one prompt → (output ids, finish reason, scores, choice)."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise ServerError("/v1/completions answered without 'choices'")
    if len(body["choices"]) != 1:
        raise ServerError(f"/v1/completions answered {len(body['choices'])} choices for one prompt")
    choice = body["choices"][0]
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise ServerError(f"finish_reason {finish!r} (stop_reason {choice.get('stop_reason')!r}): expected 'stop' or "
                          "'length'")
    block = choice.get("logprobs")
    if not isinstance(block, dict):
        raise ServerError("choices[0].logprobs is null: the server ignored 'logprobs'")
    ids, scores = parse_logprobs_block(block, k)
    token_ids = choice.get("token_ids")
    if token_ids is not None and [int(t) for t in token_ids] != ids:
        raise ServerError(f"choices[0].token_ids {token_ids} disagree with logprobs.tokens {ids}")
    return ids, finish, scores, choice


def parse_prompt_logprobs(rows: Any, prompt_ids: Sequence[int], continuation_ids: Sequence[int],
                          k: int) -> TokenScores:
    """``choices[0].prompt_logprobs`` of ``prompt + continuation`` → the continuation's rows.

    Each position is ``{"<id>": {"logprob", "rank", "decoded_token"}}``: the actual token first (with
    its own rank, which may exceed k), then ranks 1..k."""
    L, n = len(prompt_ids), len(continuation_ids)
    if not isinstance(rows, list) or len(rows) != L + n:
        got = len(rows) if isinstance(rows, list) else rows
        raise ValueError(f"prompt_logprobs has {got} positions, expected {L + n}")
    if rows[0] is not None:
        raise ValueError("prompt_logprobs[0] is not null (the first prompt token has no logprob)")
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    for i, tok in enumerate(continuation_ids):
        row = rows[L + i]
        if not isinstance(row, dict) or str(int(tok)) not in row:
            raise ValueError(f"prompt_logprobs[{L + i}] has no entry for the actual token {tok}")
        logprobs[i] = float(row[str(int(tok))]["logprob"])
        cands = []
        for key, entry in row.items():
            rank = entry.get("rank")
            if int(key) == int(tok) and (rank is None or rank > k):
                continue  # the actual token outside the top k
            cands.append((rank if rank is not None else math.inf, -float(entry["logprob"]), int(key)))
        for j, (_, neg_lp, tid) in enumerate(sorted(cands)[:k]):
            top_ids[i, j], top_lp[i, j] = tid, -neg_lp
    return TokenScores(np.asarray(continuation_ids, np.int64), logprobs, top_ids, top_lp)


def usage_facts(body: dict[str, Any]) -> dict[str, Any]:
    """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` (the latter only from a
    server started with ``--enable-prompt-tokens-details``; None otherwise): what proves a prefix-cache
    hit and a prompt's length."""
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}


def request_spec_stats(body: dict[str, Any]) -> SpecStats | None:
    """``metrics.speculative_decoding`` (``--per-request-spec-decode-metrics``) → per-request totals."""
    sd = (body.get("metrics") or {}).get("speculative_decoding") if isinstance(body.get("metrics"), dict) else None
    if not isinstance(sd, dict):
        return None
    proposed, accepted = int(sd["num_draft_tokens"]), int(sd["num_accepted_draft_tokens"])
    steps = int(sd["num_spec_steps"])
    if accepted > proposed:
        raise ServerError(f"metrics.speculative_decoding: num_accepted_draft_tokens {accepted} > num_draft_tokens "
                          f"{proposed}")
    return SpecStats(True, proposed=proposed, accepted=accepted, verify_steps=steps,
                     source="vLLM response metrics.speculative_decoding (--per-request-spec-decode-metrics): "
                            "num_draft_tokens / num_accepted_draft_tokens / num_spec_steps")


def parse_metrics(text: str) -> dict[str, Any]:
    """A ``/metrics`` exposition → ``{"proposed", "accepted", "verify_steps"}`` summed over labels,
    ``{"finished", "generated"}`` (:data:`TRAFFIC_COUNTERS`; None when the exposition has no such
    sample), and ``"spec_families"``: whether any ``vllm:spec_decode_*`` family exists (only with a
    speculative config)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {key: 0 for key in SPEC_COUNTERS}
    out.update({key: None for key in TRAFFIC_COUNTERS})
    wanted = {sample: key for key, sample in {**SPEC_COUNTERS, **TRAFFIC_COUNTERS}.items()}
    families = False
    for family in text_string_to_metric_families(text):
        if family.name.startswith(SPEC_FAMILY_PREFIX):
            families = True
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] = (out[key] or 0) + int(round(sample.value))
    out["spec_families"] = families
    return out


def answer_tokens(answer: Any) -> int:
    """The tokens an answer carries (``choices[0].token_ids``), for a tally when ``usage`` is missing."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    ids = first.get("token_ids")
    return len(ids) if isinstance(ids, list) else 0


# ---------------------------------------------------------------------------------------------- engine


def reported_max_num_seqs(info: dict[str, Any] | None) -> int | None:
    """``vllm_config.scheduler_config.max_num_seqs`` of a dev-mode ``/server_info?config_format=json``
    answer (vLLM's ``SchedulerConfig``: the sequences one scheduler step may hold), None when absent."""
    config = (info or {}).get("vllm_config")
    scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
    n = scheduler.get("max_num_seqs") if isinstance(scheduler, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


class VLLMEngine(ServerEngine):
    name = "vllm"
    descriptor = DESCRIPTOR
    scorer_description = ("vLLM prompt_logprobs on the baseline server: prompt + continuation, max_tokens 1, "
                          "prompt_logprobs k (position 0 is null)")

    launches: tuple[VLLMLaunch | None, VLLMLaunch | None]

    def __init__(self, *args: Any, max_logprobs: int, served_model_name: str | None = None, notes: Sequence[str] = (),
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_logprobs = max_logprobs
        self.served_model_name = served_model_name
        #: What the adapter changed or fell back to for this vLLM (e.g. a dropped per-request flag).
        self.notes: list[str] = list(notes)
        #: Requests in flight without --concurrency, when ``max_concurrency`` is what the servers can
        #: take (their max_num_seqs) rather than that default (:func:`create`).
        self.default_concurrency: int | None = None
        #: This engine's answered requests on the speculative servers, against which the servers' own
        #: counts show other traffic (:meth:`activity_counters`).
        self.traffic = TrafficTally()

    # ------------------------------------------------------------------ server facts (cached)
    def _fact(self, endpoint: Endpoint, what: str, read: Callable[[], Any]) -> Any:
        """``read()`` once (:meth:`ServerEngine.cached`); an answer that is an HTTP error is None,
        a server that cannot be reached raises (and is asked again next time)."""
        def answered() -> Any:
            try:
                return read()
            except ServerError as exc:
                if exc.transport:
                    raise
                return None
        return self.cached(endpoint, what, answered)

    def version(self, endpoint: Endpoint) -> str | None:
        def read() -> str | None:
            v = endpoint.get_json("/version", timeout_s=INFO_TIMEOUT_S)
            return str(v.get("version")) if isinstance(v, dict) and v.get("version") else None
        return self._fact(endpoint, "version", read)

    def model_name(self, endpoint: Endpoint) -> str | None:
        if self.served_model_name:
            return self.served_model_name

        def read() -> str | None:
            data = endpoint.get_json("/v1/models", timeout_s=INFO_TIMEOUT_S).get("data") or []
            return str(data[0]["id"]) if data else None
        return self._fact(endpoint, "model", read)

    def model_card(self, endpoint: Endpoint) -> dict[str, Any]:
        def read() -> dict[str, Any]:
            data = endpoint.get_json("/v1/models", timeout_s=INFO_TIMEOUT_S).get("data") or [{}]
            return data[0] if isinstance(data[0], dict) else {}
        return self._fact(endpoint, "card", read) or {}

    def dev_server_info(self, endpoint: Endpoint) -> dict[str, Any] | None:
        """``GET /server_info?config_format=json``: only on ``VLLM_SERVER_DEV_MODE=1`` servers (else 404 → None)."""
        def read() -> dict[str, Any] | None:
            got = endpoint.get_json("/server_info?config_format=json", timeout_s=INFO_TIMEOUT_S)
            return got if isinstance(got, dict) else None
        try:
            return self._fact(endpoint, "server_info", read)
        except ServerError:
            return None

    def max_num_seqs(self) -> int | None:
        """The fewest sequences any server of both sides schedules at once (``scheduler_config.max_num_seqs``
        of its dev-mode ``/server_info``); None when one of them does not say."""
        seen = []
        for _, endpoint in self.every_server():
            n = reported_max_num_seqs(self.dev_server_info(endpoint))
            if n is None:
                return None
            seen.append(n)
        return min(seen) if seen else None

    def read_metrics(self, endpoint: Endpoint) -> dict[str, Any]:
        with named_errors(endpoint):
            text = endpoint.request("GET", "/metrics", timeout_s=INFO_TIMEOUT_S).body.decode("utf-8", "replace")
        try:
            return parse_metrics(text)
        except ValueError as exc:
            raise ServerError(f"{endpoint.base_url}/metrics: not a Prometheus exposition ({exc})") from None

    def spec_families(self, endpoint: Endpoint) -> bool | None:
        """Whether the server exposes ``vllm:spec_decode_*`` counters (it has a speculative config);
        None when ``/metrics`` cannot be read."""
        try:
            return self._fact(endpoint, "spec_families", lambda: self.read_metrics(endpoint)["spec_families"])
        except ServerError:
            return None

    # ------------------------------------------------------------------ protocol
    def server_info(self, endpoint: Endpoint) -> dict[str, Any]:
        is_spec = self.is_speculative(endpoint)
        version = self.version(endpoint)
        card = self.model_card(endpoint)
        dev = self.dev_server_info(endpoint) or {}
        config = dev.get("vllm_config") if isinstance(dev.get("vllm_config"), dict) else {}
        spec_config: dict[str, Any] = {}
        if is_spec:
            launch = self.launches[1]
            if launch is not None:
                spec_config = launch.spec_config()
            elif isinstance(config.get("speculative_config"), dict):
                spec_config = stable_spec_config(config["speculative_config"])
            else:
                spec_config = {"speculative_config": "unknown: not launched by the gate (vLLM shows it only on "
                                                     "/server_info under VLLM_SERVER_DEV_MODE=1)"}
        summary = {"version": version, "model": card.get("id"), "root": card.get("root"),
                   "max_model_len": card.get("max_model_len"), "spec_decode_counters": self.spec_families(endpoint),
                   "api": VLLMApi.of(version).describe()}
        if is_spec and self.notes:
            summary["notes"] = list(self.notes)
        numerics = reported_numerics(config)
        dtype = numerics.get("model_config.dtype")
        return {"version": f"vllm {version or 'unknown'}", "dtype": dtype or "server", "spec_config": spec_config,
                "summary": summary, "identity": {"model_root": card.get("root")}, "numerics": numerics}

    def capabilities(self) -> Capabilities:
        deterministic, partial, unknown = self._deterministic()
        return Capabilities(scoring=True, top_k=self.max_logprobs, counters="aggregate",
                            max_concurrency=self.max_concurrency, default_concurrency=self.default_concurrency,
                            deterministic=deterministic, deterministic_partial=partial, deterministic_unknown=unknown)

    def _deterministic(self) -> tuple[str | None, str | None, str | None]:
        """(declared for both sides, declared for only some servers, declared by some and unknown for
        the rest: :func:`~specparity.engines.server.engine.declaration_unknown`). Launched servers: both get
        ``VLLM_BATCH_INVARIANT=1`` from ``batch_invariant`` (both by construction; a preset that set it
        on one launch only is partial). Running servers: every baseline and speculative server must
        show it on its dev-mode ``/server_info`` (``vllm_env``); a server without that route is
        "unknown", never assumed."""
        launches = [(role, launch) for role, launch in zip(("baseline", "spec"), self.launches) if launch is not None]
        if launches:
            if all(launch.batch_invariant for _, launch in launches):
                return ("vllm: VLLM_BATCH_INVARIANT=1 set in the environment of both launched servers (env only)", None,
                        None)
            on = [role for role, launch in launches if launch.batch_invariant]
            if on:
                return None, f"vllm: VLLM_BATCH_INVARIANT=1 set for the {' and '.join(on)} launch only", None
            return None, None, None
        said = []
        for role, endpoint in self.every_server():
            info = self.dev_server_info(endpoint)
            # vllm_env holds the parsed envs values: VLLM_BATCH_INVARIANT is a bool (JSON true)
            value = (info.get("vllm_env") or {}).get("VLLM_BATCH_INVARIANT") if info is not None else None
            on = "unknown (no dev-mode /server_info)" if info is None else (
                "true" if str(value).lower() in ("1", "true") else json.dumps(value))
            said.append((role, endpoint.base_url, on))
        what = "vllm /server_info vllm_env.VLLM_BATCH_INVARIANT=true"
        return (*declared_on_every_server(said, what, "; VLLM_SERVER_DEV_MODE=1 servers"),
                declaration_unknown(said, what))

    def complete(self, endpoint: Endpoint, req: GenerationRequest, speculative: bool) -> GenerationResult:
        if req.top_k > self.max_logprobs:
            raise ServerError(f"--top-k {req.top_k} is above the server's --max-logprobs {self.max_logprobs} "
                              "(pass --engine-opt max_logprobs=N when the server allows more)")
        families = self.spec_families(endpoint)
        if speculative and families is False:
            raise ServerError("the speculative server exposes no vllm:spec_decode_* counters on /metrics: it was "
                              "launched without --speculative-config")
        if not speculative and families:
            raise ServerError("the baseline server exposes vllm:spec_decode_* counters on /metrics: it was launched "
                              "with --speculative-config; the baseline must run without speculation")
        answer = endpoint.post_json(WIRE.path, WIRE.body(req, self.request_facts(endpoint)))
        if speculative:
            self.traffic.add(answer, answer_tokens(answer))
        ids, finish, scores, _ = parse_completion(answer, req.top_k)
        if speculative:
            spec = request_spec_stats(answer) or SpecStats.unavailable(
                "vLLM reports draft counters only run-wide: /metrics, read before and after the speculative phase")
        else:
            spec = SpecStats.unavailable("speculation off")
        return GenerationResult(req.request_id, ids, self.decode(ids), finish, scores, spec,
                                facts={k: v for k, v in usage_facts(answer).items() if v is not None})

    def request_facts(self, endpoint: Endpoint) -> dict[str, Any]:
        """The served model name and the version's "no top-k" value (:func:`request_body`)."""
        model = self.model_name(endpoint)
        return {"model": model, "top_k": top_k_disabled(self.version(endpoint))}

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        n = len(continuation_ids)
        if n == 0:
            return TokenScores.empty(top_k)
        if top_k > self.max_logprobs:
            raise ServerError(f"--top-k {top_k} is above the server's --max-logprobs {self.max_logprobs}")
        endpoint = self.scoring_endpoint(prompt_ids)
        with named_errors(endpoint, "scoring answer malformed"):
            body = score_body(prompt_ids, continuation_ids, top_k, self.request_facts(endpoint))
            answer = endpoint.post_json(WIRE.path, body)
            if self.is_speculative(endpoint):  # the cross-instance scoring: traffic on a speculative server
                self.traffic.add(answer, 1)
            if not isinstance(answer, dict) or not answer.get("choices"):
                raise ServerError("/v1/completions (scoring) answered without 'choices'")
            return parse_prompt_logprobs(answer["choices"][0].get("prompt_logprobs"), prompt_ids, continuation_ids,
                                         top_k)

    def activity_counters(self) -> dict[str, Any]:
        """Run-wide draft counters of the speculative servers, summed, once they stopped moving; with
        them (``"traffic"``, :class:`~specparity.model.traffic.Traffic`) the servers' finished requests
        and generated tokens and this engine's own count of both, so the gate can tell whether the
        counters moved for this run alone."""
        keys = (*SPEC_COUNTERS, *TRAFFIC_COUNTERS)
        previous: dict[str, Any] | None = None
        for _ in range(SETTLE_READS):
            totals: dict[str, Any] = {key: 0 for key in keys}
            families = []
            for endpoint in self.spec.fleet.endpoints:
                got = self.read_metrics(endpoint)
                families.append(got["spec_families"])
                for key in keys:
                    totals[key] = None if totals[key] is None or got[key] is None else totals[key] + got[key]
            if previous is not None and all(previous[k] == totals[k] for k in keys):
                break
            previous = totals
            time.sleep(SETTLE_INTERVAL_S)
        names = ", ".join(SPEC_COUNTERS.values())
        where = ", ".join(self.spec.fleet.urls)
        absent = "" if all(families) else "; the vllm:spec_decode_* families are absent (no --speculative-config)"
        own_finished, own_generated = self.traffic.snapshot()
        traffic = Traffic(totals.pop("finished"), totals.pop("generated"), own_finished, own_generated,
                          f"{', '.join(TRAFFIC_COUNTERS.values())} at {where}")
        totals["source"] = f"vLLM /metrics {names}, summed over labels at {where}{absent}"
        totals["traffic"] = traffic.to_json()
        return totals


@engine_factory(INFO)
def create(options: EngineOptions) -> VLLMEngine:
    tokenizer = HFTokenizer(resolve_tokenizer_dir(options, "vllm"))
    ex = options.extra
    max_logprobs = int(ex.get("max_logprobs") or DEFAULT_MAX_LOGPROBS)
    launches: tuple[VLLMLaunch | None, VLLMLaunch | None] = (None, None)
    notes: list[str] = []
    target, draft = options.target, options.draft
    if not options.baseline_urls:
        launches = launch_configs(options)
        spec_launch = launches[1]
        dropped = drop_unsupported_per_request(spec_launch, installed_has_per_request_flag())
        if dropped:
            notes.append(dropped)
        target = spec_launch.model
        draft = (spec_launch.speculative_config or {}).get("model") or options.draft
    baseline, spec = start_sessions(options, launches, "vllm")
    engine = VLLMEngine(options, baseline, spec, tokenizer, target=artifact(target) or ArtifactId("", "", ""),
                        draft=artifact(draft), launches=launches, max_concurrency=concurrency(options, spec),
                        max_logprobs=max_logprobs, served_model_name=ex.get("served_model_name"), notes=notes)
    if not ex.get("max_concurrency"):
        # what the servers can take bounds a run or sweep level; a plain run keeps the default in flight
        per_server = engine.max_num_seqs()
        if per_server is not None:
            engine.default_concurrency = min(engine.max_concurrency, concurrency(options, spec, per_server))
            engine.max_concurrency = concurrency(options, spec, per_server)
    if not target:  # name the model the server says it serves (hashed when that path is local)
        try:
            card = engine.model_card(spec.fleet.endpoints[0])
        except ServerError:
            card = {}
        engine._target = artifact(card.get("root") or card.get("id"), "/v1/models root") or engine._target
    return engine
