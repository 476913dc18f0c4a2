"""``specparity merge DIR …``: the shards of one run (``specparity run --shard I/N``) made into its journal,
verdict and reports (:mod:`specparity.run.merge`).

Exits as ``specparity run`` would have on the whole run — 0, 1, 2 (a shard's journal says it was
interrupted and nothing replaced it: its prompts are errors, so 1), 3 (the merged calibration refused) —
and 4 when the journals are not the shards of one run, each problem on its own line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specparity.gate import exitcodes

DEFAULT_MERGED_REPORT = "reports/merged"


def _run_merge(args: argparse.Namespace) -> int:
    from specparity.cli.options import check_report_dir
    from specparity.cli.outcome import print_result
    from specparity.run.gate_command import SessionResult, report_paths_of, write_failed
    from specparity.run.merge import MergeRefused, merge_parts, read_parts
    from specparity.run.runner import conclude

    if Path(args.report).resolve() in {Path(d).resolve() for d in args.dirs}:
        raise ValueError(f"--report {args.report}: also a shard's directory; write the merged run elsewhere")
    try:
        parts = read_parts(args.dirs)
        out = check_report_dir("--report", args.report)
        merged = merge_parts(parts, out, tokenizer=args.tokenizer)
    except MergeRefused as exc:
        for line in exc.problems:
            print(f"specparity: error: {line}", file=sys.stderr)
        if args.json:
            print(json.dumps({"status": "BAD_INPUT", "exit_code": exitcodes.BAD_INPUT, "passed": False,
                              "errors": exc.problems}))
        return exitcodes.BAD_INPUT
    try:
        decision = conclude(merged.run)
    except OSError as exc:
        from specparity.gate.decision import decide

        raise write_failed(f"--report {out}", exc, decide(merged.run).status) from None
    print_result(args, SessionResult(merged.run, decision, report_paths_of(out)))
    return decision.exit_code


def add_merge_command(sub: Any) -> None:
    from specparity.cli.outcome import EXIT_CODES_EPILOG

    p = sub.add_parser(
        "merge",
        help="merge the journals of a sharded run (specparity run --shard I/N) into one verdict and report",
        description="Merge every shard's --report directory into one results.jsonl, verdict and report (summary.md, "
        "report.md, report.html). The near-tie threshold is measured again on the union of the shards' noise, and "
        "each prompt judged under it, so the verdict is the one a single unsharded run reaches. A missing or "
        "repeated shard, a prompt in two journals, or shards of another engine fingerprint or configuration are "
        "refused, one line each (exit 4). docs/FLEET.md",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a shard's --report directory (or its results.jsonl)")
    p.add_argument("--report", default=DEFAULT_MERGED_REPORT,
                   help=f"where the merged results.jsonl and reports go (default {DEFAULT_MERGED_REPORT})")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the target's Hugging Face tokenizer, for the token text in the reports (default: the run's "
                   "--target or tokenizer when it is a directory here; else token ids are shown)")
    p.add_argument("--json", action="store_true", help="print the outcome as `specparity run --json` does")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the verdict line and the failures")
    p.set_defaults(func=_run_merge)
