"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) in MindSpore over a paged KV cache.

Same contract as the host's torch model: one step runs the flattened new tokens
of a whole batch; each token's K/V goes to its cache slot; each sequence's new
tokens attend causally to its cached context, so plain prefill, decode and
chunked prefill over cached context (prefix cache, SplitFuse) are one code path.

Layout choices that suit MindSpore's CPU kernels:

* weights are stored transposed (``[in, out]``) and applied with ``ops.matmul``
  (a transposed-weight ``dense`` is an order of magnitude slower on CPU);
* each layer's K and V caches are one :class:`mindspore.Parameter` of shape
  ``[num_kv_heads * num_slots, head_dim]`` (head-major), written in place with
  ``ops.scatter_update`` and read with one ``ops.gather`` that yields
  ``[kv_heads, batch, context, head_dim]``, i.e. batched-matmul order with no
  transpose of the (large) context;
* grouped-query attention runs as batched matmuls over ``kv_heads * batch``
  with the query heads of a group stacked along the rows.

The only NumPy is in :func:`build_step` (index and mask inputs) and in the final
conversion of the logits; the forward pass itself is MindSpore operators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mindie_host.api import ModelInput
from mindie_host.backend_api import LlamaArch, rope_of

#: additive mask value for positions a query must not see (exp() underflows to exactly 0)
MASKED = -1e9


def rope_inv_freq(arch: LlamaArch) -> np.ndarray:
    """Rotary inverse frequencies (float64) of the checkpoint's RoPE kind (``mindie_host.api.rope_of``).

    Dynamic NTK rescales per sequence length, which this backend's fixed tables cannot follow: refused.
    """
    rope = rope_of(arch)
    if rope.dynamic:
        raise ValueError("the ms backend does not serve dynamic NTK RoPE (rope_type 'dynamic'); use the torch backend")
    return rope.inv_freq(arch.head_dim)


@dataclass
class StepInputs:
    """Index and mask inputs of one step, built on the host side (NumPy)."""

    input_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    write_index: np.ndarray  # [KV, T] int32: row of each new token's K/V in the head-major cache
    read_index: np.ndarray  # [KV, B, max_ctx] int32: rows of each sequence's context
    mask_bias: np.ndarray  # [1, B, 1, max_q, max_ctx] float32: 0 = attend, MASKED = hidden
    pad_source: np.ndarray | None  # [B * max_q] int32: token feeding each padded query row (None: no padding)
    unpad_index: np.ndarray | None  # [T] int32: padded row of each token (None: no padding)
    logits_index: np.ndarray  # [L] int32
    num_seqs: int
    max_query_len: int
    max_context_len: int


