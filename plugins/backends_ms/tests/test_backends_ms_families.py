"""backendType ms implements the Llama family only: another family, or a sliding window that would hide part of a
sequence, is a clear startup error naming what to use instead.

The backend loads in a child process of the module (:func:`~mindie_host.testing.child_process`): MindSpore's runtime
(0.4 GB once imported) would otherwise stay in the test process for every module after this one."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path

import pytest
from mindie_plugin_backends_ms.backend import MsBackend

from mindie_host.api import resolve_model
from mindie_host.backend_api import ModelLoadError
from mindie_host.testing import child_process, make_tiny_model


@pytest.fixture(scope="module")
def child() -> Iterator[Executor]:
    """The process the backend loads in: it exits, and MindSpore's memory with it, when the module ends."""
    with child_process() as pool:
        yield pool


def _load(path: str, max_positions: list[int]) -> None:
    """In the child: load ``path`` on backendType ms, then set each of ``max_positions`` in turn (a refusal raises
    its :class:`ModelLoadError` from ``result()``)."""
    backend = MsBackend(resolve_model(path), name="m")
    backend.load()
    for n in max_positions:
        backend.set_max_positions(n)


def test_another_family_is_refused_at_load(child: Executor, tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = make_tiny_model(tmp_path / "qwen3", Qwen3Config, Qwen3ForCausalLM, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ModelLoadError) as info:
        child.submit(_load, str(path), []).result()
    message = str(info.value)
    assert "'qwen3'" in message and "backendType 'ms' implements the Llama family only" in message
    assert "backendType 'torch'" in message


def test_a_window_shorter_than_max_seq_len_is_refused(child: Executor, tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    path = make_tiny_model(tmp_path / "mistral", MistralConfig, MistralForCausalLM, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           sliding_window=64)
    child.submit(_load, str(path), [64]).result()  # the window hides nothing: served
    with pytest.raises(ModelLoadError, match="sliding_window is 64 but backendType 'ms' has no sliding-window"):
        child.submit(_load, str(path), [64, 65]).result()
