"""What a sampled decode is asked for: temperature, top-k, repetition penalty, seed.

Shared by the engines that sample (:mod:`specparity.engines.inprocess.sampling`), the run that asks
them (:mod:`specparity.run.sampling_run`) and the judge's wording, so each default lives once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: The defaults of ``specparity sample`` (docs/SAMPLING.md says why these values): a temperature
#: above 1 because the committed fixture target is nearly deterministic at 1 (top-1 mass above
#: 0.99 on most prompts), and a top-k no wider than the logprob channel (``DEFAULT_TOP_K``), so every
#: token a correct sampler emits is inside the scored channel.
DEFAULT_TEMPERATURE = 2.0
DEFAULT_SAMPLING_TOP_K = 8
DEFAULT_SAMPLES = 200
DEFAULT_SAMPLE_TOKENS = 16
DEFAULT_SEED = 0


@dataclass(frozen=True)
class SamplingParams:
    """How both sides sample: the target's logits get the repetition penalty (HF's rule: a logit of a
    token already in the context — prompt included — is divided by the penalty if positive and
    multiplied if negative), then the temperature, then the top-k cut; the rest renormalised."""

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_SAMPLING_TOP_K
    repetition_penalty: float = 1.0
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected a number > 0, got {self.temperature}")
        if self.top_k < 1:
            raise ValueError(f"top_k: expected an integer >= 1, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty: expected a number > 0, got {self.repetition_penalty}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
