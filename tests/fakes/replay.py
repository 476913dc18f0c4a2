"""The llama.cpp fakes' "model": the captured greedy answers of ``tests/data/llamacpp/``, replayed.

No torch: a fake ``llama-server`` answers from the token streams a real one produced on the fixture
target (see ``tests/data/llamacpp/README``). The same context always gets the same row, so a
baseline's decode rows and the per-position scoring rows agree exactly.
"""

from __future__ import annotations

import functools
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from specparity.engines.server.llamacpp_tokens import byte_decoder

DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp"
TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "target" / "tokenizer.json"

#: The chat template's generation prompt, ``<|im_start|>assistant\n``: what follows it is the answer.
GENERATION_PROMPT = (1, 281, 203)
EOS = 2


def load(name: str) -> Any:
    """A captured body of ``tests/data/llamacpp/``."""
    return json.loads((DATA / name).read_bytes())


class Vocab:
    """Token id -> bytes, read from the fixture target's ``tokenizer.json`` (no transformers)."""

    def __init__(self, path: Path = TOKENIZER_JSON):
        tok = json.loads(path.read_text(encoding="utf-8"))
        dec = byte_decoder()
        self.bytes: dict[int, bytes] = {}
        for piece, idx in tok["model"]["vocab"].items():
            self.bytes[int(idx)] = bytes(dec[ch] for ch in piece) if all(ch in dec for ch in piece) else piece.encode()
        self.special = {int(a["id"]) for a in tok.get("added_tokens", []) if a.get("special")}
        for a in tok.get("added_tokens", []):
            self.bytes[int(a["id"])] = a["content"].encode()
        self.size = max(self.bytes) + 1

    def piece(self, tid: int) -> dict[str, Any]:
        """``{id, token, bytes}`` as llama-server writes them (``token`` is "" for a cut UTF-8 piece)."""
        data = self.bytes.get(tid, b"")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = ""
        return {"id": tid, "token": text, "bytes": list(data)}

    def text(self, ids: Sequence[int]) -> str:
        return b"".join(self.bytes.get(t, b"") for t in ids).decode("utf-8", "replace")


@dataclass
class Stream:
    """A captured greedy answer: its tokens and, per position, (id, logprob) alternatives or None."""

    name: str
    tokens: list[int]
    rows: list[list[tuple[int, float]] | None]


class ReplayModel:
    """Greedy "model": each prompt gets one captured stream (by a hash of the prompt ids); beyond or
    off that stream it continues with deterministic ordinary tokens. ``row(context, k)`` is the
    next token's top-k (the argmax first), a pure function of the context."""

    SOURCES = ("completion_nospec.json", "completion_stop_eos.json", "completion_parallel2_b.json",
               "completion_spec_ngram_simple.json")

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.streams = [self._stream(name) for name in self.SOURCES]
        seen = sorted({t for s in self.streams for t in s.tokens} | {
            a for s in self.streams for r in s.rows if r for a, _ in r})
        #: ordinary tokens for synthesized continuations and padding: never special, never a stop
        self.ordinary = [t for t in seen if t not in vocab.special and t > 4]

    @staticmethod
    def _stream(name: str) -> Stream:
        body = load(name)
        tokens = [int(t) for t in body["tokens"]]
        rows: list[list[tuple[int, float]] | None] = [None] * len(tokens)
        for i, row in enumerate(body["completion_probabilities"][: len(tokens)]):
            alts = row.get("top_logprobs") or []
            # a reported row of a greedy answer has its own token first; drafted rows (empty) and
            # anything else are synthesized instead
            if alts and int(row["id"]) == tokens[i] and int(alts[0]["id"]) == tokens[i]:
                rows[i] = [(int(a["id"]), float(a["logprob"])) for a in alts]
        return Stream(name, tokens, rows)

    @staticmethod
    def split(context: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt up to the last generation prompt, the answer so far)."""
        ctx = tuple(int(t) for t in context)
        g = len(GENERATION_PROMPT)
        for j in range(len(ctx) - g, -1, -1):
            if ctx[j:j + g] == GENERATION_PROMPT:
                return ctx[: j + g], ctx[j + g:]
        return ctx, ()

    def stream_for(self, prompt: Sequence[int]) -> Stream:
        return self.streams[zlib.crc32(ids_bytes(prompt)) % len(self.streams)]

    def row(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        prompt, answer = self.split(context)
        s = self.stream_for(prompt)
        i = len(answer)
        alts: list[tuple[int, float]]
        if i < len(s.tokens) and list(answer) == s.tokens[:i]:
            tok = s.tokens[i]
            alts = list(s.rows[i]) if s.rows[i] else [(tok, -0.0123)]
        else:
            h = zlib.crc32(ids_bytes(context))
            tok = self.ordinary[h % len(self.ordinary)]
            alts = [(tok, -0.0456)]
        # pad to k alternatives below the last one, deterministically, within the probability mass the
        # row leaves (a row's alternatives never sum to more than 1: halving steps stay under the rest)
        have = {a for a, _ in alts}
        rest = max(1e-6, 1.0 - sum(math.exp(x) for _, x in alts))
        lp = min(min(x for _, x in alts) - 1.5, math.log(rest / 2))
        start = zlib.crc32(ids_bytes(context[-4:])) % len(self.ordinary)
        j = 0
        while len(alts) < k and j < len(self.ordinary):
            cand = self.ordinary[(start + j) % len(self.ordinary)]
            j += 1
            if cand not in have:
                alts.append((cand, round(lp, 6)))
                have.add(cand)
                lp -= 0.7  # a factor e^-0.7 < 1/2 per step
        return alts[:k]

    def greedy(self, prompt: Sequence[int], n_predict: int, k: int) -> tuple[list[int], list[list[tuple[int, float]]], str]:
        """(tokens, their rows, stop_type) of a greedy decode: stops after EOS or at n_predict."""
        ctx = list(prompt)
        tokens: list[int] = []
        rows: list[list[tuple[int, float]]] = []
        while len(tokens) < n_predict:
            r = self.row(ctx, k)
            tokens.append(r[0][0])
            rows.append(r)
            ctx.append(r[0][0])
            if r[0][0] == EOS:
                return tokens, rows, "eos"
        return tokens, rows, "limit"


def ids_bytes(ids: Iterable[int]) -> bytes:
    return b",".join(str(int(t)).encode() for t in ids)


@functools.lru_cache(maxsize=1)
def shared_vocab() -> Vocab:
    """One vocabulary per process (reading tokenizer.json takes a moment)."""
    return Vocab()
