"""The SGLang and vLLM fakes' model: the committed fixture models, run by specparity itself.

Neither SGLang nor vLLM runs here (no GPU), so their fakes compute every token and logprob with the
fixture target (``fixtures/models/target``) and standalone draft (``fixtures/models/draft``)
through specparity's own in-process engine (:class:`specparity.engines.inprocess.hf.HFEngine`): a speculative
fake decodes with the draft (transformers' assisted generation) and reports the *real* counters of
that loop; a baseline fake decodes greedily without a draft.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import threading
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
TARGET = REPO / "fixtures" / "models" / "target"
DRAFT = REPO / "fixtures" / "models" / "draft"


def recorded(path: Path) -> Any:
    """A recorded body without its ``_source`` / ``_request`` / ``_http_status`` notes."""
    body = json.loads(path.read_text())
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if not k.startswith("_")}
    return body


class FixtureBackend:
    """The fixture target (+ standalone draft) through :class:`HFEngine`; one request at a time.

    The models are deterministic on CPU, so every forward result is kept per exact input (prompt,
    limit, stops, k, mode): the many servers of a test session answer the same prompts again and
    again, and a recomputation would only return the same tokens and rows. Each caller gets its own
    deep copy, so no fault or knob can alter what another request sees."""

    def __init__(self) -> None:
        from specparity.engines.base import EngineOptions
        from specparity.engines.inprocess.hf import DEFAULT_DRAFT_TOKENS, HFEngine

        self.engine = HFEngine(EngineOptions(target=str(TARGET), draft=str(DRAFT), spec_mode="draft"))
        self.tokenizer = self.engine.target.tokenizer
        self.lock = threading.Lock()
        #: The model's EOS ids (generation_config.json + tokenizer), which every server stops on.
        self.eos_ids = tuple(self.engine.stop_token_ids())
        self.primary_eos = self.tokenizer.eos_token_id
        self.draft_width = DEFAULT_DRAFT_TOKENS
        self.vocab_size = int(self.engine.target.model.config.vocab_size)
        self._memo: dict[tuple[Any, ...], Any] = {}

    def _memoized(self, key: tuple[Any, ...], compute: Any) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return copy.deepcopy(self._memo[key])

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int], k: int,
                 speculative: bool):
        from specparity.model.types import GenerationRequest

        req = GenerationRequest("emulator", [int(t) for t in prompt_ids], int(max_new_tokens),
                                tuple(int(t) for t in stop_ids), max(1, int(k)))

        def compute():
            result = self.engine.generate([req], speculative=speculative)[0]
            if result.error:
                raise RuntimeError(result.error)
            return result

        return self._memoized(("generate", tuple(req.prompt_ids), req.max_new_tokens, req.stop_token_ids, req.top_k,
                               bool(speculative)), compute)

    def constrained_generate(self, prompt_ids: Sequence[int], constraint: Any, max_new_tokens: int,
                             stop_ids: Sequence[int], k: int, speculative: bool, rollback_bug: bool = False):
        """A constrained greedy decode (:func:`forced_document`): the constraint admits one document,
        so every server decodes its tokens and then the EOS, whatever the model prefers; rows are
        the model's own (raw) rows of those tokens, as llama.cpp and vLLM report them. Speculative:
        the draft proposes the forced path, every draft is accepted (real step records over it).

        ``rollback_bug`` (speculative): a loop whose grammar state does not roll back with a rejected
        draft — it follows the constraint through its first verify step, then the state is lost and
        the rest is the unconstrained speculative decode of that prefix."""
        import numpy as np

        from specparity.engines.base import step_record
        from specparity.model.types import GenerationResult, SpecStats, TokenScores

        prompt = [int(t) for t in prompt_ids]
        forced = self.tokenizer.encode(forced_document(constraint), add_special_tokens=False) + [self.primary_eos]
        ids = forced[:max_new_tokens]
        steps, pos, width = [], 1, self.draft_width
        while speculative and pos < len(ids):
            emitted = ids[pos:pos + width + 1]
            steps.append(step_record(ids[pos:pos + width], emitted, nominal_width=width,
                                     budget_before=max_new_tokens - pos, stop_ids=stop_ids))
            pos += len(emitted)
        if speculative and rollback_bug:
            keep = min(len(ids), 1 + width + 1)
            ids, steps = ids[:keep], steps[:1]
            if keep < max_new_tokens and ids[-1] not in stop_ids:
                tail = self.generate(prompt + ids, max_new_tokens - keep, stop_ids, k, True)
                ids += list(tail.output_ids)
                steps += list(tail.spec.steps or [])
        scores = self.score(prompt, ids, k) if ids else TokenScores.empty(max(1, k))
        finish = "stop" if ids and ids[-1] in stop_ids else "length"
        spec = SpecStats.from_steps(steps, "fake: forced path") if speculative else SpecStats.unavailable("off")
        return GenerationResult("emulator", ids, self.decode(ids), finish,
                                TokenScores(np.asarray(ids, np.int64), scores.logprobs, scores.top_ids,
                                            scores.top_logprobs), spec)

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], k: int):
        prompt, continuation, kk = [int(t) for t in prompt_ids], [int(t) for t in continuation_ids], max(1, int(k))
        return self._memoized(("score", tuple(prompt), tuple(continuation), kk),
                              lambda: self.engine.score(prompt, continuation, kk))

    def flip_closest_call(self, prompt_ids: Sequence[int], result: Any, max_new_tokens: int,
                          stop_ids: Sequence[int], k: int):
        """``result`` with one near-tie flip (the ``near_tie_flips`` hook): at the position of its
        smallest top-1/top-2 margin whose runner-up is not a stop token, that runner-up is emitted, and
        the rest is the target's greedy continuation of the new prefix. None when no position qualifies.

        The flipped position's row is *not reported* (a server may leave rows out): with margins this
        confident no row is honest there — one that still prefers the target's token says the server
        emitted a token its own verify pass rejected (``diverged``), one that prefers the flip is a
        computation far outside the noise (``drifted``)."""
        import numpy as np

        from specparity.model.types import TokenScores

        s, ids = result.scores, list(result.output_ids)
        n = min(len(ids), len(s))
        if s.k < 2 or n < 2:
            return None
        stops = {int(t) for t in stop_ids}
        margins = s.top_logprobs[:n, 0] - s.top_logprobs[:n, 1]
        candidates = [i for i in range(n) if int(s.top_ids[i, 1]) not in stops and np.isfinite(margins[i])]
        if not candidates:
            return None
        i = min(candidates, key=lambda j: float(margins[j]))
        runner_up = int(s.top_ids[i, 1])
        head = ids[:i] + [runner_up]
        chosen, top_ids, top_lp = s.logprobs[: i + 1].copy(), s.top_ids[: i + 1].copy(), s.top_logprobs[: i + 1].copy()
        chosen[i], top_ids[i], top_lp[i] = np.nan, -1, np.nan
        parts = [TokenScores(np.asarray(head, np.int64), chosen, top_ids, top_lp)]
        if max_new_tokens > len(head):
            tail = self.generate(list(prompt_ids) + head, max_new_tokens - len(head), stop_ids, k, False)
            head += list(tail.output_ids)
            parts.append(tail.scores)
        scores = TokenScores(*(np.concatenate([getattr(p, f) for p in parts])
                               for f in ("token_ids", "logprobs", "top_ids", "top_logprobs")))
        return dataclasses.replace(result, output_ids=head, scores=scores)

    def prompt_rows(self, ids: Sequence[int], k: int) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
        """Per prompt position: None for position 0, else (logprob of the actual token, its 1-based
        rank in the vocabulary, the top-k (id, logprob)) — what vLLM's prompt logprobs carry."""
        return self._memoized(("prompt_rows", tuple(int(t) for t in ids), int(k)),
                              lambda: self._prompt_rows(ids, k))

    def _prompt_rows(self, ids: Sequence[int], k: int) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
        import torch

        model = self.engine.target.model
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([list(ids)], dtype=torch.long)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        rows: list[Any] = [None]
        kk = min(max(1, k), lp.shape[-1])
        for i in range(1, len(ids)):
            row = lp[i - 1]
            actual = float(row[int(ids[i])])
            rank = 1 + int((row > row[int(ids[i])]).sum())
            vals, idx = torch.topk(row, kk)
            rows.append((actual, rank, list(zip(idx.tolist(), vals.tolist()))))
        return rows

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)


