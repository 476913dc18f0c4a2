"""Speculative *sampling* on the committed fixtures: the draft proposes by sampling, the target
verifies by rejection sampling, so the output must be distributed exactly as the target's own
sampling (``specparity sample`` judges it: :mod:`specparity.judge.sampling`).

The loop (:class:`SpeculativeSampler`), per verify step: the draft samples ``k`` tokens from its
distribution ``q`` (the repetition penalty, the temperature and the top-k applied to its logits, as
the target's are); the target scores ``[last token] + drafts`` in one pass, giving ``p``; draft
token ``i`` is accepted with probability ``min(1, p(d_i) / q(d_i))``; at the first rejection the
token is sampled from the renormalised residual ``max(0, p - q)``; when every draft is accepted a
bonus token is sampled from ``p``. The baseline (:class:`Autoregressive`) is the target's own
sampling with the same processing. Each stage is a method, so ``tests/broken_samplers.py``
breaks one stage at a time.

Both run all samples of one prompt as one batch in lockstep, with a KV cache per model: a draft
token a row rejected stays in the cache but is masked out of attention from then on, and every row
keeps its own rotary positions, so a row computes what it would compute alone (up to float32
rounding of the batched kernels; ``tests/test_sampling_loops.py`` checks the rows against a
recomputation without cache). Randomness comes from one seeded ``torch.Generator`` per prompt and
side: the same requests and seed give the same samples.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

from specparity.engines.base import EngineInfo, EngineOptions, engine_factory, step_record
from specparity.engines.common import artifact, scores_from_logits
from specparity.engines.inprocess.hf import DEFAULT_DRAFT_TOKENS, HF_OPTIONS, load_draft_model
from specparity.engines.inprocess.loop import InProcessEngine, LoopOutput, TorchTarget
from specparity.model.locations import fixture_dir
from specparity.model.sampling import SamplingParams
from specparity.model.types import (
    ArtifactId,
    GenerationRequest,
    GenerationResult,
    SpecStats,
    StepRecord,
    TokenScores,
)

#: Rows scored in one teacher-forced forward (bounds the memory of a long batch).
SCORE_CHUNK = 64


def penalise(logits: Any, seen: Any, penalty: float) -> Any:
    """HF's repetition penalty: the logit of every token in the context (``seen``, bool ``[..., V]``)
    divided by ``penalty`` when positive, multiplied when negative."""
    import torch

    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def truncate(logits: Any, top_k: int) -> Any:
    """Logits outside the ``top_k`` largest set to -inf (ties at the k-th value kept, as HF does)."""
    import torch

    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def probabilities(logits: Any, seen: Any, params: SamplingParams, *, temperature: float | None = None,
                  top_k: bool = True) -> Any:
    """The sampling distribution of ``logits`` (float32 ``[..., V]``): penalty, temperature, top-k,
    softmax — the order of HF's logits processors."""
    import torch

    x = penalise(logits.float(), seen, params.repetition_penalty) / (temperature or params.temperature)
    if top_k:
        x = truncate(x, params.top_k)
    return torch.softmax(x, dim=-1)


class _Model:
    """One model's batched KV cache with per-row validity: rows may reject different draft tokens, so
    a rejected entry is masked out (``mask``) and each row's rotary position counts only its valid
    entries (``next_pos``)."""

    def __init__(self, model: Any, rows: int, device: str):
        import torch
        from transformers import DynamicCache

        self.torch = torch
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(rows, 0, dtype=torch.long, device=device)
        self.next_pos = torch.zeros(rows, dtype=torch.long, device=device)

    def feed(self, tokens: Any, valid: Any) -> Any:
        """Feed ``tokens`` [B, m] (``valid`` bool [B, m]: entries a row really has); float32 logits [B, m, V]."""
        torch = self.torch
        v = valid.long()
        positions = self.next_pos[:, None] + torch.cumsum(v, 1) - v
        self.mask = torch.cat([self.mask, v], 1)
        out = self.model(input_ids=tokens, attention_mask=self.mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True).logits.float()
        self.next_pos = self.next_pos + v.sum(1)
        return out

    def drop(self, start: int, keep: Any) -> None:
        """Of the entries from column ``start`` on, keep only the first ``keep[b]`` of row ``b``."""
        torch = self.torch
        width = self.mask.shape[1] - start
        cols = torch.arange(width, device=self.mask.device)[None, :]
        old = self.mask[:, start:]
        new = old * (cols < keep[:, None]).long()
        self.next_pos = self.next_pos - (old - new).sum(1)
        self.mask = torch.cat([self.mask[:, :start], new], 1)


