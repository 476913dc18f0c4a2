"""Deliberately broken DFlash loops, to prove the gate catches each bug in a block-diffusion decoder.

``DFlashLoopEngine`` is the ``dflash`` engine whose speculative path is a compact copy of
``dflash.model.dflash_generate`` (greedy), making the same calls into the real draft model
(``model(...)``, ``model.propose(...)`` / ``model.compute_logits(...)``) and the package's own
helpers (``_make_cache``, ``_crop_to``, ``_raw_input_embeddings``, ``_output_head``,
``extract_context_feature``). With ``bug=None`` it reproduces ``dflash_generate`` token for token
(``tests/test_broken_dflash.py`` checks that) and the gate passes it.

``BUGS`` break losslessness: each must fail the gate as ``diverged``. ``BENIGN`` are draft-side
mistakes that cannot change the output (the target still verifies every token): the gate must
pass them, and only the accept length shows them — the gate proves losslessness, not draft quality.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, step_record
from specparity.engines.inprocess.dflash import INFO as DFLASH_INFO
from specparity.engines.inprocess.dflash import DFlashEngine, DFlashLoop
from specparity.engines.inprocess.loop import LoopOutput
from specparity.model.locations import MODELS
from specparity.model.types import GenerationRequest, StepRecord

BUGS = {
    "accept_past_mismatch": "accepts the first mismatching draft token too (acceptance length off by one)",
    "lose_bonus": "after a fully accepted block, forgets to write the bonus token (its slot keeps <mask>)",
    "no_target_crop": "after a partial accept, does not crop the target KV cache (rejected drafts stay visible)",
    "position_off_by_one": "verifies the block at positions start+1.. instead of start.. (RoPE off by one)",
    "overrun_limit": "cuts the last block at max_length - start instead of max_length - start - 1",
}
BENIGN = {
    "stale_target_hidden": "conditions the next draft on every verified position's hidden state, "
    "rejected ones included (no [:, :produced] slice)",
}


#: The models the DFlash tests run on: the committed fixtures, or another directory with the same
#: layout (target/, dflash2/, dflash1/) named by SPECPARITY_DFLASH_MODELS.
MODELS_DIR = Path(os.environ.get("SPECPARITY_DFLASH_MODELS") or MODELS)


def model_options(mode: str = "dflash2", **kwargs) -> EngineOptions:
    """Engine options for the test models with the given draft (``dflash2`` / ``dflash1``)."""
    return EngineOptions(target=str(MODELS_DIR / "target"), draft=str(MODELS_DIR / mode), spec_mode=mode, **kwargs)


class BrokenDFlashLoop(DFlashLoop):
    """A compact copy of ``dflash_generate`` (greedy) with ``bug`` switched in."""

    def __init__(self, target, mode, draft_path, block_size, *, bug: str | None = None):
        if bug is not None and bug not in BUGS and bug not in BENIGN:
            raise ValueError(f"unknown bug {bug!r}; expected one of {sorted(BUGS) + sorted(BENIGN)}")
        super().__init__(target, mode, draft_path, block_size)
        self.bug = bug
        self.name = f"dflash-loop[{bug or 'correct'}]"

    def spec_config(self) -> dict:
        return {**super().spec_config(), "loop": "tests/broken_dflash.py", "bug": self.bug}

    def run(self, target, req: GenerationRequest) -> LoopOutput:
        full, rows, steps = self.hand_loop(target, req.prompt_ids, req.max_new_tokens,
                                           req.stop_token_ids or target.stop_token_ids())
        return LoopOutput(full[len(req.prompt_ids):], rows, steps, f"tests/broken_dflash.py ({self.bug or 'correct'})")

    @torch.inference_mode()
    def hand_loop(self, torch_target, prompt_ids, max_new_tokens: int,
                  stop_ids) -> tuple[list[int], list[torch.Tensor], list[StepRecord]]:
        """``dflash_generate`` (temperature 0) with the bug switched in; returns prompt + output ids."""
        dm, model, target, bug = self._dm, self.draft, torch_target.model, self.bug
        block_size = self.block_size
        stops = [int(t) for t in stop_ids]
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        n = input_ids.shape[1]
        max_length = n + max_new_tokens
        output_ids = torch.full((1, max_length + 2), model.mask_token_id, dtype=torch.long)
        position_ids = torch.arange(output_ids.shape[1] + 1).unsqueeze(0)
        t_cache, d_cache = dm._make_cache(target.config), dm._make_cache(model.config)
        out = target(input_ids, position_ids=position_ids[:, :n], past_key_values=t_cache, use_cache=True,
                     logits_to_keep=1, output_hidden_states=block_size > 1)
        output_ids[:, :n] = input_ids
        output_ids[:, n] = out.logits[0, -1].argmax()
        rows = [out.logits[0, -1]]
        if block_size > 1:
            target_hidden = dm.extract_context_feature(out.hidden_states, model.target_layer_ids)
        start, steps = n, []
        stopped = int(output_ids[0, start]) in stops
        while start + 1 < max_length and not stopped:
            verify_size = min(block_size, max_length - start)
            block = output_ids[:, start : start + verify_size].clone()
            if verify_size > 1:
                scale = float(dm._draft_value(model.config, "input_embedding_scale", 1.0))
                draft_hidden = model(
                    target_hidden=target_hidden,
                    noise_embedding=dm._raw_input_embeddings(target, block, scale),
                    position_ids=position_ids[:, start - target_hidden.shape[1] : start + verify_size],
                    past_key_values=d_cache,
                    use_cache=True,
                )[:, 1 - verify_size :, :]
                dm._crop_to(d_cache, start)
                if isinstance(model, dm.DFlash2DraftModel):
                    block[:, 1:] = model.propose(draft_hidden, block[:, 0], dm._output_head(target), 0.0)[0]
                else:
                    block[:, 1:] = model.compute_logits(draft_hidden, dm._output_head(target)).argmax(-1)
            shift = 1 if bug == "position_off_by_one" else 0
            out = target(block, position_ids=position_ids[:, start + shift : start + shift + verify_size],
                         past_key_values=t_cache, use_cache=True, output_hidden_states=verify_size > 1)
            posterior = out.logits.argmax(-1)
            drafts = block[0, 1:].tolist()
            accepted = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
            if bug == "accept_past_mismatch" and accepted < len(drafts):
                accepted += 1
            output_ids[:, start : start + accepted + 1] = block[:, : accepted + 1]
            if not (bug == "lose_bonus" and drafts and accepted == len(drafts)):
                output_ids[:, start + accepted + 1] = posterior[:, accepted]
            left = max_length - start - (0 if bug == "overrun_limit" else 1)
            produced = min(accepted + 1, left)
            emitted = output_ids[0, start + 1 : start + 1 + produced].tolist()
            hits = [i for i, t in enumerate(emitted) if t in stops]
            if hits:
                produced, stopped = hits[0] + 1, True
            steps.append(step_record(drafts, emitted[:produced], nominal_width=block_size - 1,
                                       budget_before=max_length - start - 1, stop_ids=stops))
            rows.extend(out.logits[0, i] for i in range(produced))
            start += produced
            if not (bug == "no_target_crop" and accepted < len(drafts)):
                dm._crop_to(t_cache, start)
            if verify_size > 1:
                hidden = dm.extract_context_feature(out.hidden_states, model.target_layer_ids)
                target_hidden = hidden if bug == "stale_target_hidden" else hidden[:, :produced, :]
        end = start + 1 if bug == "overrun_limit" else min(start + 1, max_length)
        return output_ids[0, :end].tolist(), rows, steps


def DFlashLoopEngine(options: EngineOptions, bug: str | None = None) -> DFlashEngine:  # noqa: N802 - reads as a class
    """The dflash engine with the hand-copied loop (``bug``: one of BUGS / BENIGN, None: correct)."""
    return DFlashEngine(options, loop_factory=partial(BrokenDFlashLoop, bug=bug), name=f"dflash-loop[{bug or 'correct'}]")


@engine_factory(EngineInfo(
    "dflash-loop",
    spec_modes=DFLASH_INFO.spec_modes,
    options={**DFLASH_INFO.options,
             "bug": OptionSpec("the deliberate bug to run (none: the correct loop)", choices=(*BUGS, *BENIGN))},
))
def create(options: EngineOptions) -> DFlashEngine:
    """``--engine tests/broken_dflash.py:create --engine-opt bug=<name>`` (no bug: the correct loop)."""
    return DFlashLoopEngine(options, options.extra.get("bug") or None)
