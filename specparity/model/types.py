"""Data that crosses module lines: requests, per-token scores, generation results, fingerprints.

Token-level data is kept in numpy arrays rather than lists of small objects because the comparison
must handle 128K-token outputs in well under a second (see ``benchmarks/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from specparity.model.constraints import Constraint

FinishReason = Literal["stop", "length", "error"]

#: The default number of alternatives recorded per output position (``--top-k``), and the fewest a
#: run may record: a near tie is judged from the alternatives beside the chosen token.
DEFAULT_TOP_K = 8
MIN_TOP_K = 5


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to decode greedily. ``stop_token_ids`` end generation (the stop token is kept).
    ``constraint``: the output constraint the engine must apply (None: unconstrained); an engine that
    cannot apply one is refused before it loads, never run unconstrained."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = DEFAULT_TOP_K
    constraint: Constraint | None = None


def _rows(arr: np.ndarray, n: int) -> np.ndarray:
    """Reshape to ``[n, k]``; an empty array keeps its k (``reshape(0, -1)`` is ambiguous)."""
    if arr.ndim == 2 and arr.shape[0] == n:
        return arr
    return arr.reshape(n, -1) if n else arr.reshape(0, arr.shape[-1] if arr.ndim == 2 else 0)


@dataclass
class TokenScores:
    """The target's view of a token stream, one row per output position.

    ``logprobs[i]`` is the log-probability (nats, full-vocab log-softmax) of ``token_ids[i]``;
    ``top_ids[i]`` / ``top_logprobs[i]`` are the k most likely tokens at that position, sorted by
    descending logprob. Logprobs are always computed in float32 from the engine's logits, whatever
    the model dtype, so margins are comparable across runs.
    """

    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n]
    top_ids: np.ndarray  # int64 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64).reshape(-1)
        n = self.token_ids.shape[0]
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32).reshape(n)
        self.top_ids = _rows(np.asarray(self.top_ids, dtype=np.int64), n)
        self.top_logprobs = _rows(np.asarray(self.top_logprobs, dtype=np.float32), n)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.top_ids.shape[1])

    @classmethod
    def empty(cls, k: int = DEFAULT_TOP_K) -> "TokenScores":
        return cls(
            np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
        )

    def logprob_of(self, position: int, token_id: int) -> float | None:
        """Logprob of ``token_id`` at ``position`` if recorded (None: outside the recorded
        alternatives, or a row the engine did not report — NaN)."""
        if token_id == int(self.token_ids[position]) and np.isfinite(self.logprobs[position]):
            return float(self.logprobs[position])
        hits = np.nonzero(self.top_ids[position] == token_id)[0]
        if hits.size and np.isfinite(self.top_logprobs[position, hits[0]]):
            return float(self.top_logprobs[position, hits[0]])
        return None

    def reported(self, position: int) -> bool:
        """Whether the engine reported this position's row (engines may leave rows out: NaN)."""
        return bool(np.isfinite(self.logprobs[position]))

    def unreported_positions(self) -> np.ndarray:
        """Positions the engine left out by the protocol: no real alternative (``top_ids`` all −1).
        Allowed (llama.cpp drops byte-piece rows and keeps none for accepted drafts), and counted."""
        return np.flatnonzero(~(self.top_ids >= 0).any(axis=1)) if len(self) else np.zeros(0, np.int64)

    def nonfinite_positions(self) -> np.ndarray:
        """Positions whose row is reported (a real id among ``top_ids``) but carries a NaN or ±inf
        logprob — for an alternative with a real id, or for the row's own token (unless that token
        is marked not scored, id −1). Not an unreported row: a numeric failure of the engine."""
        if not len(self):
            return np.zeros(0, np.int64)
        real = self.top_ids >= 0
        with np.errstate(invalid="ignore"):
            bad_alt = (real & ~np.isfinite(self.top_logprobs)).any(axis=1)
            bad_own = real.any(axis=1) & (self.token_ids >= 0) & ~np.isfinite(self.logprobs)
        return np.flatnonzero(bad_alt | bad_own)

    def rank_of(self, position: int, token_id: int) -> int | None:
        """0-based rank of ``token_id`` among the top-k at ``position`` (None: outside the top-k)."""
        hits = np.nonzero(self.top_ids[position] == token_id)[0]
        return int(hits[0]) if hits.size else None

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids.tolist(),
            "logprobs": exact_floats(self.logprobs),
            "top_ids": self.top_ids.tolist(),
            "top_logprobs": [exact_floats(row) for row in self.top_logprobs],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TokenScores":
        k = len(data["top_ids"][0]) if data["top_ids"] else DEFAULT_TOP_K
        if not data["token_ids"]:
            return cls.empty(k)
        return cls(data["token_ids"], data["logprobs"], data["top_ids"], data["top_logprobs"])


