"""backendType ms implements the Llama family only: another family, or a sliding window that would hide part of a
sequence, is a clear startup error naming what to use instead."""

from __future__ import annotations

from pathlib import Path

import pytest
from mindie_plugin_backends_ms.backend import MsBackend

from mindie_host.api import resolve_model
from mindie_host.backend_api import ModelLoadError
from mindie_host.testing import make_tiny_model


def test_another_family_is_refused_at_load(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = make_tiny_model(tmp_path / "qwen3", Qwen3Config, Qwen3ForCausalLM, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ModelLoadError) as info:
        MsBackend(resolve_model(path), name="q").load()
    message = str(info.value)
    assert "'qwen3'" in message and "backendType 'ms' implements the Llama family only" in message
    assert "backendType 'torch'" in message


def test_a_window_shorter_than_max_seq_len_is_refused(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    path = make_tiny_model(tmp_path / "mistral", MistralConfig, MistralForCausalLM, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=64)
    backend = MsBackend(resolve_model(path), name="m")
    backend.load()
    backend.set_max_positions(64)  # the window hides nothing: served
    with pytest.raises(ModelLoadError, match="sliding_window is 64 but backendType 'ms' has no sliding-window"):
        backend.set_max_positions(65)
