"""The ``dflash`` engine: the reference DFlash / DFlash2 block-diffusion decoder (PyPI ``dflash``).

Baseline: the target's plain greedy decode (:meth:`~specparity.engines.inprocess.loop.TorchTarget.greedy`).
Speculative (:class:`DFlashLoop`): ``dflash.model.dflash_generate`` with a ``DFlash2DraftModel`` (``--spec-mode dflash2``,
the default) or a ``DFlashDraftModel`` (``--spec-mode dflash1``) at a configurable block size
(``--num-draft-tokens``; default: the draft config's ``block_size``).

Counters are observed, not trusted: for the duration of one ``dflash_generate`` call a forward hook
on the target records every call's ``input_ids``, ``position_ids`` and logits. The first call is
the prefill (``logits_to_keep=1``); every later call verifies a block ``[anchor at position start,
draft tokens…]`` whose logits row ``j`` predicts position ``start + 1 + j``. Consecutive verify
starts give the tokens each step produced; the block gives what was proposed. The same call runs
with ``return_stats=True`` and the per-step counts it reports (``acceptance_lengths``) must equal the
hook-derived ones, or the request fails as an engine error. ``return_stats=True`` times with
``torch.cuda.synchronize()``, which raises on a CPU-only torch: while the call runs,
``dflash.model._cuda_time`` is swapped for ``time.perf_counter`` (scoped, restored afterwards; the
package itself is not modified). See ``docs/DFLASH.md``.

``--kv-cache-dtype fp8_e4m3``: ``dflash_generate`` builds its own target cache
(``dflash.model._make_cache``, a ``DynamicCache``) and passes it to every target forward; the
target's fp8 hook (:func:`specparity.engines.inprocess.kvcache.install_guard`) quantizes that cache's writes,
so the prefill and every verify block store float8 K/V like the baseline's decode. The draft model
and its own cache stay in the model dtype (the hook is on the target only).
"""

from __future__ import annotations

import importlib.metadata
import json
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from specparity.engines.base import EngineInfo, EngineOptions, engine_factory, step_record
from specparity.engines.common import check_draft_given, torch_dtype
from specparity.engines.inprocess.hf import HF_OPTIONS
from specparity.engines.common import artifact
from specparity.engines.inprocess.loop import InProcessEngine, LoopOutput, TorchTarget
from specparity.engines.inprocess.kvcache import check_engine_options
from specparity.model.locations import fixture_dir
from specparity.model.force_reject import DraftCorruptor
from specparity.model.types import ArtifactId, GenerationRequest, StepRecord

#: spec mode -> (draft class name in config.json ``architectures``, fixture directory)
SPEC_MODES = {"dflash2": ("DFlash2DraftModel", "dflash2"), "dflash1": ("DFlashDraftModel", "dflash1")}
#: ``dflash_config`` keys a DFlash2 draft must carry; without them it silently runs as v1.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def check_options(options: EngineOptions) -> None:
    """The KV-cache options, and a DFlash draft when ``--target`` is given."""
    check_engine_options(options)
    check_draft_given(options, "dflash", options.spec_mode or "dflash2")


INFO = EngineInfo("dflash", spec_modes=tuple(SPEC_MODES), options=HF_OPTIONS, check=check_options,
                  counters="steps", force_reject=("all", "random"))
SOURCE = "target forward hook (verify blocks), cross-checked with dflash acceptance_lengths"


class DFlashLoadError(ValueError):
    """A draft that does not fit the spec mode or the target; raised at engine construction."""


@dataclass
class TargetCall:
    """One forward call of the target inside ``dflash_generate``."""

    input_ids: list[int]
    start: int  # position of input_ids[0]
    contiguous: bool  # position_ids == start .. start + len - 1
    logits: Any  # torch.Tensor [rows, vocab] in the model dtype


def _dflash_model():
    try:
        import dflash.model as dm
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DFlashLoadError(
            f"the dflash engine needs the `dflash` package ({exc}); install it without its [local] extra, which "
            f"pins torch and transformers exactly: `pip install dflash==0.1.0 --no-deps` (see docs/DFLASH.md)"
        ) from exc
    return dm


def _dflash_version() -> str:
    try:
        return importlib.metadata.version("dflash")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree / copied package
        return "(version unknown: no package metadata)"


@contextmanager
def host_timer(module: Any) -> Iterator[None]:
    """Make ``return_stats=True`` work without CUDA: swap ``module._cuda_time`` (which calls
    ``torch.cuda.synchronize()``) for ``time.perf_counter`` while the block runs, then restore it."""
    import torch

    original = getattr(module, "_cuda_time", None)
    if original is None or torch.cuda.is_available():
        yield
        return
    module._cuda_time = time.perf_counter
    try:
        yield
    finally:
        module._cuda_time = original


