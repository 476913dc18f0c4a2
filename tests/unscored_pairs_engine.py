"""A plugin engine whose teacher-forced scorer reports only the token it scored: the real ``hf`` engine,
except that every row of ``score()`` keeps its top-1 alternative (the scored token, the argmax) and
leaves the others unreported (id −1, NaN), as a server that returns one prompt logprob per position.

The scorer passes its check (its argmax is the baseline's token wherever the margin is clear), yet no
(position, alternative) pair is recorded by both the decode rows and the scorer's rows, so no noise can
be measured: the gate refuses to calibrate, or — with ``--near-tie-nats`` — judges with the latent-drift
check off.
"""

from __future__ import annotations

import numpy as np

from specparity.engines.base import EngineInfo, EngineOptions, engine_factory
from specparity.engines.inprocess.hf import HF_OPTIONS, SPEC_MODES, HFEngine
from specparity.model.types import TokenScores


def top1_only(s: TokenScores) -> TokenScores:
    """``s`` with every alternative but the first unreported."""
    ids, top = s.top_ids.copy(), s.top_logprobs.astype(np.float32)
    ids[:, 1:] = -1
    top[:, 1:] = np.nan
    return TokenScores(s.token_ids, s.logprobs, ids, top)


class UnscoredPairsEngine(HFEngine):
    name = "hf-unscored-pairs"

    def score(self, prompt_ids, continuation_ids, top_k):
        return top1_only(super().score(prompt_ids, continuation_ids, top_k))


@engine_factory(EngineInfo("hf-unscored-pairs", spec_modes=SPEC_MODES, options=HF_OPTIONS))
def create(options: EngineOptions) -> UnscoredPairsEngine:
    return UnscoredPairsEngine(options)
