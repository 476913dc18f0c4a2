"""In-process engines (torch): the shared decode/verify loop (``loop``), transformers (``hf``), the
DFlash reference (``dflash``) and the fp8 KV cache. May import: ``model``, ``engines.base``,
``engines.common``.
"""
