"""Goldens: a recorded baseline, so a speculative run (or a new engine) is compared without
re-running the target without speculation.

Restarting a 27B server without speculation costs minutes; a golden records, once, what the gate
needs of the baseline: per prompt the token ids, finish reason and top-k logprobs per position as
decoded, and the teacher-forced top-k of the same tokens (the pair the near-tie threshold is
measured from: the noise still comes from a baseline measurement). The format is documented in
``golden/README.md`` (schema ``specparity_golden`` version 1):

* line 1, the header: ``specparity_golden`` (1), the engine ``fingerprint``, its ``baseline_key``
  (sha256 over what decides the baseline's numerics — engine, version, target, dtype, KV-cache and
  kernel settings, not the draft or the speculative config), the prompt files' content hashes,
  ``top_k``, when it was recorded and by which specparity;
* one line per prompt: the prompt, its content hash, the encoded prompt ids, the baseline and its
  teacher-forced scores, and — optional, when a speculative run recorded it — ``acceptance``: that
  run's speculation counters for the prompt (totals and per-step records, as a journal holds them),
  which ``specparity compare`` compares with a later run's (a golden without it: "not recorded").

Every line carries ``sha256``, the hash of its own canonical JSON without that field: a corrupted
or hand-edited golden fails with ``file:line: what is wrong``, never with a wrong verdict. Writes
are atomic (a temporary file in the same directory, then ``os.replace``), and a golden recorded
under another baseline key is never overwritten without ``--update-golden=force``.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from specparity.model.jsonl import JsonlError, read_jsonl
from specparity.model.prompts import Prompt, PromptFileError
from specparity.model.types import Fingerprint, GenerationResult, SpecStats, TokenScores

SCHEMA_VERSION = 1
HEADER_KEY = "specparity_golden"
#: Fingerprint ``extra`` keys that do not decide the baseline's numerics (where a server listens,
#: how it was launched, the speculative side's server): left out of the baseline key.
VOLATILE_EXTRA = frozenset({"baseline_urls", "spec_urls", "launch", "spec_server"})
FINISH_REASONS = ("stop", "length")


class GoldenError(ValueError):
    """A golden that cannot be used as it is; the message is ``file:line: what is wrong``."""


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical(obj).encode("utf-8")).hexdigest()


def prompt_digest(prompt: Prompt) -> str:
    """The content hash of one prompt (its id, text or messages, limit, category, tags)."""
    return digest(prompt.to_json())


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def baseline_fields(fp: Fingerprint) -> dict[str, Any]:
    """What decides the baseline's numerics: the fingerprint without the draft, the speculative
    config and where the servers listen."""
    return {
        "engine": fp.engine,
        "engine_version": fp.engine_version,
        "target": {"sha256": fp.target.sha256, "kind": fp.target.kind},
        "dtype": fp.dtype,
        "extra": {k: v for k, v in sorted(fp.extra.items()) if k not in VOLATILE_EXTRA},
    }


def baseline_key(fp: Fingerprint) -> str:
    return digest(baseline_fields(fp))


def describe_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Which baseline fields differ, in words (``dtype float32 → bfloat16; engine_version …``)."""
    out = []

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{where}.{k}" if where else k)
        elif a != b:
            out.append(f"{where} {a!r} → {b!r}")

    walk(old, new, "")
    return "; ".join(out) or "no difference"


@dataclass
class GoldenEntry:
    prompt: Prompt
    prompt_sha256: str
    prompt_ids: list[int]
    max_new_tokens: int
    baseline: GenerationResult
    tf: TokenScores
    line: int
    #: The speculative run's counters for this prompt (``acceptance``), None when not recorded.
    spec: SpecStats | None = None


@dataclass
class Golden:
    path: Path
    header: dict[str, Any]
    entries: dict[str, GoldenEntry] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.header["baseline_key"]

    @property
    def fields(self) -> dict[str, Any]:
        return self.header["baseline_fields"]

    def describe(self) -> str:
        f = self.fields
        return (f"{self.path} ({len(self.entries)} prompts, {f['engine']} {f['engine_version']} [{f['dtype']}], "
                f"recorded {self.header.get('recorded', '?')})")

    def entry_for(self, prompt: Prompt) -> GoldenEntry | None:
        """The entry of ``prompt``, only when the golden recorded this very prompt (same content)."""
        entry = self.entries.get(prompt.id)
        return entry if entry is not None and entry.prompt_sha256 == prompt_digest(prompt) else None


