"""Phi-3 (and Phi-3.5, Phi-4-mini): fused ``qkv_proj`` and ``gate_up_proj``, and LongRoPE.

The fused projections are split into the canonical ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` /
``up_proj`` rows as they are read, so every shared path (low-bit forms, int8 schemes, tensor-parallel slices,
per-row deltas) sees Llama's names. LongRoPE rotates with ``short_factor`` while a sequence is within
``original_max_position_embeddings`` and with ``long_factor`` once it is longer, scaling cos and sin by
``sqrt(1 + ln(max / original) / ln(original))`` (:mod:`mindie_host.models.rope`): a prompt longer than the original
context is computed with the long factors throughout, as transformers does. (transformers also recomputes the whole
cache when a sequence crosses the threshold during generation; here the keys already cached keep the rotation they
got, as in vLLM.) The older ``rope_scaling`` kinds ``su`` and ``yarn`` mean LongRoPE for Phi-3, as in
transformers' ``Phi3Config``. A ``sliding_window`` applies to every layer.
"""

from __future__ import annotations

from typing import Any

from mindie_host.backend_api import Architecture, GGUFInfo, ModelArch, Piece, base_config, split_rows


class Phi3Family(Architecture):
    """Phi-3 checkpoints (``Phi3ForCausalLM``)."""

    name = "phi3"
    model_types = ("phi3",)
    rope_kinds = ("default", "longrope")
    partial_rotary = True
    gguf_architectures = ("phi3",)
    #: llama.cpp keeps Q, K and V fused in ``attn_qkv`` and the MLP's gate and up in ``ffn_up``
    gguf_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """llama.cpp's ``phi3`` files: LongRoPE's factors are the ``rope_factors_short`` / ``_long`` tensors, its
        switch point ``rope.scaling.original_context_length``."""
        cfg = base_config(info, "phi3")
        if "rope_factors_long.weight" in info.tensors:
            cfg["rope_scaling"] = {
                "rope_type": "longrope",
                "short_factor": info.tensor("rope_factors_short.weight").tolist(),
                "long_factor": info.tensor("rope_factors_long.weight").tolist(),
            }
            cfg["original_max_position_embeddings"] = int(info.key("rope.scaling.original_context_length"))
        return cfg

    def text_config(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """``config.json`` with the older LongRoPE names (``su``, ``yarn``) read as ``longrope``."""
        for key in ("rope_parameters", "rope_scaling"):
            rope = cfg.get(key)
            if isinstance(rope, dict) and (rope.get("rope_type") or rope.get("type")) in ("su", "yarn"):
                rope = {k: v for k, v in rope.items() if k != "type"}
                cfg = {**cfg, key: {**rope, "rope_type": "longrope"}}
        return cfg

    def tensor_pieces(self, name: str, arch: ModelArch) -> list[Piece]:
        """``qkv_proj`` as Q, K and V rows and ``gate_up_proj`` as gate and up rows; the rest as they are."""
        q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
        for suffix, parts in (
            (
                "self_attn.qkv_proj.weight",
                [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv), ("self_attn.v_proj.weight", kv)],
            ),
            (
                "self_attn.qkv_proj.bias",
                [("self_attn.q_proj.bias", q), ("self_attn.k_proj.bias", kv), ("self_attn.v_proj.bias", kv)],
            ),
            ("mlp.gate_up_proj.weight", [("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)]),
        ):
            pieces = split_rows(name, suffix, parts)
            if pieces is not None:
                return pieces
        return [Piece(name)]


PHI3 = Phi3Family()
