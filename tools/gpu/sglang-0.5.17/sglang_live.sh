#!/bin/bash
# SGLang 0.5.17 servers for the fixture target and the lossless gate against them, one GPU host.
# From the checkout's root, after sglang_setup.sh unpacked SGLang into /tmp/sgl:
#   [MODE=graphs] tools/gpu/sglang-0.5.17/sglang_live.sh serve [NAME ...]
#        base ngram standalone eagle3 dflash (default: all), each in its own process group; base first; waits
#        for /health. MODE=eager (default) disables CUDA graphs; MODE=graphs keeps SGLang's default (CUDA
#        graphs for decode and for the draft); the two modes use separate ports and can run side by side.
#   [MODE=graphs] tools/gpu/sglang-0.5.17/sglang_live.sh gate NAME [ARGS...]
#        the gate: base against NAME of the same mode (ARGS go to pytest, e.g. --concurrency 1); the report
#        lands in WORK/reports/MODE-NAME[-TAG] (TAG from the environment, e.g. TAG=c1)
#   [MODE=graphs] [LEVELS="1 8 32"] tools/gpu/sglang-0.5.17/sglang_live.sh matrix NAME ...
#        for each NAME: the gate at each concurrency level (reports MODE-NAME-cN), then
#        `specparity compare --old-side spec` of the lowest level against each higher one; one line per run
#   tools/gpu/sglang-0.5.17/sglang_live.sh pack OUTDIR      OUTDIR/sglang-live.tar.gz: reports, logs (no server
#                                                           weights), and the JIT cache as its own tarball
#   tools/gpu/sglang-0.5.17/sglang_live.sh stop
# EAGLE3 serves fixtures/models/eagle3 through a copy whose eagle_aux_hidden_state_layer_ids are shifted by
# one: the head names the target layers in vLLM's convention (id k = the hidden state entering layer k),
# SGLang 0.5.17 reads id k as the state leaving layer k (its Qwen3 model captures before layer k+1).
# DFLASH serves fixtures/models/dflash1, whose target_layer_ids include the target's last layer (3 of 0-3):
# SGLang 0.5.17 captures "before layer k+1" and never reaches layer 4 of 4, so the draft receives two
# features instead of three and the server dies on its first forward pass (docs/SERVERS.md).
# DFlash2 (fixtures/models/dflash2) is not served: 0.5.17 has no DFlash2DraftModel.
# standins/ (last on the servers' path) holds a deep_gemm stand-in: the draft's CUDA-graph capture imports
# the DeepSeek sparse-attention backends, which import deep_gemm (not in the bundle); see its docstring.
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
# TARGET: the model every server serves and the gate tokenizes with (default the fixture target; e.g. the
# tie-dense copy that tests/tie_model.py writes)
TARGET=${TARGET:-$T/target}
MODE=${MODE:-eager}
case "$MODE" in eager) P0=31000 ;; graphs) P0=31100 ;; *) echo "sglang_live: MODE is eager or graphs, not $MODE"; exit 4 ;; esac
PORT_base=$P0 PORT_ngram=$((P0 + 1)) PORT_standalone=$((P0 + 2)) PORT_dflash=$((P0 + 3)) PORT_eagle3=$((P0 + 4))
# a small KV pool each, so that every server fits one GPU side by side
COMMON=(--model-path "$TARGET" --host 127.0.0.1 --attention-backend triton --sampling-backend pytorch
        --context-length 2048 --max-total-tokens 65536 --max-running-requests 32 --mem-fraction-static 0.1
        --mm-feature-transport cpu)
[ "$MODE" = eager ] && COMMON+=(--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled)
ARGS_base=()
ARGS_ngram=(--speculative-algorithm NGRAM --speculative-num-draft-tokens 4)
ARGS_standalone=(--speculative-algorithm STANDALONE --speculative-draft-model-path "$T/draft"
                 --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
ARGS_dflash=(--speculative-algorithm DFLASH --speculative-draft-model-path "$T/dflash1")
ARGS_eagle3=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$WORK/eagle3-sglang"
             --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK/logs" "$WORK/reports" "$WORK/pgid"

# the EAGLE-3 head with its layer ids in SGLang's convention (see the header)
eagle3_copy() {
  mkdir -p "$WORK/eagle3-sglang" && cp "$T/eagle3/model.safetensors" "$WORK/eagle3-sglang/" &&
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); e=c['eagle_config']; \
e['eagle_aux_hidden_state_layer_ids']=[k-1 for k in e['eagle_aux_hidden_state_layer_ids']]; \
c['eagle_aux_hidden_state_layer_ids']=e['eagle_aux_hidden_state_layer_ids']; \
json.dump(c, open(sys.argv[2], 'w'), indent=2)" "$T/eagle3/config.json" "$WORK/eagle3-sglang/config.json"
}

health() { python3 -c "import sys,urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=5); sys.exit(0)" 2>/dev/null; }

