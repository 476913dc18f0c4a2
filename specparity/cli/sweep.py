"""``specparity sweep``'s own options: the concurrency levels, and the gate options a sweep refuses. The sweep
itself is :mod:`specparity.run.sweep`.
"""

from __future__ import annotations

from typing import Any

from specparity.run.setup import BadInput


#: Gate options the sweep sets itself or cannot honour across levels, with why.
REFUSED_OPTIONS = {
    "concurrency": ("--concurrency", "the sweep sets the concurrency of each level from --levels; leave --concurrency out"),
    "resume": ("--resume", "a sweep is not resumed; rerun it (each level's journal stays in its own directory)"),
    "update_golden": ("--update-golden", "record the golden once with `specparity record`, then sweep with --golden"),
}


def parse_levels(text: Any) -> tuple[int, ...]:
    """``--levels 1,4,16``: two or more distinct positive integers, returned in ascending order."""
    raw = "" if text is None else str(text)
    expected = "expected two or more distinct positive integers separated by commas, e.g. 1,4,16"
    parts = [p.strip() for p in raw.split(",")]
    if not raw.strip() or any(not p for p in parts):
        raise BadInput(f"--levels {raw}: {expected}" if raw.strip() else f"--levels (empty): {expected}")
    levels = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            raise BadInput(f"--levels {raw}: {p!r} is not an integer; {expected}") from None
        if n < 1:
            raise BadInput(f"--levels {raw}: {n} is not a positive integer; {expected}")
        levels.append(n)
    twice = sorted({n for n in levels if levels.count(n) > 1})
    if twice:
        raise BadInput(f"--levels {raw}: {', '.join(map(str, twice))} given twice; {expected}")
    if len(levels) < 2:
        raise BadInput(f"--levels {raw}: one level only; {expected} (one level is `specparity run --concurrency "
                       f"{levels[0]}`)")
    return tuple(sorted(levels))


def check_sweep_options(raw: dict[str, Any]) -> None:
    """The gate options a sweep refuses (one line naming the option), before anything loads."""
    for dest, (flag, why) in REFUSED_OPTIONS.items():
        if raw.get(dest) not in (None, False, ""):
            raise BadInput(f"{flag}: {why}")
    if not raw.get("report"):
        raise BadInput("--report: a sweep keeps each level's journal; give a report directory (default reports/sweep)")
