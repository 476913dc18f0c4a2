"""An engine's counters are judged by what it returns, not by what it declares.

``--require-all-paths`` is refused before anything loads for an engine that declares per-request
totals; an engine that declares per-verify-step records and then answers totals
(``tests/undercounting_engines.py``) gets past that check, so the run itself must fail the rule,
naming the engine and what it returned.
"""

from __future__ import annotations

import json

from prompt_subsets import SHORT, first_of_categories
from specparity.cli import commands as cli
from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT

ENGINE = f"{REPO_ROOT / 'tests' / 'undercounting_engines.py'}:totals_only"


def test_require_all_paths_fails_on_an_engine_that_returns_totals(tmp_path, capsys):
    from undercounting_engines import SOURCE

    prompts = first_of_categories(tmp_path / "p.jsonl", {"math": 2})
    code = cli.main(["run", "--engine", ENGINE, "--prompts", str(tmp_path / "p.jsonl"), "--calibration", "selected",
                     *SHORT, "--report", str(tmp_path / "r"), "--require-all-paths=1", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == exitcodes.GATE_FAILED, doc
    assert doc["counts"]["exact"] == len(prompts)  # lossless: only the rule fails
    line = next(f for f in doc["failures"] if f.startswith("--require-all-paths 1: "))
    head = json.loads((tmp_path / "r" / "results.jsonl").read_text().splitlines()[0])
    assert (f"engine {head['fingerprint']['engine']!r} declares per-verify-step counters but returned per-request totals without "
            f"step records for {len(prompts)} (first {prompts[0].id}: ") in line
    assert f"source: {SOURCE})" in line and f"of {len(prompts)} speculative answer(s)" in line
    assert not any("path taken on" in f for f in doc["failures"])  # no path is claimed missing: they are unknown
