#!/usr/bin/env bash
# Builds the parts that bring vLLM 0.26.0 to a GPU host without network (Python 3.12, torch 2.11.0+cu130,
# transformers 5.17.0, triton 3.6.0, numba 0.68.0, numpy 2.5.2 already there; vLLM 0.26.0 pins torch 2.11.0
# and is built for CUDA 13.0). Run from the project's root:
#
#   bash tools/gpu/vllm-0.26.0/vllm_bundle.sh [OUTDIR]      # default OUTDIR .gpu/vllm (keep it git-ignored)
#
#   OUTDIR/p1a/vllm_C.part-aa  ~28 MB \ vllm/_C_stable_libtorch.abi3.so (78.8 MB, imported unconditionally by
#   OUTDIR/p1b/vllm_C.part-ab  ~28 MB /  vllm/platforms/cuda.py), tar | xz -9e, split in two
#   OUTDIR/p2/vllm_py.tar.xz   14.6 MB  the rest of the vllm wheel, trimmed (below), with vllm_flash_attn's FA3
#   OUTDIR/p2/whl/             18 MB    34 dependency wheels the host lacks (list below)
#
# Each part fits a 64 MiB transfer beside the checkout (~25 MB); vllm_setup.sh copies each arriving part
# to /tmp/vparts and, once all three are there, installs into /tmp/site.
#
# Trimmed out of the wheel (730 MB unpacked): vllm_flash_attn/_vllm_fa2_C (305 MB; optional import, Hopper uses
# FA3), _moe_C_stable_libtorch (48 MB; optional import, dense model), vllm-rs (43 MB; only with
# VLLM_USE_RUST_FRONTEND=1), third_party/deep_gemm and third_party/fmha_sm100 (65 MB; fp8 / sm100 only;
# has_deep_gemm() then says False). Nothing else.
# Every vLLM process needs VLLM_USE_FLASHINFER_SAMPLER=0 (flashinfer is not brought; vLLM 0.26 imports it
# unconditionally for the top-k/top-p sampler unless that variable is 0) -- tools/gpu/vllm_live.sh exports it.
set -euo pipefail
OUT="${1:-.gpu/vllm}"
WORK="${VLLM_BUNDLE_WORK:-/tmp/vb}"
WHEEL_DIR="${VLLM_WHEEL_DIR:-/tmp/vw}"
WHEEL="$WHEEL_DIR/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
P2="$OUT/p2"
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
# What `vllm serve` of a dense Qwen3 model imports that the GPU host does not have. Found by importing
# vllm.entrypoints.cli.main / openai.api_server / v1.engine.core / v1.worker.gpu_model_runner /
# model_executor.models.qwen3 / v1.spec_decode.{ngram_proposer,draft_model,eagle} in a local CPU venv that mirrors
# the GPU host, adding the missing package each time. Pins: xgrammar 0.2.7 is the newest that accepts vLLM's
# apache-tvm-ffi==0.1.10 (0.2.8+ need >=0.1.11 and fail at import); openai <3 (vLLM asks >=2; 3.x is untested).
DEPS=(annotated_types==0.8.0 apache_tvm_ffi==0.1.10 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 distro==1.9.0
      fastapi==0.136.3 httptools==0.9.0 ijson==3.6.0 jiter==0.19.0 jmespath==1.1.0 llguidance==1.7.6
      model_hosting_container_standards==0.1.16 msgspec==0.23.0 openai==2.54.0 openai_harmony==0.0.8
      partial_json_parser==0.2.1.1.post7 prometheus_fastapi_instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4
      pydantic_core==2.50.5 python_dotenv==1.2.4 python_json_logger==4.2.0 python_multipart==0.0.34 pyzmq==27.3.0
      setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 typing_extensions==4.16.0 typing_inspection==0.4.5
      uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7)

mkdir -p "$WORK" "$WHEEL_DIR" "$OUT/p1a" "$OUT/p1b" "$P2"
if [ ! -f "$WHEEL" ]; then
  python3 -m pip download "${PLAT[@]}" -d "$WHEEL_DIR" vllm==0.26.0
fi
rm -rf "$WORK/full" "$WORK/trim"
mkdir -p "$WORK/full" "$WORK/trim"
(cd "$WORK/full" && unzip -q "$WHEEL")
(cd "$WORK/full" && tar -cf - vllm/_C_stable_libtorch.abi3.so) | xz -9e -T2 | split -b 28M - "$WORK/vllm_C.part-"
mv "$WORK/vllm_C.part-aa" "$OUT/p1a/"; mv "$WORK/vllm_C.part-ab" "$OUT/p1b/"
(cd "$WORK/full" && tar -cf - --exclude=vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
    --exclude=vllm/_C_stable_libtorch.abi3.so --exclude=vllm/_moe_C_stable_libtorch.abi3.so \
    --exclude=vllm/vllm-rs --exclude=vllm/third_party/deep_gemm --exclude=vllm/third_party/fmha_sm100 \
    --exclude='__pycache__' vllm vllm-0.26.0.dist-info) | xz -9 -T2 >"$P2/vllm_py.tar.xz"
rm -rf "$P2/whl" && mkdir -p "$P2/whl"
python3 -m pip download -q "${PLAT[@]}" -d "$P2/whl" "${DEPS[@]}" 2>&1 | { grep -v "is ignored" || true; }
du -sm "$OUT"/p1a "$OUT"/p1b "$P2"
echo "each part plus the checkout must stay under 64 MiB"
