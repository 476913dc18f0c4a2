#!/bin/bash
# The GDN hybrid fixture (fixtures/models/hybrid: Qwen3_5ForCausalLM, 3 Gated DeltaNet + 1 attention layer, a
# one-layer mtp.* block) on SGLang 0.5.17, plain and with its own MTP block as the EAGLE draft (preset sglang-mtp:
# 3 steps, top-k 1, 4 draft tokens), gated as a user would. One GPU host, from the checkout's root, after
# sglang_setup.sh unpacked SGLang into /tmp/sgl:
#
#   tools/gpu/sglang-0.5.17/hybrid_live.sh start          the whole plan below in the background (setsid), log WORK/driver.log
#   tools/gpu/sglang-0.5.17/hybrid_live.sh all            the same in the foreground
#   tools/gpu/sglang-0.5.17/hybrid_live.sh status         where the plan is: its log, the steps done, the GPU's memory
#   tools/gpu/sglang-0.5.17/hybrid_live.sh collect OUTDIR OUTDIR/hybrid-summaries.tar.gz (summaries, sweep/arms
#                                                         tables, probes, /server_info, key log lines, driver log),
#                                                         OUTDIR/hybrid-logs.tar.gz (server logs, last 3000 lines each),
#                                                         OUTDIR/hybrid-jit-cache.tar.gz (the tvm-ffi JIT builds)
#   tools/gpu/sglang-0.5.17/hybrid_live.sh stop           stop every server and gate it started
#
# WORK is $SPECPARITY_LIVE_WORK, else /tmp/specparity-hybrid-live. The plan:
#  1. sweeps: an eager pair (plain + MTP, started here, one after the other: each SGLang server sizes its pools
#     from the GPU memory free when it starts) and a CUDA-graph pair; `specparity sweep --levels 1,8,CAP` against
#     each pair, CAP = the speculative server's own limit on requests in flight: the number in its log line
#     "max_running_requests is capped to N by the mamba state cache", else /server_info
#     internal_states[0].effective_max_running_requests_per_dp. Then hybrid_probe.py: per-position acceptance
#     (SGLang's spec_correct_drafts_histogram) at concurrency 1 and 8, and the radix cache per prompt.
#  2. arms: `specparity arms --arms default,prefix-warm,preempt --preset sglang-mtp` through arms_live.sh (eager),
#     with SGLang's default --mamba-radix-cache-strategy and with extra_buffer (SERVER_ARGS).
#  3. two servers side by side: `specparity run --preset sglang-mtp --engine-opt parallel_start=true` at
#     --mem-fraction-static 0.3 (pools sized from memory alone), at 0.3 with --max-total-tokens 65536, at 0.3
#     with --max-total-tokens and --max-mamba-cache-size (pools sized by count), and at 0.15; each starts only
#     before DEADLINE_PARALLEL seconds into the plan (on one H100 the plan reached part 3 after 728 s).
# Host flags on every server: triton attention, pytorch sampling, a 2048-token context (after the preset's
# 32768: the later flag wins; the fixture has 4096 positions), --mm-feature-transport cpu; the eager pair takes
# --mem-fraction-static 0.3 with nothing else bounding its pools (what decides its cap). Every server started
# while others start takes --max-total-tokens 65536 --max-mamba-cache-size 512 (BOUND) so that its pools are
# small and fixed: a server sizes its budget from the memory free at its start minus what another server takes
# before it profiles (docs/live/sglang-0.5.17/hybrid-mtp/README.md), so unbounded servers starting together fail.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
WORK=${SPECPARITY_LIVE_WORK:-/tmp/specparity-hybrid-live}
SGL=${SGLANG_DIR:-/tmp/sgl}
PY=$HERE/sglang_python.sh
HYB=$ROOT/fixtures/models/hybrid
PRESET=sglang-mtp
export SGLANG_DIR=$SGL SGLANG_JIT_CACHE=${SGLANG_JIT_CACHE:-$WORK/tvm-ffi}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
HOST="--attention-backend triton --sampling-backend pytorch --context-length 2048 --mm-feature-transport cpu"
EAGER="--cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
FRAC=${FRAC:-0.3}
BOUND=${BOUND:---max-total-tokens 65536 --max-mamba-cache-size 512}
# the latest a step of part 3 may start (seconds since the plan began), so that the plan ends inside a lease
DEADLINE_PARALLEL=${DEADLINE_PARALLEL:-900}
T0_FILE=$WORK/t0

