#!/usr/bin/env python3
"""The dependency lock: what the suite was last proven with, and how it moves on purpose.

``ci/lock.txt`` pins every package (and its dependencies) that ``ci/install.sh`` and ``ci/pythons.sh``
install, as pip constraints, for every supported Python at once (markers in the file). It is compiled by
uv from pyproject.toml's ranges and ``ci/lock.in``; the package's own requirements stay ranges, so a user
who ``pip install specparity`` still gets whatever the ranges allow.

    python3 ci/lock.py compile [--upgrade] [-o FILE]   recompile (same versions where they still fit, or the newest)
    python3 ci/lock.py check                           ci/lock.txt satisfies pyproject.toml's ranges and ci/lock.in
    python3 ci/lock.py diff OLD NEW                    what moved between two lock files
    python3 ci/lock.py upgrade [--package NAME ...]    the newest versions the ranges allow (or only NAME's), the
                                                       whole suite in a fresh virtualenv, and ci/lock.txt replaced
                                                       only when it passes; prints what changed either way
    python3 ci/lock.py newest [--torch SPEC]           the whole suite on the newest versions the ranges allow,
                                                       without touching the lock; prints what differs from it

``upgrade`` and ``newest`` run ``ci/suite.sh`` (what ``.ci/run`` runs) in ``.lock/venv-*``; their reports go to
``.lock/`` (``upgrade.md``, ``newest.md``). Exit codes: 0 passed (or nothing to do), 1 the suite failed or the lock
is out of step, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "ci" / "lock.txt"
LOCK_IN = ROOT / "ci" / "lock.in"
WORK = ROOT / ".lock"
#: The extras the checkout installs (ci/install.sh: ``-e ".[torch,test,ray]"``).
EXTRAS = ("torch", "test", "ray")
#: The oldest supported Python (pyproject's requires-python): the universal lock covers it and every newer one.
OLDEST_PYTHON = "3.10"
COMPILE_COMMAND = "python3 ci/lock.py compile"
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


@dataclass(frozen=True)
class Pin:
    """One line of a lock: ``name==version`` for the environments its marker selects."""

    name: str
    version: str
    marker: str | None


def canonical(name: str) -> str:
    """PEP 503's normal form, so ``Jinja2`` and ``jinja2`` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> list[Pin]:
    pins = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            raise SystemExit(f"{path}:{number}: expected 'name==version [; marker]', got {line!r}")
        name, version, marker = match.groups()
        pins.append(Pin(canonical(name), version, marker))
    return pins


def versions(pins: list[Pin]) -> dict[str, str]:
    """``{name: "v1" or "v1 (marker), v2 (marker)"}``: one readable entry per package."""
    grouped: dict[str, list[str]] = {}
    for pin in pins:
        grouped.setdefault(pin.name, []).append(pin.version if pin.marker is None else f"{pin.version} ({pin.marker})")
    return {name: ", ".join(entries) for name, entries in grouped.items()}


def describe_changes(old: dict[str, str], new: dict[str, str], old_label: str, new_label: str) -> list[str]:
    """Markdown lines: one table row per package that moved, appeared or went away (none: one sentence)."""
    rows = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before != after:
            rows.append(f"| {name} | {before or '(none)'} | {after or '(none)'} |")
    if not rows:
        return [f"No package differs between {old_label} and {new_label}."]
    return [f"{len(rows)} package(s) differ between {old_label} and {new_label}:", "",
            f"| package | {old_label} | {new_label} |", "|---|---|---|", *rows]


def uv_command() -> list[str]:
    """uv from this environment, installed at the locked version when it is missing."""
    found = shutil.which("uv")
    if found:
        return [found]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-c", str(LOCK), "uv"], check=True)
    return [sys.executable, "-m", "uv"]


def compile_lock(out: Path, upgrade: bool = False, packages: tuple[str, ...] = ()) -> None:
    """uv pip compile, universal (one file for every Python from the oldest supported one), run from the
    checkout's root so the file names no machine path. Without ``upgrade`` uv keeps the versions ``out``
    already holds where they still satisfy the inputs."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out != LOCK and LOCK.exists() and not out.exists():
        shutil.copy2(LOCK, out)  # the starting point uv keeps versions from
    argv = [*uv_command(), "pip", "compile", "pyproject.toml", "ci/lock.in", *(f"--extra={e}" for e in EXTRAS),
            "--universal", f"--python-version={OLDEST_PYTHON}", "--custom-compile-command", COMPILE_COMMAND,
            "--quiet", "-o", os.path.relpath(out, ROOT)]
    if upgrade:
        argv.append("--upgrade")
    argv += [f"--upgrade-package={p}" for p in packages]
    subprocess.run(argv, cwd=ROOT, check=True)


def check_lock(lock: Path = LOCK, pyproject: Path = ROOT / "pyproject.toml", lock_in: Path = LOCK_IN) -> list[str]:
    """What is wrong with ``lock`` against the ranges it was compiled from (empty: nothing): every
    requirement of the package (with the checkout's extras) and of ci/lock.in has a pin that satisfies
    it for every Python the pin's marker covers. Reads files only (no network)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in EXTRAS:
        wanted += project["optional-dependencies"][extra]
    wanted += [line.split("#")[0].strip() for line in lock_in.read_text().splitlines()]
    pins: dict[str, list[Pin]] = {}
    for pin in read_lock(lock):
        pins.setdefault(pin.name, []).append(pin)
    problems = []
    for text in filter(None, wanted):
        req = Requirement(text)
        name = canonical(req.name)
        if name not in pins:
            problems.append(f"{lock.name}: {req.name} is required ({text}) but not pinned")
            continue
        for pin in pins[name]:
            if req.specifier and not req.specifier.contains(pin.version, prereleases=True):
                where = f" for {pin.marker}" if pin.marker else ""
                problems.append(f"{lock.name}: {req.name}=={pin.version}{where} is outside {text!r}")
    return problems


def fresh_venv(path: Path) -> Path:
    """A new virtualenv with pip (the previous one at ``path`` removed); returns its bin folder."""
    venv.EnvBuilder(clear=True, with_pip=True).create(path)
    return path / "bin"


def run_suite(bin_dir: Path, lock: str, torch: str | None = None) -> int:
    """``ci/suite.sh`` (the body of ``.ci/run``) with ``bin_dir`` first on PATH and ``SPECPARITY_LOCK``."""
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(bin_dir.parent),
           "SPECPARITY_LOCK": lock}
    env.pop("PYTHONHOME", None)
    if torch:
        env["SPECPARITY_TORCH"] = torch
    return subprocess.run(["bash", str(ROOT / "ci" / "suite.sh")], cwd=ROOT, env=env).returncode


