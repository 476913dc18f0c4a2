"""The default prompt suite drives every speculative path of both embedded engines on enough prompts.

A lossless gate proves nothing about a path no prompt reaches (``specparity.model.coverage``), and a
path reached by one prompt is one prompt edit away from untested. So for the default modes of the
two embedded engines — ``hf`` (transformers assisted generation, fixture draft, width 4) and
``dflash`` (DFlash2, block 8) — the speculative side of ``prompts/default.jsonl`` must take each
path in ``PATHS`` on at least ``MIN_PROMPTS`` prompts. The ``paths`` category exists for this
(``tools/path_coverage.py`` prints the same counts; prompts/README.md records them, with headroom:
>= 10 prompts per path in fp32 on the 2-core CPU).
"""

from __future__ import annotations

import pytest

from specparity.model.coverage import PATHS, Coverage
from specparity.engines import load_engine
from specparity.engines.base import EngineOptions
from specparity.model.locations import fixture_dir
from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS
from specparity.model.types import GenerationRequest

MIN_PROMPTS = 5
#: engine -> (spec mode, draft fixture): the default mode of each embedded engine.
ENGINES = {"hf": ("draft", "draft"), "dflash": ("dflash2", "dflash2")}


@pytest.fixture(scope="module", params=sorted(ENGINES))
def suite_coverage(request, default_prompts) -> tuple[str, Coverage]:
    """One engine load per engine; the speculative side of every default prompt (no baseline)."""
    name = request.param
    mode, draft = ENGINES[name]
    engine = load_engine(name, EngineOptions(target=str(fixture_dir("target")), draft=str(fixture_dir(draft)),
                                             spec_mode=mode))
    cov = Coverage()
    errors = []
    try:
        stop = tuple(engine.stop_token_ids())
        for p in default_prompts:
            ids = engine.encode_prompt(p.prompt, p.messages_as_dicts())
            req = GenerationRequest(p.id, ids, p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, stop, 8)
            (res,) = engine.generate([req], speculative=True)
            if res.error:
                errors.append(f"{p.id}: {res.error}")
            cov.add(res.spec)
    finally:
        engine.close()
    assert not errors, errors
    return f"{name}:{mode}", cov


def test_every_path_is_taken_on_enough_prompts(suite_coverage, default_prompts):
    key, cov = suite_coverage
    assert cov.requests_with_steps == len(default_prompts), f"{key}: not every request reported per-step records"
    counts = ", ".join(f"{p}={cov.prompts[p]} prompts/{cov.taken()[p]} steps" for p in PATHS)
    low = cov.missing(MIN_PROMPTS)
    assert not low, (f"{key}: paths taken on fewer than {MIN_PROMPTS} of {len(default_prompts)} default prompts: "
                     f"{', '.join(low)} (counts: {counts}); add prompts to the 'paths' category of "
                     "prompts/default.jsonl that provoke them (python tools/path_coverage.py --per-prompt)")
