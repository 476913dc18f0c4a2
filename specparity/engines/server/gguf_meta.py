"""What a GGUF file says about its vocabulary: tokens, special ids, end-of-generation set.

The llamacpp engine sends token ids, so it must know the served model's own vocabulary: which ids
end generation (llama.cpp's EOG set, which ``/props`` does not list) and which tokens are byte
pieces whose probability rows the server drops. Both are read from the GGUF's metadata here — a
header-only reader (no tensor data is touched, no extra dependency) of the GGUF v2/v3 key-value
section.

The EOG set follows llama.cpp's ``llama_vocab::impl::load`` (``src/llama-vocab.cpp``): the EOS,
EOT and EOM ids and the FIM pad/rep/sep ids from the metadata, plus every token whose text is one of
the end-of-turn spellings llama.cpp recognises.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
#: Token texts llama.cpp marks as end-of-generation whatever the metadata says (src/llama-vocab.cpp).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
#: Metadata keys whose id is end-of-generation.
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
            "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id")
#: GGUF scalar value types: type id -> struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not a readable GGUF (the message names the file)."""


@dataclass
class GGUFVocab:
    """A GGUF's vocabulary and identity, as llama.cpp will load it."""

    path: str
    architecture: str
    tokenizer_model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    tokens: list[str] = field(repr=False)
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    eog_ids: tuple[int, ...]
    name: str = ""

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


class _Reader:
    def __init__(self, buf: Any, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF metadata")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            return [self.value(itype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF value type {vtype}")


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key-value pair of a GGUF file's header (GGUF v2 and v3)."""
    p = Path(path)
    try:
        with p.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            r = _Reader(buf, str(p))
            if bytes(buf[:4]) != GGUF_MAGIC:
                raise GGUFError(f"{p}: not a GGUF file (no GGUF magic)")
            r.pos = 4
            version = r.take("I")
            if version < 2:
                raise GGUFError(f"{p}: GGUF version {version} is not supported (2 or 3 expected)")
            r.take("Q")  # tensor count
            n_kv = r.take("Q")
            out: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                out[key] = r.value(r.take("I"))
            return out
    except (OSError, ValueError) as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{p}: cannot read GGUF metadata ({exc})") from None


def read_vocab(path: str | Path) -> GGUFVocab:
    """The vocabulary, special ids and EOG set of a GGUF file (:class:`GGUFError` if unreadable)."""
    meta = read_metadata(path)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens in the GGUF metadata")
    model = str(meta.get("tokenizer.ggml.model", ""))

    def special(key: str) -> int | None:
        v = meta.get(key)
        return int(v) if isinstance(v, int) and 0 <= v < len(tokens) else None

    eog = {i for i in (special(k) for k in EOG_KEYS) if i is not None}
    eog |= {i for i, t in enumerate(tokens) if t in EOG_TEXTS}
    # llama.cpp's default for a GPT-2 style vocabulary is no BOS; for SentencePiece it is one
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = model in ("llama", "t5") and special("tokenizer.ggml.bos_token_id") is not None
    return GGUFVocab(path=str(path), architecture=str(meta.get("general.architecture", "")), tokenizer_model=model,
                     tokens=[str(t) for t in tokens], bos_id=special("tokenizer.ggml.bos_token_id"),
                     eos_id=special("tokenizer.ggml.eos_token_id"), add_bos=bool(add_bos),
                     eog_ids=tuple(sorted(eog)), name=str(meta.get("general.name", "")))
