"""Run a fake server by hand: ``python -m fakes [--protocol sglang] [--spec] [--fault FAULT@N,M]`` from ``tests/``."""

from __future__ import annotations

import argparse
import time
from typing import Sequence

from fakes import FAULTS, LlamaCppServer, Rule, SGLangServer, VLLMServer

SERVERS = {"llamacpp": LlamaCppServer, "sglang": SGLangServer, "vllm": VLLMServer}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fakes", description="A fake inference server that misbehaves "
                                                                     "on purpose; prints its URL.")
    ap.add_argument("--protocol", choices=sorted(SERVERS), default="llamacpp")
    ap.add_argument("--spec", action="store_true", help="answer as a speculative server (draft counters)")
    ap.add_argument("--fault", action="append", default=[], metavar="FAULT[@N,M]",
                    help=f"misbehave on these generation requests (all when no @): {', '.join(FAULTS)}")
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--batch-flip-above", type=int, default=None, metavar="N",
                    help="sglang: flip answers decoded while more than N requests are in flight (batch_flip_above)")
    ns = ap.parse_args(argv)
    rules = []
    for f in ns.fault:
        name, _, nums = f.partition("@")
        rules.append(Rule(name, requests=[int(x) for x in nums.split(",")] if nums else None))
    knobs = {} if ns.batch_flip_above is None else {"batch_flip_above": ns.batch_flip_above}
    if knobs and ns.protocol != "sglang":
        ap.error("--batch-flip-above: only the sglang fake has it")
    with SERVERS[ns.protocol](speculative=ns.spec, rules=rules, die_after=ns.die_after, **knobs) as srv:
        print(srv.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
