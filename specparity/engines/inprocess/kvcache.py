"""A float8 (e4m3) KV cache for the in-process engines, with static scales, as SGLang stores it.

Why
---
The one non-exact prompt seen in production came from SGLang serving with
``--kv-cache-dtype fp8_e4m3``. To let CI produce *real* fp8 flips on the committed fixtures on a
CPU, every engine built on :class:`~specparity.engines.inprocess.loop.TorchTarget` (``hf``, ``dflash``,
plugins) takes ``--kv-cache-dtype fp8_e4m3`` (:attr:`EngineOptions.kv_cache_dtype`): every key and
value an attention layer writes to its cache is stored as ``torch.float8_e4m3fn`` and read back
dequantized, i.e. round-tripped::

    x  ->  (x / scale).clamp(-448, 448).to(float8_e4m3fn).to(float32) * scale  ->  model dtype

What SGLang does (read from its source, ``sgl-project/sglang``; not copied):

* ``model_runner``: ``--kv-cache-dtype fp8_e4m3`` makes the KV pool dtype ``torch.float8_e4m3fn``
  (``float8_e4m3fnuz`` on ROCm); ``auto`` keeps the model dtype.
* ``mem_cache/memory_pool.py`` ``MHATokenToKVPool.set_kv_buffer``: when the incoming K/V dtype is
  not the pool dtype, K is divided by ``k_scale`` and V by ``v_scale`` (when the layer has them)
  and cast to the fp8 dtype before being written; the attention backends read the pool with
  ``k_scale`` / ``v_scale`` to dequantize.
* ``layers/quantization/kv_cache.py`` ``BaseKVCacheMethod.process_weights_after_loading``: the
  scales come from the checkpoint (one ``k_scale`` / ``v_scale`` per attention layer, or one
  ``kv_scale`` for both); when the checkpoint has none, ``k_scale = v_scale = 1.0``; anything but
  a per-tensor float is refused ("Only support per-tensor scaling factor for fp8 KV cache").
  vLLM logs "Using KV cache scaling factor 1.0 for fp8_e4m3 ... may cause accuracy issues" in
  that case.

So the scales are **static**: fixed at load, never recomputed per write. That matters for a
parity gate: a scale recomputed from each update's own amax (transformers' ``Fp8QuantizedLayer``
freezes it after the *first* update, whose size differs between a prefill, a verify block and a
decode step) would make decode and verify quantize the same key differently — an engine bug, not
the numerics a production fp8 cache has.

Scale modes (``--engine-opt kv_scales=...``):

* ``per_tensor`` (default): ``k_scale = v_scale = 1.0`` for every layer — what SGLang does with
  ``--kv-cache-dtype fp8_e4m3`` and a checkpoint without scales, the production configuration.
* ``per_layer``: one calibrated k/v scale per attention layer (amax / 448) — what SGLang does with
  a calibrated fp8 checkpoint (its only supported granularity).
* ``per_head``: one calibrated scale per layer and per KV head (amax / 448) — finer than SGLang
  supports (vLLM's per-attention-head scheme); for comparison.

Calibration runs once at engine load: :data:`CALIBRATION_TEXT` (fixed, independent of the prompt
suite) through the target with an unquantized cache, amax of every layer's (and head's) K and V.
Deterministic, and the same scales serve the baseline, the teacher-forced scoring and the
speculative run. Values above the calibrated amax saturate at ±448 × scale, as they do in SGLang
with a calibrated checkpoint.

Where the round trip applies: in every forward of the target, whoever makes it. A forward
pre-hook on the target (:func:`install_guard`) wraps the ``update`` of any cache the forward is
given — the ``DynamicCache`` transformers' ``generate`` builds, dflash's own target cache, a plugin
loop's own cache (:func:`quantize_cache`) — and gives a fresh :class:`Fp8KVCache` to a forward given
none (teacher-forced scoring, a loop's plain ``model(ids)``). The round trip happens in ``update``,
before the layer stores anything, and ``update`` returns the dequantized keys/values — so the
tokens of the current forward (a prefill, a verify block, a decode step, a teacher-forced pass)
attend to the quantized K/V of themselves and their prefix alike, and decode, verify and
teacher-forced scoring see the same values up to kernel noise. (SGLang's FlashInfer *ragged*
prefill path attends to the new chunk's own K/V before they are written, unquantized; its decode
and target-verify read them back from the fp8 pool. Modelling that would make a teacher-forced
prefill and a decode differ by the full fp8 error by construction; here both read the cache.)
Only attention layers write K/V through ``update``: linear-attention / mamba state of a hybrid
target stays in the model dtype, and so does the draft model's own cache (transformers' assistant
builds its own ``DynamicCache``; dflash's draft cache is created from the draft's config and left
alone) — only the target's cache is fp8, as in SGLang, whose draft KV pool is a separate one.

This module imports neither torch nor transformers at import time (``KV_CACHE_DTYPES`` and the
checks serve the command line before any model loads); :class:`Fp8KVCache` is built on first use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

#: ``--kv-cache-dtype`` values (``None`` means ``auto``: the model dtype, unchanged behaviour).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
#: ``--engine-opt kv_scales=`` values; the first is the default.
KV_SCALE_MODES = ("per_tensor", "per_layer", "per_head")
DEFAULT_KV_SCALES = KV_SCALE_MODES[0]
#: Largest finite float8 e4m3fn value (``torch.finfo(torch.float8_e4m3fn).max``).
FP8_E4M3_MAX = 448.0

#: Fixed calibration text for ``per_layer`` / ``per_head`` scales: prose, a list, code, numbers and
#: a chat turn, so every kind of token the suites use moves through the target once.
CALIBRATION_TEXT = (
    "<|im_start|>user\nExplain in two short paragraphs why the sky is blue, then list three "
    "facts about the ocean.<|im_end|>\n<|im_start|>assistant\n"
    "Sunlight is made of many colours. When it passes through the air, the short blue waves are "
    "scattered far more than the long red ones, so blue light reaches our eyes from every part of "
    "the sky. At sunset the light travels through much more air, the blue is scattered away, and "
    "the sky turns orange and red.\n\n"
    "1. The ocean covers about 71 percent of the Earth.\n"
    "2. Its deepest point, the Challenger Deep, is nearly 11,000 metres down.\n"
    "3. Most of the oxygen we breathe comes from tiny plants that live in the sea.<|im_end|>\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])  # 0 1 1 2 3 5 8 13 21 34\n"
    "Once upon a time, a little girl named Lily found a shiny red ball in the park. She asked her "
    "mom if she could keep it, and her mom said yes. They played together until the sun went down. "
    "SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC;\n"
    "The quick brown fox jumps over the lazy dog. 12 + 30 = 42; 7 * 8 = 56; 2 ** 10 = 1024."
)


def normalize_kv_cache_dtype(value: Any) -> str:
    """``"auto"`` or ``"fp8_e4m3"`` for an :attr:`EngineOptions.kv_cache_dtype` value (``None`` is
    ``auto``); anything else is a ``ValueError`` naming ``--kv-cache-dtype``."""
    if value is None:
        return "auto"
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {value!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return value


def resolve_kv_options(kv_cache_dtype: Any, kv_scales: Any = None) -> tuple[str, str | None]:
    """(dtype, scale mode) from ``--kv-cache-dtype`` and ``--engine-opt kv_scales``: the mode is None
    for ``auto``, the default mode when fp8 is asked without one. A scale mode without fp8 is refused
    (it would be silently ignored)."""
    dtype = normalize_kv_cache_dtype(kv_cache_dtype)
    if kv_scales is not None and kv_scales not in KV_SCALE_MODES:
        raise ValueError(f"--engine-opt kv_scales={kv_scales!r}: expected one of {', '.join(KV_SCALE_MODES)}")
    if dtype == "auto":
        if kv_scales is not None:
            raise ValueError(f"--engine-opt kv_scales={kv_scales}: applies only with --kv-cache-dtype fp8_e4m3 "
                             f"(the KV cache is in the model dtype)")
        return dtype, None
    return dtype, kv_scales or DEFAULT_KV_SCALES


def check_engine_options(options: Any) -> None:
    """``EngineInfo.check`` for engines built on ``TorchTarget``: torch is installed, and the
    KV-cache options, before any model loads."""
    require_torch()
    resolve_kv_options(getattr(options, "kv_cache_dtype", None), (options.extra or {}).get("kv_scales"))


def require_torch() -> None:
    """In-process engines run the models here and need torch; the server engines do not, so torch is
    an optional dependency (``specparity[torch]``). Without it: one line naming the fix, exit code 4,
    instead of an import error from deep inside an engine."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):  # a None entry in sys.modules: import blocked
        spec = None
    if spec is None:
        from specparity.engines import SERVER_ENGINES

        raise ValueError("--engine: this engine runs the models in this process and needs torch, which is not "
                         "installed (pip install torch==2.13.0 for the CPU wheel, or pip install 'specparity[torch]'); "
                         f"the server engines ({', '.join(SERVER_ENGINES)}) need no torch")