mkdir -p "$WORK/logs" "$WORK/reports" "$WORK/pgid" "$WORK/info" "$WORK/probes" "$WORK/done"

log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - $(cat "$T0_FILE" 2>/dev/null || date +%s) ))s] $*"; }
elapsed() { echo $(( $(date +%s) - $(cat "$T0_FILE") )); }
health() { python3 -c "import sys,urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=5)" 2>/dev/null; }
gate() { (cd "$ROOT" && PYTHONPATH=$ROOT python3 -m specparity.cli.commands "$@"); }

# the preset's argv (specparity's own SGLangLaunch), with extra flags after it: base|spec EXTRA
preset_args() {
  PYTHONPATH=$ROOT python3 - "$1" "$HYB" "$PRESET" "$2" <<'PY'
import shlex, sys
from specparity.engines.base import EngineOptions
from specparity.engines.server.sglang_launch import launch_configs
role, target, preset, extra = sys.argv[1:5]
b, s = launch_configs(EngineOptions(target=target, preset=preset, extra={"server_args": shlex.split(extra)}))
print(shlex.join((b if role == "base" else s).args()))
PY
}

# start NAME PORT ROLE EXTRA: one server in its own process group, log WORK/logs/NAME.log
start() {
  local name=$1 port=$2 role=$3 extra=$4 argv
  argv=$(preset_args "$role" "$extra") || { log "START $name: cannot build the argv"; return 1; }
  log "START $name port $port: $argv"
  ( cd "$WORK" && eval "exec setsid $PY -m sglang.launch_server $argv --host 127.0.0.1 --port $port" \
      >"$WORK/logs/$name.log" 2>&1 ) &
  echo $! >"$WORK/pgid/$name"
}

# wait_up NAME PORT [TIMEOUT]: until /health answers (0) or the server died / the time ran out (1)
wait_up() {
  local name=$1 port=$2 limit=${3:-600} t=$(date +%s)
  until health "$port"; do
    if ! kill -0 "$(cat "$WORK/pgid/$name")" 2>/dev/null; then
      log "DEAD $name after $(( $(date +%s) - t )) s:"; grep -E "Error|error|Exception" "$WORK/logs/$name.log" | tail -5
      return 1
    fi
    [ $(( $(date +%s) - t )) -gt "$limit" ] && { log "TIMEOUT $name"; return 1; }
    sleep 2
  done
  log "UP $name after $(( $(date +%s) - t )) s"
  curl -s "http://127.0.0.1:$port/server_info" >"$WORK/info/$name.json" 2>/dev/null ||
    python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$port/server_info').read().decode())" \
      >"$WORK/info/$name.json"
  keylines "$WORK/logs/$name.log" >"$WORK/info/$name.keylines.txt"
}

keylines() {
  grep -E "capped to|max_running_requests|max_total_num_tokens|max_mamba_cache_size|mamba|Loaded weights|KV Cache|Memory pool|radix|overlap|Error|error:|Traceback|Capture|cuda graph" "$1" |
    grep -v "Decode batch\|Prefill batch" | cut -c1-400 | head -80
}

# cap NAME: the speculative server's own limit on requests in flight (see the header)
cap() {
  local n
  n=$(grep -o "max_running_requests is capped to [0-9]*" "$WORK/logs/$1.log" | tail -1 | grep -o "[0-9]*$")
  if [ -n "$n" ]; then echo "$n mamba-log"; return; fi
  n=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); s=(d.get('internal_states') or [{}])[0]; \
print(s.get('effective_max_running_requests_per_dp') or d.get('max_running_requests') or '')" "$WORK/info/$1.json" 2>/dev/null)
  echo "${n:-16} server_info"
}

levels_for() { local c=$1; if [ "$c" -gt 8 ]; then echo "1,8,$c"; elif [ "$c" -gt 1 ]; then echo "1,$c"; else echo "1,8"; fi; }

