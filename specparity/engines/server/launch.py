"""Launching servers the gate starts itself, in the manner of llama.cpp's own server tests.

A :class:`ServerProcess` owns one process from argv to process-group kill: its flags come from a
typed launch config (``LlamaServerLaunch``, ``SGLangLaunch``, ``VLLMLaunch``: :class:`LaunchConfig` objects,
each turning its fields into argv, unit-tested), it binds ``127.0.0.1`` on a free port, waits for health with a
deadline while watching the process (a server that exits during start-up fails at once, with the
tail of its log), keeps the whole log in a file (which goes into the report), and always stops the
whole process group — on ``stop()``, on leaving a ``with`` block, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from specparity.engines.server.http import Endpoint, ServerError

#: Seconds a launched server has to answer ``/health`` when its launch config does not say
#: (:attr:`LaunchConfig.startup_timeout_s`; ``--engine-opt startup_timeout`` overrides both).
DEFAULT_STARTUP_TIMEOUT_S = 300.0
#: The same for a GPU server (SGLang, vLLM): loading a large checkpoint, compiling and capturing CUDA
#: graphs takes many minutes.
GPU_STARTUP_TIMEOUT_S = 1800.0

#: Every process started and not yet stopped, so an interpreter exit never leaves a server behind.
_LIVE: set["ServerProcess"] = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


#: Why a server process usually dies of a signal, for the one-line message that names it: a bare
#: "exited with code -4" sends the reader to a signal table before the real cause.
SIGNAL_CAUSES: dict[int, str] = {
    signal.SIGILL: ("illegal instruction: the binary uses CPU instructions this machine does not have, e.g. AMX or "
                    "AVX-512 from a -march=native build on another CPU"),
    signal.SIGKILL: "killed from outside, e.g. by the kernel's out-of-memory killer or a timeout",
    signal.SIGSEGV: "segmentation fault: a crash inside the server",
    signal.SIGABRT: "aborted: a failed assertion or an uncaught exception inside the server, see its log",
    signal.SIGBUS: "bus error: a truncated or changed model file mapped into memory, or a crash",
    signal.SIGFPE: "arithmetic fault inside the server",
}


def describe_exit(name: str, code: int | None, *, guess: bool = True) -> str:
    """``"<name> exited with code N"``, or for a negative Popen return code (death by a signal)
    ``"<name> was killed by SIGILL (<likely cause>)"`` (``guess`` False: without the likely cause, when
    something better is known)."""
    if code is None or code >= 0:
        return f"{name} exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"{name} was killed by signal {-code}"
    cause = SIGNAL_CAUSES.get(sig) if guess else None
    return f"{name} was killed by {sig.name}" + (f" ({cause})" if cause else "")


#: How much of a dead server's log is searched for the error it logged (a traceback printed by
#: several processes runs to hundreds of lines).
LOG_SCAN_LINES = 2000
#: How much of a dead server's log a launch error quotes.
LOG_TAIL_LINES = 20
#: A log line that names a Python exception (``ValueError: ...``, ``torch.OutOfMemoryError: ...``).
_LOGGED_ERROR = re.compile(r"^(?:[\w.]+\.)?(?:\w*Error|\w*Exception|Exception)(?:\([^)]*\))?: .+")


#: What a server puts before a logged line: vLLM's process tag (``(EngineCore pid=2568)``) and its
#: logger's level, date and source (``ERROR 12-02 19:01:44 [core.py:1330]``).
_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s*(?:[A-Z]+ \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*)?")
#: An exception that only wraps another one logged before it (vLLM's API server:
#: ``RuntimeError: Engine core initialization failed. See root cause above.``).
_POINTS_ABOVE = re.compile(r"\babove\b", re.IGNORECASE)


def logged_error(text: str) -> str | None:
    """The last exception line a server logged that names its own cause, if any: a server whose
    launcher kills its own process tree when a child fails (SGLang) dies of SIGKILL, and its signal says
    less than the error it logged; vLLM's front end ends with a wrapper that points to the engine core's
    error above it, which is the one worth reading (``ValueError: No available memory for the cache
    blocks``)."""
    found = [line for line in (_LOG_PREFIX.sub("", raw.strip()) for raw in text.splitlines())
             if _LOGGED_ERROR.match(line)]
    causes = [line for line in found if not _POINTS_ABOVE.search(line)]
    return (causes or found)[-1] if found else None


#: Run before a server's exec (``python -c``, argv: the parent's pid, then the server's argv): ask the
#: kernel for SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``, kept across exec), give up if the
#: parent is already gone, then become the server.
PARENT_DEATH_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


class LaunchError(RuntimeError):
    """A server that did not come up; the message carries the tail of its log."""


@dataclass(eq=False)
class ServerProcess:
    """One server process. ``args`` are its flags *without* host and port (added here).

    ``ready`` is the readiness check: given an :class:`Endpoint`, return None when ready, else a
    short reason (default: ``GET /health`` answers 200).
    """

    name: str
    program: Sequence[str]
    args: Sequence[str]
    host: str = "127.0.0.1"
    port: int | None = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    log_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    ready: Callable[[Endpoint], str | None] | None = None
    host_flag: str = "--host"
    port_flag: str = "--port"
    #: Die with the process that started it (Linux: a parent-death SIGKILL set before the server's exec).
    #: For a server started by a Ray actor: a lost actor must not leave its server serving, or the run
    #: would never see the pair as lost (:mod:`specparity.run.ray_fleet`).
    die_with_parent: bool = False
    process: subprocess.Popen | None = field(default=None, init=False)
    log_path: Path | None = field(default=None, init=False)

    def argv(self) -> list[str]:
        port = self.port if self.port is not None else 0
        return [*self.program, *self.args, self.host_flag, self.host, self.port_flag, str(port)]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        """Start the process and wait until it is ready; returns its base URL."""
        self.spawn()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def spawn(self) -> None:
        """Start the process without waiting for it (:meth:`wait_ready` then waits): two servers spawned
        before either is waited for start side by side."""
        if self.port is None:
            self.port = free_port(self.host)
        log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="specparity-server-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.name.replace(' ', '-')}.log"
        log = open(self.log_path, "w", encoding="utf-8")
        log.write("$ " + " ".join(self.argv()) + "\n")
        log.flush()
        argv = self.argv()
        if self.die_with_parent and sys.platform.startswith("linux"):
            argv = [sys.executable, "-c", PARENT_DEATH_EXEC, str(os.getpid()), *argv]
        try:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **self.env}, start_new_session=True)
        except OSError as exc:
            log.close()
            raise LaunchError(f"{self.name}: cannot start {self.program[0]}: {exc}") from None
        finally:
            if self.process is None:
                log.close()
        log.close()
        _LIVE.add(self)

    def wait_ready(self) -> None:
        endpoint = Endpoint(self.url, read_timeout_s=10.0, connect_timeout_s=2.0, connect_retries=0, dead_after=10**9)
        check = self.ready or health_ok
        deadline = time.monotonic() + self.startup_timeout_s
        reason = "not started"
        try:
            while time.monotonic() < deadline:
                code = self.process.poll() if self.process else -1
                if code is not None:
                    scanned = self.log_tail(LOG_SCAN_LINES)
                    tail = "\n".join(scanned.splitlines()[-LOG_TAIL_LINES:])
                    error = logged_error(scanned)
                    said = f" after logging {error}" if error else ""
                    raise LaunchError(f"{describe_exit(self.name, code, guess=not error)} during start-up{said}; "
                                      f"log {self.log_path}:\n{tail}")
                try:
                    reason = check(endpoint) or ""
                except ServerError as exc:
                    reason = str(exc)
                if not reason:
                    return
                time.sleep(0.25)
        finally:
            endpoint.close()
        raise LaunchError(f"{self.name} not ready after {self.startup_timeout_s:g} s ({reason}); log {self.log_path}:\n"
                          f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``grace_s`` — also when the
        leader already exited (its children may not have)."""
        proc, self.process = self.process, None
        _LIVE.discard(self)
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of the group is left
        if proc.poll() is None:
            proc.wait(timeout=grace_s)

    def kill(self) -> None:
        """SIGKILL the process group at once (tests use it to kill a server mid-run)."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LaunchConfig:
    """What every engine's typed launch config (``LlamaServerLaunch``, ``SGLangLaunch``,
    ``VLLMLaunch``) has alike: a program, its flags, its environment, and :meth:`process` to turn
    them into a :class:`ServerProcess`. Subclasses are dataclasses of that server's flags and set
    ``startup_timeout_s`` where their server takes longer (or less) to load than the default."""

    #: Seconds to wait for ``/health`` after the start.
    startup_timeout_s: ClassVar[float] = DEFAULT_STARTUP_TIMEOUT_S

    @property
    def program(self) -> list[str]:
        raise NotImplementedError

    def args(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Environment variables the launch itself sets (besides the GPUs the engine assigns)."""
        return {}

    def spec_config(self) -> dict[str, Any]:
        """The speculative settings of this launch, for the fingerprint."""
        raise NotImplementedError

    def validate(self) -> None:
        """Refuse flag values the server would refuse (ValueError, one line); nothing by default."""

    @classmethod
    def pair(cls, preset: str, base: dict[str, Any], spec: dict[str, Any]) -> tuple["LaunchConfig", "LaunchConfig"]:
        """A preset's baseline and speculative launch configs, both validated: an unknown field or a
        bad value is one ValueError that names the preset."""
        try:
            launches = cls(**base), cls(**spec)
            for launch in launches:
                launch.validate()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--preset {preset}: {exc}") from None
        return launches

    def process(self, name: str, *, log_dir: str | None, startup_timeout_s: float | None = None,
                env: dict[str, str] | None = None) -> ServerProcess:
        return ServerProcess(name, self.program, self.args(), log_dir=log_dir,
                             startup_timeout_s=startup_timeout_s or self.startup_timeout_s,
                             env={**self.env(), **(env or {})})


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def health_ok(endpoint: Endpoint) -> str | None:
    """Ready when ``GET /health`` answers 200 (llama.cpp, SGLang and vLLM all answer 503 or refuse
    the connection while loading)."""
    try:
        endpoint.request("GET", "/health")
    except ServerError as exc:
        return str(exc)
    return None


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop(grace_s=2.0)
