"""A numpy speculative sampler over synthetic bigram models, for the judge's false-alarm and power study.

The target and the draft are next-token tables over a small vocabulary (the draft: the target's
logits plus noise); the loop is the algorithm of :mod:`specparity.engines.inprocess.sampling` — the
same processing (repetition penalty, temperature, top-k), the same acceptance, residual and bonus —
run for all samples in lockstep, with the same catalogue of bugs (``tests/broken_samplers.py``). A
run takes well under a second, so hundreds of runs measure its false-alarm rate and its
power; the fixture models show the same bugs end to end (``tests/test_sampling_loops.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specparity.judge.sampling import ScoredSample

BUGS = ("draft_unscaled", "residual_from_p", "topk_draft_only", "bonus_from_draft", "reused_uniform",
        "penalty_misses_block")


@dataclass(frozen=True)
class SimConfig:
    vocab: int = 48
    prompts: int = 4
    samples: int = 200
    tokens: int = 16
    width: int = 4
    temperature: float = 2.0
    top_k: int = 8
    penalty: float = 1.3
    draft_noise: float = 1.5
    logit_scale: float = 3.0


def models(cfg: SimConfig, seed: int = 1234) -> tuple[np.ndarray, np.ndarray]:
    """(target, draft) bigram logit tables ``[V, V]``, fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    target = rng.standard_normal((cfg.vocab, cfg.vocab)) * cfg.logit_scale
    return target, target + rng.standard_normal(target.shape) * cfg.draft_noise


def probs(logits: np.ndarray, seen: np.ndarray, cfg: SimConfig, *, temperature: float | None = None,
          top_k: bool = True) -> np.ndarray:
    x = np.where(seen, np.where(logits < 0, logits * cfg.penalty, logits / cfg.penalty), logits)
    x = x / (temperature or cfg.temperature)
    if top_k:
        kth = np.partition(x, -cfg.top_k, axis=-1)[..., -cfg.top_k][..., None]
        x = np.where(x < kth, -np.inf, x)
    w = np.exp(x - x.max(axis=-1, keepdims=True))
    return w / w.sum(axis=-1, keepdims=True)


