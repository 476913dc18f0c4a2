"""The ``sglang`` engine: SGLang's native ``/generate`` over HTTP, two running servers or two launches.

Facts below come from the Python source of the SGLang wheels, **0.5.23** and, where it differs,
**0.5.19** (``docs/ENGINE_APIS.md`` has the ``file:line`` of each). It was exercised against the
SGLang protocol emulator in ``tests/fakes/sglang.py`` and the bodies in ``tests/data/sglang/``, never
against a live SGLang (no GPU here).

* **Request.** ``POST /generate`` with ``input_ids`` (one prompt; used as-is, no BOS added),
  ``return_logprob: true``, ``top_logprobs_num: k``, ``logprob_start_len: -1`` (no prompt
  logprobs) and ``sampling_params`` = :data:`SENT_SAMPLING_KEYS` only: greedy (``temperature 0``,
  ``top_k 1``), every other knob explicitly neutral (``--preferred-sampling-params`` server
  defaults are merged into ``/generate`` requests), ``ignore_eos: false`` (in SGLang ``ignore_eos``
  also disables ``stop_token_ids``) and the request's ``stop_token_ids``. An unknown
  ``sampling_params`` key is HTTP **400** ``{"error": "unknown field ..."}`` in 0.5.23 and HTTP
  **500** ``text/plain`` "Internal Server Error" in 0.5.19 (an uncaught ``TypeError``), so only
  keys both versions declare are sent (unit-tested against both allow-lists).
* **Answer.** ``output_ids`` (the matched stop token included), ``meta_info.finish_reason`` (a
  dict: ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message": ...}``), ``meta_info.output_token_logprobs[i] = [logprob, id,
  text|null]`` and ``output_top_logprobs[i]`` = a list of such entries sorted by descending
  logprob, or ``null`` for a position without a row (*not reported*: NaN).
* **Counters** are per-request totals on the *finished* answer, written only when the server has
  a ``speculative_algorithm`` and ``spec_verify_ct > 0``: ``spec_verify_ct`` (verify forwards →
  ``verify_steps``), ``spec_num_correct_drafts`` (accepted drafts, counted before the finish
  truncation, so it can exceed what was emitted) and ``spec_num_proposed_drafts`` (=
  ``spec_verify_ct * (speculative_num_draft_tokens - 1)``); 0.5.19 also sends the aliases
  ``spec_accepted_drafts`` / ``spec_proposed_drafts``. A speculative answer of >= 2 tokens from
  a server that declares speculation but carries no ``spec_*`` key is an **error** (never a
  silent pass); a 1-token answer legitimately has none (it finished at the prefill).
* **Scoring** (teacher-forced, on the *baseline* server): one ``/generate`` of ``prompt +
  continuation`` with ``max_new_tokens 1`` and ``logprob_start_len = len(prompt) - 1``; the
  prompt-logprob lists then start at the last prompt position, whose entry is always
  ``[null, id, ...]`` (and ``input_top_logprobs[0]`` is ``null``), so entry 0 is dropped and entry
  ``j >= 1`` is the row that predicts ``continuation[j - 1]``.
* **Server facts** from ``GET /server_info`` (``/get_server_info`` on servers without it):
  ``version``, ``speculative_*``, ``kv_cache_dtype``, ``enable_deterministic_inference``
  (→ ``Capabilities.deterministic``, saying where it was read, when every baseline and speculative
  server says ``true``; the gate is then bit-exact; a one-sided ``true`` is only reported),
  ``disable_radix_cache`` …
* Speculation is a launch-time setting, so the baseline and the speculative run are two servers
  (``--baseline-url`` / ``--spec-url``) or two launches of a preset
  (``python -m sglang.launch_server`` from :class:`SGLangLaunch`; needs a GPU).
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence

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
from specparity.engines.server.sglang_descriptor import DESCRIPTOR
from specparity.engines.server.http import Endpoint, ServerError
from specparity.engines.server.wire import WireFormat
from specparity.engines.server.launch import GPU_STARTUP_TIMEOUT_S, LaunchConfig
from specparity.engines.server.presets import preset_launch_values
from specparity.engines.common import artifact
from specparity.engines.server.engine import (
    DEFAULT_CONCURRENCY,
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
from specparity.model.constraints import Constraint
from specparity.model.types import ArtifactId, GenerationRequest, GenerationResult, SpecStats, TokenScores

#: ``--speculative-algorithm`` names SGLang resolves (case-insensitive; 0.5.23
#: ``speculative/spec_info.py:32-66``; 0.5.19 lacks ``UNO``). Not enforced: plugins may register more.
ALGORITHMS = ("DFLASH", "UNO", "DSPARK", "EAGLE", "EAGLE3", "FROZEN_KV_MTP", "STANDALONE", "NGRAM", "NEXTN")
#: ``sampling_params`` keys 0.5.23 accepts (the contract allow-list, ``sglang/api/v1/api_types.py:1256``).
SAMPLING_KEYS_0_5_23 = frozenset((
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
))
#: ``SamplingParams`` struct fields of 0.5.19 that a client may set (``sglang/srt/sampling/sampling_params.py:57-88``).
SAMPLING_KEYS_0_5_19 = frozenset((
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params",
))
#: What this adapter sends: greedy, every other knob neutral and explicit.
GREEDY_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 0.0, "frequency_penalty": 0.0,
                   "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "ignore_eos": False}
SENT_SAMPLING_KEYS = frozenset(GREEDY_SAMPLING) | {"max_new_tokens", "stop_token_ids"}
#: ``sampling_params`` key of each prompt constraint (both 0.5.19 and 0.5.23 declare them, as strings:
#: ``json_schema`` is the schema serialised as JSON; ``ebnf`` takes the GBNF dialect xgrammar reads).
CONSTRAINT_KEYS = {"json_schema": "json_schema", "grammar": "ebnf"}
#: ``--preferred-sampling-params`` keys that would change the tokens of a request that does not send
#: them (the server merges its preferred params under every ``/generate``'s own,
#: ``tokenizer_manager.py:1549-1552`` in 0.5.23).
UNSENT_HARMFUL_KEYS = ("stop", "stop_regex", "regex", "json_schema", "ebnf", "structural_tag", "logit_bias",
                       "custom_params", "n", "beam_width", "watermark", "choice")
#: ``--cuda-graph-backend-prefill`` choices (0.5.19 also has ``tc_piecewise``, which 0.5.23 rejects).
CUDA_GRAPH_BACKENDS = ("full", "breakable", "disabled", "tc_piecewise")
MAMBA_SSM_DTYPES = ("float32", "bfloat16", "float16")
#: Keys of ``/server_info`` kept in the fingerprint.
SUMMARY_KEYS = ("version", "model_path", "dtype", "kv_cache_dtype", "context_length", "page_size", "tp_size",
                "dp_size", "pp_size",
                "max_running_requests", "mem_fraction_static", "attention_backend", "sampling_backend",
                "enable_deterministic_inference", "disable_radix_cache", "random_seed", "launch_command")
#: The ``/server_info`` fields (recorded in ``tests/data/sglang/server_info_*.json``) that decide how the
#: target computes: every server of both sides must report the same (:meth:`ServerEngine.check_same_target`).
NUMERICS_KEYS = ("dtype", "quantization", "kv_cache_dtype", "attention_backend", "prefill_attention_backend",
                 "decode_attention_backend", "tp_size", "pp_size")


def reported_numerics(info: dict[str, Any]) -> dict[str, Any]:
    """The :data:`NUMERICS_KEYS` a ``/server_info`` body reports; a null ``quantization`` is a report too
    ("none": the weights as stored), a null backend is not (chosen by the server, which says no more)."""
    out = {k: info[k] for k in NUMERICS_KEYS if info.get(k) is not None}
    if "quantization" in info and info["quantization"] is None:
        out["quantization"] = "none"
    return out


SPEC_KEYS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_draft_tokens",
             "speculative_num_steps", "speculative_eagle_topk", "speculative_draft_model_quantization",
             "speculative_dflash_block_size")
SPEC_SOURCE = ("sglang meta_info spec_verify_ct / spec_num_correct_drafts / spec_num_proposed_drafts (per-request "
               "totals; proposed = verify_ct x (speculative_num_draft_tokens - 1); accepted counted before the "
               "finish truncation)")


# ---------------------------------------------------------------------------------------------- launch


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


OPTIONS = {
    **server_options("SGLang", "sglang.launch_server", startup_timeout_s=SGLangLaunch.startup_timeout_s,
                     concurrency_note=", capped by a launch's max_running_requests",
                     gpus_note=": on one GPU their --mem-fraction-static must fit together"),
    "python": OptionSpec("launches: the Python interpreter that has SGLang installed (default: this one)"),
    "tp_size": OptionSpec("launches: --tp-size for both launches", parse=parse_positive_int),
    "dp_size": OptionSpec("launches: --dp-size for both launches", parse=parse_positive_int),
    "pp_size": OptionSpec("launches: --pp-size for both launches", parse=parse_positive_int),
    "deterministic": OptionSpec("launches: --enable-deterministic-inference on both launches (true/false)",
                                parse=parse_bool),
}


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


def check_options(options: EngineOptions) -> None:
    """Everything the sglang engine needs, checked before anything launches (ValueError, one line)."""
    check_server_flags(options, "sglang")
    resolve_tokenizer_dir(options, "sglang")
    if options.preset:
        launch_configs(options)


INFO = EngineInfo("sglang", options=OPTIONS, dtypes=(), local_models=False, check=check_options, server=True, descriptor=DESCRIPTOR,
                  counters="request", constraints=tuple(CONSTRAINT_KEYS),
                  force_reject_note="SGLang's own knob, SGLANG_SIMULATE_ACC_LEN=1 with SGLANG_SIMULATE_ACC_TOKEN_MODE="
                  "real-draft-token, is not wired here yet (untested); see docs/FORCE_REJECT.md")


# ---------------------------------------------------------------------------------------------- wire format


def generate_body(input_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int], top_k: int, *,
                  logprob_start_len: int = -1, rid: str | None = None,
                  constraint: Constraint | None = None) -> dict[str, Any]:
    """The ``/generate`` body: one prompt, greedy, logprobs on, only keys 0.5.19 and 0.5.23 both know;
    a prompt's output constraint as its ``sampling_params`` key (:data:`CONSTRAINT_KEYS`)."""
    sampling: dict[str, Any] = {"max_new_tokens": int(max_new_tokens), **GREEDY_SAMPLING}
    if stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if constraint is not None:
        sampling[CONSTRAINT_KEYS[constraint.kind]] = constraint.text
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": int(logprob_start_len),
        "top_logprobs_num": int(top_k),
    }
    if rid:
        body["rid"] = rid
    return body


