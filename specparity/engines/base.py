"""The engine protocol: the one small surface every engine answers.

As in vLLM's test ``conftest.py`` (``HfRunner`` / ``VllmRunner``), every engine — in-process
transformers, the dflash reference decoder, a server behind HTTP, or a team's own decoder loaded
with ``--engine mypkg.mod:factory`` — is driven through the same calls, so one comparison serves
all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

from specparity.types import Fingerprint, GenerationRequest, GenerationResult, TokenScores


@dataclass
class EngineOptions:
    """What the command line (or a caller) tells an engine factory.

    ``spec_mode`` names the speculative method inside an engine (``draft``, ``prompt_lookup``,
    ``dflash2``, ``dflash1`` …); ``None`` means the engine's default. ``num_draft_tokens`` is the
    draft width / block size; ``None`` means the engine's default. Unknown keys go to ``extra`` so
    user engines can take their own options.
    """

    target: str | None = None
    draft: str | None = None
    spec_mode: str | None = None
    dtype: str = "float32"
    num_draft_tokens: int | None = None
    threads: int | None = 1
    extra: dict[str, Any] = field(default_factory=dict)
    #: Server engines: already-running endpoints (several shard the prompts), else the engine launches.
    baseline_urls: tuple[str, ...] = ()
    spec_urls: tuple[str, ...] = ()
    #: Server engines: a named launch configuration (:mod:`specparity.engines.presets`).
    preset: str | None = None
    #: Server engines: the read timeout of one request, seconds (no request waits unbounded).
    request_timeout: float = 300.0
    #: Where launched servers write their logs (the report directory, when there is one).
    log_dir: str | None = None


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, so the gate answers each missing capability explicitly.

    ``scoring``: ``score()`` works (teacher-forced, one pass); without it the runner scores through
    another route and says which in the report. ``top_k``: the most alternatives per position it
    returns (None: any). ``counters``: how speculation is counted — ``steps`` (per verify step),
    ``request`` (per-request totals), ``aggregate`` (only run-wide totals, read by
    ``activity_counters()`` before and after the speculative phase) or ``none``.
    ``max_concurrency``: requests it can serve at once (in-process torch engines: 1).
    ``deterministic``: the engine declares deterministic / batch-invariant inference (e.g. SGLang's
    ``enable_deterministic_inference``), with where that was read.
    """

    scoring: bool = True
    top_k: int | None = None
    counters: Literal["steps", "request", "aggregate", "none"] = "steps"
    max_concurrency: int = 1
    deterministic: str | None = None


DEFAULT_CAPABILITIES = Capabilities()


def capabilities_of(engine: Any) -> Capabilities:
    """An engine's declared capabilities; engines that declare none get the in-process defaults."""
    fn = getattr(engine, "capabilities", None)
    return fn() if callable(fn) else DEFAULT_CAPABILITIES


#: Model dtypes the in-process engines understand (``--dtype``).
TORCH_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class OptionSpec:
    """One ``--engine-opt KEY=VALUE`` an engine accepts, checked before anything loads.

    ``parse`` turns the string into the value the engine uses and raises ``ValueError`` with a
    message saying what was expected; ``choices`` restricts the string to a fixed set.
    """

    help: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None

    def check(self, key: str, value: str) -> Any:
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"--engine-opt {key}={value!r}: expected one of {', '.join(self.choices)}")
        if self.parse is None:
            return value
        try:
            return self.parse(value)
        except ValueError as exc:
            raise ValueError(f"--engine-opt {key}={value!r}: {exc}") from None


@dataclass(frozen=True)
class EngineInfo:
    """What an engine kind accepts, known without loading anything: the face checks every option
    against it before a model loads, so a typo is one line and exit code 4, never a silent default.

    ``spec_modes``: accepted ``--spec-mode`` values, the first is the default (empty: the engine
    takes none). ``options``: accepted ``--engine-opt`` keys. ``dtypes``: accepted ``--dtype``
    values (empty: the engine has no dtype, e.g. a server). ``local_models``: ``--target`` /
    ``--draft`` must be local model directories (a typo must never become a hub download).
    """

    name: str
    spec_modes: tuple[str, ...] = ()
    options: Mapping[str, OptionSpec] = field(default_factory=dict)
    dtypes: tuple[str, ...] = TORCH_DTYPES
    local_models: bool = True
    #: Engine-specific checks of the whole option set, before anything loads or launches; raises
    #: ``ValueError`` with one line naming the option (e.g. a server binary or a GGUF that is missing).
    check: Callable[["EngineOptions"], None] | None = None
    #: Whether the engine talks to servers (``--baseline-url``/``--spec-url``/``--preset`` apply).
    server: bool = False


F = TypeVar("F", bound=Callable[..., Any])


def engine_factory(info: EngineInfo) -> Callable[[F], F]:
    """Declare what a factory's engine accepts: ``@engine_factory(EngineInfo("mine", options={...}))``.

    A factory without a declaration still loads, but may be given no ``--engine-opt`` at all
    (there is nothing to check the keys against).
    """

    def wrap(fn: F) -> F:
        fn.engine_info = info  # type: ignore[attr-defined]
        return fn

    return wrap


def parse_int_list(value: str) -> tuple[int, ...]:
    """``"4,7"`` -> ``(4, 7)`` (for options naming token ids)."""
    try:
        out = tuple(int(t) for t in value.split(","))
    except ValueError:
        raise ValueError("expected comma-separated token ids") from None
    if not out:
        raise ValueError("expected comma-separated token ids")
    return out


def parse_positive_int(value: str) -> int:
    """``--engine-opt`` values that count something (slots, tokens): an integer >= 1."""
    try:
        n = int(value)
    except ValueError:
        raise ValueError("expected an integer >= 1") from None
    if n < 1:
        raise ValueError("expected an integer >= 1")
    return n


def parse_positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise ValueError("expected a number > 0") from None
    if not x > 0:
        raise ValueError("expected a number > 0")
    return x


def parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


@runtime_checkable
class Engine(Protocol):
    """A greedy decoder that can run with and without speculation."""

    name: str

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        """Token ids for a plain prompt or chat messages (chat template applied)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of a token stream (for display only: verdicts compare ids)."""

    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end generation (EOS and friends)."""

    def generate(self, requests: Sequence[GenerationRequest], *, speculative: bool) -> list[GenerationResult]:
        """Decode each request greedily; return one result per request, in order.

        A request that fails returns ``GenerationResult.failed`` rather than raising, so a batch
        never loses the results that did finish.
        """

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        """Teacher-forced: the target's top-k logprobs at every position of ``continuation_ids``.

        Row i describes the distribution that predicts ``continuation_ids[i]`` given the prompt and
        ``continuation_ids[:i]``, computed in one pass.
        """

    def fingerprint(self) -> Fingerprint:
        """Engine, version, model and draft identity with content hashes, dtype, spec config."""

    def close(self) -> None:
        """Release processes, servers and memory."""
