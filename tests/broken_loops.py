"""Deliberately broken speculative loops, to prove the gate catches each bug.

``HandLoop`` is a hand-written draft-and-verify loop over the fixture target and draft (the draft
proposes ``k`` tokens greedily, the target verifies ``[last token] + drafts`` in one pass with its
KV cache, accepts the matching prefix, appends the bonus/correction token, crops both caches),
written exactly as a team writes its own engine: a :class:`~specparity.engines.inprocess.loop.SpeculativeLoop`
over a :class:`~specparity.engines.inprocess.loop.TorchTarget`, joined by ``InProcessEngine``. With
``bug=None`` it is lossless and the gate must pass it; each bug below is a mistake real engines
have shipped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, step_record
from specparity.engines.inprocess.hf import DEFAULT_DRAFT_TOKENS, HF_OPTIONS, load_draft_model
from specparity.engines.common import artifact
from specparity.engines.inprocess.loop import InProcessEngine, LoopOutput, TorchTarget
from specparity.model.locations import fixture_dir
from specparity.model.force_reject import DraftCorruptor
from specparity.model.types import ArtifactId, GenerationRequest, StepRecord

#: Fully rejected verify steps in a row after which ``reject_streak_crop`` misbehaves, by default:
#: longer than any streak the fixture draft produces on prompts/default.jsonl (docs/FORCE_REJECT.md has
#: the count), so only ``--force-reject all`` reaches it. tests/test_force_reject.py sets it from the
#: streaks it measures, so a prompt added to the file cannot move the bug into the default run.
REJECT_STREAK = 4
BUGS = {
    "accept_unverified": "accepts one draft token past the first mismatch: the first rejected draft token of a "
                         "block, without checking it",
    "drop_bonus": "advances the context by the bonus token but leaves it out of the output",
    "duplicate_bonus": "writes the bonus token into the output twice",
    "short_crop": "after a partial accept, crops the target KV cache one position too short",
    "overrun_stop": "keeps the rest of an accepted block after a stop token inside it",
    "overrun_limit": "ignores max_new_tokens inside a block (emits the whole accepted block)",
    "inactive": "never proposes a draft token (speculation silently off)",
    "stale_context": "reuses the previous request's last token as the first verify input",
    "noisy_verify": "perturbs the verify pass's logits (a verify kernel that disagrees with decode beyond rounding)",
}
#: Bugs only the reject path exposes often enough: the default run passes them (the good draft never
#: reaches their path on the fixture prompts); ``--force-reject all`` must catch them.
REJECT_PATH_BUGS = {
    "reject_streak_crop": f"after {REJECT_STREAK} consecutive fully rejected verify steps (a streak the fixture draft "
                          "never reaches on the default prompts), crops the target KV cache one position too short: "
                          "a rollback whose history of accepted positions wrapped around",
}
#: Scale (nats) of the seeded noise ``noisy_verify`` adds to every verify logit.
VERIFY_NOISE = 2.0
#: How a loop accepts a draft token that is not its verify row's argmax (None: never). ``draft``
#: is legitimate greedy decoding — at an exact tie of the row either token is the argmax, and many
#: engines keep the draft's; ``close`` is a bug: a tolerance several bf16 ulps wide.
TIE_RULES = {
    "draft": "at an exact tie of its verify row between the argmax and the draft token, keeps the draft token",
    "close": "accepts a draft token whose verify logit is within ACCEPT_CLOSE_NATS of the row's maximum",
}
ACCEPT_CLOSE_NATS = 3.0


class HandLoop:
    """The hand-written loop; ``bug`` (a key of :data:`BUGS`) breaks it on purpose."""

    def __init__(self, target: TorchTarget, draft_path: str, width: int, bug: str | None = None,
                 reject_streak: int = REJECT_STREAK, tie_rule: str | None = None):
        if bug is not None and bug not in BUGS and bug not in REJECT_PATH_BUGS:
            raise ValueError(f"unknown bug {bug!r}; expected one of {sorted(BUGS) + sorted(REJECT_PATH_BUGS)}")
        if tie_rule is not None and tie_rule not in TIE_RULES:
            raise ValueError(f"unknown tie rule {tie_rule!r}; expected one of {sorted(TIE_RULES)}")
        self.tie_rule = tie_rule
        self.draft_path = draft_path
        self.target_model = target.model
        self.draft = load_draft_model(draft_path, target)
        self.num_draft_tokens = width
        self.bug = bug
        self.reject_streak = reject_streak
        self._stale_last: int | None = None
        self._noise = torch.Generator().manual_seed(0)
        #: Requests whose output holds a token the bug put there (``accept_unverified``): where it fired.
        self.fired: set[str] = set()
        self.name = f"hf-loop[{bug or tie_rule and f'tie-{tie_rule}' or 'correct'}]"
        #: Requests on which ``reject_streak_crop`` cropped short (the bug's path was reached).
        self.streak_fired: set[str] = set()

    def spec_config(self) -> dict:
        return {"mode": "draft", "num_draft_tokens": self.num_draft_tokens, "schedule": "constant",
                "loop": "tests/broken_loops.py", "bug": self.bug, "tie_rule": self.tie_rule}

    def draft_artifact(self) -> ArtifactId:
        return artifact(self.draft_path)

    def run(self, target: TorchTarget, req: GenerationRequest) -> LoopOutput:
        out, rows, steps = self._loop(req, target.stop_token_ids(), target.draft_corruptor(req))
        return LoopOutput(out, rows, steps, f"tests/broken_loops.py ({self.bug or 'correct'})")

    # ------------------------------------------------------------------ the loop
    def _loop(self, req: GenerationRequest, default_stops,
              corruptor: DraftCorruptor | None = None) -> tuple[list[int], list[torch.Tensor], list[StepRecord]]:
        from transformers import DynamicCache

        bug = self.bug
        stops = set(req.stop_token_ids or default_stops)
        prompt = list(req.prompt_ids)
        t_cache = DynamicCache(config=self.target_model.config)
        d_cache = DynamicCache(config=self.draft.config)
        logits = self.target_model(input_ids=torch.tensor([prompt]), past_key_values=t_cache, use_cache=True).logits[0, -1]
        first = int(logits.argmax())
        context = prompt + [first]  # what the models have seen (or will see next)
        out = [first]
        rows = [logits.float()]
        steps: list[StepRecord] = []
        width = self.num_draft_tokens
        streak = 0  # fully rejected verify steps in a row
        while len(out) < req.max_new_tokens and out[-1] not in stops:
            budget = req.max_new_tokens - len(out)
            k = 0 if bug == "inactive" else (width if bug == "overrun_limit" else min(width, budget - 1))
            drafts = self._propose(context, d_cache, k)
            if corruptor is not None:  # --force-reject: verify the corrupted block instead
                drafts = corruptor.corrupt(drafts)
            last = context[-1]
            if bug == "stale_context" and self._stale_last is not None and len(out) == 1:
                last = self._stale_last
            verify = self.target_model(
                input_ids=torch.tensor([[last] + drafts]), past_key_values=t_cache, use_cache=True
            ).logits[0]
            if bug == "noisy_verify":
                verify = verify + VERIFY_NOISE * torch.randn(verify.shape, generator=self._noise)
            argmax = verify.argmax(-1).tolist()
            n = 0
            while n < len(drafts) and (drafts[n] == argmax[n] or self._keeps(verify[n], drafts[n])):
                n += 1
            unverified = None
            if bug == "accept_unverified" and n < len(drafts):
                unverified, n = n, n + 1
            new = drafts[:n] + [argmax[n]]
            new_rows = [verify[i].float() for i in range(len(new))]
            if bug != "overrun_stop":
                for i, t in enumerate(new):
                    if t in stops:
                        new, new_rows = new[: i + 1], new_rows[: i + 1]
                        break
            if bug != "overrun_limit":
                new, new_rows = new[:budget], new_rows[:budget]
            if unverified is not None and unverified < len(new):
                self.fired.add(req.request_id)
            context += new
            emitted, emitted_rows = list(new), list(new_rows)
            if bug == "drop_bonus" and n == len(drafts) and drafts:
                emitted, emitted_rows = emitted[:-1], emitted_rows[:-1]
            if bug == "duplicate_bonus" and n == len(drafts) and drafts:
                emitted, emitted_rows = emitted + emitted[-1:], emitted_rows + emitted_rows[-1:]
            out += emitted
            rows += emitted_rows
            steps.append(step_record(drafts, new, nominal_width=width, budget_before=budget, stop_ids=stops))
            keep = len(context) - 1  # the cache holds everything but the newest token
            if bug == "short_crop" and n < len(drafts):
                keep -= 1
            streak = streak + 1 if drafts and n == 0 else 0
            if bug == "reject_streak_crop" and streak >= self.reject_streak:
                keep -= 1
                self.streak_fired.add(req.request_id)
            surplus = t_cache.get_seq_length() - keep
            if surplus > 0:  # (after a short crop the cache can already be shorter than `keep`)
                t_cache.crop(-surplus)
        self._stale_last = context[-1]
        return out, rows, steps

    def _keeps(self, row: torch.Tensor, draft: int) -> bool:
        """Whether :data:`TIE_RULES` keeps a draft token that is not the row's (lowest-id) argmax."""
        if self.tie_rule == "draft":
            return bool(row[draft] == row.max())
        if self.tie_rule == "close":
            return float(row.max() - row[draft]) <= ACCEPT_CLOSE_NATS
        return False

    def _propose(self, context: Sequence[int], d_cache, k: int) -> list[int]:
        """Greedy draft tokens; the draft cache is cropped to the agreed context first."""
        if k <= 0:
            return []
        seen = d_cache.get_seq_length()
        agreed = len(context) - 1
        if seen > agreed:
            d_cache.crop(agreed - seen)
            seen = agreed
        feed = list(context[seen:])
        drafts: list[int] = []
        for _ in range(k):
            logits = self.draft(input_ids=torch.tensor([feed]), past_key_values=d_cache, use_cache=True).logits[0, -1]
            tok = int(logits.argmax())
            drafts.append(tok)
            feed = [tok]
        return drafts


