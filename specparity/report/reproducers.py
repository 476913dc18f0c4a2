"""Reproducers: one folder per prompt that diverged, drifted, flipped (near_tie) or errored with both
sides answering, that an engine developer can paste into an issue tracker.

``reproducers/<prompt id>/`` beside ``report.md`` holds the request the engine got, both streams as
the journal holds them, the first differing position and, to see the same divergence again:

* server engines (llama.cpp, SGLang, vLLM): the exact request bodies sent to the baseline and the
  speculative server (built by the adapter's own ``WIRE.body``, :mod:`specparity.engines.server.wire`,
  from the request and the server facts journalled on the run line), ``repro.sh`` (curl) and a
  standard-library ``repro.py`` that sends both and prints the first differing position;
* in-process and plugin engines: a ``repro.py`` that rebuilds the engine from the run's ``--engine``
  and options (``GateConfig.engine``) and decodes the request without and with speculation.

A calibration that was refused, or that found the speculative server's rows beyond the allowance for two
instances, gets ``reproducers/calibration/`` instead of (refused) or beside (found) the prompts' folders:
the two scorings behind it, where they differ most (:mod:`specparity.report.scorer_repro`).

A reproducer is a rendering of the journal: every number comes from the journalled form of a result
(``GenerationResult.to_json``, as ``results.jsonl`` holds it), so the folder written at the end
of a run and the one ``specparity report DIR`` rebuilds from ``results.jsonl`` are the same bytes. A
reproducer that cannot be written is a warning line, never an exception that costs the run its report.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specparity.engines.server.wire import WireFormat, replayed, shard_index, wire_format
from specparity.model.gate_run import GateRun, PromptRecord
from specparity.model.types import GenerationRequest, GenerationResult
from specparity.report import repro_scripts, scorer_repro

REPRODUCERS = "reproducers"
INDEX = "README.md"
#: The classes that get a reproducer (plus ``error`` when both sides answered: the comparison, not
#: a failed request, made it an error).
CLASSES = ("near_tie", "drifted", "diverged")
#: Seconds ``repro.py`` waits for one server answer.
REQUEST_TIMEOUT_S = 600.0
#: Rows of the recorded top-k shown in a reproducer's README.
README_TOP_K = 8


@dataclass(frozen=True)
class Reproducer:
    """One written reproducer: which prompt, its class, its folder (relative to the report directory)
    and how it reproduces (``server``, ``in-process`` or ``recorded only``)."""

    prompt_id: str
    klass: str
    folder: str
    how: str

    @property
    def readme(self) -> str:
        return f"{self.folder}/{INDEX}"


@dataclass
class Reproducers:
    """What :func:`write_reproducers` wrote, and a line for each one it could not write."""

    written: list[Reproducer] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def link(self, prompt_id: str) -> str | None:
        """The relative link to ``prompt_id``'s reproducer README (None: none written)."""
        return next((r.readme for r in self.written if r.prompt_id == prompt_id), None)

    def links(self) -> dict[str, str]:
        return {r.prompt_id: r.readme for r in self.written}


def wanted(rec: PromptRecord) -> bool:
    """Whether ``rec`` gets a reproducer: a judged prompt whose request is known and whose class is
    near_tie / drifted / diverged, or error with both sides answering (not one failed request)."""
    v, base, spec = rec.verdict, rec.baseline, rec.spec
    if v is None or rec.request is None or base is None or spec is None:
        return False
    return v.klass in CLASSES or (v.klass == "error" and not base.error and not spec.error)


