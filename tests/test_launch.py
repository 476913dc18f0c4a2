"""Launchers: typed fields -> argv (every llama.cpp preset), and the ServerProcess lifecycle.

The lifecycle tests use a small Python HTTP server in a child process (no model): readiness waits
on ``/health`` with a deadline while watching the process, a server that dies during start-up fails
at once with its log, and ``stop()`` kills the whole process group (a grandchild included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from specparity.engines.base import EngineOptions
from specparity.engines.server.launch import LaunchError, ServerProcess, health_ok
from specparity.engines.server.llamacpp_launch import LlamaServerLaunch, launch_configs
from specparity.engines.server.presets import PRESETS, fill, get_preset

TOY_SERVER = r'''
import http.server, os, subprocess, sys, time
delay, fail = float(sys.argv[1]), sys.argv[2] == "fail"
port = int(sys.argv[sys.argv.index("--port") + 1])
print("toy server starting", flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["CHILD_PID_FILE"], "w").write(str(child.pid))
if fail:
    print("fatal: cannot load model", flush=True)
    sys.exit(3)
t0 = time.time()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ready = time.time() - t0 > delay
        self.send_response(200 if ready else 503)
        self.end_headers()
        self.wfile.write(b'{"status":"ok"}' if ready else b'{"error":"Loading model"}')
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def toy(tmp_path: Path, *, delay: float = 0.5, fail: bool = False, timeout: float = 20.0) -> ServerProcess:
    script = tmp_path / "toy.py"
    script.write_text(TOY_SERVER)
    return ServerProcess("toy", [sys.executable, str(script)], [str(delay), "fail" if fail else "ok"],
                         log_dir=str(tmp_path), startup_timeout_s=timeout,
                         env={"CHILD_PID_FILE": str(tmp_path / "child.pid")})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_process_waits_for_health_binds_localhost_and_kills_its_group(tmp_path):
    proc = toy(tmp_path, delay=0.6)
    t0 = time.monotonic()
    with proc:
        assert time.monotonic() - t0 >= 0.5  # waited through the 503s
        assert proc.url.startswith("http://127.0.0.1:") and proc.alive()
        assert proc.argv()[-4:] == ["--host", "127.0.0.1", "--port", str(proc.port)]
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(child)
    assert not proc.alive()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the server's own child outlived stop(): the process group was not killed"
    log = proc.log_path.read_text()
    assert log.startswith("$ ") and "toy server starting" in log


def test_process_that_dies_during_startup_fails_at_once_with_its_log(tmp_path):
    proc = toy(tmp_path, fail=True, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)toy exited with code 3 during start-up.*fatal: cannot load model"):
        proc.start()
    assert time.monotonic() - t0 < 10
    assert not proc.alive()
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "a server that died during start-up left its children running"


def test_a_server_that_logs_an_error_and_kills_itself_is_named_by_the_error(tmp_path):
    """A launcher that kills its own process tree when a child fails (SGLang's) dies of SIGKILL: the
    error it logged is the cause, not a guess about the signal."""
    script = tmp_path / "selfkill.py"
    script.write_text("import os, signal, sys\n"
                      "print('Traceback (most recent call last):', flush=True)\n"
                      "print('ValueError: Loaded weights leave no GPU memory for the KV cache', flush=True)\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = ServerProcess("sglang-spec", [sys.executable, str(script)], [], log_dir=str(tmp_path), startup_timeout_s=30)
    with pytest.raises(LaunchError) as info:
        proc.start()
    first = str(info.value).splitlines()[0]
    assert first.startswith("sglang-spec was killed by SIGKILL during start-up after logging ValueError: Loaded "
                            "weights leave no GPU memory for the KV cache; log "), first
    assert "out-of-memory killer" not in first


def test_a_vllm_start_up_failure_is_named_by_the_engine_cores_error_not_the_wrapper(tmp_path):
    """vLLM's front end ends its log with a wrapper (``RuntimeError: ... See root cause above``) after a
    traceback longer than the log tail shown; the error worth naming is the engine core's, logged with
    vLLM's process tag and logger prefix (the shape of a live vLLM 0.26.0 log whose KV cache did not fit)."""
    cause = ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
             "when initializing the engine.")
    lines = ["(EngineCore pid=2568) INFO 12-02 19:01:44 [gpu_worker.py:560] Available KV cache memory: -0.59 GiB",
             "(EngineCore pid=2568) ERROR 12-02 19:01:44 [core.py:1330] Traceback (most recent call last):",
             f"(EngineCore pid=2568) ERROR 12-02 19:01:44 [core.py:1330] {cause}",
             f"(EngineCore pid=2568) {cause}",
             "(APIServer pid=2448) Traceback (most recent call last):"]
    lines += [f'(APIServer pid=2448)   File "vllm/v1/engine/core_client.py", line {n}, in __init__' for n in range(60)]
    lines.append("(APIServer pid=2448) RuntimeError: Engine core initialization failed. See root cause above. "
                 "Failed core proc(s): {}")
    script = tmp_path / "vllm_dies.py"
    script.write_text(f"import sys\nprint({chr(10).join(lines)!r}, flush=True)\nsys.exit(1)\n")
    proc = ServerProcess("vllm-spec", [sys.executable, str(script)], [], log_dir=str(tmp_path), startup_timeout_s=30)
    with pytest.raises(LaunchError) as info:
        proc.start()
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"vllm-spec exited with code 1 during start-up after logging {cause}; log "), first


