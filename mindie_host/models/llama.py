"""The builtin Llama family (Llama, Mistral, Qwen2 / Qwen2.5, SmolLM), registered like any other family.

It is the host's only family: the others come from plugins (``mindie-plugin-models``) through the same
``mindie_host_model_architectures`` hook, which this module implements as a builtin plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import hookimpl
from .architecture import Architecture, ModelArch
from .gguf_files import base_config


class LlamaFamily(Architecture):
    """Pre-norm decoders with grouped-query attention, rotate-half RoPE and a SiLU-gated MLP.

    Qwen2 is the same shape with a bias on Q, K and V (``attention_bias`` defaults to true for it); Mistral
    checkpoints may set a ``sliding_window`` for every layer, and Qwen2 ones ``use_sliding_window`` for the
    layers from ``max_window_layers`` on.
    """

    name = "llama"
    model_types = ("llama", "mistral", "qwen2", "smollm")
    gguf_architectures = ("llama", "qwen2")
    gguf_rotary_permuted = True

    def read_config(self, cfg: dict[str, Any], directory: Path | None = None) -> ModelArch:
        """As :meth:`Architecture.read_config`, with Qwen2's default bias on Q, K and V."""
        arch = super().read_config(cfg, directory)
        if "attention_bias" not in cfg and arch.model_type == "qwen2":
            arch.attention_bias = True
        return arch


    def gguf_config(self, info: Any) -> dict[str, Any] | None:
        """A ``llama`` or ``qwen2`` file without experts (``llama`` with experts is Mixtral's)."""
        if info.key("expert_count") or "blk.0.ffn_gate_inp.weight" in info.tensors:
            return None
        return base_config(info, info.arch)

    def gguf_permuted(self, arch: ModelArch) -> bool:
        """llama.cpp's Llama converter interleaves the rotary rows; its Qwen2 converter does not."""
        return arch.model_type != "qwen2"


LLAMA = LlamaFamily()


@hookimpl
def mindie_host_model_architectures(ctx: Any) -> list[Architecture]:
    """The Llama family."""
    return [LLAMA]