@dataclass
class _Rows:
    """What each row of a batch emitted: tokens, each token's position in its verify step, the steps."""

    tokens: list[list[int]]
    positions: list[list[int]]
    blocks: list[list[tuple[list[int], list[int]]]] = field(default_factory=list)


class Autoregressive:
    """The baseline: the target samples one token per forward (penalty, temperature, top-k)."""

    name = "target-sampling"

    def run(self, model: Any, prompt: Sequence[int], rows: int, steps: int, params: SamplingParams,
            generator: Any, device: str) -> _Rows:
        torch = _torch()
        t = _Model(model, rows, device)
        seen = torch.zeros(rows, model.config.vocab_size, dtype=torch.bool, device=device)
        ids = torch.tensor([list(prompt)] * rows, dtype=torch.long, device=device)
        seen[:, ids[0]] = True
        logits = t.feed(ids, torch.ones_like(ids, dtype=torch.bool))[:, -1]
        out = _Rows([[] for _ in range(rows)], [[] for _ in range(rows)])
        for _ in range(steps):
            tok = torch.multinomial(probabilities(logits, seen, params), 1, generator=generator)
            seen.scatter_(1, tok, True)
            for b, x in enumerate(tok[:, 0].tolist()):
                out.tokens[b].append(x)
                out.positions[b].append(0)
            logits = t.feed(tok, torch.ones_like(tok, dtype=torch.bool))[:, -1]
        return out


