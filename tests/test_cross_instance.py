"""The noise between two server instances enters the allowance only up to a cap the speculative side
cannot move (``specparity.model.cross_instance``); beyond it, it is a finding.

The cap must leave every recorded live run as it was: each summary under ``docs/live/`` (vLLM 0.26.0,
SGLang 0.5.17 on an H200) prints the within-instance and cross-instance figures and the largest drift
its rows showed; read back here, none raises a finding and every drift bound still covers its rows.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specparity.model.cross_instance import CROSS_INSTANCE_FACTOR, CROSS_INSTANCE_NATS, CrossFigure, cross_instance_cap
from specparity.model.locations import REPO_ROOT
from specparity.model.threshold import DEFAULT_CEILING_NATS, DRIFT_MULTIPLIER, NearTieThreshold, NoiseStats

LIVE = REPO_ROOT / "docs" / "live"
NUMBER = r"([0-9.]+(?:e[+-]?[0-9]+)?)"


def _stats(flip: float, every: float, moved: int | None = None) -> NoiseStats:
    """A measurement whose threshold figure is ``flip`` and whose largest |Δmargin| is ``every``."""
    return NoiseStats(every, every, 100, 1000, robust_abs_delta=flip, moved_pairs=moved)


def _threshold(within: NoiseStats, cross: NoiseStats | None, ceiling: float = DEFAULT_CEILING_NATS) -> NearTieThreshold:
    return NearTieThreshold(0.0, "measured", within, 1.5, ceiling, "", cross)


def test_the_cap_takes_the_larger_of_the_floor_and_a_multiple_of_the_within_instance_figure():
    assert cross_instance_cap(0.0) == CROSS_INSTANCE_NATS
    assert cross_instance_cap(0.3) == pytest.approx(CROSS_INSTANCE_FACTOR * 0.3)
    inside = CrossFigure("near-tie figure", 0.0, CROSS_INSTANCE_NATS)
    assert not inside.excess and inside.accepted == CROSS_INSTANCE_NATS
    beyond = CrossFigure("near-tie figure", 0.1, 0.6)
    assert beyond.excess and beyond.accepted == pytest.approx(max(CROSS_INSTANCE_NATS, CROSS_INSTANCE_FACTOR * 0.1))


def test_what_the_speculative_server_adds_beyond_the_cap_sets_nothing():
    within = _stats(1e-5, 3e-5)
    near, wide = _threshold(within, _stats(0.2, 0.24, 10)), _threshold(within, _stats(0.9, 1.7, 990))
    # within the cap: the figure is taken whole, no finding
    assert near.flip_noise == pytest.approx(0.2) and near.drift_nats == pytest.approx(DRIFT_MULTIPLIER * 0.24)
    assert near.cross_finding() is None
    # beyond it: the threshold and the drift bound stop at the cap, and the rest is a finding
    assert wide.flip_noise == wide.noise_max == CROSS_INSTANCE_NATS
    assert wide.drift_nats == pytest.approx(DRIFT_MULTIPLIER * CROSS_INSTANCE_NATS)
    finding = wide.cross_finding()
    assert finding.startswith("the speculative server's target computes differently: cross-instance 0.9 nats vs "
                              "within-instance 1e-05 (near-tie figure; the allowance takes 0.25), 1.7 vs 3e-05 "
                              "(largest over every pair; 0.25); 990 of 1000 pairs moved between the two servers")
    assert "dtype, quantization, KV cache dtype, attention backend, tensor-parallel size" in finding
    assert "the allowance takes 0.25 of the near-tie figure, 0.25 of the largest over every pair" in \
        wide.describe_cross()
    # a noisier baseline instance raises the cap with it: its own two computations differ that much
    noisy = _threshold(_stats(0.5, 0.9), _stats(0.9, 1.7))
    assert noisy.cross_finding() is None and noisy.noise_max == pytest.approx(1.7)
    # the journal keeps the finding, and a rebuilt threshold gives the same
    data = wide.to_json()
    assert data["cross_instance_finding"] == finding
    assert NearTieThreshold.from_json(data).cross_finding() == finding


def test_the_drift_bound_stops_at_the_ceiling():
    loud = _threshold(_stats(0.3, 0.6), None)
    assert DRIFT_MULTIPLIER * 0.6 > DEFAULT_CEILING_NATS
    assert loud.drift_nats == DEFAULT_CEILING_NATS and loud.drift_held
    raised = _threshold(_stats(0.3, 0.6), None, ceiling=3.0)
    assert raised.drift_nats == pytest.approx(DRIFT_MULTIPLIER * 0.6) and not raised.drift_held


def _figures(text: str) -> dict[str, float] | None:
    """The within- and cross-instance figures and the largest drift a live summary printed (None: no
    cross-instance figure measured there)."""
    line = {m.group(1): m.group(2) for m in re.finditer(r"^- (Near-tie threshold|Cross-instance noise|Latent drift): "
                                                          r"(.*)$", text, re.M)}
    cross = line.get("Cross-instance noise", "")
    if not cross.startswith("max |Δmargin|"):
        return None
    threshold = line["Near-tie threshold"]
    c_flip = float(re.match(rf"max \|Δmargin\| {NUMBER}", cross).group(1))
    c_every = re.search(rf"every pair: (?:max )?{NUMBER}", cross)
    old = re.search(rf"the larger of {NUMBER} between incremental decode", threshold)
    if old:  # the first format: one all-pairs figure each
        w_flip = w_every = float(old.group(1))
    else:
        within = threshold.split("scoring of the baseline: ", 1)[1].split("; between the two server instances", 1)[0]
        w_flip = float(re.match(NUMBER, within).group(1))
        every = re.search(rf"every pair: (?:max )?{NUMBER}", within)
        w_every = float(every.group(1)) if every else w_flip
    drift = re.search(rf"largest drift {NUMBER} nats", line["Latent drift"])
    return {"w_flip": w_flip, "w_every": w_every, "c_flip": c_flip,
            "c_every": float(c_every.group(1)) if c_every else c_flip, "drift": float(drift.group(1)) if drift else 0.0}


def test_recorded_live_runs_raise_no_finding_and_keep_their_bounds():
    summaries = sorted(LIVE.rglob("*.md"))
    measured = [p for p in summaries if "- Cross-instance noise: max |Δmargin|" in p.read_text()]
    runs = {p: _figures(p.read_text()) for p in measured}
    engines = {p.relative_to(LIVE).parts[0].split("-")[0] for p in runs}
    assert engines == {"vllm", "sglang"} and all(f is not None for f in runs.values())
    largest = max(f["c_every"] for f in runs.values())
    assert largest > CROSS_INSTANCE_NATS  # the recorded figures reach past the floor: the factor is exercised
    for path, f in runs.items():
        th = _threshold(_stats(f["w_flip"], f["w_every"]), _stats(f["c_flip"], f["c_every"]))
        where = str(path.relative_to(REPO_ROOT))
        assert th.cross_finding() is None, where
        assert th.flip_noise == pytest.approx(max(f["w_flip"], f["c_flip"])), where
        assert th.drift_nats >= f["drift"], where
