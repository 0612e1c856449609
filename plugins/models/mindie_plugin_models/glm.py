"""GLM-4 in both of transformers' forms: ``glm`` (``GlmForCausalLM``, glm-4-9b-chat-hf) and ``glm4``
(``Glm4ForCausalLM``, GLM-4-0414).

Both rotate only the first part of each head (``partial_rotary_factor``, 0.5) and pair its values interleaved
(``(0, 1), (2, 3) ...``) where the shared layers pair them as halves (``(0, d/2), (1, d/2 + 1) ...``). Reordering
the rotary rows of each query and key head the same way turns one convention into the other without changing a
single ``q . k`` product (:meth:`GlmFamily.adapt`), so the shared rotary kernels serve GLM. The MLP's
``gate_up_proj`` is fused in the checkpoint and is split into gate and up. ``glm4`` adds a norm on each branch's
output before the residual add (``post_self_attn_layernorm``, ``post_mlp_layernorm``).

llama.cpp's converter writes ``GlmForCausalLM`` as its ``chatglm`` architecture (the one of THUDM's remote-code
ChatGLM checkpoints, whose files fuse Q, K and V in ``attn_qkv``) and ``Glm4ForCausalLM`` as ``glm4``; each family
tells its files by their tensors (:meth:`GlmFamily.gguf_config`, :meth:`Glm4Family.gguf_config`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mindie_host.backend_api import (
    Architecture,
    GGUFInfo,
    ModelArch,
    ModelLoadError,
    Norms,
    Piece,
    base_config,
    split_rows,
)

#: the projections whose rows carry the rotary dimensions
ROTATED = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias")


def interleaved_to_halves(rows: np.ndarray, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Reorder the rows of whole heads so that each head's rotary part goes from interleaved pairs to halves:
    new row ``j`` is old row ``2j`` and new row ``rotary_dim / 2 + j`` old row ``2j + 1``; the rest stay."""
    order = np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2), np.arange(rotary_dim, head_dim)])
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])
    return np.ascontiguousarray(heads[:, order]).reshape(rows.shape)


class GlmFamily(Architecture):
    """``glm``: Llama's layer with partial interleaved RoPE, biased Q/K/V and a fused gate/up projection."""

    name = "glm"
    model_types = ("glm",)
    partial_rotary = True
    default_attention_bias = True
    gguf_architectures = ("chatglm",)
    #: llama.cpp keeps the MLP's gate and up fused in ``ffn_up`` (gate first, as the checkpoint's ``gate_up_proj``)
    gguf_names = {"ffn_up": "mlp.gate_up_proj"}
    #: the rotary rows are reordered after reading (:meth:`adapt`), which stored 8-bit blocks would not follow
    gguf_low_bit = False

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """llama.cpp's ``chatglm`` files written from a ``GlmForCausalLM`` directory: Q, K and V apart (rotary rows
        as the checkpoint's), no branch-output norms; the metadata as the converter writes it, which llama.cpp
        runs: each head ``embedding_length / head_count`` wide and the norms' epsilon its ``1e-5`` (the converter
        reads ChatGLM's ``layernorm_epsilon``, not ``rms_norm_eps``). A file with ``attn_qkv`` (THUDM's remote-code
        ChatGLM checkpoints) is refused by name."""
        if info.has("blk.0.attn_qkv.weight"):
            raise ModelLoadError(
                f"{info.path.name}: a chatglm GGUF file with fused attn_qkv (converted from THUDM's remote-code "
                "ChatGLM checkpoints) is not served; convert the transformers form (GlmForCausalLM, "
                "glm-4-9b-chat-hf) instead"
            )
        if not info.has("blk.0.attn_q.weight") or info.has("blk.0.post_attention_norm.weight"):
            return None
        cfg = base_config(info, "glm")
        rows = info.tensors["blk.0.attn_q.weight"][0]
        if rows != cfg["num_attention_heads"] * cfg["head_dim"]:
            raise ModelLoadError(
                f"{info.path.name}: attn_q has {rows} rows where the chatglm metadata says "
                f"{cfg['num_attention_heads']} heads of {cfg['head_dim']} (llama.cpp's converter takes a head as "
                "hidden_size / num_attention_heads wide, which this checkpoint's head_dim is not)"
            )
        return cfg

    def tensor_pieces(self, name: str, arch: ModelArch) -> list[Piece]:
        """``mlp.gate_up_proj`` as ``gate_proj`` and ``up_proj``; the rest under their own names."""
        inter = arch.intermediate_size
        fused = split_rows(
            name, "mlp.gate_up_proj.weight", [("mlp.gate_proj.weight", inter), ("mlp.up_proj.weight", inter)]
        )
        return fused if fused is not None else [Piece(name)]

    def adapt(self, name: str, array: np.ndarray, arch: ModelArch) -> np.ndarray:
        """Query and key rows reordered from interleaved to half-split rotary pairs."""
        if name.endswith(ROTATED):
            rotary = int(arch.head_dim * arch.partial_rotary_factor)
            return interleaved_to_halves(array, arch.head_dim, rotary)
        return array


class Glm4Family(GlmFamily):
    """``glm4``: :class:`GlmFamily` with a norm on the attention's and the MLP's outputs."""

    name = "glm4"
    model_types = ("glm4",)
    norms = Norms(attn_out="post_self_attn_layernorm", mlp_out="post_mlp_layernorm")
    gguf_architectures = ("glm4",)
    #: llama.cpp keeps the MLP's gate and up fused in ``ffn_up``, and names the branch-output norms its way
    gguf_names = {"ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
                  "post_ffw_norm": "post_mlp_layernorm"}

    def gguf_config(self, info: GGUFInfo) -> dict[str, Any] | None:
        """llama.cpp's ``glm4`` text files (rotary rows as the checkpoint's: its converter reorders them only for
        the multimodal M-RoPE form)."""
        if not info.has("blk.0.attn_q.weight", "blk.0.post_attention_norm.weight"):
            return None
        return base_config(info, "glm4")


GLM = GlmFamily()
GLM4 = Glm4Family()
