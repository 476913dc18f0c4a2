#!/usr/bin/env bash
# Builds the parts that bring SGLang 0.5.17 to a GPU host without network (Python 3.12, torch 2.11.0+cu130,
# transformers 5.17.0, triton 3.6.0, numpy 2.5.2, nvcc 13.0 already there). SGLang 0.5.17 is the newest SGLang
# that pins torch 2.11.0. Run from the project's root on a machine with network:
#
#   bash tools/gpu/sglang-0.5.17/sglang_bundle.sh [OUTDIR]    # default OUTDIR .gpu/sglang (keep it git-ignored)
#
# One tree is packed (tar | xz -9e) and split into equal parts OUTDIR/pN/sglang.part-* of at most PART_MB, so each travels
# beside the checkout within one 64 MiB transfer; sglang_setup.sh gathers them and unpacks once all are there.
#
# The tree (what `python -m sglang.launch_server` of a dense bf16 Qwen3 model imports with NGRAM, STANDALONE,
# EAGLE or DFLASH and --attention-backend triton --sampling-backend pytorch; README.md says how it was found):
#   site/      sglang (trimmed), sgl_kernel (trimmed), flashinfer (python only), xgrammar (no static library),
#              and the dependency wheels below, unpacked
#   site-tf/   transformers 5.12.1 (SGLang's pin) with tokenizers 0.22.2 (5.12.1 refuses the host's 0.23.x)
#
# Trimmed, and why:
#   sglang-kernel 0.4.5 (1150 MB unpacked): flash_ops.abi3.so (1071 MB; FA3, the default attention backend on
#     Hopper, imported only by the fa3 backend: the servers run --attention-backend triton), sm100/ (Blackwell
#     common_ops; sm90/common_ops is the one an H200 loads), infllm_ops (28 MB; InfLLM-V2 sparse attention,
#     loaded on first use), flashmla_ops (14 MB; MLA models only).
#   sglang 0.5.17 (70 MB): multimodal_gen/ (diffusion serving), srt/server/_core.so (Rust HTTP front end, only
#     with SGLANG_RUST_SERVER=1), srt/grpc/_core.so (only with --grpc-port).
#   flashinfer-python 0.6.15.post1 (75 MB): data/cutlass, data/cccl, data/spdlog (headers for flashinfer's own
#     JIT; the triton attention backend and the pytorch sampler never call it; flashinfer is still imported).
#   xgrammar 0.2.1 (113 MB): lib/libxgrammar.a and include/ (a static library for C++ builds).
# Not brought at all (SGLang requires them, a dense bf16 launch does not import them): sgl-deep-gemm, flash-attn-4,
# tilelang, helion, humming-kernels, quack-kernels, tokenspeed_mla, torchao, torch_memory_saver, kernels,
# outlines, numba 0.65.1 (the host's numba is not imported on this path), cuda-python, nvidia-cutlass-dsl.
set -euo pipefail
OUT="${1:-.gpu/sglang}"
WORK="${SGLANG_BUNDLE_WORK:-/tmp/sgb}"
WHEEL_DIR="${SGLANG_WHEEL_DIR:-/tmp/sgw}"
PART_MB="${SGLANG_PART_MB:-34}"   # MiB, the most one part may weigh
PY="${SGLANG_BUNDLE_PYTHON:-python3}"
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
# SGLang and the GPU packages it pins (sglang-0.5.17.dist-info/METADATA Requires-Dist).
MAIN=(sglang==0.5.17 sglang-kernel==0.4.5 flashinfer_python==0.6.15.post1 xgrammar==0.2.1 apache-tvm-ffi==0.1.11)
# Module-level imports of the launch path that the host lacks or may lack, with what they import in turn.
# openai 2.6.1 is SGLang's pin; torchvision 0.26.0 is the one built for torch 2.11.0 (cu130), imported by
# sglang.srt.utils.common; IPython by sglang.utils (via the weight loader); ninja is the build tool of SGLang's
# JIT kernels (tvm-ffi runs `ninja` from PATH; sglang_setup.sh links it into /tmp/sgl/bin).
DEPS=(aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated_types==0.8.0 anyio==4.16.0
      asttokens==3.0.2 attrs==26.1.0 certifi==2026.10.19.post1 cffi==2.1.1 charset_normalizer==3.5.3 click==8.5.1
      compressed_tensors==0.20.1 decorator==5.3.1 dill==0.4.1 distro==1.9.0 einops==0.8.2 executing==2.3.0
      fastapi==0.136.3 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0 httpcore==1.0.9 httpx==0.28.1 idna==3.20
      ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 jsonschema==4.26.0
      jsonschema_specifications==2025.9.1 loguru==0.7.3 matplotlib_inline==0.2.2 msgspec==0.23.0 multidict==7.2.1
      nvidia_ml_py==13.615.71 openai==2.6.1 orjson==3.13.0 parso==0.8.7 partial_json_parser==0.2.1.1.post7
      pexpect==4.9.0 pillow==13.0.0 prometheus_client==0.26.0 prompt_toolkit==3.0.53 propcache==0.5.4 psutil==7.2.2
      ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5
      pygments==2.21.0 python_multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 requests==2.34.2
      rpds_py==2026.9.1 sentencepiece==0.2.3 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.14.0 stack_data==0.6.3
      starlette==1.10.0 torchvision==0.26.0 traitlets==5.16.1 typing_extensions==4.16.0 typing_inspection==0.4.5
      urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 wcwidth==0.9.4 yarl==1.25.1 zstandard==0.25.0
      ninja==1.13.2)