# --------------------------------------------------------------------------- reading


def _check_sum(obj: dict[str, Any], where: str) -> None:
    stated = obj.get("sha256")
    if not isinstance(stated, str):
        raise GoldenError(f"{where}: sha256: missing (every golden line carries the hash of its content)")
    actual = digest({k: v for k, v in obj.items() if k != "sha256"})
    if actual != stated:
        raise GoldenError(f"{where}: sha256: the line's content does not match its hash (edited by hand or "
                          f"corrupted); re-record it with --update-golden")


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if key not in obj:
        raise GoldenError(f"{where}: {key}: missing (expected {what})")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise GoldenError(f"{where}: {key}: expected {what}, got {type(value).__name__}")
    return value


def _int_list(obj: dict[str, Any], key: str, where: str) -> list[int]:
    value = _need(obj, key, list, where, "a list of token ids")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value):
        raise GoldenError(f"{where}: {key}: expected a list of token ids (integers >= 0)")
    return value


def _rows(obj: dict[str, Any], key: str, n: int, where: str) -> TokenScores:
    data = _need(obj, key, dict, where, "top-k rows {token_ids, logprobs, top_ids, top_logprobs}")
    try:
        scores = TokenScores.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise GoldenError(f"{where}: {key}: expected top-k rows {{token_ids, logprobs, top_ids, top_logprobs}} "
                          f"({type(exc).__name__}: {exc})") from None
    if len(scores) != n:
        raise GoldenError(f"{where}: {key}: {len(scores)} rows for {n} output tokens")
    return scores


def _entry(obj: dict[str, Any], where: str, lineno: int, top_k: int) -> GoldenEntry:
    _check_sum(obj, where)
    try:
        prompt = Prompt.from_json(_need(obj, "prompt", dict, where, "the prompt object"), where)
    except PromptFileError as exc:
        raise GoldenError(str(exc)) from None
    stated = _need(obj, "prompt_sha256", str, where, "the prompt's content hash")
    if stated != prompt_digest(prompt):
        raise GoldenError(f"{where}: prompt_sha256: does not match the prompt recorded on this line")
    prompt_ids = _int_list(obj, "prompt_ids", where)
    output = _int_list(obj, "output_ids", where)
    finish = _need(obj, "finish_reason", str, where, f"one of {', '.join(FINISH_REASONS)}")
    if finish not in FINISH_REASONS:
        raise GoldenError(f"{where}: finish_reason: expected one of {', '.join(FINISH_REASONS)}, got {finish!r}")
    max_new = _need(obj, "max_new_tokens", int, where, "an integer >= 1")
    if max_new < 1 or len(output) > max_new:
        raise GoldenError(f"{where}: max_new_tokens: {max_new} for {len(output)} output tokens")
    scores, tf = _rows(obj, "scores", len(output), where), _rows(obj, "tf", len(output), where)
    for name, rows in (("scores", scores), ("tf", tf)):
        if list(rows.token_ids) != output:
            raise GoldenError(f"{where}: {name}.token_ids: not the output_ids")
        if len(output) and rows.k < top_k:
            raise GoldenError(f"{where}: {name}: {rows.k} alternatives per position, fewer than the header's top_k {top_k}")
    text = obj.get("text", "")
    baseline = GenerationResult(prompt.id, output, text if isinstance(text, str) else "", finish, scores,
                                SpecStats.unavailable("golden baseline"), wall_s=float(obj.get("wall_s", 0.0)))
    spec = None
    if obj.get("acceptance") is not None:
        data = _need(obj, "acceptance", dict, where, "speculation counters {available, proposed, accepted, ...}")
        try:
            spec = SpecStats.from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise GoldenError(f"{where}: acceptance: expected speculation counters ({type(exc).__name__}: {exc})") from None
    return GoldenEntry(prompt, stated, prompt_ids, max_new, baseline, tf, lineno, spec)


