"""The llama-server build's configuration, checked without building, and what a finished build says
about itself.

* the cache key hashes the cmake flags (another flag, another key: a build with other flags is never
  taken from the cache);
* the flags keep AMX out even where ``-march`` enables it: ``GGML_NATIVE=ON`` compiles with
  ``-march=native``, which on a CPU advertising AMX defines ``__AMX_INT8__`` and builds ggml's AMX
  kernels into every quantized matmul (SIGILL on a machine without AMX). Checked with
  ``-march=sapphirerapids`` standing in for such a host, on this machine's compiler;
* the build found here states the CPU features it was compiled for, none of them AMX, and this CPU
  has them all (skipped without a build, failed under ``SPECPARITY_REQUIRE_LLAMACPP``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from llamacpp_fixtures import require_llama_server
from specparity.engines.server.llamacpp_build import BUILD_SCRIPT

#: A CPU whose -march enables AMX (Intel Sapphire Rapids), standing in for an AMX build host.
AMX_MARCH = "-march=sapphirerapids"


def script(*args: str, tmp_path: Path, **env: str) -> list[str]:
    """The packaged build script's stdout lines for ``args`` (only printing options: nothing is built)."""
    proc = subprocess.run(["bash", str(BUILD_SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SPECPARITY_CACHE": str(tmp_path), **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_cache_key_hashes_the_cmake_flags(tmp_path):
    (key,) = script("--print-key", tmp_path=tmp_path)
    extra = "-DGGML_AVX512=OFF"
    (other,) = script("--print-key", tmp_path=tmp_path, LLAMACPP_EXTRA_CMAKE_FLAGS=extra)
    assert extra not in script("--print-flags", tmp_path=tmp_path)
    assert extra in script("--print-flags", tmp_path=tmp_path, LLAMACPP_EXTRA_CMAKE_FLAGS=extra)
    assert other != key and other.rsplit("-", 1)[0] == key.rsplit("-", 1)[0], (key, other)


def _amx_macros(compiler: str, *flags: str) -> set[str]:
    proc = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c++", "-"], input="", capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"__AMX_[A-Z0-9]+__", proc.stdout))


def test_the_flags_keep_amx_out_where_march_enables_it(tmp_path):
    flags = script("--print-flags", tmp_path=tmp_path)
    assert "-DGGML_NATIVE=ON" in flags
    for option in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert f"-D{option}=OFF" in flags, flags
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler to check the flags with")
    with_amx = _amx_macros(compiler, AMX_MARCH)
    if not with_amx:
        pytest.skip(f"{compiler} {AMX_MARCH} enables no AMX (a compiler older than AMX support)")
    for lang in ("C", "CXX"):
        (value,) = [f.split("=", 1)[1] for f in flags if f.startswith(f"-DCMAKE_{lang}_FLAGS=")]
        # ggml puts -march=native after CMAKE_<LANG>_FLAGS: the explicit -mno-amx-* must win in that order
        assert _amx_macros(compiler, *value.split(), AMX_MARCH) == set(), (lang, value, with_amx)


#: /proc/cpuinfo's names where they are not the compiler's macro name in lower case.
CPUINFO_NAMES = {"SSE3": "pni", "BMI": "bmi1", "AVXVNNI": "avx_vnni"}


def test_the_build_states_its_cpu_features_and_this_cpu_has_them():
    binary = require_llama_server()
    info_path = binary.parent.parent / "build-info.txt"
    if not info_path.is_file():
        pytest.skip(f"{binary} is not a `specparity llamacpp build` install (no build-info.txt beside bin/)")
    head = info_path.read_text().split("\n--- ", 1)[0]
    info = dict(line.split("=", 1) for line in head.splitlines() if "=" in line)
    assert "-mno-amx-int8" in info.get("cmake_flags", ""), (
        f"{info_path}: built before AMX was turned off; rebuild with `specparity llamacpp build`")
    features = info.get("cpu_features", "").split()
    assert features and not [f for f in features if f.startswith("AMX")], info.get("cpu_features")
    host = set(Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0].split()) \
        if Path("/proc/cpuinfo").is_file() else set()
    if host:
        missing = [f for f in features
                   if not {CPUINFO_NAMES.get(f, f.lower()), f.lower().replace("avx512", "avx512_")} & host]
        assert not missing, f"{binary} needs CPU features this machine lacks: {missing}"
