"""Protocol emulators of SGLang and vLLM servers, backed by a real model, for tests on a CPU.

Neither SGLang nor vLLM runs here (no GPU), so the adapters in ``specparity/engines/sglang.py``
and ``specparity/engines/vllm.py`` are exercised end to end against these: small
``http.server.ThreadingHTTPServer``\\ s bound to ``127.0.0.1`` on a free port, served from a
thread, stopped cleanly by :meth:`Emulator.stop`. Each speaks one server's wire format — field
names, nesting, key order, ``null`` entries, error bodies and status codes as read from the
SGLang 0.5.23 / 0.5.19 and vLLM 0.33.0 source (``docs/ENGINE_APIS.md``) and as recorded in
``tests/data/{sglang,vllm}/`` — and computes every token and logprob with the committed fixture
models through specparity's own in-process engine (:class:`specparity.engines.hf.HFEngine`,
target ``fixtures/models/target``, standalone draft ``fixtures/models/draft``).

An emulator launched with speculation (``speculative=True``) decodes with the draft (transformers'
assisted generation) and reports the *real* counters of that loop in the server's own format
(SGLang ``meta_info.spec_*``; vLLM ``/metrics`` counters and, with ``per_request_metrics``,
``metrics.speculative_decoding``); a baseline emulator decodes greedily without a draft.

What an emulator does **not** do is marked: a request outside the greedy, non-streaming subset
(sampling, penalties, ``stream``, ``echo``, ``ignore_eos``, a knob vLLM would fill from
``generation_config.json``) gets HTTP 400 with a message starting ``emulator:``, never a silently
different answer.

Misbehaviour switches:

* ``die_after=N`` (both): after answering N generation requests the server stops — the listening
  socket is closed and every later request, also on a kept-alive connection, is dropped without
  an answer (a crashed server, as the client sees it).
* ``spec_disabled_for_logprobs=True`` (vLLM): what vLLM 0.11–0.13 did under the ngram/suffix
  proposers: a request with ``logprobs`` is decoded without drafting, and the ``/metrics`` spec
  counters never move.
* ``declares_deterministic=True`` (SGLang): ``/server_info`` is the recorded
  ``server_info_deterministic.json`` body (``enable_deterministic_inference: true``), with the
  ``speculative_*`` keys written over it on a speculative server.
* ``drop_spec_fields=True`` (SGLang): a speculative server whose answers carry no ``spec_*`` keys.
* ``dev_mode=True`` (vLLM): a ``VLLM_SERVER_DEV_MODE=1`` server, which answers ``GET /server_info``
  (``vllm_config``, ``vllm_env``, ``system_env``); ``batch_invariant=True`` puts
  ``VLLM_BATCH_INVARIANT: true`` in its ``vllm_env``.
* ``near_tie_flips=N`` (SGLang and vLLM, speculative): the first N answers of two or more tokens are
  flipped at their closest call (:meth:`FixtureBackend.flip_closest_call`): the runner-up token
  where the target's top-1/top-2 margin is smallest, then a greedy continuation of that prefix. Every
  later token is the target's argmax, so the gate calls it ``near_tie`` once its threshold covers
  that margin (the fixture target is confident: margins of 5–18 nats, so a test widens
  ``--near-tie-nats``). A test fiction: the answer's ``spec_*`` counters stay those of the
  unflipped speculative decode.
* ``version="0.26.0"`` (vLLM): answers the way a live vLLM 0.26.0 did (``tests/data/vllm-0.26.0/``):
  ``system_fingerprint`` ``vllm-0.26.0-nohash``, no ``weight_versions`` in a choice, no
  ``usage.completion_tokens_details``, ``metrics`` always null (0.26 has no
  ``--per-request-spec-decode-metrics``: ``per_request_metrics=True`` is refused), ``min_p`` accepted on a
  greedy speculative request, and a dev-mode ``/server_info`` shaped like the recorded one (the whole
  ``SpeculativeConfig`` with its nested model/parallel configs and ports, dtype ``torch.bfloat16``).
* ``instance_noise_nats=x`` (SGLang): this instance's logits differ from another's by −x, 0 or +x per
  (prefix, token), the same in its decode rows and in its scoring rows — what two server instances
  of one model do (graph capture, batch shapes), as measured between two live vLLM servers. Rows
  whose top-1/top-2 margin is under 3x are left alone, so the argmax never moves.
* ``version="0.5.19"`` (SGLang): unknown ``sampling_params`` keys give HTTP 500 ``text/plain``
  instead of 0.5.23's 400, the counters carry the 0.5.19 aliases, ``/server_info`` has no
  ``launch_command`` / ``frontend``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
TARGET = REPO / "fixtures" / "models" / "target"
DRAFT = REPO / "fixtures" / "models" / "draft"

#: ``route`` returns this to drop the connection without an answer (a dead server).
DROP = object()


def _recorded(path: Path) -> Any:
    """A recorded body without its ``_source`` / ``_request`` / ``_http_status`` notes."""
    body = json.loads(path.read_text())
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if not k.startswith("_")}
    return body


# ---------------------------------------------------------------------------------------------- backend


class FixtureBackend:
    """The fixture target (+ standalone draft) through :class:`HFEngine`; one request at a time."""

    def __init__(self) -> None:
        from specparity.engines.base import EngineOptions
        from specparity.engines.hf import DEFAULT_DRAFT_TOKENS, HFEngine

        self.engine = HFEngine(EngineOptions(target=str(TARGET), draft=str(DRAFT), spec_mode="draft"))
        self.tokenizer = self.engine.target.tokenizer
        self.lock = threading.Lock()
        #: The model's EOS ids (generation_config.json + tokenizer), which every server stops on.
        self.eos_ids = tuple(self.engine.stop_token_ids())
        self.primary_eos = self.tokenizer.eos_token_id
        self.draft_width = DEFAULT_DRAFT_TOKENS
        self.vocab_size = int(self.engine.target.model.config.vocab_size)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int], k: int,
                 speculative: bool):
        from specparity.types import GenerationRequest

        req = GenerationRequest("emulator", [int(t) for t in prompt_ids], int(max_new_tokens),
                                tuple(int(t) for t in stop_ids), max(1, int(k)))
        result = self.engine.generate([req], speculative=speculative)[0]
        if result.error:
            raise RuntimeError(result.error)
        return result

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], k: int):
        return self.engine.score(list(prompt_ids), list(continuation_ids), max(1, int(k)))

    def flip_closest_call(self, prompt_ids: Sequence[int], result: Any, max_new_tokens: int,
                          stop_ids: Sequence[int], k: int):
        """``result`` with one near-tie flip (the ``near_tie_flips`` hook): at the position of its
        smallest top-1/top-2 margin whose runner-up is not a stop token, that runner-up is emitted, and
        the rest is the target's greedy continuation of the new prefix. None when no position qualifies.

        The flipped position's row is *not reported* (a server may leave rows out): with margins this
        confident no row is honest there — one that still prefers the target's token says the server
        emitted a token its own verify pass rejected (``diverged``), one that prefers the flip is a
        computation far outside the noise (``drifted``)."""
        import dataclasses

        import numpy as np

        from specparity.types import TokenScores

        s, ids = result.scores, list(result.output_ids)
        n = min(len(ids), len(s))
        if s.k < 2 or n < 2:
            return None
        stops = {int(t) for t in stop_ids}
        margins = s.top_logprobs[:n, 0] - s.top_logprobs[:n, 1]
        candidates = [i for i in range(n) if int(s.top_ids[i, 1]) not in stops and np.isfinite(margins[i])]
        if not candidates:
            return None
        i = min(candidates, key=lambda j: float(margins[j]))
        runner_up = int(s.top_ids[i, 1])
        head = ids[:i] + [runner_up]
        chosen, top_ids, top_lp = s.logprobs[: i + 1].copy(), s.top_ids[: i + 1].copy(), s.top_logprobs[: i + 1].copy()
        chosen[i], top_ids[i], top_lp[i] = np.nan, -1, np.nan
        parts = [TokenScores(np.asarray(head, np.int64), chosen, top_ids, top_lp)]
        if max_new_tokens > len(head):
            tail = self.generate(list(prompt_ids) + head, max_new_tokens - len(head), stop_ids, k, False)
            head += list(tail.output_ids)
            parts.append(tail.scores)
        scores = TokenScores(*(np.concatenate([getattr(p, f) for p in parts])
                               for f in ("token_ids", "logprobs", "top_ids", "top_logprobs")))
        return dataclasses.replace(result, output_ids=head, scores=scores)

    def prompt_rows(self, ids: Sequence[int], k: int) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
        """Per prompt position: None for position 0, else (logprob of the actual token, its 1-based
        rank in the vocabulary, the top-k (id, logprob)) — what vLLM's prompt logprobs carry."""
        import torch

        model = self.engine.target.model
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([list(ids)], dtype=torch.long)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        rows: list[Any] = [None]
        kk = min(max(1, k), lp.shape[-1])
        for i in range(1, len(ids)):
            row = lp[i - 1]
            actual = float(row[int(ids[i])])
            rank = 1 + int((row > row[int(ids[i])]).sum())
            vals, idx = torch.topk(row, kk)
            rows.append((actual, rank, list(zip(idx.tolist(), vals.tolist()))))
        return rows

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)


