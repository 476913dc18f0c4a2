"""Forced rejection (``--force-reject``): drive a speculative loop down its reject path on purpose.

A correct loop rolls its state back after a rejected draft: it crops the target's KV cache,
restores recurrent (Mamba/GDN) state, rewinds a grammar. A good draft is rarely rejected outright,
so a rollback bug can hide behind healthy acceptance; forcing the rejects makes every verify step
(``all``) or many of them (``random``) take that path, while the output must stay the target's own
greedy tokens — the normal comparison judges it.

How a reject is forced without running the target twice: the draft token at the chosen depth is
replaced by a *substitute* that differs from the draft's own proposal and is a token the target
never chooses in practice (its padding or mask token, not a stop token). Whenever the draft's
proposal there was the target's choice, which is what a good draft mostly proposes, the
substitute differs from the target's argmax and the verify must reject it; otherwise the verify
decides. The intent is never trusted: the share of verify steps that really took the reject path
is counted from the engine's own step records (:class:`RejectShare`), and ``all`` must reach
:data:`MIN_REJECT_SHARE` of them or the run is refused as a configuration error.

Modes: ``all`` corrupts depth 0 of every draft (every step a full reject); ``random`` corrupts a
depth drawn uniformly from the block with a fixed seed per request (full rejects and partial
accepts, the same on every run and every resume).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

#: ``--force-reject`` values and what each does (the option's help and the docs say it).
FORCE_REJECT_MODES = {
    "all": "every draft wrong on purpose at depth 0: each verify step must reject all of its drafts",
    "random": "one draft token wrong at a random depth (fixed seed per prompt): full rejects and partial accepts",
}
#: Under ``--force-reject all`` at least this share of the verify steps with drafts must have
#: rejected every draft token, else the mode did not do its job and the run is refused.
MIN_REJECT_SHARE = 0.9
#: The seed every request's depth generator starts from (mixed with the request id).
SEED = 20251201


@dataclass(frozen=True)
class ForceReject:
    """The forced-rejection mode of one engine, with the substitute tokens it writes.

    ``substitutes``: tokens the target never chooses in practice, in order of preference (the
    first one that differs from the draft's own token at that depth is written)."""

    mode: str
    substitutes: tuple[int, ...]
    seed: int = SEED

    def __post_init__(self) -> None:
        if self.mode not in FORCE_REJECT_MODES:
            raise ValueError(f"--force-reject {self.mode!r}: expected one of {', '.join(FORCE_REJECT_MODES)}")
        if len(self.substitutes) < 2:
            raise ValueError("forced rejection needs at least two substitute tokens (one may be the draft's own)")

    def for_request(self, request_id: str) -> "DraftCorruptor":
        """The corruptor of one request: its depths depend only on the seed and the request id."""
        return DraftCorruptor(self, random.Random(self.seed ^ zlib.crc32(request_id.encode("utf-8"))))

    @classmethod
    def for_tokenizer(cls, mode: str, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> "ForceReject":
        """Substitutes from the tokenizer's own special tokens that end nothing (padding, mask,
        unknown), then the last ids of the vocabulary as a fallback."""
        stops = set(stop_ids)
        named = [getattr(tokenizer, f"{n}_token_id", None) for n in ("pad", "mask", "unk")]
        specials = list(named) + list(getattr(tokenizer, "all_special_ids", []) or [])
        picks: list[int] = []
        for t in specials + [vocab_size - 1, vocab_size - 2, vocab_size - 3]:
            if t is not None and 0 <= int(t) < vocab_size and int(t) not in stops and int(t) not in picks:
                picks.append(int(t))
        return cls(mode, tuple(picks[:3]))


class DraftCorruptor:
    """Rewrites the drafts of one request, step by step (a loop calls :meth:`corrupt` once per
    verify step, on the tokens it is about to verify)."""

    def __init__(self, spec: ForceReject, rng: random.Random):
        self.spec = spec
        self._rng = rng

    def depth(self, n: int) -> int:
        """Where to corrupt a block of ``n`` draft tokens: 0 under ``all``, uniform under ``random``."""
        return 0 if self.spec.mode == "all" else self._rng.randrange(n)

    def substitute(self, token: int) -> int:
        """A substitute token that differs from ``token`` (the draft's own proposal)."""
        return next(t for t in self.spec.substitutes if t != token)

    def corrupt(self, drafts: Sequence[int]) -> list[int]:
        """The drafts with one token replaced (none to replace: unchanged)."""
        out = list(drafts)
        if out:
            d = self.depth(len(out))
            out[d] = self.substitute(out[d])
        return out


@dataclass(frozen=True)
class RejectShare:
    """What forced rejection achieved, counted from what the engine reported.

    ``steps``: verify steps that verified at least one draft token; ``rejected``: of those, steps
    that accepted none; ``partial``: steps that accepted some but not all. Engines with totals
    only report no steps (``per_step`` False): ``proposed`` / ``accepted`` are their totals."""

    mode: str
    steps: int = 0
    rejected: int = 0
    partial: int = 0
    proposed: int = 0
    accepted: int = 0
    per_step: bool = True

    @classmethod
    def counted(cls, mode: str, coverage: Any, activity: Any) -> "RejectShare":
        """From a run's :class:`~specparity.model.coverage.Coverage` (per-step kinds) and its
        :class:`~specparity.model.gate_run.Activity` (totals, for engines without step records)."""
        if coverage.requests_with_steps:
            kinds = coverage.kinds
            return cls(mode, kinds["none"] + kinds["partial"] + kinds["all"], kinds["none"], kinds["partial"],
                       activity.proposed, activity.accepted)
        return cls(mode, proposed=activity.proposed, accepted=activity.accepted, per_step=False)

    @property
    def share(self) -> float | None:
        return self.rejected / self.steps if self.steps else None

    def describe(self) -> str:
        """One line for the summary and the terminal."""
        if not self.per_step:
            return (f"--force-reject {self.mode}: {self.accepted}/{self.proposed} draft tokens accepted "
                    "(the engine reports totals only)")
        if not self.steps:
            return f"--force-reject {self.mode}: no verify step with draft tokens"
        line = (f"--force-reject {self.mode}: {self.rejected}/{self.steps} verify steps with drafts rejected every "
                f"draft token ({self.rejected / self.steps:.0%})")
        if self.mode == "random" or self.partial:
            line += f", {self.partial} partial accept(s)"
        return line

    def problem(self) -> str | None:
        """Why the mode did not do its job (``all`` only: ``random`` is counted, never judged), or None."""
        if self.mode != "all":
            return None
        if not self.per_step:
            if self.proposed and self.accepted == 0:
                return None
            if not self.proposed:
                return "--force-reject all: the engine proposed no draft token, so no reject was forced"
            return (f"--force-reject all: {self.accepted} of {self.proposed} draft tokens were accepted (expected none): "
                    "the engine did not force the rejects")
        if not self.steps:
            return "--force-reject all: no verify step with draft tokens, so no reject was forced"
        if self.rejected / self.steps < MIN_REJECT_SHARE:
            return (f"--force-reject all: only {self.rejected}/{self.steps} verify steps ({self.rejected / self.steps:.0%}) "
                    f"rejected every draft token, fewer than {MIN_REJECT_SHARE:.0%}: the mode did not do its job")
        return None
