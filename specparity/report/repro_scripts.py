"""The text of a reproducer's ``repro.py`` and ``repro.sh`` (:mod:`specparity.report.reproducers`).

The scripts are meant to be pasted into an engine's issue tracker and run on another machine, so
the server ones use the standard library only (urllib, json) and carry their request bodies inline;
the in-process one imports specparity to rebuild the engine. Both end in the same comparison
(:data:`COMPARE`): the first output position where the two token streams differ (or where one
ended), with each side's top-k there, or "identical".
"""

from __future__ import annotations

import json
import shlex
from typing import Any

#: Shared by every ``repro.py``: the comparison and what it prints. ``rows[i]`` is position i's
#: top-k as ``[(token id, logprob, text or None), ...]``, or None where the engine reported no row.
COMPARE = r'''
def first_difference(a, b):
    """The first position where the streams differ, or where the shorter one ended (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def largest_drift(ids, base_rows, spec_rows):
    """(position, nats) where the two sides' logprobs of the same chosen token differ most (None:
    no position where both reported it): latent drift shows here when no token flips."""
    best = None
    for i, tid in enumerate(ids):
        own = [next((lp for t, lp, _ in (rows[i] or ()) if t == tid), None) if i < len(rows) else None
               for rows in (base_rows, spec_rows)]
        if None not in own and (best is None or abs(own[0] - own[1]) > best[1]):
            best = (i, abs(own[0] - own[1]))
    return best


def show(base_ids, base_rows, spec_ids, spec_rows):
    """Print the first differing position and both sides' top-k there; 1 when the streams differ."""
    print(f"baseline: {len(base_ids)} tokens; speculative: {len(spec_ids)} tokens")
    pos = first_difference(base_ids, spec_ids)
    if pos is None:
        print(f"identical: the same {len(base_ids)} token ids on both sides")
        drift = largest_drift(base_ids, base_rows, spec_rows)
        if drift is not None:
            print(f"largest |logprob difference| of the chosen token: {drift[1]:.6g} nats at position {drift[0]}")
        print(f"the gate recorded: {RECORDED}")
        return 0
    print(f"first differing output position: {pos}")
    sides = (("baseline", base_ids, base_rows), ("speculative", spec_ids, spec_rows))
    for name, ids, _ in sides:
        print(f"  {name:<11} token: {ids[pos] if pos < len(ids) else '(stream ended)'}")
    print(f"top-k at position {pos} (id logprob text):")
    for name, ids, rows in sides:
        row = rows[pos] if pos < len(rows) else None
        if not row:
            print(f"  {name}: no row reported")
            continue
        print(f"  {name}:")
        for rank, (tid, lp, text) in enumerate(row):
            shown = "" if text is None else " " + json.dumps(text, ensure_ascii=False)
            print(f"    {rank:>2}  {tid:>8}  {lp:>12.6f}{shown}")
    print(f"the gate recorded: {RECORDED}")
    return 1
'''

#: Shared by the server scripts: one JSON POST with the standard library.
POST = r'''

def post(url, body):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())
'''

_SCORER_MAIN = POST + r"""

def margins(own, row):
    # logprob(chosen token) - logprob(alternative), for every other token the row reports
    return {} if own is None else {tid: own - lp for tid, lp, _ in row if tid != TOKEN}


def main():
    seen = []
    for read in READS:
        url = os.environ.get(read["env"], read["url"]).rstrip("/")
        own, row = row_of(read["kind"], post(url + PATH, read["body"]), POSITION, TOKEN, PROMPT_LEN)
        seen.append((read["label"], own, row))
        print(f"{read['label']} ({read['kind']} request to {url}): chosen token {TOKEN} logprob "
              f"{'not reported' if own is None else f'{own:.6f}'}; top-k at output position {POSITION} (id logprob text):")
        for rank, (tid, lp, text) in enumerate(row):
            shown = "" if text is None else " " + json.dumps(text, ensure_ascii=False)
            print(f"    {rank:>2}  {tid:>8}  {lp:>12.6f}{shown}")
    (_, own_a, row_a), (_, own_b, row_b) = seen
    m_a, m_b = margins(own_a, row_a), margins(own_b, row_b)
    shared = [(abs(m_a[t] - m_b[t]), t) for t in m_a if t in m_b]
    print(f"the gate recorded: {RECORDED}")
    if not shared:
        print("no alternative token is reported on both sides: nothing to compare")
        return 1
    delta, tid = max(shared)
    print(f"largest |margin difference|: {delta:.6g} nats (chosen token {TOKEN} against token {tid}); "
          f"{LIMIT_WORDS}: {LIMIT:g} nats")
    return 1 if delta > LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
"""

