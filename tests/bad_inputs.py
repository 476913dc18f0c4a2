"""Every bad input we know users try, with the one line it must produce.

One list serves ``tests/test_bad_input.py`` (checks each: exit 4, one line on stderr, naming the
option or ``file:line``) and ``tools/bad_input_table.py`` (writes the bad-input table of
``docs/ERRORS.md`` from real runs of the same commands). ``{tmp}`` in an argument is a scratch
directory holding the files ``make`` writes.

A case runs either as the real command (:func:`run_process`) or in this process up to the point
where the command refuses it (:func:`run_in_process`): for ``pytest …``, pytest's own option
parsing, plugin and conftest loading and every ``pytest_configure`` hook (where specparity checks
its options, before any collection or model load), ending where ``pytest.main`` would print
``ERROR: <message>`` and exit with ``ExitCode.USAGE_ERROR``; for ``specparity …``, ``cli.main``
itself. A process costs an interpreter and torch import per case; the in-process run checks the same
line and code, and a few cases still run as processes to prove the wiring around them.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]
HEADER = '{"specparity_prompts": 1, "description": "bad input"}\n'
GOOD = '{"id": "x-1", "category": "x", "lang": "en", "prompt": "hello"}\n'


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # after the command
    expect: str  # a fragment of the one line
    command: str = "pytest"  # "pytest" (pytest suites/lossless …) or "specparity"
    make: Callable[[Path], None] | None = None

    def full_argv(self, tmp: Path) -> list[str]:
        args = [a.replace("{tmp}", str(tmp)) for a in self.argv]
        if self.command == "pytest":
            return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        return [str(Path(sys.executable).with_name("specparity")), *args]

    def shown(self) -> str:
        return ("pytest " if self.command == "pytest" else "specparity ") + " ".join(self.argv).replace("{tmp}/", "")


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return make


def _both(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        for m in makers:
            m(tmp)
    return make


LOOPS = "tests/broken_loops.py:create"
FIXTURE_TARGET = "fixtures/models/target"

CASES: tuple[Case, ...] = (
    Case("engine-opt-typo", ("suites/lossless", "--engine", LOOPS, "--engine-opt", "bugs=short_crop"),
         "--engine-opt bugs: unknown key for engine 'hf-loop' (it knows: attn_implementation, bug, kv_scales, stop_token_ids, "
         "tie_rule)"),
    Case("engine-opt-bad-value", ("suites/lossless", "--engine", LOOPS, "--engine-opt", "bug=nosuch"),
         "--engine-opt bug='nosuch': expected one of accept_unverified"),
    Case("engine-opt-no-equals", ("suites/lossless", "--engine-opt", "attn_implementation"),
         "--engine-opt 'attn_implementation': expected KEY=VALUE"),
    Case("engine-opt-builtin-typo", ("suites/lossless", "--engine", "hf", "--engine-opt", "attn=eager"),
         "--engine-opt attn: unknown key for engine 'hf'"),
    Case("num-draft-tokens-0", ("suites/lossless", "--engine", "hf", "--num-draft-tokens", "0"),
         "--num-draft-tokens 0: expected an integer >= 1"),
    Case("num-draft-tokens-negative", ("suites/lossless", "--engine", "hf", "--num-draft-tokens", "-3"),
         "--num-draft-tokens -3: expected an integer >= 1"),
    Case("num-draft-tokens-text", ("suites/lossless", "--num-draft-tokens", "four"),
         "--num-draft-tokens 'four': expected an integer >= 1"),
    Case("target-missing", ("suites/lossless", "--target", "/nonexistent/dir"),
         "--target /nonexistent/dir: no such directory (expected a local model directory with config.json; "
         "specparity never downloads models)"),
    Case("target-hub-id", ("suites/lossless", "--target", "nosuch/model"),
         "--target nosuch/model: no such directory"),
    Case("target-file", ("suites/lossless", "--target", "README.md"), "--target README.md: not a directory"),
    Case("target-no-config", ("suites/lossless", "--target", "{tmp}/empty"),
         "no config.json in this directory", make=lambda tmp: (tmp / "empty").mkdir()),
    Case("draft-missing", ("suites/lossless", "--draft", "/nonexistent/draft"), "--draft /nonexistent/draft: no such directory"),
    Case("near-tie-negative", ("suites/lossless", "--near-tie-nats", "-1"), "--near-tie-nats -1: expected a number >= 0"),
    Case("near-tie-nan", ("suites/lossless", "--near-tie-nats", "nan"), "--near-tie-nats nan: expected a number >= 0"),
    Case("max-near-tie", ("suites/lossless", "--max-near-tie", "2"), "--max-near-tie 2: expected a number in [0, 1]"),
    Case("bit-exact-and-allow-near-tie", ("suites/lossless", "--bit-exact", "--allow-near-tie"),
         "--bit-exact and --allow-near-tie: give one or neither"),
    Case("near-tie-above-ceiling", ("suites/lossless", "--near-tie-nats", "3"),
         "--near-tie-nats 3: above the near-tie ceiling 2 nats (a flip that wide is not numeric noise); to accept it "
         "on purpose, also pass --near-tie-ceiling 3 or more"),
    Case("near-tie-ceiling-0", ("suites/lossless", "--near-tie-ceiling", "0"), "--near-tie-ceiling 0: expected a number >= 1e-06"),
    Case("calibration-unknown", ("suites/lossless", "--calibration", "all"),
         "--calibration 'all': expected suite, selected or a prompt file (JSONL)"),
    Case("calibration-bad-file", ("suites/lossless", "--calibration", "{tmp}/cal.jsonl"),
         "cal.jsonl:3: <line>: invalid JSON", make=_write("cal.jsonl", HEADER + GOOD + '{"id": \n')),
    Case("drift-policy", ("suites/lossless", "--drift-policy", "ignore"), "--drift-policy 'ignore': expected one of fail, warn"),
    Case("require-all-paths-swallows-path", ("--require-all-paths", "suites/lossless"),
         "--require-all-paths 'suites/lossless': expected an integer >= 0 (write --require-all-paths=N"),
    Case("max-new-tokens-0", ("suites/lossless", "--max-new-tokens", "0"), "--max-new-tokens 0: expected an integer >= 1"),
    Case("top-k", ("suites/lossless", "--top-k", "3"), "--top-k 3: expected an integer >= 5"),
    Case("threads-negative", ("suites/lossless", "--threads", "-1"), "--threads -1: expected an integer >= 1"),
    Case("report-unwritable", ("suites/lossless", "--report", "/proc/nope"),
         "--report /proc/nope: cannot create or write the report directory"),
    Case("engine-unknown", ("suites/lossless", "--engine", "nosuch"),
         "--engine 'nosuch': expected one of dflash, hf, llamacpp, sglang, vllm or 'module:factory' / "
         "'path/to/file.py:factory'"),
    Case("engine-probe-syntax", ("suites/lossless", "--engine", "sglang==0.5.19"),
         "for the probes' name==version use --probe-engine"),
    Case("engine-file-missing", ("suites/lossless", "--engine", "mine.py:create"),
         "--engine 'mine.py:create': file mine.py not found"),
    Case("engine-no-factory", ("suites/lossless", "--engine", "tests/broken_loops.py:nope"),
         "has no callable 'nope'"),
    Case("engine-module-missing", ("suites/lossless", "--engine", "nosuchpkg.engine:create"),
         "--engine 'nosuchpkg.engine:create': cannot import module 'nosuchpkg.engine'"),
    Case("spec-mode", ("suites/lossless", "--spec-mode", "eagle"), "--spec-mode 'eagle': engine 'dflash' supports dflash2, dflash1"),
    Case("dtype", ("suites/lossless", "--dtype", "int8"), "--dtype 'int8': engine 'dflash' supports float32, bfloat16, float16"),
    Case("categories", ("suites/lossless", "--categories", "maths"), "--categories: unknown maths; the prompt files have"),
    Case("prompts-missing", ("suites/lossless", "--prompts", "{tmp}/nope.jsonl"), "nope.jsonl: file not found"),
    Case("prompts-not-utf8", ("suites/lossless", "--prompts", "{tmp}/latin1.jsonl"),
         "latin1.jsonl:2: <line>: expected UTF-8 text (invalid continuation byte: byte 0xe9 at column 60)",
         make=_write("latin1.jsonl", HEADER.encode() + b'{"id": "x-1", "category": "x", "lang": "fr", "prompt": "caf\xe9 au lait"}\n')),
    Case("prompts-bad-json", ("suites/lossless", "--prompts", "{tmp}/broken.jsonl"),
         "broken.jsonl:3: <line>: invalid JSON", make=_write("broken.jsonl", HEADER + GOOD + '{"id": "x-2",\n')),
    Case("prompts-unknown-field", ("suites/lossless", "--prompts", "{tmp}/typo.jsonl"),
         "typo.jsonl:2: max_tokens: unknown field",
         make=_write("typo.jsonl", HEADER + GOOD.replace('"prompt"', '"max_tokens": 9, "prompt"'))),
    Case("prompts-duplicate-id", ("suites/lossless", "--prompts", "{tmp}/a.jsonl", "--prompts", "{tmp}/b.jsonl"),
         "b.jsonl:2: id: duplicate id 'x-1'", make=_both(_write("a.jsonl", HEADER + GOOD), _write("b.jsonl", HEADER + GOOD))),
    Case("prompts-json-schema-invalid", ("suites/lossless", "--prompts", "{tmp}/schema.jsonl"),
         "schema.jsonl:2: json_schema: not a valid JSON Schema",
         make=_write("schema.jsonl", HEADER + GOOD.replace('"prompt"', '"json_schema": {"type": "objekt"}, "prompt"'))),
    Case("prompts-grammar-no-root", ("suites/lossless", "--prompts", "{tmp}/gbnf.jsonl"),
         "gbnf.jsonl:2: grammar: expected a GBNF grammar with a 'root ::= ...' rule",
         make=_write("gbnf.jsonl", HEADER + GOOD.replace('"prompt"', '"grammar": "answer ::= [0-9]+", "prompt"'))),
    Case("prompts-two-constraints", ("suites/lossless", "--prompts", "{tmp}/both.jsonl"),
         "both.jsonl:2: json_schema/grammar: expected at most one of 'json_schema' or 'grammar'",
         make=_write("both.jsonl", HEADER + GOOD.replace(
             '"prompt"', '"json_schema": {"type": "object"}, "grammar": "root ::= \\"{}\\"", "prompt"'))),
    Case("structured-in-process-engine", ("suites/lossless", "--prompts", "prompts/structured.jsonl"),
         "prompts/structured.jsonl:2: json_schema: engine 'dflash' cannot constrain decoding (it applies no "
         "constraint; json_schema runs on llamacpp, sglang, vllm)"),
    Case("probes-without-engine", ("suites/probes", "--target", FIXTURE_TARGET),
         "suites/probes needs --probe-engine name==version"),
    Case("xdist-each", ("-n", "2", "--dist", "each", "suites/lossless"),
         "--dist each would run the whole gate on every worker"),
    Case("cli-lossless-engine", ("lossless", "--engine", "nosuch"), "--engine 'nosuch'", command="specparity"),
    Case("cli-probe-live-engine", ("probe", "--target", FIXTURE_TARGET, "--engine", "sglang==0.5.19", "--live-engine", "nosuch"),
         "--live-engine 'nosuch': expected one of dflash, hf", command="specparity"),
    Case("server-url-without-engine", ("suites/lossless", "--baseline-url", "http://127.0.0.1:8000"),
         "--baseline-url: needs --engine llamacpp, sglang or vllm"),
    Case("server-url-in-process", ("suites/lossless", "--engine", "hf", "--preset", "llamacpp-draft-simple"),
         "--preset: engine 'hf' runs in-process"),
    Case("server-one-url", ("suites/lossless", "--engine", "llamacpp", "--baseline-url", "http://127.0.0.1:8000"),
         "--spec-url: the llamacpp engine needs both --baseline-url and --spec-url"),
    Case("server-bad-url", ("suites/lossless", "--engine", "llamacpp", "--baseline-url", "localhost:8000",
                            "--spec-url", "http://127.0.0.1:8001"), "--baseline-url 'localhost:8000': expected http://host:port"),
    Case("server-preset-unknown", ("suites/lossless", "--engine", "llamacpp", "--preset", "nosuch"),
         "--preset 'nosuch': not a preset of engine 'llamacpp' (known: llamacpp-draft-dflash"),
    Case("server-binary-missing", ("suites/lossless", "--engine", "llamacpp", "--engine-opt", "binary=/nope/llama-server"),
         "--engine-opt binary=/nope/llama-server: not an executable llama-server"),
    Case("server-target-not-gguf", ("suites/lossless", "--engine", "llamacpp", "--engine-opt", "binary=/bin/true",
                                     "--target", FIXTURE_TARGET),
         "--target fixtures/models/target: expected an existing .gguf file"),
    Case("server-dtype", ("suites/lossless", "--engine", "llamacpp", "--dtype", "bfloat16"),
         "--dtype 'bfloat16': engine 'llamacpp' runs the dtype its server was launched with"),
    Case("sglang-no-server", ("suites/lossless", "--engine", "sglang"),
         "--baseline-url: the sglang engine needs --baseline-url and --spec-url (running servers) or --preset NAME"),
    Case("vllm-no-tokenizer", ("suites/lossless", "--engine", "vllm", "--baseline-url", "http://127.0.0.1:1",
                               "--spec-url", "http://127.0.0.1:2"), "--engine-opt tokenizer: the vllm engine sends token ids"),
    Case("scorer-unknown", ("suites/lossless", "--scorer", "oracle"), "--scorer 'oracle': expected one of auto, engine, embedded"),
    Case("scorer-embedded-no-model", ("suites/lossless", "--scorer", "embedded"),
         "--scorer embedded: needs --scorer-model HF_DIR"),
    Case("concurrency-0", ("suites/lossless", "--concurrency", "0"), "--concurrency 0: expected an integer >= 1"),
    Case("request-timeout-0", ("suites/lossless", "--engine", "llamacpp", "--request-timeout", "0"),
         "--request-timeout 0: expected a number >= 1"),
    Case("kv-cache-dtype-unknown", ("suites/lossless", "--kv-cache-dtype", "fp9"),
         "--kv-cache-dtype 'fp9': expected one of auto, fp8_e4m3"),
    Case("kv-cache-dtype-server", ("suites/lossless", "--engine", "llamacpp", "--kv-cache-dtype", "fp8_e4m3"),
         "--kv-cache-dtype fp8_e4m3: engine 'llamacpp' runs the KV cache its server was launched with"),
    Case("device-unknown", ("suites/lossless", "--device", "tpu"), "--device 'tpu': expected cpu, cuda or cuda:N"),
    Case("device-no-cuda", ("suites/lossless", "--device", "cuda"), "--device cuda: torch sees no CUDA device"),
    Case("golden-mode-unknown", ("suites/lossless", "--golden", "{tmp}/g.jsonl", "--golden-mode", "upgrade"),
         "--golden-mode 'upgrade': expected one of spec, baseline"),
    Case("update-golden-no-golden", ("suites/lossless", "--update-golden"),
         "--update-golden: needs --golden FILE"),
    Case("golden-not-json", ("suites/lossless", "--golden", "{tmp}/g.jsonl"), "g.jsonl:1: not JSON",
         make=_write("g.jsonl", "{not json\n")),
    Case("golden-wrong-header", ("suites/lossless", "--golden", "{tmp}/g.jsonl"),
         "g.jsonl:1: specparity_golden: expected a header line with specparity_golden: 1",
         make=_write("g.jsonl", '{"specparity_golden": 2}\n')),
    Case("golden-directory", ("suites/lossless", "--golden", "{tmp}"), "a directory; expected a golden file"),
    Case("resume-no-journal", ("suites/lossless", "--resume", "--report", "{tmp}/r"),
         "--resume: {tmp}/r/results.jsonl: no journal to continue"),
    Case("resume-no-report", ("suites/lossless", "--resume", "--report", ""), "--resume: needs --report DIR"),
    Case("resume-bad-journal", ("suites/lossless", "--resume", "--report", "{tmp}/r"),
         "results.jsonl:1: expected a 'run' line of schema specparity.results/1 first",
         make=_write("r/results.jsonl", '{"kind": "baseline", "prompt_id": "x"}\n')),
    Case("policy-missing", ("suites/lossless", "--policy", "{tmp}/nope.toml"), "--policy {tmp}/nope.toml: cannot read"),
    Case("policy-not-toml", ("suites/lossless", "--policy", "{tmp}/p.toml"), "p.toml: not TOML",
         make=_write("p.toml", "[gate\n")),
    Case("policy-unknown-key", ("suites/lossless", "--policy", "{tmp}/p.toml"),
         "p.toml:3: max_near_ties: unknown key; expected one of fail_on",
         make=_write("p.toml", "[gate]\nmax_near_tie = 0.1\nmax_near_ties = 0.2\n")),
    Case("require-all-paths-request-totals", ("suites/lossless", "--engine", "llamacpp", "--baseline-url",
                                              "http://127.0.0.1:8000", "--spec-url", "http://127.0.0.1:8001",
                                              "--require-all-paths", "3"),
         "--require-all-paths 3: engine 'llamacpp' reports per-request totals only, and this rule needs "
         "per-verify-step records"),
    Case("policy-paths-aggregate", ("suites/lossless", "--engine", "vllm", "--baseline-url", "http://127.0.0.1:8000",
                                    "--spec-url", "http://127.0.0.1:8001", "--engine-opt", f"tokenizer={FIXTURE_TARGET}",
                                    "--policy", "{tmp}/p.toml"),
         "p.toml:2: require_all_paths 2: engine 'vllm' reports run-wide aggregate counters only",
         make=_write("p.toml", "[gate]\nrequire_all_paths = 2\n")),
    Case("policy-allow-unknown-typo", ("suites/lossless", "--policy", "{tmp}/p.toml"),
         "p.toml:2: allow_unknown: expected a list of probe names among lm-head",
         make=_write("p.toml", '[gate]\nallow_unknown = ["lm_head"]\n')),
    Case("policy-fail-on-without-diverged", ("suites/lossless", "--policy", "{tmp}/p.toml"),
         "p.toml:2: fail_on: expected a list that includes diverged and error",
         make=_write("p.toml", '[gate]\nfail_on = ["error"]\n')),
    Case("policy-bad-floor", ("suites/lossless", "--policy", "{tmp}/p.toml"),
         "p.toml:2: min_accept_length: expected a number >= 0",
         make=_write("p.toml", '[gate]\nmin_accept_length = "high"\n')),
    Case("cli-probe-engine-syntax", ("probe", "--target", FIXTURE_TARGET, "--engine", "sglang-0.5.19"),
         "expected name==version", command="specparity"),
    Case("cli-probe-target-missing", ("probe", "--target", "/nonexistent", "--engine", "sglang==0.5.19"),
         "/nonexistent", command="specparity"),
    Case("force-reject-unknown-mode", ("suites/lossless", "--force-reject", "always"),
         "--force-reject 'always': expected one of all, random"),
    Case("force-reject-sglang", ("suites/lossless", "--engine", "sglang", "--force-reject", "all"),
         "--force-reject all: engine 'sglang': it cannot force rejects"),
    Case("force-reject-llamacpp-random", ("suites/lossless", "--engine", "llamacpp", "--force-reject", "random"),
         "--force-reject random: engine 'llamacpp': it can force only all"),
    Case("force-reject-llamacpp-urls", ("suites/lossless", "--engine", "llamacpp", "--baseline-url",
                                        "http://127.0.0.1:8000", "--spec-url", "http://127.0.0.1:8001",
                                        "--force-reject", "all"),
         "--force-reject all with --spec-url: the llamacpp engine forces rejects only on a server it launches"),
    Case("force-reject-plugin-without-support", ("suites/lossless", "--engine", "tests/broken_dflash.py:create",
                                            "--force-reject", "all"),
         "--force-reject all: engine 'dflash-loop': it cannot force rejects"),
    Case("force-reject-all-require-paths", ("suites/lossless", "--force-reject", "all", "--require-all-paths", "1"),
         "--force-reject all with --require-all-paths: every draft is rejected"),
    Case("shard-out-of-range", ("suites/lossless", "--shard", "3/2"), "--shard 3/2: expected I/N with 0 <= I < N"),
    Case("shard-not-a-fraction", ("run", "--shard", "2"), "--shard 2: expected I/N with 0 <= I < N",
         command="specparity"),
    Case("shard-update-golden", ("suites/lossless", "--shard", "0/2", "--golden", "{tmp}/g.jsonl", "--update-golden"),
         "--shard 0/2 with --update-golden: a golden records every prompt"),
    Case("ray-in-process-engine", ("run", "--ray", "auto"), "--ray: engine 'dflash' runs in this process",
         command="specparity"),
    Case("ray-pairs-without-ray", ("run", "--ray-pairs", "2"), "--ray-pairs: needs --ray ADDRESS", command="specparity"),
    Case("merge-not-a-shard", ("merge", "{tmp}"), "no results.jsonl there", command="specparity"),
)


#: Cases that also run as the real command, a process: a pytest suite's bad engine option (a plugin
#: engine file, imported to read its declaration), a prompt file refused by file:line, and the console
#: script's ``specparity lossless`` (pytest inside the CLI: only a process runs it, :func:`in_process`).
END_TO_END = ("engine-opt-typo", "prompts-bad-json", "cli-lossless-engine")


# --------------------------------------------------------------------------- running a case


@dataclass(frozen=True)
class Outcome:
    """What a case ended with: the exit code and what it printed."""

    code: int
    stdout: str
    stderr: str


def _args(case: Case, tmp: Path) -> list[str]:
    if case.make:
        case.make(tmp)
    return [a.replace("{tmp}", str(tmp)) for a in case.argv]


def run_process(case: Case, tmp: Path) -> Outcome:
    """The command a user types, as a process in the checkout."""
    _args(case, tmp)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(case.full_argv(tmp), cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


def in_process(case: Case) -> bool:
    """``specparity lossless`` is ``pytest.main`` inside ``cli.main``: a second pytest session in
    this process would share its plugins and imported test modules, so it only runs as a process."""
    return not (case.command == "specparity" and case.argv[:1] == ("lossless",))


def run_in_process(case: Case, tmp: Path) -> Outcome:
    """The case in this process (see the module docstring), from the checkout as the process would
    be; the working directory, ``sys.path`` and the environment are put back afterwards."""
    args = _args(case, tmp)
    if not in_process(case):
        raise ValueError(f"{case.id}: runs only as a process")
    cwd, path, environ = os.getcwd(), list(sys.path), dict(os.environ)
    os.chdir(REPO)
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        if case.command == "pytest":
            return _pytest_configure(["-q", "-p", "no:cacheprovider", *args])
        from specparity.cli import commands as cli

        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(args)
        return Outcome(code, out.getvalue(), err.getvalue())
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)


def _pytest_configure(args: list[str]) -> Outcome:
    """``pytest ARGS`` up to and including ``pytest_configure``, without a session.

    ``_prepareconfig`` and ``Config._do_configure`` are what ``pytest.main`` calls before it
    collects anything (pytest's own ``pytester.parseconfigure`` is these two calls, but it also
    unloads every module imported meanwhile, torch included, which cannot be imported twice). A
    ``UsageError`` from either is what ``pytest.main`` prints, one ``ERROR: <arg>`` line per
    argument, and turns into ``ExitCode.USAGE_ERROR``. Options that pass make exit code 0 here: the
    real command would go on to collect and run.
    """
    from _pytest.config import _prepareconfig

    def refused(exc: pytest.UsageError) -> Outcome:
        return Outcome(int(pytest.ExitCode.USAGE_ERROR), "", "".join(f"ERROR: {msg}\n" for msg in exc.args))

    try:
        config = _prepareconfig(args)
    except pytest.UsageError as exc:
        return refused(exc)
    try:
        config._do_configure()
    except pytest.UsageError as exc:
        return refused(exc)
    finally:
        config._ensure_unconfigure()
    return Outcome(int(pytest.ExitCode.OK), "", "")