def test_process_not_ready_in_time(tmp_path):
    proc = toy(tmp_path, delay=60, timeout=1.0)
    with pytest.raises(LaunchError, match=r"not ready after 1 s \(GET /health: HTTP 503"):
        proc.start()
    assert not proc.alive()


def test_parallel_start_spawns_both_servers_before_waiting_for_either(tmp_path):
    """--engine-opt parallel_start: the speculative server is already running while the baseline is still
    answering 503; a failing start stops both."""
    from specparity.engines.base import EngineOptions
    from specparity.engines.server.engine import open_sessions

    (tmp_path / "b").mkdir(), (tmp_path / "s").mkdir()
    base, spec = toy(tmp_path / "b", delay=1.0), toy(tmp_path / "s", delay=0.2)
    seen = []

    def base_ready(endpoint):
        seen.append(spec.alive())
        return health_ok(endpoint)

    base.ready = base_ready
    sessions = open_sessions(EngineOptions(extra={"parallel_start": True}), (base, spec))
    try:
        assert seen and seen[0] is True, "the speculative server was not spawned before the baseline was waited for"
        assert base.alive() and spec.alive()
    finally:
        for session in sessions:
            session.close()
    assert not base.alive() and not spec.alive()
    (tmp_path / "b2").mkdir(), (tmp_path / "s2").mkdir()
    base, spec = toy(tmp_path / "b2", delay=0.2), toy(tmp_path / "s2", fail=True, timeout=60)
    with pytest.raises(LaunchError, match="exited with code 3"):
        open_sessions(EngineOptions(extra={"parallel_start": True}), (base, spec))
    assert not base.alive() and not spec.alive()


SUPERVISED = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_DFL)  # whatever the test runner left: the default, as under a CI runner
from specparity.engines.server.launch import ServerProcess
from specparity.run import signals
if sys.argv[1] == "handled":
    signals.install()
proc = ServerProcess("toy", [sys.executable, sys.argv[2]], ["0.1", "ok"], log_dir=sys.argv[3],
                     env={"CHILD_PID_FILE": sys.argv[4]})
proc.start()
print(proc.process.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["handled", "default"])
def test_sigterm_stops_the_servers_a_run_launched(tmp_path, mode):
    """SIGTERM (a CI timeout, kill) ends a run as Ctrl-C does: the launched server's whole process group
    is stopped. With SIGTERM's default disposition (the control case) the server outlives the run."""
    toy(tmp_path)  # writes toy.py
    driver = tmp_path / "supervised.py"
    driver.write_text(SUPERVISED)
    child_file = tmp_path / "child.pid"
    run = subprocess.Popen([sys.executable, str(driver), mode, str(tmp_path / "toy.py"), str(tmp_path),
                            str(child_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = int(run.stdout.readline().strip() or 0)
    assert server, run.stderr.read()
    grandchild = int(child_file.read_text())
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=30)
    deadline = time.monotonic() + 10
    while (_alive(server) or _alive(grandchild)) and time.monotonic() < deadline and mode == "handled":
        time.sleep(0.05)
    try:
        if mode == "handled":
            assert not _alive(server) and not _alive(grandchild), "SIGTERM left the launched server running"
        else:
            assert _alive(server), "the control case no longer shows the leak: nothing is tested"
    finally:
        for pid in (server, grandchild):
            if _alive(pid):
                os.killpg(os.getpgid(pid), signal.SIGKILL) if pid == server else os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ llama.cpp argv


def test_llama_server_argv_fields():
    launch = LlamaServerLaunch("/bin/llama-server", "t.gguf", draft="d.gguf", spec_type="draft-simple",
                               draft_n_max=4, ctx_size=2048, parallel=2, threads=1, gpu_layers=99, cache_type="q8_0",
                               extra=("--metrics",))
    assert launch.args() == ["-m", "t.gguf", "--threads", "1", "-c", "2048", "--parallel", "2", "--no-webui",
                             "-md", "d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "4",
                             "-ngl", "99", "-ngld", "99", "-ctk", "q8_0", "-ctv", "q8_0", "--metrics"]
    ngram = LlamaServerLaunch("b", "t.gguf", spec_type="ngram-map-k", ngram_size_n=3, ngram_size_m=8)
    assert ngram.args()[-6:] == ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                                 "--spec-ngram-map-k-size-m", "8"]
    assert LlamaServerLaunch("b", "t.gguf").args() == ["-m", "t.gguf", "--threads", "1", "-c", "4096", "--parallel",
                                                       "1", "--no-webui"]
    with pytest.raises(ValueError, match="needs a draft model"):
        LlamaServerLaunch("b", "t.gguf", spec_type="draft-dflash").args()
    with pytest.raises(ValueError, match="expected one of"):
        LlamaServerLaunch("b", "t.gguf", spec_type="medusa").args()


EXPECTED_SPEC_ARGS = {
    "llamacpp-draft-simple": ["-md", "D.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "4"],
    "llamacpp-ngram-simple": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                              "--spec-ngram-simple-size-m", "8"],
    "llamacpp-ngram-map-k": ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                             "--spec-ngram-map-k-size-m", "8"],
    "llamacpp-draft-dflash": ["-md", "D.gguf", "--spec-type", "draft-dflash", "--spec-draft-n-max", "7"],
    "llamacpp-draft-mtp": ["--spec-type", "draft-mtp", "--spec-draft-n-max", "4"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SPEC_ARGS))
