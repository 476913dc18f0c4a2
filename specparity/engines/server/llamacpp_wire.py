"""llama-server's wire format: the ``/completion`` body the adapter sends (and a reproducer sends again) and the
parser of ``completion_probabilities``. What each field means, and the version it was read in, is in
:mod:`specparity.engines.server.llamacpp`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from specparity.engines.server.wire import WireFormat
from specparity.model.types import GenerationRequest, TokenScores


def parse_probabilities(rows: Sequence[dict[str, Any]], token_ids: Sequence[int], k: int) -> TokenScores:
    """``completion_probabilities`` → :class:`TokenScores`, rows aligned to tokens by id.

    A token without a row (dropped by the server: an incomplete UTF-8 piece) or with an empty one
    (accepted from a draft: ``logprob 0.0``, no alternatives) is *not reported*: NaN, never a
    probability of 1. A row that matches no later token is a malformed answer (ValueError)."""
    n = len(token_ids)
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    cursor = 0
    for r, row in enumerate(rows):
        tid = int(row["id"])
        while cursor < n and int(token_ids[cursor]) != tid:
            cursor += 1  # tokens the server kept no row for
        if cursor >= n:
            raise ValueError(f"completion_probabilities[{r}].id {tid} matches no remaining token")
        alts = row.get("top_logprobs") or []
        if alts:
            logprobs[cursor] = float(row["logprob"])
            for j, alt in enumerate(alts[:k]):
                top_ids[cursor, j] = int(alt["id"])
                top_lp[cursor, j] = float(alt["logprob"])
        cursor += 1
    return TokenScores(np.asarray(token_ids, np.int64), logprobs, top_ids, top_lp)


def completion_body(prompt: Sequence[int], n_predict: int, k: int) -> dict[str, Any]:
    """A greedy ``/completion`` body with ``k`` alternatives per position (generation and scoring)."""
    return {"prompt": list(prompt), "n_predict": n_predict, "temperature": 0, "n_probs": k,
            "cache_prompt": False, "return_tokens": True}


def request_body(req: GenerationRequest, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/completion`` body of one generation request; the same on both sides (``facts``: none)."""
    body = completion_body(req.prompt_ids, req.max_new_tokens, req.top_k)
    if req.constraint is not None:  # the same field on both sides: json_schema (object) or grammar (GBNF)
        body[req.constraint.kind] = req.constraint.value()
    return body


WIRE = WireFormat("/completion", request_body)
