"""The one JSON Lines reader: line numbers, blank lines, line endings, torn tails, and the one error
carrying path and line — and the three formats built on it (prompts, goldens, journals) reading
back what specparity writes, whatever characters the text holds."""

from __future__ import annotations

import json
import pickle

import pytest

from specparity.run.golden import GoldenError, Recorded, load_golden, write_golden
from specparity.run.journal import JournalError, read_journal
from specparity.model.jsonl import JsonlError, read_jsonl
from specparity.model.prompts import Prompt, PromptFileError, load_prompts
from specparity.model.types import GenerationResult, SpecStats
from test_golden import fingerprint, recorded, scores

#: Characters str.splitlines() breaks a line at that a JSON string may hold unescaped.
LINE_BREAKING_TEXT = "a\u2028b\u2029c\x85d"


def test_records_number_every_line_and_skip_blank_ones(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n   \n[2]\n"three"\n', encoding="utf-8")
    jsonl = read_jsonl(path)
    assert list(jsonl.records()) == [(1, {"a": 1}), (4, [2]), (5, "three")]
    assert jsonl.last_line == 5, "the empty piece after the final newline is no line"


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_line_endings(tmp_path, eol):
    path = tmp_path / "x.jsonl"
    path.write_bytes(eol.join(['{"a": 1}', "", '{"b": 2}', "{oops"]).encode())
    jsonl = read_jsonl(path)
    with pytest.raises(JsonlError) as err:
        list(jsonl.records())
    assert (err.value.line, err.value.column) == (4, 2)
    assert list(jsonl.records(torn_tail=True)) == [(1, {"a": 1}), (3, {"b": 2})]


def test_a_string_holding_line_separators_stays_one_line(tmp_path):
    path = tmp_path / "x.jsonl"
    lines = [json.dumps({"text": LINE_BREAKING_TEXT}, ensure_ascii=False), json.dumps({"n": 2})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert list(read_jsonl(path).records()) == [(1, {"text": LINE_BREAKING_TEXT}), (2, {"n": 2})]


def test_not_json_carries_path_line_and_column(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"b": 2}\n', encoding="utf-8")
    with pytest.raises(JsonlError) as err:
        list(read_jsonl(path).records())
    exc = err.value
    assert (exc.path, exc.line, exc.column, exc.not_utf8) == (path, 2, 7, False)
    assert str(exc) == f"{path}:2: not JSON (Expecting value at column 7)"
    again = pickle.loads(pickle.dumps(exc))
    assert (type(again), str(again), again.line) == (JsonlError, str(exc), 2)


def test_only_the_last_line_may_be_torn(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": \n{"b": 2}\n', encoding="utf-8")
    with pytest.raises(JsonlError, match=r"x.jsonl:2: not JSON"):
        list(read_jsonl(path).records(torn_tail=True))
    path.write_text('{"a": 1}\n{"b": 2}\n{"c": \n', encoding="utf-8")
    assert [n for n, _ in read_jsonl(path).records(torn_tail=True)] == [1, 2]


def test_the_error_hook_words_it_for_the_format(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("{oops\n", encoding="utf-8")
    with pytest.raises(KeyError) as err:
        list(read_jsonl(path).records(error=lambda exc: KeyError(f"{exc.where} {exc.reason}")))
    assert err.value.args == (f"{path}:1 Expecting property name enclosed in double quotes",)


def test_bytes_that_are_not_utf8_name_line_column_and_byte(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(JsonlError) as err:
        read_jsonl(path)
    exc = err.value
    column = len('{"a": "caf') + 1
    assert (exc.line, exc.column, exc.byte, exc.not_utf8) == (2, column, 0xE9, True)
    assert str(exc) == f"{path}:2: expected UTF-8 text (invalid continuation byte: byte 0xe9 at column {column})"


def test_a_missing_file_is_left_to_the_format(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "nope.jsonl")


def test_a_prompt_file_whose_text_holds_line_separators_loads(tmp_path):
    path = tmp_path / "p.jsonl"
    record = {"id": "sep-1", "category": "c", "lang": "en", "prompt": LINE_BREAKING_TEXT}
    path.write_text(json.dumps({"specparity_prompts": 1}) + "\n" + json.dumps(record, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    (prompt,) = load_prompts(path).prompts
    assert prompt.prompt == LINE_BREAKING_TEXT and prompt.source == f"{path}:2"


def test_a_golden_whose_text_holds_line_separators_reads_back(tmp_path):
    """Goldens are written with ensure_ascii=False: a model output holding U+2028 is written raw
    and must read back (a reader splitting at every Unicode line break refused its own golden)."""
    path = tmp_path / "g.jsonl"
    ids = [5, 6, 7]
    prompt = Prompt("sep-1", "math", "en", prompt=LINE_BREAKING_TEXT)
    result = GenerationResult("sep-1", ids, LINE_BREAKING_TEXT, "length", scores(ids), SpecStats.unavailable("x"))
    write_golden(path, fingerprint(), [Recorded(prompt, [1, 2], len(ids), result, scores(ids))], prompt_files=[],
                 top_k=8)
    entry = load_golden(path).entries["sep-1"]
    assert entry.baseline.text == LINE_BREAKING_TEXT and entry.prompt.prompt == LINE_BREAKING_TEXT


def test_each_format_words_a_line_that_is_not_json(tmp_path):
    expected = "Expecting property name enclosed in double quotes at column 2"
    path = tmp_path / "p.jsonl"
    path.write_text('{"specparity_prompts": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(PromptFileError) as p_err:
        load_prompts(path)
    assert str(p_err.value) == f"{path}:2: <line>: invalid JSON ({expected})"
    path = tmp_path / "g.jsonl"
    write_golden(path, fingerprint(), [recorded("a-1", [5, 6])], prompt_files=[], top_k=8)
    path.write_text(path.read_text(encoding="utf-8") + "{oops\n", encoding="utf-8")
    with pytest.raises(GoldenError) as g_err:
        load_golden(path)
    assert str(g_err.value) == f"{path}:3: not JSON ({expected})"
    path = tmp_path / "results.jsonl"
    path.write_text('{"kind": "run", "schema": "specparity.results/1"}\n{oops\n{"kind": "verdict"}\n', encoding="utf-8")
    with pytest.raises(JournalError) as j_err:
        read_journal(path)
    assert str(j_err.value) == f"{path}:2: not JSON ({expected})"


def test_a_journal_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"kind": "run", "schema": "specparity.results/1"}\n{"kind": "caf\xe9"}\n')
    with pytest.raises(JournalError) as err:
        read_journal(path)
    column = len('{"kind": "caf') + 1
    assert str(err.value) == f"{path}:2: expected UTF-8 text (invalid continuation byte: byte 0xe9 at column {column})"
