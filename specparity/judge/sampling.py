"""The sampling judge: is the speculative side's output distributed as the target's own sampling?

Pure (numpy only): sampled token streams and the target's teacher-forced rows in, a verdict out.

**The transform.** For every emitted token, the target's distribution at that position is read from
its teacher-forced row (scored on the baseline): the channel's ``top_k`` largest logprobs, divided by
the temperature ``T``, renormalised — exactly the distribution a sampler with temperature ``T`` and
top-k ``K`` draws from (the repetition penalty, when used, is already in the row: the run scores with
it). Tokens are ordered by rank (most likely first; the channel is sorted), and the emitted token
``x`` at rank ``r`` gets the randomised probability-integral-transform value
``u = F(r - 1) + V * p(x)``, with ``F`` the cumulative probability of the ranks before it and ``V``
uniform on [0, 1) from a seeded generator. When a sampler draws ``x`` from exactly this
distribution, ``u`` is Uniform(0, 1) whatever the context, and independent of everything emitted
before it: the values of one run are i.i.d. uniforms. A token outside the channel's top ``K`` has
probability 0 under the truncated distribution: a correct sampler never emits it, so it is a
finding of its own.

**The test.** The speculative side's values are compared *two-sample* against the baseline side's
values (the target's own sampling, scored the same way), not against the uniform: the baseline's
numerics — the rows a real engine samples from are not bit-identical to the teacher-forced rows —
shift both sides alike and so set the allowance, and nothing measured on the speculative side moves
it. The family of tests, each a two-sample Kolmogorov–Smirnov test (asymptotic p-value with
Stephens' small-sample correction):

- all speculative values pooled against all baseline values;
- for each position in the verify step (0 = the first token a step emits) that holds at least
  :data:`MIN_POSITION_VALUES` speculative values, those values against all baseline values — a bias
  confined to later draft positions (a reused random number, a penalty that misses the block's own
  tokens) is diluted in the pool but shows here;
- the *consecutive-token* test (:func:`consecutive_tokens_test`): the joint distribution of
  consecutive emitted tokens ``(x_t, x_{t+1})`` per prompt, speculative against baseline, by a
  chi-square statistic whose null distribution comes from permuting whole sequences between the two
  sides within each prompt. The PIT values are blind to a bug that only couples the decisions inside
  one verify step (one acceptance random number reused at every draft position: the accept events
  become comonotone, and the token after an accepted draft leans toward the draft's choice); the
  pair of tokens carries it, and the statistic is computed identically on both sides from the
  emitted sequences alone, so the baseline (which has no verify steps) still sets the allowance.

Under a correct sampler each family member's p-value is (asymptotically) uniform; the run fails when
the smallest p-value times the family's size (Bonferroni) is below ``alpha``, so the false-alarm
rate is at most ``alpha`` by design (measured in ``benchmarks/sampling_power.py``). Values within one sample are pooled as independent draws: exact under a
correct sampler (sequential PIT values are i.i.d.), and a bug that makes them dependent only moves the
speculative side further from the baseline. Per-prompt and per-category deviations are reported, not
tested (they would split ``alpha`` further for no gain in the verdict).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

import numpy as np

Verdict = Literal["pass", "fail", "not_applicable"]

#: The family-wise false-alarm rate of one run, by design (Bonferroni over the family). Half the 1 %
#: the command promises: the KS p-values are asymptotic and the consecutive-token p-value an
#: approximation of a permutation tail, so the design keeps a margin; docs/SAMPLING.md has the measured rate.
DEFAULT_ALPHA = 0.005
#: Label permutations behind the consecutive-token test's null distribution.
PERMUTATIONS = 200
#: Token pairs a (prompt, x_t, x_{t+1}) cell needs over both sides to enter the consecutive-token
#: statistic: rarer cells add chi-square noise and almost no signal (chosen on counts, not labels,
#: so the permutation null stays exact).
MIN_PAIR_CELL = 5
#: Speculative values a verify-step position needs to be tested on its own.
MIN_POSITION_VALUES = 200
#: Bins of the value histograms in the report.
HISTOGRAM_BINS = 10


@dataclass
class ScoredSample:
    """One sampled sequence and the target's teacher-forced rows for it (one per token)."""

    prompt_id: str
    category: str
    token_ids: np.ndarray  # int64 [n]
    top_ids: np.ndarray  # int64 [n, C], sorted by descending logprob
    top_logprobs: np.ndarray  # float32 [n, C]
    #: Speculative side: each token's index in its verify step; None on the baseline side.
    block_positions: np.ndarray | None = None


