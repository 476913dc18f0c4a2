"""Read what a checkpoint declares and stores without loading a single weight.

The probes must decide "will this engine load this draft correctly?" before anything is deployed,
often on a machine without the GPU the model needs. Everything they need is in the JSON files and
in the safetensors *headers* (an 8-byte little-endian length N, then N bytes of JSON naming every
tensor's dtype, shape and byte range). Tensor data is never read, and nothing is unpickled: a
checkpoint directory is untrusted input, so every length, offset and name is checked before use
and a malformed one is refused with an error that names the file, the field and what was expected.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterable

#: safetensors' own cap on the JSON header (``MAX_HEADER_SIZE`` in the reference reader).
MAX_HEADER_BYTES = 100_000_000
#: JSON side files (config, index, quant configs) larger than this are refused, not parsed.
MAX_JSON_BYTES = 64 * 1024 * 1024
#: safetensors dtype -> bits per element. Sub-byte types are packed.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "C64": 64,
}
DENSE_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
#: Tensor-name suffixes that sit next to a quantized ``weight`` (FP8 and other quantized checkpoints).
QUANT_SIBLINGS = (
    "weight_scale",
    "weight_scale_inv",
    "weight_scale_2",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
    "weight_packed",
    "weight_zero_point",
    "weight_shape",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
)
INDEX_FILE = "model.safetensors.index.json"
SIDE_QUANT_FILES = ("hf_quant_config.json", "quantize_config.json", "quant_config.json")


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or malformed.

    ``str(err)`` is one line naming the file, the field and what was expected, so the CLI can
    print it as is.
    """

    def __init__(self, file: str | os.PathLike[str], field_name: str, problem: str) -> None:
        self.file = str(file)
        self.field = field_name
        self.problem = problem
        super().__init__(f"{self.file}: {field_name}: {problem}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # shard file name, relative to the checkpoint directory
    offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_scalar(self) -> bool:
        return self.numel == 1 and len(self.shape) <= 1

    def describe(self) -> str:
        return f"{self.name}: {self.dtype} {list(self.shape)} ({self.file})"


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _regular_file(path: Path, field_name: str) -> int:
    """Size of ``path`` if it is a regular file (after symlinks); refuse devices, fifos, dirs."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointError(path, field_name, "file not found") from None
    except OSError as exc:
        raise CheckpointError(path, field_name, f"cannot stat ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(path, field_name, "expected a regular file")
    return st.st_size


def read_json_file(path: Path, what: str = "JSON document") -> dict[str, Any]:
    """A JSON object from ``path``; size-capped, duplicate keys refused, non-objects refused."""
    size = _regular_file(path, what)
    if size > MAX_JSON_BYTES:
        raise CheckpointError(path, what, f"{size} bytes, expected at most {MAX_JSON_BYTES}")
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError:
        raise CheckpointError(path, what, "not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(path, what, f"invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, what, f"expected a JSON object, got {type(data).__name__}")
    return data


def _expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return (math.prod(shape) * DTYPE_BITS[dtype] + 7) // 8


def read_safetensors_header(
    path: Path, *, display_name: str | None = None, max_header_bytes: int = MAX_HEADER_BYTES
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensors and ``__metadata__`` of one safetensors file, from its header only.

    Refuses: a file shorter than 8 bytes, a header length above ``max_header_bytes`` or past the
    end of the file, a header that is not UTF-8 JSON (or has duplicate keys), entries without a
    known dtype / integer shape / ``data_offsets`` pair, byte ranges outside the data section or
    of the wrong size for dtype×shape, and overlapping ranges.
    """
    name = display_name or path.name
    size = _regular_file(path, "safetensors file")
    if size < 8:
        raise CheckpointError(name, "header length", f"file is {size} bytes, expected at least 8")
    with path.open("rb") as fh:
        n = int.from_bytes(fh.read(8), "little", signed=False)
        if n > max_header_bytes:
            raise CheckpointError(name, "header length", f"{n} bytes exceeds the cap of {max_header_bytes}")
        if 8 + n > size:
            raise CheckpointError(name, "header length", f"{n} bytes runs past the end of the {size}-byte file")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError:
        raise CheckpointError(name, "header", "not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(name, "header", f"invalid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(name, "header", f"expected a JSON object, got {type(header).__name__}")
    data_len = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(name, "__metadata__", "expected an object of string to string")
    tensors: dict[str, TensorInfo] = {}
    for tname, entry in header.items():
        field_name = f"tensor {tname!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(name, field_name, "expected an object with dtype, shape, data_offsets")
        dtype = entry.get("dtype")
        if dtype not in DTYPE_BITS:
            raise CheckpointError(name, f"{field_name}.dtype", f"{dtype!r} is not a safetensors dtype")
        shape = entry.get("shape")
        if not isinstance(shape, list) or len(shape) > 16 or not all(
            type(d) is int and d >= 0 for d in shape
        ):
            raise CheckpointError(name, f"{field_name}.shape", f"{shape!r}, expected a list of non-negative ints")
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(name, f"{field_name}.data_offsets", f"{offsets!r}, expected [begin, end] with 0 <= begin <= end")
        if offsets[1] > data_len:
            raise CheckpointError(
                name, f"{field_name}.data_offsets", f"end {offsets[1]} is outside the {data_len}-byte data section"
            )
        want = _expected_nbytes(dtype, tuple(shape))
        if offsets[1] - offsets[0] != want:
            raise CheckpointError(
                name,
                f"{field_name}.data_offsets",
                f"spans {offsets[1] - offsets[0]} bytes, expected {want} for {dtype} {shape}",
            )
        tensors[tname] = TensorInfo(tname, dtype, tuple(shape), name, (offsets[0], offsets[1]))
    spans = sorted((t.offsets, t.name) for t in tensors.values() if t.offsets[1] > t.offsets[0])
    for (prev, prev_name), (cur, cur_name) in zip(spans, spans[1:]):
        if cur[0] < prev[1]:
            raise CheckpointError(name, f"tensor {cur_name!r}.data_offsets", f"overlaps {prev_name!r}")
    return tensors, metadata


def _inside(root: Path, rel: str) -> Path | None:
    """``root/rel`` if ``rel`` is a relative path that stays inside ``root``, else None."""
    if not rel or os.path.isabs(rel) or "\\" in rel:
        return None
    candidate = (root / rel).resolve()
    try:
        candidate.relative_to(root.resolve())
    except ValueError:
        return None
    return candidate


@dataclass
class QuantDecl:
    """What a checkpoint's JSON says about its quantization, normalised across formats.

    ``method`` is one of ``fp8`` (native), ``compressed-tensors``, ``modelopt``, ``gptq``, ``awq``,
    another ``quant_method`` string as written, or None (nothing declared).
    """

    method: str | None
    source: str = ""
    algo: str | None = None  # ModelOpt quant_algo (FP8, NVFP4 …)
    weight_block_size: tuple[int, int] | None = None
    strategy: str | None = None  # compressed-tensors weights.strategy of the group covering Linear
    block_structure: tuple[int, int] | None = None
    weight_bits: int | None = None
    activation_scheme: str | None = None
    ignore: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    lm_head_flag: bool | None = None  # GPTQ/AWQ ``lm_head`` key
    raw: dict[str, Any] = field(default_factory=dict)

    def _ignored(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif any(ch in pattern for ch in "*?["):
                if fnmatchcase(module, pattern):
                    return True
            elif module == pattern or module.startswith(pattern + ".") or f".{pattern}." in f".{module}.":
                return True
        return False

    def covers(self, module: str) -> bool | None:
        """Whether the declaration quantizes linear ``module`` (None: cannot tell)."""
        if self.method is None:
            return False
        if self._ignored(module):
            return False
        if self.method in ("gptq", "awq") and module.split(".")[-1] == "lm_head":
            return bool(self.lm_head_flag)
        if self.method == "compressed-tensors" and self.targets:
            for t in self.targets:
                if t == "Linear":
                    return True
                if t.startswith("re:") and re.match(t[3:], module):
                    return True
            return False
        return True


def _as_pair(value: Any) -> tuple[int, int] | None:
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value):
        return (value[0], value[1])
    return None


def _compressed_tensors_decl(qc: dict[str, Any], source: str) -> QuantDecl:
    decl = QuantDecl("compressed-tensors", source, raw=qc)
    decl.ignore = [str(x) for x in qc.get("ignore") or []]
    groups = qc.get("config_groups") or {}
    if isinstance(groups, dict):
        for group in groups.values():
            if not isinstance(group, dict):
                continue
            weights = group.get("weights") or {}
            decl.targets.extend(str(t) for t in group.get("targets") or [])
            if isinstance(weights, dict) and decl.strategy is None:
                decl.strategy = weights.get("strategy")
                decl.block_structure = _as_pair(weights.get("block_structure"))
                bits = weights.get("num_bits")
                decl.weight_bits = bits if type(bits) is int else None
            acts = group.get("input_activations")
            if isinstance(acts, dict) and decl.activation_scheme is None:
                decl.activation_scheme = "dynamic" if acts.get("dynamic", True) else "static"
    return decl


def parse_quant_decl(config: dict[str, Any], side_files: dict[str, dict[str, Any]]) -> QuantDecl:
    """Normalise ``quantization_config`` / ``hf_quant_config.json`` / ``quantize_config.json``."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        text = config.get("text_config")
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    source = "config.json:quantization_config"
    if not isinstance(qc, dict):
        if "hf_quant_config.json" in side_files:
            qc, source = {"quant_method": "modelopt", **side_files["hf_quant_config.json"]}, "hf_quant_config.json"
        elif "quantize_config.json" in side_files:
            qc, source = side_files["quantize_config.json"], "quantize_config.json"
        elif "quant_config.json" in side_files:
            qc, source = side_files["quant_config.json"], "quant_config.json"
        else:
            return QuantDecl(None)
    method = str(qc.get("quant_method") or "").lower() or None
    if method is None and ("bits" in qc or "w_bit" in qc):
        method = "awq" if "w_bit" in qc or "zero_point" in qc else "gptq"
    if method == "compressed-tensors":
        return _compressed_tensors_decl(qc, source)
    decl = QuantDecl(method, source, raw=qc)
    decl.activation_scheme = qc.get("activation_scheme")
    decl.weight_block_size = _as_pair(qc.get("weight_block_size"))
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    if method == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        decl.algo = inner.get("quant_algo")
        ignore = inner.get("exclude_modules") or ignore
    decl.ignore = [str(x) for x in ignore if isinstance(x, str)]
    if method in ("gptq", "awq"):
        flag = qc.get("lm_head")
        decl.lm_head_flag = flag if isinstance(flag, bool) else False
        bits = qc.get("bits", qc.get("w_bit"))
        decl.weight_bits = bits if type(bits) is int else None
    return decl


@dataclass
class Checkpoint:
    """A local model directory: its JSON files and the headers of its safetensors shards."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    weight_map: dict[str, str] | None = None
    side_files: dict[str, dict[str, Any]] = field(default_factory=dict)
    shard_metadata: dict[str, dict[str, str]] = field(default_factory=dict)
    gguf_files: list[str] = field(default_factory=list)

    @property
    def architectures(self) -> list[str]:
        archs = self.config.get("architectures")
        return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []

    def text_config(self) -> dict[str, Any]:
        """The language-model config: ``text_config`` over the top level for multimodal wrappers."""
        text = self.config.get("text_config")
        return {**self.config, **text} if isinstance(text, dict) else self.config

    def quant(self) -> QuantDecl:
        return parse_quant_decl(self.config, self.side_files)

    def get(self, name: str) -> TensorInfo | None:
        return self.tensors.get(name)

    def with_suffix(self, suffix: str) -> list[TensorInfo]:
        return [t for n, t in sorted(self.tensors.items()) if n == suffix or n.endswith("." + suffix)]

    def siblings(self, module: str) -> dict[str, TensorInfo]:
        """Tensors directly under ``module`` keyed by their last name component (``weight`` …)."""
        prefix = module + "." if module else ""
        out = {}
        for n, t in self.tensors.items():
            if n.startswith(prefix) and "." not in n[len(prefix):]:
                out[n[len(prefix):]] = t
        return out


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Inspect a local checkpoint directory (config, index, quant side files, shard headers).

    Raises :class:`CheckpointError` for anything missing or malformed; never reads tensor data.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(root, "checkpoint directory", "does not exist")
    if not root.is_dir():
        raise CheckpointError(root, "checkpoint directory", "expected a directory")
    config = read_json_file(root / "config.json", "config.json")
    side: dict[str, dict[str, Any]] = {}
    for fname in SIDE_QUANT_FILES:
        if (root / fname).exists():
            side[fname] = read_json_file(root / fname, fname)
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, dict[str, str]] = {}
    weight_map: dict[str, str] | None = None
    index_path = root / INDEX_FILE
    if index_path.exists():
        index = read_json_file(index_path, INDEX_FILE)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(index_path, "weight_map", "expected an object of tensor name to shard file name")
        weight_map = wm
        for shard in sorted(set(wm.values())):
            shard_path = _inside(root, shard)
            if shard_path is None:
                raise CheckpointError(index_path, f"weight_map shard {shard!r}", "expected a file name inside the checkpoint directory")
            if not shard_path.exists():
                raise CheckpointError(index_path, f"weight_map shard {shard!r}", "names a shard that does not exist")
            found, meta = read_safetensors_header(shard_path, display_name=shard)
            metadata[shard] = meta
            for tname, info in found.items():
                if tname in tensors:
                    raise CheckpointError(shard, f"tensor {tname!r}", f"also stored in {tensors[tname].file}")
                tensors[tname] = info
        for tname, shard in sorted(wm.items()):
            info = tensors.get(tname)
            if info is None or info.file != shard:
                raise CheckpointError(index_path, f"weight_map[{tname!r}]", f"tensor is not in the header of {shard}")
    else:
        for shard_path in sorted(root.glob("*.safetensors")):
            found, meta = read_safetensors_header(shard_path)
            metadata[shard_path.name] = meta
            for tname, info in found.items():
                if tname in tensors:
                    raise CheckpointError(shard_path.name, f"tensor {tname!r}", f"also stored in {tensors[tname].file}")
                tensors[tname] = info
    gguf = sorted(p.name for p in root.glob("*.gguf"))
    return Checkpoint(root, config, tensors, weight_map, side, metadata, gguf)


def module_of(tensor_name: str) -> str:
    """``layers.0.mlp.down_proj.weight`` -> ``layers.0.mlp.down_proj``."""
    return tensor_name.rsplit(".", 1)[0] if "." in tensor_name else ""


def iter_linear_weights(ckpt: Checkpoint) -> Iterable[TensorInfo]:
    """Every 2-D ``*.weight`` tensor: the candidates for linear layers."""
    for name, t in sorted(ckpt.tensors.items()):
        if name.endswith(".weight") and len(t.shape) == 2:
            yield t
