"""In-process (torch) engines by composition: one :class:`TorchTarget`, one :class:`SpeculativeLoop`.

Everything an in-process engine shares lives in :class:`TorchTarget` — loading the target and its
tokenizer, prompt encoding, the greedy baseline, teacher-forced scoring, building a
:class:`~specparity.model.types.GenerationResult` from output ids and logits rows, the target's identity.
What differs between engines is only the speculative loop. :class:`InProcessEngine` joins the two
into the engine protocol, so the built-in engines (``hf``: transformers' assisted generation,
``dflash``: the DFlash reference decoder), the deliberately broken loops in ``tests/`` and a team's
own decoder are written the same way::

    from specparity.engines.base import EngineInfo, EngineOptions, engine_factory, step_record
    from specparity.engines.inprocess.loop import InProcessEngine, LoopOutput, TorchTarget

    class MyLoop:
        name = "mine"
        def run(self, target: TorchTarget, request) -> LoopOutput: ...   # the decoder under test
        def spec_config(self) -> dict: return {"width": 4}
        def draft_artifact(self): return None

    @engine_factory(EngineInfo("mine"))
    def create(options: EngineOptions) -> InProcessEngine:
        return InProcessEngine(TorchTarget.from_options(options), MyLoop())

A loop returns the new tokens, one logits row per token (the row that chose it, as the verify pass
computed it) and one :class:`~specparity.model.types.StepRecord` per verify step (build them with
:func:`specparity.engines.base.step_record` from what was proposed and what was emitted).
Forced rejection (``--force-reject``, :mod:`specparity.model.force_reject`): a loop that supports it takes
``corrupt = target.draft_corruptor(request)`` once per request and, when it is not None, verifies
``corrupt.corrupt(drafts)`` instead of its drafts; its step records then count what the verify made
of them. Its factory declares it: ``EngineInfo("mine", force_reject=("all", "random"))``.
Loaded with ``--engine``, the factory gets ``options.target`` / ``options.draft`` already defaulted to
the fixtures and torch already pinned to ``--threads`` (:mod:`specparity.engines`).

KV cache: under ``--kv-cache-dtype fp8_e4m3`` the target stores K/V as float8 e4m3 with static
scales (:mod:`specparity.engines.inprocess.kvcache`), in every forward of ``target.model`` whoever makes it:
a hook on the model quantizes the writes of any cache it is given and gives a float8 cache to a
forward given none. The baseline, the batched baseline, teacher-forced scoring, transformers'
``generate`` and a loop's own ``target.model(...)`` calls (with or without its own
``DynamicCache``) therefore read the same kind of K/V; a draft model is not touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from specparity.engines.base import Capabilities, EngineOptions
from specparity.engines.common import (
    artifact,
    finish_reason,
    load_tokenizer,
    scores_from_logits,
    set_threads,
    torch_dtype,
)
from specparity.engines.inprocess.kvcache import KVCacheSpec, resolve_kv_options
from specparity.model.force_reject import DraftCorruptor, ForceReject
from specparity.model.locations import fixture_dir
from specparity.model.prompts import encode_prompt
from specparity.model.types import (
    ArtifactId,
    Fingerprint,
    GenerationRequest,
    GenerationResult,
    SpecStats,
    StepRecord,
    TokenScores,
)


@dataclass
class LoopOutput:
    """What one speculative decode produced: new tokens, their logits rows, its verify steps."""

    output_ids: list[int]
    rows: Sequence[Any]  # torch.Tensor [vocab] per output token
    steps: list[StepRecord]
    source: str  # where the counters come from, for the report
    wall_s: float | None = None  # the loop's own timing, if it excludes set-up work


@runtime_checkable
class SpeculativeLoop(Protocol):
    """A draft-and-verify decoder over a :class:`TorchTarget` (the part a plugin writes)."""

    name: str

    def run(self, target: "TorchTarget", request: GenerationRequest) -> LoopOutput:
        """Decode ``request`` greedily with speculation; raise on failure (the engine turns it into
        an ``error`` result for this request only)."""

    def spec_config(self) -> dict[str, Any]:
        """The speculative settings that decide its numerics (part of the fingerprint)."""

    def draft_artifact(self) -> ArtifactId | None:
        """The draft's identity (path, content hash, kind), or None (e.g. prompt lookup)."""


