"""An SGLang-protocol fake: ``python -m sglang.launch_server`` as seen over HTTP, and its faults.

It speaks SGLang's wire format — field names, nesting, key order, ``null`` entries, error bodies
and status codes as read from the SGLang 0.5.23 / 0.5.19 source (``docs/ENGINE_APIS.md``) and as
recorded in ``tests/data/sglang/`` — and computes every token, logprob and speculation counter
(``meta_info.spec_*``) with the fixture models (:mod:`fakes.backend`). A request outside the
greedy, non-streaming subset gets HTTP 400 starting ``emulator:``.

Knobs besides the faults of :class:`~fakes.server.FakeServer`:

* ``declares_deterministic=True``: ``/server_info`` is the recorded ``server_info_deterministic.json``
  body (``enable_deterministic_inference: true``), with the ``speculative_*`` keys written over it on
  a speculative server.
* ``drop_spec_fields=True``: a speculative server whose answers carry no ``spec_*`` keys (every
  answer; the ``no_timings`` fault does it to the requests it hits).
* ``near_tie_flips=N`` (speculative): the first N answers of two or more tokens are flipped at their
  closest call (:meth:`~fakes.backend.FixtureBackend.flip_closest_call`); the gate calls it
  ``near_tie`` once its threshold covers that margin (the fixture target is confident: margins of
  5–18 nats, so a test widens ``--near-tie-nats``). The answer's ``spec_*`` counters stay those of
  the unflipped speculative decode.
* ``batch_flip_above=N`` (baseline or speculative): an answer of two or more tokens decoded while more
  than N decode requests (two or more tokens) are in flight at some moment between its arrival and its
  turn at the model (each decode is held ``batch_window_s`` first, as a scheduler collects a batch) is
  flipped at its closest call, as ``near_tie_flips`` does — a kernel whose result depends on the batch size. Given to both servers, every level's gate sees
  identical streams (both sides flip alike) and only a comparison across concurrency levels
  (``specparity sweep``) sees the flip. ``batch_flipped`` lists the request ids flipped.
* ``instance_noise_nats=x``: this instance's logits differ from another's by −x, 0 or +x per
  (prefix, token), the same in its decode rows and in its scoring rows — what two server instances
  of one model do (:func:`~fakes.backend.instance_noise`). The argmax never moves.
* ``scoring_skew_nats=x``: this instance's teacher-forced rows (``logprob_start_len`` scoring) have every
  alternative below the top-1 x nats lower (:func:`~fakes.backend.scoring_skew`), its decode rows are
  right: a scoring path that disagrees with another instance by x nats at every pair, argmax unmoved.
* ``sampling_params.json_schema`` (a JSON string) / ``ebnf``: honoured as a constrained decode
  (:meth:`~fakes.backend.FixtureBackend.constrained_generate`: the schema's smallest instance, a
  one-literal grammar), and recorded in ``constraints_seen`` as ``(rid, kind, text)``;
  ``grammar_rollback_bug=True`` (speculative): the grammar state is lost after the first verify
  step, the rest is decoded unconstrained — a loop that does not roll its grammar back.
* ``server_args={"kv_cache_dtype": "fp8_e4m3", …}``: ``/server_info`` fields written over the recorded
  body, as the launch flag of that name sets them (fields of the recorded body only); the fixture model
  computes the same either way (the gate must see the launch differ).
* ``version="0.5.19"``: unknown ``sampling_params`` keys give HTTP 500 ``text/plain`` instead of
  0.5.23's 400, the counters carry the 0.5.19 aliases, ``/server_info`` has no ``launch_command`` /
  ``frontend``.

* The radix cache (on by default, as SGLang's is; ``prefix_cache=False`` is ``--disable-radix-cache``),
  as 0.5.17 keeps it: every request is matched against it when scheduled — all but its last input token,
  and no further than its ``logprob_start_len`` when it asks for input logprobs
  (``Req._compute_max_prefix_len``, ``managers/schedule_batch.py``), in whole pages — and answered in
  ``meta_info.cached_tokens``; every finished request, scoring included, is inserted with the tokens whose KV
  it computed, its input and all but its last output token, in whole pages (``RadixCache.cache_finished_req``,
  ``mem_cache/radix_cache.py``). ``page_size=N`` (``--page-size``, reported in ``/server_info``) sets the
  page. ``/flush_cache`` empties it when no request is in flight (else HTTP 400) and zeroes the lifetime
  speculation counters behind ``avg_spec_accept_length`` (``Scheduler.flush_cache``).
* ``prefix_hit_bug=True`` (speculative): flips an answer that found its whole prompt cached (a bug that only
  ``specparity arms --arms prefix-warm`` sees); ``cold_prefill_bug=True``: flips an answer that found
  nothing cached (a bug on a cold prefill, which only a cold judged request shows).
* ``retract_budget_tokens=N``: a KV cache of N tokens (``--max-total-tokens``): a decode request (two or more
  tokens) whose length (prompt + ``max_new_tokens``) times the most requests in flight while it waited (as
  ``batch_flip_above`` counts them) exceeds N is retracted once, answered in ``meta_info.num_retractions``
  and listed in ``retracted``; ``retract_bug=True`` flips a retracted answer at its closest call.
* ``running_cap=N``: the server runs at most N requests at once (``max_running_requests``, capped by a small
  mamba state cache), reported in ``/server_info`` ``internal_states[0].effective_max_running_requests_per_dp``;
  a request arriving while N run waits for a slot (listed in ``waited``); ``slot_wait_bug=True`` flips an
  answer that waited, at its closest call (a bug only ``specparity arms --arms mamba-slots`` sees).
  ``server_args={"enable_metrics": True}`` answers ``meta_info.request_received_ts`` and
  ``request_finished_ts`` (seconds since the epoch), as ``--enable-metrics`` does.

The content faults, in SGLang's fields: ``no_timings`` drops ``meta_info.spec_*``;
``accepted_gt_drafted`` reports ``spec_num_correct_drafts`` above ``spec_num_proposed_drafts``;
``short_limit`` finishes ``length`` with half the tokens; ``bad_prob_ids`` names another token in
the last ``output_token_logprobs`` entry. ``http_500`` is uvicorn's ``Internal Server Error``.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import time
import uuid
from typing import Any, Sequence

from fakes.backend import (DATA, DRAFT, TARGET, FixtureBackend, instance_noise, recorded, scoring_skew, shared_backend,
                           shortened)
from fakes.prefix_cache import PrefixCache
from fakes.faults import Rule
from fakes.server import FakeServer, Reply, Request, json_reply, not_found, refuses
from specparity.model.constraints import Constraint

#: ``sampling_params`` allow-list of 0.5.23, in the order the contract's message lists it
#: (``sglang/api/v1/api_types.py:1256``, message format ``:97``).
SGLANG_SAMPLING_0_5_23 = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
#: ``SamplingParams`` keyword fields of 0.5.19 (``sglang/srt/sampling/sampling_params.py:57-95``).
SGLANG_SAMPLING_0_5_19 = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized",
)
_SGLANG_INT_KEYS = ("max_new_tokens", "top_k", "min_new_tokens", "n")
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


class SGLangServer(FakeServer):
    """``python -m sglang.launch_server`` as seen over HTTP: ``/generate``, ``/server_info`` (and the
    deprecated ``/get_server_info``), ``/health``, ``/health_generate``, ``/model_info``."""

    server_version = "uvicorn"
    generation_paths = ("/generate",)

    def __init__(self, *, speculative: bool = False, version: str = "0.5.23", declares_deterministic: bool = False,
                 drop_spec_fields: bool = False, near_tie_flips: int = 0, backend: FixtureBackend | None = None,
                 grammar_rollback_bug: bool = False,
                 instance_noise_nats: float = 0.0, batch_flip_above: int | None = None, batch_window_s: float = 0.3,
                 rules: Sequence[Rule] = (), die_after: int | None = None,
                 refuse: bool = False, hang_s: float = 30.0, trickle_s: float = 0.1, prefix_cache: bool = True,
                 prefix_hit_bug: bool = False, server_args: dict[str, Any] | None = None,
                 scoring_skew_nats: float = 0.0, page_size: int = 1, cold_prefill_bug: bool = False,
                 retract_budget_tokens: int | None = None, retract_bug: bool = False,
                 running_cap: int | None = None, slot_wait_bug: bool = False, slot_hold_s: float = 0.05):
        super().__init__(rules=rules, die_after=die_after, refuse=refuse, hang_s=hang_s, trickle_s=trickle_s)
        self.server_args = dict(server_args or {})
        self.backend = backend or shared_backend()
        self.prefix_cache = prefix_cache
        self.prefix_hit_bug = prefix_hit_bug
        self.cold_prefill_bug = cold_prefill_bug
        self.page_size = page_size
        #: The radix cache, and the request ids of the answers an arm's bug flipped.
        self._prefix_cache = PrefixCache(page_size)
        self.arm_flipped: list[str] = []
        self.retract_budget_tokens = retract_budget_tokens
        self.retract_bug = retract_bug
        #: Request ids of the retracted answers.
        self.retracted: list[str] = []
        self.running_cap = running_cap
        self.slot_wait_bug = slot_wait_bug
        #: How long a request holds its slot at least (so that requests sent together overlap).
        self.slot_hold_s = slot_hold_s
        self._slots = threading.BoundedSemaphore(running_cap) if running_cap else None
        #: Request ids of the answers that waited for a slot.
        self.waited: list[str] = []
        self.instance_noise_nats = instance_noise_nats
        self.scoring_skew_nats = scoring_skew_nats
        if version not in ("0.5.23", "0.5.19"):
            raise ValueError("version: 0.5.23 or 0.5.19")
        if near_tie_flips and not speculative:
            raise ValueError("near_tie_flips: only a speculative emulator flips its answers")
        self.speculative = speculative
        self.version = version
        self.declares_deterministic = declares_deterministic
        self.drop_spec_fields = drop_spec_fields
        #: Answers still to flip at their closest call (the ``near_tie_flips`` hook).
        self.near_tie_flips = near_tie_flips
        #: Answers flipped so far (their request ids), for the test to check.
        self.flipped: list[str] = []
        #: The ``batch_flip_above`` hook: flip answers decoded with more than this many requests in flight.
        self.batch_flip_above = batch_flip_above
        self.batch_window_s = batch_window_s
        #: Answers flipped because they were batched (their request ids).
        self.batch_flipped: list[str] = []
        #: STANDALONE draft of width w: speculative_num_draft_tokens = w + 1 (anchor + drafts).
        self.num_draft_tokens = self.backend.draft_width + 1
        self.lifetime_verify = 0
        self.lifetime_accepted = 0
        self.grammar_rollback_bug = grammar_rollback_bug
        #: (rid, kind, text) of every constrained request, for the test to check.
        self.constraints_seen: list[tuple[str, str, str]] = []
        self._server_info = self._build_server_info()

    def radix_match(self, prompt: Sequence[int], logprob_start: int) -> int:
        """The tokens a request finds cached when scheduled: all but its last input token, no further than
        ``logprob_start`` (>= 0: it asks for input logprobs from there), in whole pages; 0 without the cache."""
        if not self.prefix_cache:
            return 0
        limit = len(prompt) - 1 if logprob_start < 0 else min(len(prompt) - 1, logprob_start)
        return self._prefix_cache.match(prompt, limit)

    def radix_insert(self, prompt: Sequence[int], output_ids: Sequence[int]) -> None:
        """A finished request's computed tokens (its input, all but its last output token) into the cache."""
        if self.prefix_cache:
            self._prefix_cache.insert([*prompt, *output_ids[:-1]])

    def flush_cache(self) -> Reply:
        """``/flush_cache``: the radix cache and the lifetime speculation counters emptied, only when idle."""
        with self._lock:
            idle = self.in_flight == 0
        if not idle:
            return Reply(400, "text/plain; charset=utf-8", b"Flush cache failed.\n")
        self._prefix_cache.clear()
        self.lifetime_verify = self.lifetime_accepted = 0
        return Reply(200, "text/plain; charset=utf-8", (
            b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            b"requests, the operation will not be performed.)\n"))

    def _build_server_info(self) -> dict[str, Any]:
        # the deterministic body differs from the plain one only in the flag (and launch_command); on
        # a speculative server the speculative_* keys are written over it below
        name = "server_info_deterministic.json" if self.declares_deterministic else (
            "server_info_dflash.json" if self.speculative else "server_info_plain.json")
        info = recorded(DATA / "sglang" / name)
        over: dict[str, Any] = {
            "model_path": str(TARGET), "tokenizer_path": str(TARGET), "served_model_name": str(TARGET),
            "enable_deterministic_inference": self.declares_deterministic,
            "context_length": 4096, "page_size": self.page_size, "disable_radix_cache": not self.prefix_cache,
        }
        unknown = sorted(set(self.server_args) - set(info))
        if unknown:
            raise ValueError(f"server_args: not /server_info fields of the recorded body: {', '.join(unknown)}")
        over.update(self.server_args)
        if self.speculative:
            over.update({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(DRAFT),
                         "speculative_num_draft_tokens": self.num_draft_tokens,
                         "speculative_num_steps": self.backend.draft_width, "speculative_eagle_topk": 1})
        for key, value in over.items():
            if key in info:
                info[key] = value
            if key in info["internal_states"][0]:
                info["internal_states"][0][key] = value
        info["internal_states"][0].pop("avg_spec_accept_length", None)
        if self.running_cap:
            info["internal_states"][0]["effective_max_running_requests_per_dp"] = self.running_cap
        flags = f"--model-path {TARGET} --port {{port}}"
        if self.speculative:
            flags += (f" --speculative-algorithm STANDALONE --speculative-draft-model-path {DRAFT} "
                      f"--speculative-num-draft-tokens {self.num_draft_tokens}")
        if self.declares_deterministic:
            flags += " --enable-deterministic-inference"
        info["launch_command"] = flags
        info["version"] = self.version
        if self.version == "0.5.19":  # 0.5.19 http_server.py:811-840: no launch_command, no frontend
            info.pop("launch_command", None)
            info.pop("frontend", None)
        return info

    def server_info(self) -> dict[str, Any]:
        info = copy.deepcopy(self._server_info)
        if "launch_command" in info:
            info["launch_command"] = info["launch_command"].replace("{port}", str(self.port))
        # avg_spec_accept_length: lifetime (accepted + bonus) / verifies, absent until the first
        # decode-stats flush (every decode_log_interval = 40 decode iterations)
        if self.speculative and self.lifetime_verify >= 40:
            info["internal_states"][0]["avg_spec_accept_length"] = (
                (self.lifetime_accepted + self.lifetime_verify) / self.lifetime_verify)
        return info

    # ------------------------------------------------------------------ routing
    def bad_json(self, raw: bytes) -> Reply:
        return json_reply(400, {"object": "error", "message": "JSON decode error", "type": "Bad Request",
                               "param": None, "code": 400})

    def error_500(self) -> Reply:
        return Reply(500, "text/plain; charset=utf-8", b"Internal Server Error")

    def error_400(self) -> Reply:
        return json_reply(400, {"error": {"message": "The input (4097 tokens) is longer than the model's context "
                                                     "length (4096 tokens)."}})

    def prompt_of(self, body: Any) -> list[int]:
        ids = body["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def limit_of(self, body: Any) -> int:
        return int((body.get("sampling_params") or {}).get("max_new_tokens", 128))

    def route(self, req: Request) -> Reply:
        method, path, body = req.method, req.path, req.body
        if method == "GET" and path in ("/health", "/health_generate"):
            return Reply(200, None, b"")
        if method == "GET" and path in ("/server_info", "/get_server_info"):
            return json_reply(200, self.server_info())
        if method == "GET" and path in ("/model_info", "/get_model_info"):
            info = recorded(DATA / "sglang" / "model_info.json")
            info.update({"model_path": str(TARGET), "served_model_name": str(TARGET), "tokenizer_path": str(TARGET),
                         "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
            return json_reply(200, info)
        if path == "/flush_cache" and method in ("GET", "POST"):
            return self.flush_cache()
        if path == "/generate" and method in ("POST", "PUT"):
            return self.generate(body, req.fault)
        return not_found()

    def _validation_error(self, loc: str, msg: str, value: Any) -> Reply:
        errors = [{"type": "value_error", "loc": ("body", loc), "msg": msg, "input": value}]
        return json_reply(400, {"object": "error", "message": f"1 validation error: {errors}", "type": "Bad Request",
                               "param": None, "code": 400})

    def _contract_error(self, sampling: dict[str, Any]) -> Reply | None:
        """0.5.23's JSON contract (400 ``{"error": "<string>"}``) or 0.5.19's uncaught TypeError (500)."""
        allowed = SGLANG_SAMPLING_0_5_23 if self.version == "0.5.23" else SGLANG_SAMPLING_0_5_19
        for key, value in sampling.items():
            if key not in allowed:
                if self.version == "0.5.19":
                    return self.error_500()  # uvicorn: an uncaught TypeError
                expected = ", ".join(f"`{k}`" for k in allowed)
                return json_reply(400, {"error": f"unknown field `{key}`, expected one of {expected}"})
            if (self.version == "0.5.23" and key in _SGLANG_INT_KEYS and value is not None
                    and (isinstance(value, bool) or not isinstance(value, int))):
                kind = "floating point" if isinstance(value, float) else type(value).__name__
                return json_reply(400, {"error": f"invalid type: {kind} `{value}`, expected i64"})
        return None

    def generate(self, body: Any, fault: str | None = None) -> Reply:
        if not isinstance(body, dict):
            return self._validation_error("body", "Input should be an object", body)
        for key in ("return_logprob", "stream", "return_text_in_logprobs"):
            if key in body and not isinstance(body[key], bool):
                return self._validation_error(key, "Input should be a valid boolean", body[key])
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            return refuses("a list of sampling_params is not emulated")
        problem = self._contract_error(sampling)
        if problem:
            return problem
        temperature = float(sampling.get("temperature", 1.0))
        if not (temperature >= 0 and math.isfinite(temperature)):
            return json_reply(400, {"error": {"message": f"temperature must be a non-negative finite number, got "
                                                        f"{temperature}."}})
        if not (temperature < 1e-6 or sampling.get("top_k") == 1):
            return refuses("only greedy decoding is emulated (temperature 0 or top_k 1)")
        for key, neutral in _NEUTRAL.items():
            if float(sampling.get(key, neutral)) != neutral:
                return refuses(f"{key}={sampling[key]} is not emulated")
        for key in ("stop", "stop_regex", "regex", "structural_tag", "logit_bias"):
            if sampling.get(key):
                return refuses(f"sampling_params.{key} is not emulated")
        if sampling.get("json_schema") and sampling.get("ebnf"):
            return refuses("json_schema and ebnf together are not emulated")
        constraint = None
        if sampling.get("json_schema"):
            try:
                constraint = Constraint("json_schema", json.dumps(json.loads(sampling["json_schema"]), sort_keys=True))
            except (TypeError, ValueError):
                return json_reply(400, {"error": {"message": "json_schema: not a JSON string"}})
        elif sampling.get("ebnf"):
            constraint = Constraint("grammar", str(sampling["ebnf"]))
        if sampling.get("ignore_eos"):
            return refuses("ignore_eos=true is not emulated")
        if body.get("stream"):
            return refuses("stream=true is not emulated")
        if int(sampling.get("n", 1)) != 1 or int(sampling.get("min_new_tokens", 0)) != 0:
            return refuses("n != 1 or min_new_tokens != 0 is not emulated")
        ids = body.get("input_ids")
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
            return refuses("only input_ids (a list of token ids, or a list of such lists) is emulated")
        rid = body.get("rid")
        out = []
        for i, prompt in enumerate(prompts):
            item_rid = (f"{rid}_{i}" if batch else rid) if isinstance(rid, str) else uuid.uuid4().hex
            answer = self._one(prompt, sampling, body, item_rid, fault, constraint)
            if isinstance(answer, Reply):
                return answer
            out.append(answer)
        return json_reply(200, out if batch else out[0])

    def _one(self, prompt: list[int], sampling: dict[str, Any], body: dict[str, Any], rid: str,
             fault: str | None, constraint: Constraint | None = None) -> Any:
        """One request, in a running slot when the server has a cap (waiting for one while the cap is reached),
        with the times ``--enable-metrics`` answers."""
        received = time.time()
        waited = False
        if self._slots is not None:
            waited = not self._slots.acquire(blocking=False)
            if waited:
                self._slots.acquire()
                self.waited.append(rid)
        try:
            answer = self._decode_one(prompt, sampling, body, rid, fault, constraint, waited)
            if self._slots is not None:
                time.sleep(self.slot_hold_s)
        finally:
            if self._slots is not None:
                self._slots.release()
        if isinstance(answer, dict) and self.server_args.get("enable_metrics"):
            answer["meta_info"].update({"request_received_ts": received, "request_finished_ts": time.time()})
        return answer

    def _decode_one(self, prompt: list[int], sampling: dict[str, Any], body: dict[str, Any], rid: str,
                    fault: str | None, constraint: Constraint | None, waited: bool) -> Any:
        max_new = sampling.get("max_new_tokens", 128)
        if max_new is None or max_new < 1:
            return refuses("max_new_tokens < 1 (prefill-only requests) is not emulated")
        return_logprob = bool(body.get("return_logprob", False))
        start = int(body.get("logprob_start_len", -1)) if return_logprob else -1
        cached = self.radix_match(prompt, start)
        top_n = int(body.get("top_logprobs_num", 0) or 0)
        with_text = bool(body.get("return_text_in_logprobs", False))
        if start == -1:
            start = len(prompt)
        if start > len(prompt):
            return json_reply(400, {"error": {"message": f"req.logprob_start_len={start} is higher than the number of "
                                                        f"input tokens len(req.origin_input_ids)={len(prompt)}. Please "
                                                        "use a smaller logprob_start_len."}})
        stops = list(dict.fromkeys([*(sampling.get("stop_token_ids") or []), *self.backend.eos_ids]))
        t0 = time.perf_counter()
        full_hit = self._prefix_cache.full_hit(len(prompt), cached)
        # only decodes (two or more tokens) form the batch: one-token scoring requests never count
        decoding = (self.batch_flip_above is not None or self.retract_budget_tokens is not None) and max_new >= 2
        token = self.join_batch(self.batch_window_s) if decoding else None
        with self.backend.lock:
            in_flight = self.leave_batch(token) if decoding else 1
            batched = decoding and self.batch_flip_above is not None and in_flight > self.batch_flip_above
            retracted = (decoding and self.retract_budget_tokens is not None
                         and in_flight * (len(prompt) + max_new) > self.retract_budget_tokens)
            if retracted:
                self.retracted.append(rid)
            if constraint is not None:
                self.constraints_seen.append((rid, constraint.kind, constraint.text))
                try:
                    result = self.backend.constrained_generate(prompt, constraint, max_new, stops, top_n,
                                                               self.speculative, self.grammar_rollback_bug)
                except ValueError as exc:
                    return refuses(str(exc))
            else:
                result = self.backend.generate(prompt, max_new, stops, top_n, self.speculative)
            if batched:
                flipped = self.backend.flip_closest_call(prompt, result, max_new, stops, top_n)
                if flipped is not None:
                    result = flipped
                    self.batch_flipped.append(rid)
            arm_bug = ((full_hit and self.prefix_hit_bug) or (cached == 0 and self.cold_prefill_bug)
                       or (retracted and self.retract_bug) or (waited and self.slot_wait_bug))
            if arm_bug and self.speculative and max_new >= 2:
                flipped = self.backend.flip_closest_call(prompt, result, max_new, stops, top_n)
                if flipped is not None:
                    result = flipped
                    self.arm_flipped.append(rid)
            if self.near_tie_flips > 0:
                flipped = self.backend.flip_closest_call(prompt, result, max_new, stops, top_n)
                if flipped is not None:
                    result = flipped
                    self.near_tie_flips -= 1
                    self.flipped.append(rid)
            in_scores = (self.backend.score(prompt[: start + 1], prompt[start + 1:], top_n)
                         if return_logprob and start < len(prompt) - 1 else None)
        if self.instance_noise_nats:
            result = copy.copy(result)
            result.scores = instance_noise(result.scores, prompt, self.instance_noise_nats)
            if in_scores is not None:
                in_scores = instance_noise(in_scores, prompt[: start + 1], self.instance_noise_nats)
        if self.scoring_skew_nats and in_scores is not None:
            in_scores = scoring_skew(in_scores, self.scoring_skew_nats)
        if fault == "short_limit":
            result = shortened(result)
        ids = list(result.output_ids)
        stopped = bool(ids) and ids[-1] in stops
        finish = {"type": "stop", "matched": ids[-1]} if stopped else {"type": "length", "length": max_new}
        text_ids = ids[:-1] if stopped else ids
        tt = self.backend.token_text

        def entry(lp: Any, tid: int) -> list[Any]:
            return [None if lp is None or not math.isfinite(lp) else float(lp), int(tid), tt(tid) if with_text else None]

        self.radix_insert(prompt, ids)
        meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                                "weight_version": "default", "num_retractions": int(retracted)}
        if return_logprob:
            in_rows: list[Any] = []
            in_tops: list[Any] = []
            if start < len(prompt):
                in_rows.append(entry(None, prompt[start]))
                in_tops.append(None)
                if in_scores is not None:
                    for j, tid in enumerate(prompt[start + 1:]):
                        in_rows.append(entry(in_scores.logprobs[j], tid))
                        in_tops.append([entry(in_scores.top_logprobs[j, c], in_scores.top_ids[j, c])
                                        for c in range(top_n)])
            s = result.scores
            meta["input_token_logprobs"] = in_rows
            meta["output_token_logprobs"] = [entry(s.logprobs[i], ids[i]) for i in range(len(ids))]
            if fault == "bad_prob_ids" and ids:
                stray = next(t for t in range(3, self.backend.vocab_size) if t not in ids)
                meta["output_token_logprobs"][-1][1] = stray
            meta["output_token_logprobs_length"] = len(ids)
            if top_n > 0:
                meta["input_top_logprobs"] = in_tops
                meta["output_top_logprobs"] = [[entry(s.top_logprobs[i, c], s.top_ids[i, c]) for c in range(top_n)]
                                               if math.isfinite(s.logprobs[i]) else None for i in range(len(ids))]
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": cached,
                     "weight_versions": [{"version": "default", "start": 0, "end": len(ids)}],
                     "cached_tokens_details": None, "dp_rank": None, "e2e_latency": time.perf_counter() - t0})
        if self.speculative and not self.drop_spec_fields and fault != "no_timings":
            spec = self._spec_fields(result.spec, len(ids))
            if fault == "accepted_gt_drafted" and "spec_num_proposed_drafts" in spec:
                spec["spec_num_correct_drafts"] = spec["spec_num_proposed_drafts"] + 3
                if "spec_accepted_drafts" in spec:
                    spec["spec_accepted_drafts"] = spec["spec_num_correct_drafts"]
            meta.update(spec)
        return {"text": self.backend.decode(text_ids), "output_ids": ids, "meta_info": meta}

    def _spec_fields(self, spec: Any, completion_tokens: int) -> dict[str, Any]:
        """``_calculate_spec_decoding_metrics`` (tokenizer_manager.py:3138-3209) from the real counters."""
        verify = int(spec.verify_steps) if spec.available else 0
        if verify <= 0:
            return {}
        correct = int(spec.accepted)
        self.lifetime_verify += verify
        self.lifetime_accepted += correct
        hist = [0] * self.num_draft_tokens
        for step in spec.steps or []:
            hist[min(step.accepted, len(hist) - 1)] += 1
        while hist and hist[-1] == 0:
            hist.pop()
        proposed = verify * (self.num_draft_tokens - 1)
        out: dict[str, Any] = {}
        if proposed > 0:
            out.update({"spec_accept_rate": correct / proposed, "spec_accept_length": completion_tokens / verify,
                        "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                        "spec_verify_ct": verify})
        out["spec_correct_drafts_histogram"] = hist
        if self.version == "0.5.19":  # backward-compat aliases (0.5.19 tokenizer_manager.py:2840-2856)
            out.update({"spec_accepted_drafts": correct, "spec_proposed_drafts": proposed,
                        "spec_accept_histogram": hist})
        return out
