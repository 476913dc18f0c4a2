"""The one JSON Lines reader behind prompt files, goldens and run journals.

All three are UTF-8 text with one JSON value per line, read whole, whose mistakes must be named by
``file:line``. This module holds what they share — decoding, splitting into lines, skipping blank
lines, parsing each line — and raises one error, :class:`JsonlError`, carrying the path and line
number of what could not be read. What each line must hold (a header first, an object of a known
kind …) and how a mistake is worded stay with the format's own module (:mod:`specparity.model.prompts`,
:mod:`specparity.run.golden`, :mod:`specparity.run.journal`).

Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (characters JSON never holds unescaped), and at nothing
else: the files are written with ``ensure_ascii=False``, so a string may hold U+2028, U+0085 or
another character :meth:`str.splitlines` would also break a line at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator


class JsonlError(ValueError):
    """A JSON Lines file that is not UTF-8, or holds a line that is not JSON.

    ``path`` and ``line`` (1-based) say where; ``column`` (1-based, in the line) and ``reason`` (the
    decoder's words) what; ``byte`` is the first byte that is not UTF-8 (None: the line is not
    JSON). ``str()`` is ``path:line: detail``; a format with its own wording builds its message
    from the attributes.
    """

    def __init__(self, path: Path, line: int, column: int, reason: str, byte: int | None = None) -> None:
        self.path, self.line, self.column, self.reason, self.byte = path, line, column, reason, byte
        super().__init__(f"{self.where}: {self.detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.path, self.line, self.column, self.reason, self.byte)

    @property
    def where(self) -> str:
        """``path:line``, the prefix of every line-level message."""
        return f"{self.path}:{self.line}"

    @property
    def not_utf8(self) -> bool:
        """Whether the file's bytes are not UTF-8 (else the line is not JSON)."""
        return self.byte is not None

    @property
    def detail(self) -> str:
        """What is wrong, in words, without the place."""
        if self.byte is not None:
            return f"expected UTF-8 text ({self.reason}: byte 0x{self.byte:02x} at column {self.column})"
        return f"not JSON ({self.reason} at column {self.column})"


@dataclass(frozen=True)
class JsonlFile:
    """A JSON Lines file read whole: its path and its lines (without the empty piece after a final
    newline, so ``lines[-1]`` is the file's last line)."""

    path: Path
    lines: tuple[str, ...]

    @property
    def last_line(self) -> int:
        """The number of the file's last line (0 for an empty file)."""
        return len(self.lines)

    def records(self, *, torn_tail: bool = False,
                error: Callable[[JsonlError], Exception] | None = None) -> Iterator[tuple[int, Any]]:
        """``(line number, parsed value)`` of every non-blank line, in order.

        ``torn_tail``: a last line that is not JSON ends the iteration instead of raising — the line
        a writer killed mid-write left behind (an append-only journal), whose earlier lines are
        intact. ``error``: turns the :class:`JsonlError` of a line that is not JSON into the
        exception raised instead (the format's own error, in its own words)."""
        for lineno, line in enumerate(self.lines, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as exc:
                if torn_tail and lineno == self.last_line:
                    return
                problem = JsonlError(self.path, lineno, exc.colno, exc.msg)
                raise (error(problem) if error is not None else problem) from None
            yield lineno, value


def read_jsonl(path: str | Path) -> JsonlFile:
    """Read and decode ``path``; :class:`OSError` (missing, a directory, unreadable) is left to the
    caller, which words it for its format; bytes that are not UTF-8 raise :class:`JsonlError` at
    the line and column of the first bad byte."""
    p = Path(path)
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise JsonlError(p, line, column, exc.reason, data[exc.start]) from exc
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()  # the empty piece after the final newline is no line
    return JsonlFile(p, tuple(lines))
