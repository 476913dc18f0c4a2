"""Structured output under speculation: a prompt's output constraint and the check of the result.

A prompt may carry a JSON schema (``"json_schema": {...}``) or a GBNF grammar (``"grammar":
"root ::= ..."``). The gate sends it on both sides, so the baseline and the speculative run decode
under the same constraint; a speculative loop whose grammar state does not roll back with a
rejected draft then emits a token the constraint forbids, and its output differs from the
baseline's (token identity) and — for a schema — stops being valid JSON for the schema
(:func:`check_output`), a failure with its own reason.

Why rows are hidden (:func:`hide_forced_rows`): an engine may report logprobs of the *raw*
distribution (llama.cpp's ``n_probs`` rows come from the logits before its sampler chain and
grammar) while the constraint picks the best *allowed* token, so a constrained token is often not its row's argmax. The gate's checks that read
"the emitted token is its own row's argmax" (greedy baselines, a speculative token its own verify
row rejects, the teacher-forced argmax after a near tie) cannot know the allowed set, so for a
constrained prompt a row whose token is not its argmax is treated as *not reported*: never used for
a margin or a noise sample, and a divergence there is ``diverged``, never excused as a near tie.
Rows whose token is the argmax (the constraint did not bind) are kept and checked as usual.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import numpy as np

from specparity.model.constraints import Constraint
from specparity.model.types import TokenScores

if TYPE_CHECKING:
    from specparity.model.verdicts import Verdict
    from specparity.model.gate_run import PromptRecord
    from specparity.model.types import GenerationResult

#: What :func:`check_output` says about one output.
Validity = Literal["valid", "invalid", "truncated", "constrained"]


@dataclass(frozen=True)
class OutputCheck:
    """What :func:`check_output` found: ``status`` and, for ``invalid``, why (one line)."""

    status: Validity
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "why": self.why}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "OutputCheck | None":
        return cls(data["status"], data.get("why", "")) if data else None


def json_prefix_state(text: str) -> Literal["complete", "prefix", "invalid"]:
    """Whether ``text`` is one complete JSON value, a proper prefix of one, or neither.

    A small scanner (the standard library parses only complete documents): it tracks open
    containers, strings with their escapes, and partial literals/numbers, so ``{"a": [1, "x`` is a
    prefix and ``{"a" 1`` is invalid."""
    s = text.strip()
    if not s:
        return "prefix"
    try:
        json.loads(s)
        return "complete"
    except ValueError:
        pass
    # expected tokens after each state; a tiny LL(1) walk that stops at the end of input
    stack: list[str] = []  # "{" or "["
    expect = "value"  # value | key_or_end | key | colon | comma_or_end | value_or_end | done
    i, n = 0, len(s)
    literals = ("true", "false", "null")
    number = re.compile(r"-?(0|[1-9]\d*)?(\.\d*)?([eE][+-]?\d*)?")

    def after_value() -> str:  # a value or a container just ended
        return "comma_or_end" if stack else "done"
    while i < n:
        c = s[i]
        if c in " \t\r\n":
            i += 1
            continue
        if expect == "done":
            return "invalid"
        if expect in ("value", "value_or_end"):
            if c == "]" and expect == "value_or_end":
                stack.pop()
                i += 1
                expect = after_value()
                continue
            if c in "{[":
                stack.append(c)
                expect = "key_or_end" if c == "{" else "value_or_end"
                i += 1
                continue
            if c == '"':
                end = _string_at(s, i)
                if isinstance(end, str):
                    return end
                i = end
                expect = after_value()
                continue
            word = next((w for w in literals if s.startswith(w[: n - i], i) and c == w[0]), None)
            if word is not None:
                if n - i < len(word):
                    return "prefix"
                i += len(word)
                expect = after_value()
                continue
            m = number.match(s, i)
            if m and m.end() > i:
                i = m.end()
                if i >= n:
                    return "prefix"
                expect = after_value()
                continue
            return "invalid"
        if expect in ("key_or_end", "key"):
            if c == "}" and expect == "key_or_end":
                stack.pop()
                i += 1
                expect = after_value()
                continue
            if c != '"':
                return "invalid"
            end = _string_at(s, i)
            if isinstance(end, str):
                return end
            i = end
            expect = "colon"
            continue
        if expect == "colon":
            if c != ":":
                return "invalid"
            i += 1
            expect = "value"
            continue
        if expect == "comma_or_end":
            top = stack[-1]
            if c == ",":
                expect = "key" if top == "{" else "value"
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                stack.pop()
                expect = after_value()
            else:
                return "invalid"
            i += 1
            continue
    return "prefix" if expect != "done" else "invalid"  # "done" parsed above as complete


def _string_at(s: str, start: int) -> int | Literal["prefix", "invalid"]:
    """The index just past the string opening at ``start``; when the text ends inside it, whether
    what is there can still become a string (``prefix``) or not (``invalid``)."""
    end = _string_end(s, start)
    if end is not None:
        return end
    return "prefix" if _string_ok(s[start + 1:]) else "invalid"


def _string_end(s: str, start: int) -> int | None:
    """Index just past the closing quote of the string opening at ``start`` (None: not closed)."""
    i = start + 1
    while i < len(s):
        if s[i] == "\\":
            i += 2
            continue
        if s[i] == '"':
            return i + 1 if _string_ok(s[start + 1:i]) else None
        i += 1
    return None


def _string_ok(body: str) -> bool:
    """No raw control characters and only JSON escapes in (the open part of) a string."""
    if any(ord(ch) < 0x20 for ch in body):
        return False
    return re.fullmatch(r'(?:[^"\\]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{0,4}|\\$)*', body) is not None


def check_output(constraint: Constraint, text: str, finish_reason: str) -> OutputCheck:
    """Whether a constrained output satisfies its constraint.

    * ``grammar``: ``constrained`` — decoded under the grammar; the gate does not parse GBNF itself
      (token identity with the baseline is the check).
    * ``json_schema``: ``valid`` when the text parses as one JSON document that validates against
      the schema; ``truncated`` when the decoder stopped at ``max_new_tokens`` (finish ``length``)
      with a proper prefix of a JSON document — not judged, the limit cut it; ``invalid`` (with why)
      otherwise: unparsable text, a document that breaks the schema, or one that ended by a stop
      token before it closed.
    """
    if constraint.kind == "grammar":
        return OutputCheck("constrained")
    state = json_prefix_state(text)
    if state == "prefix" and finish_reason == "length":
        return OutputCheck("truncated", "ended at max_new_tokens before the JSON document closed")
    if state != "complete":
        where = "before the JSON document closed" if state == "prefix" else "not JSON"
        return OutputCheck("invalid", f"{where}: {_clip(text)}")
    from jsonschema import validators

    schema = constraint.schema
    error = next(iter(validators.validator_for(schema)(schema).iter_errors(json.loads(text))), None)
    if error is None:
        return OutputCheck("valid")
    path = "/".join(str(p) for p in error.absolute_path) or "<root>"
    return OutputCheck("invalid", f"breaks the schema at {path}: {error.message}"[:240])


def _clip(text: str, limit: int = 80) -> str:
    return json.dumps(text if len(text) <= limit else text[:limit] + "…", ensure_ascii=False)


def constraint_problem(baseline: OutputCheck | None, spec: OutputCheck | None) -> str | None:
    """The failure reason when the speculative output broke a constraint the baseline kept (None:
    no such failure). A truncated side is not judged (the limit cut it, not the decoder)."""
    if baseline is None or spec is None or spec.status != "invalid" or baseline.status != "valid":
        return None
    return f"constraint broken under speculation: the speculative output {spec.why} (the baseline's is valid)"


def hide_forced_rows(scores: TokenScores) -> TokenScores:
    """``scores`` with every row whose own token is not its argmax marked *not reported* (see the
    module docstring: under a constraint the row is the raw distribution, and the constraint, not
    the argmax, chose the token). Rows already unreported stay so; the token ids are kept."""
    if not len(scores):
        return scores
    own = scores.logprobs
    best = np.where(scores.top_ids[:, 0] >= 0, scores.top_logprobs[:, 0], np.nan)
    with np.errstate(invalid="ignore"):
        forced = np.isfinite(own) & np.isfinite(best) & (own < best)
    if not forced.any():
        return scores
    logprobs, top_ids, top_lp = own.copy(), scores.top_ids.copy(), scores.top_logprobs.copy()
    logprobs[forced] = np.nan
    top_ids[forced] = -1
    top_lp[forced] = np.nan
    return TokenScores(scores.token_ids.copy(), logprobs, top_ids, top_lp)


def output_text(result: "GenerationResult", decode: Callable[[Sequence[int]], str]) -> str:
    """The text a constraint governs: the output without the stop token that ended it (the stop
    token's own text, such as ``</s>``, is not part of the document)."""
    ids = result.output_ids[:-1] if result.finish_reason == "stop" and result.output_ids else result.output_ids
    return decode(ids)


def judge_constraint(verdict: "Verdict", constraint: Constraint, baseline: "GenerationResult",
                     spec: "GenerationResult", decode: Callable[[Sequence[int]], str]) -> None:
    """Record both sides' output checks on ``verdict``; when speculation broke a constraint the
    baseline kept, the prompt fails with that as its reason (``diverged``, whatever the token
    comparison said: a near-tie flip that leaves the schema is no harmless flip)."""
    base_check = check_output(constraint, output_text(baseline, decode), baseline.finish_reason)
    spec_check = check_output(constraint, output_text(spec, decode), spec.finish_reason) if not spec.error else None
    checks: dict[str, Any] = {"kind": constraint.kind, "baseline": base_check.to_json(),
                              "spec": spec_check.to_json() if spec_check else None}
    problem = constraint_problem(base_check, spec_check)
    if problem:
        checks["problem"] = problem
    apply_constraint_checks(verdict, checks)


def apply_constraint_checks(verdict: "Verdict", checks: dict[str, Any]) -> None:
    """Record a constrained prompt's output ``checks`` (``kind``, ``baseline``, ``spec``, ``problem``) on
    ``verdict``; a ``problem`` (speculation broke the constraint the baseline kept) makes it ``diverged``
    unless it is an ``error``. Also for checks made earlier and journalled (the checks read text, which
    a merge of shard journals cannot decode; they do not depend on the threshold)."""
    verdict.constraint = dict(checks)
    problem = checks.get("problem")
    if problem and verdict.klass != "error":
        verdict.reason = f"{problem}; {verdict.reason}"
        verdict.klass = "diverged"


def unconstrained_baselines(records: "Sequence[PromptRecord]", decode: Callable[[Sequence[int]], str]) -> str | None:
    """Why the baselines show that the engine did not apply the constraints (None: they do): a
    baseline of a JSON-schema prompt that is no valid document for its schema (a truncated one is
    not judged). The engine was sent the schema, so this is the engine's or the configuration's
    fault — the run is refused like a non-greedy baseline (exit 3), never judged unconstrained."""
    bad = []
    for rec in records:
        c, b = rec.prompt.constraint, rec.baseline
        if c is None or c.kind != "json_schema" or b is None or b.error:
            continue
        check = check_output(c, output_text(b, decode), b.finish_reason)
        if check.status == "invalid":
            bad.append(f"{rec.prompt.id} ({check.why})")
    if not bad:
        return None
    return (f"the baseline output breaks its prompt's JSON schema on {len(bad)} prompt(s), first {bad[0]}: the "
            f"engine did not apply the constraint it was sent (docs/STRUCTURED.md)")
