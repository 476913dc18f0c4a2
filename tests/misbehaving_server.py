"""A llama.cpp-protocol HTTP server that answers like ``llama-server`` — and misbehaves on purpose.

It speaks the subset of ``llama-server``'s API the ``llamacpp`` engine uses (``GET /health``,
``GET /props``, ``POST /completion``; anything else is a 404 in llama.cpp's error shape) on
127.0.0.1 on a free port, with HTTP/1.1 keep-alive like cpp-httplib, and stops cleanly (every
connection closed, every handler thread joined, sleepers woken).

Answers are built from the real bodies captured in ``tests/data/llamacpp/`` (see its README): the
envelope (field names, order, ``generation_settings``, ``timings`` keys, compact JSON) is the
captured one, and ``tokens``, ``content``, ``completion_probabilities``, ``stop_type`` and
``timings`` are rebuilt for each request from a deterministic "model" that replays the captured
greedy token streams (:class:`ReplayModel`). The same context always gets the same row, so the
baseline's decode rows and the per-position scoring rows agree exactly, a speculative server
returns the baseline's tokens (drafted tokens accepted, with llama.cpp's ``logprob: 0.0`` and empty
``top_logprobs`` rows), and the gate passes when nothing is wrong.

Faults (:data:`FAULTS`) are chosen by :class:`Rule` — per ``/completion`` request number (1-based,
counted per server), per prompt (the generation prompt's token ids; its scoring requests match too),
or from a request number on — plus two server-level ones: ``refuse=True`` (the port is bound but
never listening: every connection is refused) and ``die_after=N`` (the N+1-th ``/completion``
request is dropped without an answer and the server stops listening, like a crashed
``llama-server``)::

    with MisbehavingServer(speculative=True, rules=[Rule("http_500", requests={2})]) as spec:
        ... EngineOptions(spec_urls=(spec.url,), ...)

Run it by hand: ``python tests/misbehaving_server.py --spec --fault hang@3``.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterable, Sequence

from specparity.engines.llamacpp import byte_decoder

DATA = Path(__file__).resolve().parent / "data" / "llamacpp"
TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "target" / "tokenizer.json"

#: The chat template's generation prompt, ``<|im_start|>assistant\n``: what follows it is the answer.
GENERATION_PROMPT = (1, 281, 203)
EOS = 2

FAULTS = {
    "hang": "read the request, never answer (until the server stops or hang_s passes), then close",
    "trickle": "answer the headers at once, then the body a few bytes every trickle_s (each read is quick, the "
               "whole answer takes minutes)",
    "http_500": "HTTP 500 with llama.cpp's error body",
    "http_400": "HTTP 400 with llama.cpp's error body (the captured 'Prompt contains invalid tokens')",
    "bad_json": "HTTP 200 whose body is the real answer cut in half (malformed JSON)",
    "close_mid": "send the headers and half the body, then close the connection",
    "no_timings": "a valid answer without 'timings'",
    "accepted_gt_drafted": "timings.draft_n_accepted > timings.draft_n",
    "short_limit": "stop_type 'limit' with fewer tokens than n_predict",
    "bad_prob_ids": "a completion_probabilities row whose id matches no token of the answer",
    "die": "drop this request without an answer and stop listening (a crash)",
}

ERROR_500 = {"error": {"code": 500, "message": "failed to decode the batch (ret = -3): could not find a KV slot",
                       "type": "server_error"}}


def _load(name: str) -> Any:
    return json.loads((DATA / name).read_bytes())


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------------------- the model


class Vocab:
    """Token id -> bytes, read from the fixture target's ``tokenizer.json`` (no transformers)."""

    def __init__(self, path: Path = TOKENIZER_JSON):
        tok = json.loads(path.read_text(encoding="utf-8"))
        dec = byte_decoder()
        self.bytes: dict[int, bytes] = {}
        for piece, idx in tok["model"]["vocab"].items():
            self.bytes[int(idx)] = bytes(dec[ch] for ch in piece) if all(ch in dec for ch in piece) else piece.encode()
        self.special = {int(a["id"]) for a in tok.get("added_tokens", []) if a.get("special")}
        for a in tok.get("added_tokens", []):
            self.bytes[int(a["id"])] = a["content"].encode()
        self.size = max(self.bytes) + 1

    def piece(self, tid: int) -> dict[str, Any]:
        """``{id, token, bytes}`` as llama-server writes them (``token`` is "" for a cut UTF-8 piece)."""
        data = self.bytes.get(tid, b"")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        return {"id": tid, "token": text, "bytes": list(data)}

    def text(self, ids: Sequence[int]) -> str:
        return b"".join(self.bytes.get(t, b"") for t in ids).decode("utf-8", "replace")


