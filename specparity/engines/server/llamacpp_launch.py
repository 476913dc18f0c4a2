"""How the ``llamacpp`` engine launches ``llama-server``: the typed launch (:class:`LlamaServerLaunch`: its flags,
speculative types and draft), where the binary and the fixture GGUFs are found, and the two launches of a
preset or a ``--spec-mode``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


from specparity.model.cache import user_cache_dir
from specparity.engines.base import (
    EngineOptions,
)
from specparity.engines.server.launch import LaunchConfig
from specparity.engines.server.presets import fill, get_preset, presets_for
from specparity.model.locations import MANIFEST, in_checkout


SPEC_TYPES = ("draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "ngram-simple",
              "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


#: Spec types that need a draft model (``-md``). ``draft-mtp`` drafts with the target's own MTP head
#: when no ``-md`` is given (``common/speculative.cpp``: an MTP context over the target model).
DRAFT_TYPES = ("draft-simple", "draft-eagle3", "draft-dflash", "draft-dspark")


#: Spec types that take a draft model when one is given.
OPTIONAL_DRAFT_TYPES = ("draft-mtp",)


#: Spec types with ``--spec-<type>-size-n/-size-m`` flags.
NGRAM_SIZED = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")


DEFAULT_PRESET = "llamacpp-draft-simple"


#: The draft GGUF each spec type takes by default.
DEFAULT_DRAFT = {"draft-simple": "draft", "draft-dflash": "dflash2-llamacpp"}


def fixture_gguf_dir() -> Path:
    """``<cache>/gguf/<first 16 hex of sha256(fixtures/MANIFEST.sha256)>``: the fixtures converted."""
    key = hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:16]
    return user_cache_dir() / "gguf" / key


def find_binary(explicit: str | None = None) -> Path | None:
    """``--engine-opt binary=``, else ``$SPECPARITY_LLAMA_SERVER``, else the newest cached build."""
    for candidate in (explicit, os.environ.get("SPECPARITY_LLAMA_SERVER")):
        if candidate:
            return Path(candidate)
    builds = sorted((user_cache_dir() / "llama-server").glob("*/bin/llama-server"), key=lambda p: p.stat().st_mtime)
    return builds[-1] if builds else None


@dataclass
class LlamaServerLaunch(LaunchConfig):
    """Typed ``llama-server`` flags (host and port are added by
    :class:`~specparity.engines.server.launch.ServerProcess`)."""

    #: The small GGUFs it is run with load in seconds on a CPU.
    startup_timeout_s: ClassVar[float] = 120.0

    binary: str
    model: str
    draft: str | None = None
    spec_type: str = "none"
    draft_n_max: int | None = None
    draft_n_min: int | None = None
    ngram_size_n: int | None = None
    ngram_size_m: int | None = None
    ctx_size: int = 4096
    parallel: int = 1
    threads: int = 1
    gpu_layers: int | None = None
    cache_type: str | None = None  # -ctk/-ctv, e.g. q8_0
    #: ``--spec-synth-len``: 1 under ``--force-reject all`` (synthetic acceptance that accepts no
    #: draft token: every verify step takes the target's own token and rolls the drafts back).
    synth_len: float | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def program(self) -> list[str]:
        return [self.binary]

    def args(self) -> list[str]:
        a = ["-m", self.model, "--threads", str(self.threads), "-c", str(self.ctx_size), "--parallel", str(self.parallel),
             "--no-webui"]
        if self.spec_type != "none":
            if self.spec_type not in SPEC_TYPES:
                raise ValueError(f"spec type {self.spec_type!r}: expected one of {', '.join(SPEC_TYPES)}")
            if self.spec_type in DRAFT_TYPES and not self.draft:
                raise ValueError(f"spec type {self.spec_type} needs a draft model")
            if self.draft and self.spec_type in DRAFT_TYPES + OPTIONAL_DRAFT_TYPES:
                a += ["-md", self.draft]
            a += ["--spec-type", self.spec_type]
            if self.draft_n_max is not None:
                a += ["--spec-draft-n-max", str(self.draft_n_max)]
            if self.draft_n_min is not None:
                a += ["--spec-draft-n-min", str(self.draft_n_min)]
            if self.synth_len is not None:
                a += ["--spec-synth-len", f"{self.synth_len:g}"]
            if self.spec_type in NGRAM_SIZED:
                if self.ngram_size_n is not None:
                    a += [f"--spec-{self.spec_type}-size-n", str(self.ngram_size_n)]
                if self.ngram_size_m is not None:
                    a += [f"--spec-{self.spec_type}-size-m", str(self.ngram_size_m)]
        if self.gpu_layers is not None:
            a += ["-ngl", str(self.gpu_layers)] + (["-ngld", str(self.gpu_layers)] if self.draft else [])
        if self.cache_type:
            a += ["-ctk", self.cache_type, "-ctv", self.cache_type]
        return a + list(self.extra)

    def spec_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec_type": self.spec_type}
        for key in ("draft_n_max", "draft_n_min", "ngram_size_n", "ngram_size_m", "cache_type", "parallel", "synth_len"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.draft:
            out["draft"] = self.draft
        return out


def _resolve_paths(options: EngineOptions, spec_type: str) -> tuple[str, str | None]:
    """(target GGUF, draft GGUF or None) from --target/--draft or the converted fixtures."""
    hint = "convert the fixtures with `specparity llamacpp convert`"
    if not options.target and not in_checkout():
        raise ValueError("--target: not given, and the installed specparity package carries no fixture models; "
                         "give the target GGUF (--target PATH.gguf)")
    target = options.target or str(fixture_gguf_dir() / "target.gguf")
    if not Path(target).is_file() or not target.endswith(".gguf"):
        flag = "--target" if options.target else "the fixture target GGUF"
        raise ValueError(f"{flag} {target}: expected an existing .gguf file" + ("" if options.target else f"; {hint}"))
    draft = None
    if spec_type in OPTIONAL_DRAFT_TYPES and options.draft:
        draft = options.draft
        if not Path(draft).is_file() or not draft.endswith(".gguf"):
            raise ValueError(f"--draft {draft}: expected an existing .gguf file")
    if spec_type in DRAFT_TYPES:
        # the fixture drafts go only with the fixture target (no --target)
        default = DEFAULT_DRAFT.get(spec_type) if not options.target else None
        draft = options.draft or (str(fixture_gguf_dir() / f"{default}.gguf") if default else None)
        if draft is None:
            raise ValueError(f"--draft: --spec-mode {spec_type} needs --draft DRAFT.gguf"
                             + (" made for --target (the fixture draft goes only with the fixture target)"
                                if options.target else ""))
        if not Path(draft).is_file() or not draft.endswith(".gguf"):
            flag = "--draft" if options.draft else f"the fixture draft GGUF for {spec_type}"
            raise ValueError(f"{flag} {draft}: expected an existing .gguf file" + ("" if options.draft else f"; {hint}"))
    return target, draft


def launch_configs(options: EngineOptions) -> tuple[LlamaServerLaunch, LlamaServerLaunch]:
    """The baseline and speculative launches: a preset (default ``llamacpp-draft-simple``, or the
    one named after ``--spec-mode``), overridden by explicit options. Raises ValueError."""
    preset_name = options.preset or (f"llamacpp-{options.spec_mode}" if options.spec_mode else DEFAULT_PRESET)
    if options.preset is None and options.spec_mode and preset_name not in presets_for("llamacpp"):
        preset_name = DEFAULT_PRESET
    preset = get_preset("llamacpp", preset_name)
    spec_values = dict(preset.spec)
    if options.spec_mode:
        spec_values["spec_type"] = options.spec_mode
    spec_type = spec_values.get("spec_type", "none")
    binary = find_binary(options.extra.get("binary"))
    if binary is None or not binary.is_file() or not os.access(binary, os.X_OK):
        raise ValueError(
            f"--engine-opt binary={binary}: not an executable llama-server" if binary else
            "no llama-server binary: build one with `specparity llamacpp build` (cached in "
            f"{user_cache_dir() / 'llama-server'}) or pass --engine-opt binary=PATH / $SPECPARITY_LLAMA_SERVER"
        )
    target, draft = _resolve_paths(options, spec_type)
    common: dict[str, Any] = {"binary": str(binary), "threads": options.threads or 1}
    ex = options.extra
    for opt, key in (("parallel", "parallel"), ("ctx_size", "ctx_size"), ("gpu_layers", "gpu_layers"),
                     ("cache_type", "cache_type")):
        if opt in ex:
            common[key] = ex[opt]
    common["extra"] = tuple(ex.get("server_args") or ())
    base_values = {**fill(preset.baseline, target=target, draft=draft), **common}
    spec_values = {**fill(spec_values, target=target, draft=draft), **common}
    if options.num_draft_tokens is not None:
        key = "ngram_size_m" if spec_type in NGRAM_SIZED else "draft_n_max"
        spec_values[key] = options.num_draft_tokens
    if "ngram_n" in ex:
        spec_values["ngram_size_n"] = ex["ngram_n"]
    if "ngram_m" in ex:
        spec_values["ngram_size_m"] = ex["ngram_m"]
    if spec_type in DRAFT_TYPES + OPTIONAL_DRAFT_TYPES:
        spec_values["draft"] = draft
    if options.force_reject == "all":
        spec_values["synth_len"] = FORCE_REJECT_SYNTH_LEN
    return LlamaServerLaunch(**base_values), LlamaServerLaunch(**spec_values)


#: ``--spec-synth-len`` under ``--force-reject all``: a mean acceptance length of 1 resolves to
#: per-position acceptance probabilities 0, so every draft token is rejected and the target's own
#: (greedy) token is emitted (``server_sample_and_accept_synth`` in tools/server/server-context.cpp).
FORCE_REJECT_SYNTH_LEN = 1.0
