"""``specparity sample``: is speculative sampling distributed as the target's own sampling?

Draws ``--samples`` sequences per prompt at ``--temperature`` / ``--top-k`` (and
``--repetition-penalty``) from both sides of an in-process engine that can sample, scores every one
teacher-forced on the baseline and judges the speculative side's PIT values two-sample against the
baseline's (:mod:`specparity.run.sampling_run`, :mod:`specparity.judge.sampling`; docs/SAMPLING.md).
Every option is checked before any model loads (one line, exit 4).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from specparity.judge.sampling import DEFAULT_ALPHA
from specparity.model.sampling import (
    DEFAULT_SAMPLE_TOKENS,
    DEFAULT_SAMPLES,
    DEFAULT_SAMPLING_TOP_K,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    SamplingParams,
)
from specparity.run.setup import BadInput

SAMPLE_REPORT = "reports/sample"
#: The engine ``specparity sample`` runs unless ``--engine`` names another.
DEFAULT_ENGINE = "specparity.engines.inprocess.sampling:create"


def _number(flag: str, value: str, *, low: float, high: float | None = None, what: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise BadInput(f"{flag} {value!r}: expected {what}") from None
    if not (x > low) or (high is not None and not x < high) or x != x:
        raise BadInput(f"{flag} {value!r}: expected {what}")
    return x


def _positive_int(flag: str, value: str, lowest: int = 1) -> int:
    from specparity.cli.options import _int

    return int(_int({flag: value}, flag, flag, lowest))


def check_options(args: argparse.Namespace) -> tuple[Any, Any]:
    """The run's plan (:class:`~specparity.run.sampling_run.SamplingPlan`) and the engine options, or BadInput
    naming the option."""
    from specparity.cli.options import load_prompt_files, parse_engine_opts, select_prompts
    from specparity.engines.base import EngineOptions
    from specparity.model.locations import prompt_file
    from specparity.run.sampling_run import SamplingPlan

    samples = _positive_int("--samples", args.samples, 2)
    max_new_tokens = _positive_int("--max-new-tokens", args.max_new_tokens)
    top_k = _positive_int("--top-k", args.top_k)
    temperature = _number("--temperature", args.temperature, low=0.0, what="a number > 0")
    penalty = _number("--repetition-penalty", args.repetition_penalty, low=0.0, what="a number > 0")
    alpha = _number("--alpha", args.alpha, low=0.0, high=1.0, what="a number strictly between 0 and 1")
    seed = _positive_int("--seed", args.seed, 0)
    prompts = select_prompts(load_prompt_files(args.prompts or [str(prompt_file("default.jsonl"))]),
                             args.categories.split(",") if args.categories else None)
    if not prompts:
        raise BadInput("--prompts: no prompt selected")
    threads = _positive_int("--threads", args.threads)
    width = _positive_int("--num-draft-tokens", args.num_draft_tokens) if args.num_draft_tokens is not None else None
    options = EngineOptions(target=args.target, draft=args.draft, threads=threads, num_draft_tokens=width,
                            extra=parse_engine_opts(args.engine_opt or []))
    params = SamplingParams(temperature, top_k, penalty, seed)
    return SamplingPlan(tuple(prompts), samples, max_new_tokens, params, alpha), options


def _run_sample(args: argparse.Namespace) -> int:
    from specparity.engines import EngineLoadError, build_engine, check_options as check_engine, resolve_factory
    from specparity.engines.libraries import configure_libraries
    from specparity.cli.outcome import progress
    from specparity.run.sampling_run import run_sampling, terminal_lines, write_sampling

    configure_libraries(args.verbose)
    plan, options = check_options(args)
    try:
        factory = resolve_factory(args.engine)
        checked = check_engine(factory, options, args.engine)
    except (EngineLoadError, ValueError) as exc:
        raise BadInput(str(exc)) from None
    engine = build_engine(factory, checked, args.engine)
    try:
        run = run_sampling(engine, plan, say=progress(args))
    finally:
        engine.close()
    paths = write_sampling(run, args.report)
    if args.json:
        print(json.dumps(run.to_json(), indent=1, default=str))
    else:
        lines = terminal_lines(run)
        print("\n".join(lines if args.quiet else lines + [f"report: {p}" for p in paths]))
    return run.exit_code


def add_sample_command(sub: Any) -> None:
    from specparity.cli.outcome import EXIT_CODES_EPILOG, VERBOSE_HELP

    p = sub.add_parser(
        "sample",
        help="check that speculative sampling is distributed as the target's own sampling (temperature, top-k, "
        "repetition penalty)",
        description="Draw --samples sequences per prompt from the target's own sampling and from the speculative "
        "sampler, score every token teacher-forced on the target, and compare the two sides' randomised PIT values "
        "two-sample (KS, pooled and per verify-step position; consecutive token pairs by permutation; Bonferroni "
        "at --alpha). A token outside the target's "
        "top-k fails outright. Writes REPORT/sample.json and sample.md. An engine that cannot sample is NOT "
        "APPLICABLE (exit 3). docs/SAMPLING.md has the test, its measured false-alarm rate and power.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", default=DEFAULT_ENGINE,
                   help=f"an in-process engine with a sample() method, 'module:factory' or 'path/to/file.py:factory' "
                   f"(default {DEFAULT_ENGINE})")
    p.add_argument("--engine-opt", action="append", metavar="KEY=VALUE", help="an engine option (repeatable)")
    p.add_argument("--target", default=None, help="target model directory (default: the committed fixture)")
    p.add_argument("--draft", default=None, help="draft model directory (default: the committed fixture draft)")
    p.add_argument("--num-draft-tokens", default=None, help="draft tokens per verify step (default: the engine's)")
    p.add_argument("--threads", default="1", help="torch CPU threads (default 1)")
    p.add_argument("--prompts", action="append", metavar="FILE",
                   help="prompt file (repeatable; default: the packaged prompts/default.jsonl)")
    p.add_argument("--categories", default=None, metavar="A,B", help="only these prompt categories")
    p.add_argument("--samples", default=str(DEFAULT_SAMPLES), help=f"samples per prompt and side (default {DEFAULT_SAMPLES})")
    p.add_argument("--max-new-tokens", default=str(DEFAULT_SAMPLE_TOKENS),
                   help=f"tokens per sample at most (default {DEFAULT_SAMPLE_TOKENS}; a prompt's own limit is kept if lower)")
    p.add_argument("--temperature", default=str(DEFAULT_TEMPERATURE), help=f"sampling temperature (default {DEFAULT_TEMPERATURE})")
    p.add_argument("--top-k", default=str(DEFAULT_SAMPLING_TOP_K),
                   help=f"sampling top-k, at most the logprob channel width (default {DEFAULT_SAMPLING_TOP_K})")
    p.add_argument("--repetition-penalty", default="1.0", help="HF repetition penalty on both sides (default 1.0: none)")
    p.add_argument("--seed", default=str(DEFAULT_SEED), help=f"seed of the samplers and the transform (default {DEFAULT_SEED})")
    p.add_argument("--alpha", default=str(DEFAULT_ALPHA),
                   help=f"family-wise false-alarm rate of the run (default {DEFAULT_ALPHA})")
    p.add_argument("--report", default=SAMPLE_REPORT, help=f"report directory (default {SAMPLE_REPORT})")
    p.add_argument("--json", action="store_true", help="print sample.json on stdout instead of the summary")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the verdict lines")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=_run_sample)