_SERVER_MAIN = POST + r'''

def main():
    base_url = os.environ.get("BASELINE_URL", BASELINE_URL).rstrip("/")
    spec_url = os.environ.get("SPEC_URL", SPEC_URL).rstrip("/")
    base_ids, base_rows = parse(post(base_url + PATH, BASELINE_BODY))
    spec_ids, spec_rows = parse(post(spec_url + PATH, SPEC_BODY))
    return show(base_ids, base_rows, spec_ids, spec_rows)


if __name__ == "__main__":
    sys.exit(main())
'''

_INPROCESS_MAIN = r'''

def rows_of(engine, result, k):
    scores = result.scores
    return [[(int(t), float(lp), engine.decode([int(t)])) for t, lp in zip(scores.top_ids[i][:k], scores.top_logprobs[i][:k])
             if int(t) >= 0] or None for i in range(len(result.output_ids))]


def main():
    import dataclasses

    from specparity.engines import build_engine, resolve_factory
    from specparity.engines.base import EngineOptions
    from specparity.model.constraints import Constraint
    from specparity.model.types import GenerationRequest

    known = {f.name for f in dataclasses.fields(EngineOptions)}
    values = {k: v for k, v in ENGINE["options"].items() if k in known}
    for key in ("baseline_urls", "spec_urls"):
        values[key] = tuple(values.get(key) or ())
    options = EngineOptions(**values)
    engine = build_engine(resolve_factory(ENGINE["spec"]), options, ENGINE["spec"])
    c = REQUEST["constraint"]
    request = GenerationRequest(REQUEST["request_id"], list(REQUEST["prompt_ids"]), int(REQUEST["max_new_tokens"]),
                                tuple(REQUEST["stop_token_ids"]), int(REQUEST["top_k"]),
                                constraint=Constraint(c["kind"], c["text"]) if c else None)
    try:
        base = engine.generate([request], speculative=False)[0]
        spec = engine.generate([request], speculative=True)[0]
        for name, result in (("baseline", base), ("speculative", spec)):
            if result.error:
                print(f"{name} failed: {result.error}")
        return show(base.output_ids, rows_of(engine, base, request.top_k),
                    spec.output_ids, rows_of(engine, spec, request.top_k))
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
'''


