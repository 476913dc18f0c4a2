"""A vLLM-protocol fake: ``vllm serve`` as seen over HTTP, and its faults.

It speaks vLLM's wire format — field names, key order, ``null`` entries, error bodies and status
codes as read from the vLLM 0.33.0 source (``docs/ENGINE_APIS.md``), recorded in
``tests/data/vllm/``, and for ``version="0.26.0"`` field by field as a live 0.26.0 answered
(``tests/data/vllm-0.26.0/``) — and computes every token, logprob and speculation counter (the
``/metrics`` counters and, with ``per_request_metrics``, ``metrics.speculative_decoding``) with the
fixture models (:mod:`fakes.backend`). A request outside the greedy, non-streaming subset
(sampling, penalties, ``stream``, ``echo``, ``ignore_eos``, a knob vLLM would fill from
``generation_config.json``) gets HTTP 400 starting ``emulator:``.

Knobs besides the faults of :class:`~fakes.server.FakeServer`:

* ``spec_disabled_for_logprobs=True``: what vLLM 0.11–0.13 did under the ngram/suffix proposers: a
  request with ``logprobs`` is decoded without drafting, and the ``/metrics`` spec counters never move.
* ``dev_mode=True``: a ``VLLM_SERVER_DEV_MODE=1`` server, which answers ``GET /server_info``
  (``vllm_config``, ``vllm_env``, ``system_env``); ``batch_invariant=True`` puts
  ``VLLM_BATCH_INVARIANT: true`` in its ``vllm_env``; ``max_num_seqs=N`` its ``vllm_config``'s
  ``scheduler_config.max_num_seqs`` (the recorded 0.26.0 dump keeps no scheduler config, so without it
  there is none).
* ``near_tie_flips=N`` (speculative): the first N answers of two or more tokens are flipped at their
  closest call (:meth:`~fakes.backend.FixtureBackend.flip_closest_call`).
* ``structured_outputs`` ``{"json": schema}`` / ``{"grammar": gbnf}``: honoured as a constrained
  decode (:meth:`~fakes.backend.FixtureBackend.constrained_generate`) and recorded in
  ``constraints_seen`` as ``(prompt ids, kind, text)``; ``grammar_rollback_bug=True`` (speculative):
  the grammar state is lost after the first verify step.
* ``version="0.26.0"``: ``system_fingerprint`` ``vllm-0.26.0-nohash``, no ``weight_versions`` in a
  choice, no ``usage.completion_tokens_details``, ``metrics`` always null (0.26 has no
  ``--per-request-spec-decode-metrics``: ``per_request_metrics=True`` is refused), ``min_p`` accepted
  on a greedy speculative request, and a dev-mode ``/server_info`` shaped like the recorded one.

Configuration-arm knobs (``specparity arms``; each a bug that only its arm catches):

* ``preempt_budget_tokens=N``: a KV cache of N tokens (``--num-gpu-blocks-override``): a decode
  request (two or more tokens) whose length (prompt + ``max_tokens``) times the most requests in flight
  while it waited (each decode is held ``batch_window_s`` first, as a scheduler collects a batch)
  exceeds N is preempted, counted in ``vllm:num_preemptions_total`` and listed in ``preempted``;
  ``preempt_bug=True`` flips a preempted answer at its closest call (a KV cache restored wrongly);
  ``preempt_scoring=True`` counts a preemption for every ``prompt_logprobs`` (scoring) request, as a long
  prefill preempted under a small cache would be, and flips nothing.
* The prefix cache (on by default, as vLLM's is: ``CacheConfig.enable_prefix_caching``, ``config/cache.py``;
  ``prefix_cache=False`` is ``--no-enable-prefix-caching``), as 0.26.0 keeps it in blocks of
  ``PREFIX_BLOCK`` tokens: a request reads it when scheduled — all but its last prompt token
  (``KVCacheManager.get_computed_blocks``) — except a ``prompt_logprobs`` request, which skips reading it
  (``SamplingParams.skip_reading_prefix_cache`` defaults to ``prompt_logprobs is not None``,
  ``sampling_params.py``) but whose full blocks are cached all the same, as every request's are
  (``KVCacheManager.allocate_slots`` → ``cache_blocks``, ``v1/core/kv_cache_manager.py``): a scoring request
  warms the cache for a later request of the same prompt. Here a finished request's prompt and all but its
  last output token are inserted. ``prompt_tokens_details=True`` (``--enable-prompt-tokens-details``)
  answers ``usage.prompt_tokens_details.cached_tokens``. With ``dev_mode``, ``POST /reset_prefix_cache``
  empties it (``{"success": false}`` while a request is in flight: ``BlockPool.reset_prefix_cache``).
  ``prefix_hit_bug=True`` flips an answer that found its whole prompt cached; ``cold_prefill_bug=True``
  (speculative) one that found nothing cached. ``spec_method`` (default ``draft_model``) is the dev-mode
  ``speculative_config.method``; for a draft that reads the target's hidden states (``eagle``, ``eagle3``,
  ``mtp``, ``dflash``, ``dspark``) a hit loses its last block, as vLLM 0.26.0 recomputes it for the draft
  (``find_longest_cache_hit``).
* ``batch_invariant=True`` with ``deterministic_bug=True``: a speculative server that flips its answers
  only in batch-invariant mode; ``kv_cache_dtype`` (dev-mode ``cache_config.cache_dtype``, default
  ``auto``) with ``fp8_bug=True``: flips only when it starts with ``fp8``.
* ``attention_backend`` / ``tensor_parallel_size`` / ``pipeline_parallel_size``: the dev-mode
  ``attention_config.backend`` (default null: chosen by vLLM) and ``parallel_config.tensor_parallel_size``
  / ``pipeline_parallel_size`` (default 1), as the recorded body
  reports them; the fixture model computes the same either way (the gate must see the launch differ).
* ``scoring_skew_nats=x``: its ``prompt_logprobs`` rows (teacher-forced scoring) have every alternative
  below the top-1 x nats lower, the actual token's too where it is not the top-1; decode rows are right
  (as :func:`~fakes.backend.scoring_skew`): a scoring path off by x nats at every pair, argmax unmoved.
* ``drop_leading=S``: the model does not see the first S tokens of a longer prompt (the fixture target
  has 4096 positions; a long-context prompt of 32K tokens is still counted, cached and answered in full:
  ``usage.prompt_tokens``, ``prompt_logprobs`` with a null row for each position left out). The cut is
  counted from the prompt's start, so a decode and the teacher-forced scoring of its tokens (the same
  prompt with the answer appended) see the same context. With it,
  ``long_bug_tokens=N`` (speculative): flips an answer whose prompt is longer than N tokens (a bug that
  shows only at long context).

The content faults, in vLLM's fields: ``no_timings`` answers ``metrics: null``;
``accepted_gt_drafted`` reports more accepted draft tokens than drafted (in ``metrics`` and in the
``/metrics`` counters); ``short_limit`` finishes ``length`` with half the tokens; ``bad_prob_ids``
names another token in the last ``logprobs.tokens`` entry. ``http_500`` is vLLM's error body of a
dead engine core.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
import uuid
from typing import Any, Sequence

from fakes.backend import DATA, DRAFT, TARGET, FixtureBackend, recorded, shared_backend, shortened
from fakes.prefix_cache import PrefixCache
from fakes.faults import Rule
from fakes.server import FakeServer, Reply, Request, json_reply, not_found, refuses
from specparity.model.constraints import Constraint

#: Speculative methods whose prefix-cache hits vLLM 0.26.0 shortens by one block (its
#: ``SpeculativeConfig.use_eagle``).
HIDDEN_STATE_DRAFTS = ("eagle", "eagle3", "mtp", "dflash", "dspark")
#: The fake prefix cache's block size (vLLM's default ``--block-size``).
PREFIX_BLOCK = 16
#: Knobs vLLM fills from ``generation_config.json`` when a request leaves them unset.
VLLM_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class VLLMServer(FakeServer):
    """``vllm serve`` as seen over HTTP: ``/v1/completions``, ``/v1/models``, ``/version``, ``/health``
    and ``/metrics`` (Prometheus text rendered by ``prometheus_client`` from counters declared as vLLM
    declares them)."""

    server_version = "uvicorn"
    generation_paths = ("/v1/completions",)

    def __init__(self, *, speculative: bool = False, spec_disabled_for_logprobs: bool = False,
                 per_request_metrics: bool = False, max_logprobs: int = 20, version: str = "0.33.0",
                 served_model_name: str = "fixture/target", dev_mode: bool = False, batch_invariant: bool = False,
                 near_tie_flips: int = 0, backend: FixtureBackend | None = None, rules: Sequence[Rule] = (),
                 die_after: int | None = None, refuse: bool = False, hang_s: float = 30.0, trickle_s: float = 0.1,
                 grammar_rollback_bug: bool = False, preempt_budget_tokens: int | None = None,
                 preempt_bug: bool = False, batch_window_s: float = 0.3, prefix_cache: bool = True,
                 prompt_tokens_details: bool = False, prefix_hit_bug: bool = False, deterministic_bug: bool = False,
                 kv_cache_dtype: str = "auto", fp8_bug: bool = False, max_num_seqs: int | None = None,
                 drop_leading: int | None = None, long_bug_tokens: int | None = None,
                 attention_backend: str | None = None, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1, scoring_skew_nats: float = 0.0, spec_method: str = "draft_model",
                 cold_prefill_bug: bool = False, preempt_scoring: bool = False):
        super().__init__(rules=rules, die_after=die_after, refuse=refuse, hang_s=hang_s, trickle_s=trickle_s)
        self.backend = backend or shared_backend()
        self.grammar_rollback_bug = grammar_rollback_bug
        self.preempt_budget_tokens = preempt_budget_tokens
        self.preempt_bug = preempt_bug
        self.batch_window_s = batch_window_s
        #: Prompts (as token ids, joined) whose requests were preempted.
        self.preempted: list[str] = []
        self.prefix_cache = prefix_cache
        self.prompt_tokens_details = prompt_tokens_details
        self.prefix_hit_bug = prefix_hit_bug
        self.cold_prefill_bug = cold_prefill_bug
        self.preempt_scoring = preempt_scoring
        self.deterministic_bug = deterministic_bug
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_bug = fp8_bug
        self.attention_backend = attention_backend
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.drop_leading = drop_leading
        self.long_bug_tokens = long_bug_tokens
        self.scoring_skew_nats = scoring_skew_nats
        self.spec_method = spec_method
        #: The prefix cache, and the prompts (as token ids, joined) of the answers an arm's bug flipped.
        self._prefix_cache = PrefixCache(PREFIX_BLOCK)
        self.arm_flipped: list[str] = []
        #: (prompt ids, kind, text) of every constrained request, for the test to check.
        self.constraints_seen: list[tuple[list[int], str, str]] = []
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if near_tie_flips and not speculative:
            raise ValueError("near_tie_flips: only a speculative emulator flips its answers")
        #: vLLM 0.26.x answers as recorded live (tests/data/vllm-0.26.0/), else as read in 0.33.0's source
        self.v026 = version.split(".")[:2] == ["0", "26"]
        if per_request_metrics and speculative and self.v026:
            raise ValueError("per_request_metrics: vLLM 0.26 has no --per-request-spec-decode-metrics")
        self.speculative = speculative
        self.dev_mode = dev_mode
        self.max_num_seqs = max_num_seqs
        self.batch_invariant = batch_invariant
        self.near_tie_flips = near_tie_flips
        self.flipped: list[str] = []  # prompts (as token ids, joined) of the flipped answers
        self.spec_disabled_for_logprobs = spec_disabled_for_logprobs
        self.per_request_metrics = per_request_metrics and speculative
        self.max_logprobs = max_logprobs
        self.version = version
        self.served = served_model_name
        self.num_spec_tokens = self.backend.draft_width
        self.created = int(time.time())
        self.fingerprint = f"vllm-{version}-nohash" if self.v026 else "vllm-%s-%s" % (version, hashlib.sha256(
            f"{served_model_name}{speculative}".encode()).hexdigest()[:8])
        # metrics, declared as vllm/v1/spec_decode/metrics.py:177-275 and vllm/v1/metrics/loggers.py:499
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.labelvalues = (served_model_name, "0")
        if speculative:
            self.c_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                                    registry=self.registry)
            self.c_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                          registry=self.registry)
            self.c_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels,
                                      registry=self.registry)
            self.c_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels + ["position"],
                                     registry=self.registry)
            for c in (self.c_drafts, self.c_draft_tokens, self.c_accepted):
                c.labels(*self.labelvalues)
            for pos in range(self.num_spec_tokens):
                self.c_per_pos.labels(*self.labelvalues, str(pos))
        self.g_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                               registry=self.registry)
        self.g_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                               registry=self.registry)
        self.c_prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                registry=self.registry)
        self.c_generation = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                    registry=self.registry)
        self.c_preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                     labels, registry=self.registry)
        self.c_preemptions.labels(*self.labelvalues)
        self.c_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                 labels[:1] + ["finished_reason"] + labels[1:], registry=self.registry)
        for g in (self.g_running, self.g_waiting, self.c_prompt, self.c_generation):
            g.labels(*self.labelvalues)
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self.c_success.labels(self.labelvalues[0], reason, self.labelvalues[1])

    # ------------------------------------------------------------------ routing
    def bad_json(self, raw: bytes) -> Reply:
        return self._error(400, "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 0), 'msg': "
                                "'JSON decode error'}", "Bad Request")

    def _error(self, code: int, message: str, kind: str = "BadRequestError", param: str | None = None,
               value: Any = None) -> Reply:
        if param is not None:
            message = f"{message} (parameter={param}, value={value})"
        return json_reply(code, {"error": {"message": message, "type": kind, "param": param, "code": code}})

    def error_500(self) -> Reply:
        return self._error(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                           "InternalServerError")

    def error_400(self) -> Reply:
        return self._error(400, "This model's maximum context length is 4096 tokens. However, your request has "
                                "4097 input tokens. Please reduce the length of the input messages.")

    def prompt_of(self, body: Any) -> list[int]:
        return list(body["prompt"])

    def limit_of(self, body: Any) -> int:
        return int(body.get("max_tokens") or 16)

    def route(self, req: Request) -> Reply:
        method, path, query, body = req.method, req.path, req.query, req.body
        if method == "GET" and path == "/health":
            return Reply(200, None, b"")
        if method == "GET" and path == "/version":
            return json_reply(200, {"version": self.version})
        if method == "GET" and path == "/v1/models":
            models = recorded(DATA / "vllm" / "models.json")
            card = models["data"][0]
            card.update({"id": self.served, "root": str(TARGET), "created": self.created, "max_model_len": 4096})
            card["permission"][0]["created"] = self.created
            return json_reply(200, models)
        if method == "GET" and path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            with self.backend.lock:
                text = generate_latest(self.registry)
            return Reply(200, CONTENT_TYPE_LATEST, text)
        if method == "GET" and path == "/server_info" and self.dev_mode:
            return json_reply(200, self.dev_server_info(query))
        if method == "POST" and path == "/v1/completions":
            return self.completions(body, req.fault)
        if method == "POST" and path == "/reset_prefix_cache" and self.dev_mode:
            with self._lock:
                idle = self.in_flight == 0
            if idle:
                self._prefix_cache.clear()
            return json_reply(200, {"success": idle})
        return not_found()

    def dev_server_info(self, query: str) -> dict[str, Any]:
        """``GET /server_info`` of a ``VLLM_SERVER_DEV_MODE=1`` server (vLLM's
        ``serve/instrumentator/server_info.py``, ``serve/dev/server_info/api_router.py`` in 0.33.0):
        ``vllm_config`` (``str(VllmConfig)``, or with ``config_format=json`` its pydantic JSON dump;
        here only the keys the adapter reads), ``vllm_env`` (every ``VLLM_*`` name of ``vllm.envs``
        without ``KEY``, as its *parsed* value: ``VLLM_BATCH_INVARIANT`` is
        ``bool(int(os.getenv(...)))``, so JSON ``true``/``false``) and ``system_env``
        (``collect_env``; a few keys here)."""
        spec = ({"method": self.spec_method, "model": str(DRAFT), "num_speculative_tokens": self.num_spec_tokens}
                if self.speculative else None)
        config = {"model_config": {"model": str(TARGET), "dtype": "torch.float32", "max_model_len": 4096,
                                   "served_model_name": self.served},
                  "speculative_config": spec}
        config["cache_config"] = {"cache_dtype": self.kv_cache_dtype, "block_size": PREFIX_BLOCK}
        config["parallel_config"] = {"tensor_parallel_size": self.tensor_parallel_size,
                                         "pipeline_parallel_size": self.pipeline_parallel_size}
        config["attention_config"] = {"backend": self.attention_backend}
        if self.v026:  # the recorded 0.26.0 shapes: the whole SpeculativeConfig, nested configs and ports
            live = recorded(DATA / "vllm-0.26.0" / "server_info_ngram.json")["vllm_config"]
            model_config = {**live["model_config"], "model": str(TARGET), "tokenizer": str(TARGET),
                            "served_model_name": self.served}
            spec = copy.deepcopy(live["speculative_config"]) if self.speculative else None
            if spec is not None:
                spec.update({"method": self.spec_method, "model": str(DRAFT), "num_speculative_tokens": self.num_spec_tokens,
                             "prompt_lookup_max": None, "prompt_lookup_min": None, "target_model_config": model_config})
                spec["draft_model_config"] = {**model_config, "model": str(DRAFT), "tokenizer": str(DRAFT)}
            config = {"model_config": model_config, "speculative_config": spec}
            config["cache_config"] = {**live.get("cache_config", {}), "cache_dtype": self.kv_cache_dtype}
            config["parallel_config"] = {**live["parallel_config"], "tensor_parallel_size": self.tensor_parallel_size,
                                         "pipeline_parallel_size": self.pipeline_parallel_size}
            config["attention_config"] = {**live["attention_config"], "backend": self.attention_backend}
        if self.max_num_seqs is not None:  # vLLM's SchedulerConfig, as its pydantic dump nests it
            config = {**config, "scheduler_config": {"max_num_seqs": self.max_num_seqs, "max_model_len": 4096}}
        return {"vllm_config": config if "config_format=json" in query else f"VllmConfig(model={str(TARGET)!r}, ...)",
                "vllm_env": {"VLLM_BATCH_INVARIANT": self.batch_invariant, "VLLM_SERVER_DEV_MODE": True,
                             "VLLM_LOGGING_LEVEL": "INFO"},
                "system_env": {"torch_version": "2.9.0", "is_cuda_available": False}}

    def prefix_lookup(self, prompt: Sequence[int]) -> tuple[int, bool]:
        """(cached tokens, whether the whole prompt was cached before) for a generation request; (0, False)
        without ``prefix_cache``. Whole blocks of :data:`PREFIX_BLOCK` tokens only, and never the prompt's
        last token (vLLM recomputes it to get the first logits)."""
        if not self.prefix_cache:
            return 0, False
        cached = self._prefix_cache.match(prompt, len(prompt) - 1)
        full = self._prefix_cache.full_hit(len(prompt), cached)
        if self.spec_method in HIDDEN_STATE_DRAFTS and self.speculative:
            cached = max(0, cached - PREFIX_BLOCK)
        return cached, full

    def completions(self, body: Any, fault: str | None = None) -> Reply:
        if not isinstance(body, dict):
            return self._error(400, "1 validation error:\n  {'type': 'model_attributes_type', 'loc': ('body',), "
                                    "'msg': 'Input should be a valid dictionary'}", "Bad Request")
        model = body.get("model")
        if model is not None and model != self.served:
            return self._error(404, f"The model `{model}` does not exist.", "NotFoundError", "model", model)
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
            return refuses("only a token-id prompt (a list of ints) is emulated")
        for key in VLLM_KNOBS:
            if body.get(key) is None:
                return refuses(f"{key} not sent: vLLM would take it from the model's generation_config.json "
                                         "(--generation-config auto)")
        top_k = body["top_k"]
        if not isinstance(top_k, int) or top_k < -1:
            return self._error(400, f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        if self.speculative and (float(body["min_p"]) > 1e-5 and not self.v026 or body.get("logit_bias")):
            return self._error(400, "The min_p and logit_bias sampling parameters are not yet supported with "
                                    "speculative decoding.")
        if float(body["temperature"]) >= 1e-5:
            return refuses("only greedy decoding (temperature < 1e-5) is emulated")
        for key, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if float(body[key]) != neutral:
                return refuses(f"{key}={body[key]} is not emulated")
        logprobs = body.get("logprobs")
        if logprobs is not None and logprobs > self.max_logprobs:
            return self._error(400, f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                                    f"{self.max_logprobs}", param="logprobs", value=logprobs)
        prompt_logprobs = body.get("prompt_logprobs")
        if prompt_logprobs is not None and prompt_logprobs > self.max_logprobs:
            return self._error(400, f"Requested prompt logprobs of {prompt_logprobs}, which is greater than max "
                                    f"allowed: {self.max_logprobs}", param="prompt_logprobs", value=prompt_logprobs)
        for key in ("echo", "stream", "ignore_eos", "stop", "min_tokens", "logit_bias", "bad_words"):
            if body.get(key):
                return refuses(f"{key}={body[key]!r} is not emulated")
        constraint = None
        structured = body.get("structured_outputs")
        if structured:
            given = {k: v for k, v in structured.items() if v is not None} if isinstance(structured, dict) else {}
            if set(given) == {"json"} and isinstance(given["json"], dict):
                constraint = Constraint("json_schema", json.dumps(given["json"], sort_keys=True))
            elif set(given) == {"grammar"} and isinstance(given["grammar"], str):
                constraint = Constraint("grammar", given["grammar"])
            else:
                return refuses(f"structured_outputs={structured!r} is not emulated (one of json, grammar)")
        if (body.get("n") or 1) != 1:
            return self._error(400, f"n must be 1 when using greedy sampling, got {body['n']}.")
        max_tokens = body.get("max_tokens")
        max_tokens = 16 if max_tokens is None else int(max_tokens)
        if max_tokens < 1:
            return self._error(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens",
                               value=max_tokens)
        stops = list(dict.fromkeys([*(body.get("stop_token_ids") or []), *self.backend.eos_ids]))
        use_spec = self.speculative and not (self.spec_disabled_for_logprobs and logprobs is not None)
        k = int(logprobs or 0)
        decoding = self.preempt_budget_tokens is not None and max_tokens >= 2 and prompt_logprobs is None
        token = self.join_batch(self.batch_window_s) if decoding else None
        with self.backend.lock:
            in_flight = self.leave_batch(token) if decoding else 1
            preempted = decoding and in_flight * (len(prompt) + max_tokens) > self.preempt_budget_tokens
            cached, full_hit = self.prefix_lookup(prompt) if prompt_logprobs is None else (0, False)
            if self.preempt_scoring and prompt_logprobs is not None:
                self.c_preemptions.labels(*self.labelvalues).inc()
            full_prompt = prompt
            if self.drop_leading is not None and len(prompt) > self.drop_leading:
                prompt = prompt[self.drop_leading:]
            if constraint is not None:
                self.constraints_seen.append((list(prompt), constraint.kind, constraint.text))
                try:
                    result = self.backend.constrained_generate(prompt, constraint, max_tokens, stops, k, use_spec,
                                                               self.grammar_rollback_bug)
                except ValueError as exc:
                    return refuses(str(exc))
            else:
                result = self.backend.generate(prompt, max_tokens, stops, k, use_spec)
            if self.near_tie_flips > 0:
                flipped = self.backend.flip_closest_call(prompt, result, max_tokens, stops, k)
                if flipped is not None:
                    result = flipped
                    self.near_tie_flips -= 1
                    self.flipped.append(",".join(map(str, prompt)))
            if preempted:
                self.c_preemptions.labels(*self.labelvalues).inc()
                self.preempted.append(",".join(map(str, prompt)))
            bug = ((preempted and self.preempt_bug) or (full_hit and self.prefix_hit_bug)
                   or (self.speculative and self.cold_prefill_bug and prompt_logprobs is None and cached == 0)
                   or (self.speculative and self.batch_invariant and self.deterministic_bug)
                   or (self.speculative and self.kv_cache_dtype.startswith("fp8") and self.fp8_bug)
                   or (self.speculative and self.long_bug_tokens is not None
                       and len(full_prompt) > self.long_bug_tokens))
            if bug and max_tokens >= 2:
                flipped = self.backend.flip_closest_call(prompt, result, max_tokens, stops, k)
                if flipped is not None:
                    result = flipped
                    self.arm_flipped.append(",".join(map(str, full_prompt)))
            rows = self.backend.prompt_rows(prompt, prompt_logprobs) if prompt_logprobs is not None else None
            if rows is not None and self.scoring_skew_nats:  # every margin against the top-1 grows, argmax kept
                x = self.scoring_skew_nats
                rows = [None if r is None else (r[0] - (x if r[1] > 1 else 0.0), r[1],
                                                [(tid, lp - (x if j else 0.0)) for j, (tid, lp) in enumerate(r[2])])
                        for r in rows]
            left_out, prompt = len(full_prompt) - len(prompt), full_prompt
            if fault == "short_limit":
                result = shortened(result)
            ids = list(result.output_ids)
            if self.prefix_cache:  # every request's computed tokens, scoring included
                self._prefix_cache.insert([*prompt, *ids[:-1]])
            stopped = bool(ids) and ids[-1] in stops
            finish = "stop" if stopped else "length"
            self.c_prompt.labels(*self.labelvalues).inc(len(prompt))
            self.c_generation.labels(*self.labelvalues).inc(len(ids))
            self.c_success.labels(self.labelvalues[0], finish, self.labelvalues[1]).inc()
            steps = list(result.spec.steps or []) if use_spec and result.spec.available else []
            for step in steps:
                if step.proposed <= 0:
                    continue
                self.c_drafts.labels(*self.labelvalues).inc()
                self.c_draft_tokens.labels(*self.labelvalues).inc(step.proposed)
                self.c_accepted.labels(*self.labelvalues).inc(step.accepted)
                for pos in range(min(step.accepted, self.num_spec_tokens)):
                    self.c_per_pos.labels(*self.labelvalues, str(pos)).inc()
            if fault == "accepted_gt_drafted" and steps:  # the counters move by more than was drafted
                self.c_accepted.labels(*self.labelvalues).inc(3 + sum(st.proposed - st.accepted for st in steps))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        with_ids = bool(body.get("return_token_ids"))
        stop_reason = None if not stopped or ids[-1] == self.backend.primary_eos else ids[-1]
        text = self.backend.decode(ids[:-1] if stopped else ids)

        def key(tid: int) -> str:
            return f"token_id:{int(tid)}" if as_ids else self.backend.token_text(tid)

        block = None
        if logprobs is not None:
            s = result.scores
            tokens = [key(t) for t in ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            tops = []
            for i in range(len(ids)):
                if not math.isfinite(s.logprobs[i]):  # a row left out
                    tops.append(None)
                    continue
                row = {key(ids[i]): max(float(s.logprobs[i]), -9999.0)}  # the sampled token first
                for c in range(k):
                    row[key(s.top_ids[i, c])] = max(float(s.top_logprobs[i, c]), -9999.0)
                tops.append(row)
            if fault == "bad_prob_ids" and tokens:
                tokens[-1] = key(next(t for t in range(3, self.backend.vocab_size) if t not in ids))
            block = {"text_offset": offsets, "token_logprobs": [max(float(x), -9999.0) if math.isfinite(x) else None
                                                                for x in s.logprobs[: len(ids)]],
                     "tokens": tokens, "top_logprobs": tops}
        prompt_lp = None
        if rows is not None:
            prompt_lp = [None] * (left_out + 1)
            for i, row in enumerate(rows[1:], start=left_out + 1):
                actual, rank, top = row
                entry = {str(prompt[i]): {"logprob": max(actual, -9999.0), "rank": rank,
                                          "decoded_token": self.backend.token_text(prompt[i])}}
                for r, (tid, lp) in enumerate(top, start=1):
                    entry[str(tid)] = {"logprob": max(lp, -9999.0), "rank": r,
                                       "decoded_token": self.backend.token_text(tid)}
                prompt_lp.append(entry)
        metrics = None
        if self.per_request_metrics and use_spec and steps and fault != "no_timings":
            acc = sum(st.accepted for st in steps)
            drafted = sum(st.proposed for st in steps)
            n_steps = sum(1 for st in steps if st.proposed > 0)
            hist = [0] * (self.num_spec_tokens + 1)
            for st in steps:
                if st.proposed > 0:
                    hist[min(st.accepted, self.num_spec_tokens)] += 1
            metrics = {"time_to_first_token_ms": None, "generation_time_ms": None, "queue_time_ms": None,
                       "mean_itl_ms": None, "tokens_per_second": None,
                       "speculative_decoding": {
                           "mean_acceptance_length": 1 + acc / n_steps if n_steps else 0.0,
                           "draft_acceptance_rate": acc / drafted if drafted else 0.0,
                           "acceptance_histogram": hist, "num_spec_steps": n_steps,
                           "num_accepted_draft_tokens": drafted + 3 if fault == "accepted_gt_drafted" else acc,
                           "num_draft_tokens": drafted,
                           "num_spec_tokens": self.num_spec_tokens, "per_step_accepted": None,
                           "per_step_drafted": None}}
        choice = {"index": 0, "text": text, "logprobs": block, "finish_reason": finish, "stop_reason": stop_reason,
                  "token_ids": ids if with_ids else None, "prompt_logprobs": prompt_lp,
                  "prompt_token_ids": list(prompt) if with_ids else None, "routed_experts": None,
                  "weight_versions": None}
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids),
                 "prompt_tokens_details": {"cached_tokens": cached} if self.prompt_tokens_details else None,
                 "completion_tokens_details": None}
        if self.v026:  # recorded: neither key exists in 0.26.0
            del choice["weight_versions"], usage["completion_tokens_details"]
        answer = {"id": "cmpl-" + uuid.uuid4().hex[:16], "object": "text_completion", "created": int(time.time()),
                  "model": self.served, "choices": [choice], "service_tier": None,
                  "system_fingerprint": self.fingerprint,
                  "usage": usage,
                  "kv_transfer_params": None, "ec_transfer_params": None, "metrics": metrics}
        return json_reply(200, answer)
