"""The session fixture that builds each family's tiny random model (the specs and helpers: family_cases.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from family_cases import SPECS, randomize_zero_biases

from mindie_host.testing import make_tiny_model


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_family(name)``: the path of family ``name``'s tiny model, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            config_class, model_class = SPECS[name].classes()
            built[name] = make_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{name}"), config_class, model_class, **SPECS[name].keys
            )
            randomize_zero_biases(built[name])
        return built[name]

    return get
