"""Verify/decode invariance: ``pytest suites/invariance``.

Without ``--engine`` it measures the embedded configurations — transformers' assisted generation
with the **target as its own draft** (fp32 and bf16, 4 draft tokens, the default suite plus
``prompts/near_tie.jsonl``) and each default prompt decoded alone and in left-padded batches of 4
(fp32 and bf16). With ``--engine X --draft <the target>`` it measures that engine instead (e.g.
``--engine llamacpp --draft target.gguf``: llama.cpp ``-md`` with the target's own GGUF; batching
there is ``--concurrency`` requests to its parallel slots). The table is printed in the terminal
summary and written to ``reports/invariance/invariance.md`` and ``.json`` (``<report>/invariance``
when ``--report`` names a directory; nothing with ``--report ''``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from specparity.gate import exitcodes
from specparity.model.locations import REPO_ROOT, fixture_dir
from specparity.cli.options import DEFAULT_REPORT
from specparity.model.prompts import load_prompts
from specparity.plugin.pytest_plugin import gate_setup, report_section, setup_error

NEAR_TIE_PROMPTS = REPO_ROOT / "prompts" / "near_tie.jsonl"
#: The embedded configurations: (check, dtype). Self-draft is hf with the target as assistant.
EMBEDDED = [("self-draft", "float32"), ("self-draft", "bfloat16"), ("batching", "float32"), ("batching", "bfloat16")]
SELF_DRAFT_WIDTH = 4
BATCH_SIZE = 4
_REPORTS = pytest.StashKey[list]()


def _configs(config: pytest.Config) -> list[tuple[str, str]]:
    if setup_error(config):
        return []  # the plugin reports the bad option once the items are collected
    if config.getoption("engine") is None:
        return EMBEDDED
    dtype = gate_setup(config).engine_options.dtype
    return [("self-draft", dtype), ("batching", dtype)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "invariance_case" in metafunc.fixturenames:
        cases = _configs(metafunc.config)
        metafunc.parametrize("invariance_case", cases, ids=[f"{c}-{d}" for c, d in cases])


class Invariance:
    """Builds the engine of each case, runs it, keeps every report for the table."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.setup = gate_setup(config)
        self.explicit = config.getoption("engine") is not None
        #: Per dtype, the embedded self-draft run's baselines: the batching case's solo runs when it
        #: asks the very same requests (run_batching checks), so they are not decoded and scored twice.
        self.solo: dict[str, Any] = {}
        report = config.getoption("report")
        self.out = None if not report else Path(REPO_ROOT / "reports" / "invariance" if report == DEFAULT_REPORT
                                                 else Path(report) / "invariance")

    def engine(self, check: str, dtype: str) -> Any:
        from specparity.engines import build_engine

        opts = self.setup.engine_options
        if not self.explicit:
            from specparity.engines import resolve_factory

            target = str(fixture_dir("target"))
            # the fixture demo: self-draft drafts with the target itself; batching never speculates, so
            # its hf engine is built in prompt-lookup mode, which loads no draft model
            if check == "self-draft":
                opts = dataclasses.replace(opts, target=target, draft=target, spec_mode="draft", dtype=dtype,
                                           num_draft_tokens=SELF_DRAFT_WIDTH)
            else:
                opts = dataclasses.replace(opts, target=target, draft=None, spec_mode="prompt_lookup", dtype=dtype,
                                           num_draft_tokens=SELF_DRAFT_WIDTH)
            return build_engine(resolve_factory("hf"), opts, "hf")
        try:
            return build_engine(self.setup.factory, opts, self.setup.engine_spec)
        except Exception as exc:  # noqa: BLE001 - an engine that cannot start: one line, exit code 3
            pytest.exit(f"specparity invariance: cannot load engine {self.setup.engine_spec!r}: "
                        f"{type(exc).__name__}: {exc}", returncode=exitcodes.ENGINE_ERROR)

    def prompts(self, check: str):
        prompts = list(self.setup.prompts)
        if check == "self-draft" and not self.explicit and not self.setup.config.categories:
            prompts += load_prompts(NEAR_TIE_PROMPTS).prompts
        return prompts

    def record(self, report: Any) -> None:
        from specparity.run.invariance import TABLE_HEADER, table

        reports = self.config.stash.setdefault(_REPORTS, [])
        reports.append(report)
        lines = TABLE_HEADER + table(reports)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "invariance.md").write_text("# Verify/decode invariance\n\n" + "\n".join(lines) + "\n")
            (self.out / "invariance.json").write_text(json.dumps([r.to_json() for r in reports], indent=1) + "\n")


    def summarize(self) -> None:
        """The whole table once, in the terminal summary (relayed to the controller under xdist)."""
        from specparity.run.invariance import TABLE_HEADER, table

        reports = self.config.stash.get(_REPORTS, [])
        if reports:
            where = [f"written to {self.out}/invariance.md"] if self.out is not None else []
            report_section(self.config, "specparity invariance", TABLE_HEADER + table(reports) + where)


@pytest.fixture(scope="session")
def invariance(request: pytest.FixtureRequest):
    inv = Invariance(request.config)
    yield inv
    inv.summarize()