class SpeculativeSampler:
    """Draft-and-verify with rejection sampling (module docstring); the methods are the stages a
    broken variant overrides."""

    name = "speculative-sampling"
    #: Whether the draft is fed its last proposal too (a variant that reads ``q`` after it).
    feeds_last_draft = False

    def __init__(self, draft: Any, width: int):
        if width < 1:
            raise ValueError(f"--num-draft-tokens: expected an integer >= 1, got {width}")
        self.draft = draft
        self.width = width

    # ------------------------------------------------------------------ stages
    def draft_probs(self, logits: Any, seen: Any, params: SamplingParams) -> Any:
        """``q``: the distribution the draft samples from, and the one the verify divides by."""
        return probabilities(logits, seen, params)

    def verify_q(self, q: Any, q_logits: Any, q_seen: list[Any], params: SamplingParams) -> Any:
        """``q`` as the acceptance ratio and the residual read it ([B, k, V])."""
        return q

    def target_probs(self, logits: Any, seen_block: list[Any], seen_start: Any, params: SamplingParams) -> Any:
        """``p`` at each verify position i ([B, k+1, V]): the penalty over the context up to the
        token before it, drafts accepted earlier in the block included."""
        torch = _torch()
        return torch.stack([probabilities(logits[:, i], seen_block[i], params) for i in range(logits.shape[1])], 1)

    def ratio_p(self, p: Any, logits: Any, seen_block: list[Any], params: SamplingParams) -> Any:
        """``p`` as the acceptance ratio reads it."""
        return p

    def acceptance_uniforms(self, rows: int, k: int, generator: Any, device: str) -> Any:
        """One independent U(0,1) per row and draft position."""
        return _torch().rand(rows, k, generator=generator, device=device)

    def next_distribution(self, p_n: Any, q_n: Any, all_accepted: Any) -> Any:
        """The token after the accepted drafts: the residual ``max(0, p - q)`` at a rejection, ``p``
        itself after a full accept (``q_n`` is zero there), renormalised by the sampler."""
        torch = _torch()
        res = torch.clamp(p_n - q_n, min=0)
        empty = res.sum(-1, keepdim=True) <= 0
        return torch.where(empty, p_n, res)

    def bonus_distribution(self, p_k: Any, q_k: Any | None) -> Any:
        """The bonus token's distribution after a full accept: the target's ``p``."""
        return p_k

    # ------------------------------------------------------------------ the loop
    def run(self, model: Any, prompt: Sequence[int], rows: int, steps: int, params: SamplingParams,
            generator: Any, device: str) -> _Rows:
        torch = _torch()
        k = self.width
        vocab = model.config.vocab_size
        t, d = _Model(model, rows, device), _Model(self.draft, rows, device)
        ids = torch.tensor([list(prompt)] * rows, dtype=torch.long, device=device)
        ones = torch.ones_like(ids, dtype=torch.bool)
        seen = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        seen[:, ids[0]] = True
        first = torch.multinomial(probabilities(t.feed(ids, ones)[:, -1], seen, params), 1, generator=generator)[:, 0]
        d.feed(ids, ones)
        seen[torch.arange(rows), first] = True
        out = _Rows([[x] for x in first.tolist()], [[0] for _ in range(rows)], [[] for _ in range(rows)])
        last = first
        pending = torch.stack([first, first], 1)  # the draft's unseen tokens; slot 0 valid only after a full accept
        pending_valid = torch.zeros(rows, 2, dtype=torch.bool, device=device)
        pending_valid[:, 1] = True
        rows_idx = torch.arange(rows, device=device)
        while min(len(x) for x in out.tokens) < steps:
            # ---- draft: k samples from q
            d_start = d.mask.shape[1]
            q_logits, q_list, q_seen, drafts = [], [], [], []
            logits = d.feed(pending, pending_valid)[:, -1]
            s = seen.clone()
            for j in range(k + (1 if self.feeds_last_draft else 0)):
                q_logits.append(logits)
                q_seen.append(s.clone())
                q_j = self.draft_probs(logits, s, params)
                q_list.append(q_j)
                if j == k:
                    break
                tok = torch.multinomial(q_j, 1, generator=generator)[:, 0]
                drafts.append(tok)
                s[rows_idx, tok] = True
                if j < k - 1 or self.feeds_last_draft:
                    logits = d.feed(tok[:, None], torch.ones(rows, 1, dtype=torch.bool, device=device))[:, -1]
            D = torch.stack(drafts, 1)  # [B, k]
            q_all = torch.stack(q_list[:k], 1)  # [B, k, V]
            q = self.verify_q(q_all, torch.stack(q_logits[:k], 1), q_seen[:k], params)
            # ---- target: one pass over [last] + drafts
            t_start = t.mask.shape[1]
            block = torch.cat([last[:, None], D], 1)
            t_logits = t.feed(block, torch.ones_like(block, dtype=torch.bool))
            seen_block = [seen]
            for i in range(k):
                nxt = seen_block[-1].clone()
                nxt[rows_idx, D[:, i]] = True
                seen_block.append(nxt)
            p = self.target_probs(t_logits, seen_block, seen, params)  # [B, k+1, V]
            p_ratio = self.ratio_p(p[:, :k], t_logits[:, :k], seen_block[:k], params)
            # ---- accept / reject
            r = self.acceptance_uniforms(rows, k, generator, device)
            pd = p_ratio.gather(2, D[:, :, None])[:, :, 0]
            qd = q.gather(2, D[:, :, None])[:, :, 0]
            ok = r * qd < pd  # r < p/q, without dividing by a zero q
            n = torch.cumprod(ok.long(), 1).sum(1)  # accepted drafts per row
            q_ext = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
            p_n = p[rows_idx, n]
            nxt_dist = self.next_distribution(p_n, q_ext[rows_idx, n], n == k)
            full = (n == k)[:, None]
            bonus = self.bonus_distribution(p[:, k], q_list[k] if self.feeds_last_draft else None)
            nxt_dist = torch.where(full, bonus, nxt_dist)
            new = torch.multinomial(nxt_dist, 1, generator=generator)[:, 0]
            # ---- bookkeeping: caches, context, outputs
            t.drop(t_start, 1 + n)
            fed = k if self.feeds_last_draft else k - 1
            d.drop(d_start + 2, torch.clamp(n, max=fed))
            for b, (nb, x) in enumerate(zip(n.tolist(), new.tolist())):
                emitted = D[b, :nb].tolist() + [x]
                out.blocks[b].append((D[b].tolist(), emitted))
                out.tokens[b] += emitted
                out.positions[b] += list(range(len(emitted)))
            seen = seen_block[0].clone()
            keep = torch.arange(k, device=device)[None, :] < n[:, None]
            seen[rows_idx[:, None].expand(-1, k)[keep], D[keep]] = True
            seen[rows_idx, new] = True
            last = new
            fed_last = n == k if not self.feeds_last_draft else torch.zeros_like(n, dtype=torch.bool)
            pending = torch.stack([D[:, k - 1], new], 1)
            pending_valid = torch.stack([fed_last, torch.ones_like(fed_last)], 1)
        return out


