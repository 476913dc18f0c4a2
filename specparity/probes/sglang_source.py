"""Read an SGLang source tree (installed package, unpacked copy, or wheel) without importing it.

Importing sglang pulls CUDA kernels and minutes of start-up; the facts the probes need are in
its Python text: whether the mamba slot allocator asserts when the pool is exhausted, whether
the prefix-donation call sites guard against that, and the slot-sizing constants. Everything
here is ``ast`` over source text, so it works on a CPU box for any version, including a patched
copy, and every finding carries ``file:line``.
"""

from __future__ import annotations

import ast
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from specparity.model.packages import installed_package_dir
from specparity.probes.version_facts import MambaSizing, format_version, parse_version

MEM_CACHE_DIR = "sglang/srt/mem_cache/"
CONFIGURATOR = "sglang/srt/mem_cache/kv_cache_configurator.py"
OVERRIDES = "sglang/srt/arg_groups/overrides.py"
ALLOC_NAME = re.compile(r"alloc\w*mamba|mamba\w*alloc", re.I)


class SourceError(ValueError):
    """The path given as an SGLang source is not one."""


class SourceTree(Protocol):
    label: str

    def files(self) -> list[str]:
        """Paths relative to the tree root, e.g. ``sglang/srt/models/dflash.py``."""

    def read(self, rel: str) -> str: ...