def load_golden(path: str | Path) -> Golden:
    """Read and check a golden; :class:`GoldenError` (``file:line: …``) for anything wrong."""
    p = Path(path)
    try:
        jsonl = read_jsonl(p)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise GoldenError(f"{p}: cannot read the golden ({exc})") from None
    except JsonlError as exc:  # not UTF-8: worded as the decoder words it
        raise GoldenError(f"{p}: cannot read the golden ({exc.__cause__})") from None
    golden: Golden | None = None
    for lineno, obj in jsonl.records(error=lambda exc: GoldenError(str(exc))):
        where = f"{p}:{lineno}"
        if not isinstance(obj, dict):
            raise GoldenError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if golden is None:
            version = obj.get(HEADER_KEY)
            if version != SCHEMA_VERSION:
                raise GoldenError(f"{where}: {HEADER_KEY}: expected a header line with {HEADER_KEY}: {SCHEMA_VERSION}, "
                                  f"got {version!r}")
            _check_sum(obj, where)
            for key, kind, what in (("baseline_key", str, "a sha256"), ("baseline_fields", dict, "an object"),
                                    ("fingerprint", dict, "the engine fingerprint"), ("top_k", int, "an integer")):
                _need(obj, key, kind, where, what)
            if digest(obj["baseline_fields"]) != obj["baseline_key"]:
                raise GoldenError(f"{where}: baseline_key: not the hash of baseline_fields")
            golden = Golden(p, obj)
            continue
        entry = _entry(obj, where, lineno, int(golden.header["top_k"]))
        if entry.prompt.id in golden.entries:
            first = golden.entries[entry.prompt.id].line
            raise GoldenError(f"{where}: prompt.id: duplicate id {entry.prompt.id!r} (first recorded at line {first})")
        golden.entries[entry.prompt.id] = entry
    if golden is None:
        raise GoldenError(f"{p}:1: empty golden (expected a {HEADER_KEY} header line)")
    return golden


# --------------------------------------------------------------------------- writing


@dataclass
class Recorded:
    """One prompt's baseline as a run measured it, ready to be written."""

    prompt: Prompt
    prompt_ids: Sequence[int]
    max_new_tokens: int
    baseline: GenerationResult
    tf: TokenScores
    stop_token_ids: Sequence[int] = ()
    #: The speculative run's counters for this prompt, written as ``acceptance`` when available.
    spec: SpecStats | None = None


def _line(obj: dict[str, Any]) -> str:
    return json.dumps({**obj, "sha256": digest(obj)}, ensure_ascii=False) + "\n"


def _entry_json(r: Recorded) -> dict[str, Any]:
    b = r.baseline
    return {
        "prompt": r.prompt.to_json(),
        "prompt_sha256": prompt_digest(r.prompt),
        "prompt_ids": [int(x) for x in r.prompt_ids],
        "max_new_tokens": int(r.max_new_tokens),
        "output_ids": [int(x) for x in b.output_ids],
        "text": b.text,
        "finish_reason": b.finish_reason,
        "wall_s": round(b.wall_s, 6),
        "scores": b.scores.to_json(),
        "tf": r.tf.to_json(),
        **({"acceptance": r.spec.to_json()} if r.spec is not None and r.spec.available else {}),
    }


def write_golden(path: str | Path, fingerprint: Fingerprint, recorded: Iterable[Recorded], *,
                 prompt_files: Sequence[str], top_k: int, keep: Golden | None = None,
                 description: str = "", stop_token_ids: Sequence[int] = ()) -> int:
    """Write the golden atomically; returns the number of prompts in it.

    ``keep``: an existing golden under the same baseline key whose entries for prompts not recorded
    now are kept (a run of some prompts updates those and leaves the others)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fields_ = baseline_fields(fingerprint)
    entries = {r.prompt.id: _entry_json(r) for r in recorded}
    if keep is not None:
        for pid, old in keep.entries.items():
            if pid not in entries:
                entries[pid] = _entry_json(Recorded(old.prompt, old.prompt_ids, old.max_new_tokens, old.baseline, old.tf,
                                                    spec=old.spec))
    header = {
        HEADER_KEY: SCHEMA_VERSION,
        "description": description or "recorded baseline (specparity golden/README.md)",
        "baseline_key": digest(fields_),
        "baseline_fields": fields_,
        "fingerprint": fingerprint.to_json(),
        "prompt_files": [{"name": Path(f).name, "sha256": file_digest(f)} for f in prompt_files if Path(f).is_file()],
        "top_k": int(top_k),
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "recorded": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "specparity": _version(),
    }
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(_line(header))
            for pid in sorted(entries):
                fh.write(_line(entries[pid]))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a golden is shared like source
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(entries)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("specparity")
    except Exception:  # noqa: BLE001 - not installed (a source tree on sys.path)
        return "unknown"
