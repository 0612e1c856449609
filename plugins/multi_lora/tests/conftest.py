"""Fixtures for multi_lora: a tiny base model, random PEFT adapters built with peft, and HF references."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mindie_host.testing import make_tiny_llama
from multi_lora_helpers import ADAPTER_SPECS, PROMPTS, hf_greedy, make_peft_adapter


@pytest.fixture(scope="session")
def lora_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (own copy: lora_adapter.json is written next to it)."""
    return make_tiny_llama(tmp_path_factory.mktemp("lora-base"), seed=7)


@pytest.fixture(scope="session")
def lora_adapters(lora_base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four adapters of ADAPTER_SPECS, built with peft; alpha/beta/gamma listed in lora_adapter.json."""
    root = tmp_path_factory.mktemp("lora-adapters")
    paths = {name: make_peft_adapter(lora_base, root / name, *spec) for name, spec in ADAPTER_SPECS.items()}
    listing = {name: str(paths[name]) for name in ("alpha", "beta", "gamma")}
    (lora_base / "lora_adapter.json").write_text(json.dumps(listing))
    return paths


@pytest.fixture(scope="session")
def hf_reference(lora_base: Path, lora_adapters: dict[str, Path]) -> Callable[[str | None, int, int], list[int]]:
    """``ref(adapter or None, prompt index, max_new)`` -> HF merged greedy tokens (memoized)."""
    cache: dict[tuple[Any, ...], list[int]] = {}

    def ref(adapter: str | None, prompt_index: int, max_new: int) -> list[int]:
        key = (adapter, prompt_index, max_new)
        if key not in cache:
            cache[key] = hf_greedy(lora_base, lora_adapters[adapter] if adapter else None, PROMPTS[prompt_index],
                                   max_new)
        return cache[key]

    return ref
