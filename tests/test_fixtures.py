"""The committed fixture models are the ones the manifest names, and stay small."""

from __future__ import annotations

from specparity.model.locations import MANIFEST, MODELS, verify_manifest

LIMIT_BYTES = 25 * 1024 * 1024


def test_manifest_matches_every_fixture_file():
    assert verify_manifest() == []
    listed = {line.split(maxsplit=1)[1].lstrip("*").strip() for line in MANIFEST.read_text().splitlines() if line.strip()}
    on_disk = {str(p.relative_to(MANIFEST.parent)) for p in MODELS.rglob("*") if p.is_file()}
    assert on_disk <= listed, f"fixture files missing from the manifest: {sorted(on_disk - listed)}"


def test_fixtures_stay_under_the_size_budget():
    # committed bytes: a link to the shared tokenizer costs nothing
    total = sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file() and not p.is_symlink())
    assert total < LIMIT_BYTES, f"{total / 2**20:.1f} MiB of fixtures"


def test_manifest_mismatch_is_reported(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x")
    manifest = tmp_path / "MANIFEST.sha256"
    manifest.write_text("0" * 64 + "  a.bin\n" + "garbage\n")
    problems = verify_manifest(manifest)
    assert len(problems) == 2 and "sha256" in problems[0] and ":2: expected" in problems[1]
