"""The gate's options, parsed and checked once, before any model loads.

Every entry point (the pytest plugin, the sweeps, the CLI) turns its raw options into one
:class:`GateSetup` through :func:`build_setup`. A bad value raises :class:`BadInput` whose message
is one line naming the option (or ``file:line``) and what was expected; the face prints it and
exits with :data:`specparity.gate.exitcodes.BAD_INPUT`. Nothing here imports torch or loads a model:
the engine's factory is imported (to read its declaration), never called.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from specparity.engines import (SERVER_ENGINES, EngineLoadError, check_options, engine_info, engines_applying,
                                resolve_factory)
from specparity.engines.base import EngineOptions
from specparity.run.golden import Golden, GoldenError, load_golden
from specparity.run.journal import JOURNAL, Journal, JournalError, read_journal
from specparity.gate.policy_file import PolicyError, load_policy, merge
from specparity.model.locations import prompt_file
from specparity.judge.noise import near_tie_above_ceiling
from specparity.model.threshold import DEFAULT_CEILING_NATS
from specparity.cli.option_table import DEFAULT_ENGINE, DEFAULT_REPORT  # noqa: F401 - re-exported
from specparity.model.gate_run import DRIFT_POLICIES, GateConfig, GatePolicy
from specparity.model.prompts import Prompt, PromptFileError, load_many
from specparity.model.replay import DEFAULT_SERVER_REPLAYS
from specparity.model.shards import Shard, ShardError

from specparity.run.scoring import SCORERS
from specparity.model.types import DEFAULT_TOP_K, MIN_TOP_K
from specparity.run.setup import BadInput, GateSetup, check_counters, shard_share

#: prompts/default.jsonl in a checkout, the copy the wheel carries when installed (fixtures.prompt_file).
DEFAULT_PROMPTS = prompt_file("default.jsonl")


def _int(raw: Mapping[str, Any], key: str, flag: str, minimum: int, default: int | None = None) -> int | None:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value))
        except ValueError:
            raise BadInput(f"{flag} {value!r}: expected an integer >= {minimum}") from None
    if value < minimum:
        raise BadInput(f"{flag} {value}: expected an integer >= {minimum}")
    return value


def _float(raw: Mapping[str, Any], key: str, flag: str, lo: float, hi: float | None = None,
           default: float | None = None) -> float | None:
    value = raw.get(key)
    if value is None:
        return default
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise BadInput(f"{flag} {value!r}: expected a number") from None
    bounds = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
    if not math.isfinite(value) or value < lo or (hi is not None and value > hi):
        raise BadInput(f"{flag} {value:g}: expected a number {bounds}")
    return value


def _require_paths(value: Any) -> int:
    """``--require-all-paths [N]``: the option takes an optional count, so a test path written
    right after it is read as the count; say how to write it."""
    try:
        n = int(value or 0)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise BadInput(f"--require-all-paths {value!r}: expected an integer >= 0 (write --require-all-paths=N, "
                       "or put the option after the test paths)")
    return n


def check_model_dir(flag: str, path: str | None) -> str | None:
    """A local model directory with a config.json, or a clear error; never a hub id."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        raise BadInput(f"{flag} {path}: no such directory (expected a local model directory with config.json; "
                       "specparity never downloads models)")
    if not p.is_dir():
        raise BadInput(f"{flag} {path}: not a directory (expected a local model directory with config.json)")
    if not (p / "config.json").is_file():
        raise BadInput(f"{flag} {path}: no config.json in this directory (expected a local model directory)")
    return str(p)


