"""The gate policy file (``--policy FILE``): what fails a merge, in one reviewed file.

A team keeps its rules next to its CI (``ci/policy.toml``) and changes them by review, not by
editing flags scattered over workflow files; :data:`EXAMPLE` is such a file, every key with its
default (``min_accept_length`` and ``allow_unknown``, which have none, with an example).

``diverged`` and ``error`` always fail (a policy cannot make a real bug pass). ``drifted`` left
out of ``fail_on`` makes drift a warning; ``near_tie`` in it makes the gate bit-exact. A flag given
on the command line overrides the file's value. Mistakes are one line: ``file:line: key: what was
expected``.

A probe that answers ``unknown`` (it could not check what it probes) is not green under a policy:
it fails unless ``allow_unknown`` names it (:func:`judge_unknown`; ``ci/gate.sh``'s probes suite
and ``specparity probe --policy FILE``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib
from pathlib import Path
from typing import Any, Sequence

from specparity.judge.acceptance import DEFAULT_MAX_ACCEPT_DROP
from specparity.model.verdicts import CLASSES
from specparity.model.gate_run import DEFAULT_MAX_NEAR_TIE, FINDING_POLICIES, GatePolicy

ALWAYS_FAIL = ("diverged", "error")
KEYS = ("fail_on", "max_near_tie", "min_accept_length", "max_accept_drop", "require_all_paths", "allow_unknown_activity",
        "calibration_findings", "allow_unknown")

#: A policy file setting every key (:data:`KEYS`), with the defaults written from where they are defined.
EXAMPLE = "".join(f"{setting:<44} # {why}\n" if why else f"{setting}\n" for setting, why in (
    ("[gate]", ""),
    ('fail_on = ["diverged", "error", "drifted"]', 'classes that fail; add "near_tie" to demand bit-exactness'),
    (f"max_near_tie = {DEFAULT_MAX_NEAR_TIE:g}", "a fixed share of near-tie prompts (unset: a budget from the data)"),
    ("min_accept_length = 1.5", "acceptance floor (mean accept length)"),
    (f"max_accept_drop = {DEFAULT_MAX_ACCEPT_DROP:g}", "specparity compare: largest accept-length drop vs OLD"),
    (f"require_all_paths = {GatePolicy.require_paths}", "each speculative path on at least N prompts (0: warn)"),
    (f"allow_unknown_activity = {str(GatePolicy.allow_unknown_activity).lower()}", ""),
    (f'calibration_findings = "{GatePolicy.calibration_findings}"', 'findings about the measurement: "warn" or "fail"'),
    ('allow_unknown = ["mamba-slots"]', 'probes whose "unknown" answer may pass (by name)'),
))


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the file, line and key."""


def _line_of(text: str, key: str) -> int:
    for lineno, line in enumerate(text.splitlines(), start=1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line):
            return lineno
    return 1


def where(path: str | Path, key: str) -> str:
    """``file:line`` of ``key`` in a policy file already read by :func:`load_policy` (for a refusal
    that depends on more than the file, e.g. on the engine's counters)."""
    try:
        return f"{path}:{_line_of(Path(path).read_text(encoding='utf-8'), key)}"
    except OSError:
        return str(path)


