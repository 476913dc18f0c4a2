"""Server engines: the shared skeleton (``engine``: sessions, launch-or-URL), HTTP, the process
launcher, presets, and the adapters (``llamacpp``, ``sglang``, ``vllm``). Import no torch. May
import: ``model``, ``engines.base``, ``engines.common``.
"""
