"""The fp8 (e4m3) KV cache of the in-process engines (``--kv-cache-dtype fp8_e4m3``): the round trip,
static scales, that every target forward of both runs goes through it, the fingerprint, bad values."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from specparity.engines import EngineLoadError, load_engine
from specparity.engines.inprocess import kvcache
from specparity.engines.base import EngineOptions
from specparity.engines.inprocess.loop import TorchTarget
from specparity.engines.inprocess.kvcache import (
    FP8_E4M3_MAX,
    KV_CACHE_DTYPES,
    KVScales,
    calibrate_scales,
    fp8_round_trip,
    resolve_kv_options,
)
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.judge.noise import position_deltas
from specparity.model.types import GenerationRequest

MAX_NEW = 32


def e4m3_values() -> torch.Tensor:
    """Every finite float8 e4m3fn value, sorted (from the 256 bit patterns)."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return vals[torch.isfinite(vals)].unique().sort().values


# ---------------------------------------------------------------------------------------------- numerics
def test_representable_values_survive_the_round_trip():
    table = e4m3_values()
    assert table.max().item() == FP8_E4M3_MAX and table[table > 0].min().item() == 2.0 ** -9
    assert torch.equal(fp8_round_trip(table), table)
    # with a scale, the representable values are the table times the scale
    scale = torch.tensor(0.0123)
    assert torch.equal(fp8_round_trip(table * scale, scale), (table * scale))


def test_other_values_round_to_the_nearest_e4m3_step_and_saturate():
    table = e4m3_values()
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(20000, generator=gen) * 2 - 1) * 460  # includes a few beyond ±448
    x = torch.cat([x, torch.randn(20000, generator=gen) * 0.05])  # the subnormal range too
    got = fp8_round_trip(x)
    dist = (x[:, None].clamp(-448, 448) - table[None, :]).abs()
    best = dist.min(dim=1).values
    # the result is one of the nearest representable values (ties: either neighbour)
    assert torch.equal((got[:, None] == table[None, :]).any(dim=1), torch.ones_like(got, dtype=torch.bool))
    assert torch.allclose((got - x.clamp(-448, 448)).abs(), best)
    assert fp8_round_trip(torch.tensor([1.06, 1.07, 17.0, 500.0, -1e4])).tolist() == [1.0, 1.125, 16.0, 448.0, -448.0]


def test_round_trip_keeps_the_model_dtype():
    x = torch.randn(2, 2, 5, 8, dtype=torch.bfloat16)
    y = fp8_round_trip(x, torch.full((1, 2, 1, 1), 0.01))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert not torch.equal(y, x), "bf16 has more mantissa than e4m3: something must round"


def test_kv_cache_dtype_values_and_refusals():
    assert KV_CACHE_DTYPES == ("auto", "fp8_e4m3")
    assert resolve_kv_options(None) == ("auto", None) == resolve_kv_options("auto")
    assert resolve_kv_options("fp8_e4m3") == ("fp8_e4m3", "per_tensor")
    assert resolve_kv_options("fp8_e4m3", "per_head") == ("fp8_e4m3", "per_head")
    for bad in ("fp8", "fp8_e5m2", "FP8_E4M3", "int8", ""):
        with pytest.raises(ValueError, match=r"--kv-cache-dtype .*expected one of auto, fp8_e4m3"):
            resolve_kv_options(bad)
    with pytest.raises(ValueError, match=r"kv_scales=per_head: applies only with --kv-cache-dtype fp8_e4m3"):
        resolve_kv_options("auto", "per_head")
    with pytest.raises(ValueError, match=r"kv_scales='dynamic'"):
        resolve_kv_options("fp8_e4m3", "dynamic")


