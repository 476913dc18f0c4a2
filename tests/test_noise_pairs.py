"""The near-tie threshold is measured on the pairs that can flip; the drift bound on every pair.

An alternative 10–18 nats below the chosen token can never flip, yet its margin carries the largest
absolute rounding (bf16 + fp8 KV on the fixtures: 0.44 nats over every pair, 0.19 over the pairs whose
margin is under 2 nats). So the threshold covers the noise of the pairs within the ceiling, falling
back to every pair — never looser than that — when too few of them were seen.
"""

from __future__ import annotations

import numpy as np
import pytest

from specparity.judge.calibration import Sample, calibrate
from specparity.judge.noise import measure_noise
from specparity.model.threshold import MIN_NEAR_PAIRS
from specparity.model.types import TokenScores


def _rows(n: int, top: list[float], moved: list[float]) -> tuple[TokenScores, TokenScores]:
    """n positions choosing token 0; the other side moves each alternative's logprob by ``moved``."""
    k = len(top)
    ids = np.tile(np.arange(k), (n, 1))
    a = np.tile(np.asarray(top, np.float32), (n, 1))
    a[:, 2:] -= 0.001 * np.arange(n, dtype=np.float32)[:, None]  # rows differ, as a model's do
    b = a + np.asarray(moved, np.float32)
    return TokenScores(ids[:, 0], a[:, 0], ids, a), TokenScores(ids[:, 0], b[:, 0], ids, b)


# token 0 chosen; token 1 is 0.5 nats behind (can flip) and moves by 0.05; tokens 2-4 are 12-16
# nats behind and move by up to 0.4
TOP = [-0.5, -1.0, -12.0, -14.0, -16.0]  # log-probabilities: they sum to less than 1
MOVED = [0.0, 0.05, 0.4, -0.3, 0.2]


def test_threshold_covers_the_pairs_that_can_flip():
    a, b = _rows(MIN_NEAR_PAIRS, TOP, MOVED)
    _, t = calibrate([Sample("p", a.token_ids.tolist(), a, b)], scorer="test")
    n = t.noise
    assert (n.near_pairs, n.near_window) == (MIN_NEAR_PAIRS, 2.0) and n.near_measured
    assert n.near_max_abs_delta == pytest.approx(0.05, abs=1e-6) and n.max_abs_delta == pytest.approx(0.4, abs=1e-6)
    assert t.nats == pytest.approx(1.5 * 0.05, rel=1e-5)
    # the drift bound compares rows at every pair, far alternatives included: it stays on all of them
    assert t.drift_nats == pytest.approx(4 * 0.4, rel=1e-5)
    assert (f"over the {MIN_NEAR_PAIRS} pairs whose margin is at most 2 nats (3rd-largest 0.05, max 0.05; every "
            f"pair: max 0.4") in t.describe()


def test_too_few_small_margin_pairs_fall_back_to_every_pair():
    a, b = _rows(MIN_NEAR_PAIRS - 1, TOP, MOVED)
    _, t = calibrate([Sample("p", a.token_ids.tolist(), a, b)], scorer="test")
    assert not t.noise.near_measured and t.nats == pytest.approx(1.5 * 0.4, rel=1e-5)
    assert (f"only {MIN_NEAR_PAIRS - 1} pair(s) with a margin at most 2 nats, fewer than {MIN_NEAR_PAIRS}"
            in t.describe())


def test_a_raised_ceiling_widens_the_window():
    """The window is the ceiling: only a pair within it can be judged a near tie."""
    a, b = _rows(MIN_NEAR_PAIRS, TOP, MOVED)
    _, t = calibrate([Sample("p", a.token_ids.tolist(), a, b)], scorer="test", ceiling=13.0)
    assert t.noise.near_pairs == 2 * MIN_NEAR_PAIRS and t.nats == pytest.approx(1.5 * 0.4, rel=1e-5)


def test_either_side_small_makes_a_pair_near():
    """A pair counts as near when its margin is small on either side (the side that saw it close)."""
    a, b = _rows(MIN_NEAR_PAIRS, [-0.1, -3.0], [0.0, 2.5])  # 2.9 nats behind on one side, 0.4 on the other
    assert measure_noise([(a, b)], window=2.0).near_pairs == MIN_NEAR_PAIRS
    assert measure_noise([(a, b)]).near_window is None