def folder_names(ids: list[str]) -> dict[str, str]:
    """A safe, distinct folder name per prompt id (letters, digits, ``-_.``; others become ``_``)."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for pid in ids:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in pid).strip(".") or "prompt"
        base, n = name, 2
        while name in taken:
            name, n = f"{base}-{n}", n + 1
        taken.add(name)
        out[pid] = name
    return out


def request_of(rec: PromptRecord, run: GateRun) -> GenerationRequest:
    """The request the engine got for ``rec``, from what the journal holds (prompt ids, token limit,
    the run's stop ids and ``--top-k``, the prompt's constraint)."""
    req = rec.request
    assert req is not None
    return GenerationRequest(rec.prompt.id, [int(t) for t in req.prompt_ids], int(req.max_new_tokens),
                             tuple(int(t) for t in req.stop_token_ids), int(run.config.top_k),
                             constraint=rec.prompt.constraint)


def request_json(req: GenerationRequest) -> dict[str, Any]:
    c = req.constraint
    return {"request_id": req.request_id, "prompt_ids": list(req.prompt_ids), "max_new_tokens": req.max_new_tokens,
            "stop_token_ids": list(req.stop_token_ids), "top_k": req.top_k,
            "constraint": {"kind": c.kind, "text": c.text} if c is not None else None}


def stream_json(result: GenerationResult) -> dict[str, Any]:
    """A result as the journal holds it, without the timing (which differs between runs)."""
    data = result.to_json()
    return {k: data[k] for k in ("output_ids", "text", "finish_reason", "scores", "error")}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two streams differ, or where the shorter ended (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def recorded_line(rec: PromptRecord, position: int | None) -> str:
    """What the gate recorded, in one line (the scripts print it next to what they see)."""
    v = rec.verdict
    assert v is not None
    where = f"first differing output position {position}" if position is not None else "identical token ids"
    if position is None and v.drift is not None and v.drift.start is not None:
        where += f", latent drift from position {v.drift.start}"
    return f"{v.klass}: {where}"


# ---------------------------------------------------------------------------------------------- per engine kind


@dataclass(frozen=True)
class ServerSides:
    """Where each side's request went and the bodies it was sent."""

    wire: WireFormat
    urls: tuple[str, str]
    bodies: tuple[dict[str, Any], dict[str, Any]]


def side_servers(run: GateRun, engine: str, req: GenerationRequest) -> tuple[WireFormat, tuple[tuple[str, dict], ...]] | None:
    """The adapter's wire format and, per side (baseline, speculative), the URL of the server that side sent
    ``req`` to (the run's own sharding) with the facts its bodies are built from, as journalled; None when
    ``engine`` is no built-in server engine. Raises ValueError naming what the journal lacks."""
    wire = wire_format(engine)
    if wire is None:
        return None
    extra = run.fingerprint.extra if run.fingerprint is not None else {}
    recorded = run.wire
    if "part_of" in recorded:  # a merged run (specparity merge): the servers of the prompt's own shard
        recorded = recorded["parts"][recorded["part_of"].get(req.request_id, 0)]
    out = []
    for role in ("baseline", "spec"):
        servers = recorded.get(role) or [{"url": u, "facts": {}} for u in extra.get(f"{role}_urls") or []]
        if not servers:
            raise ValueError(f"the journal records no {role} server URL")
        server = servers[shard_index(req.request_id, len(servers))]
        if server.get("facts") is None:
            raise ValueError(f"the {role} server {server['url']} could not say what its requests need: "
                             f"{server.get('error', 'not recorded')}")
        out.append((str(server["url"]), dict(server["facts"])))
    return wire, tuple(out)


def server_sides(run: GateRun, engine: str, req: GenerationRequest) -> ServerSides | None:
    """The server each side sent ``req`` to and the exact bodies, rebuilt by the adapter's ``WIRE.body``
    from the journalled facts (:func:`side_servers`); None when ``engine`` is no built-in server engine."""
    found = side_servers(run, engine, req)
    if found is None:
        return None
    wire, servers = found
    bodies = [replayed(wire, role, wire.body, req, facts) for role, (_, facts) in zip(("baseline", "spec"), servers)]
    return ServerSides(wire, (servers[0][0], servers[1][0]), (bodies[0], bodies[1]))


# ---------------------------------------------------------------------------------------------- files