def _torch():
    import torch

    return torch


def group_seed(seed: int, prompt: Sequence[int], speculative: bool) -> int:
    """A stable per-prompt, per-side seed (zlib's CRC: the same on every run and platform)."""
    key = f"{seed}:{int(speculative)}:{','.join(map(str, prompt))}".encode()
    return zlib.crc32(key)


def cut_row(tokens: list[int], positions: list[int], limit: int, stops: set[int]) -> tuple[list[int], list[int]]:
    """A row's output up to its first stop token (kept) or ``limit`` tokens."""
    end = min(limit, len(tokens))
    for i, x in enumerate(tokens[:end]):
        if x in stops:
            end = i + 1
            break
    return tokens[:end], positions[:end]


def row_steps(blocks: list[tuple[list[int], list[int]]], limit: int, stops: set[int], width: int) -> list[StepRecord]:
    """The step records of a row's verify steps, each cut as the output is (the first token came from the prefill)."""
    records, made = [], 1
    for proposed, emitted in blocks:
        if made >= limit:
            break
        budget = limit - made
        kept = emitted[:budget]
        for i, x in enumerate(kept):
            if x in stops:
                kept = kept[: i + 1]
                break
        records.append(step_record(proposed, kept, nominal_width=width, budget_before=budget, stop_ids=stops))
        made += len(kept)
        if kept and kept[-1] in stops:
            break
    return records


class SamplingEngine(InProcessEngine):
    """An in-process engine that samples: :meth:`sample` on both sides, :meth:`score_samples` for the
    teacher-forced rows. Greedy ``generate`` is not what it is for: its loop refuses."""

    def __init__(self, target: TorchTarget, sampler: SpeculativeSampler, *, name: str, draft_path: str):
        super().__init__(target, _NoGreedy(name, sampler, draft_path), name=name)
        self.sampler = sampler
        self.baseline = Autoregressive()

    def sample(self, requests: Sequence[GenerationRequest], *, speculative: bool,
               params: SamplingParams) -> list[GenerationResult]:
        """Sample every request; requests with the same prompt and limits run as one batch. Each
        speculative result carries ``facts["block_positions"]``: each token's index in its verify step."""
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault((tuple(req.prompt_ids), req.max_new_tokens, tuple(req.stop_token_ids)), []).append(i)
        results: list[GenerationResult | None] = [None] * len(requests)
        torch = self.target.torch
        for (prompt, limit, stop_ids), members in groups.items():
            stops = set(stop_ids or self.target.stop_token_ids())
            gen = torch.Generator(device=self.target.device).manual_seed(group_seed(params.seed, prompt, speculative))
            try:
                with torch.inference_mode():
                    decoder = self.sampler if speculative else self.baseline
                    rows = decoder.run(self.target.model, prompt, len(members), limit, params, gen, self.target.device)
            except Exception as exc:  # noqa: BLE001 - one failed prompt must not lose the others
                for i in members:
                    results[i] = GenerationResult.failed(requests[i].request_id, f"{type(exc).__name__}: {exc}")
                continue
            for b, i in enumerate(members):
                req = requests[i]
                tokens, positions = cut_row(rows.tokens[b], rows.positions[b], limit, stops)
                spec = (SpecStats.from_steps(row_steps(rows.blocks[b], limit, stops, self.sampler.width),
                                             self.sampler.name) if speculative else SpecStats.unavailable("speculation off"))
                results[i] = GenerationResult(
                    request_id=req.request_id, output_ids=tokens, text=self.target.decode(tokens),
                    finish_reason="stop" if tokens and tokens[-1] in stops else "length",
                    scores=_unreported(len(tokens), req.top_k), spec=spec,
                    facts={"block_positions": positions} if speculative else {},
                )
        return [r for r in results if r is not None]

    def score_samples(self, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]], top_k: int, *,
                      repetition_penalty: float = 1.0) -> list[TokenScores]:
        """Teacher-forced rows of many continuations of one prompt, batched (right padding cannot
        reach a causal row), with the repetition penalty over each position's context applied as
        the sampler applies it (the logprobs are of the penalised logits; temperature and top-k are
        the judge's)."""
        torch = self.target.torch
        model, dev = self.target.model, self.target.device
        out: list[TokenScores] = []
        n = len(prompt_ids)
        for lo in range(0, len(continuations), SCORE_CHUNK):
            chunk = [list(c) for c in continuations[lo: lo + SCORE_CHUNK]]
            width = max((len(c) for c in chunk), default=0)
            if width == 0:
                out += [TokenScores.empty(top_k) for _ in chunk]
                continue
            pad = [c + [0] * (width - len(c)) for c in chunk]
            ids = torch.tensor([list(prompt_ids) + c for c in pad], dtype=torch.long, device=dev)
            with torch.inference_mode():
                logits = model(input_ids=ids).logits[:, n - 1: n - 1 + width].float()
            if repetition_penalty != 1.0:
                seen = torch.zeros(len(chunk), logits.shape[-1], dtype=torch.bool, device=dev)
                seen[:, list(prompt_ids)] = True
                rows = []
                for i in range(width):
                    rows.append(penalise(logits[:, i], seen, repetition_penalty))
                    seen[torch.arange(len(chunk)), ids[:, n + i]] = True
                logits = torch.stack(rows, 1)
            for b, c in enumerate(chunk):
                out.append(scores_from_logits(logits[b, : len(c)], c, top_k) if c else TokenScores.empty(top_k))
        return out