# sweep MODE BASEPORT SPECPORT
sweep() {
  local mode=$1 bp=$2 sp=$3 c src lv
  read -r c src < <(cap "$mode-mtp")
  lv=$(levels_for "$c")
  echo "$c $src" >"$WORK/info/$mode-cap.txt"
  log "SWEEP $mode levels $lv (cap $c from $src)"
  gate sweep --levels "$lv" --engine sglang --baseline-url "http://127.0.0.1:$bp" --spec-url "http://127.0.0.1:$sp" \
    --target "$HYB" --engine-opt "max_concurrency=$c" --report "$WORK/reports/$mode-sweep" >"$WORK/logs/gate-$mode-sweep.txt" 2>&1
  local rc=$?
  log "SWEEP $mode exit $rc: $(grep -m1 -E 'specparity sweep' "$WORK/logs/gate-$mode-sweep.txt")"
  for k in 1 8; do
    python3 "$HERE/hybrid_probe.py" accept "http://127.0.0.1:$sp" --tokenizer "$HYB" --concurrency $k \
      --label "$mode MTP server, concurrency $k" --out "$WORK/probes/$mode-accept-c$k" >"$WORK/logs/probe-$mode-accept-c$k.txt" 2>&1
    log "PROBE $mode accept c$k exit $?: $(grep -A2 '^| verify' "$WORK/probes/$mode-accept-c$k.md" 2>/dev/null | tail -1)"
  done
  if [ "$mode" = eager ]; then
    for role in base mtp; do
      local port=$bp; [ $role = mtp ] && port=$sp
      python3 "$HERE/hybrid_probe.py" cache "http://127.0.0.1:$port" --tokenizer "$HYB" \
        --label "eager $role server (default strategy)" --out "$WORK/probes/eager-$role-cache" >"$WORK/logs/probe-eager-$role-cache.txt" 2>&1
      log "PROBE eager $role cache exit $?: $(grep -E '^\| the' "$WORK/probes/eager-$role-cache.md" 2>/dev/null | tr '\n' ' ')"
    done
  fi
  touch "$WORK/done/$mode-sweep"
  stop_group "$mode-base" "$mode-mtp"
}

# arms NAME SERVER_ARGS
arms() {
  local name=$1 extra=$2
  log "ARMS $name (SERVER_ARGS: $extra)"
  SERVER_ARGS="$extra" MODE=eager "$ROOT/tools/gpu/arms_live.sh" sglang "$WORK/reports/arms-$name" \
    --preset "$PRESET" --target "$HYB" --arms default,prefix-warm,preempt >"$WORK/logs/gate-arms-$name.txt" 2>&1
  log "ARMS $name exit $?: $(grep -m1 'specparity arms' "$WORK/logs/gate-arms-$name.txt")"
  touch "$WORK/done/arms-$name"
}

