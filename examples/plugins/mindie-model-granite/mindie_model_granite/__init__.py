"""An example model family for mindie-host: IBM Granite (``GraniteForCausalLM``, ``model_type: granite``).

Granite is Llama's layer with four scalars from its ``config.json``: the embeddings are multiplied by
``embedding_multiplier``, the attention scores by ``attention_multiplier`` (instead of ``head_dim ** -0.5``), each
branch's output by ``residual_multiplier`` before its residual add, and the logits divided by ``logits_scaling``.
Three of them are fields every family has (:class:`~mindie_host.backend_api.ModelArch`); the fourth needs a layer
of its own, made from the host's shared blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from mindie_host.api import BackendContext, hookimpl
from mindie_host.backend_api import Architecture, DecoderLayer, ModelArch, Step, dense_attention, dense_mlp


class GraniteLayer(DecoderLayer):
    """The dense layer with each branch's output scaled by ``residual_multiplier``."""

    def __init__(self, *, residual_multiplier: float, **blocks: Any) -> None:
        super().__init__(**blocks)
        self.residual_multiplier = residual_multiplier

    def __call__(self, x: torch.Tensor, pending: torch.Tensor | None, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        plat = step.platform
        x, h = plat.add_rms_norm(x, pending, self.attn_in, self.eps)
        o = self.attn(h, step) * self.residual_multiplier
        x, h = plat.add_rms_norm(x, o, self.mlp_in, self.eps)
        return x, self.mlp(h, step) * self.residual_multiplier


class GraniteFamily(Architecture):
    """Granite: how its config reads and what its layers are."""

    name = "granite"
    model_types = ("granite",)

    def read_config(self, cfg: dict[str, Any], directory: Any = None) -> ModelArch:
        """Llama's reading, plus the four scalars."""
        arch = super().read_config(cfg, directory)
        arch.embedding_multiplier = float(cfg.get("embedding_multiplier", 1.0))
        arch.attention_scale = float(cfg.get("attention_multiplier", 1.0))
        arch.logit_scale = 1.0 / float(cfg.get("logits_scaling", 1.0))
        arch.options["residual_multiplier"] = float(cfg.get("residual_multiplier", 1.0))
        return arch

    def build_layer(self, index: int, arch: ModelArch, weights: Any) -> GraniteLayer:
        """The shared attention and gated MLP, in a :class:`GraniteLayer`."""
        p = f"model.layers.{index}."
        return GraniteLayer(
            attn=dense_attention(arch, index, weights),
            mlp=dense_mlp(arch, index, weights),
            attn_in=weights.tensor(p + "input_layernorm.weight"),
            mlp_in=weights.tensor(p + "post_attention_layernorm.weight"),
            eps=arch.rms_norm_eps,
            residual_multiplier=arch.options["residual_multiplier"],
        )


GRANITE = GraniteFamily()


@hookimpl
def mindie_host_model_architectures(ctx: BackendContext) -> list[Architecture]:
    """The Granite family."""
    return [GRANITE]
