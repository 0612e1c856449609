"""A tiny random Llama for the llma plugin's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from mindie_host.testing import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's tiny model (tests/conftest.py): built once per session whichever asks first."""
    return make_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama-shared")