def exact_floats(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to the very same float32 (NaN and ±inf
    kept). A journal's rows must be the rows the run judged and calibrated on: a noise of 3e-5 nats
    (float32 logits) rounded to 6 decimals would move a threshold measured again from the journal
    (``specparity merge``) by several percent, and with it a near tie at the edge."""
    return [float(str(v)) for v in np.asarray(values, dtype=np.float32)]


def accept_length(emitted: int, verify_steps: int) -> float | None:
    """specparity's accept length: tokens emitted by verify steps per verify step, bonus included.

    The one definition every count in a report uses (see the counter contract in
    :mod:`specparity.engines.base`). It leaves out the token a plain prefill produces before any
    draft exists, so it is SGLang's ``spec_accept_length`` (``completion_tokens / spec_verify_ct``,
    which counts that token) minus ``1 / verify_steps``, and vLLM's ``1 + accepted / drafts`` when no
    block is cut.
    """
    return emitted / verify_steps if verify_steps else None


@dataclass
class StepRecord:
    """One verify step of a speculative loop; the contract is pinned in :mod:`specparity.engines.base`
    (build records with :func:`specparity.engines.base.step_record`)."""

    proposed: int
    accepted: int
    emitted: int
    cut: Literal["limit", "stop"] | None = None


@dataclass
class SpecStats:
    """Speculation counters of one request, or an explicit "not available".

    Engines that can observe each verify step fill ``steps``; engines that only expose totals (a
    server's metrics) fill the totals and leave ``steps`` as None.
    """

    available: bool
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    steps: list[StepRecord] | None = None
    source: str = ""  # where the numbers come from, e.g. "instrumented candidate generator"

    @classmethod
    def unavailable(cls, why: str) -> "SpecStats":
        return cls(available=False, source=why)

    @classmethod
    def from_steps(cls, steps: list[StepRecord], source: str) -> "SpecStats":
        return cls(
            available=True,
            proposed=sum(s.proposed for s in steps),
            accepted=sum(s.accepted for s in steps),
            verify_steps=len(steps),
            steps=steps,
            source=source,
        )

    @property
    def emitted(self) -> int:
        """Tokens the verify steps appended: summed from the steps, or — for an engine that reports
        totals only — one correction/bonus per verify step on top of the accepted drafts."""
        if self.steps is not None:
            return sum(s.emitted for s in self.steps)
        return self.accepted + self.verify_steps

    @property
    def mean_accept_length(self) -> float | None:
        """:func:`accept_length` of this request."""
        return accept_length(self.emitted, self.verify_steps) if self.available else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "available": self.available,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "verify_steps": self.verify_steps,
            "source": self.source,
        }
        if self.steps is not None:
            out["steps"] = [[s.proposed, s.accepted, s.emitted, s.cut] for s in self.steps]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "SpecStats":
        steps = data.get("steps")
        return cls(
            available=data["available"],
            proposed=data.get("proposed", 0),
            accepted=data.get("accepted", 0),
            verify_steps=data.get("verify_steps", 0),
            steps=[StepRecord(*s) for s in steps] if steps is not None else None,
            source=data.get("source", ""),
        )


@dataclass
class GenerationResult:
    """What an engine returns for one request, speculative or not.

    ``scores`` holds, for every output position, the logprob of the chosen token and the top-k
    alternatives as the engine computed them while decoding (for a speculative run: from the
    verify pass). ``error`` is set when the request failed; the other fields are then partial.

    ``facts``: what the server said about how it served the request, where it says it —
    ``prompt_tokens`` (its own count), ``cached_tokens`` (prompt tokens found in its prefix cache),
    ``preemptions`` (times the request was preempted or retracted before it finished) — journalled
    with the answer; the configuration arms prove their condition from them.
    """

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    scores: TokenScores
    spec: SpecStats
    wall_s: float = 0.0
    error: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "request_id": self.request_id,
            "output_ids": list(self.output_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "scores": self.scores.to_json(),
            "spec": self.spec.to_json(),
            "wall_s": round(self.wall_s, 6),
            "error": self.error,
        }
        if self.facts:
            out["facts"] = dict(self.facts)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GenerationResult":
        return cls(
            request_id=data["request_id"],
            output_ids=list(data["output_ids"]),
            text=data["text"],
            finish_reason=data["finish_reason"],
            scores=TokenScores.from_json(data["scores"]),
            spec=SpecStats.from_json(data["spec"]),
            wall_s=data.get("wall_s", 0.0),
            error=data.get("error"),
            facts=dict(data.get("facts") or {}),
        )

    @classmethod
    def failed(cls, request_id: str, error: str) -> "GenerationResult":
        return cls(request_id, [], "", "error", TokenScores.empty(), SpecStats.unavailable("request failed"), error=error)


@dataclass(frozen=True)
class ArtifactId:
    """A model or draft: where it came from and a content hash of its weights and config."""

    path: str
    sha256: str
    kind: str = ""  # e.g. "Qwen3ForCausalLM", "DFlash2DraftModel", "prompt-lookup"


@dataclass
class Fingerprint:
    """Everything that decides an engine's numerics; goldens are keyed by it."""

    engine: str
    engine_version: str
    target: ArtifactId
    draft: ArtifactId | None
    dtype: str
    spec_config: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "target": vars(self.target),
            "draft": vars(self.draft) if self.draft else None,
            "dtype": self.dtype,
            "spec_config": self.spec_config,
            "extra": self.extra,
        }

    def unknown_spec_config(self) -> list[str]:
        """The speculative settings this fingerprint could not read, as ``key: value`` (a server the
        gate did not launch and that does not show its configuration says ``unknown …``). Two equal
        fingerprints with an unknown part prove nothing about what the servers speculate with."""
        return [f"{key}: {value}" for key, value in sorted(self.spec_config.items())
                if isinstance(value, str) and value.startswith("unknown")]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Fingerprint":
        draft = data.get("draft")
        return cls(data["engine"], data["engine_version"], ArtifactId(**data["target"]),
                   ArtifactId(**draft) if draft else None, data["dtype"], data.get("spec_config", {}),
                   data.get("extra", {}))