@dataclass
class TorchTarget:
    """The target model and tokenizer, and what every in-process engine does with them."""

    path: str
    dtype_name: str = "float32"
    attn_implementation: str = "sdpa"
    threads: int | None = 1
    stop_ids_override: tuple[int, ...] | None = None
    #: ``--kv-cache-dtype`` (None/"auto" or "fp8_e4m3") and ``--engine-opt kv_scales`` (fp8 only).
    kv_cache_dtype: str | None = None
    kv_scales: str | None = None
    #: ``--device``: where the target runs ("cpu", "cuda", "cuda:N"); a loop puts its draft there too.
    device: str = "cpu"
    #: ``--force-reject``: None, "all" or "random"; a loop asks :meth:`draft_corruptor` per request.
    force_reject: str | None = None
    model: Any = field(init=False, repr=False)
    tokenizer: Any = field(init=False, repr=False)
    #: The target's KV cache (``auto`` or fp8 with its static scales); under fp8 every forward of
    #: ``model`` goes through it (:func:`specparity.engines.inprocess.kvcache.install_guard`).
    kv: KVCacheSpec = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        resolve_kv_options(self.kv_cache_dtype, self.kv_scales)  # a bad value fails before the model loads
        set_threads(self.threads)
        self.torch = torch
        # local_files_only: a path typo must fail here, never turn into a model-hub download.
        self.tokenizer = load_tokenizer(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=torch_dtype(self.dtype_name), attn_implementation=self.attn_implementation,
            local_files_only=True,
        ).eval().to(self.device)
        # static scales, calibrated once here (before the hook): the same for the baseline, the
        # scoring and the loop; then every forward of the target stores its K/V through them
        self.kv = KVCacheSpec.load(self.model, self.tokenizer, self.kv_cache_dtype, self.kv_scales)
        self._kv_hooks = self.kv.install(self.model)
        self._stop_ids = self.stop_ids_override or self._eos_ids()
        self._artifact: ArtifactId | None = None
        self._force_reject = (ForceReject.for_tokenizer(self.force_reject, self.tokenizer,
                                                        int(self.model.config.vocab_size), self._stop_ids)
                              if self.force_reject else None)

    @classmethod
    def from_options(cls, options: EngineOptions) -> "TorchTarget":
        """The target named by ``--target`` (default: the committed fixture), with ``--dtype``,
        ``--threads``, ``--kv-cache-dtype`` and the ``attn_implementation`` / ``stop_token_ids`` /
        ``kv_scales`` engine options."""
        stop = options.extra.get("stop_token_ids")
        if isinstance(stop, str):  # options not passed through check_options (a direct construction)
            from specparity.engines.base import parse_int_list

            stop = parse_int_list(stop)
        return cls(
            str(options.target or fixture_dir("target")),
            dtype_name=options.dtype,
            attn_implementation=str(options.extra.get("attn_implementation", "sdpa")),
            threads=options.threads,
            stop_ids_override=tuple(stop) if stop else None,
            kv_cache_dtype=options.kv_cache_dtype,
            kv_scales=options.extra.get("kv_scales"),
            device=options.device,
            force_reject=options.force_reject,
        )

    # ------------------------------------------------------------------ tokenizer side
    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = self.model.generation_config.eos_token_id
        for value in (eos if isinstance(eos, list) else [eos]) + [self.tokenizer.eos_token_id]:
            if value is not None and value not in ids:
                ids.append(int(value))
        return tuple(ids)

    def draft_corruptor(self, req: GenerationRequest) -> DraftCorruptor | None:
        """Under ``--force-reject``: the object that rewrites this request's drafts before each
        verify (:meth:`DraftCorruptor.corrupt`); None otherwise. A loop that supports forced
        rejection calls it once per request and passes every block of drafts through it."""
        return self._force_reject.for_request(req.request_id) if self._force_reject else None

    # ------------------------------------------------------------------ decoding and scoring
    def new_cache(self) -> Any:
        """A fresh KV cache for the target: an :class:`~specparity.engines.inprocess.kvcache.Fp8KVCache` under
        ``--kv-cache-dtype fp8_e4m3``, None under ``auto``. Optional for a loop: under fp8 any cache
        the target is given is quantized anyway."""
        return self.kv.new_cache(self.model)

    def generation_config(self, req: GenerationRequest):
        """Greedy settings for ``model.generate`` (used by the baseline and by assisted generation)."""
        from transformers import GenerationConfig

        stop = list(req.stop_token_ids or self._stop_ids)
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=req.max_new_tokens,
            eos_token_id=stop,
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stop[0],
            return_dict_in_generate=True,
            output_logits=True,
        )

    def greedy(self, req: GenerationRequest) -> GenerationResult:
        """The baseline: the target's own ``generate(do_sample=False)``, no speculation."""
        out, wall = self.hf_generate(req)
        return self.result(req, out.sequences[0, len(req.prompt_ids):].tolist(), self.logits_rows(out),
                           SpecStats.unavailable("speculation off"), wall)

    def greedy_batch(self, reqs: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """The baseline of several requests decoded together in one left-padded batch (batching
        invariance): each row is cut at its own stop token or limit, with its own logits rows."""
        torch = self.torch
        if not reqs:
            return []
        stop = sorted({t for r in reqs for t in (r.stop_token_ids or self._stop_ids)})
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stop[0]
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in reqs], dtype=torch.long,
                           device=self.device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs], dtype=torch.long,
                            device=self.device)
        config = self.generation_config(reqs[0])
        config.max_new_tokens = max(r.max_new_tokens for r in reqs)
        config.eos_token_id = stop
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=config)
        wall = (time.perf_counter() - t0) / len(reqs)
        results = []
        for b, req in enumerate(reqs):
            row_stops = set(req.stop_token_ids or self._stop_ids)
            new = out.sequences[b, width:].tolist()[: req.max_new_tokens]
            end = next((i + 1 for i, t in enumerate(new) if t in row_stops), len(new))
            rows = [step[b] for step in out.logits[:end]]
            results.append(self.result(req, new[:end], rows, SpecStats.unavailable("batched baseline"), wall))
        return results

    def hf_generate(self, req: GenerationRequest, **kwargs: Any):
        """``model.generate`` on ``req`` with greedy settings (``kwargs`` may add an assistant);
        returns the output and its wall time."""
        torch = self.torch
        ids = torch.tensor([list(req.prompt_ids)], dtype=torch.long, device=self.device)
        kwargs.setdefault("generation_config", self.generation_config(req))
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out, time.perf_counter() - t0

    @staticmethod
    def logits_rows(out: Any) -> list[Any]:
        return [step[0] for step in out.logits] if out.logits else []

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        torch = self.torch
        if not continuation_ids:
            return TokenScores.empty(top_k)
        ids = torch.tensor([list(prompt_ids) + list(continuation_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0]
        n = len(prompt_ids)
        return scores_from_logits(logits[n - 1 : n - 1 + len(continuation_ids)], continuation_ids, top_k)

    def result(self, req: GenerationRequest, new_ids: list[int], rows: Sequence[Any], spec: SpecStats,
               wall: float) -> GenerationResult:
        """A result from the output ids and one logits row per output token (the row that chose it)."""
        stop = req.stop_token_ids or self._stop_ids
        scores = (
            scores_from_logits(self.torch.stack(list(rows[: len(new_ids)])), new_ids, req.top_k)
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

    # ------------------------------------------------------------------ identity
    def artifact(self) -> ArtifactId:
        if self._artifact is None:
            self._artifact = artifact(self.path)
        return self._artifact

    def device_label(self) -> str:
        """The device in the fingerprint: "cpu", or the CUDA device with its name (kernels differ by GPU)."""
        if self.device == "cpu":
            return "cpu"
        return f"{self.device} ({self.torch.cuda.get_device_name(self.torch.device(self.device))})"

    @staticmethod
    def version() -> str:
        import torch
        import transformers

        return f"transformers {transformers.__version__}, torch {torch.__version__}"

    def close(self) -> None:
        for hook in getattr(self, "_kv_hooks", ()):
            hook.remove()
        self.model = None


class InProcessEngine:
    """The engine protocol over a :class:`TorchTarget` and a :class:`SpeculativeLoop`.

    One request at a time (torch in-process; ``capabilities().max_concurrency == 1``). A request
    whose loop raises becomes an ``error`` result for that request only.
    """

    def __init__(self, target: TorchTarget, loop: SpeculativeLoop, *, name: str | None = None,
                 version: str = "", extra: dict[str, Any] | None = None):
        self.target = target
        self.loop = loop
        self.name = name or loop.name
        self._version = version
        self._extra = extra or {}
        self._fingerprint: Fingerprint | None = None

    # ------------------------------------------------------------------ protocol
    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        return self.target.encode_prompt(prompt, messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.target.decode(token_ids)

    def stop_token_ids(self) -> tuple[int, ...]:
        return self.target.stop_token_ids()

    def generate(self, requests: Sequence[GenerationRequest], *, speculative: bool) -> list[GenerationResult]:
        results = []
        for req in requests:
            try:
                results.append(self.speculative(req) if speculative else self.target.greedy(req))
            except Exception as exc:  # noqa: BLE001 - one failed request must not lose the others
                results.append(GenerationResult.failed(req.request_id, f"{type(exc).__name__}: {exc}"))
        return results

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Plain decode of ``requests`` in one batch (optional protocol method, used by the batching
        invariance check; engines without it are batched by concurrent requests)."""
        return self.target.greedy_batch(requests)

    def speculative(self, req: GenerationRequest) -> GenerationResult:
        t0 = time.perf_counter()
        with self.target.torch.inference_mode():
            out = self.loop.run(self.target, req)
        wall = out.wall_s if out.wall_s is not None else time.perf_counter() - t0
        return self.target.result(req, out.output_ids, out.rows, SpecStats.from_steps(out.steps, out.source), wall)

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        return self.target.score(prompt_ids, continuation_ids, top_k)

    def capabilities(self) -> Capabilities:
        return Capabilities(scoring=True, top_k=None, counters="steps", max_concurrency=1)

    def fingerprint(self) -> Fingerprint:
        if self._fingerprint is None:
            t = self.target
            self._fingerprint = Fingerprint(
                engine=self.name,
                engine_version=", ".join(v for v in (self._version, t.version()) if v),
                target=t.artifact(),
                draft=self.loop.draft_artifact(),
                dtype=t.dtype_name,
                spec_config=self.loop.spec_config(),
                extra={"attn_implementation": t.attn_implementation, "threads": t.threads, "device": t.device_label(),
                       **t.kv.fingerprint_extra(), **self._extra},
            )
        return self._fingerprint

    def invalidate_fingerprint(self) -> None:
        """Call after changing the loop's settings in place (e.g. a block-size sweep)."""
        self._fingerprint = None

    def close(self) -> None:
        close = getattr(self.loop, "close", None)
        if callable(close):
            close()
        self.target.close()