def _write(folder: Path, name: str, text: str, executable: bool = False) -> None:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    if executable:
        path.chmod(0o755)


def _topk_table(base: dict[str, Any], spec: dict[str, Any], pos: int) -> list[str]:
    """The recorded top-k of both sides at ``pos``, as a markdown table."""
    rows = []
    for side in (base, spec):
        s = side["scores"]
        rows.append(list(zip(s["top_ids"][pos], s["top_logprobs"][pos])) if pos < len(s["top_ids"]) else [])
    lines = ["| rank | baseline id | baseline logprob | speculative id | speculative logprob |", "|---:|---:|---:|---:|---:|"]
    for rank in range(min(README_TOP_K, max(len(rows[0]), len(rows[1])))):
        cells = []
        for row in rows:
            tid, lp = row[rank] if rank < len(row) else (None, None)
            cells += ["-" if tid is None or tid < 0 else str(tid), "-" if lp is None or tid is None or tid < 0 else f"{lp:.6f}"]
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    return lines


def _readme(rec: PromptRecord, run: GateRun, req: GenerationRequest, streams: dict[str, Any], position: int | None,
            how: str, files: list[str], sides: ServerSides | None) -> str:
    v = rec.verdict
    assert v is not None
    fp = run.fingerprint
    lines = [f"# Reproducer: `{rec.prompt.id}` ({v.klass})", "", v.reason, ""]
    if rec.replay is not None:
        lines += [f"How often it comes back: {rec.replay.describe()}.", ""]
    if fp is not None:
        lines.append(f"- Engine: `{fp.engine}` {fp.engine_version}, dtype `{fp.dtype}`, spec config "
                     f"`{json.dumps(fp.spec_config, sort_keys=True)}`")
        lines.append(f"- Target: `{fp.target.path}`" + (f"; draft: `{fp.draft.path}`" if fp.draft else ""))
    constraint = f"; constraint: {req.constraint.describe()}" if req.constraint is not None else ""
    lines.append(f"- Request: {len(req.prompt_ids)} prompt tokens, greedy, max_new_tokens {req.max_new_tokens}, "
                 f"stop ids {list(req.stop_token_ids)}, top-k {req.top_k}{constraint}")
    base, spec = streams["baseline"], streams["spec"]
    lines.append(f"- Output: baseline {len(base['output_ids'])} tokens ({base['finish_reason']}), speculative "
                 f"{len(spec['output_ids'])} tokens ({spec['finish_reason']})")
    d = v.divergence
    if position is not None:
        token = ""
        if d is not None and d.position == position:
            b = f"{d.baseline_token.id} {json.dumps(d.baseline_token.text, ensure_ascii=False)}" if d.baseline_token else "(ended)"
            s = f"{d.spec_token.id} {json.dumps(d.spec_token.text, ensure_ascii=False)}" if d.spec_token else "(ended)"
            token = f": baseline {b}, speculative {s}"
        lines.append(f"- First differing output position: **{position}**{token}")
    else:
        lines.append("- First differing output position: none, the token ids are identical"
                     + (f" (latent drift from position {v.drift.start})" if v.drift and v.drift.start is not None else ""))
    lines += ["", "## Run it", ""]
    if how == "server" and sides is not None:
        lines += [f"Against the servers the run used (baseline `{sides.urls[0]}`, speculative `{sides.urls[1]}`; "
                  "`BASELINE_URL` / `SPEC_URL` override them):", "",
                  "    python3 repro.py    # standard library only: the first differing position and both top-k there",
                  "    sh repro.sh         # the same two requests with curl, answers printed as they come", "",
                  f"`baseline.request.json` and `spec.request.json` are the bodies of `POST {sides.wire.path}`, as sent."]
        launched = {role: argvs for role, argvs in ((fp.extra.get("launch") or {}) if fp is not None else {}).items()
                    if argvs}
        if launched:
            lines += ["", "The gate launched these servers itself and stopped them after the run; start them again "
                      "as it did and point `BASELINE_URL` / `SPEC_URL` at them:", ""]
            lines += [f"    # {role}\n    {argv}" for role, argvs in launched.items() for argv in argvs]
            lines.append("")
        if sides.wire.per_request:
            fields = ", ".join(f"`{f}`" for f in sides.wire.per_request)
            lines.append(f"The run's bodies also carried {fields}, set afresh for every request; these leave it out.")
    elif how == "in-process":
        lines += ["Rebuilds the engine with the run's `--engine` and options (`engine.json`) and decodes the request "
                  "without and with speculation (specparity and the engine's dependencies installed, the models at "
                  "the recorded paths):", "", "    python3 repro.py"]
    else:
        lines += ["The journal does not say how to rebuild this engine; `request.json` and `streams.json` hold what "
                  "it was sent and what it answered."]
    if position is not None:
        lines += ["", f"## Recorded top-k at position {position}", "", *_topk_table(base, spec, position)]
    lines += ["", "## Files", ""] + [f"- `{name}`" for name in files]
    return "\n".join(lines) + "\n"


