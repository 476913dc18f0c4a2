"""The engine protocol: the one small surface every engine answers.

As in vLLM's test ``conftest.py`` (``HfRunner`` / ``VllmRunner``), every engine — in-process
transformers, the dflash reference decoder, a server behind HTTP, or a team's own decoder loaded
with ``--engine mypkg.mod:factory`` — is driven through the same calls, so one comparison serves
all of them.

Counter contract
----------------
A speculative result reports one :class:`~specparity.model.types.StepRecord` per **verify step**: one
target forward pass of the loop that produced output tokens. The prompt's prefill is a step only
when it also verifies draft tokens (transformers' assisted generation fuses the two); a plain
prefill whose token exists before any draft (dflash, SGLang, vLLM, llama.cpp) is not a step, and
its token is not counted as emitted. For each step:

* ``proposed`` — draft tokens the target verified in this pass (after any narrowing to fit
  ``max_new_tokens``); 0 for a pass with no draft (e.g. prompt lookup found no match);
* ``accepted`` — how many leading draft tokens made it into the output (``<= proposed``);
* ``emitted`` — tokens this step appended to the output: the accepted drafts plus the target's own
  correction or bonus token, minus anything cut;
* ``cut`` — ``"stop"`` when an accepted draft token was a stop token and the rest of the block was
  dropped; ``"limit"`` when ``max_new_tokens`` shaped the block: the step ended exactly at the limit
  after its tokens were truncated, or after a proposal narrowed to fit the limit was fully
  accepted. A proposal narrowed by the limit whose draft was then rejected was not cut.

Build records with :func:`step_record` from what was proposed and what was emitted; every count in a
report (acceptance rate, :func:`~specparity.model.types.accept_length`, path coverage) derives from these
fields, so engines that follow the contract are counted alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

from specparity.model.types import Fingerprint, GenerationRequest, GenerationResult, StepRecord, TokenScores


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
    #: Server engines: a named launch configuration (:mod:`specparity.engines.server.presets`).
    preset: str | None = None
    #: Server engines: the read timeout of one request, seconds (no request waits unbounded).
    request_timeout: float = 300.0
    #: Where launched servers write their logs (the report directory, when there is one).
    log_dir: str | None = None
    #: In-process engines: the target's KV-cache dtype (``--kv-cache-dtype``): None / "auto" (the
    #: model dtype) or "fp8_e4m3" (static-scale float8 round trip, :mod:`specparity.engines.inprocess.kvcache`).
    kv_cache_dtype: str | None = None
    #: In-process engines: the torch device the target (and draft) run on (``--device``): "cpu"
    #: (default) or "cuda" / "cuda:N".
    device: str = "cpu"
    #: ``--force-reject``: None, "all" or "random" (:mod:`specparity.model.force_reject`); only an engine
    #: whose :attr:`EngineInfo.force_reject` names the mode is given it.
    force_reject: str | None = None


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, so the gate answers each missing capability explicitly.

    ``scoring``: ``score()`` works (teacher-forced, one pass); without it the runner scores through
    another route and says which in the report. ``top_k``: the most alternatives per position it
    returns (None: any). ``counters``: how speculation is counted — ``steps`` (per verify step),
    ``request`` (per-request totals), ``aggregate`` (only run-wide totals, read by
    ``activity_counters()`` before and after the speculative phase) or ``none``.
    ``max_concurrency``: requests it can serve at once (in-process torch engines: 1), the most a run
    or a sweep level may put in flight. ``default_concurrency``: requests in flight when
    ``--concurrency`` is not given (None: ``max_concurrency``), for an engine whose server can take
    far more than a gate run needs (vLLM's ``max_num_seqs``).
    ``deterministic``: the engine declares deterministic / batch-invariant inference (e.g. SGLang's
    ``enable_deterministic_inference``) for **both** sides compared — every baseline and every
    speculative server — with where that was read; the gate then demands bit-exact output
    (:func:`specparity.gate.decision.bit_exact`). ``deterministic_partial``: a declaration that covers only
    part of them (say, the speculative server alone), in the same words: the report shows it, the
    policy ignores it (a near tie between a deterministic and a non-deterministic server breaks no
    promise). ``deterministic_unknown``: some servers declare it and none says it is off, but the
    others could not be asked (no route, an unreadable answer): without a policy it is reported like
    a partial declaration; under a policy file an unknown is not lenient, and the run is bit-exact.
    """

    scoring: bool = True
    top_k: int | None = None
    counters: Literal["steps", "request", "aggregate", "none"] = "steps"
    max_concurrency: int = 1
    default_concurrency: int | None = None
    deterministic: str | None = None
    deterministic_partial: str | None = None
    deterministic_unknown: str | None = None


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
    ``counters``: the :attr:`Capabilities.counters` kind every engine of this kind reports, known
    without loading it (None: unknown until the engine is built, e.g. a plugin that does not say),
    so a policy the counters cannot check (``--require-all-paths`` needs per-step records,
    ``min_accept_length`` any counters) is refused before anything loads or launches.
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
    #: How this engine kind counts speculation (see ``counters`` above); None: known only once built.
    counters: Literal["steps", "request", "aggregate", "none"] | None = None
    #: The ``--force-reject`` modes the engine can force (:mod:`specparity.model.force_reject`); a mode it
    #: cannot is refused before anything loads, with ``force_reject_note`` saying why.
    force_reject: tuple[str, ...] = ()
    force_reject_note: str = ""
    #: Output constraints (prompt fields ``json_schema`` / ``grammar``) the engine applies on both
    #: sides; a constrained prompt for an engine without its kind is refused before anything loads
    #: (never decoded unconstrained). Empty: none (in-process engines, plugins that do not say).
    constraints: tuple[str, ...] = ()
    #: A server engine's own facts beyond the protocol (arms, prefix cache, proofs' readers, reproducer
    #: parsers: :class:`~specparity.engines.server.descriptor.ServerDescriptor`); None for an engine without.
    descriptor: Any = None