def request_body(req: GenerationRequest, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/generate`` body of one generation request; ``facts["rid"]``: its request id (each request
    gets a fresh one: SGLang refuses an id already in flight)."""
    return generate_body(req.prompt_ids, req.max_new_tokens, req.stop_token_ids, req.top_k, rid=facts.get("rid"),
                         constraint=req.constraint)


def score_body(prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int,
               facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/generate`` body that scores ``continuation_ids`` teacher-forced: prompt + continuation, one
    new token, logprobs from the last prompt position (:func:`parse_score` reads it); ``facts["rid"]`` as
    in :func:`request_body`."""
    return generate_body([*prompt_ids, *continuation_ids], 1, (), top_k, logprob_start_len=len(prompt_ids) - 1,
                         rid=facts.get("rid"))


WIRE = WireFormat("/generate", request_body, per_request=("rid",), score=score_body)


def _float_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def parse_logprobs(token_rows: Sequence[Any], top_rows: Sequence[Any] | None, token_ids: Sequence[int],
                   k: int, what: str = "output") -> TokenScores:
    """``*_token_logprobs`` / ``*_top_logprobs`` → :class:`TokenScores` (ValueError on a malformed list).

    ``token_rows[i] = [logprob|null, id, text|null]`` must name ``token_ids[i]``; a ``null`` logprob
    or a ``null`` top row is *not reported* (NaN, top id -1)."""
    n = len(token_ids)
    if len(token_rows) != n:
        raise ValueError(f"{what}_token_logprobs has {len(token_rows)} entries for {n} tokens")
    if top_rows is not None and len(top_rows) != n:
        raise ValueError(f"{what}_top_logprobs has {len(top_rows)} rows for {n} tokens")
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    for i, entry in enumerate(token_rows):
        if int(entry[1]) != int(token_ids[i]):
            raise ValueError(f"{what}_token_logprobs[{i}] names token {entry[1]}, the stream has {token_ids[i]}")
        logprobs[i] = _float_or_nan(entry[0])
        row = top_rows[i] if top_rows is not None else None
        for j, alt in enumerate((row or [])[:k]):
            top_ids[i, j] = int(alt[1])
            top_lp[i, j] = _float_or_nan(alt[0])
    return TokenScores(np.asarray(token_ids, np.int64), logprobs, top_ids, top_lp)


def parse_finish(meta: dict[str, Any]) -> str:
    """``meta_info.finish_reason`` → ``stop`` / ``length``; ServerError for an abort or an unfinished answer."""
    fr = meta.get("finish_reason")
    if fr is None:
        raise ServerError("meta_info.finish_reason is null: the answer is not a finished request")
    if not isinstance(fr, dict):
        raise ServerError(f"meta_info.finish_reason {fr!r}: expected an object with 'type'")
    kind = fr.get("type")
    if kind == "stop" and isinstance(fr.get("matched"), str):
        raise ServerError(f"the server stopped on the string/regex {fr['matched']!r}, and none was sent "
                          "(a --preferred-sampling-params stop?)")
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        raise ServerError(f"the server aborted the request: {fr.get('message')!r} (status_code "
                          f"{fr.get('status_code')}, err_type {fr.get('err_type')})")
    raise ServerError(f"meta_info.finish_reason type {kind!r}: expected 'stop', 'length' or 'abort'")


def _first(meta: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if meta.get(key) is not None:
            return meta[key]
    return None


#: ``declared`` value for a server whose ``/server_info`` could not be read.
UNKNOWN = "<unknown>"


#: How SGLang's /server_info spells "no speculative algorithm" (None, or the enum's name as a string).
NO_ALGORITHM = ("", "none", "null")


def declared_name(value: Any) -> str | None:
    """The declared ``speculative_algorithm``, None for every spelling of "none" (SGLang prints its
    ``SpeculativeAlgorithm.NONE`` enum as ``"NONE"``)."""
    if value is None or str(value).strip().lower() in NO_ALGORITHM:
        return None
    return str(value)


def spec_stats(meta: dict[str, Any], n_out: int, declared: str | None) -> SpecStats:
    """Per-request counters of a speculative answer. ``declared``: the server's ``speculative_algorithm``
    (None: it declares none; :data:`UNKNOWN`: ``/server_info`` unreadable)."""
    verify = meta.get("spec_verify_ct")
    accepted = _first(meta, "spec_num_correct_drafts", "spec_accepted_drafts")
    proposed = _first(meta, "spec_num_proposed_drafts", "spec_proposed_drafts")
    present = [k for k, v in (("spec_verify_ct", verify), ("spec_num_correct_drafts", accepted),
                              ("spec_num_proposed_drafts", proposed)) if v is not None]
    if present and len(present) < 3:
        missing = sorted({"spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts"} - set(present))
        raise ServerError(f"meta_info has {', '.join(present)} but not {', '.join(missing)}")
    if present:
        verify, accepted, proposed = int(verify), int(accepted), int(proposed)
        if accepted > proposed or verify < 0 or accepted < 0:
            raise ServerError(f"meta_info spec counters inconsistent: spec_num_correct_drafts {accepted}, "
                              f"spec_num_proposed_drafts {proposed}, spec_verify_ct {verify}")
        return SpecStats(True, proposed=proposed, accepted=accepted, verify_steps=verify, source=SPEC_SOURCE)
    histogram = _first(meta, "spec_correct_drafts_histogram", "spec_accept_histogram")
    if histogram is not None:
        # Verify forwards but no scalar keys: speculative_num_draft_tokens <= 1, nothing drafted.
        return SpecStats(True, proposed=0, accepted=0, verify_steps=int(sum(histogram)),
                         source="sglang meta_info spec_correct_drafts_histogram only (speculative_num_draft_tokens "
                                "<= 1: no draft tokens proposed)")
    if declared is None:  # a server launched without speculation: inactive, which fails, never "unknown"
        return SpecStats(True, proposed=0, accepted=0, verify_steps=0,
                         source="the speculative server declares no speculative_algorithm in /server_info: it does "
                                "not speculate")
    if n_out < 2:
        return SpecStats(True, source="sglang: finished after the prefill token, no verify step (no spec_* keys)")
    if declared == UNKNOWN:
        return SpecStats.unavailable("no spec_* keys in meta_info and /server_info unreadable")
    raise ServerError(f"the server declares speculative_algorithm={declared} but its {n_out}-token answer carries "
                      "no spec_* keys in meta_info: cannot tell whether speculation ran")


#: ``meta_info`` keys that say how the server served a request, and the name each is journalled under
#: (:attr:`~specparity.model.types.GenerationResult.facts`): the prompt's token count, the prompt tokens its
#: radix cache held, and ``num_retractions``, the times the scheduler retracted the request to free KV cache
#: (``Req.retraction_count``, answered by ``TokenizerManager`` in 0.5.17): SGLang's preemption.
ANSWER_FACTS = {"prompt_tokens": "prompt_tokens", "cached_tokens": "cached_tokens", "num_retractions": "preemptions"}


#: ``meta_info`` times (seconds since the epoch, the server's clock) a server with ``--enable-metrics`` answers:
#: when the request reached the server and when it finished (``APIServerReqTimeStats.convert_to_output_meta_info``,
#: 0.5.17). Requests alive at once beyond what the server runs waited for a slot.
ANSWER_TIMES = {"request_received_ts": "received_ts", "request_finished_ts": "finished_ts"}


def answer_facts(meta: dict[str, Any]) -> dict[str, int | float]:
    """The :data:`ANSWER_FACTS` and :data:`ANSWER_TIMES` an answer's ``meta_info`` carries (a key it lacks is
    left out)."""
    out: dict[str, int | float] = {name: int(meta[key]) for key, name in ANSWER_FACTS.items()
                                   if isinstance(meta.get(key), int) and not isinstance(meta.get(key), bool)}
    for key, name in ANSWER_TIMES.items():
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def parse_generate(body: Any, k: int) -> tuple[list[int], str, TokenScores, dict[str, Any]]:
    """A ``/generate`` answer for one prompt → (output ids, finish reason, scores, meta_info)."""
    if isinstance(body, list):
        raise ServerError(f"/generate answered a JSON array of {len(body)} items (a batch) for one prompt")
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ServerError("/generate answered without meta_info")
    meta = body["meta_info"]
    ids = [int(t) for t in body["output_ids"]]
    finish = parse_finish(meta)
    if "output_token_logprobs" not in meta:
        raise ServerError("meta_info has no output_token_logprobs: the server ignored return_logprob")
    scores = parse_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs"), ids, k)
    return ids, finish, scores, meta


def parse_score(body: Any, prompt_ids: Sequence[int], continuation_ids: Sequence[int], k: int) -> TokenScores:
    """A ``/generate`` answer with ``logprob_start_len = len(prompt) - 1`` → the continuation's rows."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ServerError("/generate (scoring) answered without meta_info")
    meta = body["meta_info"]
    rows = meta.get("input_token_logprobs")
    tops = meta.get("input_top_logprobs")
    n = len(continuation_ids)
    if not isinstance(rows, list) or len(rows) != n + 1:
        got = len(rows) if isinstance(rows, list) else rows
        raise ServerError(f"input_token_logprobs has {got} entries, expected {n + 1} (last prompt position + "
                          "continuation)")
    if rows[0][0] is not None or int(rows[0][1]) != int(prompt_ids[-1]):
        raise ServerError(f"input_token_logprobs[0] is {rows[0]!r}, expected [null, {prompt_ids[-1]}, ...]")
    if tops is not None and (len(tops) != n + 1 or tops[0] is not None):
        raise ServerError("input_top_logprobs does not start with null at the last prompt position")
    return parse_logprobs(rows[1:], tops[1:] if tops is not None else None, continuation_ids, k, what="input")


# ---------------------------------------------------------------------------------------------- engine


class SGLangEngine(ServerEngine):
    name = "sglang"
    descriptor = DESCRIPTOR
    scorer_description = ("SGLang prompt logprobs on the baseline server: one /generate of prompt + continuation "
                          "with logprob_start_len = len(prompt) - 1 (entry 0 is null and dropped), max_new_tokens 1")

    launches: tuple[SGLangLaunch | None, SGLangLaunch | None]

    # ------------------------------------------------------------------ server facts
    def raw_server_info(self, endpoint: Endpoint) -> dict[str, Any] | None:
        """``GET /server_info`` (``/get_server_info`` where it is missing), cached; None when unreadable."""
        def read() -> dict[str, Any]:
            for path in ("/server_info", "/get_server_info"):
                try:
                    got = endpoint.get_json(path, timeout_s=INFO_TIMEOUT_S)
                except ServerError as exc:
                    if exc.status == 404:
                        continue
                    raise
                return got if isinstance(got, dict) else {}
            return {}
        try:
            return self.cached(endpoint, "server_info", read) or None
        except ServerError:
            return None  # not cached: a server still starting may answer later

    def preferred_problem(self, endpoint: Endpoint) -> str | None:
        """The server's ``--preferred-sampling-params`` keys that would change a request's tokens."""
        preferred = (self.raw_server_info(endpoint) or {}).get("preferred_sampling_params")
        if isinstance(preferred, str):
            try:
                preferred = json.loads(preferred)
            except ValueError:
                return f"preferred_sampling_params {preferred!r} is not JSON"
        bad = sorted(k for k in (preferred or {}) if k in UNSENT_HARMFUL_KEYS and preferred[k] not in (None, [], ""))
        if bad:
            return (f"the server's --preferred-sampling-params sets {', '.join(bad)}, which SGLang merges into every "
                    "/generate request that does not send it; relaunch without them")
        return None

    def declared_algorithm(self, endpoint: Endpoint) -> str | None:
        info = self.raw_server_info(endpoint)
        if not info or "speculative_algorithm" not in info:
            return UNKNOWN
        return declared_name(info.get("speculative_algorithm"))

    def server_info(self, endpoint: Endpoint) -> dict[str, Any]:
        info = self.raw_server_info(endpoint) or {}
        is_spec = self.is_speculative(endpoint)
        summary = {k: info.get(k) for k in SUMMARY_KEYS if k in info}
        states = info.get("internal_states") or [{}]
        first = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
        if "avg_spec_accept_length" in first:  # absent until the first decode-stats flush
            summary["avg_spec_accept_length"] = first["avg_spec_accept_length"]
        if is_spec:
            spec_config = {k: info.get(k) for k in SPEC_KEYS if k in info}
            if not spec_config:
                launch = self.launches[1]
                spec_config = launch.spec_config() if launch else {"speculative_algorithm": "unknown (/server_info "
                                                                                             "unreadable)"}
        else:
            spec_config = {}
        return {"version": f"sglang {info.get('version', 'unknown')}", "dtype": info.get("dtype") or "server",
                "spec_config": spec_config, "summary": summary,
                "identity": {k: info.get(k) for k in ("model_path", "tokenizer_path")},
                "numerics": reported_numerics(info)}

    def capabilities(self) -> Capabilities:
        """``deterministic`` only when **every** server of both sides reports
        ``enable_deterministic_inference: true`` in ``/server_info``: the promise of bit-exact output
        holds between two deterministic servers, not between a deterministic one and an ordinary one.
        A declaration by only some of them (or a server whose ``/server_info`` is unreadable or lacks
        the key) goes to ``deterministic_partial``, in the same words, and makes nothing strict."""
        said = []
        for role, endpoint in self.every_server():
            on = (self.raw_server_info(endpoint) or {}).get("enable_deterministic_inference")
            said.append((role, endpoint.base_url, "unknown (/server_info unreadable or without the key)" if on is None
                         else str(bool(on)).lower()))
        what = "sglang /server_info enable_deterministic_inference=true"
        deterministic, partial = declared_on_every_server(said, what)
        return Capabilities(scoring=True, top_k=None, counters="request", max_concurrency=self.max_concurrency,
                            deterministic=deterministic, deterministic_partial=partial,
                            deterministic_unknown=declaration_unknown(said, what))

    # ------------------------------------------------------------------ requests
    def complete(self, endpoint: Endpoint, req: GenerationRequest, speculative: bool) -> GenerationResult:
        declared = self.declared_algorithm(endpoint)
        problem = self.preferred_problem(endpoint)
        if problem:
            raise ServerError(problem)
        if not speculative and declared not in (None, UNKNOWN):
            raise ServerError(f"the baseline server declares speculative_algorithm={declared} in /server_info: "
                              "the baseline must run without speculation")
        rid = f"specparity-{req.request_id}-{uuid.uuid4().hex[:12]}"
        body = endpoint.post_json(WIRE.path, WIRE.body(req, {**self.request_facts(endpoint), "rid": rid}))
        ids, finish, scores, meta = parse_generate(body, req.top_k)
        if speculative:
            spec = spec_stats(meta, len(ids), declared)
        else:
            if meta.get("spec_verify_ct"):
                raise ServerError(f"the baseline server answered spec_verify_ct={meta['spec_verify_ct']}: it runs "
                                  "with speculation; the baseline must not")
            spec = SpecStats.unavailable("speculation off")
        wall = float(meta.get("e2e_latency") or 0.0)
        return GenerationResult(req.request_id, ids, self.decode(ids), finish, scores, spec, wall_s=wall,
                                facts=answer_facts(meta))

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        n = len(continuation_ids)
        if n == 0:
            return TokenScores.empty(top_k)
        if not prompt_ids:
            raise ServerError("cannot score a continuation without at least one prompt token")
        endpoint = self.scoring_endpoint(prompt_ids)
        with named_errors(endpoint, "scoring answer malformed"):
            body = endpoint.post_json(WIRE.path, score_body(prompt_ids, continuation_ids, top_k,
                                                            {"rid": f"specparity-score-{uuid.uuid4().hex[:12]}"}))
            return parse_score(body, prompt_ids, continuation_ids, top_k)


@engine_factory(INFO)
def create(options: EngineOptions) -> SGLangEngine:
    tokenizer = HFTokenizer(resolve_tokenizer_dir(options, "sglang"))
    launches: tuple[SGLangLaunch | None, SGLangLaunch | None] = (None, None)
    per_server = None
    target, draft = options.target, options.draft
    if not options.baseline_urls:
        launches = launch_configs(options)
        spec_launch = launches[1]
        if spec_launch.max_running_requests:  # no more in flight than the server runs at once
            per_server = min(DEFAULT_CONCURRENCY, spec_launch.max_running_requests)
        target, draft = spec_launch.model_path, spec_launch.speculative_draft_model_path
    baseline, spec = start_sessions(options, launches, "sglang")
    engine = SGLangEngine(options, baseline, spec, tokenizer, target=artifact(target) or ArtifactId("", "", ""),
                          draft=artifact(draft), launches=launches, max_concurrency=concurrency(options, spec, per_server))
    if not target:  # name the model the server says it serves (hashed when that path is local)
        info = engine.raw_server_info(spec.fleet.endpoints[0]) or {}
        engine._target = artifact(info.get("model_path"), "/server_info model_path") or engine._target
        if draft is None:
            engine._draft = artifact(info.get("speculative_draft_model_path"), "/server_info "
                                     "speculative_draft_model_path")
    return engine