def render_one(rec: PromptRecord, run: GateRun) -> tuple[str, dict[str, tuple[str, bool]]]:
    """``rec``'s reproducer: how it reproduces, and its files (name -> (text, executable)). Built
    whole before anything is written, so a reproducer that cannot be built leaves no half folder."""
    assert rec.verdict is not None and rec.baseline is not None and rec.spec is not None
    req = request_of(rec, run)
    streams = {"baseline": stream_json(rec.baseline), "spec": stream_json(rec.spec)}
    position = first_difference(streams["baseline"]["output_ids"], streams["spec"]["output_ids"])
    recorded = recorded_line(rec, position)
    title = f"Reproducer for prompt {rec.prompt.id}: {recorded}."
    files: dict[str, tuple[str, bool]] = {
        "request.json": (repro_scripts.json_file(request_json(req)), False),
        "streams.json": (repro_scripts.json_file({**streams, "verdict": {"class": rec.verdict.klass, "reason": rec.verdict.reason,
                                                       "first_difference": position}}), False),
    }
    sides = server_sides(run, run.fingerprint.engine, req) if run.fingerprint is not None else None
    how = "recorded only"
    if sides is not None:
        how = "server"
        files["baseline.request.json"] = (repro_scripts.json_file(sides.bodies[0]), False)
        files["spec.request.json"] = (repro_scripts.json_file(sides.bodies[1]), False)
        files["repro.sh"] = (repro_scripts.curl_script(title=title, path=sides.wire.path, urls=sides.urls,
                                                       bodies=sides.bodies), True)
        files["repro.py"] = (repro_scripts.server_script(
            title=title, engine=run.fingerprint.engine, path=sides.wire.path, urls=sides.urls, bodies=sides.bodies,
            recorded=recorded, timeout_s=REQUEST_TIMEOUT_S), True)
    elif run.config.engine:
        how = "in-process"
        files["engine.json"] = (repro_scripts.json_file(run.config.engine), False)
        files["repro.py"] = (repro_scripts.inprocess_script(title=title, engine=run.config.engine,
                                                            request=request_json(req), recorded=recorded), True)
    readme = _readme(rec, run, req, streams, position, how, ["README.md", *files], sides)
    return how, {"README.md": (readme, False), **files}


def write_one(rec: PromptRecord, run: GateRun, folder: Path) -> str:
    """Write ``rec``'s reproducer into ``folder`` (removed again if a write fails); returns how it reproduces."""
    how, files = render_one(rec, run)
    write_folder(folder, files)
    return how