def _unreported(n: int, k: int) -> TokenScores:
    """Rows a sampling result does not report (the run scores teacher-forced): NaN, ids -1."""
    import numpy as np

    return TokenScores(np.full(n, -1), np.full(n, np.nan), np.full((n, k), -1), np.full((n, k), np.nan))


class _NoGreedy:
    """The :class:`SpeculativeLoop` face of a sampling engine: identity for the fingerprint; greedy
    decoding is refused (``specparity run`` gates greedy engines such as ``hf``)."""

    def __init__(self, name: str, sampler: SpeculativeSampler, draft_path: str):
        self.name, self.sampler, self.draft_path = name, sampler, draft_path
        self._artifact: ArtifactId | None = None

    def run(self, target: TorchTarget, request: GenerationRequest) -> LoopOutput:
        raise RuntimeError(f"engine {self.name!r} decodes by sampling only: use `specparity sample`")

    def spec_config(self) -> dict[str, Any]:
        return {"mode": "draft", "num_draft_tokens": self.sampler.width, "decoding": "speculative sampling",
                "sampler": type(self.sampler).__name__}

    def draft_artifact(self) -> ArtifactId | None:
        if self._artifact is None:
            self._artifact = artifact(self.draft_path)
        return self._artifact


def build(options: EngineOptions, sampler_class: type[SpeculativeSampler] = SpeculativeSampler,
          name: str = "spec-sampling") -> SamplingEngine:
    """A sampling engine over ``--target`` / ``--draft`` (default: the fixtures) with ``sampler_class``."""
    target = TorchTarget.from_options(options)
    draft_path = str(options.draft or fixture_dir("draft"))
    width = DEFAULT_DRAFT_TOKENS if options.num_draft_tokens is None else options.num_draft_tokens
    sampler = sampler_class(load_draft_model(draft_path, target), width)
    return SamplingEngine(target, sampler, name=name, draft_path=draft_path)


@engine_factory(EngineInfo("spec-sampling", spec_modes=("draft",), options=dict(HF_OPTIONS)))
def create(options: EngineOptions) -> SamplingEngine:
    """``--engine specparity.engines.inprocess.sampling:create``: the correct speculative sampler."""
    return build(options)