# parallel NAME SERVER_ARGS: both servers of the preset started side by side by the gate
parallel() {
  local name=$1 extra=$2
  [ "$(elapsed)" -gt "$DEADLINE_PARALLEL" ] && { log "PARALLEL $name: not started (past the deadline)"; return; }
  log "PARALLEL $name (server_args: $HOST $EAGER $extra)"
  gate run --engine sglang --preset "$PRESET" --target "$HYB" --engine-opt parallel_start=true \
    --engine-opt "python=$PY" --engine-opt "server_args=$HOST $EAGER $extra" --report "$WORK/reports/parallel-$name" \
    >"$WORK/logs/gate-parallel-$name.txt" 2>&1
  local rc=$?
  log "PARALLEL $name exit $rc: $(grep -m1 -E 'specparity lossless gate|LaunchError|Loaded weights' "$WORK/logs/gate-parallel-$name.txt" | cut -c1-300)"
  for f in "$WORK/reports/parallel-$name"/servers/*.log; do
    [ -f "$f" ] && { echo "== $f"; keylines "$f"; } >>"$WORK/info/parallel-$name.keylines.txt"
  done
  touch "$WORK/done/parallel-$name"
}

stop_group() {
  local n; for n in "$@"; do
    [ -f "$WORK/pgid/$n" ] && { kill -- -"$(cat "$WORK/pgid/$n")" 2>/dev/null; rm -f "$WORK/pgid/$n"; }
  done
}

all() {
  date +%s >"$T0_FILE"
  log "PLAN start on $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
  nvidia-smi >"$WORK/info/nvidia-smi-start.txt" 2>&1
  local jobs=()
  # 1. the eager pair: the plain server first, alone (it builds SGLang's JIT kernels for everyone)
  start eager-base 32000 base "$HOST $EAGER --mem-fraction-static $FRAC"
  wait_up eager-base 32000 || { log "PLAN: the plain eager server did not start; nothing else can"; stopall_servers; return 3; }
  start eager-mtp 32001 spec "$HOST $EAGER --mem-fraction-static $FRAC"
  if wait_up eager-mtp 32001; then sweep eager 32000 32001 & jobs+=($!); fi
  # 2. the arms (their servers bounded: they start while others start)
  arms default "$BOUND" & jobs+=($!)
  arms extra_buffer "$BOUND --mamba-radix-cache-strategy extra_buffer" & jobs+=($!)
  # 1b. the CUDA-graph pair, one after the other
  start graphs-base 32100 base "$HOST --mem-fraction-static $FRAC $BOUND"
  if wait_up graphs-base 32100; then
    start graphs-mtp 32101 spec "$HOST --mem-fraction-static $FRAC $BOUND"
    if wait_up graphs-mtp 32101; then sweep graphs 32100 32101 & jobs+=($!); fi
  fi
  wait "${jobs[@]}"
  stopall_servers
  sleep 3
  nvidia-smi >"$WORK/info/nvidia-smi-before-parallel.txt" 2>&1
  # 3. two servers side by side
  parallel f030 "--mem-fraction-static 0.3"
  parallel f030-tokens "--mem-fraction-static 0.3 --max-total-tokens 65536"
  parallel f030-bound "--mem-fraction-static 0.3 --max-total-tokens 65536 --max-mamba-cache-size 512"
  parallel f015 "--mem-fraction-static 0.15"
  log "PLAN done"
  touch "$WORK/done/plan"
}

stopall_servers() {
  local f; for f in "$WORK"/pgid/*; do [ -f "$f" ] && { kill -- -"$(cat "$f")" 2>/dev/null; rm -f "$f"; }; done
}

status() {
  tail -n "${1:-40}" "$WORK/driver.log" 2>/dev/null
  echo "done: $(ls "$WORK/done" 2>/dev/null | tr '\n' ' ')"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader 2>/dev/null
}

collect() {
  local out=${1:?collect OUTDIR} s=$WORK/collect
  rm -rf "$s" && mkdir -p "$s/summaries" "$s/logs"
  (cd "$WORK" && find reports probes info -type f \( -name '*.md' -o -name '*.json' -o -name '*.txt' \) \
      ! -name results.jsonl -print0 | xargs -0 -r tar -cf - | tar -xf - -C "$s/summaries")
  cp "$WORK/driver.log" "$s/summaries/" 2>/dev/null
  cp "$WORK"/logs/gate-*.txt "$WORK"/logs/probe-*.txt "$s/summaries/" 2>/dev/null
  for f in "$WORK"/logs/*.log "$WORK"/reports/*/servers/*.log "$WORK"/reports/*/*/sglang-*.log; do
    [ -f "$f" ] || continue
    tail -n 3000 "$f" >"$s/logs/$(echo "${f#$WORK/}" | tr '/' '_')"
  done
  mkdir -p "$out"
  tar -czf "$out/hybrid-summaries.tar.gz" -C "$s" summaries
  tar -czf "$out/hybrid-logs.tar.gz" -C "$s" logs
  [ -d "$SGLANG_JIT_CACHE" ] && tar -czf "$out/hybrid-jit-cache.tar.gz" -C "$SGLANG_JIT_CACHE" .
  ls -la "$out"
}

stopall() {
  stopall_servers
  [ -f "$WORK/driver.pid" ] && kill -- -"$(cat "$WORK/driver.pid")" 2>/dev/null
  echo "hybrid_live: stopped"
}

cmd=${1:-}; shift || true
case "$cmd" in
  start)
    setsid bash "$0" all >"$WORK/driver.log" 2>&1 < /dev/null &
    echo $! >"$WORK/driver.pid"; sleep 1; echo "hybrid_live: plan started (pid $(cat "$WORK/driver.pid")), log $WORK/driver.log" ;;
  all) all ;;
  status) status "$@" ;;
  collect) collect "$@" ;;
  stop) stopall ;;
  *) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 4 ;;
esac
