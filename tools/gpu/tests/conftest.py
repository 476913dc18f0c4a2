"""Tests of the GPU-run tooling (``pytest tools/gpu/tests``): the committed fixture models only, no hub."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