# ---------------------------------------------------------------------------------------------- numerics
def fp8_round_trip(x: Any, scale: Any = 1.0) -> Any:
    """``x`` stored as float8 e4m3 with ``scale`` and read back, in ``x``'s dtype.

    ``scale``: a float or a float32 tensor broadcastable to ``x`` (``[1, heads, 1, 1]`` against
    ``[batch, heads, seq, head_dim]``). Computed in float32; values beyond ±448 × scale saturate.
    """
    import torch

    if torch.is_tensor(scale):
        scale = scale.to(device=x.device, dtype=torch.float32)
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


@dataclass(frozen=True)
class KVScales:
    """Static dequantization scales: per attention layer, a float32 tensor (scalar for
    ``per_tensor`` / ``per_layer``, ``[1, kv_heads, 1, 1]`` for ``per_head``). ``per_tensor`` has no
    table: every layer is 1.0."""

    mode: str
    k: Mapping[int, Any] = field(default_factory=dict)
    v: Mapping[int, Any] = field(default_factory=dict)
    source: str = "1.0 for every layer (uncalibrated, SGLang's default without checkpoint scales)"

    def for_layer(self, layer_idx: int) -> tuple[Any, Any]:
        if self.mode == "per_tensor":
            return 1.0, 1.0
        try:
            return self.k[layer_idx], self.v[layer_idx]
        except KeyError:
            raise RuntimeError(f"fp8 KV cache: no calibrated {self.mode} scale for layer {layer_idx} "
                               f"(calibration saw layers {sorted(self.k)})") from None

    def digest(self) -> str:
        """sha256 of the scale values (identifies the calibration in the fingerprint)."""
        h = hashlib.sha256(self.mode.encode())
        for table in (self.k, self.v):
            for i in sorted(table):
                h.update(f"{i}:".encode() + table[i].float().cpu().numpy().tobytes())
        return "sha256:" + h.hexdigest()[:16]