def LoopEngine(options: EngineOptions, bug: str | None = None,  # noqa: N802 - reads as a class
               reject_streak: int = REJECT_STREAK, tie_rule: str | None = None) -> InProcessEngine:
    """The hand-written loop (``bug``: one of :data:`BUGS`, None: correct; ``tie_rule``: one of
    :data:`TIE_RULES`) as an engine."""
    target = TorchTarget.from_options(options)
    width = DEFAULT_DRAFT_TOKENS if options.num_draft_tokens is None else options.num_draft_tokens
    loop = HandLoop(target, str(options.draft or fixture_dir("draft")), width, bug, reject_streak, tie_rule)
    return InProcessEngine(target, loop, name=loop.name)


@engine_factory(EngineInfo(
    "hf-loop",
    spec_modes=("draft",),
    options={**HF_OPTIONS, "bug": OptionSpec("the deliberate bug to run (none: the correct loop)", choices=tuple(BUGS) + tuple(REJECT_PATH_BUGS)),
             "tie_rule": OptionSpec("how a draft token that is not the row's argmax may be kept (none: never)",
                                    choices=tuple(TIE_RULES))},
    force_reject=("all", "random"),
))
def create(options: EngineOptions) -> InProcessEngine:
    """``--engine tests/broken_loops.py:create --engine-opt bug=<name>`` (no bug: the correct loop;
    ``--engine-opt tie_rule=draft|close``: :data:`TIE_RULES`)."""
    return LoopEngine(options, options.extra.get("bug") or None, tie_rule=options.extra.get("tie_rule") or None)