def load_policy(path: str | Path) -> dict[str, Any]:
    """The policy as raw option values (``dest`` names, as :func:`specparity.cli.options.build_setup` reads
    them): ``max_near_tie``, ``drift_policy``, ``bit_exact``, ``require_all_paths``,
    ``allow_unknown_activity``, ``min_accept_length``, ``calibration_findings``, ``max_accept_drop``
    (read by ``specparity compare`` only: a gate run has no earlier run to compare its acceptance with)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"--policy {path}: cannot read the policy file ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{p}: not TOML: {exc}") from None
    unknown_tables = sorted(set(data) - {"gate"})
    if unknown_tables or "gate" not in data or not isinstance(data["gate"], dict):
        where = f"{p}:{_line_of(text, unknown_tables[0]) if unknown_tables else 1}"
        raise PolicyError(f"{where}: expected one table [gate] with keys {', '.join(KEYS)}"
                          + (f"; unknown {', '.join(unknown_tables)}" if unknown_tables else ""))
    gate = data["gate"]
    out: dict[str, Any] = {}

    def bad(key: str, expected: str) -> PolicyError:
        return PolicyError(f"{p}:{_line_of(text, key)}: {key}: expected {expected}, got {gate[key]!r}")

    for key in gate:
        if key not in KEYS:
            raise PolicyError(f"{p}:{_line_of(text, key)}: {key}: unknown key; expected one of {', '.join(KEYS)}")
    if "fail_on" in gate:
        classes = gate["fail_on"]
        if not isinstance(classes, list) or not all(isinstance(c, str) and c in CLASSES and c != "exact" for c in classes):
            raise bad("fail_on", f"a list of classes among {', '.join(c for c in CLASSES if c != 'exact')}")
        missing = [c for c in ALWAYS_FAIL if c not in classes]
        if missing:
            raise bad("fail_on", f"a list that includes {' and '.join(ALWAYS_FAIL)} (they always fail: a policy "
                                 f"cannot make a real bug pass)")
        out["drift_policy"] = "fail" if "drifted" in classes else "warn"
        if "near_tie" in classes:
            out["bit_exact"] = True
    if "max_near_tie" in gate:
        v = gate["max_near_tie"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise bad("max_near_tie", "a fraction in [0, 1]")
        out["max_near_tie"] = float(v)
    if "min_accept_length" in gate:
        v = gate["min_accept_length"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise bad("min_accept_length", "a number >= 0 (tokens per verify step)")
        out["min_accept_length"] = float(v)
    if "max_accept_drop" in gate:
        v = gate["max_accept_drop"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise bad("max_accept_drop", "a number >= 0 (tokens per verify step)")
        out["max_accept_drop"] = float(v)
    if "require_all_paths" in gate:
        v = gate["require_all_paths"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad("require_all_paths", "an integer >= 0")
        out["require_all_paths"] = v
    if "allow_unknown_activity" in gate:
        if not isinstance(gate["allow_unknown_activity"], bool):
            raise bad("allow_unknown_activity", "true or false")
        out["allow_unknown_activity"] = gate["allow_unknown_activity"]
    if "calibration_findings" in gate:
        if gate["calibration_findings"] not in FINDING_POLICIES:
            raise bad("calibration_findings", f"one of {', '.join(repr(v) for v in FINDING_POLICIES)}")
        out["calibration_findings"] = gate["calibration_findings"]
    if "allow_unknown" in gate:
        names, known = gate["allow_unknown"], probe_names()
        if not isinstance(names, list) or not all(isinstance(n, str) and n in known for n in names):
            raise bad("allow_unknown", f"a list of probe names among {', '.join(known)}")
        out["allow_unknown"] = tuple(names)
    return out


def probe_names() -> tuple[str, ...]:
    """Every probe's name (static and live), the names ``allow_unknown`` takes."""
    from specparity.probes import live
    from specparity.probes.inputs import STATIC_PROBES

    return (*STATIC_PROBES, *live.LIVE_PROBES)


def allowed_unknown(path: str | Path) -> tuple[str, ...]:
    """The probes whose ``unknown`` the policy file accepts (none unless ``allow_unknown`` names them)."""
    return tuple(load_policy(path).get("allow_unknown", ()))


def judge_unknown(finding: Any, allowed: Sequence[str], source: str) -> Any:
    """A probe's :class:`~specparity.probes.finding.Finding` under a policy: ``unknown`` becomes a
    failure unless ``allowed`` names the probe (an unchecked deploy question is not green)."""
    from specparity.probes.finding import Status

    if finding.status is not Status.UNKNOWN or finding.probe in allowed:
        return finding
    return replace(finding, status=Status.FAIL,
                   summary=f"unknown, and the policy {source} does not allow it: {finding.summary}",
                   action=(finding.action + "; " if finding.action else "")
                   + f'make the probe answer (see its evidence), or add "{finding.probe}" to allow_unknown in {source}')


def merge(raw: dict[str, Any], policy: dict[str, Any]) -> dict[str, Any]:
    """``raw`` option values with the policy file's filling every option the command line left unset
    (None or False). ``--allow-near-tie`` on the command line wins over ``near_tie`` in ``fail_on``."""
    out = dict(raw)
    for key, value in policy.items():
        if key == "bit_exact" and raw.get("allow_near_tie"):
            continue
        if out.get(key) in (None, False, ""):
            out[key] = value
    return out