def instance_noise(scores: Any, prefix: Sequence[int], nats: float) -> Any:
    """``scores`` (rows of the tokens after ``prefix``) as another server instance computes them: every
    logprob moved by −``nats``, 0 or +``nats``, chosen by a hash of the row's prefix and the token (so
    decode and scoring rows of one instance agree), rows re-sorted; rows whose top-1/top-2 margin is
    under 3 × ``nats`` are kept, so no argmax moves (the ``instance_noise_nats`` knob)."""
    import numpy as np

    from specparity.types import TokenScores

    ids = [int(t) for t in prefix]
    logprobs, top_ids, top_lp = scores.logprobs.copy(), scores.top_ids.copy(), scores.top_logprobs.copy()
    for i, tid in enumerate(scores.token_ids.tolist()):
        context = hash(tuple(ids))
        ids.append(int(tid))
        if scores.k < 2 or not top_lp[i, 0] - top_lp[i, 1] >= 3 * nats:
            continue
        step = [nats * ((hash((context, int(t))) % 3) - 1) for t in top_ids[i]]
        top_lp[i] += np.asarray(step, np.float32)
        logprobs[i] += nats * ((hash((context, int(tid))) % 3) - 1)
        order = np.argsort(-top_lp[i], kind="stable")
        top_ids[i], top_lp[i] = top_ids[i][order], top_lp[i][order]
    return TokenScores(scores.token_ids, logprobs, top_ids, top_lp)


