"""The output constraint a prompt may carry (data only; the checks live in :mod:`specparity.structured`).

Kept apart from :mod:`specparity.types` so the request type can name it without importing the
checks (which need ``jsonschema``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "grammar"]
#: The prompt-file fields that carry a constraint (at most one per prompt).
CONSTRAINT_FIELDS: tuple[ConstraintKind, ...] = ("json_schema", "grammar")


@dataclass(frozen=True)
class Constraint:
    """One prompt's output constraint. ``text`` is the GBNF grammar, or the schema as canonical JSON
    (sorted keys), so the request stays hashable and a journal compares it as a string."""

    kind: ConstraintKind
    text: str

    @property
    def schema(self) -> dict[str, Any]:
        """The JSON schema (``kind`` ``json_schema`` only)."""
        return json.loads(self.text)

    def value(self) -> Any:
        """What a prompt file holds (and what engines are sent): the schema object or the grammar string."""
        return self.schema if self.kind == "json_schema" else self.text

    def describe(self) -> str:
        return "JSON schema" if self.kind == "json_schema" else "GBNF grammar"
