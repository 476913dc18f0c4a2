"""Structured output under speculation (docs/STRUCTURED.md).

* the prompt fields ``json_schema`` / ``grammar``: read, checked, written back;
* the output checks: a JSON document valid for its schema, a prefix cut by ``max_new_tokens``
  (truncated, not judged), anything else invalid; a grammar output is reported as constrained;
* rows the constraint (not the argmax) chose are not judged on;
* the bodies the adapters build are read as the engines' own sources define the fields (SGLang's
  ``SamplingParams``, vLLM's ``StructuredOutputsParams``; every other vLLM key one a live vLLM
  0.26.0 answered), carry the prompt file's own schema or grammar, and are accepted by the SGLang
  and vLLM emulators, which validate them on their own and decode under the constraint; in a gate
  run both sides receive it;
* a speculative loop whose grammar state does not roll back with a rejected draft (the fakes'
  ``grammar_rollback_bug``) fails the gate on constrained prompts, with its own reason, and passes
  an unconstrained run: only the constrained prompts catch it.
"""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fakes import SGLangServer, VLLMServer
from fakes.backend import TARGET, FixtureBackend, forced_document
from fakes.gate import pytest_in_process
from specparity.model.constraints import Constraint
from specparity.engines.server.sglang_wire import WIRE as sglang_wire
from specparity.engines.server.vllm_wire import WIRE as vllm_wire
from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import PromptFileError, load_prompts
from specparity.judge.structured import check_output, hide_forced_rows, json_prefix_state
from specparity.model.types import GenerationRequest, TokenScores

STRUCTURED = REPO_ROOT / "prompts" / "structured.jsonl"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}},
          "required": ["n", "s"], "additionalProperties": False}


def schema_constraint(schema: dict = SCHEMA) -> Constraint:
    return Constraint("json_schema", json.dumps(schema, sort_keys=True))


# ------------------------------------------------------------------------------------- prompt files


def test_structured_prompt_file_carries_a_constraint_on_every_prompt():
    prompts = load_prompts(STRUCTURED).prompts
    assert prompts and all(p.constraint is not None for p in prompts)
    assert {p.constraint.kind for p in prompts} == {"json_schema", "grammar"}
    for p in prompts:  # written back as read: a journal or golden holds the same constraint
        again = type(p).from_json(p.to_json(), "again")
        assert again.constraint == p.constraint


@pytest.mark.parametrize("field, value, expect", [
    ("json_schema", {"type": "objekt"}, "json_schema: not a valid JSON Schema"),
    ("json_schema", [], "json_schema: expected a non-empty JSON Schema object"),
    ("grammar", "answer ::= [0-9]+", "grammar: expected a GBNF grammar with a 'root ::= ...' rule"),
    ("grammar", 7, "grammar: expected a non-empty GBNF grammar string"),
])
def test_a_bad_constraint_names_file_line_and_field(tmp_path, field, value, expect):
    path = tmp_path / "p.jsonl"
    row = {"id": "x-1", "category": "x", "lang": "en", "prompt": "hi", field: value}
    path.write_text('{"specparity_prompts": 1}\n' + json.dumps(row) + "\n")
    with pytest.raises(PromptFileError) as err:
        load_prompts(path)
    assert str(err.value).startswith(f"{path}:2: {expect}"), str(err.value)


# ------------------------------------------------------------------------------------- output checks


@pytest.mark.parametrize("text, state", [
    ('{"n": 1, "s": "a"}', "complete"), ('{"n": [1, "x', "prefix"), ('{"n": tr', "prefix"), ("", "prefix"),
    ('{"n":1,', "prefix"), ('{"n" 1', "invalid"), ('{"n": 1} x', "invalid"), ("{}}", "invalid"),
    ("The answer is", "invalid"), ('{"a\nb', "invalid"),
])
def test_json_prefix_state(text, state):
    assert json_prefix_state(text) == state


