#!/bin/bash
# `specparity arms` against live vLLM or SGLang launched by the gate on a GPU host, from the checkout's root:
#   [MODE=eager|graphs] tools/gpu/arms_live.sh vllm|sglang REPORT [specparity arms options ...]
# vLLM comes from /tmp/site (vllm-0.26.0/vllm_setup.sh), SGLang from /tmp/sgl (sglang-0.5.17/sglang_setup.sh)
# through sglang-0.5.17/sglang_python.sh. The host flags each engine needs here go into --engine-opt
# server_args, with SERVER_ARGS from the environment after them: vLLM a 2048-token context (an arm's own
# --max-model-len comes later and wins), --enforce-eager in eager mode; SGLang triton attention, pytorch
# sampling, 0.3 of the GPU per server, a 2048-token context, CUDA graphs off in eager mode (sglang-0.5.17/
# README.md says why). The options given (--preset, --target, --arms, ...) follow.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENGINE=${1:?engine: vllm or sglang}
REPORT=${2:?report folder}
shift 2
MODE=${MODE:-eager}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "$ENGINE" in
  vllm)
    SITE=${VLLM_SITE:-/tmp/site}
    export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:$PATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
    HOST="--max-model-len 2048"
    [ "$MODE" = eager ] && HOST="$HOST --enforce-eager"
    EXTRA=() ;;
  sglang)
    export PYTHONPATH=$ROOT
    HOST="--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.3 --context-length 2048 --mm-feature-transport cpu"
    [ "$MODE" = eager ] && HOST="$HOST --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
    EXTRA=(--engine-opt "python=$HERE/sglang-0.5.17/sglang_python.sh") ;;
  *) echo "arms_live: engine is vllm or sglang, not $ENGINE"; exit 4 ;;
esac
cd "$ROOT" && exec python3 -m specparity.cli.commands arms --engine "$ENGINE" --report "$REPORT" \
  --engine-opt "server_args=$HOST ${SERVER_ARGS:-}" "${EXTRA[@]}" "$@"