def calibrate_scales(model: Any, tokenizer: Any, mode: str, text: str = CALIBRATION_TEXT) -> KVScales:
    """Static scales for ``mode``: ``per_tensor`` is 1.0; ``per_layer`` / ``per_head`` run ``text``
    through ``model`` once with an unquantized cache and take amax / 448 of every layer's K and V
    (over all tokens and channels; per KV head for ``per_head``)."""
    if mode not in KV_SCALE_MODES:
        raise ValueError(f"--engine-opt kv_scales={mode!r}: expected one of {', '.join(KV_SCALE_MODES)}")
    if mode == "per_tensor":
        return KVScales(mode)
    import torch
    from transformers import DynamicCache

    amax_k: dict[int, Any] = {}
    amax_v: dict[int, Any] = {}

    class _AmaxRecorder(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            amax_k[layer_idx] = key_states.detach().float().abs().amax(dim=(0, 2, 3))  # [kv_heads]
            amax_v[layer_idx] = value_states.detach().float().abs().amax(dim=(0, 2, 3))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): _AmaxRecorder(config=model.config)})
    if not amax_k:
        raise RuntimeError("fp8 KV cache calibration: the target wrote no K/V through its cache")
    tiny = torch.finfo(torch.float32).tiny

    def scale(amax):
        if mode == "per_layer":
            amax = amax.max()
        else:
            amax = amax.view(1, -1, 1, 1)
        return (amax / FP8_E4M3_MAX).clamp(min=tiny).cpu()

    text_id = "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]
    return KVScales(
        mode,
        {i: scale(a) for i, a in amax_k.items()},
        {i: scale(a) for i, a in amax_v.items()},
        f"amax/448 of {'each layer' if mode == 'per_layer' else 'each layer and KV head'} over the built-in "
        f"calibration text ({ids.shape[1]} tokens, {text_id})",
    )


# ---------------------------------------------------------------------------------------------- the cache
_CACHE_CLASS: Any = None