def test_check_output_valid_truncated_invalid():
    c = schema_constraint()
    assert check_output(c, '{"n": 3, "s": "b"}', "stop").status == "valid"
    # cut by the limit mid-document: not judged (the limit cut it, not the decoder)
    assert check_output(c, '{"n": 3, "s": "', "length").status == "truncated"
    # the same text ended by a stop token: the decoder closed nothing
    stopped = check_output(c, '{"n": 3, "s": "', "stop")
    assert stopped.status == "invalid" and "before the JSON document closed" in stopped.why
    broken = check_output(c, '{"n": 3, "s": "c"}', "stop")
    assert broken.status == "invalid" and "breaks the schema at s" in broken.why
    # at the limit, text that is no JSON prefix is invalid, not truncated
    assert check_output(c, "The answer is 3", "length").status == "invalid"
    assert check_output(Constraint("grammar", 'root ::= "x"'), "anything", "stop").status == "constrained"


def test_rows_the_constraint_chose_are_not_judged_on():
    """Row 0's token is its argmax (kept); row 1's token is second (the constraint chose it: hidden);
    row 2 was already unreported (stays so)."""
    scores = TokenScores([5, 7, 9], [-0.1, -2.0, np.nan], [[5, 6], [8, 7], [-1, -1]],
                         [[-0.1, -3.0], [-0.5, -2.0], [np.nan, np.nan]])
    out = hide_forced_rows(scores)
    assert out.reported(0) and not out.reported(1) and not out.reported(2)
    assert out.token_ids.tolist() == [5, 7, 9] and (out.top_ids[1] == -1).all()
    assert scores.reported(1)  # the input is left alone


# ------------------------------------------------------------------------------------- adapters
#
# What each engine makes of a request body, as the engines' own sources declare it (never as the
# adapters build it), so a body that follows a wrong belief about a field fails here:
#
# * SGLang ``/generate``: ``sampling_params`` is ``SamplingParams`` (``sglang/srt/sampling/sampling_params.py``):
#   ``json_schema: Optional[str]``, ``regex: Optional[str]``, ``ebnf: Optional[str]`` (the grammar fields), and
#   ``SamplingParams.verify()`` raises "Only one of regex, json_schema, or ebnf can be set." when more than one
#   is not None. A key outside the struct is HTTP 400 (0.5.23) or 500 (0.5.19): the emulator's allow-lists
#   (``tests/fakes/sglang.py``) hold the fields of each version.
# * vLLM ``/v1/completions``: ``CompletionRequest.structured_outputs: StructuredOutputsParams | None``
#   (``vllm/entrypoints/openai/protocol.py``); ``StructuredOutputsParams`` (``vllm/sampling_params.py``) has
#   ``json: str | dict | None``, ``regex: str | None``, ``choice: list[str] | None``, ``grammar: str | None``,
#   ``json_object: bool | None``, ``structural_tag: str | None`` and its ``__post_init__`` demands exactly one
#   of those six; ``disable_any_whitespace``, ``disable_additional_properties`` (bool) and
#   ``whitespace_pattern`` (str | None) are options. vLLM ignores a top-level key it does not declare (with a
#   warning), so a misspelt key decodes unconstrained and the server still answers 200.

#: SGLang ``SamplingParams`` grammar fields and what each holds (``Optional[str]`` each).
SGLANG_GRAMMAR_FIELDS = {"json_schema": "a JSON schema serialised as a string", "regex": "a regular expression",
                         "ebnf": "an EBNF grammar (xgrammar reads the GBNF dialect)"}
#: vLLM ``StructuredOutputsParams``: the six constraint fields (exactly one set) with their types, and the options.
VLLM_CONSTRAINT_FIELDS = {"json": (str, dict), "regex": (str,), "choice": (list,), "grammar": (str,),
                          "json_object": (bool,), "structural_tag": (str,)}
VLLM_OPTION_FIELDS = {"disable_any_whitespace": (bool,), "disable_additional_properties": (bool,),
                      "whitespace_pattern": (str,)}
#: The recorded live vLLM 0.26.0 exchanges: requests the server answered.
VLLM_026_CAPTURES = sorted((REPO_ROOT / "tests" / "data" / "vllm-0.26.0").glob("capture-*.json"))