def check_report_dir(flag: str, path: str) -> str:
    """Create the report directory and prove it writable now, not after the run."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".specparity-write-test-"):
            pass
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot create or write the report directory "
                       f"({type(exc).__name__}: {exc.strerror or exc})") from None
    return str(p)


def parse_engine_opts(items: Sequence[str]) -> dict[str, str]:
    extra: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BadInput(f"--engine-opt {item!r}: expected KEY=VALUE")
        if key in extra:
            raise BadInput(f"--engine-opt {key}: given twice ({extra[key]!r} and {value!r})")
        extra[key.strip()] = value
    return extra


def load_prompt_files(files: Sequence[str]) -> list[Prompt]:
    try:
        return load_many(files)
    except PromptFileError as exc:
        raise BadInput(str(exc)) from None


def check_constraints(info: Any, engine: str, prompts: Sequence[Prompt]) -> None:
    """Every constrained prompt the run sends (selected or run for calibration) needs an engine that
    applies its constraint on both sides (``EngineInfo.constraints``); else one line naming the
    prompt's file:line and field, before anything loads: never a silently unconstrained decode."""
    supported = tuple(info.constraints) if info is not None else ()
    for p in prompts:
        if p.constraint is not None and p.constraint.kind not in supported:
            name = info.name if info is not None else engine
            raise BadInput(f"{p.source}: {p.constraint.kind}: engine {name!r} cannot constrain decoding "
                           f"({'it applies ' + ', '.join(supported) if supported else 'it applies no constraint'}; "
                           f"{p.constraint.kind} runs on {', '.join(engines_applying(p.constraint.kind))}): leave the "
                           "constrained prompts out of "
                           f"the prompt files (every prompt of them runs, if only to calibrate) or use one of those engines")


def select_prompts(prompts: list[Prompt], categories: Sequence[str] | None) -> list[Prompt]:
    if categories:
        known = {p.category for p in prompts}
        unknown = sorted(set(categories) - known)
        if unknown:
            raise BadInput(f"--categories: unknown {', '.join(unknown)}; the prompt files have {', '.join(sorted(known))}")
        prompts = [p for p in prompts if p.category in categories]
    return prompts


def _policy_origin(cli: Mapping[str, Any], policy_file: str | None) -> dict[str, str]:
    """Where each counter-dependent rule comes from: the command line wins over the policy file."""
    from specparity.gate.policy_file import where

    flags = {"require_all_paths": "--require-all-paths", "min_accept_length": "min_accept_length"}
    return {key: flag if cli.get(key) not in (None, False, "") or not policy_file else f"{where(policy_file, key)}: {key}"
            for key, flag in flags.items()}


