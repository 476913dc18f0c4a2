"""The tokenizer a ``llamacpp`` run uses: llama-server's own (``/tokenize``, ``/detokenize``), with the GGUF's byte
pieces decoded as llama.cpp decodes them and the served vocabulary's digest, so the gate sends and reads token
ids exactly as the server does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence


from specparity.engines.server.http import Endpoint, ServerError
from specparity.engines.common import FULL_HASH_LIMIT
from specparity.engines.server.gguf_meta import GGUFError, GGUFVocab, read_vocab


def utf8_complete_len(data: bytes) -> int:
    """llama.cpp's ``validate_utf8``: the length of ``data`` without a multi-byte character cut off
    at its end (it inspects only the last four bytes, as the server does)."""
    n = len(data)
    for i in range(1, min(4, n) + 1):
        c = data[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character standing for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def byte_piece_tokens(tokenizer: Any) -> list[int]:
    """Ids whose bytes end in an incomplete UTF-8 character (byte-level BPE vocabularies): the
    tokens whose probability rows llama-server drops."""
    tok = getattr(tokenizer, "tok", tokenizer)
    dec = byte_decoder()
    out = []
    for token, idx in tok.get_vocab().items():
        if token in tok.all_special_tokens or not all(ch in dec for ch in token):
            continue
        data = bytes(dec[ch] for ch in token)
        if utf8_complete_len(data) < len(data):
            out.append(int(idx))
    return sorted(out)


def gguf_byte_pieces(vocab: GGUFVocab) -> list[int]:
    """:func:`byte_piece_tokens` from the GGUF's own vocabulary: byte-level BPE pieces (``gpt2``
    tokenizers) or SentencePiece byte tokens (``<0xE6>``) that end in an incomplete UTF-8 character."""
    out = []
    if vocab.tokenizer_model == "gpt2":
        dec = byte_decoder()
        for i, token in enumerate(vocab.tokens):
            if token and all(ch in dec for ch in token):
                data = bytes(dec[ch] for ch in token)
                if utf8_complete_len(data) < len(data):
                    out.append(i)
    else:
        for i, token in enumerate(vocab.tokens):
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    data = bytes([int(token[3:5], 16)])
                except ValueError:
                    continue
                if utf8_complete_len(data) < len(data):
                    out.append(i)
    return out


#: Text tokenized on every endpoint to check that all of them tokenize alike (Latin, digits,
#: punctuation, accents, CJK and an emoji: the pre-tokenizer's and the byte fallback's cases).
TOKENIZE_PROBE = "Hello, world! 12345 déjà vu 日本語のテキスト 🙂\n\tdef f(x): return x*2"


DIGEST_CHUNK = 1 << 20


def gguf_digest(path: Path) -> str:
    """The served file's content identity: ``sha256:`` of the whole file, or above
    :data:`~specparity.engines.common.FULL_HASH_LIMIT` ``sha256-sampled:`` of its size and 64 evenly
    spaced 1 MiB chunks (two different weight files differ there; hashing many GB per endpoint per
    run would not do)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as fh:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: fh.read(DIGEST_CHUNK), b""):
                h.update(chunk)
            return "sha256:" + h.hexdigest()
        h.update(str(size).encode())
        for i in range(64):
            fh.seek(i * (size - DIGEST_CHUNK) // 63)
            h.update(fh.read(DIGEST_CHUNK))
    return "sha256-sampled:" + h.hexdigest()


def server_tokenize(endpoint: Endpoint, text: str) -> list[int]:
    """``/tokenize`` with special tokens added and parsed as ``/completion`` does for a text prompt."""
    r = endpoint.post_json("/tokenize", {"content": text, "add_special": True, "parse_special": True})
    if not isinstance(r, dict) or not isinstance(r.get("tokens"), list):
        raise ServerError(f"{endpoint.base_url}/tokenize answered without a 'tokens' list")
    return [int(t) for t in r["tokens"]]


class LlamaServerTokenizer:
    """Prompt encoding, decoding and stop ids of the served model itself: raw prompts through the
    server's ``/tokenize`` with special tokens added as ``/completion`` adds them (the BOS the
    vocabulary asks for), messages through ``/apply-template`` (the GGUF's chat template, as
    ``/v1/chat/completions`` renders it) and then ``/tokenize``; stop ids are the GGUF's
    end-of-generation set (:mod:`specparity.engines.server.gguf_meta`)."""

    def __init__(self, endpoint: Endpoint, vocab: GGUFVocab):
        self.endpoint = endpoint
        self.vocab = vocab
        self.path = f"{endpoint.base_url} (/tokenize, /apply-template of {vocab.path})"

    def tokenize(self, text: str) -> list[int]:
        return server_tokenize(self.endpoint, text)

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        if messages is not None:
            r = self.endpoint.post_json("/apply-template", {"messages": messages, "add_generation_prompt": True})
            if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
                raise ServerError(f"{self.endpoint.base_url}/apply-template answered without a 'prompt' string")
            return self.tokenize(r["prompt"])
        return self.tokenize(prompt or "")

    def decode(self, ids: Sequence[int]) -> str:
        r = self.endpoint.post_json("/detokenize", {"tokens": [int(t) for t in ids]})
        return str(r.get("content", "")) if isinstance(r, dict) else ""

    def stop_token_ids(self) -> tuple[int, ...]:
        return self.vocab.eog_ids


def served_vocab(target: str | None, props: dict[str, Any], *, required: bool) -> GGUFVocab | None:
    """The GGUF vocabulary of the served target: ``--target`` / the launched file, else the
    ``model_path`` the server reports in ``/props`` when that file is readable here. None when
    neither is readable and not ``required`` (an explicit ``--engine-opt tokenizer`` then stands for
    the model's vocabulary); ValueError otherwise."""
    for path in (target, props.get("model_path")):
        if path and Path(path).is_file():
            try:
                return read_vocab(path)
            except GGUFError as exc:
                raise ValueError(f"--target {path}: {exc}") from None
    if not required:
        return None
    raise ValueError(f"--target: the llamacpp engine reads the served GGUF's vocabulary and end-of-generation tokens, "
                     f"but the server's model_path {props.get('model_path')!r} is not readable here; pass --target "
                     "PATH.gguf (a copy of the served file) or --engine-opt tokenizer=DIR (the model's Hugging Face "
                     "tokenizer directory)")