@dataclass
class DirSource:
    """A directory holding the ``sglang`` package (site-packages, or an unpacked wheel)."""

    root: Path
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or str(self.root / "sglang")

    def files(self) -> list[str]:
        base = self.root
        return sorted(p.relative_to(base).as_posix() for p in (base / "sglang").rglob("*.py"))

    def read(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")


@dataclass
class WheelSource:
    """An sglang wheel read in place with ``zipfile`` (never installed, never imported)."""

    path: Path
    label: str = ""
    _zip: zipfile.ZipFile | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.label = self.label or self.path.name
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise SourceError(f"{self.path}: not a readable wheel ({exc})") from None

    def files(self) -> list[str]:
        assert self._zip is not None
        return sorted(n for n in self._zip.namelist() if n.startswith("sglang/") and n.endswith(".py"))

    def names(self) -> list[str]:
        assert self._zip is not None
        return self._zip.namelist()

    def read(self, rel: str) -> str:
        assert self._zip is not None
        return self._zip.read(rel).decode("utf-8", errors="replace")


def open_source(path: str | Path) -> SourceTree:
    """A wheel file, a directory containing ``sglang/``, or the ``sglang`` package directory."""
    p = Path(path)
    if p.is_file() and p.suffix in (".whl", ".zip"):
        return WheelSource(p)
    if (p / "sglang" / "__init__.py").is_file():
        return DirSource(p)
    if p.name == "sglang" and (p / "__init__.py").is_file():
        return DirSource(p.parent)
    raise SourceError(f"{p}: expected an sglang wheel, a directory containing sglang/, or the sglang package directory")


def installed_sglang() -> Path | None:
    """The installed ``sglang`` package directory, found without importing it."""
    return installed_package_dir("sglang")


def source_version(tree: SourceTree) -> str | None:
    """``__version__`` from ``sglang/_version.py``, else the dist-info ``METADATA`` Version."""
    files = set(tree.files())
    if "sglang/_version.py" in files:
        m = re.search(r"""^(?:__version__|version)\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                      tree.read("sglang/_version.py"), re.M)
        if m:
            return m.group(1)
    if isinstance(tree, WheelSource):
        meta = [n for n in tree.names() if n.endswith(".dist-info/METADATA")]
        if meta:
            m = re.search(r"^Version:\s*(\S+)", tree.read(meta[0]), re.M)
            return m.group(1) if m else None
    if isinstance(tree, DirSource):
        for dist in sorted(tree.root.glob("sglang-*.dist-info/METADATA")):
            m = re.search(r"^Version:\s*(\S+)", dist.read_text(errors="replace"), re.M)
            if m:
                return m.group(1)
    return None


@dataclass
class FoundSource:
    tree: SourceTree | None
    version: str | None
    notes: list[str]


def find_source(version: str, explicit: str | Path | None = None, wheel_cache: str | Path | None = None) -> FoundSource:
    """The SGLang source to read for ``version``: explicit path, else cached wheel, else installed.

    A tree whose version differs from the one asked for is used only when given explicitly
    (the operator knows best, e.g. a patched copy) and the mismatch is noted.
    """
    notes: list[str] = []
    if explicit:
        tree = open_source(explicit)
        found = source_version(tree)
        if found and parse_version(found)[:3] != parse_version(version)[:3]:
            notes.append(f"source {tree.label} is sglang {found}, not {version}")
        return FoundSource(tree, found, notes)
    if wheel_cache and Path(wheel_cache).is_dir():
        for whl in sorted(Path(wheel_cache).glob(f"sglang-{version}-*.whl")):
            tree = WheelSource(whl)
            return FoundSource(tree, source_version(tree) or version, notes)
    pkg = installed_sglang()
    if pkg is not None:
        tree = DirSource(pkg.parent)
        found = source_version(tree)
        if found and parse_version(found)[:3] == parse_version(version)[:3]:
            return FoundSource(tree, found, notes)
        notes.append(f"installed sglang at {pkg} is {found}, not {version}")
    else:
        notes.append("no installed sglang found (importlib.util.find_spec, not imported)")
    notes.append(f"no sglang-{version}-*.whl in {wheel_cache}" if wheel_cache else "no wheel cache given")
    return FoundSource(None, None, notes)


# --------------------------------------------------------------------------------------------
# Mamba slot exhaustion: allocator and prefix-donation sites
# --------------------------------------------------------------------------------------------


@dataclass
class AllocFn:
    file: str
    line: int
    cls: str
    name: str
    on_failure: str  # asserts | raises | returns-none
    fail_line: int | None = None
    message: str | None = None

    def describe(self) -> str:
        at = f" at :{self.fail_line}" if self.fail_line else ""
        msg = f" {self.message!r}" if self.message else ""
        return f"{self.file}:{self.line} {self.cls}.{self.name} on an empty pool: {self.on_failure}{msg}{at}"


@dataclass
class DonationSite:
    file: str
    line: int
    callee: str
    target: str | None
    guard_line: int | None

    @property
    def guarded(self) -> bool:
        return self.guard_line is not None

    def describe(self) -> str:
        guard = f"None-checked at :{self.guard_line}" if self.guarded else "result not checked for None"
        return f"{self.file}:{self.line} prepare_for_caching_req donates via self.{self.callee}() -> {self.target}; {guard}"


@dataclass
class ExhaustionReport:
    """What an SGLang tree does when the mamba pool is empty during allocation and prefix donation."""

    label: str
    version: str | None
    allocators: list[AllocFn]
    sites: list[DonationSite]
    inline_asserts: list[str]  # other "Can not alloc mamba cache" asserts (copy-on-write allocation)

    @property
    def outcome(self) -> str:
        """``asserts`` (server dies), ``skips`` (donation skipped), ``unguarded`` (None flows on), ``not-found``."""
        if not self.sites:
            return "not-found"
        by_name = {a.name: a for a in self.allocators}
        callees = [by_name.get(s.callee) for s in self.sites]
        if any(c is None or c.on_failure in ("asserts", "raises") for c in callees):
            return "asserts"
        if all(s.guarded for s in self.sites):
            return "skips"
        return "unguarded"

    def evidence(self) -> list[str]:
        return [a.describe() for a in self.allocators] + [s.describe() for s in self.sites] + self.inline_asserts


def _assert_message(node: ast.Assert) -> str | None:
    return node.msg.value if isinstance(node.msg, ast.Constant) and isinstance(node.msg.value, str) else None


def _classify_alloc(fn: ast.FunctionDef) -> tuple[str, int | None, str | None]:
    returns_none = False
    asserted: tuple[int, str | None] | None = None
    raised: int | None = None
    for node in ast.walk(fn):
        if isinstance(node, ast.Return) and (node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None)):
            returns_none = True
        elif isinstance(node, ast.Assert) and asserted is None:
            asserted = (node.lineno, _assert_message(node))
        elif isinstance(node, ast.Raise) and raised is None:
            raised = node.lineno
    if returns_none:
        return "returns-none", asserted[0] if asserted else None, asserted[1] if asserted else None
    if asserted:
        return "asserts", asserted[0], asserted[1]
    if raised:
        return "raises", raised, None
    return "returns-none", None, None  # the allocator's None is passed straight through


def _none_test_names(test: ast.expr) -> set[str]:
    """Names an ``if`` test compares with None (``x is None``, ``x is not None``, ``not x``)."""
    names: set[str] = set()
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name):
            if any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
                isinstance(c, ast.Constant) and c.value is None for c in node.comparators
            ):
                names.add(node.left.id)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and isinstance(node.operand, ast.Name):
            names.add(node.operand.id)
    return names


def _self_call(node: ast.AST) -> str | None:
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    ):
        return node.func.attr
    return None


def _donation_sites(fn: ast.FunctionDef, alloc_names: set[str], rel: str) -> list[DonationSite]:
    ifs = [n for n in ast.walk(fn) if isinstance(n, ast.If)]
    sites = []
    for node in ast.walk(fn):
        callee = _self_call(node)
        if callee is None or callee not in alloc_names:
            continue
        target = None
        for parent in ast.walk(fn):
            if isinstance(parent, (ast.Assign, ast.AnnAssign)) and parent.value is node:
                tgt = parent.targets[0] if isinstance(parent, ast.Assign) else parent.target
                target = tgt.id if isinstance(tgt, ast.Name) else None
        guard = None
        if target is not None:
            guard = next((i.lineno for i in ifs if i.lineno > node.lineno and target in _none_test_names(i.test)), None)
        sites.append(DonationSite(rel, node.lineno, callee, target, guard))
    return sorted(sites, key=lambda s: s.line)


def analyze_mamba_exhaustion(tree: SourceTree) -> ExhaustionReport:
    """Find the mamba cache component(s) and classify their exhaustion behaviour."""
    allocators: list[AllocFn] = []
    sites: list[DonationSite] = []
    inline: list[str] = []
    for rel in tree.files():
        if not rel.startswith(MEM_CACHE_DIR):
            continue
        text = tree.read(rel)
        if "prepare_for_caching_req" not in text or not ALLOC_NAME.search(text):
            continue
        try:
            module = ast.parse(text)
        except SyntaxError:
            continue
        for cls in (n for n in module.body if isinstance(n, ast.ClassDef)):
            methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
            if "prepare_for_caching_req" not in methods:
                continue
            alloc_names = {n for n in methods if ALLOC_NAME.search(n) and "int8" not in n and "ckpt" not in n}
            for name in sorted(alloc_names):
                kind, line, msg = _classify_alloc(methods[name])
                allocators.append(AllocFn(rel, methods[name].lineno, cls.name, name, kind, line, msg))
            sites += _donation_sites(methods["prepare_for_caching_req"], alloc_names, rel)
            for fname, fn in sorted(methods.items()):
                if fname in alloc_names:
                    continue
                for node in ast.walk(fn):
                    msg = _assert_message(node) if isinstance(node, ast.Assert) else None
                    if msg and "alloc mamba" in msg.lower():
                        inline.append(f"{rel}:{node.lineno} {cls.name}.{fname} asserts {msg!r}")
    return ExhaustionReport(tree.label, source_version(tree), allocators, sites, inline)


# --------------------------------------------------------------------------------------------
# Slot-sizing constants, read from the tree instead of the table
# --------------------------------------------------------------------------------------------


def _module_constants(text: str) -> dict[str, tuple[object, int]]:
    out: dict[str, tuple[object, int]] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and value.args:  # frozenset({...})
                value = value.args[0]
            try:
                out[node.targets[0].id] = (ast.literal_eval(value), node.lineno)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                continue
    return out


def read_mamba_sizing(tree: SourceTree) -> MambaSizing | None:
    """``MAMBA_CACHE_*`` constants and ``_MAMBA_EXTRA_BUFFER_ARCHS`` from the tree, with lines."""
    files = set(tree.files())
    if CONFIGURATOR not in files:
        return None
    text = tree.read(CONFIGURATOR)
    consts = _module_constants(text)
    if "MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO" not in consts:
        return None

    def c(name: str, default: int) -> int:
        value = consts.get(name, (default, 0))[0]
        return value if isinstance(value, int) else default

    warn_line = next((i for i, line in enumerate(text.splitlines(), 1) if "max_running_requests is capped to" in line), None)
    sources = [
        f"{tree.label}: {CONFIGURATOR}:{consts['MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO'][1]} "
        f"MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO={c('MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO', 3)}"
        + (f", :{warn_line} 'max_running_requests is capped to ...'" if warn_line else "")
    ]
    archs: frozenset[str] = frozenset()
    if OVERRIDES in files:
        over = _module_constants(tree.read(OVERRIDES))
        if "_MAMBA_EXTRA_BUFFER_ARCHS" in over:
            value, line = over["_MAMBA_EXTRA_BUFFER_ARCHS"]
            archs = frozenset(str(a) for a in value) if isinstance(value, (set, frozenset, list, tuple)) else frozenset()
            sources.append(f"{tree.label}: {OVERRIDES}:{line} _MAMBA_EXTRA_BUFFER_ARCHS ({len(archs)} archs)")
    return MambaSizing(
        base=c("MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO", 3),
        drop_on_skip=c("MAMBA_CACHE_BASE_RATIO_DROP_ON_SKIP", 1),
        extra_overlap=c("MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP", 2),
        extra_lazy=c("MAMBA_CACHE_V2_ADDITIONAL_RATIO_OVERLAP_LAZY", 1),
        extra_no_overlap=c("MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_OVERLAP", 1),
        extra_no_buffer_skip=c("MAMBA_CACHE_V2_ADDITIONAL_RATIO_NO_BUFFER", 1),
        sources=tuple(sources),
        extra_buffer_archs=archs,
    )


def short_version(v: str | None) -> str:
    return format_version(parse_version(v)[:3]) if v else "?"
