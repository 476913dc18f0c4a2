"""Prompt suites: the versioned JSONL schema, its strict loader, and the long-context generator.

Schema ``specparity_prompts`` version 1 (documented in ``prompts/README.md``):

* line 1: header ``{"specparity_prompts": 1, "description": "..."}``
* every other non-blank line: one prompt object with ``id`` (unique, ``[a-z0-9][a-z0-9_.-]*``),
  ``category``, ``lang``, exactly one of ``prompt`` (str) or ``messages`` (list of
  ``{"role", "content"}``), optional ``max_new_tokens`` (int ≥ 1), optional ``tags`` (list of str),
  optional output constraint: at most one of ``json_schema`` (a JSON Schema object) or ``grammar``
  (a GBNF string with a ``root`` rule), see :mod:`specparity.judge.structured`.

A malformed file fails with ``file:line: field: what was expected`` — never with a KeyError
three modules later.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from specparity.model.constraints import CONSTRAINT_FIELDS, Constraint
from specparity.model.jsonl import JsonlError, read_jsonl

SCHEMA_VERSION = 1
HEADER_KEY = "specparity_prompts"
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_ROLES = {"system", "user", "assistant"}
_KNOWN_FIELDS = {"id", "category", "lang", "prompt", "messages", "max_new_tokens", "tags", *CONSTRAINT_FIELDS}


class PromptFileError(ValueError):
    """A prompt file that does not follow the schema; the message is ``file:line: field: expected``."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    lang: str
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    max_new_tokens: int | None = None
    tags: tuple[str, ...] = ()
    source: str = ""  # "file:line", for error messages and reports
    #: The output constraint sent to both sides (None: unconstrained; :mod:`specparity.judge.structured`).
    constraint: Constraint | None = None

    def messages_as_dicts(self) -> list[dict[str, str]] | None:
        if self.messages is None:
            return None
        return [{"role": r, "content": c} for r, c in self.messages]

    @classmethod
    def from_json(cls, data: Any, source: str = "") -> "Prompt":
        """The inverse of :meth:`to_json`, checked like a prompt file's line (``source`` names where
        the object came from: a journal's or golden's ``file:line``)."""
        return _parse_record(data, source)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "category": self.category, "lang": self.lang}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        else:
            out["messages"] = self.messages_as_dicts()
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.tags:
            out["tags"] = list(self.tags)
        if self.constraint is not None:
            out[self.constraint.kind] = self.constraint.value()
        return out


@dataclass
class PromptSuite:
    path: str
    description: str
    prompts: list[Prompt] = field(default_factory=list)

    def select(self, categories: Iterable[str] | None = None, ids: Iterable[str] | None = None) -> list[Prompt]:
        cats = set(categories) if categories else None
        wanted = set(ids) if ids else None
        return [
            p for p in self.prompts if (cats is None or p.category in cats) and (wanted is None or p.id in wanted)
        ]


def _fail(where: str, fieldname: str, expected: str) -> PromptFileError:
    return PromptFileError(f"{where}: {fieldname}: {expected}")


def _not_json(exc: JsonlError) -> PromptFileError:
    return _fail(exc.where, "<line>", f"invalid JSON ({exc.reason} at column {exc.column})")


