"""Pieces every in-process (torch) engine shares: logprob extraction, hashing, finish reasons."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specparity.model.types import ArtifactId, FinishReason, TokenScores

#: Above this many bytes of weights a model directory is hashed by config + safetensors headers +
#: sizes instead of full content (hashing many GB on every run would dominate it).
FULL_HASH_LIMIT = 512 * 1024 * 1024
_HASHED_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".gguf")


def dir_sha256(path: str | os.PathLike[str]) -> str:
    """Content hash of a model directory (weights, config, tokenizer files), order-independent.

    Returns ``sha256:<hex>`` for a full-content hash, or ``sha256-headers:<hex>`` when the weights
    exceed :data:`FULL_HASH_LIMIT` and only configs, safetensors headers and file sizes are hashed.
    """
    root = Path(path)
    if root.is_file():
        files = [root]
    else:
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES)
    total = sum(p.stat().st_size for p in files)
    full = total <= FULL_HASH_LIMIT
    h = hashlib.sha256()
    for p in files:
        rel = p.name if root.is_file() else str(p.relative_to(root))
        h.update(rel.encode() + b"\0")
        with p.open("rb") as fh:
            if full or p.suffix != ".safetensors":
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            else:
                (n,) = struct.unpack("<Q", fh.read(8))
                h.update(fh.read(min(n, 100 << 20)))
                h.update(str(p.stat().st_size).encode())
    return ("sha256:" if full else "sha256-headers:") + h.hexdigest()


def model_kind(path: str | os.PathLike[str]) -> str:
    """The first ``architectures`` entry of a model directory's config.json, if any."""
    cfg = Path(path) / "config.json"
    try:
        arch = json.loads(cfg.read_text()).get("architectures") or [""]
        return str(arch[0])
    except (OSError, ValueError):
        return ""


def scores_from_logits(logits, token_ids: Sequence[int], top_k: int) -> TokenScores:
    """Float32 log-softmax of ``logits`` [n, vocab] → logprob of each chosen token plus the top-k."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None])[:, 0] if len(token_ids) else lp.new_zeros(0)
    k = min(top_k, lp.shape[-1])
    top_lp, top_ids = torch.topk(lp, k, dim=-1, sorted=True)
    return TokenScores(
        np.asarray(token_ids, dtype=np.int64),
        chosen.cpu().numpy(),
        top_ids.cpu().numpy(),
        top_lp.cpu().numpy(),
    )


def finish_reason(output_ids: Sequence[int], stop_ids: Sequence[int]) -> FinishReason:
    """``stop`` if the stream ends on a stop token, else ``length``; whether a ``length`` stream
    really reached ``max_new_tokens`` is the comparison's check (``compare._stream_problem``)."""
    if output_ids and output_ids[-1] in set(stop_ids):
        return "stop"
    return "length"


def torch_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype: expected one of {sorted(table)}, got {name!r}")
    return table[name]


#: ``tokenizer_class`` values for which ``AutoTokenizer`` loads the generic tokenizers-backed class.
GENERIC_FAST_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
#: transformers resolves its names lazily on their first import, and a second thread importing a name while the
#: first is resolving it is told it does not exist (``ImportError: cannot import name …``); the shards of a Ray
#: run (:mod:`specparity.run.ray_fleet`) build their engines side by side, so the imports go one at a time.
_TRANSFORMERS_IMPORT = threading.Lock()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` from local files, without torch where that is the
    same object: a directory whose ``tokenizer_config.json`` names the generic fast class (the
    fixtures do) is loaded by that class, which is the one AutoTokenizer would pick. Importing
    AutoTokenizer pulls in torch and transformers' model registry (about 2.5 s of CPU), which a
    server engine encoding prompts never needs; any other tokenizer class still goes through it."""
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("tokenizer_class") in GENERIC_FAST_TOKENIZERS:
        with _TRANSFORMERS_IMPORT:
            from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    with _TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads: on a 2-core machine one thread is ~50x faster for tiny models
    when anything else is running (docs/PERFORMANCE.md)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def artifact(path: str | os.PathLike[str] | None, kind: str = "") -> ArtifactId | None:
    """The identity of a model: a local directory hashed (``dir_sha256``, its ``architectures[0]``
    as the kind, else ``kind``), a single file (a GGUF) hashed whole, anything else (a hub id, a
    path only the server sees) named only. The one builder every engine's fingerprint uses."""
    if not path:
        return None
    p = Path(path)
    if p.is_dir():
        return ArtifactId(str(p), dir_sha256(p), model_kind(p) or kind)
    if p.is_file():
        return ArtifactId(str(p), "sha256:" + hashlib.sha256(p.read_bytes()).hexdigest(), kind)
    return ArtifactId(str(path), "", kind)



def check_draft_given(options: Any, engine: str, mode: str, *, alternative: str = "") -> None:
    """A draft-model spec mode with ``--target`` but no ``--draft`` is refused (ValueError, before any
    model loads): the fixture draft is paired only with the fixture target (the demo run without
    ``--target``), never silently with a user's model, whose tokenizer it does not share."""
    if options.target and not options.draft:
        raise ValueError(f"--draft: --target {options.target} is given without --draft, and the {engine} engine's "
                         f"--spec-mode {mode} needs a draft model made for that target (the fixture draft goes only "
                         f"with the fixture target){alternative}")
