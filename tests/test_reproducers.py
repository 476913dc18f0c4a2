"""Reproducers (``reproducers/<prompt id>/`` in the report directory): one per failing or flipped
prompt, none for exact ones; their scripts show the divergence the verdict names again, against the
same fake servers or a rebuilt in-process engine; ``specparity report DIR`` rebuilds them byte for
byte from the journal; a journal that lacks what a reproducer needs still renders, with a warning."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import SGLangServer, VLLMServer
from fakes.backend import TARGET
from fakes.gate import run_lossless
from inprocess import run_cli
from specparity.engines.server.wire import wire_format
from specparity.model.locations import REPO_ROOT
from specparity.report.reproducers import REPRODUCERS, folder_names

#: The prompts both gate runs decode: one category (several prompts, so exact ones sit beside the
#: failing ones), 16 new tokens.
CATEGORY = "math"
MAX_NEW = "16"
POSITION = re.compile(r"^first differing output position: (\d+)$", re.M)
#: A broken loop that emits an unverified draft token: it diverges wherever a block is partly accepted.
BUG = "accept_unverified"


def prompt_lines(report: Path) -> dict[str, dict]:
    return {r["prompt"]["id"]: r for r in map(json.loads, (report / "results.jsonl").read_text().splitlines())
            if r["kind"] == "prompt"}


def failing(lines: dict[str, dict]) -> dict[str, int | None]:
    """Prompt id -> the first differing position the verdict names, for every prompt that gets a reproducer."""
    out = {}
    for pid, line in lines.items():
        v = line["verdict"]
        if v["class"] in ("near_tie", "drifted", "diverged") or (
                v["class"] == "error" and line["baseline"] and line["spec"]
                and not line["baseline"]["error"] and not line["spec"]["error"]):
            out[pid] = (v.get("divergence") or {}).get("position")
    return out


def folders(report: Path) -> dict[str, Path]:
    """Prompt id -> its reproducer folder, read from each folder's request.json."""
    root = report / REPRODUCERS
    if not root.is_dir():
        return {}
    return {json.loads((d / "request.json").read_text())["request_id"]: d for d in root.iterdir() if d.is_dir()}


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def child(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """A child process as a user starts it: default signal dispositions (SIGPIPE too, for a shell pipe)."""
    def defaults() -> None:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=defaults)


