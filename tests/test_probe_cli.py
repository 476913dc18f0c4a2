"""``specparity probe``: one table, exit 1 on a predicted failure, one line + exit 4 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import probe_artifacts as pa
from specparity.cli.commands import main

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return {
        "target": pa.dense_target(d / "target", shards=2),
        "hybrid": pa.hybrid_target(d / "hybrid"),
        "fp8_head": pa.fp8_head_target(d / "fp8_head"),
        "draft": pa.dflash2_draft(d / "draft"),
        "draft_old_config": pa.dflash2_draft(d / "draft_old", stored="block128", declared="per_tensor"),
        "draft_as_v1": pa.dflash2_draft(d / "draft_v1", arch="DFlashDraftModel"),
    }


def probe(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["probe", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_passing_pair_prints_one_table_and_exits_zero(capsys, dirs):
    code, out, err = probe(capsys, "--target", dirs["target"], "--draft", dirs["draft"], "--engine", "sglang==0.5.19")
    assert code == 0, out
    assert err == ""
    for name in ("lm-head", "draft-fp8-scales", "dflash2-format", "mamba-slots", "mamba-exhaustion"):
        assert name in out
    assert "FAIL" not in out and out.count("OK:") == 5
    assert "| probe" in out and "what to do" in out


def column(table: str, index: int) -> str:
    """The text of one table column, cells joined (rich wraps long cells over several lines)."""
    cells = [line.split("|")[index].strip() for line in table.splitlines()
             if line.startswith("|") and not set(line) <= set("|-+ ")]
    return " ".join(c for c in cells if c)


def test_failing_pair_exits_one_with_evidence(capsys, dirs):
    code, out, _ = probe(capsys, "--target", dirs["fp8_head"], "--draft", dirs["draft_old_config"],
                         "--engine", "vllm==0.11.0")
    assert code == 1
    verdicts = " ".join(column(out, 2).split())
    assert "FAIL: quantized target head (fp8-block)" in verdicts
    assert "engine says: DFlash2 requires an unquantized target LM head for candidate TopK; got Fp8LinearMethod." in verdicts
    assert "will load but accept ~nothing" in verdicts
    evidence = column(out, 3).replace(" ", "")
    assert "lm_head.weight:F8_E4M3[512,256]" in evidence
    assert "layers.0.mlp.down_proj.weight_scale_inv:F32[2,3]" in evidence


def test_json_format(capsys, dirs):
    code, out, _ = probe(capsys, "--target", dirs["target"], "--draft", dirs["draft_as_v1"], "--engine",
                         "sglang==0.5.19", "--format", "json")
    data = json.loads(out)
    assert code == 1
    by = {v["probe"]: v for v in data}
    assert by["dflash2-format"]["status"] == "fail" and "DFlash v1" in by["dflash2-format"]["summary"]
    assert by["lm-head"]["status"] == "ok"


@pytest.mark.registry
def test_hybrid_with_field_report_flags_warns_and_reads_source(capsys, dirs):
    pa.sglang_wheel("0.5.19")  # cached once with pip download; read offline, never installed
    code, out, _ = probe(capsys, "--target", dirs["hybrid"], "--draft", dirs["draft"], "--engine", "sglang==0.5.19",
                         "--launch-flags", "--speculative-algorithm DFLASH --max-mamba-cache-size 8",
                         "--wheel-cache", pa.WHEEL_CACHE, "--format", "json")
    by = {v["probe"]: v for v in json.loads(out)}
    assert code == 1
    assert by["mamba-slots"]["status"] == "warn" and "capped to 1" in by["mamba-slots"]["message"]
    assert by["mamba-exhaustion"]["status"] == "fail"
    assert any("mamba_component.py:493 MambaComponent._alloc_mamba_slot" in e and "at :499" in e
               for e in by["mamba-exhaustion"]["evidence"])


def _hostile(tmp_path: Path) -> Path:
    pa.raw_safetensors(tmp_path / "model.safetensors", b"{}", length=1 << 40)
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("case", ["hostile", "missing", "bad-engine", "unknown-engine", "bad-flags", "bad-source"])
def test_bad_input_is_one_line_exit_four(capsys, dirs, tmp_path, case):
    args = {"target": dirs["target"], "draft": dirs["draft"], "engine": "sglang==0.5.19"}
    extra: list[str] = []
    if case == "hostile":
        args["draft"] = _hostile(tmp_path)
    elif case == "missing":
        args["target"] = tmp_path / "nowhere"
    elif case == "bad-engine":
        args["engine"] = "sglang-0.5.19"
    elif case == "unknown-engine":
        args["engine"] = "tgi==2.0"
    elif case == "bad-flags":
        extra = ["--launch-flags", "--page-size big"]
    elif case == "bad-source":
        extra = ["--sglang-source", tmp_path]
    code, out, err = probe(capsys, "--target", args["target"], "--draft", args["draft"], "--engine", args["engine"], *extra)
    assert code == 4 and out == ""
    assert err.count("\n") == 1 and err.startswith("specparity: error: ") and "Traceback" not in err


def test_console_script_on_hostile_input(tmp_path, dirs):
    """The installed entry point, in a real process: one line on stderr, no traceback."""
    exe = Path(sys.executable).with_name("specparity")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "specparity.cli.commands"]
    proc = subprocess.run([*cmd, "probe", "--target", str(dirs["target"]), "--draft", str(_hostile(tmp_path)),
                           "--engine", "sglang==0.5.19"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("header length: 1099511627776 bytes exceeds the cap of 100000000")


def test_live_engine_probes_from_the_cli(capsys, dirs, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    code, out, _ = probe(capsys, "--target", dirs["target"], "--draft", dirs["draft"], "--engine", "sglang==0.5.19",
                         "--live-engine", "probe_artifacts:misscaled_draft_engine", "--format", "json")
    by = {v["probe"]: v for v in json.loads(out)}
    assert code == 1
    assert by["first-decode"]["status"] == "ok"
    assert by["acceptance-floor"]["status"] == "fail" and "silently rejected" in by["acceptance-floor"]["summary"]
