"""backendType atb serves the Llama family only (its NPU operators are written and checked for it): another
family, or a sliding window shorter than maxSeqLen, is a clear startup error. No NPU is touched: the refusal
comes before any operator runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from mindie_plugin_backends_atb.backend import AtbBackend
from mindie_plugin_backends_atb.platform import NpuPlatform
from mindie_plugin_models import FAMILIES

from mindie_host.api import resolve_model
from mindie_host.backend_api import Architectures, LlamaFamily, ModelLoadError
from mindie_host.testing import make_tiny_model


def _atb(path: Path) -> AtbBackend:
    platform = NpuPlatform(object(), device_type="cpu", mem_get_info=lambda: (8 << 30, 16 << 30))
    return AtbBackend(resolve_model(path), name="atb", dtype="float32", platform=platform,
                      architectures=Architectures.of(LlamaFamily(), *FAMILIES))


def test_another_family_is_refused(tmp_path: Path) -> None:
    from transformers import Glm4Config, Glm4ForCausalLM

    path = make_tiny_model(tmp_path / "glm4", Glm4Config, Glm4ForCausalLM, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ModelLoadError) as info:
        _atb(path).load()
    message = str(info.value)
    assert "backendType 'atb' does not serve the glm4 family (model_type 'glm4')" in message
    assert "it serves: llama" in message and "backendType 'torch' serves every installed family" in message


def test_a_window_shorter_than_max_seq_len_is_refused(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    path = make_tiny_model(tmp_path / "mistral", MistralConfig, MistralForCausalLM, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=64)
    backend = _atb(path)
    backend.load()
    backend.set_max_positions(64)
    with pytest.raises(ModelLoadError, match="sliding_window is 64 but backendType 'atb' has no sliding-window"):
        backend.set_max_positions(128)