def raw_constraints(path: Path = STRUCTURED) -> list[tuple[str, str, object]]:
    """(prompt id, field, value) of every constrained row, read as plain JSON (not through the
    prompt loader): what the prompt file asks the engines to apply."""
    out = []
    for line in path.read_text().splitlines()[1:]:
        row = json.loads(line)
        for field in ("json_schema", "grammar"):
            if field in row:
                out.append((row["id"], field, row[field]))
    return out


def sglang_reading(sampling: dict) -> tuple[str, object] | None:
    """What SGLang's ``SamplingParams`` makes of ``sampling_params``: None (unconstrained) or (kind,
    value) with kind ``json_schema`` (the parsed schema), ``ebnf`` or ``regex``; AssertionError where the
    source's types or ``verify()`` refuse it."""
    set_fields = [f for f in SGLANG_GRAMMAR_FIELDS if sampling.get(f) is not None]
    assert len(set_fields) <= 1, f"SamplingParams.verify(): only one of regex, json_schema, or ebnf: {set_fields}"
    if not set_fields:
        return None
    field = set_fields[0]
    value = sampling[field]
    assert isinstance(value, str), f"sampling_params.{field} is Optional[str], got {type(value).__name__}"
    return (field, json.loads(value)) if field == "json_schema" else (field, value)


def vllm_reading(structured: object) -> tuple[str, object]:
    """What vLLM's ``StructuredOutputsParams`` makes of ``structured_outputs``: (field, value) of its one
    constraint field; AssertionError where the dataclass or its ``__post_init__`` refuse it."""
    assert isinstance(structured, dict), f"structured_outputs is a StructuredOutputsParams object, got {structured!r}"
    unknown = set(structured) - set(VLLM_CONSTRAINT_FIELDS) - set(VLLM_OPTION_FIELDS)
    assert not unknown, f"StructuredOutputsParams has no field {sorted(unknown)}"
    for field, value in structured.items():
        kinds = {**VLLM_CONSTRAINT_FIELDS, **VLLM_OPTION_FIELDS}[field]
        nullable = field not in ("disable_any_whitespace", "disable_additional_properties")
        assert (value is None and nullable) or isinstance(value, kinds), (field, value)
    set_fields = [f for f in VLLM_CONSTRAINT_FIELDS if structured.get(f) is not None]
    assert len(set_fields) == 1, f"StructuredOutputsParams.__post_init__ demands exactly one constraint: {set_fields}"
    field = set_fields[0]
    value = structured[field]
    return field, (json.loads(value) if field == "json" and isinstance(value, str) else value)


def live_vllm_keys() -> set[str]:
    """Every top-level key of a ``/v1/completions`` request a live vLLM 0.26.0 answered with 200."""
    keys: set[str] = set()
    for path in VLLM_026_CAPTURES:
        for ex in json.loads(path.read_text()).get("exchanges", []):
            if ex["path"] == "/v1/completions" and ex["status"] == 200 and isinstance(ex.get("request"), dict):
                keys |= set(ex["request"])
    return keys


def request_for(prompt_id: str, prompts: Path = STRUCTURED, rid: str = "r-1") -> GenerationRequest:
    """The request the gate builds for one prompt of ``prompts`` (its constraint as the loader read it)."""
    prompt = next(p for p in load_prompts(prompts).prompts if p.id == prompt_id)
    return GenerationRequest(rid, [1, 2, 3], 24, (2,), 4, constraint=prompt.constraint)