def pretty_json(value: Any, indent: str = "") -> str:
    """JSON one key per line, but a list of numbers or strings on one line: a prompt of 100K token ids
    stays one line, not 100K. ``ensure_ascii`` keeps the text of every script and file ASCII-safe."""
    inner = indent + " "
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(str(k))}: {pretty_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + pretty_json(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value)


def json_file(value: Any) -> str:
    """A reproducer's JSON file: :func:`pretty_json` and a final newline."""
    return pretty_json(value) + "\n"


def _descriptor(engine: str) -> Any:
    """The server engine's descriptor, whose ``repro_parse`` (``parse(answer)``: token ids and top-k rows) and
    ``repro_row_parse`` (``row_of(kind, answer, pos, token, prompt_len)``: one position's row of a ``score`` or
    ``decode`` answer) are standard-library Python pasted into ``repro.py``; ValueError for an engine without
    them."""
    from specparity.engines import server_descriptor

    d = server_descriptor(engine)
    if d is None or not d.repro_parse:
        raise ValueError(f"engine {engine!r} declares no reproducer parsers (ServerDescriptor.repro_parse)")
    return d


def _literal(value: Any) -> str:
    """``value`` as Python source: JSON text inside ``json.loads`` (pasteable as it stands)."""
    return f'json.loads(r"""{pretty_json(value)}""")'


def server_script(*, title: str, engine: str, path: str, urls: tuple[str, str], bodies: tuple[dict, dict],
                  recorded: str, timeout_s: float) -> str:
    """``repro.py`` for a server engine: both recorded bodies, sent with urllib, compared."""
    return (f'#!/usr/bin/env python3\n"""{title}\n\nSends the request bodies the gate sent to the baseline '
            f'and the speculative {engine} server (override them with\nBASELINE_URL / SPEC_URL) and prints the '
            'first output position where the answers differ, with both\nsides\' top-k there, or "identical". '
            'Standard library only. Exit status: 1 when they differ, 0 when identical.\n"""\n\n'
            "import json\nimport os\nimport sys\nimport urllib.request\n\n"
            f"BASELINE_URL = {json.dumps(urls[0])}\nSPEC_URL = {json.dumps(urls[1])}\nPATH = {json.dumps(path)}\n"
            f"TIMEOUT_S = {timeout_s:g}\nRECORDED = {json.dumps(recorded, ensure_ascii=False)}\n"
            f"BASELINE_BODY = {_literal(bodies[0])}\nSPEC_BODY = {_literal(bodies[1])}\n"
            f"{_descriptor(engine).repro_parse}{COMPARE}{_SERVER_MAIN}")


def inprocess_script(*, title: str, engine: dict[str, Any], request: dict[str, Any], recorded: str) -> str:
    """``repro.py`` for an in-process or plugin engine: the engine rebuilt from the run's options,
    the request decoded without and with speculation, compared."""
    return (f'#!/usr/bin/env python3\n"""{title}\n\nRebuilds the engine the gate ran (the same --engine and '
            'options; specparity, the engine\'s own\ndependencies and the models at the recorded paths must be '
            'there), decodes the request without\nand with speculation through the engine protocol and prints the '
            'first output position where the\nstreams differ, with both sides\' top-k there, or "identical". Exit '
            'status: 1 when they differ.\n"""\n\n'
            "import json\nimport sys\n\n"
            f"RECORDED = {json.dumps(recorded, ensure_ascii=False)}\nENGINE = {_literal(engine)}\n"
            f"REQUEST = {_literal(request)}\n{COMPARE}{_INPROCESS_MAIN}")


def curl_script(*, title: str, path: str, urls: tuple[str, str], bodies: tuple[dict, dict]) -> str:
    """``repro.sh``: the same two requests as curl lines, the bodies inline, exactly as sent."""
    lines = ["#!/bin/sh", f"# {title}", "# The request bodies the gate sent; BASELINE_URL / SPEC_URL override the servers.",
             "set -eu", f"BASELINE_URL=\"${{BASELINE_URL:-{urls[0]}}}\"", f"SPEC_URL=\"${{SPEC_URL:-{urls[1]}}}\""]
    for label, var, body in (("baseline", "BASELINE_URL", bodies[0]), ("speculative", "SPEC_URL", bodies[1])):
        lines += [f"echo {shlex.quote(f'== {label}: POST')} \"${var}{path}\"",
                  f"curl -sS -X POST \"${var}{path}\" -H 'Content-Type: application/json' --data-binary @- <<'JSON'",
                  json.dumps(body), "JSON", "echo"]
    return "\n".join(lines) + "\n"


def scorer_script(*, title: str, engine: str, path: str, reads: list[dict[str, Any]], position: int, token: int,
                  prompt_len: int, limit: float, limit_words: str, recorded: str, timeout_s: float) -> str:
    """``repro.py`` of a calibration problem: two requests whose rows the gate compared (``reads``: label,
    URL, the environment variable that overrides it, ``score`` or ``decode``, and the body), and the
    margins of both rows at one output position."""
    return (f'#!/usr/bin/env python3\n"""{title}\n\nSends the two requests whose rows the gate compared to the '
            f'{engine} servers (BASELINE_URL / SPEC_URL\noverride them) and prints both rows at output position '
            f'{position} (the baseline\'s token {token}) and the\nlargest difference between their margins. Standard '
            f'library only. Exit status: 1 when that difference\nexceeds {limit:.4g} nats ({limit_words}), 0 when it '
            'does not.\n"""\n\n'
            "import json\nimport os\nimport sys\nimport urllib.request\n\n"
            f"PATH = {json.dumps(path)}\nTIMEOUT_S = {timeout_s:g}\nPOSITION = {position}\nTOKEN = {token}\n"
            f"PROMPT_LEN = {prompt_len}\nLIMIT = {limit!r}\nLIMIT_WORDS = {json.dumps(limit_words)}\n"
            f"RECORDED = {json.dumps(recorded, ensure_ascii=False)}\n"
            f"READS = {_literal(reads)}\n{_descriptor(engine).repro_row_parse}{_SCORER_MAIN}")


def scorer_curl_script(*, title: str, path: str, reads: list[dict[str, Any]]) -> str:
    """``repro.sh`` of a calibration problem: the same two requests as curl lines."""
    lines = ["#!/bin/sh", f"# {title}", "# The two requests whose rows the gate compared; BASELINE_URL / SPEC_URL override the servers.",
             "set -eu"]
    for env in dict.fromkeys(r["env"] for r in reads):
        url = next(r["url"] for r in reads if r["env"] == env)
        lines.append(f"{env}=\"${{{env}:-{url}}}\"")
    for read in reads:
        label, env = f"== {read['label']} ({read['kind']}): POST", read["env"]
        lines += [f"echo {shlex.quote(label)} \"${env}{path}\"",
                  f"curl -sS -X POST \"${env}{path}\" -H 'Content-Type: application/json' --data-binary @- <<'JSON'",
                  json.dumps(read["body"]), "JSON", "echo"]
    return "\n".join(lines) + "\n"