def build_setup(raw: Mapping[str, Any], *, check_report: bool = False, speculates: bool = True) -> GateSetup:
    """Validate the raw option values (names as pytest's ``dest``: ``engine``, ``engine_opt`` …).

    ``check_report``: also create the report directory and prove it writable (done when the user
    named one; the default directory is created when the run starts). ``speculates``: False for a
    run of baselines only (``specparity record``), where no counter-dependent rule applies.
    """
    origin = _policy_origin(raw, raw.get("policy"))
    if raw.get("policy"):
        try:
            raw = merge(dict(raw), load_policy(raw["policy"]))
        except PolicyError as exc:
            raise BadInput(str(exc)) from None
    engine_spec = raw.get("engine") or DEFAULT_ENGINE
    server_flags = [flag for flag, key in (("--baseline-url", "baseline_url"), ("--spec-url", "spec_url"),
                                           ("--preset", "preset")) if raw.get(key)]
    if server_flags and not raw.get("engine"):
        raise BadInput(f"{server_flags[0]}: needs --engine {', '.join(SERVER_ENGINES[:-1])} or {SERVER_ENGINES[-1]} "
                       f"(the default engine {DEFAULT_ENGINE} runs in-process)")
    if "==" in engine_spec:
        raise BadInput(f"--engine {engine_spec!r}: the lossless gate takes an engine name (dflash, hf, module:factory); "
                       "for the probes' name==version use --probe-engine")
    try:
        factory = resolve_factory(engine_spec, "--engine")
    except EngineLoadError as exc:
        raise BadInput(str(exc)) from None
    info = engine_info(factory)
    local = info is None or info.local_models
    report = raw.get("report", DEFAULT_REPORT)
    dtype = raw.get("dtype") or "float32"
    if info is not None and not info.dtypes and dtype != "float32":
        raise BadInput(f"--dtype {dtype!r}: engine {info.name!r} runs the dtype its server was launched with")
    options = EngineOptions(
        target=check_model_dir("--target", raw.get("target")) if local else raw.get("target"),
        draft=check_model_dir("--draft", raw.get("draft")) if local else raw.get("draft"),
        spec_mode=raw.get("spec_mode"),
        dtype=dtype if info is None or info.dtypes else "server",
        num_draft_tokens=_int(raw, "num_draft_tokens", "--num-draft-tokens", 1),
        threads=_int(raw, "threads", "--threads", 1, default=EngineOptions.threads),
        extra=parse_engine_opts(raw.get("engine_opt") or []),
        baseline_urls=tuple(raw.get("baseline_url") or ()),
        spec_urls=tuple(raw.get("spec_url") or ()),
        preset=raw.get("preset"),
        request_timeout=_float(raw, "request_timeout", "--request-timeout", 1.0, default=EngineOptions.request_timeout),
        log_dir=str(Path(report) / "servers") if report else None,
        kv_cache_dtype=_kv_cache_dtype(raw.get("kv_cache_dtype"), info),
        device=_device(raw.get("device"), info),
        force_reject=_force_reject(raw, info, engine_spec),
    )
    try:
        options = check_options(factory, options, engine_spec)
    except (EngineLoadError, ValueError) as exc:
        raise BadInput(str(exc)) from None
    cats = raw.get("categories")
    categories = [c.strip() for c in cats.split(",") if c.strip()] if cats else None
    if cats is not None and not categories:
        raise BadInput(f"--categories {cats!r}: expected comma-separated category names")
    prompt_files = [str(p) for p in (raw.get("prompts") or [DEFAULT_PROMPTS])]
    suite = load_prompt_files(prompt_files)
    calibration_source = raw.get("calibration") or "suite"
    if calibration_source == "suite":
        calibration: list[Prompt] | None = suite
    elif calibration_source == "selected":
        calibration = None
    elif Path(calibration_source).is_file():
        calibration = load_prompt_files([calibration_source])
    else:
        raise BadInput(f"--calibration {calibration_source!r}: expected suite, selected or a prompt file (JSONL)")
    drift = raw.get("drift_policy") or "fail"
    if drift not in DRIFT_POLICIES:
        raise BadInput(f"--drift-policy {drift!r}: expected one of {', '.join(DRIFT_POLICIES)}")
    if raw.get("bit_exact") and raw.get("allow_near_tie"):
        raise BadInput("--bit-exact and --allow-near-tie: give one or neither (--bit-exact fails every near tie; "
                       "--allow-near-tie allows them even where the engine declares deterministic inference)")
    scorer = raw.get("scorer") or "auto"
    if scorer not in SCORERS:
        raise BadInput(f"--scorer {scorer!r}: expected one of {', '.join(SCORERS)}")
    scorer_model = check_model_dir("--scorer-model", raw.get("scorer_model"))
    if scorer == "embedded" and not scorer_model:
        raise BadInput("--scorer embedded: needs --scorer-model HF_DIR (the target's weights in Hugging Face format)")
    if report and check_report:
        report = check_report_dir("--report", report)
    golden, golden_mode, update = _golden(raw)
    resume = _resume(raw, report)
    config = GateConfig(
        prompts=prompt_files,
        categories=categories,
        max_new_tokens=_int(raw, "max_new_tokens", "--max-new-tokens", 1),
        near_tie_nats=_float(raw, "near_tie_nats", "--near-tie-nats", 0.0),
        near_tie_ceiling=_float(raw, "near_tie_ceiling", "--near-tie-ceiling", 1e-6, default=DEFAULT_CEILING_NATS),
        calibration=calibration_source,
        report_dir=report or None,
        top_k=_int(raw, "top_k", "--top-k", MIN_TOP_K, default=DEFAULT_TOP_K),
        concurrency=_int(raw, "concurrency", "--concurrency", 1),
        replays=_int(raw, "replay", "--replay", 0,
                     default=DEFAULT_SERVER_REPLAYS if info is not None and info.server else 0),
        scorer=scorer,
        scorer_model=scorer_model,
        policy=GatePolicy(
            # None: the budget follows the data (judge.flip_budget); a fraction only when asked for
            max_near_tie=_float(raw, "max_near_tie", "--max-near-tie", 0.0, 1.0),
            # None: bit-exact exactly when the engine declares determinism (gate.bit_exact)
            bit_exact=True if raw.get("bit_exact") else False if raw.get("allow_near_tie") else None,
            require_paths=_require_paths(raw.get("require_all_paths")),
            allow_unknown_activity=bool(raw.get("allow_unknown_activity")),
            drift=drift,
            min_accept_length=_float(raw, "min_accept_length", "min_accept_length", 0.0),
            # a CI gate under a reviewed policy: what the engine could not say is not lenient
            unknown_fails=bool(raw.get("policy")),
            calibration_findings=raw.get("calibration_findings") or "warn",
        ),
        golden=raw.get("golden") or None,
        golden_mode=golden_mode,
        update_golden=update,
        resume=bool(raw.get("resume")),
        force_reject=options.force_reject,
        shard=_shard(raw.get("shard"), update),
    )
    if options.force_reject and golden_mode == "baseline":
        raise BadInput(f"--force-reject {options.force_reject} with --golden-mode baseline: that mode runs no "
                       "speculation, so nothing can be rejected; drop one of them")
    if options.force_reject == "all" and config.policy.require_paths:
        raise BadInput("--force-reject all with --require-all-paths: every draft is rejected, so the partial and full "
                       "accept paths are never taken; use --force-reject random, or drop --require-all-paths")
    if config.near_tie_nats is not None and config.near_tie_nats > config.near_tie_ceiling:
        raise BadInput(near_tie_above_ceiling(config.near_tie_nats, config.near_tie_ceiling))
    if resume is not None:
        check_resumable(resume, config)
    check_constraints(info, engine_spec, suite + list(calibration or []))
    applies = speculates and golden_mode != "baseline"
    if applies and info is not None and info.counters is not None:
        check_counters(config.policy, info.counters, info.name, origin)
    selected = select_prompts(suite, categories)
    plan = None
    if config.shard is not None:
        plan, selected, calibration = shard_share(config, selected, calibration)
    return GateSetup(engine_spec, factory, options, config, selected, calibration,
                     golden, resume, origin, counters_pending=applies and (info is None or info.counters is None),
                     plan=plan)


