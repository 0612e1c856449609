"""Qwen3 (dense): Llama's layout with an RMSNorm on each query and key head before RoPE.

The per-head norms are the checkpoint's ``self_attn.q_norm`` / ``self_attn.k_norm``; the host's dense layer applies
them (:class:`~mindie_host.backend_api.Attention`). Q, K and V carry a bias only when ``attention_bias`` says so.
Sliding-window layers follow ``use_sliding_window`` / ``max_window_layers`` / ``layer_types`` as transformers reads
them.
"""

from __future__ import annotations

from typing import Any

from mindie_host.backend_api import Architecture, GGUFInfo, ModelArch, ModelLoadError, base_config


class Qwen3Family(Architecture):
    """Qwen3 dense checkpoints (``Qwen3ForCausalLM``)."""

    name = "qwen3"
    model_types = ("qwen3",)
    gguf_architectures = ("qwen3",)

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """llama.cpp's ``qwen3`` files (rotary rows as the checkpoint's; no sliding window in the format)."""
        return base_config(info, "qwen3")

    def build_layer(self, index: int, arch: ModelArch, weights: Any) -> Any:
        """The host's dense layer, once the checkpoint is seen to have the per-head norms."""
        for norm in ("q_norm", "k_norm"):
            if not weights.has(f"model.layers.{index}.self_attn.{norm}.weight"):
                raise ModelLoadError(f"layer {index} has no self_attn.{norm}: not a Qwen3 checkpoint")
        return None


QWEN3 = Qwen3Family()