start() {
  local names=("$@")
  for n in "${names[@]}"; do
    local port="PORT_$n" args="ARGS_$n[@]"
    [ -n "${!port:-}" ] || { echo "sglang_live: unknown server $n (base ngram standalone eagle3 dflash)"; exit 4; }
    [ "$n" = eagle3 ] && eagle3_copy
    # SGLANG_ENABLE_JIT_DEEPGEMM=false: with the deep_gemm stand-in importable SGLang would otherwise enable DeepGEMM
    ( export PYTHONPATH=$SGL/site-tf:$SGL/site:$HERE/standins PATH=$SGL/bin:$PATH TVM_FFI_CACHE_DIR=${SGLANG_JIT_CACHE:-$WORK/tvm-ffi} \
             SGLANG_ENABLE_JIT_DEEPGEMM=false
      cd "$WORK" && exec setsid python3 -m sglang.launch_server "${COMMON[@]}" --port "${!port}" "${!args}" \
        >"$WORK/logs/$MODE-$n.log" 2>&1 ) &
    echo $! >"$WORK/pgid/$MODE-$n"
    echo "sglang_live: $MODE $n on port ${!port}, log $WORK/logs/$MODE-$n.log"
  done
  local t0=$(date +%s)
  for n in "${names[@]}"; do
    local port="PORT_$n"
    until health "${!port}"; do
      kill -0 "$(cat "$WORK/pgid/$MODE-$n")" 2>/dev/null || { echo "sglang_live: $MODE $n exited"; tail -30 "$WORK/logs/$MODE-$n.log"; break; }
      sleep 3
    done
    health "${!port}" && echo "sglang_live: $MODE $n healthy after $(( $(date +%s) - t0 )) s"
  done
}

serve() {
  local names=("$@") rest=() n; [ ${#names[@]} -eq 0 ] && names=(base ngram standalone eagle3 dflash)
  for n in "${names[@]}"; do [ "$n" = base ] || rest+=("$n"); done
  # base first, alone: it builds the JIT kernels every server shares (two builds of one kernel in one
  # cache folder at once are not safe); the speculative servers then find them and build only their own
  # (a base of the other mode already built them: then base starts with the rest)
  [ ${#rest[@]} -lt ${#names[@]} ] && start base
  [ ${#rest[@]} -gt 0 ] && start "${rest[@]}"
  return 0
}

gate() {
  local n=$1; shift; local port="PORT_$n"
  [ -n "${!port:-}" ] && [ "$n" != base ] || { echo "sglang_live: gate needs one of ngram standalone eagle3 dflash"; exit 4; }
  local run="$MODE-$n${TAG:+-$TAG}"
  # the gate runs in the host's environment (SGLang's tree is for the servers only)
  cd "$ROOT" && PYTHONPATH=$ROOT python3 -m pytest suites/lossless -q -p no:cacheprovider --engine sglang \
    --baseline-url "http://127.0.0.1:$PORT_base" --spec-url "http://127.0.0.1:${!port}" \
    --engine-opt "tokenizer=$TARGET" --report "$WORK/reports/$run" "$@" 2>&1 | tee "$WORK/logs/gate-$run.txt"
  return "${PIPESTATUS[0]}"
}

matrix() {
  local levels=(${LEVELS:-1 8 32}) n c rc lo
  lo=${levels[0]}
  for n in "$@"; do
    for c in "${levels[@]}"; do
      TAG=c$c gate "$n" --concurrency "$c" >/dev/null 2>&1; rc=$?
      echo "MATRIX $MODE $n c$c: exit $rc; $(grep -h -m1 -oE '(PASS|FAIL)[^|]{0,140}' "$WORK/logs/gate-$MODE-$n-c$c.txt")"
    done
    for c in "${levels[@]:1}"; do
      (cd "$ROOT" && PYTHONPATH=$ROOT python3 -c "import sys; from specparity.cli.commands import main; sys.exit(main())" \
        compare "$WORK/reports/$MODE-$n-c$lo" "$WORK/reports/$MODE-$n-c$c" --old-side spec \
        >"$WORK/logs/compare-$MODE-$n-c$lo-c$c.txt" 2>&1)
      echo "COMPARE $MODE $n c$lo vs c$c: exit $? $(tail -1 "$WORK/logs/compare-$MODE-$n-c$lo-c$c.txt" | cut -c1-120)"
    done
  done
}

pack() {
  mkdir -p "$1" && tar -czf "$1/sglang-live.tar.gz" -C "$WORK" reports logs &&
  { [ -d "${SGLANG_JIT_CACHE:-$WORK/tvm-ffi}" ] && tar -czf "$1/sglang-jit-cache.tar.gz" -C "${SGLANG_JIT_CACHE:-$WORK/tvm-ffi}" . ; true; }
  ls -la "$1"
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
  matrix) matrix "$@" ;;
  pack) pack "$@" ;;
  stop) stop ;;
  *) sed -n 2,27p "$0"; exit 4 ;;
esac