@dataclass
class Transformed:
    """The PIT values of one side, with where each came from."""

    values: np.ndarray  # float64 [m], one per token inside the channel
    prompt_ids: np.ndarray  # object [m]
    categories: np.ndarray  # object [m]
    positions: np.ndarray  # int64 [m], -1 without block positions
    outside: list[tuple[str, int, int]] = field(default_factory=list)  # (prompt, token index, token id)
    unreported: int = 0  # rows with no channel (NaN): nothing to transform
    samples: int = 0


@dataclass(frozen=True)
class Deviation:
    """One slice of the speculative values against the baseline's: the KS distance, its p-value, and
    the mean value on each side (0.5 under the uniform; a draft-favoured bias lowers the speculative
    mean, since likely tokens sit at the start of the order)."""

    key: str
    n_speculative: int
    n_baseline: int
    statistic: float
    p_value: float
    mean_speculative: float
    mean_baseline: float
    tested: bool = False

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class PairTest:
    """The consecutive-token component: its chi-square statistic, the permutation null's mean and
    standard deviation, the p-value (Wilson–Hilferty tail of a scaled chi-square with the null's mean
    and variance), and what it was computed on."""

    statistic: float
    null_mean: float
    null_sd: float
    p_value: float
    cells: int
    pairs_per_side: tuple[int, int]
    permutations: int

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["pairs_per_side"] = list(self.pairs_per_side)
        return d


@dataclass
class SamplingRunResult:
    """The verdict of one sampling run and the figures behind it."""

    verdict: Verdict
    reason: str
    statistic: float  # the pooled KS distance
    p_value: float  # the smallest family p-value, Bonferroni-adjusted
    alpha: float
    samples_per_side: tuple[int, int]  # (baseline, speculative) sequences
    values_per_side: tuple[int, int]
    family_size: int
    pooled: Deviation | None = None
    positions: list[Deviation] = field(default_factory=list)
    prompts: list[Deviation] = field(default_factory=list)
    categories: list[Deviation] = field(default_factory=list)
    histogram: dict[str, list[int]] = field(default_factory=dict)
    outside: list[tuple[str, int, int]] = field(default_factory=list)
    consecutive: PairTest | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict, "reason": self.reason, "statistic": self.statistic, "p_value": self.p_value,
            "alpha": self.alpha, "samples_per_side": list(self.samples_per_side),
            "values_per_side": list(self.values_per_side), "family_size": self.family_size,
            "pooled": self.pooled.to_json() if self.pooled else None,
            "positions": [d.to_json() for d in self.positions], "prompts": [d.to_json() for d in self.prompts],
            "categories": [d.to_json() for d in self.categories], "histogram": self.histogram,
            "outside": [list(o) for o in self.outside],
            "consecutive": self.consecutive.to_json() if self.consecutive else None,
        }


# --------------------------------------------------------------------------- the transform


