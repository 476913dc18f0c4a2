"""The acceptance artefact rules (``specparity/judge/artefacts.py``) at their edges, with their words: a
loop of exactly the minimum length, exactly the minimum share of the output, exactly two periods, the
longest period looked for; a recited span at exactly the minimum share and count; what ``artefact``
looks at with and without the prompt. Hand-built token lists, the expected figures counted by hand."""

from __future__ import annotations

import pytest

from specparity.judge.artefacts import (MAX_PERIOD, MIN_LOOP_TOKENS, RECITE_NGRAM, artefact, recites_prompt,
                                        repetition_loop)

UNIQUE = list(range(1000, 1100))  # tokens that never repeat


def test_the_words_of_a_loop():
    assert repetition_loop([5, 6, 7] * 6) == "repetition loop: period 3 over the last 18 of 18 tokens"


@pytest.mark.parametrize("prefix, tail, flagged", [
    (10, 10, True),    # 10 tokens of period 1: the minimum length, half the output
    (9, 9, False),     # 9: below the minimum length
    (12, 10, False),   # 10 of 22: below half the output
    (11, 11, True),    # 11 of 22: exactly half
])
def test_a_loop_needs_the_minimum_length_and_half_the_output(prefix, tail, flagged):
    toks = UNIQUE[:prefix] + [7] * tail
    got = repetition_loop(toks)
    assert (got == f"repetition loop: period 1 over the last {tail} of {prefix + tail} tokens") == flagged, got
    assert (got is not None) == flagged


def test_a_loop_must_repeat_twice():
    """Period 12: one full period plus part of a second is no loop; two full periods are."""
    period = UNIQUE[:12]
    assert repetition_loop(UNIQUE[50:52] + period + period[:11]) is None
    assert repetition_loop(UNIQUE[50:52] + period * 2) == "repetition loop: period 12 over the last 24 of 26 tokens"


def test_the_longest_period_looked_for():
    assert repetition_loop(UNIQUE[:MAX_PERIOD] * 2) == (
        f"repetition loop: period {MAX_PERIOD} over the last {2 * MAX_PERIOD} of {2 * MAX_PERIOD} tokens")
    assert repetition_loop(UNIQUE[:MAX_PERIOD + 1] * 2) is None


def test_the_shortest_period_is_named():
    assert repetition_loop([4, 4] * 8) == "repetition loop: period 1 over the last 16 of 16 tokens"


def test_no_loop_in_short_or_empty_outputs():
    assert repetition_loop([]) is None
    assert repetition_loop([3]) is None
    assert repetition_loop([3] * (MIN_LOOP_TOKENS - 1)) is None


def test_the_words_of_a_recited_prompt_and_its_edges():
    prompt = UNIQUE[:40]
    assert recites_prompt(prompt, prompt[:20] + UNIQUE[60:80]) == "recites the prompt: 20 of 40 tokens copied from it"
    assert recites_prompt(prompt, prompt[:19] + UNIQUE[60:81]) is None  # 19 of 40: under half
    assert recites_prompt(prompt, prompt[:10] + UNIQUE[60:70]) == "recites the prompt: 10 of 20 tokens copied from it"
    assert recites_prompt(prompt, prompt[:9] + UNIQUE[60:62]) is None  # 9 tokens: under the minimum count
    assert recites_prompt(prompt, prompt[:RECITE_NGRAM - 1]) is None  # shorter than one n-gram
    assert recites_prompt(prompt[:RECITE_NGRAM - 1], prompt[:20]) is None  # a prompt shorter than one n-gram


def test_a_recited_span_counts_every_token_of_its_ngrams():
    """Two recited spans of 8 and 12 tokens (20 of 36) with an unrecited gap between them."""
    prompt = UNIQUE[:40]
    out = prompt[0:8] + UNIQUE[60:76] + prompt[20:32]
    assert recites_prompt(prompt, out) == "recites the prompt: 20 of 36 tokens copied from it"


def test_artefact_takes_the_loop_first_and_the_prompt_only_when_given():
    loop = [5, 6] * 10
    assert artefact(loop, loop) == repetition_loop(loop)
    prompt = UNIQUE[:40]
    recited = prompt[:20]
    assert artefact(prompt, recited) == "recites the prompt: 20 of 20 tokens copied from it"
    assert artefact(None, recited) is None
    assert artefact([], recited) is None
    assert artefact(prompt, UNIQUE[60:80]) is None


def test_recitation_edges_of_the_prompt():
    """An empty output; a prompt of exactly one n-gram recited twice; the prompt's last n-grams."""
    prompt = UNIQUE[:40]
    assert recites_prompt(prompt, []) is None
    one = UNIQUE[:RECITE_NGRAM]
    assert recites_prompt(one, one * 2) == f"recites the prompt: {2 * RECITE_NGRAM} of {2 * RECITE_NGRAM} tokens copied from it"
    assert recites_prompt(prompt, prompt[20:40] + UNIQUE[60:80]) == "recites the prompt: 20 of 40 tokens copied from it"
