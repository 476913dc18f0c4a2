"""The checkpoint inspector: headers only, and hostile input refused with file + field + expectation."""

from __future__ import annotations

import ast
import json
import os
import struct
import time
from pathlib import Path

import pytest

import probe_artifacts as pa
from specparity.probes import checkpoints
from specparity.probes.checkpoints import CheckpointError, load_checkpoint, parse_quant_decl, read_safetensors_header


def test_sharded_checkpoint_reads_every_header(tmp_path):
    pa.dflash2_draft(tmp_path / "d")
    pa.dense_target(tmp_path / "t", shards=3)
    t = load_checkpoint(tmp_path / "t")
    assert t.weight_map is not None and len(set(t.weight_map.values())) == 3
    head = t.tensors["lm_head.weight"]
    assert (head.dtype, head.shape) == ("BF16", (pa.V, pa.H))
    assert head.file == t.weight_map["lm_head.weight"]
    d = load_checkpoint(tmp_path / "d")
    w, s = d.tensors["layers.1.mlp.down_proj.weight"], d.tensors["layers.1.mlp.down_proj.weight_scale_inv"]
    assert (w.dtype, w.shape) == ("F8_E4M3", (pa.H, pa.I))
    assert (s.dtype, s.shape) == ("F32", (2, 3))
    assert d.architectures == ["DFlash2DraftModel"]
    assert set(d.siblings("layers.1.mlp.down_proj")) == {"weight", "weight_scale_inv"}


def test_reads_header_without_touching_data(tmp_path):
    """A 16 GiB (sparse) shard is inspected in milliseconds: only the header is read."""
    n = 16 << 30
    header = json.dumps({"big": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    path = tmp_path / "model.safetensors"
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        fh.truncate(8 + len(header) + n)
    (tmp_path / "config.json").write_text("{}")
    t0 = time.perf_counter()
    ckpt = load_checkpoint(tmp_path)
    assert time.perf_counter() - t0 < 1.0
    assert ckpt.tensors["big"].shape == (n,)


def test_module_never_unpickles():
    """No pickle, no torch: the inspector cannot execute anything a checkpoint contains."""
    tree = ast.parse(Path(checkpoints.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"pickle", "torch", "dill", "joblib", "numpy"}
    assert "torch.load" not in ast.unparse(tree)


def _shard(tmp_path: Path, header, data: bytes = b"", length=None) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return pa.raw_safetensors(tmp_path / "model.safetensors", header, data, length)


OK_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "header, data, length, field, expected",
    [
        (b"{}", b"", 1 << 40, "header length", "exceeds the cap"),
        ({"a": OK_ENTRY}, bytes(8), 5000, "header length", "runs past the end"),
        (b"{not json", b"", None, "header", "invalid JSON"),
        (b"\xff\xfe{}", b"", None, "header", "not UTF-8"),
        (b"[1, 2]", b"", None, "header", "expected a JSON object"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', bytes(4), None, "header",
         "duplicate key"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4), None, "data_offsets",
         "outside the 4-byte data section"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(16), None, "data_offsets",
         "expected 16 for F32"),
        ({"a": OK_ENTRY, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), None,
         "data_offsets", "overlaps"),
        ({"a": {"dtype": "F8_E4M3X", "shape": [1], "data_offsets": [0, 1]}}, bytes(1), None, "dtype",
         "not a safetensors dtype"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b"", None, "shape", "non-negative"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, bytes(8), None, "data_offsets",
         "0 <= begin <= end"),
        ({"a": "x"}, b"", None, "tensor 'a'", "expected an object"),
        ({"__metadata__": {"k": 1}}, b"", None, "__metadata__", "string to string"),
    ],
)
def test_hostile_headers_are_refused(tmp_path, header, data, length, field, expected):
    _shard(tmp_path, header, data, length)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert "model.safetensors" in msg and field in msg and expected in msg, msg
    assert "\n" not in msg


def test_short_file_and_non_regular_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="expected at least 8"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="expected a regular file"):
        load_checkpoint(tmp_path)


def test_fifo_shard_is_not_opened(tmp_path):
    """A named pipe would block a naive reader forever."""
    (tmp_path / "config.json").write_text("{}")
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="regular file"):
        load_checkpoint(tmp_path)


def _index(tmp_path: Path, weight_map) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_index_naming_a_missing_shard(tmp_path):
    pa.dense_target(tmp_path, shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00009-of-00009.safetensors"
    _index(tmp_path, index["weight_map"])
    with pytest.raises(CheckpointError, match=r"model-00009-of-00009.safetensors.*does not exist"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub\\x.safetensors", ""])
def test_index_shard_outside_the_directory(tmp_path, shard):
    d = tmp_path / "ckpt"
    pa.dense_target(d)
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    _index(d, {"lm_head.weight": shard})
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        load_checkpoint(d)


def test_index_tensor_missing_from_its_shard(tmp_path):
    pa.dense_target(tmp_path)
    _index(tmp_path, {"lm_head.weight": "model.safetensors", "ghost.weight": "model.safetensors"})
    with pytest.raises(CheckpointError, match=r"weight_map\['ghost.weight'\].*not in the header"):
        load_checkpoint(tmp_path)


def test_index_weight_map_type(tmp_path):
    pa.dense_target(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    with pytest.raises(CheckpointError, match="weight_map: expected an object"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "content, expected", [(None, "file not found"), ("[]", "expected a JSON object"), ("{", "invalid JSON"),
                          ('{"a": 1, "a": 2}', "duplicate key")]
)
def test_config_json_problems(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert "config.json" in str(err.value) and expected in str(err.value)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "f").write_text("x")
    with pytest.raises(CheckpointError, match="expected a directory"):
        load_checkpoint(tmp_path / "f")


def test_quant_declarations():
    ct = parse_quant_decl({"quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"strategy": "block", "block_structure": [128, 128]}}},
        "ignore": ["lm_head", "re:.*self_attn\\.[qkv]_proj"]}}, {})
    assert (ct.strategy, ct.block_structure) == ("block", (128, 128))
    assert ct.covers("layers.0.mlp.down_proj") is True
    assert ct.covers("layers.0.self_attn.k_proj") is False and ct.covers("lm_head") is False
    gptq = parse_quant_decl({}, {"quantize_config.json": {"bits": 4, "group_size": 128, "lm_head": True}})
    assert (gptq.method, gptq.lm_head_flag, gptq.covers("lm_head")) == ("gptq", True, True)
    mo = parse_quant_decl({}, {"hf_quant_config.json": {"quantization": {"quant_algo": "NVFP4",
                                                                          "exclude_modules": ["lm_head", "*.mlp.gate"]}}})
    assert (mo.method, mo.algo, mo.covers("lm_head"), mo.covers("layers.3.mlp.gate")) == ("modelopt", "NVFP4", False, False)
    fp8 = parse_quant_decl({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                    "ignored_layers": ["layers.0.self_attn.q_proj"]}}, {})
    assert fp8.weight_block_size == (128, 128) and not fp8.covers("layers.0.self_attn.q_proj")
    assert fp8.covers("layers.1.self_attn.q_proj")
    assert parse_quant_decl({}, {}).method is None


def test_header_reader_reports_display_name(tmp_path):
    p = pa.raw_safetensors(tmp_path / "x.safetensors", b"{}", length=99)
    with pytest.raises(CheckpointError, match=r"^shard-7: header length"):
        read_safetensors_header(p, display_name="shard-7")
