"""A stand-in for ``deep_gemm`` (the sgl-deep-gemm wheel), which the trimmed SGLang 0.5.17 bundle leaves out.

SGLang's EAGLE/STANDALONE v2 worker imports the DeepSeek sparse-attention backends while it captures the
draft's CUDA graphs, only to list their classes (``eagle_worker_v2._capture_cuda_graphs``); those modules
import ``deep_gemm`` and some of its submodules at module level. The real package builds a CUDA library
when imported. This stand-in lets the imports succeed: every ``deep_gemm.*`` submodule resolves to a
module like this one, and any function taken from it raises when called, so a model that really needs
DeepGEMM fails loudly instead of computing something else. The fixture target (a dense Qwen3 with triton
attention) never calls it. ``sglang_live.sh`` puts the folder holding this package on the servers' path
and sets ``SGLANG_ENABLE_JIT_DEEPGEMM=false``: SGLang turns DeepGEMM on whenever ``import deep_gemm``
succeeds on sm_90 (``deep_gemm_wrapper/configurer.py``) and would then call ``deep_gemm.set_pdl`` at start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


def _missing(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(f"deep_gemm.{name}: the real sgl-deep-gemm is not installed (stand-in module)")
    call.__name__ = name
    return call


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(name)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StandIn(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        return None


sys.meta_path.append(_Finder())
__path__ = []  # submodules come from the finder above


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
