"""The request body each server adapter sends, as one function per adapter that both the adapter's
``complete()`` and the reproducers (:mod:`specparity.report.reproducers`) call.

A reproducer must send exactly what the gate sent, so the body is built in one place: each adapter
module declares ``WIRE = WireFormat(path, body)``, where ``body(request, facts)`` turns a
:class:`~specparity.model.types.GenerationRequest` and the server facts the adapter reads once per
endpoint (vLLM's served model name and its "no top-k" value; nothing for llama.cpp) into the JSON
body. The facts of every endpoint are journalled on the run line (``wire``), so the body can be
rebuilt from the journal alone, long after the servers are gone.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from specparity.model.types import GenerationRequest

#: ``body(request, facts) -> JSON body`` of one greedy generation request.
BodyBuilder = Callable[[GenerationRequest, Mapping[str, Any]], dict[str, Any]]
#: ``score(prompt ids, continuation ids, top_k, facts) -> JSON body`` of one teacher-forced scoring request
#: (posted to the same path): the continuation's rows read from one prefill of prompt + continuation.
ScoreBuilder = Callable[[Sequence[int], Sequence[int], int, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class WireFormat:
    """Where an adapter posts a generation request and how it builds the body. ``per_request``: body
    fields the adapter sets afresh for every request (SGLang's ``rid``), which a reproducer leaves out.
    ``score``: the body of its teacher-forced scoring request, for an adapter that scores a whole
    continuation in one request (None: llama.cpp scores one request per position)."""

    path: str
    body: BodyBuilder
    per_request: tuple[str, ...] = ()
    score: ScoreBuilder | None = None


def replayed(wire: WireFormat, role: str, build: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A body one of ``wire``'s builders makes from journalled facts, without the fields set afresh per
    request (what a reproducer sends); ValueError naming the fact a journal from before reproducers lacks."""
    try:
        body = build(*args)
    except KeyError as exc:
        raise ValueError(f"the journal lacks the {role} server's {exc} (recorded before reproducers existed)") from None
    return {k: v for k, v in body.items() if k not in wire.per_request}


def shard_index(request_id: str, n: int) -> int:
    """Which of ``n`` servers of one side serves ``request_id`` (:meth:`~specparity.engines.server.http.Fleet.pick`):
    a stable hash, so a reproducer names the same server the run used."""
    return zlib.crc32(request_id.encode()) % n


def wire_format(engine: str) -> WireFormat | None:
    """The :class:`WireFormat` the server engine ``engine`` (a registered name or a ``module:factory`` spec)
    declares in its factory's module (``WIRE``); None: not a server engine, or one that declares none."""
    import sys

    from specparity.engines import INPROCESS_ENGINES, EngineLoadError, engine_info, resolve_factory

    if engine in INPROCESS_ENGINES:
        return None  # a built-in in-process engine: no wire format, and no reason to import torch to say so
    try:
        factory = resolve_factory(engine)
    except EngineLoadError:
        return None
    info = engine_info(factory)
    module = sys.modules.get(getattr(factory, "__module__", "") or "")
    wire = getattr(module, "WIRE", None) if info is not None and info.server else None
    return wire if isinstance(wire, WireFormat) else None
