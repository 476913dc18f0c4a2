#!/usr/bin/env bash
# Build llama-server into the cache: the same script `specparity llamacpp build` runs (shipped in the
# package), kept at this path for the checkout's scripts and docs. --help lists the options.
exec bash "$(dirname "$0")/../../specparity/engines/server/llamacpp_tools/build_llama_server.sh" "$@"
