"""The gate's command-line options, declared once for every face.

``pytest suites/lossless`` (the plugin's ``pytest_addoption``) and ``specparity run`` / ``record``
(argparse) register the same flags from :data:`GATE_OPTIONS`, so a flag's name, default and help
never differ between the two; :func:`specparity.cli.options.build_setup` then checks the values, read
by their ``dest`` names. Both pytest's ``addoption`` and argparse's ``add_argument`` take argparse's
keywords, which is what each :class:`OptionSpec` holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from specparity.engines import BUILTIN, SERVER_ENGINES
from specparity.engines.base import EngineOptions
from specparity.model.force_reject import FORCE_REJECT_MODES, MIN_REJECT_SHARE
from specparity.model.replay import DEFAULT_SERVER_REPLAYS, MAX_REPLAYED_PROMPTS
from specparity.model.threshold import DEFAULT_CEILING_NATS
from specparity.model.types import DEFAULT_TOP_K, MIN_TOP_K

DEFAULT_ENGINE = "dflash"
DEFAULT_REPORT = "reports/lossless"
GATE = "specparity lossless gate"
SERVERS = "specparity servers"
SERVERS_DESCRIPTION = f"specparity: engines behind HTTP ({', '.join(SERVER_ENGINES)})"
GOLDEN = "specparity goldens"
GOLDEN_DESCRIPTION = "specparity: recorded baselines (goldens), resume, policy file"
FLEET = "specparity fleet"
FLEET_DESCRIPTION = "specparity: one run split over machines (shards, merged by `specparity merge`)"


@dataclass(frozen=True)
class OptionSpec:
    flag: str
    group: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flag.lstrip("-").replace("-", "_")


def _o(flag: str, group: str = GATE, **kwargs: Any) -> OptionSpec:
    return OptionSpec(flag, group, kwargs)


GATE_OPTIONS: tuple[OptionSpec, ...] = (
    _o("--engine", default=None,
       help=f"engine: {DEFAULT_ENGINE} (default), {', '.join(n for n in BUILTIN if n != DEFAULT_ENGINE)}, "
            "module:factory or path/to/file.py:factory"),
    _o("--target", default=None, help="target model directory (default: the committed fixture)"),
    _o("--draft", default=None, help="draft model directory (default: the engine's fixture draft)"),
    _o("--spec-mode", default=None,
       help="speculative method inside the engine (each engine's modes: docs/ENGINES.md; one it lacks is refused, "
            "naming the modes it has)"),
    _o("--num-draft-tokens", default=None, help="draft width / block size (integer >= 1)"),
    _o("--dtype", default="float32", help="in-process engines: float32, bfloat16, float16"),
    _o("--kv-cache-dtype", default=None,
       help="in-process engines: auto (the model dtype, default) or fp8_e4m3 (K and V stored as float8 e4m3 "
       "with static scales, as SGLang's --kv-cache-dtype fp8_e4m3), for the baseline and the speculative run alike"),
    _o("--device", default=None, help="in-process engines: torch device, cpu (default) or cuda / cuda:N"),
    _o("--threads", default=EngineOptions.threads,
       help=f"torch threads for in-process engines (default {EngineOptions.threads})"),
    _o("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
       help="engine-specific option; unknown keys are refused, naming the ones the engine knows"),
    _o("--prompts", action="append", default=[], help="prompt JSONL file(s) (default prompts/default.jsonl)"),
    _o("--categories", default=None, help="comma-separated categories to run"),
    _o("--max-new-tokens", default=None, help="override every prompt's max_new_tokens"),
    _o("--near-tie-nats", default=None, help="near-tie threshold in nats (default: measured)"),
    _o("--max-near-tie", default=None, help="allowed fraction of near-tie prompts, in place of the default budget that follows the data "
                 "(near-tie flips that are not exact ties within what the baseline's own numerics predict)"),
    _o("--bit-exact", action="store_true", help="demand bit-exactness: a near-tie flip fails (the default "
       "when the engine declares deterministic / batch-invariant inference for both sides)"),
    _o("--allow-near-tie", action="store_true", help="allow near ties up to --max-near-tie even when the "
       "engine declares deterministic inference (which otherwise makes the gate bit-exact)"),
    _o("--require-all-paths", nargs="?", const=1, default=None, metavar="N",
       help="fail when a speculative path is taken on fewer than N prompts (N defaults to 1)"),
    _o("--near-tie-ceiling", default=None, metavar="NATS",
       help=f"refuse a measured near-tie threshold above this (default {DEFAULT_CEILING_NATS:g} nats)"),
    _o("--calibration", default="suite", metavar="SET",
       help="what the noise is measured on: suite (every prompt of the prompt files, default), "
       "selected (only the prompts that run), or a prompt file"),
    _o("--drift-policy", default=None, help="a drifted prompt (identical tokens, rows beyond the "
       "noise): fail (default) or warn"),
    _o("--force-reject", default=None, metavar="MODE",
       help="force the speculative loop down its reject path, output still compared: "
       + "; ".join(f"{k} ({v})" for k, v in FORCE_REJECT_MODES.items())
       + f"; with all, fewer than {MIN_REJECT_SHARE * 100:g}%% of verify steps rejecting is a configuration error"),
    _o("--allow-unknown-activity", action="store_true",
       help="do not fail when the engine reports no draft counters"),
    _o("--top-k", default=DEFAULT_TOP_K, help=f"alternatives recorded per position (>= {MIN_TOP_K})"),
    _o("--report", default=DEFAULT_REPORT, help=f"report directory (default {DEFAULT_REPORT}; '' for none)"),
    _o("--baseline-url", SERVERS, action="append", default=[], metavar="URL",
       help="a running server without speculation (repeatable: several shard the prompts)"),
    _o("--spec-url", SERVERS, action="append", default=[], metavar="URL",
       help="a running server with speculation (repeatable)"),
    _o("--preset", SERVERS, default=None, help="a named launch configuration to start both servers "
       "(specparity.engines.server.presets; llamacpp default: llamacpp-draft-simple)"),
    _o("--concurrency", SERVERS, default=None, help="requests in flight per phase (default: what the engine serves)"),
    _o("--replay", SERVERS, default=None, metavar="N",
       help=f"send each failing prompt's speculative request N times more after the run and say how often the failure "
            f"reproduces (the verdict stands; default {DEFAULT_SERVER_REPLAYS} for server engines, 0 for in-process "
            f"ones; at most {MAX_REPLAYED_PROMPTS} prompts)"),
    _o("--request-timeout", SERVERS, default=None, help=f"seconds one request may take (default {EngineOptions.request_timeout:g})"),
    _o("--scorer", SERVERS, default="auto", help="teacher-forced scorer: auto, engine, embedded"),
    _o("--scorer-model", SERVERS, default=None, help="HF model directory for --scorer embedded"),
    _o("--golden", GOLDEN, default=None, metavar="FILE",
       help="a golden (recorded baseline, golden/README.md): the baseline is read from it instead of run; "
       "missing, it is a failure unless --update-golden records it"),
    _o("--update-golden", GOLDEN, nargs="?", const="update", default=None, metavar="force",
       help="record or rewrite the golden named by --golden from this run's baselines (=force: also "
       "when it was recorded under a different engine fingerprint)"),
    _o("--golden-mode", GOLDEN, default=None, metavar="MODE",
       help="spec (default): the speculative run against the golden; baseline: a new baseline without "
       "speculation against the golden (an engine upgrade), with the same classes"),
    _o("--resume", GOLDEN, action="store_true",
       help="continue the run journalled in --report DIR (results.jsonl): finished prompts are kept, not rerun"),
    _o("--policy", GOLDEN, default=None, metavar="FILE",
       help="the gate policy file (TOML, ci/policy.toml): which classes fail, the near-tie budget, the "
       "acceptance floor; command-line flags override it"),
)

#: Options of the faces that make one gate run (``specparity run``, ``pytest suites/lossless``), not of
#: the commands that make several (``sweep``, ``arms``) or record a golden (``record``): a shard is a
#: part of one run, merged back with ``specparity merge`` (docs/FLEET.md).
SHARD_OPTIONS: tuple[OptionSpec, ...] = (
    _o("--shard", FLEET, default=None, metavar="I/N",
       help="judge only shard I of N (I counted from 0): a prompt's shard is a hash of its id, the same on every "
       "machine; `specparity merge` of every shard's --report gives the run's verdict (docs/FLEET.md)"),
)

GROUP_DESCRIPTIONS = {GATE: GATE, SERVERS: SERVERS_DESCRIPTION, GOLDEN: GOLDEN_DESCRIPTION, FLEET: FLEET_DESCRIPTION}


def gate_dests() -> tuple[str, ...]:
    """The ``dest`` names :func:`specparity.cli.options.build_setup` reads from every face."""
    return tuple(spec.dest for spec in GATE_OPTIONS)


def shard_dests() -> tuple[str, ...]:
    """The ``dest`` names of :data:`SHARD_OPTIONS` (read by the faces that take them)."""
    return tuple(spec.dest for spec in SHARD_OPTIONS)


def add_gate_options(add: Callable[[str, str], Callable[..., Any]],
                     options: tuple[OptionSpec, ...] = GATE_OPTIONS) -> None:
    """Register every gate option (or ``options``): ``add(group, description)`` returns the function that
    adds one flag to that group (pytest's ``group.addoption`` or an argparse group's ``add_argument``)."""
    adders: dict[str, Callable[..., Any]] = {}
    for spec in options:
        if spec.group not in adders:
            adders[spec.group] = add(spec.group, GROUP_DESCRIPTIONS[spec.group])
        adders[spec.group](spec.flag, **spec.kwargs)