@contextmanager
def capture_target_calls(model: Any) -> Iterator[list[TargetCall]]:
    """Record every forward call of ``model`` (input ids, start position, logits) while the block runs."""
    calls: list[TargetCall] = []

    def hook(_module, args, kwargs, output):
        ids = args[0] if args else kwargs.get("input_ids")
        ids = ids[0].tolist()
        pos = kwargs.get("position_ids")
        if pos is None:
            start, contiguous = -1, False
        else:
            p = pos[0].tolist()
            start = int(p[0])
            contiguous = p == list(range(start, start + len(ids)))
        calls.append(TargetCall(ids, start, contiguous, output.logits[0].detach()))

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


@contextmanager
def corrupting_drafts(draft: Any, corruptor: DraftCorruptor | None) -> Iterator[None]:
    """``--force-reject``: while the block runs, every block of drafts ``dflash_generate`` proposes
    goes through ``corruptor``. A DFlash2 draft's ``propose`` (greedy tokens) is wrapped; a DFlash v1
    draft's ``compute_logits`` is, so that its argmax is the corrupted token. Scoped to this instance
    and restored afterwards; the package is not modified. The hook on the target sees the corrupted
    block, so the step records count what the verify made of it."""
    if corruptor is None:
        yield
        return
    name = "propose" if hasattr(draft, "propose") else "compute_logits"
    original = getattr(draft, name)

    def propose(*args: Any, **kwargs: Any):
        tokens, indices, probs = original(*args, **kwargs)
        flat = tokens.reshape(-1)
        out = tokens.clone()
        out.reshape(-1)[:] = flat.new_tensor(corruptor.corrupt(flat.tolist()))
        return out, indices, probs

    def compute_logits(*args: Any, **kwargs: Any):
        logits = original(*args, **kwargs)  # [1, n, vocab]
        wanted = corruptor.corrupt(logits[0].argmax(-1).tolist())
        out = logits.clone()
        top = out.max()
        for i, tok in enumerate(wanted):
            out[0, i, tok] = top + 1.0
        return out

    setattr(draft, name, propose if name == "propose" else compute_logits)
    try:
        yield
    finally:
        delattr(draft, name)


def steps_from_calls(
    calls: Sequence[TargetCall],
    full_ids: Sequence[int],
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    stop_ids: Sequence[int],
) -> tuple[list[StepRecord], list[Any], list[int]]:
    """Rebuild the verify steps of one ``dflash_generate`` call from the target calls it made.

    Returns the step records, one logits row per output token (prefill row, then each verify
    step's first ``produced`` rows) and the per-step produced counts. Raises ``RuntimeError`` when
    the calls do not describe the stream (wrong prefill, a block whose anchor is not the stream's
    token at its start, non-contiguous positions, starts that do not advance).
    """
    n = prompt_len
    out_len = len(full_ids) - n
    if not calls:
        raise RuntimeError("instrumentation saw no target call")
    pre = calls[0]
    if pre.input_ids != list(full_ids[:n]) or pre.start not in (0, -1):
        raise RuntimeError("the first target call is not the prefill of the prompt")
    rows = [pre.logits[-1]]
    verifies = calls[1:]
    starts = [c.start for c in verifies]
    ends = starts[1:] + [len(full_ids) - 1]
    produced: list[int] = []
    steps: list[StepRecord] = []
    max_length = n + max_new_tokens
    for c, start, end in zip(verifies, starts, ends):
        if not c.contiguous:
            raise RuntimeError(f"verify call at {start}: position_ids are not contiguous")
        if not n <= start < len(full_ids) or c.input_ids[0] != full_ids[start]:
            raise RuntimeError(f"verify call at {start}: the block's anchor is not the stream's token at {start}")
        k = end - start
        if k < 1 or k > len(c.input_ids):
            raise RuntimeError(f"verify call at {start}: the next step starts at {end}, {k} tokens later")
        produced.append(k)
        rows.extend(c.logits[i] for i in range(k))
        steps.append(
            step_record(
                c.input_ids[1:],
                full_ids[start + 1 : start + 1 + k],
                nominal_width=block_size - 1,
                budget_before=max_length - start - 1,
                stop_ids=stop_ids,
            )
        )
    if len(rows) != out_len:
        raise RuntimeError(f"{len(rows)} logits rows for {out_len} output tokens")
    return steps, rows, produced


