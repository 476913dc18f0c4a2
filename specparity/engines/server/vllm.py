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
import time
from typing import Any, Callable, Sequence


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
from specparity.model.constraints import CONSTRAINT_FIELDS
from specparity.model.traffic import Traffic
from specparity.model.types import ArtifactId, GenerationRequest, GenerationResult, SpecStats, TokenScores
from specparity.engines.server.vllm_wire import (SPEC_COUNTERS, TRAFFIC_COUNTERS, WIRE, answer_tokens,
                                                 parse_completion, parse_metrics, parse_prompt_logprobs,
                                                 reported_max_num_seqs, reported_numerics, request_spec_stats,
                                                 score_body, stable_spec_config, top_k_disabled, usage_facts)
from specparity.engines.server.vllm_launch import (ENTRYPOINTS, PER_REQUEST_METRICS, VLLMApi, VLLMLaunch,
                                                   drop_unsupported_per_request, installed_has_per_request_flag,
                                                   launch_configs)

#: ``--max-logprobs`` default (``vllm/config/model.py:286``).
DEFAULT_MAX_LOGPROBS = 20
#: Seconds between two /metrics reads while waiting for the counters to settle, and the most reads.
SETTLE_INTERVAL_S = 0.25
SETTLE_READS = 12


# ---------------------------------------------------------------------------------------------- launch


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


def check_options(options: EngineOptions) -> None:
    """Everything the vllm engine needs, checked before anything launches (ValueError, one line)."""
    check_server_flags(options, "vllm")
    resolve_tokenizer_dir(options, "vllm")
    if importlib.util.find_spec("prometheus_client") is None:
        raise ValueError("--engine vllm: reading vLLM's /metrics draft counters needs the prometheus_client package, "
                         "which is not installed (pip install prometheus_client)")
    if options.preset:
        launch_configs(options)


INFO = EngineInfo("vllm", options=OPTIONS, dtypes=(), local_models=False, check=check_options, server=True,
                  descriptor=DESCRIPTOR,
                  counters="aggregate", constraints=CONSTRAINT_FIELDS,
                  force_reject_note="newer vLLM's rejection_sample_method synthetic with synthetic_acceptance_length 1 "
                  "is not wired here yet (untested); see docs/FORCE_REJECT.md")


# ---------------------------------------------------------------------------------------------- wire format


# ---------------------------------------------------------------------------------------------- engine


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
