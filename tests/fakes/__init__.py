"""Fake inference servers for the tests: llama.cpp, SGLang and vLLM over HTTP, and their faults.

No GPU runs here, so the HTTP adapters in ``specparity/engines/`` are exercised end to end against
these. Every fake is a :class:`~fakes.server.FakeServer` — a threading HTTP server on 127.0.0.1 on a
free port, with start/stop or a ``with`` block, connection tracking and a clean stop — plus one
protocol router:

* :class:`~fakes.llamacpp.LlamaCppServer`: ``llama-server``, answering from the captured bodies of
  ``tests/data/llamacpp/`` (:mod:`fakes.replay`, no torch);
* :class:`~fakes.sglang.SGLangServer` and :class:`~fakes.vllm.VLLMServer`: SGLang and vLLM,
  computing every token, logprob and speculation counter with the committed fixture models
  (:mod:`fakes.backend`).

Every fault of :data:`~fakes.faults.FAULTS` is available on every protocol: ``rules=[Rule(fault,
requests=…, prompt=…, from_request=…)]`` picks the generation requests it hits, ``die_after=N``
drops the N+1-th and stops listening (a crash), ``refuse=True`` binds the port and never listens::

    with SGLangServer() as base, SGLangServer(speculative=True, rules=[Rule("close_mid", requests={3})]) as spec:
        ... --baseline-url base.url --spec-url spec.url
"""

from fakes.faults import FAULTS, Rule, Seen
from fakes.llamacpp import LlamaCppServer
from fakes.server import FakeServer
from fakes.sglang import SGLangServer
from fakes.vllm import VLLMServer

__all__ = ["FAULTS", "FakeServer", "LlamaCppServer", "Rule", "SGLangServer", "Seen", "VLLMServer"]