class DFlashLoop:
    """``dflash_generate`` with a DFlash2 / DFlash v1 draft at a configurable block size, its verify
    steps rebuilt from a forward hook on the target and cross-checked with dflash's own counts."""

    name = "dflash"

    def __init__(self, target: TorchTarget, mode: str, draft_path: str, block_size: int | None):
        if mode not in SPEC_MODES:
            raise DFlashLoadError(f"--spec-mode: the dflash engine supports {sorted(SPEC_MODES)}, got {mode!r}")
        if block_size is not None and block_size < 1:
            raise DFlashLoadError(f"--num-draft-tokens: the block size must be >= 1, got {block_size}")
        self._dm = _dflash_model()
        self.mode = mode
        self.target_path = target.path
        self.draft_path = draft_path
        self.draft_kind, self.draft_config = self._check_draft_config(Path(draft_path), mode)
        self.draft = self._load_draft(target)
        self.block_size = int(block_size or self.draft.block_size)
        self._draft_artifact: ArtifactId | None = None

    def set_block_size(self, block_size: int) -> None:
        if int(block_size) < 1:
            raise DFlashLoadError(f"block size must be >= 1, got {block_size}")
        self.block_size = int(block_size)

    # ------------------------------------------------------------------ loading
    @staticmethod
    def _check_draft_config(path: Path, mode: str) -> tuple[str, dict[str, Any]]:
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise DFlashLoadError(f"--draft {path}: cannot read config.json ({exc})") from None
        archs = cfg.get("architectures") or []
        kind = archs[0] if archs else ""
        want = SPEC_MODES[mode][0]
        dcfg = cfg.get("dflash_config") or {}
        has_v2_keys = [k for k in DFLASH2_KEYS if k in dcfg or k in cfg]
        if kind not in ("DFlash2DraftModel", "DFlashDraftModel"):
            hint = (
                f" (its dflash_config has the DFlash2 keys {has_v2_keys}: add architectures: [\"DFlash2DraftModel\"])"
                if has_v2_keys
                else ""
            )
            raise DFlashLoadError(
                f"--draft {path}: config.json architectures {archs!r} names no DFlash draft "
                f"(expected DFlash2DraftModel or DFlashDraftModel){hint}"
            )
        if kind != want:
            other = next(m for m, (k, _) in SPEC_MODES.items() if k == kind)
            raise DFlashLoadError(
                f"--spec-mode {mode} needs a {want} draft, but {path} is a {kind}; "
                f"pass --spec-mode {other} or a {want} with --draft"
            )
        if kind == "DFlash2DraftModel":
            missing = [k for k in DFLASH2_KEYS if k not in has_v2_keys]
            if missing:
                raise DFlashLoadError(f"--draft {path}: a DFlash2DraftModel config without dflash_config keys {missing}")
        return kind, cfg

    def _load_draft(self, target: TorchTarget):
        dm = self._dm
        cls = dm.DFlash2DraftModel if self.draft_kind == "DFlash2DraftModel" else dm.DFlashDraftModel
        draft, info = cls.from_pretrained(
            self.draft_path, dtype=torch_dtype(target.dtype_name), output_loading_info=True, local_files_only=True
        )
        # A tensor the checkpoint lacks keeps its init (``base_kernel`` is torch.empty); a tensor it
        # has under a name no parameter matches is dropped. Either loads "successfully" and then
        # accepts almost nothing (docs/DFLASH.md): refuse both.
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            bad = sorted(info.get(key) or [])
            if bad:
                raise DFlashLoadError(
                    f"--draft {self.draft_path}: {key.replace('_', ' ')} loading it as {self.draft_kind}: "
                    f"{bad[:6]}{' …' if len(bad) > 6 else ''}"
                )
        draft = draft.eval().to(target.device)
        t, d = target.model.config, draft.config
        layers = list(draft.target_layer_ids)
        problems = []
        if d.hidden_size != t.hidden_size:
            problems.append(f"hidden_size {d.hidden_size} != target {t.hidden_size}")
        if draft.fc.in_features != len(layers) * t.hidden_size:
            problems.append(f"fc takes {draft.fc.in_features} features, target_layer_ids {layers} give "
                            f"{len(layers) * t.hidden_size}")
        if not layers or max(layers) >= t.num_hidden_layers or min(layers) < 0:
            problems.append(f"target_layer_ids {layers} outside the target's {t.num_hidden_layers} layers")
        if draft.mask_token_id is None or not 0 <= int(draft.mask_token_id) < t.vocab_size:
            problems.append(f"mask_token_id {draft.mask_token_id!r} outside the target vocabulary")
        sel = getattr(draft, "candidate_selector", None)
        if sel is not None and sel.successor_codebook.num_embeddings != t.vocab_size:
            problems.append(f"selector codebooks cover {sel.successor_codebook.num_embeddings} tokens, "
                            f"target vocab {t.vocab_size}")
        if problems:
            raise DFlashLoadError(f"--draft {self.draft_path} does not fit target {self.target_path}: "
                                  + "; ".join(problems))
        return draft

    # ------------------------------------------------------------------ identity
    def spec_config(self) -> dict[str, Any]:
        draft = self.draft
        spec: dict[str, Any] = {
            "mode": self.mode,
            "draft_kind": self.draft_kind,
            "block_size": self.block_size,
            "draft_block_size": int(draft.block_size),
            "target_layer_ids": [int(i) for i in draft.target_layer_ids],
            "mask_token_id": int(draft.mask_token_id),
            "temperature": 0.0,
        }
        if self.draft_kind == "DFlash2DraftModel":
            dcfg = self.draft_config.get("dflash_config") or {}
            spec.update({k: dcfg.get(k, self.draft_config.get(k)) for k in DFLASH2_KEYS})
        return spec

    def draft_artifact(self) -> ArtifactId:
        if self._draft_artifact is None:
            self._draft_artifact = artifact(self.draft_path, self.draft_kind)
        return self._draft_artifact

    def close(self) -> None:
        self.draft = None

    # ------------------------------------------------------------------ speculative path
    def run_dflash(self, target: TorchTarget, prompt_ids: Sequence[int], max_new_tokens: int,
                   stop_ids: Sequence[int], corruptor: DraftCorruptor | None = None):
        """One instrumented ``dflash_generate`` call: (stats namespace, target calls, wall seconds).
        ``corruptor`` (``--force-reject``) rewrites every block of drafts before the target verifies it."""
        torch = target.torch
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.model.device)
        with capture_target_calls(target.model) as calls, host_timer(self._dm), warnings.catch_warnings(), \
                corrupting_drafts(self.draft, corruptor):
            # dflash passes ``past_key_values=``; transformers >= 5.x warns it goes away in 5.40 (docs/DFLASH.md)
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            t0 = time.perf_counter()
            stats = self._dm.dflash_generate(
                self.draft,
                target.model,
                ids,
                max_new_tokens,
                list(stop_ids),
                temperature=0.0,
                block_size=self.block_size,
                return_stats=True,
            )
            wall = time.perf_counter() - t0
        return stats, calls, wall

    def run(self, target: TorchTarget, req: GenerationRequest) -> LoopOutput:
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        stop = tuple(req.stop_token_ids or target.stop_token_ids())
        stats, calls, wall = self.run_dflash(target, req.prompt_ids, req.max_new_tokens, stop,
                                             target.draft_corruptor(req))
        full = stats.output_ids[0].tolist()
        n = len(req.prompt_ids)
        if full[:n] != list(req.prompt_ids):
            raise RuntimeError("dflash_generate's output does not start with the prompt")
        steps, rows, produced = steps_from_calls(calls, full, n, req.max_new_tokens, self.block_size, stop)
        reported = [int(x) for x in stats.acceptance_lengths]
        if produced != reported:
            raise RuntimeError(
                f"instrumentation disagrees with dflash: hook-derived tokens per step {produced} != "
                f"acceptance_lengths {reported}"
            )
        return LoopOutput(full[n:], rows, steps, SOURCE, wall)