def step_record(
    proposed_ids: Sequence[int],
    emitted_ids: Sequence[int],
    *,
    nominal_width: int,
    budget_before: int,
    stop_ids: Iterable[int],
) -> StepRecord:
    """The :class:`~specparity.model.types.StepRecord` of one verify step, per the counter contract above.

    ``proposed_ids``: the draft tokens verified; ``emitted_ids``: the tokens the step appended;
    ``nominal_width``: the draft width the loop proposes when the limit does not interfere;
    ``budget_before``: output tokens still allowed before the step (``max_new_tokens`` minus the
    tokens already emitted); ``stop_ids``: the tokens that end generation.

    ``accepted`` is the length of the common prefix of the two lists: in a correct loop the token
    after the accepted drafts is the target's own and differs from the draft there. When every
    emitted token is an accepted draft, the block was truncated: by a stop token if the last one is
    a stop, else by the limit (only if the step ends exactly at it — a loop that drops tokens for no
    reason has no cut to claim).
    """
    stops = set(stop_ids)
    proposed, emitted = list(proposed_ids), list(emitted_ids)
    accepted = 0
    for p, e in zip(proposed, emitted):
        if p != e:
            break
        accepted += 1
    at_limit = len(emitted) == budget_before
    cut: Literal["limit", "stop"] | None = None
    if emitted and accepted == len(emitted):  # truncated: no correction/bonus token made it
        if emitted[-1] in stops:
            cut = "stop"
        elif at_limit:
            cut = "limit"
    elif at_limit and proposed and accepted == len(proposed) < nominal_width and emitted[-1] not in stops:
        cut = "limit"  # narrowed to fit the limit, fully accepted, and the bonus filled it
    return StepRecord(len(proposed), accepted, len(emitted), cut)


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

        ``output_ids`` holds the new tokens only. ``finish_reason`` is ``"stop"`` exactly when the
        last token is a stop token (``request.stop_token_ids``, else :meth:`stop_token_ids`), which
        is kept in the output and never followed by another token; ``"length"`` exactly when
        ``max_new_tokens`` tokens were emitted without a stop. :func:`specparity.judge.compare.compare`
        enforces this: a speculative stream that breaks it (a short ``"length"``, a token past a
        stop or past the limit) is ``diverged`` even when its tokens match, and a finish reason that
        differs from the baseline's is ``diverged`` too.

        ``scores`` has one row per output token, the row that chose it (for a speculative run: from
        the verify pass): ``logprobs[i]`` is the *exact* float32 log-softmax of ``output_ids[i]``,
        also when that token is outside the top-k; ``top_ids[i]`` / ``top_logprobs[i]`` are at
        least ``request.top_k`` alternatives sorted by descending logprob. Only a row the engine
        cannot report may be left out: ``logprobs[i]`` and ``top_logprobs[i]`` NaN, ``top_ids[i]``
        -1. The noise measurement skips it, and a baseline divergence there is judged on the
        teacher-forced row from :meth:`score`, or is ``diverged`` when there is none: an unreported
        margin is never taken for a near tie.

        ``spec`` carries the counters of the counter contract above (build them with
        :func:`step_record`), or ``SpecStats.unavailable(why)``. A request that fails returns
        ``GenerationResult.failed`` rather than raising, so a batch never loses the results that
        did finish.
        """

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        """Teacher-forced: the target's logprobs at every position of ``continuation_ids``.

        Row i describes the distribution that predicts ``continuation_ids[i]`` given the prompt and
        ``continuation_ids[:i]``, computed in one pass, with the same row contract as
        ``GenerationResult.scores``: the exact logprob of ``continuation_ids[i]`` (also outside the
        top-k) and at least ``top_k`` alternatives by descending logprob. These rows decide whether
        every speculative token after a near-tie flip is still the target's argmax. An engine that
        cannot get a token's exact logprob (a server returning only its top-k) sets
        ``token_ids[i] = -1`` and ``logprobs[i] = NaN``: the token then counts as outside the
        top-k, never as the argmax.
        """

    def fingerprint(self) -> Fingerprint:
        """Engine, version, model and draft identity with content hashes, dtype, spec config."""

    def close(self) -> None:
        """Release processes, servers and memory."""
