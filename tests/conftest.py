"""Shared fixtures for the harness's own tests: the committed models and small prompt subsets."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specparity.engines.base import EngineOptions  # noqa: E402
from specparity.fixtures import REPO_ROOT, fixture_dir  # noqa: E402
from specparity.prompts import Prompt, load_prompts  # noqa: E402

DEFAULT_PROMPTS = REPO_ROOT / "prompts" / "default.jsonl"


@pytest.fixture(scope="session")
def default_prompts() -> list[Prompt]:
    return load_prompts(DEFAULT_PROMPTS).prompts


@pytest.fixture(scope="session")
def hf_options() -> EngineOptions:
    return EngineOptions(target=str(fixture_dir("target")), draft=str(fixture_dir("draft")), spec_mode="draft")