def draw(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of ``p`` (rows need not be normalised)."""
    c = np.cumsum(p, axis=-1)
    u = rng.random(p.shape[0]) * c[:, -1]
    return np.minimum((c < u[:, None]).sum(axis=-1), p.shape[-1] - 1)


def _seen(rows: int, vocab: int, start: int) -> np.ndarray:
    s = np.zeros((rows, vocab), dtype=bool)
    s[:, start] = True
    return s


def baseline(target: np.ndarray, start: int, cfg: SimConfig, rng: np.random.Generator) -> np.ndarray:
    """``[N, L]`` tokens of the target's own sampling after the one-token prompt ``start``."""
    n = cfg.samples
    seen, last = _seen(n, cfg.vocab, start), np.full(n, start)
    out = np.zeros((n, cfg.tokens), dtype=np.int64)
    rows = np.arange(n)
    for t in range(cfg.tokens):
        last = draw(probs(target[last], seen, cfg), rng)
        seen[rows, last] = True
        out[:, t] = last
    return out


def speculative(target: np.ndarray, draft: np.ndarray, start: int, cfg: SimConfig, rng: np.random.Generator,
                bug: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[N, L]`` tokens and their positions in the verify step, from the draft-and-verify loop (with ``bug``)."""
    n, k, L = cfg.samples, cfg.width, cfg.tokens
    rows = np.arange(n)
    seen = _seen(n, cfg.vocab, start)
    out = np.zeros((n, L + k + 1), dtype=np.int64)
    pos = np.zeros((n, L + k + 1), dtype=np.int64)
    first = draw(probs(target[np.full(n, start)], seen, cfg), rng)
    seen[rows, first] = True
    out[:, 0], fill, last = first, np.ones(n, dtype=np.int64), first
    while fill.min() < L:
        s, prev = seen.copy(), last
        drafts, qs, q1s, ps, ps_full, seen_block = [], [], [], [], [], [seen.copy()]
        for _ in range(k):
            q = probs(draft[prev], s, cfg)
            qs.append(q)
            if bug == "draft_unscaled":
                q1s.append(probs(draft[prev], s, cfg, temperature=1.0))
            d = draw(q, rng)
            drafts.append(d)
            s = s.copy()
            s[rows, d] = True
            seen_block.append(s)
            prev = d
        q_last = probs(draft[prev], s, cfg)  # the draft after its last proposal (bonus_from_draft)
        ctx = [last] + drafts
        for i in range(k + 1):
            ctx_seen = seen_block[0] if bug == "penalty_misses_block" else seen_block[i]
            ps.append(probs(target[ctx[i]], ctx_seen, cfg))
            if bug == "topk_draft_only":
                ps_full.append(probs(target[ctx[i]], ctx_seen, cfg, top_k=False))
        D = np.stack(drafts, 1)
        q_v = np.stack(q1s if bug == "draft_unscaled" else qs, 1)
        p = np.stack(ps, 1)
        p_r = np.stack(ps_full, 1)[:, :k] if bug == "topk_draft_only" else p[:, :k]
        r = np.repeat(rng.random((n, 1)), k, 1) if bug == "reused_uniform" else rng.random((n, k))
        pd = np.take_along_axis(p_r, D[:, :, None], 2)[:, :, 0]
        qd = np.take_along_axis(q_v, D[:, :, None], 2)[:, :, 0]
        nacc = np.cumprod(r * qd < pd, axis=1).sum(axis=1)
        q_ext = np.concatenate([q_v, np.zeros_like(q_v[:, :1])], 1)
        p_n, q_n = p[rows, nacc], q_ext[rows, nacc]
        res = p_n if bug == "residual_from_p" else np.clip(p_n - q_n, 0, None)
        res = np.where(res.sum(-1, keepdims=True) > 0, res, p_n)
        if bug == "bonus_from_draft":
            res = np.where((nacc == k)[:, None], q_last, res)
        new = draw(res, rng)
        for j in range(k + 1):
            tok = np.where(j < nacc, D[:, min(j, k - 1)], new)
            write = (j <= nacc) & (fill + j < out.shape[1])
            out[rows[write], (fill + j)[write]] = tok[write]
            pos[rows[write], (fill + j)[write]] = j
        keep = np.arange(k)[None, :] < nacc[:, None]
        seen[np.repeat(rows[:, None], k, 1)[keep], D[keep]] = True
        seen[rows, new] = True
        fill, last = fill + nacc + 1, new
    return out[:, :L], pos[:, :L]


def scored(target: np.ndarray, start: int, tokens: np.ndarray, cfg: SimConfig, prompt: str,
           positions: np.ndarray | None = None) -> list[ScoredSample]:
    """Every sample of one prompt, one :class:`ScoredSample` per sequence (the consecutive-token test
    permutes whole sequences): the target's penalised log-softmax rows, full width, sorted (what
    teacher-forced scoring returns)."""
    n, L = tokens.shape
    seen = _seen(n, cfg.vocab, start)
    ids, lps = [], []
    prev = np.full(n, start)
    rows = np.arange(n)
    for t in range(L):
        x = target[prev]
        x = np.where(seen, np.where(x < 0, x * cfg.penalty, x / cfg.penalty), x)
        lp = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
        order = np.argsort(-lp, axis=-1, kind="stable")
        ids.append(order)
        lps.append(np.take_along_axis(lp, order, -1))
        seen[rows, tokens[:, t]] = True
        prev = tokens[:, t]
    top_ids = np.stack(ids, 1)
    top_lps = np.stack(lps, 1).astype(np.float32)
    return [ScoredSample(prompt, "sim", tokens[i], top_ids[i], top_lps[i],
                         positions[i] if positions is not None else None) for i in range(n)]


def run_pair(cfg: SimConfig, seed: int, bug: str | None = None,
             tables: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[list[ScoredSample], list[ScoredSample]]:
    """(baseline, speculative) scored samples of one simulated run."""
    target, draft = tables or models(cfg)
    rng = np.random.default_rng(seed)
    base, spec = [], []
    for i in range(cfg.prompts):
        start = (7 * i + 3) % cfg.vocab
        base += scored(target, start, baseline(target, start, cfg, rng), cfg, f"p{i}")
        toks, pos = speculative(target, draft, start, cfg, rng, bug)
        spec += scored(target, start, toks, cfg, f"p{i}", pos)
    return base, spec