TF=(transformers==5.12.1 tokenizers==0.22.2)

mkdir -p "$WHEEL_DIR/main" "$WHEEL_DIR/deps" "$WHEEL_DIR/tf"
dl() { local d=$1; shift; "$PY" -m pip download -q "${PLAT[@]}" -d "$d" "$@" 2>&1 | { grep -v "is ignored" || true; }; }
dl "$WHEEL_DIR/main" "${MAIN[@]}"
dl "$WHEEL_DIR/deps" "${DEPS[@]}"
dl "$WHEEL_DIR/tf" "${TF[@]}"

rm -rf "$WORK" && mkdir -p "$WORK/tree/site" "$WORK/tree/site-tf"
S="$WORK/tree/site"
un() { unzip -q -o "$1" -d "$S" "${@:2}"; }
un "$WHEEL_DIR"/main/sglang-0.5.17-*.whl -x 'sglang/multimodal_gen/*' 'sglang/srt/server/_core*' 'sglang/srt/grpc/_core*'
un "$WHEEL_DIR"/main/sglang_kernel-0.4.5-*.whl -x 'sgl_kernel/flash_ops*' 'sgl_kernel/sm100/*' 'sgl_kernel/infllm_ops*' \
   'sgl_kernel/flashmla_ops*'
un "$WHEEL_DIR"/main/flashinfer_python-0.6.15.post1-*.whl -x 'flashinfer/data/cutlass/*' 'flashinfer/data/cccl/*' \
   'flashinfer/data/spdlog/*'
un "$WHEEL_DIR"/main/xgrammar-0.2.1-*.whl -x 'xgrammar/lib/*' 'xgrammar/include/*'
un "$WHEEL_DIR"/main/apache_tvm_ffi-0.1.11-*.whl
for w in "$WHEEL_DIR"/deps/*.whl; do un "$w"; done
for w in "$WHEEL_DIR"/tf/*.whl; do unzip -q -o "$w" -d "$WORK/tree/site-tf"; done
# console scripts are not unpacked from wheels; the launch is `python3 -m sglang.launch_server`
find "$WORK/tree" -name __pycache__ -prune -exec rm -rf {} +

echo "== what each wheel weighs (compressed wheel / unpacked / brought unpacked), MB"
for w in "$WHEEL_DIR"/main/*.whl "$WHEEL_DIR"/tf/*.whl; do
  printf "%-60s %7.1f %8.1f\n" "$(basename "$w" | cut -d- -f1-2)" "$(du -m --apparent-size "$w" | cut -f1)" \
    "$(unzip -l "$w" | tail -1 | awk '{printf "%.1f", $1/1048576}')"
done
printf "%-60s %7.1f\n" "dependency wheels (${#DEPS[@]})" "$(du -cm --apparent-size "$WHEEL_DIR"/deps/*.whl | tail -1 | cut -f1)"
for d in "$S"/sglang "$S"/sgl_kernel "$S"/flashinfer "$S"/xgrammar "$S" "$WORK/tree/site-tf"; do du -sm --apparent-size "$d"; done

rm -rf "$OUT" && mkdir -p "$OUT"
(cd "$WORK/tree" && tar -cf - site site-tf) | xz -9e -T2 >"$WORK/sglang.tar.xz"
# as few parts as PART_MB allows, of equal size
size=$(stat -c %s "$WORK/sglang.tar.xz"); max=$(( PART_MB * 1024 * 1024 ))
(cd "$WORK" && split -n $(( (size + max - 1) / max )) -d -a 1 sglang.tar.xz sglang.part-)
n=0
for p in "$WORK"/sglang.part-*; do
  n=$((n + 1)); mkdir -p "$OUT/p$n"; mv "$p" "$OUT/p$n/"
done
sha256sum "$OUT"/p*/sglang.part-* | sed "s#$OUT/p[0-9]*/##" >"$OUT/p$n/SHA256SUMS"
echo "$n" >"$OUT/p$n/NPARTS"
echo "== parts (each travels beside the checkout; each transfer must stay under 64 MiB)"
du -m --apparent-size "$OUT"/p*/sglang.part-*
