"""A tiny random Llama for the draft_model plugin's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindie_host.testing import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-draft_model"))