def script_env() -> dict[str, str]:
    """The environment a reproducer script runs in: a user's, without this checkout on the path and
    without server overrides (so it talks to the URLs it recorded)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BASELINE_URL", "SPEC_URL")}


def heredocs(script: str) -> list[dict]:
    """The JSON bodies a ``repro.sh`` sends (each between ``<<'JSON'`` and ``JSON``)."""
    return [json.loads(m) for m in re.findall(r"<<'JSON'\n(.*?)\nJSON\n", script, re.S)]


def generation_bodies(server, path: str) -> list[dict]:
    return [body for method, p, body in server.requests if method == "POST" and p == path]


def without_rid(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "rid"}


def rebuilt_identically(report: Path, tmp_path: Path) -> None:
    """``specparity report DIR`` rewrites the reproducers from the journal: the same bytes."""
    rebuilt_identically_code(report, tmp_path, 1)  # the run failed; rebuilding says so again


def rebuilt_identically_code(report: Path, tmp_path: Path, code: int) -> None:
    """:func:`rebuilt_identically`, the report command exiting ``code`` (the run's own)."""
    before = tree(report / REPRODUCERS)
    saved = tmp_path / "before"
    shutil.copytree(report / REPRODUCERS, saved)
    shutil.rmtree(report / REPRODUCERS)
    got, out = run_cli("report", report)
    assert got == code, out[-3000:]
    assert tree(report / REPRODUCERS) == before
    assert before


# ---------------------------------------------------------------------------------------------- servers


SERVERS = {
    "sglang": (SGLangServer, ("--target", str(TARGET))),
    "vllm": (VLLMServer, ("--engine-opt", f"tokenizer={TARGET}")),
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(SERVERS))
def test_server_reproducer_shows_the_divergence_again(engine, tmp_path):
    """The speculative fake flips its first answer at the closest call (a margin of several nats:
    diverged). The report holds a reproducer for that prompt only; its bodies are the ones the run
    sent (rid aside), its repro.sh sends the same, and its repro.py, run as a child against the same
    servers with the fault armed again, prints the position the verdict names."""
    server, extra = SERVERS[engine]
    path = wire_format(engine).path
    with server() as base, server(speculative=True, near_tie_flips=1) as spec:
        report = tmp_path / "report"
        proc, _ = run_lossless(engine, base.url, spec.url, report, *extra, in_process=True)
        assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
        lines = prompt_lines(report)
        wanted = failing(lines)
        assert len(wanted) == 1 and len(lines) > 1, wanted  # one flipped answer among several prompts
        found = folders(report)
        assert set(found) == set(wanted)
        (pid, position), = wanted.items()
        assert position is not None
        folder = found[pid]
        assert folder.name == folder_names([pid])[pid]

        # the bodies: what the run sent for this prompt, and what repro.sh sends
        request = json.loads((folder / "request.json").read_text())
        bodies = [json.loads((folder / f"{side}.request.json").read_text()) for side in ("baseline", "spec")]
        for server_, body in zip((base, spec), bodies):
            sent = [b for b in generation_bodies(server_, path)
                    if without_rid(b) == without_rid(body)]
            assert sent, f"{server_.url} never received the reproducer's body"
        assert request["max_new_tokens"] == int(MAX_NEW)
        script = (folder / "repro.sh").read_text()
        assert heredocs(script) == bodies
        assert f"BASELINE_URL:-{base.url}" in script and f"SPEC_URL:-{spec.url}" in script

        # repro.py: standard library only, against the same servers, the fault armed again
        spec.near_tie_flips = 1
        env = script_env()
        before = len(generation_bodies(spec, path))
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr
        assert [int(p) for p in POSITION.findall(done.stdout)] == [position], done.stdout
        assert "top-k at position" in done.stdout and "speculative:" in done.stdout
        assert generation_bodies(spec, path)[before:] == [bodies[1]]  # exactly the recorded body

        # and without the fault the same request is identical on both sides
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
        assert done.returncode == 0 and "identical" in done.stdout, done.stdout + done.stderr

        if shutil.which("curl"):
            before = len(generation_bodies(base, path))
            done = child(["sh", str(folder / "repro.sh")], env=env, timeout=120)
            assert done.returncode == 0, done.stderr
            assert generation_bodies(base, path)[before:] == [bodies[0]]

    summary = (report / "summary.md").read_text()
    assert f"- Reproducers: 1 in `{REPRODUCERS}/README.md`" in summary
    link = f"{REPRODUCERS}/{folder.name}/README.md"
    assert f"]({link})" in (report / "report.md").read_text()
    assert f'href="{link}"' in (report / "report.html").read_text()
    rebuilt_identically(report, tmp_path)


def test_old_journal_without_request_facts_still_renders(tmp_path):
    """A vLLM journal from before the run line carried the servers' request facts: the reproducer
    cannot rebuild the body, so it is a warning line in the summary, and every report still renders."""
    with VLLMServer() as base, VLLMServer(speculative=True, near_tie_flips=1) as spec:
        report = tmp_path / "report"
        proc, _ = run_lossless("vllm", base.url, spec.url, report, *SERVERS["vllm"][1], in_process=True)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    wanted = failing(prompt_lines(report))
    journal = report / "results.jsonl"
    rows = [json.loads(line) for line in journal.read_text().splitlines()]
    for row in rows:
        row.pop("wire", None)
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = run_cli("report", report)
    assert code == 1, out[-3000:]
    summary = (report / "summary.md").read_text()
    for pid in wanted:
        assert f"- Reproducer: reproducer for {pid} not written: ValueError: the journal lacks the baseline " \
               f"server's 'top_k'" in summary
    assert folders(report) == {}
    assert (report / "report.html").read_text().startswith("<!doctype html>")
    assert "rendering this report failed" not in (report / "report.html").read_text()

    # a server that could not say what its requests need when the run started: the error it gave
    run_line = rows[0]
    assert run_line["kind"] == "run"
    run_line["wire"] = {role: [{"url": url, "facts": None, "error": "ServerError: /v1/models answered 500"}]
                        for role, url in (("baseline", base.url), ("spec", spec.url))}
    journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out = run_cli("report", report)
    assert code == 1, out[-3000:]
    summary = (report / "summary.md").read_text()
    for pid in wanted:
        assert f"- Reproducer: reproducer for {pid} not written: ValueError: the baseline server {base.url} could " \
               f"not say what its requests need: ServerError: /v1/models answered 500" in summary
    assert folders(report) == {} and "Reproducers:" not in summary


# ---------------------------------------------------------------------------------------------- in-process


@pytest.fixture(scope="module")
def loop_report(tmp_path_factory) -> Path:
    report = tmp_path_factory.mktemp("loop") / "report"
    code, out = run_cli("run", "--engine", "tests/broken_loops.py:create", "--engine-opt", f"bug={BUG}",
                        "--categories", CATEGORY, "--max-new-tokens", MAX_NEW, "--calibration", "selected",
                        "--report", report)
    assert code == 1, out[-4000:]
    assert f"report: {report / REPRODUCERS / 'README.md'}" in out.splitlines()  # the index, among the files
    return report


@pytest.mark.slow  # the child imports torch and loads both models again
def test_inprocess_reproducer_shows_the_divergence_again(loop_report, tmp_path):
    """The broken loop's run leaves a reproducer per failing prompt, none for exact ones; the first
    one's repro.py, run as a child from another directory, rebuilds the plugin engine with the run's
    options and prints the position the verdict names."""
    lines = prompt_lines(loop_report)
    wanted = failing(lines)
    assert wanted and len(wanted) < len(lines), wanted  # failing and exact prompts side by side
    found = folders(loop_report)
    assert set(found) == set(wanted)
    pid = next(iter(wanted))
    folder = found[pid]
    engine = json.loads((folder / "engine.json").read_text())
    assert engine["spec"] == f"{REPO_ROOT / 'tests' / 'broken_loops.py'}:create"
    assert engine["options"]["extra"] == {"bug": BUG}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, str(folder / "repro.py")], capture_output=True, text=True, timeout=300,
                          env=env, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert [int(p) for p in POSITION.findall(done.stdout)] == [wanted[pid]], done.stdout
    assert f"the gate recorded: {lines[pid]['verdict']['class']}: first differing output position {wanted[pid]}" \
        in done.stdout
    readme = (folder / "README.md").read_text()
    assert f"First differing output position: **{wanted[pid]}**" in readme
    link = f"{REPRODUCERS}/{folder.name}/README.md"
    assert f"]({link})" in (loop_report / "summary.md").read_text()