class DFlashEngine(InProcessEngine):
    """``dflash_generate`` against the target's own greedy decode, one request at a time (batch 1)."""

    def __init__(self, options: EngineOptions, *, loop_factory: Any = None, name: str = "dflash"):
        """``loop_factory(target, mode, draft_path, block_size)`` builds the loop (default
        :class:`DFlashLoop`; the broken DFlash loops in ``tests/`` pass their own)."""
        mode = options.spec_mode or "dflash2"
        if mode not in SPEC_MODES:
            raise DFlashLoadError(f"--spec-mode: the dflash engine supports {sorted(SPEC_MODES)}, got {mode!r}")
        if options.num_draft_tokens is not None and options.num_draft_tokens < 1:
            raise DFlashLoadError(f"--num-draft-tokens: the block size must be >= 1, got {options.num_draft_tokens}")
        check_draft_given(options, "dflash", mode)
        _dflash_model()  # a missing package is one clear error before the target loads
        target = TorchTarget.from_options(options)
        draft = str(options.draft or fixture_dir(SPEC_MODES[mode][1]))
        loop = (loop_factory or DFlashLoop)(target, mode, draft, options.num_draft_tokens)
        super().__init__(target, loop, name=name, version=f"dflash {_dflash_version()}")

    # conveniences for sweeps and tests
    @property
    def spec_mode(self) -> str:
        return self.loop.mode

    @property
    def draft(self):
        return self.loop.draft

    @property
    def block_size(self) -> int:
        return self.loop.block_size

    def set_block_size(self, block_size: int) -> None:
        """Change the block size (verify width: anchor + ``block_size - 1`` draft tokens) in place;
        the fingerprint follows. Sweeps use this to reuse one loaded engine."""
        self.loop.set_block_size(block_size)
        self.invalidate_fingerprint()

    def run_dflash(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int]):
        return self.loop.run_dflash(self.target, prompt_ids, max_new_tokens, stop_ids)


@engine_factory(INFO)
def create(options: EngineOptions) -> DFlashEngine:
    return DFlashEngine(options)
