"""The mamba exhaustion probe against real SGLang source from PyPI, plus patched copies.

The wheels are downloaded once into the user cache (``specparity.model.cache``, outside the checkout;
``pip download --no-deps``, never installed) and read with ``zipfile`` / ``ast``; without a package
registry these tests skip and say so (``registry`` mark). No GPU, no running server, nothing imported from
sglang. What only a live SGLang can show — the scheduler actually dying — is the mamba-stress
probe's job (tests/test_probe_live.py exercises it on a simulated slot pool).
"""

from __future__ import annotations

import shutil

import pytest

import probe_artifacts as pa
from specparity.probes.checkpoints import load_checkpoint
from specparity.probes.version_facts import EngineSpec
from specparity.probes.mamba_slots import LaunchFlags, probe_mamba_exhaustion, probe_mamba_slots
from specparity.probes.sglang_source import (
    DirSource,
    SourceError,
    WheelSource,
    analyze_mamba_exhaustion,
    find_source,
    open_source,
    read_mamba_sizing,
    source_version,
)
from specparity.probes.finding import Status

pytestmark = [pytest.mark.offline, pytest.mark.registry]

# version -> (component file, _alloc_mamba_slot def line, its assert line, donation call lines)
EXPECTED = {
    "0.5.17": ("unified_cache/components/mamba_component.py", 473, 479, [557, 570, 577]),
    "0.5.19": ("unified_cache/components/mamba_component.py", 493, 499, [577, 590, 597]),
    "0.5.23": ("unified_cache/components/mamba.py", 527, 552, [653, 666, 673]),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def wheel(request):
    return request.param, pa.sglang_wheel(request.param)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return load_checkpoint(pa.hybrid_target(tmp_path_factory.mktemp("hyb") / "t"))


def test_real_releases_assert_on_exhaustion(wheel):
    version, path = wheel
    tree = WheelSource(path)
    report = analyze_mamba_exhaustion(tree)
    comp, def_line, assert_line, sites = EXPECTED[version]
    assert source_version(tree) == version and report.version == version
    assert report.outcome == "asserts"
    alloc = [a for a in report.allocators if a.name == "_alloc_mamba_slot"]
    assert len(alloc) == 1 and alloc[0].file.endswith(comp)
    assert (alloc[0].line, alloc[0].fail_line, alloc[0].message) == (def_line, assert_line, "Can not alloc mamba cache")
    assert [s.line for s in report.sites] == sites and not any(s.guarded for s in report.sites)
    assert any("finalize_match_result_in_cache asserts 'Can not alloc mamba cache'" in e for e in report.inline_asserts)


@pytest.fixture(scope="module", params=["0.5.19", "0.5.23"])
def unpacked(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"sglang-{request.param}")
    pa.extract_sglang(pa.sglang_wheel(request.param), root)
    return request.param, root


def _copy(root, tmp_path):
    dest = tmp_path / "copy"
    shutil.copytree(root, dest)
    return dest


def test_patched_copy_skips_donation(unpacked, tmp_path):
    version, root = unpacked
    assert analyze_mamba_exhaustion(DirSource(root)).outcome == "asserts"
    patched = _copy(root, tmp_path)
    assert pa.patch_graceful(patched) == 3
    report = analyze_mamba_exhaustion(DirSource(patched))
    assert report.outcome == "skips", report.evidence()
    assert report.version == version
    assert all(s.guarded for s in report.sites) and report.allocators[0].on_failure == "returns-none"


def test_half_patches_are_told_apart(unpacked, tmp_path):
    _, root = unpacked
    guards_only = _copy(root, tmp_path / "a")
    pa.patch_graceful(guards_only, allocator=False)
    assert analyze_mamba_exhaustion(DirSource(guards_only)).outcome == "asserts"
    allocator_only = _copy(root, tmp_path / "b")
    pa.patch_graceful(allocator_only, guards=False)
    assert analyze_mamba_exhaustion(DirSource(allocator_only)).outcome == "unguarded"


def test_exhaustion_probe_verdicts(unpacked, hybrid, tmp_path):
    version, root = unpacked
    engine = EngineSpec.parse(f"sglang=={version}")
    real = probe_mamba_exhaustion(hybrid, engine, LaunchFlags(), find_source(version, root))
    assert real.status is Status.FAIL and real.message == "AssertionError: Can not alloc mamba cache"
    assert any("prepare_for_caching_req donates via self._alloc_mamba_slot()" in e for e in real.evidence)
    patched = _copy(root, tmp_path)
    pa.patch_graceful(patched)
    good = probe_mamba_exhaustion(hybrid, engine, LaunchFlags(), find_source(version, patched))
    assert good.status is Status.OK and "all 3 sites" in good.summary
    off = probe_mamba_exhaustion(hybrid, engine, LaunchFlags(disable_radix_cache=True), find_source(version, root))
    assert off.status is Status.OK


def test_missing_source_is_unknown(hybrid, tmp_path):
    found = find_source("0.5.21", None, tmp_path)
    v = probe_mamba_exhaustion(hybrid, EngineSpec.parse("sglang==0.5.21"), LaunchFlags(), found)
    assert v.status is Status.UNKNOWN and any("no sglang-0.5.21-*.whl" in e for e in v.evidence)


def test_wheel_cache_lookup_and_version_mismatch(tmp_path):
    found = find_source("0.5.19", None, pa.WHEEL_CACHE)
    assert isinstance(found.tree, WheelSource) and found.version == "0.5.19"
    explicit = find_source("0.5.23", pa.sglang_wheel("0.5.19"))
    assert explicit.version == "0.5.19" and "not 0.5.23" in explicit.notes[0]


def test_sizing_constants_read_from_source(hybrid):
    tree = WheelSource(pa.sglang_wheel("0.5.23"))
    sizing = read_mamba_sizing(tree)
    assert (sizing.base, sizing.extra_overlap) == (3, 2)
    assert "Qwen3_5ForCausalLM" in sizing.extra_buffer_archs and "MiniCPMV4_7ForConditionalGeneration" in sizing.extra_buffer_archs
    assert any("kv_cache_configurator.py:227" in s and ":3141" in s for s in sizing.sources)
    v = probe_mamba_slots(hybrid, EngineSpec.parse("sglang==0.5.23"), LaunchFlags.parse("--max-mamba-cache-size 8"),
                          find_source("0.5.23", None, pa.WHEEL_CACHE))
    assert v.status is Status.WARN and any("overrides.py:403" in e for e in v.evidence)


def test_open_source_refuses_non_sources(tmp_path):
    with pytest.raises(SourceError):
        open_source(tmp_path)
    (tmp_path / "x.whl").write_bytes(b"not a zip")
    with pytest.raises(SourceError, match="not a readable wheel"):
        open_source(tmp_path / "x.whl")
