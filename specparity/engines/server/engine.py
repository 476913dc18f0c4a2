"""Engines behind HTTP: the baseline and the speculative run as two sessions of one engine kind.

For SGLang and vLLM speculation is a launch-time setting, so — as vLLM's own tests hold a
``ref_llm`` and a ``spec_llm`` — a server engine holds two :class:`~specparity.engines.server.http.Fleet`\\ s:
``baseline`` (no speculation) and ``spec``. Each is either already running (``--baseline-url`` /
``--spec-url``, repeatable: several URLs shard the prompts) or launched by the gate from a typed
launch config (:mod:`specparity.engines.server.launch`, presets in :mod:`specparity.engines.server.presets`).

An adapter (``llamacpp``, ``sglang``, ``vllm``) subclasses :class:`ServerEngine` and implements
only the wire format: :meth:`ServerEngine.complete` (one greedy request → a
:class:`~specparity.model.types.GenerationResult`) and, if the server can, :meth:`ServerEngine.score`.
Everything else — launch-or-URL (:func:`start_sessions`, with the GPUs of each launch), the
``--engine-opt`` keys the adapters share (:func:`server_options`), requests in flight, cached
server facts, determinism declared on every server of both sides, sharding, bounded timeouts,
turning every failure into an ``error`` result with its cause, the sanity checks every server
answer gets, health, fingerprint, logs, stopping what was launched — lives here once.
"""

from __future__ import annotations

import copy
import json
import shlex
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from specparity.engines.base import (
    Capabilities,
    EngineOptions,
    OptionSpec,
    parse_bool,
    parse_positive_float,
    parse_positive_int,
)
from specparity.engines.common import load_tokenizer
from specparity.engines.server.http import Endpoint, Fleet, ServerError, check_url
from specparity.engines.server.launch import LaunchConfig, ServerProcess, describe_exit
from specparity.engines.server.presets import presets_for
from specparity.model.prompts import encode_prompt
from specparity.model.types import (
    ArtifactId,
    Fingerprint,
    GenerationRequest,
    GenerationResult,
    TokenScores,
)


#: The two sides, in this order everywhere: names of the sessions, of the launched processes
#: (``<engine>-baseline``) and of the ``--engine-opt <role>_gpus`` options.
ROLES = ("baseline", "spec")
#: Seconds for a GET of what a server says about itself (``/health``, ``/props``, ``/server_info``,
#: ``/version``, ``/v1/models``, ``/metrics``): small answers, but from a server that may be busy.
INFO_TIMEOUT_S = 30.0
#: Requests in flight per server and phase when neither ``--engine-opt max_concurrency`` nor the
#: server's own slots say otherwise.
DEFAULT_CONCURRENCY = 8


