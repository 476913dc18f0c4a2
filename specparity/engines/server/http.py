"""HTTP for server engines: bounded, thread-safe, and every failure named.

One :class:`Endpoint` per server URL, built on a urllib3 ``PoolManager`` (thread-safe, unlike a
shared ``requests.Session``) so the runner can keep many requests in flight. Every request has a
connect and a read timeout, and the whole answer must arrive within the read timeout (a server that
trickles its body is cut off too) — no request loop runs unbounded — and only *connection* failures are
retried (a refused connection never reached the server; a read timeout may have, and greedy
generation is replayed only by the gate's own re-run, never silently). Every failure becomes a
:class:`ServerError` whose message says what happened (refused, timed out, HTTP status and body,
malformed JSON), which the engine turns into an ``error`` result for that prompt.

A :class:`Fleet` is the endpoints of one role (baseline or speculative): requests are sharded over
them by request id, and an endpoint that fails at the transport level ``dead_after`` times in a row
is marked dead, so a server that died mid-run fails the remaining prompts at once, with the cause,
instead of waiting out a timeout per prompt.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import urlsplit

import urllib3
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import MaxRetryError, NewConnectionError, ProtocolError, ReadTimeoutError
from urllib3.util import Retry, Timeout

from specparity.engines.server.wire import shard_index

DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 300.0
#: Consecutive transport failures after which an endpoint is considered dead.
DEAD_AFTER = 3


class ServerError(RuntimeError):
    """A request that did not produce a usable answer. ``transport`` is True when the server could
    not be reached or did not answer (refused, reset, timed out) as opposed to answering badly."""

    def __init__(self, message: str, *, transport: bool = False, status: int | None = None):
        super().__init__(message)
        self.transport = transport
        self.status = status


def check_url(flag: str, url: str) -> str:
    """``http(s)://host:port[/prefix]``, normalised without a trailing slash; ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} {url!r}: expected http://host:port")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise ValueError(f"{flag} {url!r}: malformed port") from None
    return url.rstrip("/")


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str

    def json(self, what: str) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            snippet = self.body[:200].decode("utf-8", "replace")
            raise ServerError(f"{what}: malformed JSON in the response ({snippet!r})") from None


class Endpoint:
    """One server: ``get``/``post`` with timeouts, connection retries and named failures."""

    def __init__(self, base_url: str, *, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, connect_retries: int = 2,
                 dead_after: int = DEAD_AFTER, maxsize: int = 16):
        self.base_url = base_url.rstrip("/")
        self.timeout = Timeout(connect=connect_timeout_s, read=read_timeout_s)
        retry = Retry(total=connect_retries, connect=connect_retries, read=0, status=0, other=0,
                      backoff_factor=0.2, allowed_methods=None, raise_on_status=False)
        self._pool = urllib3.PoolManager(maxsize=maxsize, block=False, retries=retry, timeout=self.timeout)
        self._lock = threading.Lock()
        self._failures = 0
        self._dead_after = dead_after
        self.dead_reason: str | None = None

    def __repr__(self) -> str:
        return f"Endpoint({self.base_url})"

    # ------------------------------------------------------------------ requests
    def request(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None,
                expect: Sequence[int] = (200,)) -> Response:
        if self.dead_reason is not None:
            raise ServerError(f"{self.base_url} is marked dead ({self.dead_reason})", transport=True)
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        timeout = self.timeout if timeout_s is None else Timeout(connect=self.timeout.connect_timeout, read=timeout_s)
        started = time.monotonic()
        try:
            r = self._pool.request(method, url, body=data, headers=headers, timeout=timeout, preload_content=False)
            payload = _read_body(r, url, started + (timeout.read_timeout or DEFAULT_READ_TIMEOUT_S))
        except (MaxRetryError, NewConnectionError, ProtocolError, ReadTimeoutError, Urllib3Error, OSError) as exc:
            raise self._transport_failure(method, path, exc, timeout.read_timeout) from None
        self._ok()
        resp = Response(r.status, payload, r.headers.get("Content-Type", ""))
        if r.status not in expect:
            snippet = resp.body[:300].decode("utf-8", "replace").strip()
            raise ServerError(f"{method} {path}: HTTP {r.status} from {self.base_url}: {snippet or '(empty body)'}",
                              status=r.status)
        return resp

    def post_json(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("POST", path, body, **kw).json(f"POST {self.base_url}{path}")

    def get_json(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw).json(f"GET {self.base_url}{path}")

    # ------------------------------------------------------------------ failure accounting
    def _transport_failure(self, method: str, path: str, exc: BaseException, read_timeout: float | None) -> ServerError:
        cause = exc.reason if isinstance(exc, MaxRetryError) and exc.reason is not None else exc
        if isinstance(cause, (ReadTimeoutError, TimeoutError)) or "timed out" in str(cause).lower():
            what = f"timed out after {read_timeout:g} s" if read_timeout is not None else "timed out"
        elif isinstance(cause, (NewConnectionError, ConnectionRefusedError)) or "refused" in str(cause).lower():
            what = "connection refused"
        elif isinstance(cause, ProtocolError) or "closed" in str(cause).lower() or "reset" in str(cause).lower():
            what = "connection closed by the server mid-request"
        else:
            what = f"{type(cause).__name__}: {cause}"
        message = f"{method} {self.base_url}{path}: {what}"
        with self._lock:
            self._failures += 1
            if self._failures >= self._dead_after and self.dead_reason is None:
                self.dead_reason = f"{self._failures} consecutive transport failures, last: {what}"
        return ServerError(message, transport=True)

    def _ok(self) -> None:
        with self._lock:
            self._failures = 0

    def close(self) -> None:
        self._pool.clear()


def _read_body(r: urllib3.BaseHTTPResponse, url: str, deadline: float) -> bytes:
    """The whole body, by the deadline: the read timeout bounds each socket read, so a server that
    trickles its answer a few bytes at a time would otherwise hold the request forever."""
    chunks = []
    try:
        while chunk := r.read1(1 << 16):
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise ReadTimeoutError(None, url, "timed out: the answer was still arriving")  # type: ignore[arg-type]
    except BaseException:
        r.close()  # never hand a half-read connection back to the pool
        raise
    r.release_conn()
    return b"".join(chunks)


class Fleet:
    """The endpoints of one role; a request always goes to the same endpoint (sharded by its id)."""

    def __init__(self, role: str, endpoints: Sequence[Endpoint]):
        if not endpoints:
            raise ValueError(f"no {role} endpoint")
        self.role = role
        self.endpoints = list(endpoints)

    def pick(self, request_id: str) -> Endpoint:
        return self.endpoints[shard_index(request_id, len(self.endpoints))]

    @property
    def urls(self) -> list[str]:
        return [e.base_url for e in self.endpoints]

    def close(self) -> None:
        for e in self.endpoints:
            e.close()
