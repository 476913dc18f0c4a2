"""Block-size sweep of the dflash engine: one lossless gate run per block size, one table.

``pytest suites/sweeps`` takes the plugin's engine options (``--target``, ``--draft``,
``--spec-mode dflash2|dflash1``, ``--dtype``, ``--threads``), ``--prompts``/``--categories`` and
``--max-new-tokens`` (default 32 here), loads the dflash engine once and re-runs the gate at every
block size. The table (accept length and tokens/s per block size) is printed in the terminal
summary and written to ``<report>/block_sizes.md`` and ``.json`` (``reports/sweeps`` unless
``--report`` names another directory). Speeds here are a by-product of a correctness run on a
shared CPU; ``benchmarks/dflash_blocks.py`` measures them properly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from specparity.model.locations import REPO_ROOT
from specparity.gate.decision import GateDecision
from specparity.cli.options import DEFAULT_REPORT
from specparity.plugin.pytest_plugin import gate_setup, report_section
from specparity.model.gate_run import Activity, GateConfig, GateRun
from specparity.run.runner import conclude, run_gate

SWEEP_MAX_NEW = 32
#: Prompts per sweep step when no --categories narrow the suite: the first of each category.
PER_CATEGORY = 1
_ROWS = pytest.StashKey[list]()


@dataclass
class SweepRow:
    block: int
    prompts: int
    counts: dict[str, int]  # class -> prompts
    activity: Activity  # draft counters over the run
    base_tok_s: float
    spec_tok_s: float

    @property
    def speedup(self) -> float:
        return self.spec_tok_s / self.base_tok_s if self.base_tok_s else 0.0


def _tok_s(results) -> float:
    toks = sum(len(r.output_ids) for r in results)
    wall = sum(r.wall_s for r in results)
    return toks / wall if wall else 0.0


def sweep_row(block: int, run: GateRun, decision: GateDecision) -> SweepRow:
    return SweepRow(
        block=block,
        prompts=len(run.records),
        counts=dict(decision.counts),
        activity=run.activity(),
        base_tok_s=_tok_s([r.baseline for r in run.records if r.baseline and not r.baseline.error]),
        spec_tok_s=_tok_s([r.spec for r in run.records if r.spec and not r.spec.error]),
    )


def table_lines(rows: list[SweepRow]) -> list[str]:
    out = [
        "| block | prompts | exact / tie / drift / div / err | accept length | tok/s no spec | tok/s dflash | speedup |",
        "|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r.block):
        mal = r.activity.mean_accept_length
        al = f"{mal:.2f}" if mal is not None else "n/a"
        c = r.counts
        out.append(
            f"| {r.block} | {r.prompts} | {c['exact']} / {c['near_tie']} / {c['drifted']} / {c['diverged']} / {c['error']} | {al} | "
            f"{r.base_tok_s:.1f} | {r.spec_tok_s:.1f} | {r.speedup:.2f}x |"
        )
    return out


class Sweep:
    """One loaded dflash engine, the prompt subset, and a gate run per requested block size."""

    def __init__(self, config: pytest.Config):
        from specparity.engines.inprocess.dflash import DFlashEngine

        self.config = config
        setup = gate_setup(config)
        base = setup.config
        prompts = setup.prompts
        if not base.categories:
            per_cat: dict[str, list] = {}
            for p in prompts:
                per_cat.setdefault(p.category, [])
                if len(per_cat[p.category]) < PER_CATEGORY:
                    per_cat[p.category].append(p)
            prompts = [p for group in per_cat.values() for p in group]
        self.prompts = prompts
        report = config.getoption("report")
        self.report_dir = Path(REPO_ROOT / "reports" / "sweeps" if report == DEFAULT_REPORT else report)
        self.base = base
        self.max_new = base.max_new_tokens or SWEEP_MAX_NEW
        self.engine = DFlashEngine(setup.engine_options)

    def run(self, block: int) -> tuple[GateRun, GateDecision, SweepRow]:
        self.engine.set_block_size(block)
        cfg = GateConfig(
            **{**vars(self.base), "max_new_tokens": self.max_new,
               "report_dir": str(self.report_dir / f"block-{block}")}
        )
        run = run_gate(self.engine, self.prompts, cfg)
        decision = conclude(run)
        row = sweep_row(block, run, decision)
        rows = self.config.stash.setdefault(_ROWS, [])
        rows.append(row)
        self._write(rows)
        return run, decision, row

    def _write(self, rows: list[SweepRow]) -> None:
        self.report_dir.mkdir(parents=True, exist_ok=True)
        fp = self.engine.fingerprint()
        head = (f"# dflash block-size sweep\n\nengine {fp.engine_version}; draft {fp.draft.kind} ({fp.draft.path}); "
                f"dtype {fp.dtype}; {len(self.prompts)} prompts x {self.max_new} new tokens; threads "
                f"{fp.extra.get('threads')}\n\n")
        (self.report_dir / "block_sizes.md").write_text(head + "\n".join(table_lines(rows)) + "\n")
        data = [{**asdict(r), "accept_length": r.activity.mean_accept_length, "speedup": r.speedup}
                for r in sorted(rows, key=lambda r: r.block)]
        (self.report_dir / "block_sizes.json").write_text(json.dumps(data, indent=1) + "\n")

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(scope="session")
def sweep(request: pytest.FixtureRequest):
    engine = request.config.getoption("engine")
    if engine not in (None, "dflash"):
        pytest.skip(f"the block-size sweep drives the dflash engine, not --engine {engine}")
    s = Sweep(request.config)
    yield s
    s.close()
    rows = request.config.stash.get(_ROWS, None)
    if rows:
        report_section(request.config, "dflash block-size sweep", table_lines(rows))

