"""Deliberately broken speculative samplers, to prove ``specparity sample`` catches each bug.

Each is :class:`~specparity.engines.inprocess.sampling.SpeculativeSampler` with one stage broken, a
mistake real speculative-sampling implementations have made; the correct sampler must pass.
``--engine tests/broken_samplers.py:create --engine-opt bug=<name>``.
"""

from __future__ import annotations

import torch

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS
from specparity.engines.inprocess.sampling import SamplingEngine, SpeculativeSampler, build, probabilities

BUGS = {
    "draft_unscaled": "the acceptance ratio and the residual read the draft's q at temperature 1 while the drafts "
                      "are sampled at the run's temperature",
    "residual_from_p": "at a rejection, samples the replacement from p instead of the residual max(0, p - q)",
    "topk_draft_only": "applies top-k to the draft only: the acceptance ratio reads the target's untruncated p",
    "bonus_from_draft": "after a full accept, samples the bonus token from the draft's q instead of the target's p",
    "reused_uniform": "draws one acceptance random number per verify step and reuses it at every draft position",
    "penalty_misses_block": "applies the repetition penalty to the verify rows over the context before the step, "
                            "missing the draft tokens accepted earlier in the same step",
}


class DraftUnscaled(SpeculativeSampler):
    def verify_q(self, q, q_logits, q_seen, params):
        return torch.stack([probabilities(q_logits[:, j], q_seen[j], params, temperature=1.0)
                            for j in range(q_logits.shape[1])], 1)


class ResidualFromP(SpeculativeSampler):
    def next_distribution(self, p_n, q_n, all_accepted):
        return p_n


class TopkDraftOnly(SpeculativeSampler):
    def ratio_p(self, p, logits, seen_block, params):
        return torch.stack([probabilities(logits[:, i], seen_block[i], params, top_k=False)
                            for i in range(logits.shape[1])], 1)


class BonusFromDraft(SpeculativeSampler):
    feeds_last_draft = True

    def bonus_distribution(self, p_k, q_k):
        return q_k


class ReusedUniform(SpeculativeSampler):
    def acceptance_uniforms(self, rows, k, generator, device):
        return torch.rand(rows, 1, generator=generator, device=device).expand(rows, k)


class PenaltyMissesBlock(SpeculativeSampler):
    def target_probs(self, logits, seen_block, seen_start, params):
        return torch.stack([probabilities(logits[:, i], seen_start, params) for i in range(logits.shape[1])], 1)


SAMPLERS: dict[str, type[SpeculativeSampler]] = {
    "draft_unscaled": DraftUnscaled,
    "residual_from_p": ResidualFromP,
    "topk_draft_only": TopkDraftOnly,
    "bonus_from_draft": BonusFromDraft,
    "reused_uniform": ReusedUniform,
    "penalty_misses_block": PenaltyMissesBlock,
}
assert set(SAMPLERS) == set(BUGS)


def sampler_engine(options: EngineOptions, bug: str | None = None) -> SamplingEngine:
    """The sampler with ``bug`` (a key of :data:`BUGS`; None: the correct one) as an engine."""
    if bug is not None and bug not in SAMPLERS:
        raise ValueError(f"unknown bug {bug!r}; expected one of {sorted(SAMPLERS)}")
    return build(options, SAMPLERS[bug] if bug else SpeculativeSampler, name=f"spec-sampling[{bug or 'correct'}]")


@engine_factory(EngineInfo(
    "spec-sampling-broken",
    spec_modes=("draft",),
    options={**HF_OPTIONS, "bug": OptionSpec("the deliberate bug (none: the correct sampler)", choices=tuple(BUGS))},
))
def create(options: EngineOptions) -> SamplingEngine:
    return sampler_engine(options, options.extra.get("bug") or None)
