"""The same DFlash2 draft under the reference dflash decoder and under llama.cpp: acceptance per category.

    python tools/acceptance_parity.py [--max-new-tokens 48] [--json OUT] [--out DIR]

Runs the three gate runs below, each writing its journal under ``--out`` (default: a temporary
directory), and compares them with ``specparity parity`` (docs/ACCEPTANCE.md), which any two
journals can be given to directly; exits with the same-draft comparison's code.

Both engines run the llama.cpp-compatible variant of the fixture DFlash2 draft
(``tools/llamacpp/convert_gguf.py`` builds it: the fixture's weights with feature layers [0, 2, 2],
because llama.cpp cannot read the target's last layer) at 7 draft tokens per verify step (block 8).
A third column runs llama.cpp on the *fixture* layers' intended draft mismatch: the reference on the
original fixture draft (layers [0, 2, 3]) against llama.cpp on the variant — the size of gap a draft
that is not the one it was given produces. Needs a llama-server build and the converted GGUFs
(``ci/llamacpp.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def activities(engine, prompts, max_new: int, journal_dir: str) -> dict:
    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import run_gate

    try:
        run = run_gate(engine, prompts, GateConfig(max_new_tokens=max_new, report_dir=journal_dir))
    finally:
        engine.close()
    bad = [r.prompt.id for r in run.records if r.verdict is None or r.verdict.klass in ("diverged", "error")]
    if bad:
        raise SystemExit(f"{engine.name}: not lossless on {bad}")
    return {cat: run.activity(cat) for cat in run.categories()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", help="write the three runs' per-category counters here")
    ap.add_argument("--out", help="where the three runs' journals go (default: a temporary directory)")
    args = ap.parse_args(argv)
    import tempfile
    from pathlib import Path

    out = Path(args.out or tempfile.mkdtemp(prefix="acceptance-parity-"))

    from specparity.engines.base import EngineOptions
    from specparity.engines.inprocess.dflash import DFlashEngine
    from specparity.engines.server.llamacpp import create
    from specparity.engines.server.llamacpp_launch import fixture_gguf_dir
    from specparity.model.locations import REPO_ROOT, fixture_dir
    from specparity.cli import commands as cli
    from specparity.model.prompts import load_prompts

    prompts = load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts
    gg = fixture_gguf_dir()
    variant = gg / "variants" / "dflash2-llamacpp"
    ref_variant = activities(DFlashEngine(EngineOptions(draft=str(variant), spec_mode="dflash2", num_draft_tokens=8)),
                             prompts, args.max_new_tokens, str(out / "dflash-variant"))
    ref_fixture = activities(DFlashEngine(EngineOptions(draft=str(fixture_dir("dflash2")), spec_mode="dflash2",
                                                        num_draft_tokens=8)), prompts, args.max_new_tokens,
                             str(out / "dflash-fixture"))
    llama = activities(create(EngineOptions(preset="llamacpp-draft-dflash", draft=str(gg / "dflash2-llamacpp.gguf"))),
                       prompts, args.max_new_tokens, str(out / "llamacpp"))
    print("Same draft (variant [0,2,2]) under the reference dflash engine (A) and llama.cpp draft-dflash (B):")
    code = cli.main(["parity", str(out / "dflash-variant"), str(out / "llamacpp")])
    print("\nA different draft (reference on the fixture's layers [0,2,3], A) against llama.cpp on the variant (B):")
    cli.main(["parity", str(out / "dflash-fixture"), str(out / "llamacpp")])
    if args.json:
        dump = {name: {c: vars(a) for c, a in acts.items()}
                for name, acts in (("dflash_variant", ref_variant), ("dflash_fixture", ref_fixture), ("llamacpp", llama))}
        with open(args.json, "w") as fh:
            json.dump(dump, fh, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
