#!/bin/bash
# SGLang 0.5.17 servers for the fixture target and the lossless gate against them, eager mode, one GPU host.
# From the checkout's root, after sglang_setup.sh unpacked SGLang into /tmp/sgl:
#   tools/gpu/sglang-0.5.17/sglang_live.sh serve [NAME ...]     base ngram standalone dflash (default: all), each
#                                                               in its own process group; base first; waits for
#                                                               /health
#   tools/gpu/sglang-0.5.17/sglang_live.sh gate NAME [ARGS...]  the gate: base against NAME (ARGS go to pytest)
#   tools/gpu/sglang-0.5.17/sglang_live.sh stop
# EAGLE/EAGLE3 are not served: no EAGLE head exists for the fixture target (the fixtures hold a plain draft
# model and DFlash drafts only). DFlash2 (fixtures/models/dflash2) is not served: 0.5.17 has no DFlash2DraftModel.
# Every server runs --attention-backend triton (the FA3 library, sgl_kernel/flash_ops, is not brought) and
# --sampling-backend pytorch (no flashinfer JIT); SGLang's own JIT kernels (RMSNorm, SiLU-and-mul, RoPE, KV
# store, NGRAM's corpus) compile on a server's first forward pass into SGLANG_JIT_CACHE (default WORK/tvm-ffi),
# shared by the servers. That folder (a few MB) is valid on any sm_90 host with the same SGLang and tvm-ffi:
# carry it back and point SGLANG_JIT_CACHE at it to skip the builds next time.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
SGL=${SGLANG_DIR:-/tmp/sgl}
WORK=${SPECPARITY_LIVE_WORK:-/tmp/specparity-sglang-live}
T=$ROOT/fixtures/models
PORT_base=31000 PORT_ngram=31001 PORT_standalone=31002 PORT_dflash=31003
# eager (no CUDA graphs); a small KV pool each, so that every server fits one GPU side by side
COMMON=(--model-path "$T/target" --host 127.0.0.1 --attention-backend triton --sampling-backend pytorch
        --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled --context-length 2048
        --max-total-tokens 65536 --max-running-requests 32 --mem-fraction-static 0.1 --mm-feature-transport cpu)
ARGS_base=()
ARGS_ngram=(--speculative-algorithm NGRAM --speculative-num-draft-tokens 4)
ARGS_standalone=(--speculative-algorithm STANDALONE --speculative-draft-model-path "$T/draft"
                 --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
ARGS_dflash=(--speculative-algorithm DFLASH --speculative-draft-model-path "$T/dflash1")
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK/logs" "$WORK/reports" "$WORK/pgid"

health() { python3 -c "import sys,urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=5); sys.exit(0)" 2>/dev/null; }

start() {
  local names=("$@")
  for n in "${names[@]}"; do
    local port="PORT_$n" args="ARGS_$n[@]"
    [ -n "${!port:-}" ] || { echo "sglang_live: unknown server $n (base ngram standalone dflash)"; exit 4; }
    ( export PYTHONPATH=$SGL/site-tf:$SGL/site PATH=$SGL/bin:$PATH TVM_FFI_CACHE_DIR=${SGLANG_JIT_CACHE:-$WORK/tvm-ffi}
      cd "$WORK" && exec setsid python3 -m sglang.launch_server "${COMMON[@]}" --port "${!port}" "${!args}" \
        >"$WORK/logs/$n.log" 2>&1 ) &
    echo $! >"$WORK/pgid/$n"
    echo "sglang_live: $n on port ${!port}, log $WORK/logs/$n.log"
  done
  local t0=$(date +%s)
  for n in "${names[@]}"; do
    local port="PORT_$n"
    until health "${!port}"; do
      kill -0 "$(cat "$WORK/pgid/$n")" 2>/dev/null || { echo "sglang_live: $n exited"; tail -30 "$WORK/logs/$n.log"; break; }
      sleep 3
    done
    health "${!port}" && echo "sglang_live: $n healthy after $(( $(date +%s) - t0 )) s"
  done
}

serve() {
  local names=("$@") rest=() n; [ ${#names[@]} -eq 0 ] && names=(base ngram standalone dflash)
  for n in "${names[@]}"; do [ "$n" = base ] || rest+=("$n"); done
  # base first, alone: it builds the JIT kernels every server shares (two builds of one kernel in one
  # cache folder at once are not safe); the speculative servers then find them and build only their own
  [ ${#rest[@]} -lt ${#names[@]} ] && start base
  [ ${#rest[@]} -gt 0 ] && start "${rest[@]}"
  return 0
}

gate() {
  local n=$1; shift; local port="PORT_$n"
  [ -n "${!port:-}" ] && [ "$n" != base ] || { echo "sglang_live: gate needs one of ngram standalone dflash"; exit 4; }
  # the gate runs in the host's environment (SGLang's tree is for the servers only)
  cd "$ROOT" && PYTHONPATH=$ROOT python3 -m pytest suites/lossless -q -p no:cacheprovider --engine sglang \
    --baseline-url "http://127.0.0.1:$PORT_base" --spec-url "http://127.0.0.1:${!port}" \
    --engine-opt "tokenizer=$T/target" --report "$WORK/reports/$n" "$@" 2>&1 | tee "$WORK/logs/gate-$n.txt"
  return "${PIPESTATUS[0]}"
}

stop() {
  for f in "$WORK"/pgid/*; do
    [ -f "$f" ] && { kill -- -"$(cat "$f")" 2>/dev/null; rm -f "$f"; }
  done
  echo "sglang_live: stopped"
}

cmd=${1:-}; shift || true
case "$cmd" in
  serve) serve "$@" ;;
  gate) gate "$@" ;;
  stop) stop ;;
  *) sed -n 2,9p "$0"; exit 4 ;;
esac
