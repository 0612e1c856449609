"""GGUF files as llama.cpp's converter (``convert_hf_to_gguf.py``) writes them, read for a family.

A family that reads GGUF names the ``general.architecture`` values it may read
(:attr:`~mindie_host.models.architecture.Architecture.gguf_architectures`) and tells from the file's metadata and
tensor names whether a file is its own, answering with the ``config.json`` the file stands for
(:meth:`~mindie_host.models.architecture.Architecture.gguf_config`): the converter writes Mixtral as ``llama`` with
expert tensors, and DeepSeek-V3 and V2 both as ``deepseek2``, so the architecture name alone does not say.
:func:`base_config` reads the metadata every architecture shares.

Tensors: llama.cpp's block names (``blk.3.attn_q.weight``) map to the checkpoint names the family reads
(:data:`BLOCK_NAMES`, with the family's own :attr:`~mindie_host.models.architecture.Architecture.gguf_names` over
them), and a stack of experts (``blk.3.ffn_gate_exps.weight``, ``[E, rows, cols]``) to one matrix per expert
(``model.layers.3.mlp.experts.5.gate_proj.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .gguf_header import gguf_tensors, read_gguf_header

#: llama.cpp's per-block tensor names -> the Hugging Face checkpoint's (after ``model.layers.N.``)
BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
#: the whole-model tensors
MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: a stack of experts' matrices -> each expert's projection (``mlp.experts.<i>.<proj>.weight``)
EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


@dataclass
class GGUFInfo:
    """What a GGUF file says of itself: its architecture, its metadata (token lists left out) and its tensors'
    shapes (rows first, as numpy holds them)."""

    path: Path
    arch: str
    fields: dict[str, Any]
    tensors: dict[str, tuple[int, ...]]
    vocab_size: int

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's metadata key ``name`` (``attention.head_count`` reads ``<arch>.attention.head_count``)."""
        return self.fields.get(f"{self.arch}.{name}", default)

    def has(self, *names: str) -> bool:
        """Whether every one of the tensors ``names`` is in the file."""
        return all(n in self.tensors for n in names)

    def tensor(self, name: str) -> Any:
        """Tensor ``name`` of the file, as float32 (a family reads a small one: Phi-3's RoPE factors)."""
        import numpy as np
        from gguf.quants import dequantize

        for t in gguf_tensors(self.path):
            if t.name == name:
                return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(self.tensors[name])
        raise KeyError(name)


_SKIPPED_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges")


def read_info(path: Path) -> GGUFInfo:
    """The :class:`GGUFInfo` of the GGUF file at ``path`` (its header, read once per file)."""
    header = read_gguf_header(path)
    fields = {k: v for k, v in header.fields.items() if k not in _SKIPPED_FIELDS}
    arch = str(fields.get("general.architecture", ""))
    vocab = fields.get(f"{arch}.vocab_size") or len(header.fields.get("tokenizer.ggml.tokens") or [])
    shapes = {t.name: tuple(int(d) for d in reversed(t.dims)) for t in header.tensors}
    return GGUFInfo(Path(path), arch, fields, shapes, int(vocab))


def base_config(info: GGUFInfo, model_type: str) -> dict[str, Any]:
    """The ``config.json`` keys the metadata of every llama.cpp architecture gives, for a checkpoint of
    ``model_type``: sizes, heads, norms' epsilon, RoPE (base, scaling, the rotated share of each head), experts,
    a sliding window, the special tokens, whether the LM head is tied (no ``output.weight``) and the Q/K/V bias."""
    hidden = int(info.key("embedding_length"))
    heads = int(info.key("attention.head_count"))
    head_dim = int(info.key("attention.key_length") or hidden // heads)
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(info.key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(info.key("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "intermediate_size": int(info.key("feed_forward_length") or 0),
        "vocab_size": info.vocab_size,
        "rms_norm_eps": float(info.key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(info.key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(info.key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in info.tensors,
        "attention_bias": "blk.0.attn_q.bias" in info.tensors,
        "bos_token_id": info.fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": info.fields.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    rotated = info.key("rope.dimension_count")
    if rotated is not None and int(rotated) != head_dim:
        cfg["partial_rotary_factor"] = int(rotated) / head_dim
    kind = info.key("rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": str(kind), "factor": float(info.key("rope.scaling.factor", 1.0))}
        original = info.key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow",
                                                                                "beta_slow")):
            if info.key(gguf_key) is not None:
                scaling[hf_key] = float(info.key(gguf_key))
        cfg["rope_scaling"] = scaling
    if info.key("expert_count"):
        cfg.update(num_experts=int(info.key("expert_count")), num_local_experts=int(info.key("expert_count")),
                   num_experts_per_tok=int(info.key("expert_used_count")))
        if info.key("expert_feed_forward_length"):
            cfg["moe_intermediate_size"] = int(info.key("expert_feed_forward_length"))
    if info.key("attention.sliding_window"):
        cfg["sliding_window"] = int(info.key("attention.sliding_window"))
    return cfg


def checkpoint_names(name: str, shape: tuple[int, ...], names: dict[str, str]) -> list[str] | None:
    """The checkpoint name(s) of GGUF tensor ``name`` of ``shape``: one, or one per expert for a stack of
    experts (their rows in order); None for a tensor the names do not cover."""
    if name in MODEL_NAMES:
        return [MODEL_NAMES[name]]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    layer, base, suffix = parts[1], parts[2], parts[3]
    if base in EXPERT_STACKS and suffix == "weight" and len(shape) == 3:
        return [f"model.layers.{layer}.mlp.experts.{i}.{EXPERT_STACKS[base]}.weight" for i in range(shape[0])]
    if f"{base}.{suffix}" in names:  # a whole name (DeepSeek's ``exp_probs_b.bias``)
        return [f"model.layers.{layer}.{names[f'{base}.{suffix}']}"]
    if base in names:
        return [f"model.layers.{layer}.{names[base]}.{suffix}"]
    return None