def test_report_rebuilds_inprocess_reproducers_identically(loop_report, tmp_path):
    rebuilt_identically(loop_report, tmp_path)


def test_a_new_run_in_the_directory_clears_old_reproducers(loop_report, tmp_path):
    """Reproducers are derived files: the next run in the same directory removes them before it
    writes anything, so a folder never names a failure of another run."""
    report = tmp_path / "report"
    shutil.copytree(loop_report, report)
    assert folders(report)
    code, out = run_cli("run", "--engine", "tests/broken_loops.py:create", "--categories", CATEGORY,
                        "--max-new-tokens", MAX_NEW, "--calibration", "selected", "--report", report)
    assert code == 0, out[-4000:]
    assert not (report / REPRODUCERS).exists()
    assert "Reproducer" not in (report / "summary.md").read_text()


def test_llamacpp_reproducer_sends_the_bodies_the_run_sent(tmp_path):
    """llama.cpp, against the replaying fake (whose answers never diverge): one prompt's journalled
    speculative stream is altered so the report writes a reproducer for it. Its repro.py speaks the
    llama-server protocol: it sends the bodies the run sent and reports the live
    answers identical (exit 0)."""
    from fakes import LlamaCppServer
    from specparity.engines.base import EngineOptions
    from specparity.engines.server import llamacpp
    from specparity.model.prompts import load_prompts
    from specparity.model.gate_run import GateConfig
    from specparity.run.runner import conclude, run_gate

    math = [p for p in load_prompts(REPO_ROOT / "prompts" / "default.jsonl").prompts if p.category == CATEGORY]
    report = tmp_path / "report"
    with LlamaCppServer() as base, LlamaCppServer(speculative=True) as spec:
        engine = llamacpp.create(EngineOptions(baseline_urls=(base.url,), spec_urls=(spec.url,),
                                               extra={"tokenizer": str(TARGET)}))
        try:
            run = run_gate(engine, math, GateConfig(max_new_tokens=int(MAX_NEW), report_dir=str(report),
                                                    categories=[CATEGORY]))
        finally:
            engine.close()
        assert conclude(run).passed and not (report / REPRODUCERS).exists()
        path = wire_format("llamacpp").path
        journal = report / "results.jsonl"
        rows = [json.loads(line) for line in journal.read_text().splitlines()]
        line = next(r for r in rows if r["kind"] == "prompt")
        pid, ids = line["prompt"]["id"], line["spec"]["output_ids"]
        ids[-1] += 1
        line["verdict"]["class"] = "diverged"
        journal.write_text("".join(json.dumps(r) + "\n" for r in rows))
        code, out = run_cli("report", report)
        assert code == 1, out[-3000:]
        assert set(folders(report)) == {pid}
        folder = folders(report)[pid]
        bodies = [json.loads((folder / f"{side}.request.json").read_text()) for side in ("baseline", "spec")]
        assert bodies[0] == bodies[1]  # llama.cpp: the same body on both sides
        sent = [b for b in generation_bodies(spec, path) if b == bodies[1]]
        assert len(sent) == 1, "the run sent the speculative server another body for this prompt"
        env = script_env()
        before = [len(generation_bodies(s, path)) for s in (base, spec)]
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
        assert done.returncode == 0 and "identical" in done.stdout, done.stdout + done.stderr
        assert f"the gate recorded: diverged: first differing output position {len(ids) - 1}" in done.stdout
        assert [generation_bodies(s, path)[n:] for s, n in zip((base, spec), before)] == [[bodies[0]], [bodies[1]]]