def test_every_llamacpp_preset_builds_its_argv(name):
    preset = get_preset("llamacpp", name)
    base = LlamaServerLaunch(binary="b", **fill(preset.baseline, target="T.gguf", draft="D.gguf"))
    spec = LlamaServerLaunch(binary="b", **fill(preset.spec, target="T.gguf", draft="D.gguf"))
    common = ["-m", "T.gguf", "--threads", "1", "-c", "4096", "--parallel", "1", "--no-webui"]
    assert base.args() == common, "the baseline launch must run without speculation"
    assert spec.args() == common + EXPECTED_SPEC_ARGS[name]


def test_every_preset_is_covered():
    assert sorted(n for n, p in PRESETS.items() if p.engine == "llamacpp") == sorted(EXPECTED_SPEC_ARGS)


def test_launch_configs_apply_options_over_the_preset(tmp_path):
    for name in ("target.gguf", "draft.gguf", "x.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    opts = EngineOptions(target=str(tmp_path / "target.gguf"), draft=str(tmp_path / "draft.gguf"), threads=1,
                         extra={"binary": str(binary), "parallel": 3, "server_args": ["--metrics"]})
    base, spec = launch_configs(opts)
    assert spec.spec_type == "draft-simple" and spec.draft_n_max == 4 and spec.parallel == 3
    assert base.spec_type == "none" and base.draft is None and base.extra == ("--metrics",)
    _, spec = launch_configs(replace(opts, num_draft_tokens=6))
    assert spec.draft_n_max == 6
    _, spec = launch_configs(replace(opts, spec_mode="ngram-simple", num_draft_tokens=5))
    assert (spec.spec_type, spec.ngram_size_n, spec.ngram_size_m, spec.draft) == ("ngram-simple", 3, 5, None)
    _, spec = launch_configs(replace(opts, preset="llamacpp-draft-dflash", draft=str(tmp_path / "x.gguf")))
    assert (spec.spec_type, spec.draft_n_max, spec.draft) == ("draft-dflash", 7, str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="--draft .*nope.gguf: expected an existing .gguf file"):
        launch_configs(replace(opts, draft=str(tmp_path / "nope.gguf")))


#: A stand-in for a llama-server built for another CPU: it dies of SIGILL before it listens, as the
#: real one does on its first AMX instruction. The disposition is reset first: an inherited handler
#: (faulthandler) would turn the signal into an ordinary exit.
SIGILL_SERVER = """#!{python}
import os, signal, sys
print("loading model", flush=True)
signal.signal(signal.SIGILL, signal.SIG_DFL)
os.kill(os.getpid(), signal.SIGILL)
"""


def test_a_server_killed_by_a_signal_at_start_up_is_named_by_the_signal_and_its_cause(tmp_path):
    import signal

    fake = tmp_path / "llama-server"
    fake.write_text(SIGILL_SERVER.format(python=sys.executable))
    fake.chmod(0o755)
    model = tmp_path / "target.gguf"
    model.write_bytes(b"GGUF")
    proc = LlamaServerLaunch(str(fake), str(model)).process("llama-server-base", log_dir=str(tmp_path))
    with pytest.raises(LaunchError) as err:
        proc.start()
    message = str(err.value)
    assert message.startswith(f"llama-server-base was killed by {signal.Signals.SIGILL.name} (illegal instruction: "
                              "the binary uses CPU instructions this machine does not have"), message
    assert "exited with code" not in message and "loading model" in message, message
    assert not proc.alive()