def write_folder(folder: Path, files: dict[str, tuple[str, bool]]) -> None:
    """Write a reproducer's ``files`` (name -> (text, executable)) into ``folder``, removed again if a write fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, (text, executable) in files.items():
            _write(folder, name, text, executable)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def planned(run: GateRun) -> Reproducers:
    """The reproducers :func:`write_reproducers` writes for ``run`` when every one can be written,
    without writing anything: what a report rendered on its own (``render_summary_md(run, decision)``)
    links. A refused calibration gets one, of the measurement (:mod:`specparity.report.scorer_repro`),
    instead of one per unjudged prompt."""
    out = Reproducers()
    engine = run.fingerprint.engine if run.fingerprint is not None else ""
    wire, found = wire_format(engine), scorer_repro.problem(run)
    spot = scorer_repro.find_spot(run) if found and wire is not None and wire.score is not None else None
    calibration = ([Reproducer(spot.prompt_id, "calibration", f"{REPRODUCERS}/{scorer_repro.FOLDER}", "server")]
                   if spot is not None else [])
    if run.calibration_error:
        out.written += calibration
        return out
    records = [r for r in run.records if wanted(r)]
    names = folder_names([r.prompt.id for r in records])
    how = "server" if wire is not None else "in-process" if run.config.engine else "recorded only"
    for rec in records:
        assert rec.verdict is not None
        out.written.append(Reproducer(rec.prompt.id, rec.verdict.klass, f"{REPRODUCERS}/{names[rec.prompt.id]}", how))
    out.written += calibration
    return out


def write_calibration(run: GateRun, folder: Path) -> str:
    """Write the calibration problem's reproducer into ``folder`` (removed again if a write fails)."""
    found = scorer_repro.problem(run)
    assert found is not None and run.fingerprint is not None
    spot = scorer_repro.find_spot(run)
    assert spot is not None
    req = request_of(spot.record, run)
    servers = side_servers(run, run.fingerprint.engine, req)
    assert servers is not None
    write_folder(folder, scorer_repro.render(run, found, spot, req, servers[0], servers[1], REQUEST_TIMEOUT_S))
    return "server"


def write_reproducers(run: GateRun, report_dir: str | Path) -> Reproducers:
    """Replace ``report_dir/reproducers/`` with one folder per wanted prompt and an index; never
    raises: what cannot be written is a warning line (the report still renders)."""
    out = Reproducers()
    root = Path(report_dir) / REPRODUCERS
    try:
        if root.exists():
            shutil.rmtree(root)
    except OSError as exc:
        out.warnings.append(f"reproducers: could not clear {root} ({exc}); none written")
        return out
    for plan in planned(run).written:
        try:
            folder = Path(report_dir) / plan.folder
            how = (write_calibration(run, folder) if plan.klass == "calibration"
                   else write_one(run.record(plan.prompt_id), run, folder))
        except Exception as exc:  # noqa: BLE001 - one reproducer must never cost the run its report
            out.warnings.append(f"reproducer for {plan.prompt_id} not written: {type(exc).__name__}: {exc}")
            continue
        out.written.append(Reproducer(plan.prompt_id, plan.klass, plan.folder, how))
    if out.written or out.warnings:
        try:
            _write(root, INDEX, _index(out))
        except OSError as exc:
            out.warnings.append(f"reproducers: index not written ({exc})")
    return out


def _index(found: Reproducers) -> str:
    lines = ["# Reproducers", "", "One folder per prompt that diverged, drifted, flipped (near_tie) or errored with "
             "both sides answering: the request, both streams, the first differing position and a script that "
             "shows it again (`repro.py`).", "", "| prompt | class | reproduces |", "|---|---|---|"]
    lines += [f"| [`{r.prompt_id}`]({r.folder.split('/', 1)[1]}/{INDEX}) | {r.klass} | {r.how} |" for r in found.written]
    if any(r.klass == "calibration" for r in found.written):
        lines += ["", "The `calibration` folder is the measurement behind a refused calibration or a cross-instance "
                  "finding: the two scorings whose rows differ most (`repro.py` prints both rows there)."]
    if found.warnings:
        lines += ["", "Not written:", ""] + [f"- {w}" for w in found.warnings]
    return "\n".join(lines) + "\n"