def test_the_scripts_comparison_names_the_split_and_the_drift():
    """The comparison every repro.py ends with, on hand-made streams: a token that differs, a stream
    that ends early (the split is where it ended), identical streams with the chosen token's logprob
    apart on one position (where latent drift shows)."""
    from specparity.report.repro_scripts import COMPARE

    scope: dict = {"json": json, "RECORDED": "recorded"}
    exec(COMPARE, scope)  # noqa: S102 - the script text under test
    first, drift = scope["first_difference"], scope["largest_drift"]
    assert first([1, 2, 3], [1, 4, 3]) == 1
    assert first([1, 2, 3], [1, 2]) == 2 and first([1, 2], [1, 2, 3]) == 2
    assert first([1, 2], [1, 2]) is None
    base = [[(1, -0.1, None)], [(2, -0.5, None), (7, -1.0, None)], None]
    spec = [[(1, -0.1, None)], [(7, -0.8, None), (2, -0.9, None)], [(3, -0.2, None)]]
    assert drift([1, 2, 3], base, spec) == (1, pytest.approx(0.4))
    assert drift([1, 2, 3], [None] * 3, spec) is None


@pytest.mark.slow
def test_constrained_prompt_reproducer_sends_the_constraint(tmp_path):
    """A grammar-constrained prompt on vLLM fakes whose speculative server loses the grammar state
    after its first verify step: the reproducer's bodies carry the grammar on both sides, and its
    repro.py (the bug is deterministic) prints the position the verdict names. The threshold is given
    (``--near-tie-nats``): rows a constraint chose are not calibrated on, so one constrained prompt leaves
    no noise to measure."""
    grammar = 'root ::= "{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"Berlin\\"}}"'
    prompts = tmp_path / "one.jsonl"
    prompts.write_text('{"specparity_prompts": 1, "description": "one grammar prompt"}\n' + json.dumps(
        {"id": "tool-literal", "category": "structured", "lang": "en", "max_new_tokens": 48, "grammar": grammar,
         "messages": [{"role": "user", "content": "Call the weather tool for Berlin."}]}) + "\n")
    with VLLMServer() as base, VLLMServer(speculative=True, grammar_rollback_bug=True) as spec:
        report = tmp_path / "report"
        proc = run_lossless("vllm", base.url, spec.url, report, *SERVERS["vllm"][1], "--prompts", str(prompts),
                            "--categories", "structured", "--max-new-tokens", "48", "--near-tie-nats", "0.01",
                            in_process=True)[0]
        assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
        wanted = failing(prompt_lines(report))
        assert set(wanted) == {"tool-literal"} and wanted["tool-literal"] is not None
        folder = folders(report)["tool-literal"]
        request = json.loads((folder / "request.json").read_text())
        assert request["constraint"] == {"kind": "grammar", "text": grammar}
        for side in ("baseline", "spec"):
            body = json.loads((folder / f"{side}.request.json").read_text())
            assert body["structured_outputs"] == {"grammar": grammar}
        env = script_env()
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert [int(p) for p in POSITION.findall(done.stdout)] == [wanted["tool-literal"]], done.stdout


