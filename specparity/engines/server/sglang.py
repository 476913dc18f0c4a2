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
import uuid
from typing import Any, Sequence


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
from specparity.model.types import ArtifactId, GenerationRequest, GenerationResult, SpecStats, TokenScores
from specparity.engines.server.sglang_wire import (CONSTRAINT_KEYS, SUMMARY_KEYS, UNKNOWN, UNSENT_HARMFUL_KEYS, WIRE,
                                                   answer_facts, declared_name, parse_generate, parse_score,
                                                   reported_numerics, score_body, spec_stats)
from specparity.engines.server.sglang_launch import SGLangLaunch, SPEC_KEYS, launch_configs


# ---------------------------------------------------------------------------------------------- launch


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


def check_options(options: EngineOptions) -> None:
    """Everything the sglang engine needs, checked before anything launches (ValueError, one line)."""
    check_server_flags(options, "sglang")
    resolve_tokenizer_dir(options, "sglang")
    if options.preset:
        launch_configs(options)


INFO = EngineInfo("sglang", options=OPTIONS, dtypes=(), local_models=False, check=check_options, server=True,
                  descriptor=DESCRIPTOR,
                  counters="request", constraints=tuple(CONSTRAINT_KEYS),
                  force_reject_note="SGLang's own knob, SGLANG_SIMULATE_ACC_LEN=1 with SGLANG_SIMULATE_ACC_TOKEN_MODE="
                  "real-draft-token, is not wired here yet (untested); see docs/FORCE_REJECT.md")


# ---------------------------------------------------------------------------------------------- wire format


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