def instance_noise(scores: Any, prefix: Sequence[int], nats: float) -> Any:
    """``scores`` (rows of the tokens after ``prefix``) as another server instance computes them: every
    logprob moved by −``nats``, 0 or +``nats``, chosen by a hash of the row's prefix and the token (so
    decode and scoring rows of one instance agree), rows re-sorted; rows whose top-1/top-2 margin is
    under 3 × ``nats`` are kept, so no argmax moves (the ``instance_noise_nats`` knob)."""
    import numpy as np

    from specparity.model.types import TokenScores

    ids = [int(t) for t in prefix]
    logprobs, top_ids, top_lp = scores.logprobs.copy(), scores.top_ids.copy(), scores.top_logprobs.copy()
    for i, tid in enumerate(scores.token_ids.tolist()):
        context = hash(tuple(ids))
        ids.append(int(tid))
        if scores.k < 2 or not top_lp[i, 0] - top_lp[i, 1] >= 3 * nats:
            continue
        step = [nats * ((hash((context, int(t))) % 3) - 1) for t in top_ids[i]]
        top_lp[i] += np.asarray(step, np.float32)
        logprobs[i] += nats * ((hash((context, int(tid))) % 3) - 1)
        order = np.argsort(-top_lp[i], kind="stable")
        top_ids[i], top_lp[i] = top_ids[i][order], top_lp[i][order]
    return TokenScores(scores.token_ids, logprobs, top_ids, top_lp)


