"""The prompt schema: every malformed file names file:line: field: what was expected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specparity.model.locations import REPO_ROOT
from specparity.model.prompts import PromptFileError, load_many, load_prompts, long_context_prompt

HEADER = json.dumps({"specparity_prompts": 1, "description": "t"})
GOOD = {"id": "math-en-001", "category": "math", "lang": "en", "prompt": "1 + 1 ="}


def write(tmp_path: Path, *lines: str, name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_default_suite_is_valid_and_covers_categories():
    suite = load_prompts(REPO_ROOT / "prompts" / "default.jsonl")
    cats = {p.category for p in suite.prompts}
    required = {"commonsense", "math", "zh_writing", "list", "logic", "summary", "zh_qa", "code", "repeat"}
    assert required <= cats, required - cats
    for cat in required:
        assert sum(p.category == cat for p in suite.prompts) >= 3, cat
    assert {"en", "zh"} <= {p.lang for p in suite.prompts}


def test_good_file_loads(tmp_path):
    chat = {**GOOD, "id": "chat-1", "prompt": None}
    del chat["prompt"]
    chat["messages"] = [{"role": "user", "content": "hi"}]
    path = write(tmp_path, HEADER, json.dumps(GOOD), "", json.dumps(chat))
    suite = load_prompts(path)
    assert [p.id for p in suite.prompts] == ["math-en-001", "chat-1"]
    assert suite.prompts[1].messages_as_dicts() == [{"role": "user", "content": "hi"}]
    assert suite.prompts[0].source == f"{path}:2"


@pytest.mark.parametrize(
    "record, field, expected",
    [
        ({**GOOD, "id": "Bad Id"}, "id", "lowercase"),
        ({k: v for k, v in GOOD.items() if k != "category"}, "category", "missing"),
        ({**GOOD, "messages": [{"role": "user", "content": "x"}]}, "prompt/messages", "exactly one"),
        ({**{k: v for k, v in GOOD.items() if k != "prompt"}, "messages": [{"role": "bot", "content": "x"}]},
         "messages[0].role", "expected one of"),
        ({**GOOD, "max_new_tokens": 0}, "max_new_tokens", "integer >= 1"),
        ({**GOOD, "max_new_tokens": True}, "max_new_tokens", "integer >= 1"),
        ({**GOOD, "tags": "x"}, "tags", "list of strings"),
        ({**GOOD, "temperature": 0}, "temperature", "unknown field"),
        ({**GOOD, "prompt": ""}, "prompt", "non-empty string"),
    ],
)
def test_bad_record_names_file_line_field(tmp_path, record, field, expected):
    path = write(tmp_path, HEADER, json.dumps(GOOD | {"id": "ok-1"}), json.dumps(record))
    with pytest.raises(PromptFileError) as err:
        load_prompts(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}:3: {field}: "), msg
    assert expected in msg


def test_bad_json_and_header(tmp_path):
    with pytest.raises(PromptFileError, match=r":2: <line>: invalid JSON"):
        load_prompts(write(tmp_path, HEADER, "{not json"))
    with pytest.raises(PromptFileError, match=r":1: specparity_prompts: expected a header"):
        load_prompts(write(tmp_path, json.dumps(GOOD)))
    with pytest.raises(PromptFileError, match=r"expected schema version 1, got 2"):
        load_prompts(write(tmp_path, json.dumps({"specparity_prompts": 2})))
    with pytest.raises(PromptFileError, match=r"file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(PromptFileError, match=r"at least one prompt"):
        load_prompts(write(tmp_path, HEADER))


def test_duplicate_ids_within_and_across_files(tmp_path):
    with pytest.raises(PromptFileError, match=r":3: id: duplicate id 'math-en-001' \(first defined at .*:2\)"):
        load_prompts(write(tmp_path, HEADER, json.dumps(GOOD), json.dumps(GOOD)))
    a = write(tmp_path, HEADER, json.dumps(GOOD), name="a.jsonl")
    b = write(tmp_path, HEADER, json.dumps(GOOD), name="b.jsonl")
    with pytest.raises(PromptFileError, match=r"b.jsonl:2: id: duplicate id"):
        load_many([a, b])


@pytest.mark.parametrize("tokens", [64, 2048, 131072])
def test_long_context_is_deterministic_and_scales(tokens):
    a, b = long_context_prompt(tokens, seed=3), long_context_prompt(tokens, seed=3)
    assert a == b
    assert "Remember this:" in a.prompt
    # ~3.5 characters per token by construction; within 10 % (plus the fixed question and needle)
    assert abs(len(a.prompt) / 3.5 - tokens) < 0.1 * tokens + 40
    assert long_context_prompt(tokens, seed=4).prompt != a.prompt