def test_reproducers_that_cannot_be_written_cost_nothing_else(loop_report, tmp_path):
    """A file where the reproducers' folder belongs: rebuilding the reports writes none, says why in
    one summary line, and every report is still written with the verdicts."""
    report = tmp_path / "report"
    shutil.copytree(loop_report, report)
    shutil.rmtree(report / REPRODUCERS)
    (report / REPRODUCERS).write_text("in the way\n")
    for name in ("summary.md", "report.md", "report.html"):
        (report / name).unlink()
    code, out = run_cli("report", report)
    assert code == 1, out[-3000:]
    summary = (report / "summary.md").read_text()
    assert f"- Reproducer: reproducers: could not clear {report / REPRODUCERS} (" in summary
    assert "- Reproducers:" not in summary and "Reproducer: [" not in summary
    for pid in failing(prompt_lines(report)):
        assert f"`{pid}`" in summary and pid in (report / "report.md").read_text()
    assert "rendering this report failed" not in (report / "report.html").read_text()


# ---------------------------------------------------------------------------------------------- refused calibration


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(SERVERS))
def test_a_calibration_finding_leaves_a_reproducer_of_the_measurement(engine, tmp_path):
    """The speculative fake's teacher-forced rows are 3 nats off at every pair (its decode rows and every
    argmax right): the gate judges the prompts (every one exact) but finds the speculative server's rows
    beyond the allowance for two instances. ``reproducers/calibration/`` holds the two scoring bodies the
    run sent, and a repro.py that, run as a child against the same servers, prints the margin difference
    the journal recorded there and exits 1; without the skew it exits 0."""
    server, extra = SERVERS[engine]
    path = wire_format(engine).path
    with server() as base, server(speculative=True, scoring_skew_nats=3.0) as spec:
        report = tmp_path / "report"
        proc, records = run_lossless(engine, base.url, spec.url, report, *extra, in_process=True)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        threshold = next(r for r in records if r["kind"] == "threshold")
        assert threshold["cross_instance_finding"], threshold
        root = report / REPRODUCERS
        assert sorted(p.name for p in root.iterdir()) == ["README.md", "calibration"]  # every prompt exact
        folder = root / "calibration"
        spot = json.loads((folder / "request.json").read_text())
        assert spot["between"] == "cross" and abs(spot["delta_nats"] - 3.0) < 1e-3
        bodies = [json.loads((folder / f"request{i}.json").read_text()) for i in (1, 2)]
        for server_, body in zip((base, spec), bodies):
            assert any(without_rid(b) == body for b in generation_bodies(server_, path)), server_.url
        assert bodies[0].get("input_ids", bodies[0].get("prompt")) == spot["prompt_ids"] + spot["continuation_ids"]
        assert heredocs((folder / "repro.sh").read_text()) == bodies

        env = script_env()
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
        assert done.returncode == 1, done.stdout + done.stderr
        shown = re.search(r"largest \|margin difference\|: (\S+) nats", done.stdout)
        assert shown and abs(float(shown.group(1)) - spot["delta_nats"]) < 1e-3, done.stdout
        assert f"top-k at output position {spot['position']}" in done.stdout

        spec.scoring_skew_nats = 0.0
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        shown = re.search(r"largest \|margin difference\|: (\S+) nats", done.stdout)
        assert shown and float(shown.group(1)) < 1e-3, done.stdout

    assert "reproducers/calibration/README.md" in (report / REPRODUCERS / "README.md").read_text().replace("](", "](reproducers/")
    rebuilt_identically_code(report, tmp_path, 0)


@pytest.mark.slow
def test_a_refused_calibration_leaves_only_the_reproducer_of_the_measurement(tmp_path):
    """The baseline server's teacher-forced rows are 3 nats off its decode rows: the noise within its own
    instance is above the ceiling, the gate refuses to calibrate and judges nothing. No prompt gets a
    folder (each would show two identical streams); ``reproducers/calibration/`` does, and its repro.py
    shows the difference against the same servers (exit 1)."""
    with SGLangServer(scoring_skew_nats=3.0) as base, SGLangServer(speculative=True) as spec:
        report = tmp_path / "report"
        proc, records = run_lossless("sglang", base.url, spec.url, report, "--target", str(TARGET), in_process=True)
        assert proc.returncode != 0 and any(r["kind"] == "calibration_refused" for r in records)
        root = report / REPRODUCERS
        assert sorted(p.name for p in root.iterdir()) == ["README.md", "calibration"]
        folder = root / "calibration"
        assert json.loads((folder / "request.json").read_text())["delta_nats"] > 2.0
        env = script_env()
        done = child([sys.executable, "-I", str(folder / "repro.py")], env=env, timeout=120)
        assert done.returncode == 1 and "near-tie ceiling" in done.stdout, done.stdout + done.stderr
    assert "calibration/README.md" in (report / "summary.md").read_text()