def build_step(batch: ModelInput, block_size: int, num_slots: int, num_kv_heads: int) -> StepInputs:
    """Slots, gather rows and the causal mask of one step (the torch model's ``build_metadata``, in NumPy).

    Row ``r`` of sequence ``i`` is the token at absolute position ``ctx_i - q_i + r``;
    it sees context positions ``<= ctx_i - q_i + r``. Rows past ``q_i`` (padding) see
    slot 0 only, so their softmax stays finite; their outputs are dropped.
    """
    num_seqs = batch.num_seqs
    q_lens = np.asarray(batch.query_lens, dtype=np.int64)
    ctx_lens = np.asarray(batch.context_lens, dtype=np.int64)
    max_q = int(q_lens.max())
    max_ctx = int(ctx_lens.max())
    offsets = np.arange(max_ctx, dtype=np.int64)
    slots = np.zeros((num_seqs, max_ctx), dtype=np.int64)
    new_slots: list[np.ndarray] = []
    for i, (q_len, ctx, table) in enumerate(zip(batch.query_lens, batch.context_lens, batch.block_tables)):
        tbl = np.asarray(table, dtype=np.int64)
        seq = tbl[offsets[:ctx] // block_size] * block_size + offsets[:ctx] % block_size
        slots[i, :ctx] = seq
        new_slots.append(seq[ctx - q_len: ctx])
    flat_new = np.concatenate(new_slots)
    head_base = (np.arange(num_kv_heads, dtype=np.int64) * num_slots)
    write_index = head_base[:, None] + flat_new[None, :]
    read_index = head_base[:, None, None] + slots[None, :, :]

    rows = np.arange(max_q, dtype=np.int64)
    qpos = (ctx_lens - q_lens)[:, None] + rows[None, :]  # [B, max_q]
    visible = offsets[None, None, :] <= qpos[:, :, None]  # [B, max_q, max_ctx]
    valid_row = rows[None, :] < q_lens[:, None]
    visible &= valid_row[:, :, None]
    visible[:, :, 0] |= ~valid_row
    bias = np.where(visible, np.float32(0.0), np.float32(MASKED)).astype(np.float32)

    pad_source = unpad_index = None
    if not bool((q_lens == max_q).all()):
        starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        unpad_index = np.concatenate([i * max_q + np.arange(q) for i, q in enumerate(batch.query_lens)])
        src = starts[:, None] + np.minimum(rows[None, :], q_lens[:, None] - 1)
        pad_source = src.reshape(-1)
    return StepInputs(
        input_ids=np.asarray(batch.input_ids, dtype=np.int32),
        positions=np.asarray(batch.positions, dtype=np.int32),
        write_index=write_index.astype(np.int32),
        read_index=read_index.astype(np.int32),
        mask_bias=bias.reshape(1, num_seqs, 1, max_q, max_ctx),
        pad_source=None if pad_source is None else pad_source.astype(np.int32),
        unpad_index=None if unpad_index is None else unpad_index.astype(np.int32),
        logits_index=np.asarray(batch.logits_indices, dtype=np.int32),
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_context_len=max_ctx,
    )


@dataclass
class MsLayer:
    """One decoder layer's MindSpore tensors (projection weights transposed to ``[in, out]``)."""

    input_norm: Any
    qkv_t: Any
    qkv_bias: Any | None
    o_t: Any
    post_norm: Any
    gate_up_t: Any
    down_t: Any


class MsLlama:
    """The forward pass in MindSpore. Construct from HF-named float32 NumPy arrays."""

    def __init__(self, arch: LlamaArch, weights: dict[str, np.ndarray], ms: Any) -> None:
        self.arch = arch
        self.ms = ms
        self.ops = ms.ops
        self.num_slots = 0
        self.kv_caches: list[tuple[Any, Any]] = []
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.group = arch.num_heads // arch.num_kv_heads
        self.scale = ms.Tensor(np.float32(1.0 / math.sqrt(arch.head_dim)))
        self.eps = ms.Tensor(np.float32(arch.rms_norm_eps))
        self.mint = ms.mint
        self._scores = self.ops.BatchMatMul(transpose_b=True)
        self._weighted = self.ops.BatchMatMul()

        def tensor(array: np.ndarray) -> Any:
            return ms.Tensor(np.ascontiguousarray(array, dtype=np.float32))

        embed = weights.pop("model.embed_tokens.weight")
        head = weights.pop("lm_head.weight", None)
        if arch.tie_word_embeddings or head is None:
            head = embed
        self.embed = tensor(embed)
        self.lm_head_t = tensor(head.T)
        self.final_norm = tensor(weights.pop("model.norm.weight"))
        self.layers: list[MsLayer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            qkv = np.concatenate([weights.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"], axis=0)
            bias = None
            if p + "self_attn.q_proj.bias" in weights:
                bias = tensor(np.concatenate([weights.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
            gate_up = np.concatenate([weights.pop(p + "mlp.gate_proj.weight"), weights.pop(p + "mlp.up_proj.weight")])
            self.layers.append(
                MsLayer(
                    input_norm=tensor(weights.pop(p + "input_layernorm.weight")),
                    qkv_t=tensor(qkv.T),
                    qkv_bias=bias,
                    o_t=tensor(weights.pop(p + "self_attn.o_proj.weight").T),
                    post_norm=tensor(weights.pop(p + "post_attention_layernorm.weight")),
                    gate_up_t=tensor(gate_up.T),
                    down_t=tensor(weights.pop(p + "mlp.down_proj.weight").T),
                )
            )
        positions = np.arange(arch.max_position_embeddings, dtype=np.float32)
        freqs = np.outer(positions, rope_inv_freq(arch).astype(np.float32))
        emb = np.concatenate([freqs, freqs], axis=-1)
        scale = rope_of(arch).attention_scaling  # yarn's factor on cos and sin (1 otherwise)
        self.cos = tensor(np.cos(emb) * scale)
        self.sin = tensor(np.sin(emb) * scale)

    # -- cache -----------------------------------------------------------------------------------
    def allocate(self, num_slots: int) -> None:
        """One K and one V :class:`~mindspore.Parameter` per layer, ``[kv_heads * num_slots, head_dim]``."""
        ms = self.ms
        shape = (self.arch.num_kv_heads * num_slots, self.arch.head_dim)
        self.kv_caches = [
            (ms.Parameter(self.ops.zeros(shape, ms.float32), name=f"k_cache_{i}", requires_grad=False),
             ms.Parameter(self.ops.zeros(shape, ms.float32), name=f"v_cache_{i}", requires_grad=False))
            for i in range(self.arch.num_layers)
        ]
        self.num_slots = num_slots

    # -- operators ----------------------------------------------------------------------------------
    def _rms_norm(self, x: Any, weight: Any) -> Any:
        mint = self.mint
        return x * mint.rsqrt(mint.mean(x * x, -1, keepdim=True) + self.eps) * weight

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.arch.head_dim // 2
        first, second = self.ops.split(x, half, axis=-1)
        return x * cos + self.mint.cat((-second, first), dim=-1) * sin

    def _attention(self, q: Any, k_cache: Any, v_cache: Any, step: StepInputs, read_index: Any,
                   mask_bias: Any, pad_source: Any | None, unpad_index: Any | None) -> Any:
        """q: [T, H, D] (rotated) -> [T, H * D]."""
        ops = self.ops
        arch = self.arch
        kv, group, dim = arch.num_kv_heads, self.group, arch.head_dim
        b, max_q, max_ctx = step.num_seqs, step.max_query_len, step.max_context_len
        if pad_source is not None:
            q = ops.gather(q, pad_source, 0)  # [B * max_q, H, D]
        # [B, max_q, KV, G, D] -> [KV, B, G, max_q, D] -> [KV * B, G * max_q, D]
        qb = ops.transpose(ops.reshape(q, (b, max_q, kv, group, dim)), (2, 0, 3, 1, 4))
        qb = ops.reshape(qb, (kv * b, group * max_q, dim)) * self.scale
        keys = ops.reshape(ops.gather(k_cache, read_index, 0), (kv * b, max_ctx, dim))
        values = ops.reshape(ops.gather(v_cache, read_index, 0), (kv * b, max_ctx, dim))
        scores = ops.reshape(self._scores(qb, keys), (kv, b, group, max_q, max_ctx)) + mask_bias
        probs = ops.reshape(self.mint.softmax(scores, dim=-1), (kv * b, group * max_q, max_ctx))
        out = ops.reshape(self._weighted(probs, values), (kv, b, group, max_q, dim))
        out = ops.reshape(ops.transpose(out, (1, 3, 0, 2, 4)), (b * max_q, arch.num_heads * dim))
        if unpad_index is not None:
            out = ops.gather(out, unpad_index, 0)
        return out

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, step: StepInputs) -> np.ndarray:
        """Run the decoder over one step's tokens; return float32 logits ``[len(logits_index), vocab]``."""
        ms, ops, arch = self.ms, self.ops, self.arch
        n = int(step.input_ids.shape[0])
        ids = ms.Tensor(step.input_ids)
        pos = ms.Tensor(step.positions)
        write_index = ms.Tensor(step.write_index)
        read_index = ms.Tensor(step.read_index)
        mask_bias = ms.Tensor(step.mask_bias)
        pad_source = None if step.pad_source is None else ms.Tensor(step.pad_source)
        unpad_index = None if step.unpad_index is None else ms.Tensor(step.unpad_index)
        cos = ops.reshape(ops.gather(self.cos, pos, 0), (n, 1, arch.head_dim))
        sin = ops.reshape(ops.gather(self.sin, pos, 0), (n, 1, arch.head_dim))
        x = ops.gather(self.embed, ids, 0)
        for layer, (k_cache, v_cache) in zip(self.layers, self.kv_caches):
            h = self._rms_norm(x, layer.input_norm)
            qkv = ops.matmul(h, layer.qkv_t)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q, k, v = ops.split(qkv, [self.q_size, self.kv_size, self.kv_size], axis=-1)
            q = self._rope(ops.reshape(q, (n, arch.num_heads, arch.head_dim)), cos, sin)
            k = self._rope(ops.reshape(k, (n, arch.num_kv_heads, arch.head_dim)), cos, sin)
            v = ops.reshape(v, (n, arch.num_kv_heads, arch.head_dim))
            ops.scatter_update(k_cache, write_index, ops.transpose(k, (1, 0, 2)))
            ops.scatter_update(v_cache, write_index, ops.transpose(v, (1, 0, 2)))
            attn = self._attention(q, k_cache, v_cache, step, read_index, mask_bias, pad_source, unpad_index)
            x = x + ops.matmul(attn, layer.o_t)
            h = self._rms_norm(x, layer.post_norm)
            gate, up = ops.split(ops.matmul(h, layer.gate_up_t), arch.intermediate_size, axis=-1)
            x = x + ops.matmul(self.mint.nn.functional.silu(gate) * up, layer.down_t)
        last = ops.gather(x, ms.Tensor(step.logits_index), 0)
        logits = ops.matmul(self._rms_norm(last, self.final_norm), self.lm_head_t)
        return logits.asnumpy()
