"""The HTTP server under every fake: lifecycle, connection tracking, die_after and the faults.

A :class:`FakeServer` binds a ``ThreadingHTTPServer`` to ``127.0.0.1`` on a free port (so tests
run side by side under xdist), serves it from a thread, speaks HTTP/1.1 with keep-alive (like
uvicorn and cpp-httplib) and stops cleanly: the listening socket closes, every open connection is
shut down, sleeping faults wake up and every handler thread is joined.

A protocol subclass says which paths generate (:attr:`FakeServer.generation_paths`), where a
request's prompt is (:meth:`FakeServer.prompt_of`), its error bodies, and answers in
:meth:`FakeServer.route`. The base numbers the generation requests, picks the fault of the first
matching :class:`~fakes.faults.Rule` and applies the transport and status faults around the
answer; the content faults reach the subclass as :attr:`Request.fault`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

from fakes.faults import Rule, Seen


@dataclass
class Reply:
    """An answer: status, Content-Type (None: no header) and the body bytes."""

    status: int
    content_type: str | None
    payload: bytes


@dataclass
class Request:
    """One request as received; ``fault`` is the content fault chosen for it (None: answer well)."""

    method: str
    path: str
    query: str
    body: Any
    fault: str | None = None


def json_reply(status: int, obj: Any, content_type: str = "application/json") -> Reply:
    return Reply(status, content_type, json.dumps(obj).encode())


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: "FakeServer"

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if isinstance(sys.exc_info()[1], OSError):  # a client that went away, or a connection a fault shut
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        self.owner._track(request, add=True)
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner._track(request, add=False)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall per request
    sys_version = ""
    server: _HTTPServer

    def version_string(self) -> str:
        return self.server.owner.server_version

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.owner._handle(self, "GET")

    def do_POST(self) -> None:  # noqa: N802
        self.server.owner._handle(self, "POST")

    def do_PUT(self) -> None:  # noqa: N802
        self.server.owner._handle(self, "PUT")

    def send_headers(self, reply: Reply, extra: Sequence[tuple[str, str]] = ()) -> None:
        self.send_response(reply.status)
        if reply.content_type:
            self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.payload)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()

    def drop(self) -> None:
        """Close the connection at once, whatever was (not) sent."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class FakeServer:
    """One fake server; use as a context manager or call :meth:`start` / :meth:`stop`.

    ``rules``: the faults (:data:`~fakes.faults.FAULTS`) and the generation requests they hit;
    ``die_after=N``: the N+1-th generation request is dropped unanswered and the server stops
    listening (a crash, as the client sees it: the connection closes mid-request, later ones are
    refused); ``refuse=True``: the port is bound but never listens, every connection is refused.
    """

    #: the ``Server`` header
    server_version = "fake"
    #: more headers on every answer
    extra_headers: tuple[tuple[str, str], ...] = ()
    #: paths whose POST/PUT requests generate: numbered, and hit by rules and die_after
    generation_paths: tuple[str, ...] = ()

    def __init__(self, *, rules: Sequence[Rule] = (), die_after: int | None = None, refuse: bool = False,
                 hang_s: float = 30.0, trickle_s: float = 0.1):
        self.rules = list(rules)
        self.die_after = die_after
        self.refuse = refuse
        self.hang_s = hang_s
        self.trickle_s = trickle_s
        #: generation requests as received, with the fault each got
        self.seen: list[Seen] = []
        #: every request as received: (method, path, JSON body)
        self.requests: list[tuple[str, str, Any]] = []
        #: True once the server crashed (die) or stopped
        self.dead = False
        self.port = 0
        self._count = 0
        #: generation requests received and not yet answered (a scheduler is idle at 0)
        self.in_flight = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._busy: set[socket.socket] = set()  # connections answering a request now
        self._threads: set[threading.Thread] = set()
        self._httpd: _HTTPServer | None = None
        self._serve: threading.Thread | None = None
        self._sock: socket.socket | None = None
        #: requests being collected into a batch (:meth:`join_batch`) → the most of them present at once
        #: since each joined
        self._batch: dict[object, int] = {}
        self._batch_lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FakeServer":
        if self.refuse:
            # bound (so nobody else takes the port) but never listening: connections are refused
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.bind(("127.0.0.1", 0))
            self.port = self._sock.getsockname()[1]
            return self
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.owner = self
        self.port = int(self._httpd.server_address[1])
        self._serve = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name=f"{type(self).__name__}-{self.port}", daemon=True)
        self._serve.start()
        return self

    def stop(self) -> None:
        """Stop listening, close every connection, wake sleepers and join every thread."""
        self.dead = True
        self._stopping.set()
        self._stop_listening()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for t in threads:
            t.join(timeout=5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _stop_listening(self, *, spare_busy: bool = False) -> None:
        """Close the listening socket and shut every connection down (``spare_busy``: except the
        ones answering a request now, which close once answered)."""
        with self._lock:
            httpd, self._httpd = self._httpd, None
            conns = [c for c in self._conns if not (spare_busy and c in self._busy)]
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
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

    # ------------------------------------------------------------------ the protocol (subclasses)
    def route(self, req: Request) -> Reply:
        """The answer to ``req``."""
        raise NotImplementedError

    def prompt_of(self, body: Any) -> list[int]:
        """The prompt token ids of a generation request, for :attr:`Rule.prompt` ([] when none)."""
        return []

    def limit_of(self, body: Any) -> int:
        """The token limit a generation request asks for (``Seen.n_predict``; -1 when none)."""
        return -1

    def bad_json(self, raw: bytes) -> Reply:
        """The answer to a request body that is not JSON."""
        return json_reply(400, {"error": {"message": "fake server: the body is not JSON"}})

    def error_500(self) -> Reply:
        raise NotImplementedError

    def error_400(self) -> Reply:
        raise NotImplementedError

    # ------------------------------------------------------------------ dispatch
    def _handle(self, h: _Handler, method: str) -> None:
        with self._lock:
            self._busy.add(h.connection)
        try:
            self._dispatch(h, method)
        finally:
            with self._lock:
                self._busy.discard(h.connection)
            if self.dead:  # answered before the crash: no more on this connection
                h.close_connection = True

    def _dispatch(self, h: _Handler, method: str) -> None:
        if self.dead:
            h.drop()  # no answer: the client sees the connection closed
            return
        path, _, query = h.path.partition("?")
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body: Any = None
        if method in ("POST", "PUT") and raw:
            try:
                body = json.loads(raw)
            except ValueError:
                self._send(h, self.bad_json(raw))
                return
        self.requests.append((method, path, body))
        fault = None
        generating = method in ("POST", "PUT") and path in self.generation_paths
        if generating:
            fault = self._pick_fault(body)
            with self._lock:
                self.in_flight += 1
            h.in_flight = True
        try:
            self._answer(h, method, path, query, body, fault)
        finally:
            self._count_out(h)

    def _count_out(self, h: _Handler) -> None:
        """The request of ``h`` is no longer in flight: called before its answer (or its drop) reaches the client,
        as a real server has finished a request before it writes the response, so a client that sends the next
        request on receiving this one's answer finds the server idle."""
        if getattr(h, "in_flight", False):
            h.in_flight = False
            with self._lock:
                self.in_flight -= 1

    def join_batch(self, window_s: float) -> object:
        """Join the batch being collected and wait ``window_s`` (a scheduler collecting a batch for a
        fixed delay): requests sent together all arrive within the window, however the client's threads
        are scheduled, and each counts the others. Returns the token for :meth:`leave_batch`."""
        token = object()
        with self._batch_lock:
            self._batch[token] = 0
            for t in self._batch:
                self._batch[t] = max(self._batch[t], len(self._batch))
        time.sleep(window_s)
        return token

    def leave_batch(self, token: object) -> int:
        """Leave the batch (at the request's turn at the model): how many requests were in it at once
        at its fullest since this one joined — one at a time is always 1."""
        with self._batch_lock:
            return self._batch.pop(token)

    def _answer(self, h: _Handler, method: str, path: str, query: str, body: Any, fault: str | None) -> None:
        if fault == "die":
            self.dead = True
            # refuse whatever comes next and drop this one unanswered; the requests that came
            # before it (numbered up to die_after) and are being answered still get their answer
            self._stop_listening(spare_busy=True)
            h.drop()
            return
        if fault == "hang":
            self._stopping.wait(self.hang_s)
            self._count_out(h)
            h.drop()
            return
        if fault == "http_500":
            self._send(h, self.error_500())
            return
        if fault == "http_400":
            self._send(h, self.error_400())
            return
        try:
            out = self.route(Request(method, path, query, body, fault))
        except Exception as exc:  # noqa: BLE001 - a bug in the fake must show, as a 500 naming it
            out = Reply(500, "text/plain; charset=utf-8", f"fake server crashed: {type(exc).__name__}: {exc}".encode())
        if fault == "bad_json":
            self._send(h, Reply(out.status, out.content_type, out.payload[: len(out.payload) // 2]))
        elif fault == "close_mid":
            self._send(h, out, cut_at=len(out.payload) // 2)
        elif fault == "trickle":
            self._trickle(h, out)
        else:
            self._send(h, out)

    def _pick_fault(self, body: Any) -> str | None:
        try:
            prompt = [int(t) for t in self.prompt_of(body)]
            limit = int(self.limit_of(body))
        except (TypeError, ValueError, KeyError, AttributeError, IndexError):
            prompt, limit = [], -1  # malformed: the route answers it
        with self._lock:
            self._count += 1
            n = self._count
            if self.die_after is not None and n > self.die_after:
                fault: str | None = "die"
            else:
                fault = next((r.fault for r in self.rules if r.matches(n, prompt, limit)), None)
            self.seen.append(Seen(n, len(prompt), limit, fault))
        return fault

    def _send(self, h: _Handler, reply: Reply, *, cut_at: int | None = None) -> None:
        self._count_out(h)
        h.send_headers(reply, self.extra_headers)
        if cut_at is None:
            h.wfile.write(reply.payload)
            h.wfile.flush()
            return
        h.wfile.write(reply.payload[:cut_at])
        h.wfile.flush()
        h.drop()

    def _trickle(self, h: _Handler, reply: Reply) -> None:
        self._count_out(h)
        h.send_headers(reply)
        h.wfile.flush()
        try:
            for i in range(0, len(reply.payload), 4):
                if self._stopping.wait(self.trickle_s):
                    break
                h.wfile.write(reply.payload[i:i + 4])
                h.wfile.flush()
        except OSError:  # the client gave up
            pass
        h.drop()


def not_found() -> Reply:
    """FastAPI's 404 (SGLang and vLLM)."""
    return json_reply(404, {"detail": "Not Found"})


def refuses(what: str) -> Reply:
    """A request outside what a fake emulates: HTTP 400 starting ``emulator:``, never a silently
    different answer."""
    return json_reply(400, {"error": {"message": f"emulator: {what}"}})