def post(url: str, body: dict) -> tuple[int, object]:
    """POST ``body`` as JSON; (status, parsed answer or text)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, data = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, data = err.code, err.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data.decode(errors="replace")


@pytest.mark.parametrize("prompt_id, field, value", [pytest.param(*row, id=row[0]) for row in raw_constraints()])
def test_sglang_reads_each_prompts_constraint_from_the_body(prompt_id, field, value):
    """Through the request path the engine uses (``WIRE``): the body SGLang parses carries the prompt's
    own schema (as a JSON string) or grammar (as ``ebnf``), one grammar field only, and no
    ``sampling_params`` key that 0.5.19 or 0.5.23 would refuse."""
    from fakes.sglang import SGLANG_SAMPLING_0_5_19, SGLANG_SAMPLING_0_5_23

    body = sglang_wire.body(request_for(prompt_id), {"rid": "r-1"})
    sampling = body["sampling_params"]
    both_versions = set(SGLANG_SAMPLING_0_5_23) & set(SGLANG_SAMPLING_0_5_19)
    refused = set(sampling) - both_versions
    assert not refused, f"sampling_params keys SGLang does not declare in both versions: {sorted(refused)}"
    expected = ("json_schema", value) if field == "json_schema" else ("ebnf", value)
    assert sglang_reading(sampling) == expected, sampling
    plain = sglang_wire.body(GenerationRequest("r-2", [1, 2, 3], 24, (2,), 4), {"rid": "r-2"})["sampling_params"]
    assert sglang_reading(plain) is None and not set(plain) - both_versions


@pytest.mark.parametrize("prompt_id, field, value", [pytest.param(*row, id=row[0]) for row in raw_constraints()])
def test_vllm_reads_each_prompts_constraint_from_the_body(prompt_id, field, value):
    """Through the request path the engine uses (``WIRE``): ``structured_outputs`` is a valid
    ``StructuredOutputsParams`` whose one constraint is the prompt's schema (``json``) or grammar
    (``grammar``); every other top-level key is one a live vLLM 0.26.0 answered, since a key vLLM does
    not declare is dropped without an error."""
    body = vllm_wire.body(request_for(prompt_id), {"model": "m", "top_k": 0})
    unverified = set(body) - live_vllm_keys() - {"structured_outputs"}
    assert not unverified, f"keys no live vLLM 0.26.0 request carried: {sorted(unverified)}"
    expected = ("json", value) if field == "json_schema" else ("grammar", value)
    assert vllm_reading(body.get("structured_outputs")) == expected, body.get("structured_outputs")
    plain = vllm_wire.body(GenerationRequest("r-2", [1, 2, 3], 24, (2,), 4), {"model": "m", "top_k": 0})
    assert "structured_outputs" not in plain and not set(plain) - live_vllm_keys()


def test_the_emulators_accept_each_body_and_decode_under_the_prompts_constraint(tmp_path):
    """Each body goes to the SGLang and vLLM emulators, which validate it on their own (allow-lists, field
    types) and record the constraint they decoded under: it must be the prompt row's, for every
    JSON-schema prompt and the one-literal grammar the emulators decode."""
    prompts = fake_prompts(tmp_path)
    rows = raw_constraints(prompts)
    assert rows
    with SGLangServer() as sglang, VLLMServer() as vllm:
        for i, (prompt_id, field, value) in enumerate(rows):
            want = (field, json.dumps(value, sort_keys=True) if field == "json_schema" else value)
            rid = f"r-{i}"
            status, answer = post(sglang.url + sglang_wire.path, sglang_wire.body(request_for(prompt_id, prompts, rid),
                                                                               {"rid": rid}))
            assert status == 200, (prompt_id, answer)
            assert sglang.constraints_seen[-1] == (rid, *want), prompt_id
            body = vllm_wire.body(request_for(prompt_id, prompts), {"model": vllm.served, "top_k": 0})
            status, answer = post(vllm.url + vllm_wire.path, body)
            assert status == 200, (prompt_id, answer)
            assert vllm.constraints_seen[-1][1:] == want, prompt_id
        assert len(sglang.constraints_seen) == len(vllm.constraints_seen) == len(rows)


def test_the_source_readings_refuse_what_the_engines_refuse():
    """The two readers above are the engines' rules, not a restatement of the adapters: they refuse
    the bodies SGLang and vLLM refuse, and read a schema sent either way vLLM allows."""
    with pytest.raises(AssertionError, match="only one of regex, json_schema, or ebnf"):
        sglang_reading({"json_schema": "{}", "regex": ""})
    with pytest.raises(AssertionError, match="Optional\\[str\\]"):
        sglang_reading({"json_schema": SCHEMA})
    with pytest.raises(AssertionError, match="exactly one constraint"):
        vllm_reading({"json": SCHEMA, "grammar": 'root ::= "x"'})
    with pytest.raises(AssertionError, match="has no field"):
        vllm_reading({"json_schema": SCHEMA})
    assert vllm_reading({"json": json.dumps(SCHEMA)}) == ("json", SCHEMA)
    assert vllm_reading({"json": SCHEMA, "regex": None}) == ("json", SCHEMA)


# ------------------------------------------------------------------------------------- the gate on fakes


def fake_prompts(tmp_path: Path) -> Path:
    """The JSON-schema prompts of prompts/structured.jsonl (the fakes decode any schema) and one
    one-literal grammar (the fakes decode no richer GBNF), with limits that let them close."""
    rows = [p.to_json() for p in load_prompts(STRUCTURED).prompts if p.constraint.kind == "json_schema"]
    rows.append({"id": "tool-literal", "category": "structured", "lang": "en", "max_new_tokens": 48,
                 "messages": [{"role": "user", "content": "Call the weather tool for Berlin."}],
                 "grammar": 'root ::= "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Berlin\\"}}"'})
    path = tmp_path / "structured.jsonl"
    path.write_text('{"specparity_prompts": 1, "description": "fake"}\n' + "".join(json.dumps(r) + "\n" for r in rows))
    return path


def gate(engine: str, base, spec, report: Path, *args: str):
    proc = pytest_in_process(["suites/lossless", "-q", "-p", "no:cacheprovider", "--engine", engine,
                              "--baseline-url", base.url, "--spec-url", spec.url, "--target", str(TARGET),
                              "--calibration", "selected", "--report", str(report), *args])
    records = [json.loads(x) for x in (report / "results.jsonl").read_text().splitlines()]
    return proc, [r for r in records if r["kind"] == "prompt"], records[-1]


@pytest.mark.parametrize("engine, server", [("sglang", SGLangServer), ("vllm", VLLMServer)])
def test_constraints_are_sent_to_both_sides_and_decoded_under(engine, server, tmp_path):
    prompts = fake_prompts(tmp_path)
    constrained = load_prompts(prompts).prompts
    with server() as base, server(speculative=True) as spec:
        proc, judged, verdict = gate(engine, base, spec, tmp_path / "r", "--prompts", str(prompts))
        seen_base, seen_spec = base.constraints_seen, spec.constraints_seen
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert verdict["status"] == "PASS" and len(judged) == len(constrained)
    # every constrained prompt reached both servers with its constraint (and nothing else did)
    texts = sorted((p.constraint.kind, p.constraint.text) for p in constrained)
    assert sorted((k, t) for _, k, t in seen_spec) == texts
    assert {(k, t) for _, k, t in seen_base} == set(texts)  # baseline: decoded, then scored unconstrained
    for rec in judged:
        c = rec["verdict"]["constraint"]
        assert rec["verdict"]["class"] == "exact" and "problem" not in c
        expected = "valid" if c["kind"] == "json_schema" else "constrained"
        assert c["baseline"]["status"] == c["spec"]["status"] == expected, rec["verdict"]
    assert f"PASS — exact {len(constrained)}," in proc.stdout
    n_schema = sum(p.constraint.kind == "json_schema" for p in constrained)
    line = (f"structured output: {n_schema} JSON-schema prompt(s): baseline valid {n_schema}; speculative valid "
            f"{n_schema}; {len(constrained) - n_schema} grammar prompt(s): constrained (judged by token identity)")
    assert line in proc.stdout and line.split(": ", 1)[1] in (tmp_path / "r" / "summary.md").read_text()
    # speculation ran under the constraint (SGLang counts per request, vLLM run-wide on /metrics)
    assert "speculation inactive" not in proc.stdout and re.search(r"speculation: [1-9]\d*/\d+ draft tokens accepted",
                                                                   proc.stdout), proc.stdout[-3000:]


@pytest.mark.parametrize("engine, server", [("sglang", SGLangServer), ("vllm", VLLMServer)])
def test_a_grammar_state_that_does_not_roll_back_is_caught_only_by_constrained_prompts(engine, server, tmp_path):
    """The speculative fake keeps the constraint through its first verify step and then loses the
    grammar state (a loop that does not roll it back with a rejected draft). Constrained prompts:
    every JSON-schema prompt fails with the constraint reason and the run fails (exit 1).
    Unconstrained prompts on the same servers: the bug never shows, the run passes."""
    prompts = fake_prompts(tmp_path)
    schema_ids = [p.id for p in load_prompts(prompts).prompts if p.constraint.kind == "json_schema"]
    with server() as base, server(speculative=True, grammar_rollback_bug=True) as spec:
        proc, judged, verdict = gate(engine, base, spec, tmp_path / "structured", "--prompts", str(prompts))
        plain, plain_judged, plain_verdict = gate(engine, base, spec, tmp_path / "plain", "--categories", "math",
                                                  "--max-new-tokens", "16")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    broken = [r["prompt"]["id"] for r in judged if "problem" in r["verdict"]["constraint"]]
    assert sorted(broken) == sorted(schema_ids), [(r["prompt"]["id"], r["verdict"]) for r in judged]
    for rec in judged:
        if rec["prompt"]["id"] in broken:
            v = rec["verdict"]
            assert v["class"] == "diverged" and v["reason"].startswith("constraint broken under speculation: the "
                                                                     "speculative output "), v["reason"]
            assert v["constraint"]["baseline"]["status"] == "valid" and v["constraint"]["spec"]["status"] == "invalid"
    line = (f"{len(broken)} prompt(s) broke their output constraint under speculation (the baseline's output kept "
            f"it): {', '.join(schema_ids)}")  # in prompt-file order
    assert line in verdict["failures"], verdict["failures"]
    assert f"FAIL: {line}" in proc.stdout
    assert f"speculative invalid {len(broken)}; {len(broken)} broke their schema under speculation" in proc.stdout
    # the grammar prompt diverges too, by token identity (a grammar is not parsed here)
    assert all(r["verdict"]["class"] == "diverged" for r in judged)
    assert plain.returncode == 0, (plain.stdout + plain.stderr)[-4000:]
    assert plain_verdict["status"] == "PASS" and plain_judged
    assert all(r["verdict"]["class"] == "exact" and "constraint" not in r["verdict"] for r in plain_judged)


def test_a_baseline_that_ignores_its_schema_is_refused_before_judging(tmp_path, monkeypatch):
    """A baseline server that drops the constraint (its output is prose, not the schema's JSON): the
    run is refused as a configuration error (exit 3), never judged as if unconstrained."""
    prompts = fake_prompts(tmp_path)
    own = FixtureBackend()  # the baseline's own models: the speculative server keeps the shared ones
    monkeypatch.setattr(own, "constrained_generate", lambda prompt, c, n, stops, k, speculative, bug=False:
                        own.generate(prompt, n, stops, k, speculative))
    with SGLangServer(backend=own) as base, SGLangServer(speculative=True) as spec:
        proc, judged, verdict = gate("sglang", base, spec, tmp_path / "r", "--prompts", str(prompts))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-4000:]
    assert "the baseline output breaks its prompt's JSON schema" in out
    assert all(r["verdict"]["class"] == "error" for r in judged)


def test_forced_document_is_valid_for_every_schema_of_the_prompt_file():
    for p in load_prompts(STRUCTURED).prompts:
        if p.constraint.kind == "json_schema":
            assert check_output(p.constraint, forced_document(p.constraint), "stop").status == "valid"


def test_a_calibration_file_with_constrained_prompts_is_refused_for_an_in_process_engine(capsys):
    """Calibration prompts run too (baselines only): a constrained one must never be decoded
    unconstrained, so it is refused like a selected one — before anything loads."""
    from specparity.gate import exitcodes
    from specparity.cli.commands import main

    code = main(["run", "--engine", "hf", "--calibration", str(STRUCTURED)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == exitcodes.BAD_INPUT and len(err) == 1, err
    assert f"{STRUCTURED}:2: json_schema: engine 'hf' cannot constrain decoding" in err[0]


def test_a_schema_prompt_without_jsonschema_installed_is_one_line_naming_the_package(tmp_path, monkeypatch):
    """A checkout run on a host without specparity's dependencies (e.g. a GPU host's own environment):
    the prompt file's line names the missing package instead of an internal error."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"specparity_prompts": 1}) + "\n" + json.dumps(
        {"id": "s-1", "category": "json", "lang": "en", "prompt": "x", "json_schema": {"type": "object"}}) + "\n")
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: json_schema: .*needs the jsonschema package"):
        load_prompts(path)
