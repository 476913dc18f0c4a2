"""The embedded engine ``hf``: transformers on the CPU.

Baseline: ``generate(do_sample=False)`` (:meth:`TorchTarget.greedy`). Speculative
(:class:`AssistedLoop`): a standalone draft model (``assistant_model``, constant draft width) or
n-gram prompt lookup (``prompt_lookup_num_tokens``). Acceptance is counted truthfully by wrapping
the candidate generator that ``_assisted_decoding`` drives: every ``get_candidates`` call records
what was proposed, every ``update_candidate_strategy`` call what was appended.

``--kv-cache-dtype fp8_e4m3``: the target's cache in both runs stores float8 K/V (the target's
hook, :mod:`specparity.engines.inprocess.kvcache`, quantizes the cache ``generate`` builds); the assistant
model builds its own ``DynamicCache`` (transformers does not share the target's cache with it) and
has no hook, so the draft's K/V stay in the model dtype.

``--force-reject``: the recording wrapper passes each block of candidates through the target's
:meth:`~specparity.engines.inprocess.loop.TorchTarget.draft_corruptor` before the target verifies it, and
records the corrupted block as proposed, so the counts say what the verify made of it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, parse_int_list, step_record
from specparity.engines.common import artifact, check_draft_given, torch_dtype
from specparity.engines.inprocess.loop import InProcessEngine, LoopOutput, TorchTarget
from specparity.engines.inprocess.kvcache import KV_SCALE_MODES, check_engine_options
from specparity.model.locations import fixture_dir
from specparity.model.force_reject import DraftCorruptor
from specparity.model.types import ArtifactId, GenerationRequest, StepRecord

SPEC_MODES = ("draft", "prompt_lookup")
DEFAULT_DRAFT_TOKENS = 4
#: ``--engine-opt`` keys of every engine built on :class:`TorchTarget` (hf, dflash, the broken loops).
HF_OPTIONS = {
    "attn_implementation": OptionSpec("transformers attention implementation", choices=("sdpa", "eager")),
    "stop_token_ids": OptionSpec("comma-separated token ids that end generation instead of the target's EOS "
                                 "(naming a token that never comes decodes past EOS)", parse=parse_int_list),
    "kv_scales": OptionSpec("with --kv-cache-dtype fp8_e4m3: the static K/V scales — per_tensor (default: 1.0, "
                            "SGLang without checkpoint scales), per_layer (calibrated amax/448 per layer, SGLang with "
                            "a calibrated checkpoint) or per_head (calibrated per layer and KV head)",
                            choices=KV_SCALE_MODES),
}


def check_options(options: EngineOptions) -> None:
    """The KV-cache options, and a draft for ``--spec-mode draft`` when ``--target`` is given."""
    check_engine_options(options)
    mode = options.spec_mode or "draft"
    if mode == "draft":
        check_draft_given(options, "hf", mode, alternative="; or pass --spec-mode prompt_lookup, which needs no draft")


INFO = EngineInfo("hf", spec_modes=SPEC_MODES, options=HF_OPTIONS, check=check_options, counters="steps",
                  force_reject=("all", "random"))


class RecordingCandidateGenerator:
    """Delegates to transformers' candidate generator and records one :class:`StepRecord` per
    verify step. Not a subclass on purpose: transformers' end-of-loop ``isinstance`` check then
    leaves the assistant's persistent ``num_assistant_tokens`` alone, so no state leaks between
    requests."""

    def __init__(self, inner: Any, *, nominal_width: int, max_length: int, stop_ids: Sequence[int],
                 corruptor: DraftCorruptor | None = None):
        self._inner = inner
        self._corruptor = corruptor
        self._nominal = nominal_width
        self._max_length = max_length
        self._stop_ids = tuple(stop_ids)
        self._cur_len = 0
        self._proposed: list[int] = []
        self.steps: list[StepRecord] = []

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = self._inner.get_candidates(input_ids, *args, **kwargs)
        self._cur_len = int(input_ids.shape[1])
        if self._corruptor is not None and candidates.shape[1] > self._cur_len:
            # --force-reject: the target verifies the corrupted drafts (the assistant keeps its own
            # cache of what it proposed; transformers crops it to the accepted prefix)
            drafts = self._corruptor.corrupt(candidates[0, self._cur_len :].tolist())
            candidates = candidates.clone()
            candidates[0, self._cur_len :] = candidates.new_tensor(drafts)
        self._proposed = candidates[0, self._cur_len :].tolist()
        return candidates, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        emitted = input_ids[0, self._cur_len :].tolist()
        self.steps.append(
            step_record(
                self._proposed,
                emitted,
                nominal_width=self._nominal,
                budget_before=self._max_length - self._cur_len,
                stop_ids=self._stop_ids,
            )
        )
        return self._inner.update_candidate_strategy(input_ids, scores, num_matches)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def load_draft_model(path: str, target: TorchTarget):
    """A standalone draft (``AutoModelForCausalLM``) in the target's dtype and attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(target.dtype_name), attn_implementation=target.attn_implementation,
        local_files_only=True,
    ).eval().to(target.device)


