"""The near-tie budget on recorded runs: expected against observed flips, and what the rule decides.

    python tools/flip_budget_table.py REPORT_DIR_OR_JOURNAL [...]       # also .tar.gz holding */results.jsonl

For every journal (``results.jsonl``) it prints one markdown row: the run, engine and dtype, judged
prompts, near-tie flips split into exact ties and the others, the expected count of the others with
its interval and the limit (``specparity.judge.flip_budget``), the budget's verdict, and what the old
fixed 25 % share would have said. Journals written before the flip rate was journalled get it
measured from their own baselines (decode and teacher-forced rows, both journalled) at their
threshold, and their near ties at a margin of 0 counted as exact ties — today's rules, applied to
the recorded evidence. This is how docs/CALIBRATION.md's false-alarm table was made.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from specparity.gate.decision import decide, fixed_share_why, flip_expectation  # noqa: E402
from specparity.judge.flip_budget import measure_flip_rate  # noqa: E402
from specparity.judge.resolution import is_tie  # noqa: E402
from specparity.model.gate_run import DEFAULT_MAX_NEAR_TIE, GateRun  # noqa: E402
from specparity.run.journal import load_run  # noqa: E402


def journals(paths: list[str], scratch: Path) -> list[tuple[str, Path]]:
    """(name, results.jsonl) for every argument: a journal, a report directory, or a tarball of them."""
    out = []
    for p in map(Path, paths):
        if p.suffixes[-2:] == [".tar", ".gz"]:
            with tarfile.open(p) as tar:
                members = [m for m in tar.getmembers() if m.name.endswith("results.jsonl")]
                dest = scratch / p.name
                tar.extractall(dest, members=members, filter="data")
            out += [(f"{p.name}:{m.name.rsplit('/', 2)[-2]}", dest / m.name) for m in members]
        elif p.is_dir():
            out.append((p.name, p / "results.jsonl"))
        else:
            out.append((p.parent.name, p))
    return out


def complete(run: GateRun) -> str:
    """Give an older record what today's rules read: the flip rate and the tie marks. Returns a note."""
    note = ""
    if run.threshold is not None and run.threshold.flip_rate is None:
        pool = [r for r in run.records + run.calibration_records if r.baseline is not None and r.baseline_tf is not None]
        run.threshold.flip_rate = measure_flip_rate(((r.baseline.scores, r.baseline_tf) for r in pool),
                                                    run.threshold.nats)
        note = "flip rate measured from the journalled baselines"
    for r in run.records:
        d = r.verdict.divergence if r.verdict is not None else None
        if d is not None and not d.tie and is_tie(d.baseline_margin) and r.verdict.klass == "near_tie":
            d.tie = True
    return note


def row(name: str, run: GateRun) -> str:
    note = complete(run)
    decision = decide(run)
    counts = decision.counts
    judged = sum(counts.values())
    near = counts["near_tie"]
    ties = sum(1 for r in run.records if r.verdict is not None and r.verdict.klass == "near_tie"
               and r.verdict.divergence is not None and r.verdict.divergence.tie)
    exp = flip_expectation(run)
    fixed = "FAIL" if judged and near / judged > DEFAULT_MAX_NEAR_TIE else "pass"
    fp = run.fingerprint
    engine = f"{fp.engine} {fp.dtype}" if fp else "?"
    if run.threshold is None:
        return f"| {name} | {engine} | {judged} | {near} | — | — | — | no threshold | {fixed} | {note} |"
    if exp is None:  # the fixed share for lack of evidence: the near-tie policy line says why
        check = decision.near_tie_budget
        budget = "pass" if check is None or check.state == "ok" else "FAIL"
        return (f"| {name} | {engine} | {judged} | {near} ({ties} exact ties) | — | — | {budget} (fixed share: "
                f"{fixed_share_why(run)}) | gate {decision.status} | {fixed} | {note} |")
    budget = "pass" if exp.passed else "FAIL"
    return (f"| {name} | {engine} | {judged} | {near} ({ties} exact ties, {exp.observed} others) | "
            f"{exp.expected:.1f} [{exp.low}–{exp.high}] | {exp.limit} | {budget} | gate {decision.status} | {fixed} | {note} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="results.jsonl files, report directories, or .tar.gz archives of them")
    args = ap.parse_args()
    print("| run | engine | judged | near ties | expected others [95 %] | limit | budget | gate | fixed 25 % | note |")
    print("|---|---|---:|---|---|---:|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in journals(args.paths, Path(tmp)):
            try:
                run = load_run(path)
            except Exception as exc:  # a table row per journal: one unreadable file is named, not fatal
                print(f"| {name} | unreadable: {exc} |||||||||")
                continue
            print(row(name, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