@dataclass
class Stream:
    """A captured greedy answer: its tokens and, per position, (id, logprob) alternatives or None."""

    name: str
    tokens: list[int]
    rows: list[list[tuple[int, float]] | None]


class ReplayModel:
    """Greedy "model": each prompt gets one captured stream (by a hash of the prompt ids); beyond or
    off that stream it continues with deterministic ordinary tokens. ``row(context, k)`` is the
    next token's top-k (the argmax first), a pure function of the context."""

    SOURCES = ("completion_nospec.json", "completion_stop_eos.json", "completion_parallel2_b.json",
               "completion_spec_ngram_simple.json")

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.streams = [self._stream(name) for name in self.SOURCES]
        seen = sorted({t for s in self.streams for t in s.tokens} | {
            a for s in self.streams for r in s.rows if r for a, _ in r})
        #: ordinary tokens for synthesized continuations and padding: never special, never a stop
        self.ordinary = [t for t in seen if t not in vocab.special and t > 4]

    @staticmethod
    def _stream(name: str) -> Stream:
        body = _load(name)
        tokens = [int(t) for t in body["tokens"]]
        rows: list[list[tuple[int, float]] | None] = [None] * len(tokens)
        for i, row in enumerate(body["completion_probabilities"][: len(tokens)]):
            alts = row.get("top_logprobs") or []
            # a reported row of a greedy answer has its own token first; drafted rows (empty) and
            # anything else are synthesized instead
            if alts and int(row["id"]) == tokens[i] and int(alts[0]["id"]) == tokens[i]:
                rows[i] = [(int(a["id"]), float(a["logprob"])) for a in alts]
        return Stream(name, tokens, rows)

    @staticmethod
    def split(context: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt up to the last generation prompt, the answer so far)."""
        ctx = tuple(int(t) for t in context)
        g = len(GENERATION_PROMPT)
        for j in range(len(ctx) - g, -1, -1):
            if ctx[j:j + g] == GENERATION_PROMPT:
                return ctx[: j + g], ctx[j + g:]
        return ctx, ()

    def stream_for(self, prompt: Sequence[int]) -> Stream:
        return self.streams[zlib.crc32(_ids_bytes(prompt)) % len(self.streams)]

    def row(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        prompt, answer = self.split(context)
        s = self.stream_for(prompt)
        i = len(answer)
        alts: list[tuple[int, float]]
        if i < len(s.tokens) and list(answer) == s.tokens[:i]:
            tok = s.tokens[i]
            alts = list(s.rows[i]) if s.rows[i] else [(tok, -0.0123)]
        else:
            h = zlib.crc32(_ids_bytes(context))
            tok = self.ordinary[h % len(self.ordinary)]
            alts = [(tok, -0.0456)]
        # pad to k alternatives below the last one, deterministically
        have = {a for a, _ in alts}
        lp = min(x for _, x in alts) - 1.5
        start = zlib.crc32(_ids_bytes(context[-4:])) % len(self.ordinary)
        j = 0
        while len(alts) < k and j < len(self.ordinary):
            cand = self.ordinary[(start + j) % len(self.ordinary)]
            j += 1
            if cand not in have:
                alts.append((cand, round(lp, 6)))
                have.add(cand)
                lp -= 0.5
        return alts[:k]

    def greedy(self, prompt: Sequence[int], n_predict: int, k: int) -> tuple[list[int], list[list[tuple[int, float]]], str]:
        """(tokens, their rows, stop_type) of a greedy decode: stops after EOS or at n_predict."""
        ctx = list(prompt)
        tokens: list[int] = []
        rows: list[list[tuple[int, float]]] = []
        while len(tokens) < n_predict:
            r = self.row(ctx, k)
            tokens.append(r[0][0])
            rows.append(r)
            ctx.append(r[0][0])
            if r[0][0] == EOS:
                return tokens, rows, "eos"
        return tokens, rows, "limit"


def _ids_bytes(ids: Iterable[int]) -> bytes:
    return b",".join(str(int(t)).encode() for t in ids)


# ----------------------------------------------------------------------------------------- faults


@dataclass
class Rule:
    """When to misbehave: every condition given must hold (none given: every request).

    ``requests``: 1-based ``/completion`` request numbers of this server; ``prompt``: the token ids
    of a generation prompt (a request matches when its prompt starts with them, so the prompt's
    scoring requests match too); ``from_request``: every request from that number on.
    """

    fault: str
    requests: Iterable[int] | None = None
    prompt: Sequence[int] | None = None
    from_request: int | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}: expected one of {', '.join(FAULTS)}")
        self.requests = None if self.requests is None else frozenset(int(n) for n in self.requests)
        self.prompt = None if self.prompt is None else tuple(int(t) for t in self.prompt)

    def matches(self, n: int, prompt: Sequence[int]) -> bool:
        if self.requests is not None and n not in self.requests:
            return False
        if self.from_request is not None and n < self.from_request:
            return False
        if self.prompt is not None and tuple(prompt[: len(self.prompt)]) != self.prompt:
            return False
        return True


@dataclass
class Seen:
    """One ``/completion`` request as the server saw it."""

    n: int
    prompt_len: int
    n_predict: int
    fault: str | None
    at: float = field(default_factory=time.monotonic)


# ----------------------------------------------------------------------------------------- the server


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: "MisbehavingServer"

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self.owner._track(request, add=True)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner._track(request, add=False)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall per request
    server_version = "llama.cpp"
    sys_version = ""
    server: _HTTPServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.owner._get(self)

    def do_POST(self) -> None:  # noqa: N802
        self.server.owner._post(self)

    # helpers
    def send_json(self, status: int, body: bytes, *, cut_at: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Keep-Alive", "timeout=5, max=100")
        self.end_headers()
        if cut_at is None:
            self.wfile.write(body)
            self.wfile.flush()
            return
        self.wfile.write(body[:cut_at])
        self.wfile.flush()
        self.drop()

    def drop(self) -> None:
        """Close the connection at once, whatever was (not) sent."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class MisbehavingServer:
    """A fake ``llama-server``; see the module docstring. Use as a context manager or start()/stop()."""

    def __init__(self, *, speculative: bool = False, rules: Sequence[Rule] = (), die_after: int | None = None,
                 refuse: bool = False, hang_s: float = 30.0, trickle_s: float = 0.1, draft_n_max: int = 4,
                 total_slots: int = 1,
                 vocab: Vocab | None = None):
        self.speculative = speculative
        self.rules = list(rules)
        self.die_after = die_after
        self.refuse = refuse
        self.hang_s = hang_s
        self.trickle_s = trickle_s
        self.draft_n_max = draft_n_max
        self.total_slots = total_slots
        self.vocab = vocab or _shared_vocab()
        self.model = ReplayModel(self.vocab)
        self.seen: list[Seen] = []
        self.dead = False
        self._count = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._httpd: _HTTPServer | None = None
        self._serve: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.port = 0
        envelope = "completion_spec_draft_simple.json" if speculative else "completion_nospec.json"
        self._envelope = _load(envelope)
        self._props = _load("props.json")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "MisbehavingServer":
        if self.refuse:
            # bound (so nobody else takes the port) but never listening: connections are refused
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.bind(("127.0.0.1", 0))
            self.port = self._sock.getsockname()[1]
            return self
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self._serve = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name=f"misbehaving-{self.port}", daemon=True)
        self._serve.start()
        return self

    def stop(self) -> None:
        """Stop listening, close every connection, wake sleepers and join every thread."""
        self._stopping.set()
        self._stop_listening()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> "MisbehavingServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _stop_listening(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._conns.add(conn)
                self._threads.add(threading.current_thread())
            else:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    # ------------------------------------------------------------------ endpoints
    def _get(self, h: _Handler) -> None:
        path = h.path.split("?")[0]
        if path == "/health":
            h.send_json(200, b'{"status":"ok"}')
        elif path == "/props":
            props = copy.deepcopy(self._props)
            props["total_slots"] = self.total_slots
            if self.speculative:
                props["default_generation_settings"]["params"]["speculative.types"] = "draft-simple"
            h.send_json(200, _compact(props))
        else:
            self._not_found(h)

    @staticmethod
    def _not_found(h: _Handler) -> None:
        h.send_json(404, _compact({"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}}))

    def _post(self, h: _Handler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        if h.path.split("?")[0] != "/completion":
            self._not_found(h)
            return
        try:
            req = json.loads(raw)
            prompt = [int(t) for t in req["prompt"]]
            n_predict = int(req.get("n_predict", -1))
            k = int(req.get("n_probs", 0))
        except (ValueError, KeyError, TypeError) as exc:
            h.send_json(400, _compact({"error": {"code": 400, "message": f"[json.exception] {exc}",
                                                 "type": "invalid_request_error"}}))
            return
        with self._lock:
            self._count += 1
            n = self._count
            die = self.die_after is not None and n > self.die_after
            fault = "die" if die else next((r.fault for r in self.rules if r.matches(n, prompt)), None)
            self.seen.append(Seen(n, len(prompt), n_predict, fault))
        if fault == "die":
            self.dead = True
            self._stop_listening()  # refuse whatever comes next, then drop this one unanswered
            h.drop()
            return
        if fault == "hang":
            self._stopping.wait(self.hang_s)
            h.drop()
            return
        if fault == "http_500":
            h.send_json(500, _compact(ERROR_500))
            return
        if fault == "http_400":
            h.send_json(400, (DATA / "error_invalid_token.json").read_bytes())
            return
        body = self.completion(req, prompt, n_predict, k, fault)
        if fault == "bad_json":
            h.send_json(200, body[: len(body) // 2])
        elif fault == "close_mid":
            h.send_json(200, body, cut_at=len(body) // 2)
        elif fault == "trickle":
            self._trickle(h, body)
        else:
            h.send_json(200, body)

    def _trickle(self, h: _Handler, body: bytes) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.flush()
        try:
            for i in range(0, len(body), 4):
                if self._stopping.wait(self.trickle_s):
                    break
                h.wfile.write(body[i:i + 4])
                h.wfile.flush()
        except OSError:  # the client gave up
            pass
        h.drop()

    # ------------------------------------------------------------------ the answer
    def completion(self, req: dict[str, Any], prompt: list[int], n_predict: int, k: int, fault: str | None) -> bytes:
        """A ``/completion`` answer in the captured envelope, rebuilt for this request."""
        limit = n_predict if n_predict >= 0 else 4096
        tokens, rows, stop_type = self.model.greedy(prompt, limit, max(k, 1))
        out_rows = []
        for i, (tok, alts) in enumerate(zip(tokens, rows)):
            entry = self.vocab.piece(tok)
            entry["logprob"] = alts[0][1]
            entry["top_logprobs"] = [{**self.vocab.piece(a), "logprob": lp} for a, lp in alts[:k]]
            out_rows.append(entry)
        draft_n = accepted = 0
        if self.speculative:
            draft_n, accepted, drafted_positions = self._simulate_drafts(prompt, len(tokens))
            for i in drafted_positions:  # accepted draft tokens: the server computed no row for them
                out_rows[i]["logprob"] = 0.0
                out_rows[i]["top_logprobs"] = []
        if fault == "short_limit":
            keep = max(1, min(len(tokens), limit) // 2)  # EOS is only ever last: it is cut off here
            tokens, out_rows, stop_type = tokens[:keep], out_rows[:keep], "limit"
        if fault == "bad_prob_ids" and out_rows:
            stray = next(t for t in self.model.ordinary if t not in tokens)
            out_rows[-1] = {**out_rows[-1], **self.vocab.piece(stray)}
        body = copy.deepcopy(self._envelope)
        body["content"] = self.vocab.text([t for t in tokens if t != EOS])
        body["tokens"] = tokens if req.get("return_tokens") else []
        body["id_slot"] = 0
        body["tokens_predicted"] = len(tokens)
        body["tokens_evaluated"] = len(prompt)
        gs = body["generation_settings"]
        gs["n_predict"], gs["max_tokens"], gs["n_probs"] = n_predict, n_predict, k
        gs["temperature"] = float(req.get("temperature", gs["temperature"]))
        gs["logit_bias"] = [[int(t), b] for t, b in (req.get("logit_bias") or [])] if isinstance(
            req.get("logit_bias"), list) else gs["logit_bias"]
        body["prompt"] = self.vocab.text(prompt)
        body["has_new_line"] = "\n" in body["content"]
        body["truncated"] = False
        body["stop_type"] = stop_type
        body["stopping_word"] = ""
        body["tokens_cached"] = len(prompt) + len(tokens) - 1
        prompt_ms, predicted_ms = 0.16 * len(prompt), 0.43 * max(1, len(tokens))
        timings: dict[str, Any] = {
            "cache_n": 0, "prompt_n": len(prompt), "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(1, len(prompt)),
            "prompt_per_second": 1000.0 * len(prompt) / prompt_ms if prompt_ms else 0.0,
            "predicted_n": len(tokens), "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(1, len(tokens)),
            "predicted_per_second": 1000.0 * len(tokens) / predicted_ms,
        }
        if self.speculative:
            timings["draft_n"], timings["draft_n_accepted"] = draft_n, accepted
            if fault == "accepted_gt_drafted":
                timings["draft_n_accepted"] = draft_n + 3
        body["timings"] = timings
        if fault == "no_timings":
            del body["timings"]
        body["completion_probabilities"] = out_rows if k > 0 else []
        return _compact(body)

    def _simulate_drafts(self, prompt: Sequence[int], n: int) -> tuple[int, int, list[int]]:
        """llama.cpp's draft loop, deterministically: the first token comes from the prefill; each
        verify step drafts up to ``draft_n_max`` tokens, accepts a prefix of them (a deterministic
        0..n_max, so every path is taken) and adds one target token. Returns (drafted, accepted,
        positions of accepted draft tokens)."""
        pos, drafted, accepted, positions = 1, 0, 0, []
        seed = zlib.crc32(_ids_bytes(prompt))
        step = 0
        while pos < n:
            d = self.draft_n_max
            a = min((seed + 3 * step) % (d + 1), n - pos)
            drafted += d
            accepted += a
            positions.extend(range(pos, pos + a))
            pos += a + 1  # the accepted drafts, then the target's own token
            step += 1
        return drafted, accepted, positions


_VOCAB: Vocab | None = None


def _shared_vocab() -> Vocab:
    global _VOCAB
    if _VOCAB is None:
        _VOCAB = Vocab()
    return _VOCAB


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", action="store_true", help="answer as a speculative server (draft counters)")
    ap.add_argument("--fault", action="append", default=[], metavar="FAULT[@N,M]",
                    help=f"misbehave on these request numbers (all when no @): {', '.join(FAULTS)}")
    ap.add_argument("--die-after", type=int, default=None)
    ns = ap.parse_args(argv)
    rules = []
    for f in ns.fault:
        name, _, nums = f.partition("@")
        rules.append(Rule(name, requests=[int(x) for x in nums.split(",")] if nums else None))
    with MisbehavingServer(speculative=ns.spec, rules=rules, die_after=ns.die_after) as srv:
        print(srv.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