class AssistedLoop:
    """transformers' assisted generation: a standalone draft (``draft``) or prompt lookup, at a
    constant width, with every verify step recorded."""

    name = "hf"

    def __init__(self, target: TorchTarget, mode: str, width: int, draft_path: str | None):
        if mode not in SPEC_MODES:
            raise ValueError(f"--spec-mode: the hf engine supports {SPEC_MODES}, got {mode!r}")
        if width < 1:
            raise ValueError(f"--num-draft-tokens: expected an integer >= 1, got {width}")
        self.mode, self.width = mode, width
        self.draft_path = draft_path if mode == "draft" else None
        self.draft = None
        if self.draft_path:
            self.draft = load_draft_model(self.draft_path, target)
            gc = self.draft.generation_config
            gc.num_assistant_tokens = width
            gc.num_assistant_tokens_schedule = "constant"
            # A confidence cut-off would make the proposal width depend on the draft's own
            # probabilities; a gate wants a fixed width so "block cut by the limit" is well defined.
            gc.assistant_confidence_threshold = 0.0
        self._draft_artifact: ArtifactId | None = None

    def run(self, target: TorchTarget, req: GenerationRequest) -> LoopOutput:
        kwargs: dict[str, Any] = {"generation_config": target.generation_config(req)}
        if self.mode == "draft":
            kwargs["assistant_model"] = self.draft
        else:
            kwargs["generation_config"].prompt_lookup_num_tokens = self.width
        with self._recording(target, req) as made:
            out, wall = target.hf_generate(req, **kwargs)
        if len(made) != 1:
            raise RuntimeError(f"expected one candidate generator per assisted call, saw {len(made)}")
        return LoopOutput(out.sequences[0, len(req.prompt_ids):].tolist(), target.logits_rows(out), made[0].steps,
                          f"instrumented {type(made[0]._inner).__name__}", wall)

    @contextmanager
    def _recording(self, target: TorchTarget, req: GenerationRequest) -> Iterator[list[RecordingCandidateGenerator]]:
        """Wrap the candidate generator ``_assisted_decoding`` builds for this call."""
        made: list[RecordingCandidateGenerator] = []
        model = target.model
        original = model._get_candidate_generator

        def wrapped(*args, **kwargs):
            rec = RecordingCandidateGenerator(
                original(*args, **kwargs),
                nominal_width=self.width,
                max_length=len(req.prompt_ids) + req.max_new_tokens,
                stop_ids=req.stop_token_ids or target.stop_token_ids(),
                corruptor=target.draft_corruptor(req),
            )
            made.append(rec)
            return rec

        model._get_candidate_generator = wrapped
        try:
            yield made
        finally:
            del model._get_candidate_generator

    def spec_config(self) -> dict[str, Any]:
        return {"mode": self.mode, "num_draft_tokens": self.width, "schedule": "constant"}

    def draft_artifact(self) -> ArtifactId | None:
        if self.draft_path and self._draft_artifact is None:
            self._draft_artifact = artifact(self.draft_path)
        if self.mode == "prompt_lookup":
            return ArtifactId("", "", "prompt-lookup")
        return self._draft_artifact

    def close(self) -> None:
        self.draft = None


class HFEngine(InProcessEngine):
    """transformers ``generate`` with and without speculation, one request at a time (assisted
    generation supports batch size 1 only)."""

    def __init__(self, options: EngineOptions):
        mode = options.spec_mode or "draft"
        if mode == "draft":
            check_draft_given(options, "hf", mode, alternative="; or pass --spec-mode prompt_lookup, which needs no draft")
        target = TorchTarget.from_options(options)
        width = DEFAULT_DRAFT_TOKENS if options.num_draft_tokens is None else options.num_draft_tokens
        draft = str(options.draft or fixture_dir("draft")) if mode == "draft" else None
        super().__init__(target, AssistedLoop(target, mode, width, draft), name="hf")

    @property
    def spec_mode(self) -> str:
        return self.loop.mode

    @property
    def draft(self):
        return self.loop.draft


@engine_factory(INFO)
def create(options: EngineOptions) -> HFEngine:
    return HFEngine(options)
