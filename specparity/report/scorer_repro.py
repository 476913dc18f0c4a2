"""The reproducer of a calibration problem: the two scorings the gate compared where they differ most.

When the gate cannot be calibrated (a scorer that disagrees with the baseline, or noise above the
ceiling) nothing is judged, and a reproducer per prompt would only show identical streams; when the
speculative server's rows differ from the baseline server's by more than the allowance for two
instances (a calibration finding), the prompts are judged but the finding has no prompt of its own.
What an engine developer needs in both cases is the measurement itself: the baseline's tokens scored teacher-forced on the
baseline server and on the speculative one (the cross-instance rows), or the baseline server's own
decode and teacher-forced rows — at the output position where their margins differ most. The run finds
that spot (:func:`specparity.judge.calibration.widest_difference`) and journals it on its threshold or
refusal line (``GateRun.calibration_spot``), so ``specparity report DIR`` writes the same files; the
requests are rebuilt by the adapter's own wire format
(:mod:`specparity.engines.server.wire`). Engines that score one request per position (llama.cpp) or
run in-process get none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specparity.engines.server.wire import WireFormat, replayed
from specparity.model.cross_instance import COMPARISONS
from specparity.model.gate_run import GateRun, PromptRecord
from specparity.model.types import GenerationRequest
from specparity.report import repro_scripts

#: The folder under ``reproducers/`` (a prompt id is never this: folder names of prompts are their ids).
FOLDER = "calibration"


@dataclass(frozen=True)
class ScorerSpot:
    """Where two scorings of the same tokens differ most: the prompt, the output position, the largest
    |Δmargin| there (nats) and which comparison (a key of :data:`COMPARISONS`)."""

    record: PromptRecord
    position: int
    delta: float
    between: str

    @property
    def prompt_id(self) -> str:
        return self.record.prompt.id

    def describe(self) -> str:
        return (f"{self.prompt_id} output position {self.position}: |Δmargin| {self.delta:.4g} nats between "
                f"{COMPARISONS[self.between]}")


@dataclass(frozen=True)
class Problem:
    """What the calibration ran into: the figure the measurement is held against (nats), that figure's
    name, and a title."""

    limit: float
    limit_words: str
    title: str


def problem(run: GateRun) -> Problem | None:
    """A refused calibration (held against the ceiling), or a cross-instance finding (against the smallest
    allowance it exceeds; inside the allowance, against the smallest within-instance figure it is above);
    None when the calibration had neither."""
    if run.calibration_error:
        return Problem(float(run.config.near_tie_ceiling),
                       "the near-tie ceiling the gate refused to calibrate beyond", "the refused calibration")
    t = run.threshold
    if t is not None and t.cross_finding():
        beyond = [f.cap for f in t.cross_figures() if f.excess]
        if beyond:
            return Problem(float(min(beyond)), "the allowance for two server instances, which the finding exceeds",
                           "the speculative server's rows beyond the allowance")
        within = min(f.within for f in t.cross_figures() if f.above)
        return Problem(float(within), "the baseline server's own noise, which the speculative server's rows exceed",
                       "the speculative server's rows beyond the baseline's own noise")
    return None


def find_spot(run: GateRun) -> ScorerSpot | None:
    """The journalled spot of the calibration's problem (``GateRun.calibration_spot``) with its prompt's
    record; None when the run has none, or the journal lacks that prompt's request or baseline."""
    spot = run.calibration_spot
    if not spot:
        return None
    try:
        rec = run.record(str(spot.get("prompt_id")))
    except KeyError:
        return None
    if rec.request is None or rec.baseline is None or spot.get("between") not in COMPARISONS:
        return None
    return ScorerSpot(rec, int(spot["position"]), float(spot["delta_nats"]), str(spot["between"]))


def reads(spot: ScorerSpot, req: GenerationRequest, wire: WireFormat,
          servers: tuple[tuple[str, dict], ...]) -> list[dict[str, Any]]:
    """The two requests of ``spot``'s comparison: label, URL, the variable that overrides it, kind, body."""
    assert wire.score is not None and spot.record.baseline is not None
    continuation = list(spot.record.baseline.output_ids)
    (base_url, base_facts), (spec_url, spec_facts) = servers

    def score(role: str, facts: dict) -> dict[str, Any]:
        return replayed(wire, role, wire.score, list(req.prompt_ids), continuation, int(req.top_k), facts)

    first = {"label": "baseline server, teacher-forced", "url": base_url, "env": "BASELINE_URL", "kind": "score",
             "body": score("baseline", base_facts)}
    if spot.between == "cross":
        return [first, {"label": "speculative server, teacher-forced", "url": spec_url, "env": "SPEC_URL",
                        "kind": "score", "body": score("spec", spec_facts)}]
    return [{"label": "baseline server, decode", "url": base_url, "env": "BASELINE_URL", "kind": "decode",
             "body": replayed(wire, "baseline", wire.body, req, base_facts)}, first]


