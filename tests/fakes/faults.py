"""The faults a fake server injects, and the rules that choose the requests they hit.

Every fault is available on every protocol. The transport and status faults are the same bytes
for each (the protocol only shapes the error bodies); the content faults break the one part of
an answer the adapter must check, in each protocol's own fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

#: fault name -> what the server does to a generation request it hits
FAULTS = {
    # transport and status: the same on every protocol
    "hang": "read the request, never answer (until the server stops or hang_s passes), then close",
    "trickle": "answer the headers at once, then the body a few bytes every trickle_s (each read is quick, the "
               "whole answer takes minutes)",
    "http_500": "HTTP 500 with the protocol's error body",
    "http_400": "HTTP 400 with the protocol's error body (llama.cpp: the captured 'Prompt contains invalid tokens')",
    "bad_json": "HTTP 200 whose body is the real answer cut in half (malformed JSON)",
    "close_mid": "send the headers and half the body, then close the connection",
    "die": "drop this request without an answer and stop listening (a crash)",
    # content: the answer's own fields are wrong
    "no_timings": "a valid answer without its speculation counters (llama.cpp 'timings', SGLang "
                  "'meta_info.spec_*', vLLM 'metrics')",
    "accepted_gt_drafted": "more draft tokens accepted than drafted (llama.cpp timings.draft_n_accepted, SGLang "
                           "spec_num_correct_drafts, vLLM num_accepted_draft_tokens / spec_decode counters)",
    "short_limit": "finish 'length' with fewer tokens than the request allowed",
    "bad_prob_ids": "the last logprob row names a token that is not the answer's (llama.cpp "
                    "completion_probabilities id, SGLang output_token_logprobs id, vLLM logprobs.tokens)",
}


@dataclass
class Rule:
    """When to misbehave: every condition given must hold (none given: every generation request).

    ``requests``: 1-based numbers of this server's generation requests (llama.cpp ``/completion``,
    SGLang ``/generate``, vLLM ``/v1/completions``; scoring requests are generation requests too);
    ``prompt``: token ids a request's prompt starts with (so the prompt's scoring requests match
    too); ``from_request``: every request from that number on; ``n_predict``: requests asking for
    that many tokens (with ``prompt``: the prompt's generation, not its one-token scoring requests).
    """

    fault: str
    requests: Iterable[int] | None = None
    prompt: Sequence[int] | None = None
    from_request: int | None = None
    n_predict: int | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}: expected one of {', '.join(FAULTS)}")
        self.requests = None if self.requests is None else frozenset(int(n) for n in self.requests)
        self.prompt = None if self.prompt is None else tuple(int(t) for t in self.prompt)

    def matches(self, n: int, prompt: Sequence[int], n_predict: int = -1) -> bool:
        if self.requests is not None and n not in self.requests:
            return False
        if self.from_request is not None and n < self.from_request:
            return False
        if self.prompt is not None and tuple(prompt[: len(self.prompt)]) != self.prompt:
            return False
        if self.n_predict is not None and n_predict != self.n_predict:
            return False
        return True


@dataclass
class Seen:
    """One generation request as the server saw it (``n_predict``: the token limit it asked for)."""

    n: int
    prompt_len: int
    n_predict: int
    fault: str | None
    at: float = field(default_factory=time.monotonic)
