"""The output constraint a prompt may carry, read from its prompt row (the checks of an output live in
:mod:`specparity.judge.structured`).

Kept apart from :mod:`specparity.model.types` so the request type can name it without importing the
checks (which need ``jsonschema``)."""

from __future__ import annotations

import json
import re
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


#: A GBNF grammar must define the rule engines start from.
_ROOT_RULE = re.compile(r"^\s*root\s*::=", re.MULTILINE)


class ConstraintError(ValueError):
    """A constraint that is not one (a schema that is no JSON Schema, a grammar without ``root``)."""


def parse_constraint(obj: dict[str, Any]) -> Constraint | None:
    """The constraint of one prompt row (None: unconstrained). Raises :class:`ConstraintError` whose
    message starts with the field name: ``json_schema: ...`` / ``grammar: ...``."""
    given = [f for f in CONSTRAINT_FIELDS if f in obj]
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintError("json_schema/grammar: expected at most one of 'json_schema' or 'grammar'")
    if given[0] == "json_schema":
        schema = obj["json_schema"]
        if not isinstance(schema, dict) or not schema:
            raise ConstraintError(f"json_schema: expected a non-empty JSON Schema object, got {schema!r}"[:200])
        try:
            from jsonschema import exceptions, validators
        except ImportError:  # a checkout run without installing specparity's dependencies
            raise ConstraintError("json_schema: checking a JSON Schema needs the jsonschema package, a dependency of "
                                  "specparity that is not installed here (pip install 'jsonschema>=4.18')") from None
        try:
            validators.validator_for(schema).check_schema(schema)
        except exceptions.SchemaError as exc:
            path = "/".join(str(p) for p in exc.path)
            raise ConstraintError(f"json_schema: not a valid JSON Schema ({exc.message}"
                                  + (f" at {path}" if path else "") + ")") from None
        return Constraint("json_schema", json.dumps(schema, sort_keys=True, ensure_ascii=False))
    grammar = obj["grammar"]
    if not isinstance(grammar, str) or not grammar.strip():
        raise ConstraintError("grammar: expected a non-empty GBNF grammar string")
    if not _ROOT_RULE.search(grammar):
        raise ConstraintError("grammar: expected a GBNF grammar with a 'root ::= ...' rule (engines start from root)")
    return Constraint("grammar", grammar)
