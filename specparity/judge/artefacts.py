"""Outputs whose acceptance measures the text, not the draft: repetition loops and recited prompts.

Speculative acceptance is highest where the next tokens are easiest to guess: a greedy decode
stuck in a loop ("1, 2, 1, 2, 1, 2 …") or copying its prompt back is predicted almost perfectly by
any draft (and by prompt lookup without one). A handful of such prompts can carry a run's mean
accept length, and a change that breaks or creates one loop moves it by more than a real draft
regression would. The acceptance regression check (:mod:`specparity.judge.acceptance`) therefore flags
these prompts and shows acceptance with and without them, and decides without them. Pure functions
of token ids: no tokenizer, no model.
"""

from __future__ import annotations

from typing import Sequence

#: A loop must cover at least this many output tokens (shorter tails repeat by chance; a recited
#: span must be as long).
MIN_LOOP_TOKENS = 10
#: ... and at least this fraction of the output.
MIN_LOOP_FRACTION = 0.5
#: Longest period looked for (a loop of whole sentences is longer, and rarer at gate lengths).
MAX_PERIOD = 16
#: An output token counts as recited when an n-gram of this length holding it occurs in the prompt.
RECITE_NGRAM = 8
#: The output recites the prompt when at least this fraction of its tokens are recited.
MIN_RECITE_FRACTION = 0.5


def repetition_loop(output_ids: Sequence[int]) -> str | None:
    """Why ``output_ids`` ends in a loop (a tail of period ``p`` that repeats at least twice and
    covers enough of the output), or None."""
    toks = list(output_ids)
    n = len(toks)
    for period in range(1, min(MAX_PERIOD, n // 2) + 1):
        run = 0
        for i in range(n - 1, period - 1, -1):
            if toks[i] != toks[i - period]:
                break
            run += 1
        covered = run + period
        if covered >= 2 * period and covered >= MIN_LOOP_TOKENS and covered >= MIN_LOOP_FRACTION * n:
            return f"repetition loop: period {period} over the last {covered} of {n} tokens"
    return None


def recites_prompt(prompt_ids: Sequence[int], output_ids: Sequence[int]) -> str | None:
    """Why ``output_ids`` recites its prompt (most of its tokens lie in a ``RECITE_NGRAM``-gram that
    the prompt holds), or None."""
    out, k = list(output_ids), RECITE_NGRAM
    if len(out) < k or len(prompt_ids) < k:
        return None
    grams = {tuple(prompt_ids[i:i + k]) for i in range(len(prompt_ids) - k + 1)}
    covered = [False] * len(out)
    for i in range(len(out) - k + 1):
        if tuple(out[i:i + k]) in grams:
            covered[i:i + k] = [True] * k
    share = sum(covered) / len(out)
    if share >= MIN_RECITE_FRACTION and sum(covered) >= MIN_LOOP_TOKENS:
        return f"recites the prompt: {sum(covered)} of {len(out)} tokens copied from it"
    return None


def artefact(prompt_ids: Sequence[int] | None, output_ids: Sequence[int]) -> str | None:
    """Why a prompt's output is a measurement artefact for acceptance, or None."""
    return repetition_loop(output_ids) or (recites_prompt(prompt_ids, output_ids) if prompt_ids else None)