def installed(bin_dir: Path) -> dict[str, str]:
    import json

    out = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format=json", "--exclude-editable"],
                         capture_output=True, text=True, check=True).stdout
    return {canonical(p["name"]): p["version"] for p in json.loads(out)}


def applicable(pins: list[Pin], bin_dir: Path) -> dict[str, str]:
    """The lock's versions for the interpreter in ``bin_dir`` (markers evaluated there)."""
    import json

    script = ("import json,sys; from packaging.markers import Marker; "
              "print(json.dumps([m is None or Marker(m).evaluate() for m in json.loads(sys.stdin.read())]))")
    out = subprocess.run([str(bin_dir / "python"), "-c", script], input=json.dumps([p.marker for p in pins]),
                         capture_output=True, text=True, check=True).stdout
    return {p.name: p.version for p, keep in zip(pins, json.loads(out)) if keep}


def report(name: str, lines: list[str]) -> None:
    WORK.mkdir(exist_ok=True)
    (WORK / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\n(also in {os.path.relpath(WORK / name, ROOT)})")


def cmd_upgrade(packages: tuple[str, ...]) -> int:
    candidate = WORK / "lock.txt"
    candidate.unlink(missing_ok=True)
    compile_lock(candidate, upgrade=not packages, packages=packages)
    changes = describe_changes(versions(read_lock(LOCK)), versions(read_lock(candidate)), "ci/lock.txt", "upgraded")
    print("\n".join(changes))
    if changes[0].startswith("No package differs"):
        return 0
    code = run_suite(fresh_venv(WORK / "venv-upgrade"), str(candidate))
    if code == 0:
        shutil.copy2(candidate, LOCK)
        report("upgrade.md", ["# Lock upgrade: the suite passed; ci/lock.txt replaced", "", *changes])
        return 0
    report("upgrade.md", [f"# Lock upgrade: the suite failed (exit {code}); ci/lock.txt kept", "",
                          f"The candidate lock is {os.path.relpath(candidate, ROOT)}.", "", *changes])
    return 1


def cmd_newest(torch: str | None) -> int:
    bin_dir = fresh_venv(WORK / "venv-newest")
    code = run_suite(bin_dir, "none", torch)
    changes = describe_changes(applicable(read_lock(LOCK), bin_dir), installed(bin_dir), "ci/lock.txt", "newest")
    verdict = "passed" if code == 0 else f"failed (exit {code})"
    report("newest.md", [f"# The suite on the newest versions the ranges allow: {verdict}", "", *changes])
    return 0 if code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/lock.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile", help="recompile ci/lock.txt")
    p.add_argument("--upgrade", action="store_true", help="the newest versions, not the ones the lock holds")
    p.add_argument("-o", "--output", type=Path, default=LOCK)
    sub.add_parser("check", help="ci/lock.txt satisfies pyproject.toml and ci/lock.in (offline)")
    p = sub.add_parser("diff", help="what moved between two lock files")
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p = sub.add_parser("upgrade", help="upgrade the lock, run the suite, keep it only when it passes")
    p.add_argument("--package", action="append", default=[], help="upgrade only this package (repeatable)")
    p = sub.add_parser("newest", help="the suite on the newest versions the ranges allow")
    p.add_argument("--torch", help="torch's requirement (default: ci/lock.in's pin, the CPU wheel)")
    args = parser.parse_args(argv)
    if args.command == "compile":
        compile_lock(args.output.resolve(), upgrade=args.upgrade)
        return 0
    if args.command == "check":
        problems = check_lock()
        print("\n".join(problems) or f"{LOCK.name}: every requirement is pinned within its range")
        return 1 if problems else 0
    if args.command == "diff":
        for path in (args.old, args.new):
            if not path.is_file():
                parser.error(f"{path}: no such lock file")
        print("\n".join(describe_changes(versions(read_lock(args.old)), versions(read_lock(args.new)),
                                         str(args.old), str(args.new))))
        return 0
    if args.command == "upgrade":
        return cmd_upgrade(tuple(args.package))
    return cmd_newest(args.torch)


if __name__ == "__main__":
    sys.exit(main())
