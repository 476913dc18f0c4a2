"""``specparity arms``, before anything runs: each arm's plan — the engine options with the arm's knobs (read
through the engine's descriptor, :mod:`specparity.engines.server.arm_knobs`), the prompts it sends (the long
arm's own), the sizes its launch is computed from — or a refusal naming the missing knob (exit 4) before any
model loads or request is sent. :mod:`specparity.run.arm_runs` runs the plans.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from specparity.engines.server.arm_knobs import (
    ArmLaunch,
    ArmSetupError,
    ArmSizing,
    arm_changes,
    arm_launch,
    descriptor_of,
    long_prompt_tokens,
    requests_in_flight,
    supported_arms,
    unsupported_reason,
)
from specparity.model.arms import LONG_MIN_TOKENS, Arm
from specparity.model.prompts import Prompt, long_context_prompt
from specparity.run.setup import BadInput, GateSetup

#: Long-arm prompts per run (each is tens of thousands of tokens: a few prove the path).
LONG_PROMPTS = 2


@dataclass
class ArmPlan:
    """One arm as it will run: the setup (engine options with the arm's knobs, prompts, config) and
    the launch change it made."""

    arm: Arm
    setup: GateSetup
    launch: ArmLaunch
    #: The launch change in words: what was applied, or, on running servers, what the arm expects of them.
    launch_text: str = ""


# --------------------------------------------------------------------------- planning (before anything runs)


def engine_kind(setup: GateSetup) -> tuple[str, bool]:
    """(engine name, whether it is a server engine)."""
    from specparity.engines import engine_info

    info = engine_info(setup.factory)
    return (info.name if info is not None else setup.engine_spec), bool(info is not None and info.server)


def _prompt_tokens(setup: GateSetup, engine: str, prompts: Sequence[Prompt]) -> tuple[int, ...]:
    """Each prompt's token count, with the tokenizer the server engine sends (an engine that tokenizes on the
    server, llama.cpp: its character count, an upper bound)."""
    if _on_server(engine):
        return tuple(len(p.prompt or "") + sum(len(c) for _, c in (p.messages or ())) for p in prompts)
    from specparity.engines.server.engine import HFTokenizer, resolve_tokenizer_dir

    tok = HFTokenizer(resolve_tokenizer_dir(setup.engine_options, engine))
    return tuple(len(tok.encode_prompt(p.prompt, p.messages_as_dicts())) for p in prompts)


def _on_server(engine: str) -> bool:
    """Whether ``engine`` is sent text and tokenizes on the server (its descriptor says)."""
    d = descriptor_of(engine)
    return bool(d is not None and d.tokenizes_on_server)


def _max_new(setup: GateSetup, prompts: Sequence[Prompt]) -> tuple[int, ...]:
    from specparity.model.gate_run import DEFAULT_MAX_NEW_TOKENS

    return tuple(setup.config.max_new_tokens or p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS for p in prompts)


#: How far above the long arm's size a prompt sized with the target's tokenizer may come out (tokens).
LONG_FIT_TOKENS = 64


def sized_long_prompt(size: int, seed: int, count: Callable[[Prompt], int]) -> Prompt:
    """A needle-in-a-haystack prompt of ``size`` to ``size`` + :data:`LONG_FIT_TOKENS` tokens as
    ``count`` (the target's tokenizer) measures it: the generator's characters-per-token guess is off by
    2x between tokenizers (1.8 characters a token on the fixture's, 4 on large BPE vocabularies), so the
    haystack is rescaled by what was measured until it fits (a prompt that still does not is refused by
    the plan's context check, naming its length)."""
    ask = size
    prompt = long_context_prompt(ask, seed=seed)
    for _ in range(4):
        n = count(prompt)
        if size <= n <= size + LONG_FIT_TOKENS:
            break
        ask = max(16, round(ask * (size + LONG_FIT_TOKENS / 2) / max(n, 1)))
        prompt = long_context_prompt(ask, seed=seed)
    return prompt


def long_prompts(setup: GateSetup, engine: str) -> list[Prompt]:
    """The long arm's prompts: :data:`LONG_PROMPTS` needle-in-a-haystack prompts of the size the target
    allows, sized with the tokenizer the gate sends (an engine that tokenizes on the server, llama.cpp: its
    prompts are sized by the generator's own estimate, and bounded by characters)."""
    if _on_server(engine):
        made = [long_context_prompt(LONG_MIN_TOKENS, seed=seed) for seed in range(LONG_PROMPTS)]
        size = LONG_MIN_TOKENS
    else:
        size = long_prompt_tokens(setup.engine_options.target)
        made = [sized_long_prompt(size, seed, lambda p: _prompt_tokens(setup, engine, [p])[0])
                for seed in range(LONG_PROMPTS)]
    return [dataclasses.replace(p, id=f"longctx-en-{size}-s{seed}") for seed, p in enumerate(made)]


def _hybrid_checkpoint(target: str | None) -> Any:
    """``--target``'s config as the mamba-slots probe reads it (a checkpoint of its config alone) when the target
    has linear-attention layers (a recurrent state per request: mamba state slots on SGLang); None when it has
    none or its ``config.json`` is unreadable."""
    from specparity.probes.checkpoints import Checkpoint
    from specparity.probes.mamba_slots import linear_layer_report

    try:
        config = json.loads((Path(target or "") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    checkpoint = Checkpoint(Path(target or ""), config, {})
    return checkpoint if linear_layer_report(checkpoint)[0] else None


def target_is_hybrid(target: str | None) -> bool:
    """Whether ``--target`` has linear-attention layers (:func:`_hybrid_checkpoint`); False when unreadable."""
    return _hybrid_checkpoint(target) is not None


def _installed_version(package: str, python: str | None) -> tuple[int, ...] | None:
    """The version of ``package`` the servers will run: that of ``--engine-opt python`` (asked in a child process:
    an engine often lives in another environment), else the one installed here; None when neither says."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    from specparity.probes.version_facts import parse_version

    try:
        if python:
            ask = f"import importlib.metadata as m; print(m.version({package!r}))"
            text = subprocess.run([python, "-c", ask], capture_output=True, text=True, timeout=120,
                                  check=True).stdout.strip().splitlines()[-1]
        else:
            text = version(package)
        return parse_version(text)
    except (PackageNotFoundError, ValueError, IndexError, OSError, subprocess.SubprocessError):
        return None


def predict_mamba_slots(target: str | None, flags: Any, version: tuple[int, ...] | None) -> Any:
    """The mamba-slots probe's :class:`~specparity.probes.mamba_slots.SlotPrediction` for a hybrid ``target``
    launched with ``flags`` (:class:`~specparity.probes.mamba_slots.LaunchFlags`) on SGLang ``version`` (None:
    the newest version read); None for a target that is not a hybrid."""
    from specparity.probes.mamba_slots import predict_slots
    from specparity.probes.version_facts import newest_mamba_read, sglang_mamba_sizing

    checkpoint = _hybrid_checkpoint(target)
    if checkpoint is None:
        return None
    sizing = sglang_mamba_sizing(version if version is not None and version[:3] >= (0, 5, 17) else newest_mamba_read())
    return predict_slots(checkpoint, flags, sizing, {}) if sizing else None


def mamba_slots_per_request(setup: GateSetup, engine: str) -> int | None:
    """The state slots one request of the speculative launch takes (the mamba-slots probe, on the flags the
    speculative server is launched with and the engine version it runs, else the newest version read); None
    when the target is not a hybrid or the engine cannot set up the mamba-slots arm."""
    from specparity.probes.mamba_slots import LaunchFlags

    d = descriptor_of(engine)
    if d is None or not d.supports("mamba-slots"):
        return None
    options = setup.engine_options
    argv: list[str] = [str(a) for a in (options.extra.get("server_args") or ())]
    try:
        if d.spec_launch_args is not None:
            argv = list(d.spec_launch_args(options))
    except (ValueError, KeyError, TypeError):
        pass  # servers at URLs, or no preset: the flags given are all there is
    version = _installed_version(d.package, options.extra.get("python")) if d.package else None
    prediction = predict_mamba_slots(options.target, LaunchFlags.parse(argv), version)
    return prediction.slots_per_request if prediction is not None else None


def plan_arms(setup: GateSetup, arms: Sequence[Arm], *, prelaunched: bool = False) -> list[ArmPlan]:
    """Every arm's plan; :class:`BadInput` (one line naming the arm and the missing knob) for an arm this
    engine, its servers or its model cannot run — before any model loads or request is sent."""
    engine, server = engine_kind(setup)
    if not server:
        gpu = [a.name for a in arms if a.name != "default"]
        if gpu:
            from specparity.engines import SERVER_ENGINES

            raise BadInput(f"--arms {','.join(gpu)}: engine {setup.engine_spec!r} runs in process; these arms change "
                           f"a GPU server's launch (--engine {', '.join(SERVER_ENGINES)}) — only 'default' runs here")
    options = setup.engine_options
    urls = bool(options.baseline_urls)
    if urls and not prelaunched:
        needs = [a for a in arms if a.launch]
        if needs:
            a = needs[0]
            raise BadInput(f"--arms {a.name}: it changes the servers' launch ({arm_changes(engine, a.name)}), which "
                           "the gate cannot do to servers at --baseline-url/--spec-url; use --preset, or launch them "
                           "so yourself and pass --prelaunched")
    plans = []
    for arm in arms:
        if server and arm.name not in supported_arms(engine):
            raise BadInput(f"--arms {arm.name}: engine {engine!r} cannot run it: {unsupported_reason(engine, arm.name)} "
                           f"(it supports: {', '.join(supported_arms(engine))})")
        config = setup.config
        prompts = list(setup.prompts)
        calibration = setup.calibration
        try:
            if arm.name == "long":
                prompts = long_prompts(setup, engine)
                calibration = None
            if not server:
                launch = ArmLaunch()
            else:
                sent = [*prompts, *(calibration or ())]  # every prompt a server of this arm is sent
                slots = mamba_slots_per_request(setup, engine) if arm.hybrid else None
                sizing = ArmSizing(_prompt_tokens(setup, engine, sent), _max_new(setup, sent),
                                   requests_in_flight(options), slots)
                launch = arm_launch(engine, arm.name, sizing, options)
        except ArmSetupError as exc:
            raise BadInput(str(exc) if str(exc).startswith("--arms") else f"--arms {exc}") from None
        except ValueError as exc:
            raise BadInput(f"--arms {arm.name}: {exc}") from None
        out = str(Path(config.report_dir or "reports/arms") / arm.name)
        config = dataclasses.replace(config, report_dir=out,
                                     concurrency=launch.concurrency if launch.concurrency else config.concurrency)
        arm_options = options if urls else launch.apply(options)
        arm_options = dataclasses.replace(arm_options, log_dir=out)
        expects = launch.describe()
        text = expects if not urls else (
            f"servers at the URLs, as launched (the arm expects: {expects})" if expects != "nothing" else "nothing")
        plans.append(ArmPlan(arm, dataclasses.replace(setup, engine_options=arm_options, config=config,
                                                      prompts=prompts, calibration=calibration), launch, text))
        if server and not urls:  # the launch the arm asks for must be one the engine accepts (its own checks)
            from specparity.engines import engine_info

            info = engine_info(setup.factory)
            try:
                if info is not None and info.check is not None:
                    info.check(arm_options)
            except ValueError as exc:
                raise BadInput(f"--arms {arm.name}: {exc}") from None
    return plans
