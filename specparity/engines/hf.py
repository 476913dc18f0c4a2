"""The embedded engine ``hf``: transformers on the CPU.

Baseline: ``generate(do_sample=False)``. Speculative: a standalone draft model
(``assistant_model``, constant draft width) or n-gram prompt lookup
(``prompt_lookup_num_tokens``). Acceptance is counted truthfully by wrapping the candidate
generator that ``_assisted_decoding`` drives: every ``get_candidates`` call records what was
proposed, every ``update_candidate_strategy`` call what was appended.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from specparity.coverage import classify_step
from specparity.engines.base import EngineInfo, EngineOptions, OptionSpec, engine_factory, parse_int_list
from specparity.engines.common import (
    dir_sha256,
    finish_reason,
    model_kind,
    scores_from_logits,
    set_threads,
    torch_dtype,
)
from specparity.fixtures import fixture_dir
from specparity.types import (
    ArtifactId,
    Fingerprint,
    GenerationRequest,
    GenerationResult,
    SpecStats,
    StepRecord,
    TokenScores,
)

SPEC_MODES = ("draft", "prompt_lookup")
DEFAULT_DRAFT_TOKENS = 4
#: ``--engine-opt`` keys of every engine built on :class:`HFEngine` (hf, dflash, the broken loops).
HF_OPTIONS = {
    "attn_implementation": OptionSpec("transformers attention implementation", choices=("sdpa", "eager")),
    "stop_token_ids": OptionSpec("comma-separated token ids that end generation instead of the target's EOS "
                                 "(naming a token that never comes decodes past EOS)", parse=parse_int_list),
}
INFO = EngineInfo("hf", spec_modes=SPEC_MODES, options=HF_OPTIONS)


class RecordingCandidateGenerator:
    """Delegates to transformers' candidate generator and records one :class:`StepRecord` per
    verify step. Not a subclass on purpose: transformers' end-of-loop ``isinstance`` check then
    leaves the assistant's persistent ``num_assistant_tokens`` alone, so no state leaks between
    requests."""

    def __init__(self, inner: Any, *, nominal_width: int, max_length: int, stop_ids: Sequence[int]):
        self._inner = inner
        self._nominal = nominal_width
        self._max_length = max_length
        self._stop_ids = tuple(stop_ids)
        self._cur_len = 0
        self._proposed: list[int] = []
        self.steps: list[StepRecord] = []

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = self._inner.get_candidates(input_ids, *args, **kwargs)
        self._cur_len = int(input_ids.shape[1])
        self._proposed = candidates[0, self._cur_len :].tolist()
        return candidates, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        emitted = input_ids[0, self._cur_len :].tolist()
        self.steps.append(
            classify_step(
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


class HFEngine:
    """transformers ``generate`` with and without speculation, one request at a time (assisted
    generation supports batch size 1 only)."""

    name = "hf"

    def __init__(self, options: EngineOptions):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        set_threads(options.threads)
        self.options = options
        self.target_path = str(options.target or fixture_dir("target"))
        mode = options.spec_mode or "draft"
        if mode not in SPEC_MODES:
            raise ValueError(f"--spec-mode: the hf engine supports {SPEC_MODES}, got {mode!r}")
        self.spec_mode = mode
        self.draft_path = str(options.draft or fixture_dir("draft")) if mode == "draft" else None
        self.num_draft_tokens = DEFAULT_DRAFT_TOKENS if options.num_draft_tokens is None else options.num_draft_tokens
        if self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens: expected an integer >= 1, got {self.num_draft_tokens}")
        self.dtype_name = options.dtype
        dtype = torch_dtype(options.dtype)
        self.attn_implementation = options.extra.get("attn_implementation", "sdpa")
        # local_files_only: a path typo must fail here, never turn into a model-hub download.
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.target_path, dtype=dtype, attn_implementation=self.attn_implementation, local_files_only=True
        ).eval()
        self.draft = None
        if self.draft_path:
            self.draft = AutoModelForCausalLM.from_pretrained(
                self.draft_path, dtype=dtype, attn_implementation=self.attn_implementation, local_files_only=True
            ).eval()
            gc = self.draft.generation_config
            gc.num_assistant_tokens = self.num_draft_tokens
            gc.num_assistant_tokens_schedule = "constant"
            # A confidence cut-off would make the proposal width depend on the draft's own
            # probabilities; a gate wants a fixed width so "block cut by the limit" is well defined.
            gc.assistant_confidence_threshold = 0.0
        self._stop_ids = self._find_stop_ids(options.extra.get("stop_token_ids"))
        self._torch = torch
        self._fingerprint: Fingerprint | None = None

    # ------------------------------------------------------------------ protocol
    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        if messages is not None:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids)
        return list(self.tokenizer.encode(prompt or "", add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def generate(self, requests: Sequence[GenerationRequest], *, speculative: bool) -> list[GenerationResult]:
        results = []
        for req in requests:
            try:
                results.append(self._generate_one(req, speculative))
            except Exception as exc:  # noqa: BLE001 - one failed request must not lose the others
                results.append(GenerationResult.failed(req.request_id, f"{type(exc).__name__}: {exc}"))
        return results

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        torch = self._torch
        if not continuation_ids:
            return TokenScores.empty(top_k)
        ids = torch.tensor([list(prompt_ids) + list(continuation_ids)], dtype=torch.long)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0]
        n = len(prompt_ids)
        return scores_from_logits(logits[n - 1 : n - 1 + len(continuation_ids)], continuation_ids, top_k)

    def fingerprint(self) -> Fingerprint:
        if self._fingerprint is None:
            import torch
            import transformers

            draft = None
            if self.draft_path:
                draft = ArtifactId(self.draft_path, dir_sha256(self.draft_path), model_kind(self.draft_path))
            elif self.spec_mode == "prompt_lookup":
                draft = ArtifactId("", "", "prompt-lookup")
            self._fingerprint = Fingerprint(
                engine=self.name,
                engine_version=f"transformers {transformers.__version__}, torch {torch.__version__}",
                target=ArtifactId(self.target_path, dir_sha256(self.target_path), model_kind(self.target_path)),
                draft=draft,
                dtype=self.dtype_name,
                spec_config={
                    "mode": self.spec_mode,
                    "num_draft_tokens": self.num_draft_tokens,
                    "schedule": "constant",
                },
                extra={"attn_implementation": self.attn_implementation, "threads": self.options.threads},
            )
        return self._fingerprint

    def close(self) -> None:
        self.model = self.draft = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ internals
    def _find_stop_ids(self, override: str | Sequence[int] | None) -> tuple[int, ...]:
        """The target's EOS ids, or ``--engine-opt stop_token_ids=4,7``: naming a token that never
        comes (e.g. the pad token) decodes past EOS — longer streams, more positions to compare."""
        if isinstance(override, str):  # an engine built directly, not through check_options
            override = parse_int_list(override)
        if override:
            return tuple(int(t) for t in override)
        ids: list[int] = []
        eos = self.model.generation_config.eos_token_id
        for value in (eos if isinstance(eos, list) else [eos]) + [self.tokenizer.eos_token_id]:
            if value is not None and value not in ids:
                ids.append(int(value))
        return tuple(ids)

    def _generation_kwargs(self, req: GenerationRequest) -> dict[str, Any]:
        from transformers import GenerationConfig

        stop = list(req.stop_token_ids or self._stop_ids)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=req.max_new_tokens,
            eos_token_id=stop,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stop[0],
            return_dict_in_generate=True,
            output_logits=True,
        )
        return {"generation_config": config}

    @contextmanager
    def _recording(self, req: GenerationRequest, prompt_len: int) -> Iterator[list[RecordingCandidateGenerator]]:
        """Wrap the candidate generator ``_assisted_decoding`` builds for this call."""
        made: list[RecordingCandidateGenerator] = []
        original = self.model._get_candidate_generator

        def wrapped(*args, **kwargs):
            rec = RecordingCandidateGenerator(
                original(*args, **kwargs),
                nominal_width=self.num_draft_tokens,
                max_length=prompt_len + req.max_new_tokens,
                stop_ids=req.stop_token_ids or self._stop_ids,
            )
            made.append(rec)
            return rec

        self.model._get_candidate_generator = wrapped
        try:
            yield made
        finally:
            del self.model._get_candidate_generator

    def _generate_one(self, req: GenerationRequest, speculative: bool) -> GenerationResult:
        torch = self._torch
        ids = torch.tensor([list(req.prompt_ids)], dtype=torch.long)
        kwargs = self._generation_kwargs(req)
        if speculative:
            if self.spec_mode == "draft":
                kwargs["assistant_model"] = self.draft
            else:
                kwargs["generation_config"].prompt_lookup_num_tokens = self.num_draft_tokens
        t0 = time.perf_counter()
        with torch.inference_mode():
            if speculative:
                with self._recording(req, len(req.prompt_ids)) as made:
                    out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                if len(made) != 1:
                    raise RuntimeError(f"expected one candidate generator per assisted call, saw {len(made)}")
                spec = SpecStats.from_steps(made[0].steps, f"instrumented {type(made[0]._inner).__name__}")
            else:
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                spec = SpecStats.unavailable("speculation off")
        wall = time.perf_counter() - t0
        new_ids = out.sequences[0, len(req.prompt_ids) :].tolist()
        rows = [step[0] for step in out.logits] if out.logits else []
        return self.result(req, new_ids, rows, spec, wall)

    def result(
        self, req: GenerationRequest, new_ids: list[int], rows: Sequence[Any], spec: SpecStats, wall: float
    ) -> GenerationResult:
        """A result from the output ids and one logits row per output token (the row that chose
        it); shared by every loop built on this engine (dflash, the broken loops in tests/)."""
        stop = req.stop_token_ids or self._stop_ids
        scores = (
            scores_from_logits(self._torch.stack(list(rows[: len(new_ids)])), new_ids, req.top_k)
            if new_ids
            else TokenScores.empty(req.top_k)
        )
        return GenerationResult(
            request_id=req.request_id,
            output_ids=new_ids,
            text=self.decode(new_ids),
            finish_reason=finish_reason(new_ids, stop),
            scores=scores,
            spec=spec,
            wall_s=wall,
        )

@engine_factory(INFO)
def create(options: EngineOptions) -> HFEngine:
    return HFEngine(options)