def test_the_module_imports_without_torch():
    """The lead validates ``--kv-cache-dtype`` against KV_CACHE_DTYPES before any model loads."""
    code = ("import sys; from specparity.engines.inprocess.kvcache import KV_CACHE_DTYPES, resolve_kv_options; "
            "resolve_kv_options('fp8_e4m3'); assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# ---------------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def engines():
    made = {
        "auto": load_engine("hf", EngineOptions()),
        "fp8": load_engine("hf", EngineOptions(kv_cache_dtype="fp8_e4m3")),
        "fp8_head": load_engine("hf", EngineOptions(kv_cache_dtype="fp8_e4m3", extra={"kv_scales": "per_head"})),
    }
    yield made
    for e in made.values():
        e.close()


@pytest.fixture(scope="module")
def dflash_fp8():
    eng = load_engine("dflash", EngineOptions(kv_cache_dtype="fp8_e4m3"))
    yield eng
    eng.close()


def _requests(engine, prompts, n=6, max_new=MAX_NEW):
    return [GenerationRequest(p.id, engine.encode_prompt(p.prompt, p.messages_as_dicts()), max_new,
                              engine.stop_token_ids()) for p in prompts[:n]]


@pytest.fixture
def spy(monkeypatch):
    """Every quantized K/V write (an ``Fp8KVCache`` or a cache the target's hook wrapped):
    (number of layers of that cache, layer index)."""
    seen: list[tuple[int, int]] = []
    original = kvcache._fp8_update

    def update(cache, store, key_states, value_states, layer_idx, *args, **kwargs):
        seen.append((len(cache.layers), layer_idx))
        return original(cache, store, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(kvcache, "_fp8_update", update)
    return seen


def test_per_head_scales_are_calibrated_once_per_layer_and_head(engines):
    target = engines["fp8_head"].target
    cfg = target.model.config
    scales = target.kv.scales
    assert scales.mode == "per_head" and sorted(scales.k) == sorted(scales.v) == list(range(cfg.num_hidden_layers))
    for table in (scales.k, scales.v):
        for s in table.values():
            assert s.shape == (1, cfg.num_key_value_heads, 1, 1) and s.dtype == torch.float32 and bool((s > 0).all())
    # deterministic: calibrating again gives the same scales
    again = calibrate_scales(target.model, target.tokenizer, "per_head")
    assert again.digest() == scales.digest()
    per_layer = calibrate_scales(target.model, target.tokenizer, "per_layer")
    assert all(per_layer.k[i].shape == () and torch.isclose(per_layer.k[i], scales.k[i].max()) for i in per_layer.k)
    assert KVScales("per_tensor").for_layer(7) == (1.0, 1.0)


def test_scales_are_static_across_updates(engines):
    """A later, larger update neither rescales what is stored nor changes the scales: it saturates."""
    target = engines["fp8_head"].target
    cache = target.new_cache()
    before = {i: s.clone() for i, s in target.kv.scales.k.items()}
    k0 = torch.randn(1, 2, 3, 64) * 0.5
    keys, _ = cache.update(k0, k0, 0)
    stored = keys.clone()
    huge = torch.full((1, 2, 1, 64), 1e6)
    keys, _ = cache.update(huge, huge, 0)
    assert torch.equal(keys[:, :, :3], stored), "the first update's keys were requantized"
    assert torch.allclose(keys[:, :, 3:], (FP8_E4M3_MAX * target.kv.scales.k[0]).expand(1, 2, 1, 64))
    assert all(torch.equal(before[i], target.kv.scales.k[i]) for i in before)
    assert cache.quantized_updates == 2


def test_every_target_forward_goes_through_the_fp8_cache(engines, default_prompts, spy):
    eng = engines["fp8"]
    layers = eng.target.model.config.num_hidden_layers
    req = _requests(eng, default_prompts, n=1)[0]
    base = eng.generate([req], speculative=False)[0]
    assert base.error is None and len(spy) >= layers * len(base.output_ids), "the greedy baseline"
    n = len(spy)
    eng.score(req.prompt_ids, base.output_ids, 5)
    assert len(spy) == n + layers, "teacher-forced scoring: one pass, every layer"
    n = len(spy)
    spec = eng.generate([req], speculative=True)[0]
    assert spec.error is None and len(spy) > n, "assisted generation's target forwards"
    n = len(spy)
    eng.generate_batch(_requests(eng, default_prompts, n=2))
    assert len(spy) > n, "the batched baseline"
    # only the target's cache is fp8: the assistant (1 layer) keeps its own
    assert {c for c, _ in spy} == {layers} and {i for _, i in spy} == set(range(layers))


def test_a_wrapped_cache_survives_a_deep_copy():
    """A cache the hook wrapped keeps quantizing after ``copy.deepcopy``, into the copy only."""
    import copy

    from transformers import DynamicCache

    cache = kvcache.quantize_cache(DynamicCache(), KVScales("per_tensor"))
    x = torch.full((1, 2, 1, 4), 1.07)
    cache.update(x, x, 0)
    twin = copy.deepcopy(cache)
    keys, _ = twin.update(x, x, 0)
    assert keys.shape[2] == 2 and bool((keys == 1.125).all()), "the copy stores fp8 values"
    assert cache.layers[0].keys.shape[2] == 1 and twin.quantized_updates == 2 and cache.quantized_updates == 1


def test_a_loops_own_target_forwards_are_quantized_too(engines, default_prompts, spy):
    """A plugin loop that calls ``target.model`` itself — without a cache, or with its own
    ``DynamicCache`` — stores fp8 K/V like the baseline: same rows as the teacher-forced scoring."""
    from transformers import DynamicCache

    eng = engines["fp8"]
    model = eng.target.model
    req = _requests(eng, default_prompts, n=1)[0]
    base = eng.generate([req], speculative=False)[0]
    ids = torch.tensor([list(req.prompt_ids) + base.output_ids])
    tf = eng.score(req.prompt_ids, base.output_ids, 5)
    n = len(spy)
    with torch.inference_mode():
        plain = model(input_ids=ids, use_cache=False).logits[0]
        own = DynamicCache(config=model.config)
        mine = model(input_ids=ids, past_key_values=own).logits[0]
    assert len(spy) == n + 2 * model.config.num_hidden_layers
    assert own.quantized_updates == model.config.num_hidden_layers and own.kv_scales is eng.target.kv.scales
    k = len(req.prompt_ids)
    rows = plain[k - 1 : k - 1 + len(base.output_ids)].log_softmax(-1)
    picked = rows.gather(1, torch.tensor(base.output_ids)[:, None])[:, 0].numpy()
    assert np.allclose(picked, tf.logprobs, atol=1e-6, rtol=0) and torch.equal(plain, mine)


def test_dflash_target_cache_is_fp8_and_the_draft_cache_is_not(dflash_fp8, default_prompts, spy):
    import dflash.model as dm

    original = dm._make_cache
    made: list = []

    def watch(config):
        cache = original(config)
        made.append(cache)
        return cache

    dm._make_cache = watch
    try:
        req = _requests(dflash_fp8, default_prompts, n=1)[0]
        res = dflash_fp8.generate([req], speculative=True)[0]
    finally:
        dm._make_cache = original
    assert res.error is None, res.error
    layers = dflash_fp8.target.model.config.num_hidden_layers
    target_cache, draft_cache = made  # dflash_generate: the target's, then the draft's
    assert target_cache.quantized_updates > 0 and {c for c, _ in spy} == {layers}, \
        "the prefill and the verify passes write through the fp8 round trip"
    assert getattr(draft_cache, "kv_scales", None) is None, "the draft's cache stays in the model dtype"


def test_fp8_changes_the_numbers_and_decode_and_scoring_quantize_alike(engines, default_prompts):
    """The fp8 baseline's margins move away from the auto baseline's (0.2-2.1 nats per prompt on the
    default suite, docs/FP8_KV.md: the cache is really used), while the fp8 engine's own decode and
    teacher-forced rows stay together (both read the same fp8 K/V, static scales)."""
    auto, fp8 = engines["auto"], engines["fp8_head"]
    moved, noise = [], []
    for req in _requests(auto, default_prompts, n=6):
        a, f = auto.generate([req], speculative=False)[0], fp8.generate([req], speculative=False)[0]
        n = 0
        while n < min(len(a.output_ids), len(f.output_ids)) and a.output_ids[n] == f.output_ids[n]:
            n += 1
        moved.append(float(np.nanmax(position_deltas(a.scores, f.scores)[:n])))
        tf = fp8.score(req.prompt_ids, f.output_ids, req.top_k)
        noise.append(float(np.nanmax(position_deltas(f.scores, tf))))
        # the auto engine scores the fp8 stream differently
        assert not np.array_equal(auto.score(req.prompt_ids, f.output_ids, req.top_k).top_logprobs, tf.top_logprobs)
    assert min(moved) > 0.1, moved
    assert max(noise) < min(moved) / 10, (noise, moved)


def test_fingerprint_records_the_kv_cache(engines, dflash_fp8):
    assert engines["auto"].fingerprint().extra["kv_cache_dtype"] == "auto"
    assert "kv_scales" not in engines["auto"].fingerprint().extra
    fp = engines["fp8"].fingerprint().extra
    assert (fp["kv_cache_dtype"], fp["kv_scales"]) == ("fp8_e4m3", "per_tensor") and "1.0" in fp["kv_scale_source"]
    fp = engines["fp8_head"].fingerprint().extra
    assert (fp["kv_cache_dtype"], fp["kv_scales"]) == ("fp8_e4m3", "per_head")
    assert fp["kv_scales_sha256"].startswith("sha256:")
    assert dflash_fp8.fingerprint().extra["kv_cache_dtype"] == "fp8_e4m3"
    assert engines["auto"].fingerprint().to_json() != engines["fp8"].fingerprint().to_json()


@pytest.mark.parametrize("engine", ["hf", "dflash"])
def test_a_bad_kv_cache_dtype_is_refused_before_loading(engine):
    with pytest.raises(EngineLoadError, match=r"--kv-cache-dtype 'fp8': expected one of auto, fp8_e4m3"):
        load_engine(engine, EngineOptions(kv_cache_dtype="fp8"))
    with pytest.raises(EngineLoadError, match=r"--engine-opt kv_scales=per_head: applies only with --kv-cache-dtype"):
        load_engine(engine, EngineOptions(extra={"kv_scales": "per_head"}))
    with pytest.raises(EngineLoadError, match=r"--engine-opt kv_scales='x': expected one of per_tensor"):
        load_engine(engine, EngineOptions(kv_cache_dtype="fp8_e4m3", extra={"kv_scales": "x"}))


def test_torch_target_refuses_a_bad_value_itself():
    """A plugin that builds its TorchTarget directly gets the same one-line refusal."""
    with pytest.raises(ValueError, match=r"--kv-cache-dtype 'e4m3'"):
        TorchTarget.from_options(EngineOptions(target=str(fixture_dir("target")), kv_cache_dtype="e4m3"))


def test_hybrid_target_quantizes_only_its_attention_layers():
    target = TorchTarget(str(fixture_dir("hybrid")), kv_cache_dtype="fp8_e4m3", kv_scales="per_head")
    types = target.model.config.layer_types
    assert sorted(target.kv.scales.k) == [i for i, t in enumerate(types) if t == "full_attention"]
    req = GenerationRequest("h", target.encode_prompt("Once upon a time", None), 8, target.stop_token_ids())
    assert target.greedy(req).output_ids


def test_cache_keyword_follows_the_forward_signature():
    """transformers 5.24 takes the cache as ``cache=``, 5.15–5.23 (the H200's 5.17) as
    ``past_key_values=``; a cache passed under the other name is silently ignored there, which on
    the GPU left teacher-forced scoring unquantized (docs/gpu-numerics.md)."""
    from specparity.engines.inprocess.kvcache import cache_kwarg

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            pass

    class New:
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            pass

    assert cache_kwarg(Old()) == "past_key_values" and cache_kwarg(New()) == "cache"