def _rows_table(spot: ScorerSpot) -> list[str]:
    """The recorded top-k of both compared rows at the spot, as a markdown table."""
    rec, pos = spot.record, spot.position
    assert rec.baseline is not None and rec.baseline_tf is not None
    pair = (rec.baseline_tf, rec.cross_tf) if spot.between == "cross" else (rec.baseline.scores, rec.baseline_tf)
    names = ("baseline teacher-forced", "speculative teacher-forced") if spot.between == "cross" else (
        "baseline decode", "baseline teacher-forced")
    rows = [[(int(t), float(lp)) for t, lp in zip(s.top_ids[pos], s.top_logprobs[pos]) if int(t) >= 0]
            if s is not None and pos < len(s) else [] for s in pair]
    lines = [f"| rank | {names[0]} id | logprob | {names[1]} id | logprob |", "|---:|---:|---:|---:|---:|"]
    for rank in range(max(len(rows[0]), len(rows[1]))):
        cells = []
        for row in rows:
            cells += [str(row[rank][0]), f"{row[rank][1]:.6f}"] if rank < len(row) else ["-", "-"]
        lines.append(f"| {rank} | " + " | ".join(cells) + " |")
    return lines


def render(run: GateRun, found: Problem, spot: ScorerSpot, req: GenerationRequest, wire: WireFormat,
           servers: tuple[tuple[str, dict], ...], timeout_s: float) -> dict[str, tuple[str, bool]]:
    """The folder's files (name -> (text, executable)), built whole before anything is written."""
    assert run.fingerprint is not None and spot.record.baseline is not None
    engine = run.fingerprint.engine
    requests = reads(spot, req, wire, servers)
    token = int(spot.record.baseline.output_ids[spot.position])
    recorded = f"{found.title}; the rows differ most here: {spot.describe()}"
    title = f"Reproducer of {found.title}: {spot.describe()}."
    files: dict[str, tuple[str, bool]] = {
        "request.json": (repro_scripts.json_file({"prompt_id": spot.prompt_id, "prompt_ids": list(req.prompt_ids),
                               "continuation_ids": [int(t) for t in spot.record.baseline.output_ids],
                               "position": spot.position, "token": token, "top_k": int(req.top_k),
                               "between": spot.between, "delta_nats": spot.delta}), False),
    }
    for i, read in enumerate(requests, 1):
        files[f"request{i}.json"] = (repro_scripts.json_file(read["body"]), False)
    files["repro.sh"] = (repro_scripts.scorer_curl_script(title=title, path=wire.path, reads=requests), True)
    files["repro.py"] = (repro_scripts.scorer_script(
        title=title, engine=engine, path=wire.path, reads=requests, position=spot.position, token=token,
        prompt_len=len(req.prompt_ids), limit=found.limit, limit_words=found.limit_words, recorded=recorded,
        timeout_s=timeout_s), True)
    fp = run.fingerprint
    why = run.calibration_error or (run.threshold.cross_finding() if run.threshold is not None else "") or ""
    effect = ("Every prompt of the run is `error` (not judged); this folder shows the measurement that stopped the gate."
              if run.calibration_error else "The prompts were judged; this folder shows the measurement behind the finding.")
    lines = [f"# Reproducer: {found.title}", "", why, "",
             f"The rows differ most at **{spot.describe()}**, held against {found.limit_words}: "
             f"{found.limit:.4g} nats. {effect}", "",
             f"- Engine: `{fp.engine}` {fp.engine_version}, spec config `{json.dumps(fp.spec_config, sort_keys=True)}`",
             f"- Prompt `{spot.prompt_id}`: {len(req.prompt_ids)} prompt tokens; the baseline's "
             f"{len(spot.record.baseline.output_ids)} output tokens are scored, token {token} at output position "
             f"{spot.position}", "", "## Run it", "",
             "    python3 repro.py    # standard library only: both rows at the position and their largest margin difference",
             "    sh repro.sh         # the same two requests with curl", "",
             *[f"`request{i}.json`: {r['label']} (`POST {wire.path}` to `{r['url']}`, `{r['env']}` overrides it)."
               for i, r in enumerate(requests, 1)]]
    if wire.per_request:
        lines += ["", "The run's bodies also carried " + ", ".join(f"`{f}`" for f in wire.per_request)
                  + ", set afresh for every request; these leave it out."]
    launched = {role: argvs for role, argvs in (fp.extra.get("launch") or {}).items() if argvs}
    if launched:
        lines += ["", "The gate launched these servers itself; start them again as it did:", ""]
        lines += [f"    # {role}\n    {argv}" for role, argvs in launched.items() for argv in argvs]
    lines += ["", f"## Recorded top-k at output position {spot.position}", "", *_rows_table(spot), "",
              "## Files", "", "- `README.md`"] + [f"- `{name}`" for name in files]
    return {"README.md": ("\n".join(lines) + "\n", False), **files}