def _shard(value: Any, update_golden: str | None) -> Shard | None:
    """``--shard I/N`` checked: I/N with 0 <= I < N; not with ``--update-golden`` (a shard's golden would
    hold its share of the prompts and replace the whole)."""
    if value in (None, ""):
        return None
    try:
        shard = Shard.parse(str(value))
    except ShardError as exc:
        raise BadInput(str(exc)) from None
    if update_golden:
        raise BadInput(f"--shard {shard.label} with --update-golden: a golden records every prompt; record it with "
                       "one unsharded `specparity record`, then gate the shards with --golden")
    return shard




GOLDEN_MODES = ("spec", "baseline")


def _force_reject(raw: Mapping[str, Any], info: Any, engine_spec: str) -> str | None:
    """``--force-reject MODE``: a known mode, and one the engine declares it can force (an engine
    that does not declare it cannot be trusted to: refused before anything loads)."""
    from specparity.model.force_reject import FORCE_REJECT_MODES

    mode = raw.get("force_reject")
    if mode in (None, ""):
        return None
    if mode not in FORCE_REJECT_MODES:
        raise BadInput(f"--force-reject {mode!r}: expected one of {', '.join(FORCE_REJECT_MODES)}")
    if info is None:
        raise BadInput(f"--force-reject {mode}: engine {engine_spec!r} declares no forced-rejection support (its factory "
                       "needs @engine_factory(EngineInfo(..., force_reject=(\"all\", \"random\"))) and a loop that "
                       "calls target.draft_corruptor, docs/FORCE_REJECT.md)")
    if mode not in info.force_reject:
        can = f"it can force only {', '.join(info.force_reject)}" if info.force_reject else "it cannot force rejects"
        note = f" ({info.force_reject_note})" if info.force_reject_note else ""
        raise BadInput(f"--force-reject {mode}: engine {info.name!r}: {can}{note}")
    return mode