def pit_values(token_ids: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray, temperature: float,
               top_k: int, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Randomised PIT values of ``token_ids`` under each row's top-``top_k`` distribution at
    ``temperature`` (module docstring), and a mask of the tokens outside it (their value is NaN).

    ``uniforms``: one U[0, 1) per token (``V``). Raises ValueError when the channel is narrower than
    ``top_k``: the truncated distribution is then not known.
    """
    tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n = tokens.shape[0]
    ids = np.asarray(top_ids, dtype=np.int64).reshape(n, -1)
    lps = np.asarray(top_logprobs, dtype=np.float64).reshape(n, -1)
    if ids.shape[1] < top_k:
        raise ValueError(f"top_k {top_k} is wider than the logprob channel ({ids.shape[1]} alternatives)")
    ids, lps = ids[:, :top_k], lps[:, :top_k] / temperature
    with np.errstate(invalid="ignore"):
        w = np.exp(lps - np.nanmax(lps, axis=1, keepdims=True)) if n else lps
    w = np.where(np.isfinite(w), w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    probs = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
    before = np.cumsum(probs, axis=1) - probs
    hit = ids == tokens[:, None]
    inside = hit.any(axis=1) & (total[:, 0] > 0)
    rank = hit.argmax(axis=1)
    rows = np.arange(n)
    values = np.where(inside, before[rows, rank] + np.asarray(uniforms, dtype=np.float64) * probs[rows, rank], np.nan)
    return np.clip(values, 0.0, 1.0), ~inside


def transform(samples: Sequence[ScoredSample], temperature: float, top_k: int, rng: np.random.Generator) -> Transformed:
    """The PIT values of every token of ``samples`` (one side), with their prompt, category and position.

    All sequences go through :func:`pit_values` at once (a run holds hundreds of short sequences; one
    call per sequence would cost more than the statistics)."""
    out = Transformed(np.zeros(0), np.zeros(0, object), np.zeros(0, object), np.zeros(0, np.int64),
                      samples=len(samples))
    live = [s for s in samples if len(s.token_ids)]
    if not live:
        return out
    lengths = np.array([len(s.token_ids) for s in live])
    width = max(np.asarray(s.top_ids).reshape(len(s.token_ids), -1).shape[1] for s in live)

    def padded(x: np.ndarray, n: int, fill: float) -> np.ndarray:
        x = np.asarray(x).reshape(n, -1)
        return x if x.shape[1] == width else np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=fill)

    tokens = np.concatenate([np.asarray(s.token_ids, dtype=np.int64).reshape(-1) for s in live])
    ids = np.concatenate([padded(s.top_ids, n, -1) for s, n in zip(live, lengths)]).astype(np.int64)
    lps = np.concatenate([padded(np.asarray(s.top_logprobs, dtype=np.float64), n, np.nan)
                          for s, n in zip(live, lengths)])
    reported = np.isfinite(lps[:, 0]) & (ids[:, 0] >= 0)
    out.unreported = int((~reported).sum())
    v, outside = pit_values(tokens, ids, lps, temperature, top_k, rng.random(tokens.size))
    which = np.repeat(np.arange(len(live)), lengths)
    index = np.arange(tokens.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    for i in np.flatnonzero(outside & reported):
        out.outside.append((live[which[i]].prompt_id, int(index[i]), int(tokens[i])))
    keep = ~outside
    pos = np.concatenate([np.asarray(s.block_positions, dtype=np.int64).reshape(-1) if s.block_positions is not None
                          else np.full(n, -1) for s, n in zip(live, lengths)])
    out.values = v[keep]
    out.prompt_ids = np.array([s.prompt_id for s in live], dtype=object)[which][keep]
    out.categories = np.array([s.category for s in live], dtype=object)[which][keep]
    out.positions = pos[keep]
    return out


# --------------------------------------------------------------------------- the statistics


def kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution: 2 Σ (-1)^(j-1) exp(-2 j² lam²)."""
    if lam < 0.2:
        return 1.0
    total = 0.0
    for j in range(1, 101):
        term = 2.0 * (-1) ** (j - 1) * math.exp(-2.0 * j * j * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
    return float(min(1.0, max(0.0, total)))


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov–Smirnov: (D, p). D = sup |F_a − F_b|; p from the Kolmogorov distribution at
    ``(√n_e + 0.12 + 0.11/√n_e)·D``, ``n_e = n_a n_b / (n_a + n_b)`` (Stephens' correction)."""
    a, b = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    if a.size == 0 or b.size == 0:
        return 0.0, 1.0
    grid = np.concatenate([a, b])
    d = float(np.max(np.abs(np.searchsorted(a, grid, "right") / a.size - np.searchsorted(b, grid, "right") / b.size)))
    ne = math.sqrt(a.size * b.size / (a.size + b.size))
    return d, kolmogorov_q((ne + 0.12 + 0.11 / ne) * d)


def deviation(key: str, spec: np.ndarray, base: np.ndarray, tested: bool = False) -> Deviation:
    d, p = ks_two_sample(spec, base)
    return Deviation(key, int(spec.size), int(base.size), d, p,
                     float(spec.mean()) if spec.size else float("nan"),
                     float(base.mean()) if base.size else float("nan"), tested)


def histogram(values: np.ndarray, bins: int = HISTOGRAM_BINS) -> list[int]:
    return np.histogram(values, bins=bins, range=(0.0, 1.0))[0].astype(int).tolist()


def _chi_square(spec_counts: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Two-row chi-square homogeneity statistic per column of ``spec_counts`` ``[cells, B]``
    against ``totals`` ``[cells]`` (baseline counts = totals − speculative counts)."""
    n = totals.sum()
    ns = spec_counts.sum(axis=0)
    nb = n - ns
    expected = totals[:, None] * (ns / n)[None, :]
    dev = ((spec_counts - expected) ** 2 / totals[:, None]).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((ns > 0) & (nb > 0), dev * n * n / (ns * nb), 0.0)


def wilson_hilferty_tail(x: float, mean: float, var: float) -> float:
    """P(X >= x) for X a scaled chi-square with the given mean and variance (Wilson–Hilferty cube root)."""
    if var <= 0 or mean <= 0:
        return 1.0 if x <= mean else 0.0
    nu, c = 2.0 * mean * mean / var, var / (2.0 * mean)
    z = ((max(x, 0.0) / (c * nu)) ** (1.0 / 3.0) - (1.0 - 2.0 / (9.0 * nu))) / math.sqrt(2.0 / (9.0 * nu))
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def consecutive_tokens_test(baseline: Sequence[ScoredSample], speculative: Sequence[ScoredSample],
                            rng: np.random.Generator, permutations: int = PERMUTATIONS,
                            min_cell: int = MIN_PAIR_CELL) -> PairTest | None:
    """The speculative side's consecutive token pairs against the baseline's (module docstring).

    Cells are ``(prompt, x_t, x_{t+1})`` with at least ``min_cell`` pairs over both sides; the
    statistic is the two-row chi-square over them. Pairs inside one sequence are dependent, so the
    chi-square table is not trusted: the null distribution is the statistic's over ``permutations``
    reshufflings of whole sequences between the sides within each prompt (under a correct sampler
    the sequences of one prompt are exchangeable), and the p-value is the tail of a scaled chi-square
    matched to that null's mean and variance. None when fewer than two cells qualify.
    """
    prompts: dict[str, int] = {}
    codes, seq_of_pair, seq_prompt, seq_side = [], [], [], []
    vocab = 1 + max([int(np.max(s.token_ids)) for s in (*baseline, *speculative) if len(s.token_ids)] or [0])
    for side, samples in ((0, baseline), (1, speculative)):
        for s in samples:
            t = np.asarray(s.token_ids, dtype=np.int64)
            if t.size < 2:
                continue
            k = prompts.setdefault(s.prompt_id, len(prompts))
            codes.append((k * vocab + t[:-1]) * vocab + t[1:])
            seq_of_pair.append(np.full(t.size - 1, len(seq_side)))
            seq_prompt.append(k)
            seq_side.append(side)
    if not codes:
        return None
    cells, inverse, totals = np.unique(np.concatenate(codes), return_inverse=True, return_counts=True)
    keep = totals >= min_cell
    if keep.sum() < 2:
        return None
    remap = np.cumsum(keep) - 1
    pair_seq = np.concatenate(seq_of_pair)[keep[inverse]]
    pair_cell = remap[inverse[keep[inverse]]]
    n_cells = int(keep.sum())
    totals = totals[keep].astype(np.float64)
    sides = np.asarray(seq_side, dtype=np.float64)
    groups = [np.flatnonzero(np.asarray(seq_prompt) == k) for k in range(len(prompts))]
    labels = np.empty((sides.size, permutations + 1))
    labels[:, 0] = sides
    for g in groups:
        labels[g, 1:] = rng.permuted(np.tile(sides[g][:, None], (1, permutations)), axis=0)
    # per sequence and cell, its pair count; a labelling's speculative counts are then one product
    seq_cell = np.zeros((sides.size, n_cells))
    np.add.at(seq_cell, (pair_seq, pair_cell), 1.0)
    spec_counts = seq_cell.T @ labels
    stats = _chi_square(spec_counts, totals)
    null = stats[1:]
    mean, var = float(null.mean()), float(null.var(ddof=1)) if permutations > 1 else 0.0
    n_spec = int(spec_counts[:, 0].sum())
    return PairTest(float(stats[0]), mean, math.sqrt(var), wilson_hilferty_tail(float(stats[0]), mean, var),
                    n_cells, (int(totals.sum()) - n_spec, n_spec), permutations)


# --------------------------------------------------------------------------- the verdict


def judge_sampling(baseline: Sequence[ScoredSample], speculative: Sequence[ScoredSample], *, temperature: float,
                   top_k: int, alpha: float = DEFAULT_ALPHA, seed: int = 0,
                   min_position_values: int = MIN_POSITION_VALUES,
                   permutations: int = PERMUTATIONS) -> SamplingRunResult:
    """Judge the speculative side's samples against the baseline's (module docstring for the test).

    ``not_applicable`` when there is nothing to compare on a side, or when the baseline itself emits a
    token outside its top-``top_k`` channel (the reference breaks its own truncation, or the channel
    does not hold it: no value of the speculative side can be judged against it). ``fail`` when the
    speculative side emits a token outside the channel's top ``top_k`` (probability 0 under the
    truncated target), or when the family's adjusted p-value is below ``alpha``.
    """
    rng = np.random.default_rng(seed)
    base = transform(baseline, temperature, top_k, rng)
    spec = transform(speculative, temperature, top_k, rng)
    counts = (len(baseline), len(speculative))
    sizes = (int(base.values.size), int(spec.values.size))
    empty = SamplingRunResult("not_applicable", "", 0.0, 1.0, alpha, counts, sizes, 0)
    if base.outside:
        pid, i, tok = base.outside[0]
        empty.reason = (f"the baseline emitted {len(base.outside)} token(s) outside the target's top-{top_k} channel "
                        f"(first: token {tok} at output position {i} of prompt {pid}): the reference breaks its own "
                        "truncation, nothing can be judged against it")
        empty.outside = base.outside
        return empty
    if not sizes[0] or not sizes[1]:
        side = "baseline" if not sizes[0] else "speculative"
        empty.reason = f"no value to judge on the {side} side (no token sampled, or no row reported)"
        return empty
    pooled = deviation("all", spec.values, base.values, tested=True)
    positions = []
    for j in sorted(set(spec.positions.tolist()) - {-1}):
        sel = spec.values[spec.positions == j]
        positions.append(deviation(f"position {j}", sel, base.values, tested=sel.size >= min_position_values))
    family = [pooled] + [d for d in positions if d.tested]
    consecutive = consecutive_tokens_test(baseline, speculative, rng, permutations) if permutations > 1 else None
    m = len(family) + (consecutive is not None)
    p_min = min([d.p_value for d in family] + ([consecutive.p_value] if consecutive else []))
    p_adj = min(1.0, p_min * m)
    prompts = [deviation(pid, spec.values[spec.prompt_ids == pid], base.values[base.prompt_ids == pid])
               for pid in dict.fromkeys(base.prompt_ids.tolist())]
    categories = [deviation(c, spec.values[spec.categories == c], base.values[base.categories == c])
                  for c in dict.fromkeys(base.categories.tolist())]
    hist = {"baseline": histogram(base.values), "speculative": histogram(spec.values)}
    result = SamplingRunResult("pass", "", pooled.statistic, p_adj, alpha, counts, sizes, m, pooled, positions,
                               prompts, categories, hist, spec.outside, consecutive)
    worst = min(family, key=lambda d: d.p_value)
    if spec.outside:
        pid, i, tok = spec.outside[0]
        result.verdict = "fail"
        result.reason = (f"the speculative side emitted {len(spec.outside)} token(s) the truncated target gives "
                         f"probability 0 (outside its top-{top_k}; first: token {tok} at output position {i} of "
                         f"prompt {pid})")
    elif p_adj < alpha and consecutive is not None and consecutive.p_value < worst.p_value:
        result.verdict = "fail"
        result.reason = (f"consecutive speculative tokens are paired unlike the baseline's: chi-square "
                         f"{consecutive.statistic:.1f} over {consecutive.cells} (prompt, token, next token) cells "
                         f"against a permutation null of mean {consecutive.null_mean:.1f} (sd "
                         f"{consecutive.null_sd:.1f}), p={p_adj:.2g} after Bonferroni over {m} tests < alpha {alpha:g}")
    elif p_adj < alpha:
        result.verdict = "fail"
        result.reason = (f"the speculative values differ from the baseline's: {worst.key} KS D={worst.statistic:.4f} "
                         f"over {worst.n_speculative} vs {worst.n_baseline} values, p={p_adj:.2g} after Bonferroni "
                         f"over {m} tests < alpha {alpha:g}")
    else:
        result.reason = (f"distributed as the target's own sampling: smallest adjusted p={p_adj:.2g} >= alpha {alpha:g} "
                         f"over {m} tests ({sizes[1]} speculative vs {sizes[0]} baseline values)")
    return result
