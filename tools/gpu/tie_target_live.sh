#!/bin/bash
# The tie-dense target (tests/tie_model.py: the fixture target with near-twin embedding rows, so that bf16
# logits tie exactly or differ by one ulp at most positions) gated live on vLLM with n-gram speculation
# (--preset vllm-ngram, both servers launched by the gate), in eager and CUDA-graph mode: the exact ties,
# their tie-breaking, the one-ulp flips and the near-tie budget from the data, on a real GPU engine.
# From the checkout's root on a GPU host where tools/gpu/vllm-0.26.0/vllm_setup.sh installed vLLM:
#   tools/gpu/tie_target_live.sh OUTDIR [eager] [graphs]          (default: both modes)
# Each mode writes OUTDIR/ties-MODE.txt (the gate's console) and OUTDIR/ties-MODE/ (its reports and journal).
set -u
OUT=${1:?usage: tools/gpu/tie_target_live.sh OUTDIR [eager] [graphs]}; shift
MODES=${*:-eager graphs}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
SITE=${VLLM_SITE:-/tmp/site}
[ -d "$SITE/vllm" ] && export PYTHONPATH=$SITE:$ROOT PATH=$SITE/bin:$PATH || export PYTHONPATH=$ROOT
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
TARGET=${TIE_TARGET:-/tmp/specparity-tie-target}
cd "$ROOT" || exit 1
mkdir -p "$OUT"
[ -d "$TARGET" ] || python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); \
from tie_model import build_tie_model; build_tie_model(Path('$TARGET'))" || exit 1
for mode in $MODES; do
  extra="--max-model-len 2048"
  [ "$mode" = eager ] && extra="--enforce-eager $extra"
  python3 -m specparity.cli.commands run --engine vllm --preset vllm-ngram --target "$TARGET" \
    --engine-opt "server_args=$extra" --engine-opt startup_timeout=300 --report "$OUT/ties-$mode" \
    > "$OUT/ties-$mode.txt" 2>&1
  echo "TIES $mode: rc=$? $(head -n 1 "$OUT/ties-$mode.txt")"
done
