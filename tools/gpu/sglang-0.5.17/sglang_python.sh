#!/bin/bash
# The interpreter that has SGLang 0.5.17 as sglang_setup.sh unpacked it (/tmp/sgl), for the gate's own
# launches: `--engine-opt python=tools/gpu/sglang-0.5.17/sglang_python.sh`. It sets what sglang_live.sh
# sets for its servers (site-tf/ first: transformers 5.12.1 with its tokenizers; standins/ last: the
# deep_gemm stand-in; one JIT cache for every server) and runs python3 with the arguments given.
HERE=$(cd "$(dirname "$0")" && pwd)
SGL=${SGLANG_DIR:-/tmp/sgl}
export PYTHONPATH=$SGL/site-tf:$SGL/site:$HERE/standins PATH=$SGL/bin:$PATH \
       TVM_FFI_CACHE_DIR=${SGLANG_JIT_CACHE:-/tmp/specparity-sglang-live/tvm-ffi} SGLANG_ENABLE_JIT_DEEPGEMM=false \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 "$@"