def cache_kwarg(model: Any) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` from transformers 5.24 (which
    renamed it), ``past_key_values`` before (5.15–5.23, e.g. the GPU machine's 5.17). A cache passed
    under the other name is silently ignored there (it lands in ``**kwargs``), so ask the signature."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _fp8_update(cache: Any, store: Any, key_states: Any, value_states: Any, layer_idx: int, *args: Any,
                **kwargs: Any) -> Any:
    """One quantized write: round-trip the new K/V with the layer's static scales, then let the
    cache's own ``update`` (``store``) keep them and return the (dequantized) keys and values."""
    k_scale, v_scale = cache.kv_scales.for_layer(layer_idx)
    cache.quantized_updates += 1
    return store(fp8_round_trip(key_states, k_scale), fp8_round_trip(value_states, v_scale), layer_idx,
                 *args, **kwargs)


def _fp8_cache_class() -> Any:
    """Build :class:`Fp8KVCache` on first use (transformers is imported only then)."""
    global _CACHE_CLASS
    if _CACHE_CLASS is not None:
        return _CACHE_CLASS
    from transformers import DynamicCache

    class Fp8KVCache(DynamicCache):
        """A ``DynamicCache`` that stores every key/value as float8 e4m3 with static scales: each
        ``update`` round-trips the new states (:func:`fp8_round_trip`) before the layer stores them
        and returns the dequantized cache. Linear-attention state does not pass through ``update``
        and is not touched. ``quantized_updates`` counts the updates."""

        def __init__(self, scales: KVScales, config: Any = None, **kwargs: Any):
            super().__init__(config=config, **kwargs)
            self.kv_scales = scales
            self.quantized_updates = 0

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return _fp8_update(self, super().update, key_states, value_states, layer_idx, *args, **kwargs)

    _CACHE_CLASS = Fp8KVCache
    return Fp8KVCache


def __getattr__(name: str) -> Any:  # PEP 562: ``from specparity.engines.inprocess.kvcache import Fp8KVCache``
    if name == "Fp8KVCache":
        return _fp8_cache_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def quantize_cache(cache: Any, scales: KVScales) -> Any:
    """Make an existing cache (any ``transformers`` ``Cache``: one a loop or dflash built itself)
    store fp8 from now on, by wrapping its ``update`` on the instance. A cache that already
    quantizes (an :class:`Fp8KVCache`, or one wrapped before) is left as it is."""
    if getattr(cache, "kv_scales", None) is not None:
        return cache
    # bound methods, not closures: a deep copy of the cache rebinds them to the copy
    cache._unquantized_update = cache.update
    cache.kv_scales = scales
    cache.quantized_updates = 0
    cache.update = types.MethodType(_wrapped_update, cache)
    return cache


def _wrapped_update(self: Any, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
    return _fp8_update(self, self._unquantized_update, key_states, value_states, layer_idx, *args, **kwargs)


def install_guard(model: Any, scales: KVScales) -> list[Any]:
    """Route every forward of ``model`` (the target) through the fp8 cache, whoever calls it: a
    forward pre-hook on the model (and on its base model, for loops that call that directly) wraps
    any cache it is given (:func:`quantize_cache`) and, when it is given none, passes a fresh
    :class:`Fp8KVCache` — so a teacher-forced pass, a plugin loop's ``model(ids)``, transformers'
    ``generate`` and dflash's own target cache all store and read fp8 K/V alike. Returns the hook
    handles (``.remove()`` undoes it). Other modules (a draft model) are not touched."""
    from transformers.cache_utils import Cache

    def guard_for(module: Any) -> Any:
        name = cache_kwarg(module)

        def guard(mod, args, kwargs):
            found = False
            for value in list(args) + list(kwargs.values()):
                if isinstance(value, Cache):
                    quantize_cache(value, scales)
                    found = True
            if not found:
                for alias in ("cache", "past_key_values"):
                    kwargs.pop(alias, None)  # None here
                kwargs[name] = _fp8_cache_class()(scales, config=model.config)
            return args, kwargs

        return guard

    handles = [model.register_forward_pre_hook(guard_for(model), with_kwargs=True)]
    base = getattr(model, "base_model", None)
    if base is not None and base is not model:
        handles.append(base.register_forward_pre_hook(guard_for(base), with_kwargs=True))
    return handles


@dataclass(frozen=True)
class KVCacheSpec:
    """What a :class:`~specparity.engines.inprocess.loop.TorchTarget` writes its K/V into: ``auto`` (the
    model dtype; ``new_cache`` returns None and every caller keeps transformers' own cache) or
    ``fp8_e4m3`` with static :class:`KVScales`."""

    dtype: str = "auto"
    scales: KVScales | None = None

    @property
    def quantized(self) -> bool:
        return self.dtype != "auto"

    @classmethod
    def load(cls, model: Any, tokenizer: Any, kv_cache_dtype: Any = None, kv_scales: Any = None) -> "KVCacheSpec":
        dtype, mode = resolve_kv_options(kv_cache_dtype, kv_scales)
        if dtype == "auto":
            return cls()
        return cls(dtype, calibrate_scales(model, tokenizer, mode or DEFAULT_KV_SCALES))

    def new_cache(self, model: Any) -> Any:
        """A fresh target cache for one forward / one ``generate`` (None: ``auto``)."""
        if not self.quantized:
            return None
        return _fp8_cache_class()(self.scales, config=model.config)

    def install(self, model: Any) -> list[Any]:
        """:func:`install_guard` on the target under fp8 (nothing under ``auto``); the hook handles."""
        return install_guard(model, self.scales) if self.quantized else []

    def fingerprint_extra(self) -> dict[str, Any]:
        if not self.quantized:
            return {"kv_cache_dtype": "auto"}
        assert self.scales is not None
        extra: dict[str, Any] = {"kv_cache_dtype": self.dtype, "kv_scales": self.scales.mode,
                                 "kv_scale_source": self.scales.source}
        if self.scales.mode != "per_tensor":
            extra["kv_scales_sha256"] = self.scales.digest()
        return extra
