"""Gemma 3, text: ``Gemma3TextConfig`` checkpoints (``gemma3_text``), and the language model of ``Gemma3Config``
checkpoints (``gemma3``, the multimodal ones) served text-only.

What differs from Llama:

* sliding-window layers (``sliding_window``) between global ones (``layer_types``; older configs say
  ``sliding_window_pattern``), each kind with its own RoPE (global: ``rope_theta``, possibly linearly scaled;
  local: ``rope_local_base_freq``);
* four norms a layer: the attention's and the MLP's input and output, and an RMSNorm on each query and key head;
  each norm scales by ``1 + weight``, which :meth:`Gemma3Family.adapt` folds into the weight once;
* the embeddings multiplied by ``sqrt(hidden_size)``, a GELU-gated MLP (``gelu_pytorch_tanh``), queries scaled by
  ``query_pre_attn_scalar ** -0.5``, and the logits soft-capped when ``final_logit_softcapping`` is set.
  (``attn_logit_softcapping`` is in the config, but transformers' Gemma 3 does not apply it, so neither does this.)

Configs in the wild leave out the keys that keep their default, nested in ``text_config`` too, and older ones use
the older RoPE keys: transformers' own config classes fill and convert them, as when transformers loads the
checkpoint. The vision tower and projector of a multimodal checkpoint are not read.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mindie_host.backend_api import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Architecture,
    GGUFInfo,
    ModelArch,
    ModelLoadError,
    Norms,
    Piece,
    base_config,
    rename_prefixes,
)

#: the language model's tensors in the multimodal layouts (transformers 5's and the older one) -> canonical names
LM_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
#: the multimodal parts a text-only server does not read
SKIPPED = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


class Gemma3Family(Architecture):
    """Gemma 3's language model (``Gemma3ForCausalLM``, or ``Gemma3ForConditionalGeneration`` without images)."""

    name = "gemma3"
    model_types = ("gemma3_text", "gemma3")
    activations = ("gelu_pytorch_tanh",)
    norms = Norms(
        attn_in="input_layernorm",
        attn_out="post_attention_layernorm",
        mlp_in="pre_feedforward_layernorm",
        mlp_out="post_feedforward_layernorm",
    )

    gguf_architectures = ("gemma3",)
    #: llama.cpp's names for the four norms of a layer
    gguf_names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """llama.cpp's ``gemma3`` files as its runtime reads them: sliding layers by
        ``attention.sliding_window_pattern`` (a flag per layer, or every n-th layer global; 6 when absent), the
        sliding layers' own RoPE base (``rope.freq_base_swa``), queries scaled by the head size (the hidden size
        over the heads for the 62-layer 27B)."""
        cfg = base_config(info, "gemma3_text")
        layers, window = cfg["num_hidden_layers"], cfg.pop("sliding_window", None)
        pattern = info.key("attention.sliding_window_pattern", 6)
        sliding = ([bool(v) for v in pattern] if isinstance(pattern, list)
                   else [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)])
        full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        full.update(cfg.pop("rope_scaling", None) or {})
        cfg.update(
            layer_types=[SLIDING_ATTENTION if window and s else FULL_ATTENTION for s in sliding],
            sliding_window=window or None,
            rope_parameters={FULL_ATTENTION: full, SLIDING_ATTENTION: {
                "rope_type": "default", "rope_theta": float(info.key("rope.freq_base_swa", 10000.0))}},
            query_pre_attn_scalar=cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62 else cfg["head_dim"],
            final_logit_softcapping=info.key("final_logit_softcapping"),
        )
        return cfg

    def from_gguf(self, name: str, array: np.ndarray, arch: ModelArch) -> np.ndarray:
        """The norms back to the checkpoint's ``weight`` (llama.cpp's converter stores ``1 + weight``)."""
        return array - 1.0 if name.endswith("norm.weight") else array

    def text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """The language model's config with transformers' defaults and RoPE keys (``text_config`` of ``gemma3``)."""
        from transformers import Gemma3Config, Gemma3TextConfig

        try:
            if cfg.get("model_type") == "gemma3":
                return Gemma3Config(**cfg).text_config.to_dict()  # type: ignore[no-any-return]
            return Gemma3TextConfig(**cfg).to_dict()  # type: ignore[no-any-return]
        except Exception as exc:  # a config transformers' own classes refuse
            raise ModelLoadError(f"config.json: not a Gemma 3 config transformers can read: {exc}") from exc

    def read_config(self, cfg: dict[str, Any], directory: Any = None) -> ModelArch:
        """The base reading plus Gemma's scalars."""
        arch = super().read_config(cfg, directory)
        text = self.text_config(cfg)
        if text.get("use_bidirectional_attention"):
            raise ModelLoadError(
                "config.json: use_bidirectional_attention true (an embedding model) is not served; allowed: false"
            )
        arch.attention_scale = float(text["query_pre_attn_scalar"]) ** -0.5
        arch.embedding_multiplier = math.sqrt(arch.hidden_size)
        cap = text.get("final_logit_softcapping")
        arch.final_logit_softcapping = None if cap is None else float(cap)
        return arch

    def tensor_pieces(self, name: str, arch: ModelArch) -> list[Piece]:
        """The language model's tensors under their canonical names; the vision tower and projector skipped."""
        if name.startswith(SKIPPED):
            return []
        return [Piece(rename_prefixes(name, LM_PREFIXES) or name)]

    def adapt(self, name: str, array: np.ndarray, arch: ModelArch) -> np.ndarray:
        """Each norm's ``1 + weight``, so the shared RMSNorm (which scales by the weight) computes Gemma's."""
        return array + 1.0 if name.endswith("norm.weight") else array


GEMMA3 = Gemma3Family()