def _parse_record(obj: Any, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise _fail(where, "<line>", f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KNOWN_FIELDS)
    if unknown:
        raise _fail(where, unknown[0], f"unknown field (expected one of {sorted(_KNOWN_FIELDS)})")
    for key in ("id", "category", "lang"):
        if key not in obj:
            raise _fail(where, key, "missing (expected a non-empty string)")
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise _fail(where, key, f"expected a non-empty string, got {obj[key]!r}")
    if not _ID_RE.match(obj["id"]):
        raise _fail(where, "id", f"expected lowercase [a-z0-9][a-z0-9_.-]*, got {obj['id']!r}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise _fail(where, "prompt/messages", "expected exactly one of 'prompt' or 'messages'")
    prompt = messages = None
    if has_prompt:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise _fail(where, "prompt", "expected a non-empty string")
        prompt = obj["prompt"]
    else:
        raw = obj["messages"]
        if not isinstance(raw, list) or not raw:
            raise _fail(where, "messages", "expected a non-empty list of {role, content} objects")
        parsed = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or set(m) != {"role", "content"}:
                raise _fail(where, f"messages[{i}]", "expected an object with exactly 'role' and 'content'")
            if m["role"] not in _ROLES:
                raise _fail(where, f"messages[{i}].role", f"expected one of {sorted(_ROLES)}, got {m['role']!r}")
            if not isinstance(m["content"], str):
                raise _fail(where, f"messages[{i}].content", "expected a string")
            parsed.append((m["role"], m["content"]))
        messages = tuple(parsed)
    max_new = obj.get("max_new_tokens")
    if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
        raise _fail(where, "max_new_tokens", f"expected an integer >= 1, got {max_new!r}")
    tags = obj.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _fail(where, "tags", f"expected a list of strings, got {tags!r}")
    from specparity.model.constraints import ConstraintError, parse_constraint

    try:
        constraint = parse_constraint(obj)
    except ConstraintError as exc:
        raise PromptFileError(f"{where}: {exc}") from None
    return Prompt(
        id=obj["id"],
        category=obj["category"],
        lang=obj["lang"],
        prompt=prompt,
        messages=messages,
        max_new_tokens=max_new,
        tags=tuple(tags),
        source=where,
        constraint=constraint,
    )


def load_prompts(path: str | Path) -> PromptSuite:
    """Load and validate one prompt file; raise :class:`PromptFileError` naming file:line:field."""
    path = Path(path)
    try:
        jsonl = read_jsonl(path)
    except FileNotFoundError:
        raise PromptFileError(f"{path}: file not found (expected a specparity prompts JSONL file)") from None
    except IsADirectoryError:
        raise PromptFileError(f"{path}: is a directory (expected a specparity prompts JSONL file)") from None
    except OSError as exc:
        raise PromptFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except JsonlError as exc:
        raise _fail(exc.where, "<line>", exc.detail) from None
    header_seen = False
    suite = PromptSuite(path=str(path), description="")
    seen: dict[str, str] = {}
    for lineno, obj in jsonl.records(error=_not_json):
        where = f"{path}:{lineno}"
        if not header_seen:
            if not isinstance(obj, dict) or HEADER_KEY not in obj:
                raise _fail(where, HEADER_KEY, f'expected a header line {{"{HEADER_KEY}": {SCHEMA_VERSION}, ...}}')
            if obj[HEADER_KEY] != SCHEMA_VERSION:
                raise _fail(where, HEADER_KEY, f"expected schema version {SCHEMA_VERSION}, got {obj[HEADER_KEY]!r}")
            suite.description = str(obj.get("description", ""))
            header_seen = True
            continue
        record = _parse_record(obj, where)
        if record.id in seen:
            raise _fail(where, "id", f"duplicate id {record.id!r} (first defined at {seen[record.id]})")
        seen[record.id] = where
        suite.prompts.append(record)
    if not header_seen:
        raise _fail(f"{path}:1", HEADER_KEY, "expected a header line; the file is empty")
    if not suite.prompts:
        raise _fail(f"{path}:{jsonl.last_line}", "<file>", "expected at least one prompt after the header")
    return suite


def load_many(paths: Iterable[str | Path]) -> list[Prompt]:
    """Load several files; ids must be unique across all of them."""
    out: list[Prompt] = []
    seen: dict[str, str] = {}
    for p in paths:
        for prompt in load_prompts(p).prompts:
            if prompt.id in seen:
                raise _fail(prompt.source, "id", f"duplicate id {prompt.id!r} (first defined at {seen[prompt.id]})")
            seen[prompt.id] = prompt.source
            out.append(prompt)
    return out


# --------------------------------------------------------------------------- long context


_FACT_SUBJECTS = ["the red box", "the blue key", "the old map", "the green lamp", "the silver coin", "the tall tree"]
_FACT_PLACES = ["the kitchen", "the garden", "the attic", "room 7", "the library", "the boat"]


def encode_prompt(tokenizer: Any, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
    """Token ids of a raw prompt (with the special tokens the tokenizer adds by default — its BOS,
    as a server given the text adds it) or of chat messages (the tokenizer's chat template with a
    generation prompt, which writes its own special tokens): the one encoding every engine and
    tool uses, so a prompt is the same tokens in-process, over HTTP and in the fixture
    measurements. The fixture tokenizer adds none."""
    if messages is not None:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return list(tokenizer.encode(prompt or "", add_special_tokens=True))


def long_context_prompt(target_tokens: int, *, seed: int = 0, chars_per_token: float = 3.5) -> Prompt:
    """A deterministic needle-in-a-haystack prompt of roughly ``target_tokens`` tokens.

    The haystack is numbered filler sentences; one "fact" (the needle) is placed at a seeded
    depth and the question at the end asks for it. Length is a parameter so the same generator
    serves a short CPU run (default suites) and 128K-token server runs. ``chars_per_token`` is a
    conservative estimate; engines tokenize for real and report the true length.
    """
    if target_tokens < 16:
        raise ValueError(f"long_context_prompt: target_tokens must be >= 16, got {target_tokens}")
    rng = random.Random(seed)
    subject, place = rng.choice(_FACT_SUBJECTS), rng.choice(_FACT_PLACES)
    needle = f"Remember this: {subject} is in {place}."
    budget = int(target_tokens * chars_per_token)
    sentences: list[str] = []
    used = 0
    i = 0
    while used < budget:
        s = f"Line {i}: the number {i} comes after {i - 1} and before {i + 1}."
        sentences.append(s)
        used += len(s) + 1
        i += 1
    sentences.insert(rng.randrange(len(sentences) + 1), needle)
    question = f"Question: where is {subject}? Answer: {subject} is in"
    return Prompt(
        id=f"longctx-en-{target_tokens}",
        category="long_context",
        lang="en",
        prompt="\n".join(sentences) + "\n" + question,
        tags=("long-context", f"tokens~{target_tokens}"),
        source=f"<long_context_prompt tokens={target_tokens} seed={seed}>",
    )
