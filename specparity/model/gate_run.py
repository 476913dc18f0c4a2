"""Run-level data: a gate run's configuration, its per-prompt records and its counters.

These types cross the run, policy and report layers (``runner`` fills them, ``gate`` judges them,
``report`` renders them), so they live here, below all three, with no logic beyond summing.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any

from specparity.model.verdicts import Verdict
from specparity.model.coverage import Coverage
from specparity.model.threshold import DEFAULT_CEILING_NATS, NearTieThreshold
from specparity.model.prompts import Prompt
from specparity.model.replay import Replay
from specparity.model.shards import Shard
from specparity.model.types import DEFAULT_TOP_K, MIN_TOP_K, Fingerprint, GenerationRequest, GenerationResult, SpecStats, TokenScores, accept_length

DEFAULT_MAX_NEW_TOKENS = 48
#: The fixed near-tie share applied where no flip rate was measured (a record made before the
#: budget followed the data, a threshold set by hand with nothing measured).
DEFAULT_MAX_NEAR_TIE = 0.25
DRIFT_POLICIES = ("fail", "warn")
#: What a finding about the gate's own measurement does (:mod:`specparity.gate.calibration_findings`).
FINDING_POLICIES = ("warn", "fail")


@dataclass
class GatePolicy:
    """What a run must show to pass (applied by :func:`specparity.gate.decision.decide`), apart from how it runs.

    ``bit_exact``: whether a near tie fails — ``None`` (the default, "auto"): exactly when the engine
    declares deterministic / batch-invariant inference for both sides (``GateRun.deterministic``;
    :func:`specparity.gate.decision.bit_exact` is the one rule); ``True`` (``--bit-exact``): always;
    ``False`` (``--allow-near-tie``): never, even when the engine declares determinism.
    ``max_near_tie``: an explicit fraction of near-tie prompts allowed (``--max-near-tie``); None (the
    default): the budget follows the data — near-tie flips that are not exact ties may not clearly
    exceed what the baseline's own numerics predict (:mod:`specparity.judge.flip_budget`), and exact
    ties are allowed (greedy decoding permits either tied token).
    ``require_paths``: each speculative path must be taken on at least this many prompts (0: a path
    never taken is a warning). ``drift``: what a ``drifted`` prompt does (``fail`` or ``warn``).
    ``min_accept_length``: the acceptance floor — a run whose mean accept length is below it fails
    (speculation collapsed: lossless but slower than promised); None: no floor.
    ``unknown_fails``: what the engine could not say is not lenient — a determinism declaration
    unknown on some servers makes the run bit-exact, a check the engine had to skip fails the run;
    set when a policy file is given (``--policy``: a CI gate), else those are reported as warnings.
    ``calibration_findings``: what a finding about the gate's own measurement does — the speculative
    server's target computing differently, a threshold set with no noise measured, a scorer check with
    nothing to check (:mod:`specparity.gate.calibration_findings`): ``warn`` (the default) or ``fail``;
    ``bit_exact`` True fails them too.
    A policy file (``--policy``, :mod:`specparity.gate.policy_file`) sets the same fields.
    """

    max_near_tie: float | None = None
    bit_exact: bool | None = None
    require_paths: int = 0
    allow_unknown_activity: bool = False
    drift: str = "fail"
    min_accept_length: float | None = None
    unknown_fails: bool = False
    calibration_findings: str = "warn"

    def __post_init__(self) -> None:
        if self.max_near_tie is not None and not 0.0 <= self.max_near_tie <= 1.0:
            raise ValueError(f"--max-near-tie: expected a fraction in [0, 1], got {self.max_near_tie}")
        if self.drift not in DRIFT_POLICIES:
            raise ValueError(f"--drift-policy: expected one of {', '.join(DRIFT_POLICIES)}, got {self.drift!r}")
        if self.require_paths < 0:
            raise ValueError(f"--require-all-paths: expected a count >= 1, got {self.require_paths}")
        if self.min_accept_length is not None and not self.min_accept_length >= 0:
            raise ValueError(f"min_accept_length: expected a number >= 0, got {self.min_accept_length}")
        if self.calibration_findings not in FINDING_POLICIES:
            raise ValueError(f"calibration_findings: expected one of {', '.join(FINDING_POLICIES)}, "
                             f"got {self.calibration_findings!r}")

    def to_json(self) -> dict[str, Any]:
        return vars(self).copy()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GatePolicy":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class GateConfig:
    """How a run is made (prompts, limits, scorer, calibration) and, in ``policy``, what passes."""

    prompts: list[str] = field(default_factory=list)
    categories: list[str] | None = None
    max_new_tokens: int | None = None  # None: each prompt's own, else DEFAULT_MAX_NEW_TOKENS
    near_tie_nats: float | None = None  # None: measured from the baseline
    #: A measured threshold above this is refused (the scorer or the target cannot judge near ties).
    near_tie_ceiling: float = DEFAULT_CEILING_NATS
    #: What the noise is measured on: "suite" (every prompt of the prompt files, whatever is
    #: selected), "selected" (only the prompts that run), or a prompt file (a fixed set).
    calibration: str = "suite"
    report_dir: str | None = None
    top_k: int = DEFAULT_TOP_K
    #: Requests in flight per phase; None: what the engine declares it can serve.
    concurrency: int | None = None
    #: Who scores tokens teacher-forced: "auto" (the engine if it can, else "embedded"), "engine",
    #: or "embedded" (transformers on the HF weights given by ``scorer_model``).
    scorer: str = "auto"
    scorer_model: str | None = None
    policy: GatePolicy = field(default_factory=GatePolicy)
    #: A golden file (:mod:`specparity.run.golden`): the baselines are read from it instead of run.
    golden: str | None = None
    #: "spec": the speculative run against the golden; "baseline": a new baseline (no speculation)
    #: against it — an engine upgrade, judged with the same classes.
    golden_mode: str = "spec"
    #: None, "update" (record or rewrite the golden from this run's baselines) or "force" (also over
    #: a golden recorded under another engine fingerprint).
    update_golden: str | None = None
    #: Continue the run journalled in ``report_dir`` (finished prompts are kept, not rerun).
    resume: bool = False
    #: ``--force-reject``: None, "all" or "random" (:mod:`specparity.model.force_reject`): the speculative
    #: run's drafts were corrupted on purpose; the gate counts what share of verify steps rejected.
    force_reject: str | None = None
    #: The engine as it was built — ``spec`` (``--engine``: a name or ``file.py:factory``, files made
    #: absolute) and ``options`` (the checked :class:`~specparity.engines.base.EngineOptions`, as JSON) —
    #: so a reproducer can rebuild it from the journal; None where the caller did not record it.
    engine: dict[str, Any] | None = None
    #: ``--shard I/N``: this run judges only the prompts of that shard (:mod:`specparity.model.shards`);
    #: its verdict is the shard's own, and ``specparity merge`` of every shard gives the run's.
    shard: Shard | None = None
    #: ``--replay N``: each failing prompt's speculative request is sent this many times more after the run
    #: (:mod:`specparity.model.replay`); 0: never.
    replays: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: expected an integer >= 1, got {self.max_new_tokens}")
        if self.replays < 0:
            raise ValueError(f"--replay: expected a count >= 0, got {self.replays}")
        if self.top_k < MIN_TOP_K:
            raise ValueError(f"--top-k: expected >= {MIN_TOP_K} alternatives per position, got {self.top_k}")
        if not self.near_tie_ceiling > 0:
            raise ValueError(f"--near-tie-ceiling: expected a number of nats > 0, got {self.near_tie_ceiling}")

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "policy": self.policy.to_json(), "shard": self.shard.to_json() if self.shard else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "GateConfig":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known and k not in ("policy", "shard")}
        return cls(**values, policy=GatePolicy.from_json(data.get("policy", {})), shard=Shard.from_json(data.get("shard")))


@dataclass
class PromptRecord:
    prompt: Prompt
    request: GenerationRequest | None = None
    baseline: GenerationResult | None = None
    baseline_tf: TokenScores | None = None
    spec: GenerationResult | None = None
    spec_tf: TokenScores | None = None
    verdict: Verdict | None = None
    tf_error: str | None = None  # scoring the baseline failed (the prompt is then an error)
    #: Scoring the speculative output failed (the prompt is then an error unless its tokens diverged).
    spec_tf_error: str | None = None
    #: A calibration baseline's tokens scored teacher-forced on the speculative server (the cross-instance
    #: noise is measured between these rows and ``baseline_tf``; journalled on its ``cross_instance`` line).
    cross_tf: TokenScores | None = None
    #: Where the baseline came from: "run" (this run decoded it), "golden" or "journal" (--resume).
    baseline_from: str = "run"
    #: For a reused baseline: the prompt ids and token limit it was decoded with (checked against
    #: this run's request: a reused baseline must answer the same request).
    reused_request: tuple[list[int], int] | None = None
    #: A failing prompt's speculative request sent again to the same servers, and what came back
    #: (:mod:`specparity.model.replay`; journalled on its own ``replay`` line).
    replay: Replay | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "prompt",
            "baseline_from": self.baseline_from,
            "prompt": self.prompt.to_json(),
            "prompt_ids": list(self.request.prompt_ids) if self.request else None,
            "max_new_tokens": self.request.max_new_tokens if self.request else None,
            "baseline": self.baseline.to_json() if self.baseline else None,
            "spec": self.spec.to_json() if self.spec else None,
            "spec_tf": self.spec_tf.to_json() if self.spec_tf is not None else None,
            "spec_tf_error": self.spec_tf_error,
            "verdict": self.verdict.to_json() if self.verdict else None,
        }


@dataclass
class Activity:
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    emitted: int = 0
    reported_requests: int = 0

    @property
    def mean_accept_length(self) -> float | None:
        return accept_length(self.emitted, self.verify_steps)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else None

    def add(self, s: SpecStats) -> None:
        if not s.available:
            return
        self.reported_requests += 1
        self.proposed += s.proposed
        self.accepted += s.accepted
        self.verify_steps += s.verify_steps
        self.emitted += s.emitted


@dataclass
class GateRun:
    fingerprint: Fingerprint | None
    config: GateConfig
    records: list[PromptRecord]
    threshold: NearTieThreshold | None = None
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    coverage: Coverage = field(default_factory=Coverage)
    fatal: str | None = None
    interrupted: bool = False  # Ctrl-C: the records hold what finished before it
    scorer: str = ""  # which scorer judged the tokens, in words (the report says it)
    concurrency: int = 1  # requests in flight per phase
    #: Server logs and other files the report should point to: (label, path).
    attachments: list[tuple[str, str]] = field(default_factory=list)
    #: Run-wide counters of an engine that reports only aggregates (read around phase 2).
    aggregate: SpecStats | None = None
    #: Why the aggregate counters could not be read (the run's activity is then unknown).
    counters_error: str | None = None
    #: Why the aggregate counters, read, are not this run's alone (other traffic on the servers, or
    #: nothing to rule it out: :func:`specparity.judge.traffic.unattributed`); ``aggregate`` is then
    #: left unset and the run's activity is unknown.
    aggregate_unattributed: str | None = None
    #: Deterministic / batch-invariant inference the engine declares for both sides, with where it
    #: was read; set, it makes the run bit-exact unless ``--allow-near-tie`` (``gate.bit_exact``).
    deterministic: str | None = None
    #: A declaration that does not cover both sides (one server only): reported, never strict.
    deterministic_partial: str | None = None
    #: Declared on some servers and unknown on the others (``Capabilities.deterministic_unknown``):
    #: strict under a policy (``GatePolicy.unknown_fails``), reported otherwise.
    deterministic_unknown: str | None = None
    #: Checks the engine had to skip (a server that could not answer one), in words: warnings, or
    #: failures under a policy (``GatePolicy.unknown_fails``).
    skipped_checks: list[str] = field(default_factory=list)
    #: Whether the noise is measured on a calibration set given apart from the selection (else on
    #: the selected prompts themselves), and which selected prompts belong to that set (their
    #: baselines are reused; the set's other prompts are ``calibration_records``).
    calibrated_apart: bool = False
    calibration_reused: list[str] = field(default_factory=list)
    #: Baselines run only to measure the noise (calibration prompts that are not selected).
    calibration_records: list[PromptRecord] = field(default_factory=list)
    #: Why the gate could not be calibrated (scorer refused, threshold above the ceiling): nothing
    #: was judged, and the engine or its scorer is to blame, not the speculative loop.
    calibration_error: str | None = None
    #: Where the two scorings behind a calibration problem (a refusal, or a cross-instance finding) differ
    #: most, among the selected prompts (:func:`specparity.judge.calibration.widest_difference`): what the
    #: report's ``reproducers/calibration/`` sends again. None without such a problem.
    calibration_spot: dict[str, Any] | None = None
    #: The scorer check's findings (:class:`specparity.judge.calibration.ScorerCheck`), as JSON.
    scorer_check: dict[str, Any] | None = None
    #: Why the golden could not be used (missing, another fingerprint, unreadable): nothing was
    #: judged, and the gate fails (record it with ``--update-golden``).
    golden_error: str | None = None
    #: What the golden contributed, in words (the summary says it): where it was recorded, which
    #: prompts it lacked, or that this run rewrote it.
    golden_notes: list[str] = field(default_factory=list)
    #: Prompts whose results came from the journal of an earlier, interrupted run (``--resume``):
    #: baselines reused and prompts whose verdict was already written.
    resumed_baselines: int = 0
    resumed_verdicts: int = 0
    #: Server engines: per side (``baseline`` / ``spec``), each server's ``url`` and the ``facts`` its
    #: request bodies were built from (:mod:`specparity.engines.server.wire`); empty otherwise.
    wire: dict[str, Any] = field(default_factory=dict)
    #: Where this run sits in a sharded one, in words: a shard's part, or the shards a merged run was
    #: made of (:mod:`specparity.model.shards`, :mod:`specparity.run.merge`); empty for a whole run.
    fleet_notes: list[str] = field(default_factory=list)

    def activity(self, category: str | None = None) -> Activity:
        act = Activity()
        for r in self.records:
            if r.spec is not None and (category is None or r.prompt.category == category):
                act.add(r.spec.spec)
        if category is None and act.reported_requests == 0 and self.aggregate is not None:
            act.add(self.aggregate)
        return act

    def categories(self) -> list[str]:
        return sorted({r.prompt.category for r in self.records})

    def record(self, prompt_id: str) -> PromptRecord:
        for r in self.records:
            if r.prompt.id == prompt_id:
                return r
        raise KeyError(prompt_id)