def scoring_skew(scores: Any, nats: float) -> Any:
    """Teacher-forced ``scores`` as a server whose scoring path is wrong computes them: every alternative
    below a row's top-1 moved down by ``nats`` (the token's own logprob too where it is not the top-1), so
    every margin against the top-1 grows by ``nats``, no argmax moves and no row's probabilities sum past
    1 (the ``scoring_skew_nats`` knob; decode rows are left as they are)."""
    import numpy as np

    from specparity.model.types import TokenScores

    top_lp = scores.top_logprobs.copy()
    top_lp[:, 1:] -= np.float32(nats)
    own = scores.logprobs.copy()
    own[scores.token_ids != scores.top_ids[:, 0]] -= np.float32(nats)
    return TokenScores(scores.token_ids, own, scores.top_ids, top_lp)


def forced_document(constraint: Any) -> str:
    """The one document a fake server's constraint admits: for a JSON schema its smallest instance
    (required properties only; the first enum value, the minimum number, ``minItems`` items, an
    ``"a"`` per required string character), for a grammar the literal of ``root ::= "..."``. A
    grammar with anything more is not emulated (ValueError)."""
    import json
    import re

    if constraint.kind == "grammar":
        m = re.fullmatch(r'\s*root\s*::=\s*("(?:[^"\\]|\\.)*")\s*', constraint.text)
        if not m:
            raise ValueError("only a grammar of one literal (root ::= \"...\") is emulated")
        return json.loads(m.group(1))

    def instance(schema: dict[str, Any]) -> Any:
        if "enum" in schema:
            return schema["enum"][0]
        kind = schema.get("type")
        if kind == "object":
            props = schema.get("properties", {})
            return {key: instance(props.get(key, {})) for key in schema.get("required", [])}
        if kind == "array":
            return [instance(schema.get("items", {})) for _ in range(int(schema.get("minItems", 0)))]
        if kind in ("integer", "number"):
            return schema.get("minimum", 0)
        if kind == "boolean":
            return True
        if kind == "string":
            return "a" * max(1, int(schema.get("minLength", 1)))
        return None

    return json.dumps(instance(constraint.schema), separators=(",", ":"))


@functools.lru_cache(maxsize=1)
def shared_backend() -> FixtureBackend:
    """One backend per process: every emulator shares the loaded models (and their lock)."""
    return FixtureBackend()


def shortened(result: Any) -> Any:
    """``result`` cut to half its tokens, never ending on a stop token (the ``short_limit`` fault):
    an answer that stopped for its length before the limit the request gave."""
    from specparity.model.types import TokenScores

    keep = max(1, len(result.output_ids) // 2)
    if len(result.output_ids) > 1 and keep == len(result.output_ids):
        keep -= 1
    s = result.scores
    scores = TokenScores(s.token_ids[:keep], s.logprobs[:keep], s.top_ids[:keep], s.top_logprobs[:keep])
    return dataclasses.replace(result, output_ids=list(result.output_ids)[:keep], scores=scores)
