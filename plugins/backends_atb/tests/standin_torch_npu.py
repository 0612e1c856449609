"""A STAND-IN for the torch_npu module, for testing operator dispatch on a machine without an NPU.

It is NOT torch_npu: each function records its call and computes, with plain
torch on the CPU, what the torch_npu documentation says the fused operator
computes, for the argument conventions :class:`NpuPlatform` uses. Tests built on
it check that the platform routes each operator to the named function with
consistent shapes and lengths; they say nothing about the real kernels.
"""

from __future__ import annotations

from typing import Any

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int) -> torch.Tensor:
    """q [S, N, D], k/v [L, KV, D]; query row r sees keys <= causal_offset + r. Returns [S, N, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("snd,lnd->nsl", q.float(), k.float()) * scale
    rows = torch.arange(q.shape[0]).unsqueeze(1)
    cols = torch.arange(k.shape[0]).unsqueeze(0)
    scores = scores.masked_fill(cols > causal_offset + rows, float("-inf"))
    return torch.einsum("nsl,lnd->snd", scores.softmax(-1), v.float()).to(q.dtype)


def _context(cache: torch.Tensor, table: torch.Tensor, length: int, kv_heads: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged cache ``[blocks, block_size, ...]``."""
    block_size = cache.shape[1]
    blocks = table[: -(-length // block_size)].long()
    return cache[blocks].reshape(-1, kv_heads, cache.shape[-1] // kv_heads if cache.dim() == 3 else cache.shape[-1])[
        :length
    ]


class StandInTorchNpu:
    """Records ``(name, kwargs summary)`` of every call in :attr:`calls`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def names(self) -> set[str]:
        return {name for name, _ in self.calls}

    def npu_rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, ...]:
        self.calls.append(("npu_rms_norm", {"epsilon": epsilon, "shape": tuple(x.shape)}))
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd).to(x.dtype) * gamma, rstd

    def npu_apply_rotary_pos_emb(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 layout: str = "BSH") -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(("npu_apply_rotary_pos_emb", {"layout": layout, "q": tuple(query.shape),
                                                        "cos": tuple(cos.shape)}))
        assert query.dim() == 4 and cos.dim() == 4, "the operator takes 4-D [B, S, N, D] inputs"
        for t in (query, key):
            half = t.shape[-1] // 2
            rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
            t.copy_(t * cos + rotated * sin)  # in place, like the fused operator
        return query, key

    def _npu_reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                               value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
        self.calls.append(("_npu_reshape_and_cache", {"cache": tuple(key_cache.shape), "slot_dtype": slot_indices.dtype}))
        assert key_cache.dim() == 4 and slot_indices.dtype == torch.int32
        flat_k = key_cache.view(-1, *key_cache.shape[2:])
        flat_v = value_cache.view(-1, *value_cache.shape[2:])
        flat_k[slot_indices.long()] = key
        flat_v[slot_indices.long()] = value

    def _npu_paged_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                             context_lens: torch.Tensor, out: torch.Tensor) -> None:
        self.calls.append(("_npu_paged_attention", {"num_heads": num_heads, "num_kv_heads": num_kv_heads,
                                                    "context_lens": context_lens.tolist()}))
        assert block_table.dtype == torch.int32 and context_lens.device.type == "cpu"
        for i, length in enumerate(context_lens.tolist()):
            k = _context(key_cache, block_table[i], length, num_kv_heads)
            v = _context(value_cache, block_table[i], length, num_kv_heads)
            out[i : i + 1] = _attend(query[i : i + 1], k, v, scale_value, length - 1)

    def npu_fused_infer_attention_score(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                        atten_mask: torch.Tensor | None = None, block_table: torch.Tensor,
                                        input_layout: str, block_size: int, actual_seq_lengths: list[int],
                                        actual_seq_lengths_kv: list[int], num_key_value_heads: int, num_heads: int,
                                        scale: float, sparse_mode: int, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(("npu_fused_infer_attention_score", {
            "input_layout": input_layout, "sparse_mode": sparse_mode, "block_size": block_size,
            "actual_seq_lengths": list(actual_seq_lengths), "actual_seq_lengths_kv": list(actual_seq_lengths_kv),
            "mask": None if atten_mask is None else tuple(atten_mask.shape)}))
        assert input_layout == "TND" and sparse_mode == 3 and key.dim() == 3 and key.shape[1] == block_size
        out = torch.empty_like(query)
        start = 0
        for i, end in enumerate(actual_seq_lengths):  # TND: cumulative query lengths
            length = actual_seq_lengths_kv[i]
            k = _context(key, block_table[i], length, num_key_value_heads)
            v = _context(value, block_table[i], length, num_key_value_heads)
            q_len = end - start
            # sparse_mode 3: causal aligned to the bottom-right corner (new tokens follow the cached context)
            out[start:end] = _attend(query[start:end], k, v, scale, length - q_len)
            start = end
        return out, torch.empty(0)