@functools.lru_cache(maxsize=1)
def shared_backend() -> FixtureBackend:
    """One backend per process: every emulator shares the loaded models (and their lock)."""
    return FixtureBackend()


# ---------------------------------------------------------------------------------------------- http


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn
    server_version = "uvicorn"
    sys_version = ""
    emulator: "Emulator"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.emulator.handle(self, "GET")

    def do_POST(self) -> None:  # noqa: N802
        self.emulator.handle(self, "POST")

    def do_PUT(self) -> None:  # noqa: N802
        self.emulator.handle(self, "PUT")


class Emulator:
    """One emulated server. Use as a context manager or call :meth:`start` / :meth:`stop`."""

    kind = "server"
    #: Paths whose answers count for ``die_after``.
    generation_paths: tuple[str, ...] = ()

    def __init__(self, *, die_after: int | None = None, backend: FixtureBackend | None = None):
        self.backend = backend or shared_backend()
        self.die_after = die_after
        self.generations = 0  # generation requests answered
        self.dead = False
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body) as received
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Emulator":
        handler = type(f"{type(self).__name__}Handler", (_Handler,), {"emulator": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"{self.kind}-emulator", daemon=True)
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop serving: the listening socket closes, later requests on open connections are dropped."""
        self.dead = True
        with self._stop_lock:
            if self._server is None or self._stopped.is_set():
                return
            self._stopped.set()
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=5)

    def __enter__(self) -> "Emulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ dispatch
    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        if self.dead:
            h.close_connection = True  # no answer: the client sees the connection closed
            return
        path, _, query = h.path.partition("?")
        body: Any = None
        raw = b""
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            raw = h.rfile.read(length)
        if method in ("POST", "PUT") and raw:
            try:
                body = json.loads(raw)
            except ValueError:
                self._send(h, *self.bad_json(raw))
                return
        self.requests.append((method, path, body))
        try:
            out = self.route(method, path, query, body)
        except Exception as exc:  # noqa: BLE001 - an emulator bug must show, as a 500 naming it
            out = (500, "text/plain; charset=utf-8", f"emulator crashed: {type(exc).__name__}: {exc}".encode())
        if out is DROP:
            h.close_connection = True
            return
        self._send(h, *out)
        if self.dead:  # die_after reached: this was the last answer
            threading.Thread(target=self.stop, daemon=True).start()

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, ctype: str | None, payload: bytes) -> None:
        h.send_response(status)
        if ctype:
            h.send_header("content-type", ctype)
        h.send_header("content-length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def count_generation(self) -> None:
        """Call under the backend lock once a generation answer is computed."""
        self.generations += 1
        if self.die_after is not None and self.generations >= self.die_after:
            self.dead = True

    @staticmethod
    def json(status: int, obj: Any) -> tuple[int, str, bytes]:
        return status, "application/json", json.dumps(obj).encode()

    def bad_json(self, raw: bytes) -> tuple[int, str, bytes]:
        return self.json(400, {"error": {"message": "emulator: the body is not JSON"}})

    def route(self, method: str, path: str, query: str, body: Any) -> Any:
        raise NotImplementedError


def _not_found() -> tuple[int, str, bytes]:
    return Emulator.json(404, {"detail": "Not Found"})


def _emulator_refuses(what: str) -> tuple[int, str, bytes]:
    return Emulator.json(400, {"error": {"message": f"emulator: {what}"}})


# ---------------------------------------------------------------------------------------------- SGLang

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


class SGLangEmulator(Emulator):
    """``python -m sglang.launch_server`` as seen over HTTP: ``/generate``, ``/server_info`` (and the
    deprecated ``/get_server_info``), ``/health``, ``/health_generate``, ``/model_info``."""

    kind = "sglang"
    generation_paths = ("/generate",)

    def __init__(self, *, speculative: bool = False, version: str = "0.5.23", declares_deterministic: bool = False,
                 drop_spec_fields: bool = False, die_after: int | None = None, near_tie_flips: int = 0,
                 backend: FixtureBackend | None = None, instance_noise_nats: float = 0.0):
        super().__init__(die_after=die_after, backend=backend)
        self.instance_noise_nats = instance_noise_nats
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
        #: STANDALONE draft of width w: speculative_num_draft_tokens = w + 1 (anchor + drafts).
        self.num_draft_tokens = self.backend.draft_width + 1
        self.lifetime_verify = 0
        self.lifetime_accepted = 0
        self._server_info = self._build_server_info()

    # ------------------------------------------------------------------ /server_info
    def _build_server_info(self) -> dict[str, Any]:
        # the deterministic body differs from the plain one only in the flag (and launch_command); on
        # a speculative server the speculative_* keys are written over it below
        name = "server_info_deterministic.json" if self.declares_deterministic else (
            "server_info_dflash.json" if self.speculative else "server_info_plain.json")
        info = _recorded(DATA / "sglang" / name)
        over: dict[str, Any] = {
            "model_path": str(TARGET), "tokenizer_path": str(TARGET), "served_model_name": str(TARGET),
            "enable_deterministic_inference": self.declares_deterministic,
            "context_length": 4096,
        }
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
    def bad_json(self, raw: bytes) -> tuple[int, str, bytes]:
        return self.json(400, {"object": "error", "message": "JSON decode error", "type": "Bad Request",
                               "param": None, "code": 400})

    def route(self, method: str, path: str, query: str, body: Any) -> Any:
        if method == "GET" and path in ("/health", "/health_generate"):
            return 200, None, b""
        if method == "GET" and path in ("/server_info", "/get_server_info"):
            return self.json(200, self.server_info())
        if method == "GET" and path in ("/model_info", "/get_model_info"):
            info = _recorded(DATA / "sglang" / "model_info.json")
            info.update({"model_path": str(TARGET), "served_model_name": str(TARGET), "tokenizer_path": str(TARGET),
                         "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
            return self.json(200, info)
        if path == "/flush_cache" and method in ("GET", "POST"):
            return 200, "text/plain; charset=utf-8", (
                b"Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                b"requests, the operation will not be performed.)\n")
        if path == "/generate" and method in ("POST", "PUT"):
            return self.generate(body)
        return _not_found()

    def _validation_error(self, loc: str, msg: str, value: Any) -> tuple[int, str, bytes]:
        errors = [{"type": "value_error", "loc": ("body", loc), "msg": msg, "input": value}]
        return self.json(400, {"object": "error", "message": f"1 validation error: {errors}", "type": "Bad Request",
                               "param": None, "code": 400})

    def _contract_error(self, sampling: dict[str, Any]) -> tuple[int, str, bytes] | None:
        """0.5.23's JSON contract (400 ``{"error": "<string>"}``) or 0.5.19's uncaught TypeError (500)."""
        allowed = SGLANG_SAMPLING_0_5_23 if self.version == "0.5.23" else SGLANG_SAMPLING_0_5_19
        for key, value in sampling.items():
            if key not in allowed:
                if self.version == "0.5.19":
                    return 500, "text/plain; charset=utf-8", b"Internal Server Error"
                expected = ", ".join(f"`{k}`" for k in allowed)
                return self.json(400, {"error": f"unknown field `{key}`, expected one of {expected}"})
            if (self.version == "0.5.23" and key in _SGLANG_INT_KEYS and value is not None
                    and (isinstance(value, bool) or not isinstance(value, int))):
                kind = "floating point" if isinstance(value, float) else type(value).__name__
                return self.json(400, {"error": f"invalid type: {kind} `{value}`, expected i64"})
        return None

    def generate(self, body: Any) -> Any:
        if not isinstance(body, dict):
            return self._validation_error("body", "Input should be an object", body)
        for key in ("return_logprob", "stream", "return_text_in_logprobs"):
            if key in body and not isinstance(body[key], bool):
                return self._validation_error(key, "Input should be a valid boolean", body[key])
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            return _emulator_refuses("a list of sampling_params is not emulated")
        problem = self._contract_error(sampling)
        if problem:
            return problem
        temperature = float(sampling.get("temperature", 1.0))
        if not (temperature >= 0 and math.isfinite(temperature)):
            return self.json(400, {"error": {"message": f"temperature must be a non-negative finite number, got "
                                                        f"{temperature}."}})
        if not (temperature < 1e-6 or sampling.get("top_k") == 1):
            return _emulator_refuses("only greedy decoding is emulated (temperature 0 or top_k 1)")
        for key, neutral in _NEUTRAL.items():
            if float(sampling.get(key, neutral)) != neutral:
                return _emulator_refuses(f"{key}={sampling[key]} is not emulated")
        for key in ("stop", "stop_regex", "regex", "json_schema", "ebnf", "structural_tag", "logit_bias"):
            if sampling.get(key):
                return _emulator_refuses(f"sampling_params.{key} is not emulated")
        if sampling.get("ignore_eos"):
            return _emulator_refuses("ignore_eos=true is not emulated")
        if body.get("stream"):
            return _emulator_refuses("stream=true is not emulated")
        if int(sampling.get("n", 1)) != 1 or int(sampling.get("min_new_tokens", 0)) != 0:
            return _emulator_refuses("n != 1 or min_new_tokens != 0 is not emulated")
        ids = body.get("input_ids")
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
            return _emulator_refuses("only input_ids (a list of token ids, or a list of such lists) is emulated")
        rid = body.get("rid")
        out = []
        for i, prompt in enumerate(prompts):
            item_rid = (f"{rid}_{i}" if batch else rid) if isinstance(rid, str) else uuid.uuid4().hex
            answer = self._one(prompt, sampling, body, item_rid)
            if answer is DROP or isinstance(answer, tuple):
                return answer
            out.append(answer)
        return self.json(200, out if batch else out[0])

    def _one(self, prompt: list[int], sampling: dict[str, Any], body: dict[str, Any], rid: str) -> Any:
        max_new = sampling.get("max_new_tokens", 128)
        if max_new is None or max_new < 1:
            return _emulator_refuses("max_new_tokens < 1 (prefill-only requests) is not emulated")
        return_logprob = bool(body.get("return_logprob", False))
        start = int(body.get("logprob_start_len", -1)) if return_logprob else -1
        top_n = int(body.get("top_logprobs_num", 0) or 0)
        with_text = bool(body.get("return_text_in_logprobs", False))
        if start == -1:
            start = len(prompt)
        if start > len(prompt):
            return self.json(400, {"error": {"message": f"req.logprob_start_len={start} is higher than the number of "
                                                        f"input tokens len(req.origin_input_ids)={len(prompt)}. Please "
                                                        "use a smaller logprob_start_len."}})
        stops = list(dict.fromkeys([*(sampling.get("stop_token_ids") or []), *self.backend.eos_ids]))
        t0 = time.perf_counter()
        with self.backend.lock:
            if self.dead:
                return DROP
            result = self.backend.generate(prompt, max_new, stops, top_n, self.speculative)
            if self.near_tie_flips > 0:
                flipped = self.backend.flip_closest_call(prompt, result, max_new, stops, top_n)
                if flipped is not None:
                    result = flipped
                    self.near_tie_flips -= 1
                    self.flipped.append(rid)
            in_scores = (self.backend.score(prompt[: start + 1], prompt[start + 1:], top_n)
                         if return_logprob and start < len(prompt) - 1 else None)
            self.count_generation()
        if self.instance_noise_nats:
            result = copy.copy(result)
            result.scores = instance_noise(result.scores, prompt, self.instance_noise_nats)
            if in_scores is not None:
                in_scores = instance_noise(in_scores, prompt[: start + 1], self.instance_noise_nats)
        ids = list(result.output_ids)
        stopped = bool(ids) and ids[-1] in stops
        finish = {"type": "stop", "matched": ids[-1]} if stopped else {"type": "length", "length": max_new}
        text_ids = ids[:-1] if stopped else ids
        tt = self.backend.token_text

        def entry(lp: Any, tid: int) -> list[Any]:
            return [None if lp is None or not math.isfinite(lp) else float(lp), int(tid), tt(tid) if with_text else None]

        meta: dict[str, Any] = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                                "weight_version": "default", "num_retractions": 0}
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
            meta["output_token_logprobs_length"] = len(ids)
            if top_n > 0:
                meta["input_top_logprobs"] = in_tops
                meta["output_top_logprobs"] = [[entry(s.top_logprobs[i, c], s.top_ids[i, c]) for c in range(top_n)]
                                               if math.isfinite(s.logprobs[i]) else None for i in range(len(ids))]
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0,
                     "weight_versions": [{"version": "default", "start": 0, "end": len(ids)}],
                     "cached_tokens_details": None, "dp_rank": None, "e2e_latency": time.perf_counter() - t0})
        if self.speculative and not self.drop_spec_fields:
            meta.update(self._spec_fields(result.spec, len(ids)))
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


# ---------------------------------------------------------------------------------------------- vLLM

#: Knobs vLLM fills from ``generation_config.json`` when a request leaves them unset.
VLLM_KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class VLLMEmulator(Emulator):
    """``vllm serve`` as seen over HTTP: ``/v1/completions``, ``/v1/models``, ``/version``, ``/health``
    and ``/metrics`` (Prometheus text rendered by ``prometheus_client`` from counters declared as vLLM
    declares them)."""

    kind = "vllm"
    generation_paths = ("/v1/completions",)

    def __init__(self, *, speculative: bool = False, spec_disabled_for_logprobs: bool = False,
                 per_request_metrics: bool = False, max_logprobs: int = 20, version: str = "0.33.0",
                 served_model_name: str = "fixture/target", die_after: int | None = None,
                 dev_mode: bool = False, batch_invariant: bool = False, near_tie_flips: int = 0,
                 backend: FixtureBackend | None = None):
        super().__init__(die_after=die_after, backend=backend)
        from prometheus_client import CollectorRegistry, Counter, Gauge

        if near_tie_flips and not speculative:
            raise ValueError("near_tie_flips: only a speculative emulator flips its answers")
        #: vLLM 0.26.x answers as recorded live (tests/data/vllm-0.26.0/), else as read in 0.33.0's source
        self.v026 = version.split(".")[:2] == ["0", "26"]
        if per_request_metrics and speculative and self.v026:
            raise ValueError("per_request_metrics: vLLM 0.26 has no --per-request-spec-decode-metrics")
        self.speculative = speculative
        self.dev_mode = dev_mode
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
        self.c_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                 labels[:1] + ["finished_reason"] + labels[1:], registry=self.registry)
        for g in (self.g_running, self.g_waiting, self.c_prompt, self.c_generation):
            g.labels(*self.labelvalues)
        for reason in ("stop", "length", "abort", "error", "repetition"):
            self.c_success.labels(self.labelvalues[0], reason, self.labelvalues[1])

    # ------------------------------------------------------------------ routing
    def bad_json(self, raw: bytes) -> tuple[int, str, bytes]:
        return self._error(400, "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 0), 'msg': "
                                "'JSON decode error'}", "Bad Request")

    def _error(self, code: int, message: str, kind: str = "BadRequestError", param: str | None = None,
               value: Any = None) -> tuple[int, str, bytes]:
        if param is not None:
            message = f"{message} (parameter={param}, value={value})"
        return self.json(code, {"error": {"message": message, "type": kind, "param": param, "code": code}})

    def route(self, method: str, path: str, query: str, body: Any) -> Any:
        if method == "GET" and path == "/health":
            return 200, None, b""
        if method == "GET" and path == "/version":
            return self.json(200, {"version": self.version})
        if method == "GET" and path == "/v1/models":
            models = _recorded(DATA / "vllm" / "models.json")
            card = models["data"][0]
            card.update({"id": self.served, "root": str(TARGET), "created": self.created, "max_model_len": 4096})
            card["permission"][0]["created"] = self.created
            return self.json(200, models)
        if method == "GET" and path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            with self.backend.lock:
                text = generate_latest(self.registry)
            return 200, CONTENT_TYPE_LATEST, text
        if method == "GET" and path == "/server_info" and self.dev_mode:
            return self.json(200, self.dev_server_info(query))
        if method == "POST" and path == "/v1/completions":
            return self.completions(body)
        return _not_found()

    def dev_server_info(self, query: str) -> dict[str, Any]:
        """``GET /server_info`` of a ``VLLM_SERVER_DEV_MODE=1`` server (vLLM's
        ``serve/instrumentator/server_info.py``, ``serve/dev/server_info/api_router.py`` in 0.33.0):
        ``vllm_config`` (``str(VllmConfig)``, or with ``config_format=json`` its pydantic JSON dump;
        here only the keys the adapter reads), ``vllm_env`` (every ``VLLM_*`` name of ``vllm.envs``
        without ``KEY``, as its *parsed* value: ``VLLM_BATCH_INVARIANT`` is
        ``bool(int(os.getenv(...)))``, so JSON ``true``/``false``) and ``system_env``
        (``collect_env``; a few keys here)."""
        spec = ({"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": self.num_spec_tokens}
                if self.speculative else None)
        config = {"model_config": {"model": str(TARGET), "dtype": "torch.float32", "max_model_len": 4096,
                                   "served_model_name": self.served},
                  "speculative_config": spec}
        if self.v026:  # the recorded 0.26.0 shapes: the whole SpeculativeConfig, nested configs and ports
            recorded = _recorded(DATA / "vllm-0.26.0" / "server_info_ngram.json")["vllm_config"]
            model_config = {**recorded["model_config"], "model": str(TARGET), "tokenizer": str(TARGET),
                            "served_model_name": self.served}
            spec = copy.deepcopy(recorded["speculative_config"]) if self.speculative else None
            if spec is not None:
                spec.update({"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": self.num_spec_tokens,
                             "prompt_lookup_max": None, "prompt_lookup_min": None, "target_model_config": model_config})
                spec["draft_model_config"] = {**model_config, "model": str(DRAFT), "tokenizer": str(DRAFT)}
            config = {"model_config": model_config, "speculative_config": spec}
        return {"vllm_config": config if "config_format=json" in query else f"VllmConfig(model={str(TARGET)!r}, ...)",
                "vllm_env": {"VLLM_BATCH_INVARIANT": self.batch_invariant, "VLLM_SERVER_DEV_MODE": True,
                             "VLLM_LOGGING_LEVEL": "INFO"},
                "system_env": {"torch_version": "2.9.0", "is_cuda_available": False}}

    def completions(self, body: Any) -> Any:
        if not isinstance(body, dict):
            return self._error(400, "1 validation error:\n  {'type': 'model_attributes_type', 'loc': ('body',), "
                                    "'msg': 'Input should be a valid dictionary'}", "Bad Request")
        model = body.get("model")
        if model is not None and model != self.served:
            return self._error(404, f"The model `{model}` does not exist.", "NotFoundError", "model", model)
        prompt = body.get("prompt")
        if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)):
            return _emulator_refuses("only a token-id prompt (a list of ints) is emulated")
        for key in VLLM_KNOBS:
            if body.get(key) is None:
                return _emulator_refuses(f"{key} not sent: vLLM would take it from the model's generation_config.json "
                                         "(--generation-config auto)")
        top_k = body["top_k"]
        if not isinstance(top_k, int) or top_k < -1:
            return self._error(400, f"top_k must be 0 (disable), or at least 1, got {top_k}.")
        if self.speculative and (float(body["min_p"]) > 1e-5 and not self.v026 or body.get("logit_bias")):
            return self._error(400, "The min_p and logit_bias sampling parameters are not yet supported with "
                                    "speculative decoding.")
        if float(body["temperature"]) >= 1e-5:
            return _emulator_refuses("only greedy decoding (temperature < 1e-5) is emulated")
        for key, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if float(body[key]) != neutral:
                return _emulator_refuses(f"{key}={body[key]} is not emulated")
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
                return _emulator_refuses(f"{key}={body[key]!r} is not emulated")
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
        with self.backend.lock:
            if self.dead:
                return DROP
            result = self.backend.generate(prompt, max_tokens, stops, k, use_spec)
            if self.near_tie_flips > 0:
                flipped = self.backend.flip_closest_call(prompt, result, max_tokens, stops, k)
                if flipped is not None:
                    result = flipped
                    self.near_tie_flips -= 1
                    self.flipped.append(",".join(map(str, prompt)))
            rows = self.backend.prompt_rows(prompt, prompt_logprobs) if prompt_logprobs is not None else None
            self.count_generation()
            ids = list(result.output_ids)
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
            block = {"text_offset": offsets, "token_logprobs": [max(float(x), -9999.0) if math.isfinite(x) else None
                                                                for x in s.logprobs[: len(ids)]],
                     "tokens": tokens, "top_logprobs": tops}
        prompt_lp = None
        if rows is not None:
            prompt_lp = [None]
            for i, row in enumerate(rows[1:], start=1):
                actual, rank, top = row
                entry = {str(prompt[i]): {"logprob": max(actual, -9999.0), "rank": rank,
                                          "decoded_token": self.backend.token_text(prompt[i])}}
                for r, (tid, lp) in enumerate(top, start=1):
                    entry[str(tid)] = {"logprob": max(lp, -9999.0), "rank": r,
                                       "decoded_token": self.backend.token_text(tid)}
                prompt_lp.append(entry)
        metrics = None
        if self.per_request_metrics and use_spec and steps:
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
                           "num_accepted_draft_tokens": acc, "num_draft_tokens": drafted,
                           "num_spec_tokens": self.num_spec_tokens, "per_step_accepted": None,
                           "per_step_drafted": None}}
        choice = {"index": 0, "text": text, "logprobs": block, "finish_reason": finish, "stop_reason": stop_reason,
                  "token_ids": ids if with_ids else None, "prompt_logprobs": prompt_lp,
                  "prompt_token_ids": list(prompt) if with_ids else None, "routed_experts": None,
                  "weight_versions": None}
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(ids), "completion_tokens": len(ids),
                 "prompt_tokens_details": None, "completion_tokens_details": None}
        if self.v026:  # recorded: neither key exists in 0.26.0
            del choice["weight_versions"], usage["completion_tokens_details"]
        answer = {"id": "cmpl-" + uuid.uuid4().hex[:16], "object": "text_completion", "created": int(time.time()),
                  "model": self.served, "choices": [choice], "service_tier": None,
                  "system_fingerprint": self.fingerprint,
                  "usage": usage,
                  "kv_transfer_params": None, "ec_transfer_params": None, "metrics": metrics}
        return self.json(200, answer)


# ---------------------------------------------------------------------------------------------- the gate


def run_lossless(engine: str, baseline_url: str, spec_url: str, report: Path, *extra: str,
                 timeout_s: float = 180.0):
    """``pytest suites/lossless --engine ENGINE --baseline-url … --spec-url … --categories math
    --max-new-tokens 16 --report REPORT`` as a subprocess, the way a user runs the gate; returns the
    completed process and the journal's records."""
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "pytest", "suites/lossless", "-q", "-p", "no:cacheprovider", "--engine", engine,
            "--baseline-url", baseline_url, "--spec-url", spec_url, "--categories", "math", "--max-new-tokens", "16",
            "--report", str(report), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
    journal = report / "results.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
    return proc, records