def _kv_cache_dtype(value: Any, info: Any) -> str | None:
    """``--kv-cache-dtype``: checked here, before any model loads; only in-process engines take it
    (a server's KV cache is set by its own launch flags)."""
    from specparity.engines.inprocess.kvcache import KV_CACHE_DTYPES

    if value in (None, "", "auto"):
        return None
    if value not in KV_CACHE_DTYPES:
        raise BadInput(f"--kv-cache-dtype {value!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if info is not None and info.server:
        raise BadInput(f"--kv-cache-dtype {value}: engine {info.name!r} runs the KV cache its server was launched "
                       f"with (e.g. SGLang --kv-cache-dtype, llama-server -ctk/-ctv); the flag is for in-process engines")
    return value


def _device(value: Any, info: Any) -> str:
    """``--device``: cpu, cuda or cuda:N, for in-process engines; a CUDA device must exist here."""
    if value in (None, "", "cpu"):
        return "cpu"
    text = str(value)
    head, _, index = text.partition(":")
    if head != "cuda" or (index and not index.isdigit()):
        raise BadInput(f"--device {text!r}: expected cpu, cuda or cuda:N")
    if info is not None and info.server:
        raise BadInput(f"--device {text}: engine {info.name!r} runs where its server runs (e.g. llama-server -ngl)")
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        if not torch.cuda.is_available():
            raise BadInput(f"--device {text}: torch sees no CUDA device on this machine")
        if index and int(index) >= torch.cuda.device_count():
            raise BadInput(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _golden(raw: Mapping[str, Any]) -> tuple[Golden | None, str, str | None]:
    """``--golden FILE`` read and checked now (a corrupted or hand-edited golden is bad input, named
    by file:line); a missing file is not an error here: the run fails with "no golden" unless
    ``--update-golden`` records it."""
    path, mode, update = raw.get("golden"), raw.get("golden_mode") or "spec", raw.get("update_golden")
    if mode not in GOLDEN_MODES:
        raise BadInput(f"--golden-mode {mode!r}: expected one of {', '.join(GOLDEN_MODES)}")
    if update not in (None, "update", "force"):
        raise BadInput(f"--update-golden={update}: expected no value or force")
    if not path:
        for flag, given in (("--update-golden", update), ("--golden-mode", raw.get("golden_mode"))):
            if given:
                raise BadInput(f"{flag}: needs --golden FILE (the golden to record or compare with)")
        return None, mode, None
    if update and mode == "baseline":
        raise BadInput("--update-golden with --golden-mode baseline: record the golden first (--update-golden), "
                       "then compare a new baseline with it (--golden-mode baseline)")
    if Path(path).is_dir():
        raise BadInput(f"--golden {path}: a directory; expected a golden file (e.g. golden/dflash-float32.jsonl)")
    try:
        return load_golden(path), mode, update
    except FileNotFoundError:
        return None, mode, update
    except GoldenError as exc:
        if update == "force":
            return None, mode, update  # replaced whatever is there
        raise BadInput(f"{exc} (pass --update-golden=force to replace it)" if update else str(exc)) from None


def _resume(raw: Mapping[str, Any], report: str | None) -> Journal | None:
    if not raw.get("resume"):
        return None
    if not report:
        raise BadInput("--resume: needs --report DIR (the directory whose results.jsonl is continued)")
    path = Path(report) / JOURNAL
    if not path.is_file():
        raise BadInput(f"--resume: {path}: no journal to continue (run without --resume first)")
    try:
        journal = read_journal(path)
    except JournalError as exc:
        raise BadInput(f"--resume: {exc}") from None
    if "verdict" in journal.segment_kinds and "interrupted" not in journal.segment_kinds \
            and "fatal" not in journal.segment_kinds and not _unfinished(journal):
        raise BadInput(f"--resume: {path}: that run finished (its verdict is written); start a new run without --resume")
    return journal


#: GateConfig fields a resumed run must share with the interrupted one (else its finished results
#: answer other requests or another threshold), with the flag that sets each.
RESUME_FIELDS = {"prompts": "--prompts", "max_new_tokens": "--max-new-tokens", "top_k": "--top-k",
                 "near_tie_nats": "--near-tie-nats", "calibration": "--calibration", "golden": "--golden",
                 "golden_mode": "--golden-mode", "scorer": "--scorer", "scorer_model": "--scorer-model",
                 "near_tie_ceiling": "--near-tie-ceiling", "force_reject": "--force-reject", "shard": "--shard"}


def check_resumable(journal: Journal, config: GateConfig) -> None:
    """The resumed run must make the same requests and measure the same threshold as the one it
    continues; otherwise one line naming the option that differs."""
    old = journal.header.get("config") or {}
    new = config.to_json()
    for key, flag in RESUME_FIELDS.items():
        if key in old and old[key] != new[key]:
            raise BadInput(f"--resume: {flag} differs from the interrupted run's ({old[key]!r} there, {new[key]!r} now); "
                           f"resume with the same options or start a new run")


def _unfinished(journal: Journal) -> bool:
    """Whether the journal's run left prompts without a verdict, or with an error verdict."""
    baselines = set(journal.baselines)
    judged = {pid for pid, line in journal.judged.items()
              if line.get("verdict") and line["verdict"].get("class") != "error"}
    return bool(baselines - judged) or any(
        (line.get("verdict") or {}).get("class") == "error" for line in journal.judged.values())