class HFTokenizer:
    """Prompt encoding and stop ids from a local Hugging Face model/tokenizer directory — the same
    chat template the server applies when it is given messages (the server is sent token ids)."""

    def __init__(self, path: str):
        self.path = path
        self.tok = load_tokenizer(path)
        self._stop = self._eos_ids(Path(path))

    def _eos_ids(self, root: Path) -> tuple[int, ...]:
        """The model's stop set: ``generation_config.json``'s ``eos_token_id`` (what ``generate``
        and the servers stop on), else ``config.json``'s, plus the tokenizer's EOS."""
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            try:
                eos = json.loads((root / name).read_text()).get("eos_token_id")
            except (OSError, ValueError):
                continue
            if eos is None:
                continue
            ids = [int(v) for v in (eos if isinstance(eos, list) else [eos]) if v is not None]
            break
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in ids:
            ids.append(int(self.tok.eos_token_id))
        return tuple(dict.fromkeys(ids))

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        return encode_prompt(self.tok, prompt, messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop


@dataclass
class Session:
    """One role (``baseline`` or ``spec``): its endpoints and, when the gate launched them, the
    processes behind them."""

    role: str
    fleet: Fleet
    processes: list[ServerProcess]

    def close(self) -> None:
        for p in self.processes:
            p.stop()
        self.fleet.close()


def open_session(role: str, urls: Sequence[str], launches: Sequence[ServerProcess], *,
                 read_timeout_s: float) -> Session:
    """Connect to ``urls`` or start ``launches`` (never both), bounded by ``read_timeout_s``."""
    started: list[ServerProcess] = []
    try:
        for proc in launches:
            proc.start()
            started.append(proc)
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    all_urls = list(urls) + [p.url for p in started]
    fleet = Fleet(role, [Endpoint(u, read_timeout_s=read_timeout_s) for u in all_urls])
    return Session(role, fleet, started)


def open_sessions(options: EngineOptions,
                  processes: tuple[ServerProcess, ServerProcess] | None = None) -> tuple[Session, Session]:
    """The baseline and speculative sessions: the running servers of ``--baseline-url`` /
    ``--spec-url``, or ``processes`` (baseline, speculative) started here — the baseline stopped
    again when the speculative one fails to come up. With ``--engine-opt parallel_start`` both are
    spawned before either is waited for (each GPU server's start-up is mostly its own imports and
    weights loading: side by side they take about one start's time instead of two)."""
    timeout = options.request_timeout
    if options.baseline_urls:
        return (open_session("baseline", options.baseline_urls, [], read_timeout_s=timeout),
                open_session("spec", options.spec_urls, [], read_timeout_s=timeout))
    if processes is None:
        raise ValueError("no server to connect to or launch")
    if options.extra.get("parallel_start"):
        return open_together(processes, read_timeout_s=timeout)
    baseline = open_session("baseline", [], [processes[0]], read_timeout_s=timeout)
    try:
        spec = open_session("spec", [], [processes[1]], read_timeout_s=timeout)
    except BaseException:
        baseline.close()
        raise
    return baseline, spec


def open_together(processes: tuple[ServerProcess, ServerProcess], *, read_timeout_s: float) -> tuple[Session, Session]:
    """Both processes spawned at once, then each waited for (baseline first); any failure stops both."""
    spawned: list[ServerProcess] = []
    try:
        for proc in processes:
            proc.spawn()
            spawned.append(proc)
        for proc in processes:
            proc.wait_ready()
    except BaseException:
        for proc in spawned:
            proc.stop()
        raise
    return tuple(Session(role, Fleet(role, [Endpoint(p.url, read_timeout_s=read_timeout_s)]), [p])  # type: ignore[return-value]
                 for role, p in zip(ROLES, processes))


def gpu_env(options: EngineOptions, role: str) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of the ``role`` launch, from ``--engine-opt <role>_gpus`` (empty: the
    server sees what the gate sees)."""
    gpus = options.extra.get(f"{role}_gpus")
    return {"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}


def launch_processes(options: EngineOptions, launches: tuple[LaunchConfig, LaunchConfig],
                     prefix: str) -> tuple[ServerProcess, ServerProcess]:
    """The baseline and speculative processes of ``launches``, named ``<prefix>-baseline`` /
    ``<prefix>-spec``, logging into ``--log-dir``, each with its GPUs and the start-up deadline of
    ``--engine-opt startup_timeout`` (else the launch config's own)."""
    timeout = options.extra.get("startup_timeout")
    base, spec = (launch.process(f"{prefix}-{role}", log_dir=options.log_dir,
                                 startup_timeout_s=float(timeout) if timeout else None, env=gpu_env(options, role))
                  for role, launch in zip(ROLES, launches))
    return base, spec


def start_sessions(options: EngineOptions, launches: tuple[LaunchConfig | None, LaunchConfig | None],
                   prefix: str) -> tuple[Session, Session]:
    """Launch-or-URL: the running servers of ``--baseline-url`` / ``--spec-url`` when given (the
    ``launches`` are then ``(None, None)``), else the two ``launches`` started here
    (:func:`launch_processes`, :func:`open_sessions`)."""
    base, spec = launches
    if options.baseline_urls or base is None or spec is None:
        return open_sessions(options)
    return open_sessions(options, launch_processes(options, (base, spec), prefix))


def server_options(engine: str, server: str, *, startup_timeout_s: float, concurrency_note: str = "",
                   gpus_note: str = "") -> dict[str, OptionSpec]:
    """The ``--engine-opt`` keys every engine that sends token ids to preset-launched (GPU) servers
    has alike: the tokenizer, requests in flight, and for launches the start-up deadline, extra
    ``server`` flags and the GPUs of each side."""
    return {
        "tokenizer": OptionSpec("local Hugging Face tokenizer directory used to encode prompts (default: --target "
                                f"when it is a local directory); {engine} is always sent token ids"),
        "max_concurrency": OptionSpec(f"requests in flight per phase (default {DEFAULT_CONCURRENCY}{concurrency_note})",
                                      parse=parse_positive_int),
        "startup_timeout": OptionSpec(f"launches: seconds to wait for /health (default {startup_timeout_s:g})",
                                      parse=parse_positive_float),
        "server_args": OptionSpec(f"launches: extra {server} flags for both launches, as one string",
                                  parse=shlex.split),
        "baseline_gpus": OptionSpec(f"launches: CUDA_VISIBLE_DEVICES of the baseline server (both servers run at "
                                    f"once{gpus_note})"),
        "spec_gpus": OptionSpec("launches: CUDA_VISIBLE_DEVICES of the speculative server"),
        "parallel_start": OptionSpec("launches: start both servers side by side instead of one after the other "
                                     "(true/false, default false: two engines profiling one GPU's memory at once "
                                     "may each size their KV cache from what the other has not yet taken)",
                                     parse=parse_bool),
    }


def concurrency(options: EngineOptions, spec: Session, per_server: int | None = None) -> int:
    """Requests in flight per phase: ``--engine-opt max_concurrency`` (else ``per_server``, else
    :data:`DEFAULT_CONCURRENCY`) per server, times the speculative servers that shard the prompts."""
    n = int(options.extra.get("max_concurrency") or per_server or DEFAULT_CONCURRENCY)
    return n * max(1, len(spec.fleet.endpoints))


def resolve_tokenizer_dir(options: EngineOptions, engine: str) -> str:
    """``--engine-opt tokenizer=DIR``, else ``--target`` when it is a local directory; ValueError otherwise."""
    tok = options.extra.get("tokenizer")
    flag = "--engine-opt tokenizer"
    if not tok:
        if options.target and Path(options.target).is_dir():
            tok, flag = options.target, "--target"
        else:
            what = f"--target {options.target!r} is not a local directory" if options.target else "no --target"
            raise ValueError(f"--engine-opt tokenizer: the {engine} engine sends token ids, so it needs a local "
                             f"Hugging Face tokenizer directory ({what}); pass --engine-opt tokenizer=DIR")
    p = Path(tok)
    if not p.is_dir():
        raise ValueError(f"{flag}={tok}: not a directory")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ValueError(f"{flag}={tok}: no tokenizer.json or tokenizer_config.json there")
    return str(p)

def check_distinct_sides(options: EngineOptions) -> None:
    """One server given as both a baseline and a speculative URL is refused: a drafting server
    compared with itself always agrees, and a non-drafting one measures nothing."""
    base = {check_url("--baseline-url", u) for u in options.baseline_urls}
    same = [u for u in options.spec_urls if check_url("--spec-url", u) in base]
    if same:
        raise ValueError(f"--spec-url {same[0]}: the same server is also a --baseline-url; give the baseline a "
                         "server of its own, launched without speculation")


def check_both_sides(options: EngineOptions, engine: str, otherwise: str) -> None:
    """``--baseline-url`` and ``--spec-url`` together or not at all (``otherwise`` says what the
    engine does without them)."""
    if bool(options.baseline_urls) != bool(options.spec_urls):
        missing = "--spec-url" if options.baseline_urls else "--baseline-url"
        raise ValueError(f"{missing}: the {engine} engine needs both --baseline-url and --spec-url ({otherwise})")


def check_urls(options: EngineOptions) -> None:
    """Every ``--baseline-url`` / ``--spec-url`` well formed (ValueError naming the flag)."""
    for flag, urls in (("--baseline-url", options.baseline_urls), ("--spec-url", options.spec_urls)):
        for u in urls:
            check_url(flag, u)


def check_server_flags(options: EngineOptions, engine: str) -> None:
    """Running servers (both URLs) or a preset to launch, never both, never half; URLs well formed;
    no server on both sides."""
    check_both_sides(options, engine, "or --preset to launch both servers")
    if options.baseline_urls and options.preset:
        raise ValueError(f"--preset {options.preset}: give either --baseline-url/--spec-url (running servers) or "
                         "--preset (launch them), not both")
    if not options.baseline_urls and not options.preset:
        raise ValueError(f"--baseline-url: the {engine} engine needs --baseline-url and --spec-url (running servers) "
                         f"or --preset NAME to launch them (presets: {', '.join(presets_for(engine))})")
    check_urls(options)
    check_distinct_sides(options)
    if options.baseline_urls and options.num_draft_tokens is not None:
        raise ValueError(f"--num-draft-tokens: the {engine} servers at --spec-url run with their own launch setting; "
                         "it only applies to --preset launches")

def named(endpoint: Endpoint, exc: ServerError) -> ServerError:
    """``exc`` with the endpoint's URL in its message (transport failures already name it)."""
    if endpoint.base_url in str(exc):
        return exc
    return ServerError(f"{endpoint.base_url}: {exc}", transport=exc.transport, status=exc.status)


@contextmanager
def named_errors(endpoint: Endpoint, malformed: str | None = None) -> Iterator[None]:
    """Every :class:`ServerError` raised inside names ``endpoint`` (:func:`named`); with
    ``malformed`` (e.g. ``"scoring answer malformed"``), an answer of an unexpected shape (KeyError,
    TypeError, ValueError, IndexError) becomes a ServerError saying so."""
    try:
        yield
    except ServerError as exc:
        raise named(endpoint, exc) from None
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        if malformed is None:
            raise
        raise ServerError(f"{endpoint.base_url}: {malformed} ({type(exc).__name__}: {exc})") from None


def declared_on_every_server(said: Sequence[tuple[str, str, str]], what: str,
                             where_note: str = "") -> tuple[str | None, str | None]:
    """(``Capabilities.deterministic``, ``deterministic_partial``) from what each server of both
    sides says (``(role, url, "true" | anything else)``): deterministic only when every one says
    ``true`` — bit-exact output is promised between two deterministic servers, not between a
    deterministic one and an ordinary one; some saying it is only reported. ``what`` names the
    setting and where it was read."""
    if not any(on == "true" for _, _, on in said):
        return None, None
    where = ", ".join(f"{role} {url}: {on}" for role, url, on in said)
    if all(on == "true" for _, _, on in said):
        return f"{what} ({where}{where_note})", None
    return None, f"{what}, but not on every server of both sides ({where})"

def declaration_unknown(said: Sequence[tuple[str, str, str]], what: str) -> str | None:
    """``Capabilities.deterministic_unknown``: some servers declare the setting (``"true"``) and none
    says it is off, but the others could not say (their answer starts with ``"unknown"``: no route,
    an unreadable body). Such a run is not shown deterministic, nor shown not to be; a policy then
    makes it strict (:func:`specparity.gate.decision.bit_exact`). None otherwise."""
    on = [(role, url) for role, url, answer in said if answer == "true"]
    unknown = [(role, url, answer) for role, url, answer in said if answer.startswith("unknown")]
    if not on or not unknown or len(on) + len(unknown) != len(said):
        return None
    return (f"{what} on {', '.join(f'{role} {url}' for role, url in on)}; unknown on "
            f"{', '.join(f'{role} {url} ({answer})' for role, url, answer in unknown)}")


class ServerEngine:
    """The engine protocol over a baseline session and a speculative session.

    Subclasses set ``name`` and implement :meth:`complete` (and :meth:`score` when the server can
    score teacher-forced), :meth:`server_info` and :meth:`capabilities`. ``launches`` are the
    (baseline, speculative) launch configs the gate started, ``(None, None)`` for running servers;
    ``max_concurrency`` is the requests in flight per phase (:func:`concurrency`).
    """

    name = "server"
    #: The engine's own facts (:class:`~specparity.engines.server.descriptor.ServerDescriptor`); set by each
    #: adapter class.
    descriptor: Any = None

    def __init__(self, options: EngineOptions, baseline: Session, spec: Session, tokenizer: Any,
                 *, target: ArtifactId, draft: ArtifactId | None,
                 launches: tuple[LaunchConfig | None, LaunchConfig | None] = (None, None),
                 max_concurrency: int = DEFAULT_CONCURRENCY):
        self.options = options
        self.baseline = baseline
        self.spec = spec
        self.tokenizer = tokenizer
        self._target = target
        self._draft = draft
        self.launches = launches
        self.max_concurrency = max_concurrency
        self._fingerprint: Fingerprint | None = None
        self._same_target_checked = False
        self._facts: dict[tuple[str, str], Any] = {}
        self._facts_lock = threading.Lock()

    # ------------------------------------------------------------------ server facts
    def cached(self, endpoint: Endpoint, what: str, read: Callable[[], Any]) -> Any:
        """``read()`` once per endpoint and ``what`` (thread-safe): what a server says about itself
        does not change during a run. An exception from ``read`` is not cached (a server still
        starting may answer later)."""
        key = (endpoint.base_url, what)
        with self._facts_lock:
            if key in self._facts:
                return self._facts[key]
        value = read()
        with self._facts_lock:
            self._facts[key] = value
        return value

    def every_server(self) -> list[tuple[str, Endpoint]]:
        """(role, endpoint) of every server of both sides, the baseline's first."""
        return [(s.role, e) for s in (self.baseline, self.spec) for e in s.fleet.endpoints]

    def is_speculative(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` serves the speculative side."""
        return endpoint in self.spec.fleet.endpoints

    def scoring_endpoint(self, prompt_ids: Sequence[int]) -> Endpoint:
        """The baseline server that scores ``prompt_ids`` (sharded like the prompts)."""
        return self.baseline.fleet.pick("score:" + ",".join(map(str, prompt_ids[:8])))

    # ------------------------------------------------------------------ wire format (adapters)
    def complete(self, endpoint: Endpoint, req: GenerationRequest, speculative: bool) -> GenerationResult:
        raise NotImplementedError

    def request_facts(self, endpoint: Endpoint) -> dict[str, Any]:
        """What the adapter's request body needs from ``endpoint`` besides the request (its
        ``WIRE.body`` facts, :mod:`specparity.engines.server.wire`); none by default."""
        return {}

    def wire_record(self) -> dict[str, list[dict[str, Any]]]:
        """Per side, every server's URL and its :meth:`request_facts`, for the journal's run line: a
        reproducer rebuilds the exact request bodies from it. A server that cannot say is recorded
        with the error instead of its facts (a reproducer then says so); the run goes on."""
        out: dict[str, list[dict[str, Any]]] = {}
        for session in (self.baseline, self.spec):
            rows = []
            for endpoint in session.fleet.endpoints:
                try:
                    rows.append({"url": endpoint.base_url, "facts": self.request_facts(endpoint)})
                except Exception as exc:  # noqa: BLE001 - each request meets the same failure and says it
                    rows.append({"url": endpoint.base_url, "facts": None, "error": f"{type(exc).__name__}: {exc}"})
            out[session.role] = rows
        return out

    def server_info(self, endpoint: Endpoint) -> dict[str, Any]:
        """What the server says about itself (version, speculative config), for the fingerprint.

        An ``"identity"`` entry (a dict: model path, size, vocabulary size, architecture — whatever
        names the served target) and a ``"numerics"`` entry (a dict: dtype, quantization, KV cache dtype,
        attention backend, tensor-parallel size — whatever the server reports of what decides how the
        target computes) are compared across every endpoint of both fleets before anything is judged
        (:meth:`check_same_target`)."""
        return {}

    def endpoint_identity(self, endpoint: Endpoint) -> dict[str, Any]:
        """The identity of the target ``endpoint`` serves (``server_info(...)["identity"]``)."""
        return dict(self.server_info(endpoint).get("identity") or {})

    def endpoint_numerics(self, endpoint: Endpoint) -> dict[str, Any]:
        """What decides how ``endpoint`` computes its target (``server_info(...)["numerics"]``)."""
        return dict(self.server_info(endpoint).get("numerics") or {})

    def check_same_target(self) -> None:
        """Every endpoint of both fleets serves the same target and computes it the same way: a field that
        differs between two endpoints (both reporting it) is a :class:`ServerError` naming both and the
        difference. A speculative server whose target computes differently (another KV cache dtype, a
        quantization) would otherwise widen the noise it is judged against, or be judged against a
        baseline it was never meant to match."""
        if self._same_target_checked:
            return
        servers = self.every_server()
        _refuse_differences([(role, e, self.endpoint_identity(e)) for role, e in servers], "serve the same target", "")
        _refuse_differences([(role, e, self.endpoint_numerics(e)) for role, e in servers],
                            "compute the target the same way",
                            "; launch every server with the same dtype, quantization, KV cache dtype, attention "
                            "backend, tensor-parallel and pipeline-parallel size")
        self._same_target_checked = True

    def capabilities(self) -> Capabilities:
        return Capabilities(scoring=False, counters="request", max_concurrency=self.max_concurrency)

    # ------------------------------------------------------------------ protocol
    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        return self.tokenizer.encode_prompt(prompt, messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def stop_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.stop_token_ids()

    def generate(self, requests: Sequence[GenerationRequest], *, speculative: bool) -> list[GenerationResult]:
        session = self.spec if speculative else self.baseline
        out = []
        for req in requests:
            endpoint = session.fleet.pick(req.request_id)
            t0 = time.perf_counter()
            try:
                result = self.complete(endpoint, req, speculative)
                problem = self.check(req, result)
                if problem:
                    result = GenerationResult.failed(req.request_id, f"{endpoint.base_url}: {problem}")
            except ServerError as exc:
                result = GenerationResult.failed(req.request_id, self._explain(session, endpoint, exc))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                result = GenerationResult.failed(
                    req.request_id, f"{endpoint.base_url}: unexpected response shape ({type(exc).__name__}: {exc})")
            if not result.wall_s:
                result.wall_s = time.perf_counter() - t0
            out.append(result)
        return out

    def check(self, req: GenerationRequest, result: GenerationResult) -> str | None:
        """Sanity checks on every answer: a server that stops short without saying why is an
        error, never a shorter "exact" stream."""
        n = len(result.output_ids)
        if result.finish_reason == "length" and n < req.max_new_tokens:
            return (f"returned {n} of max_new_tokens={req.max_new_tokens} tokens and finish 'length': "
                    "the server stopped short without saying why")
        if len(result.scores) != n:
            return f"returned {len(result.scores)} logprob rows for {n} tokens"
        return None

    def _explain(self, session: Session, endpoint: Endpoint, exc: ServerError) -> str:
        msg = str(exc)
        if endpoint.base_url not in msg:  # an adapter's own check (e.g. "answered without 'timings'")
            msg = f"{endpoint.base_url}: {msg}"
        for proc in session.processes:
            if proc.url == endpoint.base_url and not proc.alive():
                code = proc.process.returncode if proc.process else None
                msg += f"; {describe_exit(f'the {session.role} server process', code)}; log {proc.log_path}"
        return msg

    def score(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int], top_k: int) -> TokenScores:
        raise NotImplementedError(f"engine {self.name} cannot score teacher-forced; use --scorer embedded")

    def health(self) -> None:
        """Raise :class:`ServerError` naming the first endpoint that is not healthy."""
        for session in (self.baseline, self.spec):
            for endpoint in session.fleet.endpoints:
                try:
                    endpoint.request("GET", "/health", timeout_s=INFO_TIMEOUT_S)
                except ServerError as exc:
                    raise ServerError(f"{session.role} endpoint unhealthy: {self._explain(session, endpoint, exc)}",
                                      transport=exc.transport) from None
        self.check_same_target()

    def skipped_checks(self) -> list[str]:
        """Checks :meth:`health` had to skip because a server could not answer them, in words (the
        gate reports each, and fails on it under a policy); none by default."""
        return []

    def fingerprint(self) -> Fingerprint:
        if self._fingerprint is None:
            base = self.server_info(self.baseline.fleet.endpoints[0])
            spec = self.server_info(self.spec.fleet.endpoints[0])
            self._fingerprint = Fingerprint(
                engine=self.name,
                engine_version=str(spec.get("version") or base.get("version") or "unknown"),
                target=self._target,
                draft=self._draft,
                dtype=str(spec.get("dtype") or "server"),
                spec_config=spec.get("spec_config", {}),
                extra={
                    "baseline_urls": self.baseline.fleet.urls,
                    "spec_urls": self.spec.fleet.urls,
                    "baseline_server": base.get("summary", {}),
                    "spec_server": spec.get("summary", {}),
                    "launch": {s.role: [" ".join(p.argv()) for p in s.processes] for s in (self.baseline, self.spec)},
                },
            )
        return self._fingerprint

    def server_logs(self) -> list[tuple[str, str]]:
        """(server name, log path) of every process the gate launched, for the report."""
        return [(p.name, str(p.log_path)) for s in (self.baseline, self.spec) for p in s.processes if p.log_path]

    def close(self) -> None:
        self.baseline.close()
        self.spec.close()

    def on_speculative_side(self) -> "ServerEngine":
        """This engine with its speculative session in the baseline's place, so an adapter's own
        :meth:`score` (which scores on ``self.baseline``) scores on the speculative server: its scoring
        pass runs the target alone, and the calibration compares it with the baseline's rows to
        measure the noise between the two server instances (:mod:`specparity.judge.noise`)."""
        view = copy.copy(self)
        view.baseline = self.spec
        return view


def _refuse_differences(facts: list[tuple[str, Endpoint, dict[str, Any]]], what: str, advice: str) -> None:
    """Raise :class:`ServerError` when a field both endpoints report differs from the first endpoint's."""
    if not facts:
        return
    ref_role, ref, ref_facts = facts[0]
    for role, e, seen in facts[1:]:
        diff = sorted(k for k in set(seen) & set(ref_facts)
                      if seen[k] not in (None, "") and ref_facts[k] not in (None, "") and seen[k] != ref_facts[k])
        if diff:
            differences = "; ".join(f"{k} {ref_facts[k]!r} vs {seen[k]!r}" for k in diff)
            raise ServerError(f"the {ref_role} server {ref.base_url} and the {role} server {e.base_url} do not "
                              f"{what}: {differences}{advice}")
