#!/bin/bash
# The lossless gate against live vLLM servers on a GPU host (tools/gpu/README.md). From the checkout's root:
#   tools/gpu/vllm_live.sh serve            start every server of the plan, wait for /health
#   tools/gpu/vllm_live.sh run [--background] [--concurrency 1,8,32]
#   tools/gpu/vllm_live.sh wait             until a background run finished
#   tools/gpu/vllm_live.sh table            WORK/table.md from the journals
#   tools/gpu/vllm_live.sh stop
# vLLM comes from the environment, or from /tmp/site where tools/gpu/vllm-0.26.0/vllm_setup.sh installed it.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SITE=${VLLM_SITE:-/tmp/site}
if [ -d "$SITE/vllm" ]; then
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
# flashinfer is not part of the 0.26.0 bundle: vLLM's top-k/top-p sampler imports it unless this is 0
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT" && exec python3 "$HERE/vllm_live.py" "$@"
