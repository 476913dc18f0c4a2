"""Which shard of a run a prompt belongs to, and what each shard's journal says it was given.

A run split over machines (``--shard I/N``: a Kubernetes Indexed Job, a Slurm array, the Ray face)
must put every prompt in exactly one shard, the same one on every machine and whatever the order of
the prompt files, so that a prompt always meets the same server pair and the merged journals cover
the prompts once. The shard is therefore a pure function of the prompt id (:func:`shard_of`): a
SHA-256 of the id, which is independent of the CRC-32 that spreads one shard's prompts over its own
fleet of URLs (:func:`specparity.engines.server.wire.shard_index`) — the same hash for both would send
every prompt of a shard to one server of its fleet.

Each shard's journal names what the whole run was (:class:`ShardPlan`: every selected prompt id and
every calibration prompt id, in order) and which of them this journal ran, so
:mod:`specparity.run.merge` can refuse a merge that misses or repeats a prompt, and measure the
threshold on the union of the shards' noise exactly as one unsharded run would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

#: How :func:`shard_of` hashes (journalled, so a merge refuses journals split by another rule).
SHARD_HASH = "sha256-u64"
#: A journal's part: the shard's own run, or a rerun of what a lost server pair left unfinished.
PARTS = ("shard", "retry")


class ShardError(ValueError):
    """A ``--shard`` value that is not ``I/N`` with ``0 <= I < N``; the message is one line."""


def shard_of(prompt_id: str, count: int) -> int:
    """The shard (0 … ``count`` − 1) of ``prompt_id``: the first 8 bytes of its SHA-256, big-endian,
    modulo ``count``."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (counted from 0, as ``JOB_COMPLETION_INDEX`` and ``NEL_SHARD_IDX`` are)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str, flag: str = "--shard") -> "Shard":
        head, sep, tail = str(text).strip().partition("/")
        try:
            index, count = int(head), int(tail)
        except ValueError:
            index = count = -1
        if not sep or count < 1 or not 0 <= index < count:
            raise ShardError(f"{flag} {text}: expected I/N with 0 <= I < N (the shard index counted from 0 and the "
                             f"number of shards, e.g. 0/4 … 3/4)")
        return cls(index, count)

    def holds(self, prompt_id: str) -> bool:
        return shard_of(prompt_id, self.count) == self.index

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def to_json(self) -> dict[str, int]:
        return {"index": self.index, "count": self.count}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "Shard | None":
        return cls(int(data["index"]), int(data["count"])) if data else None


@dataclass
class ShardPlan:
    """What one journal of a sharded run was given (its ``shard`` line).

    ``prompts`` and ``calibration`` are the whole run's — every selected prompt id and every
    calibration prompt id (None: the noise is measured on the selected prompts), in prompt-file
    order — the same in every shard, so a merge can name what no journal holds. ``runs`` and
    ``calibrates`` are the ids this journal ran: its shard's share, or, for a ``retry`` part, what a
    lost server pair left unfinished."""

    shard: Shard
    prompts: list[str]
    calibration: list[str] | None
    runs: list[str] = field(default_factory=list)
    calibrates: list[str] = field(default_factory=list)
    part: str = "shard"
    hash: str = SHARD_HASH
    #: A ``retry`` part: how the pair it replaces was lost, in words.
    cause: str = ""
    #: A ``retry`` part whose pair was lost because one of its servers exited (not its node or worker): a
    #: prompt that pair judged ``error`` keeps that verdict in the merge, the rerun's shown beside it — a
    #: server that crashes under speculation is a finding, never rerun away.
    keep_errors: bool = False

    @classmethod
    def of(cls, shard: Shard, prompts: Sequence[str], calibration: Sequence[str] | None) -> "ShardPlan":
        """The shard's own part: its share of the selected and of the calibration prompts."""
        runs = [pid for pid in prompts if shard.holds(pid)]
        calibrates = [pid for pid in (calibration or []) if shard.holds(pid)]
        return cls(shard, list(prompts), list(calibration) if calibration is not None else None, runs, calibrates)

    def retry(self, runs: Sequence[str], calibrates: Sequence[str], cause: str = "",
              keep_errors: bool = False) -> "ShardPlan":
        """A rerun of ``runs`` and ``calibrates`` of this shard on another server pair (``cause``: how the pair
        was lost; ``keep_errors``: a server of it exited, so its ``error`` verdicts stand)."""
        return ShardPlan(self.shard, self.prompts, self.calibration, list(runs), list(calibrates), "retry", self.hash,
                         cause, keep_errors)

    def describe(self) -> str:
        """What this journal is a part of, in words (the summary's "Fleet" line)."""
        if self.part == "retry":
            cal = f" and {len(self.calibrates)} calibration prompt(s)" if self.calibration is not None else ""
            why = f" ({self.cause})" if self.cause else ""
            kept = ("; the prompts that pair judged error keep that verdict, this rerun's shown beside it"
                    if self.keep_errors else "")
            return (f"a rerun, on another server pair, of {len(self.runs)} selected prompt(s){cal} of shard "
                    f"{self.shard.label} that a lost server pair left unfinished{why}{kept}")
        cal = (f" and {len(self.calibrates)} of its {len(self.calibration)} calibration prompt(s)"
               if self.calibration is not None else "")
        return (f"shard {self.shard.label}: {len(self.runs)} of the run's {len(self.prompts)} selected prompt(s){cal}; "
                f"this verdict is the shard's own, on its share of the noise — `specparity merge` of every shard's "
                f"report gives the run's")

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard.to_json(), "part": self.part, "hash": self.hash, "prompts": self.prompts,
                "calibration": self.calibration, "runs": self.runs, "calibrates": self.calibrates,
                "cause": self.cause, "keep_errors": self.keep_errors}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardPlan":
        shard = Shard.from_json(data["shard"])
        assert shard is not None
        calibration = data.get("calibration")
        return cls(shard, list(data["prompts"]), list(calibration) if calibration is not None else None,
                   list(data.get("runs", [])), list(data.get("calibrates", [])), data.get("part", "shard"),
                   data.get("hash", SHARD_HASH), str(data.get("cause", "")), bool(data.get("keep_errors", False)))
