"""Sliding-window attention over the paged KV cache: each token sees only the last ``window`` positions.

transformers' rule: the token at position ``p`` attends to the keys at positions ``p - window < k <= p``.

* A step where the window hides nothing (every context within it) runs the platform's attention unchanged.
* A decode step (one new token per sequence) runs the platform's attention, kernels included, over each
  sequence's last ``window`` cache slots: :func:`decode_window_metadata` moves each sequence's gather row to
  start there. It is built from tensors only, so a compiled decode step uses it too.
* A step with longer queries whose window hides something runs each sequence through torch's attention with
  a banded causal mask (:func:`band_attention`): the kernels know only the causal mask, and a wrong answer is
  never an option.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..platform import AttentionMetadata, Platform


def windowed_attention(
    plat: Platform,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    cache: dict[int, AttentionMetadata],
    window: int,
    scale: float,
) -> torch.Tensor:
    """Attention of the step's new tokens ``q [T, H, D]`` over the last ``window`` positions of their context.

    ``cache`` keeps the window's metadata for the step's other layers.
    """
    if meta.query_lens:  # an eager step: the lengths are known here
        if max(meta.context_lens) <= window:
            return plat.paged_attention(q, k_cache, v_cache, meta, scale)  # the window hides nothing
        if meta.max_query_len > 1:
            return band_attention(plat, q, k_cache, v_cache, meta, window, scale)
    elif meta.max_query_len > 1:  # pragma: no cover - tensor-only metadata is made for decode steps only
        raise ValueError("tensor-only attention metadata with queries longer than one token")
    if window not in cache:
        cache[window] = decode_window_metadata(meta, window)
    return plat.paged_attention(q, k_cache, v_cache, cache[window], scale)


def decode_window_metadata(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """``meta`` of a decode step (one new token per sequence) narrowed to each sequence's last ``window`` slots:
    row ``i`` of the gather index starts at position ``max(0, ctx_i - window)``."""
    gather, mask = meta.gather_index, meta.attn_mask
    assert mask is not None, "a decode step's metadata has its context mask"
    seqs, width = gather.shape
    ctx = mask.reshape(seqs, -1).sum(1)
    kept = min(window, width)
    offsets = torch.arange(kept, device=gather.device)
    start = (ctx - window).clamp(min=0)
    index = (start.unsqueeze(1) + offsets.unsqueeze(0)).clamp(max=width - 1)
    new_ctx = ctx.clamp(max=window)
    return dataclasses.replace(
        meta,
        gather_index=gather.gather(1, index),
        attn_mask=(offsets.unsqueeze(0) < new_ctx.unsqueeze(1)).view(seqs, 1, 1, kept),
        max_context_len=min(meta.max_context_len, window),
        context_lens=[min(c, window) for c in meta.context_lens],
        extra={},
    )


def band_attention(
    plat: Platform,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Each sequence's new tokens over the keys within ``window`` of each, through torch's attention with a banded
    causal mask (sequence by sequence, so a row's result does not depend on the rest of the step)."""
    from ..platform import gather_slots

    out = torch.empty_like(q)
    dt = plat.attention_dtype(k_cache.dtype)
    start = 0
    for i, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        first = max(0, ctx - n - window + 1)  # the first position any of these rows sees
        slots = meta.gather_index[i, first:ctx]
        qpos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        kpos = torch.arange(first, ctx, device=q.device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window)
        o = plat.attention(
            q[start : start + n].transpose(0, 1).unsqueeze(0).to(dt),  # [1, H, n, D]
            gather_slots(k_cache, slots).transpose(0, 1).unsqueeze(0).to(dt),  # [1, KV, L, D]
            gather_slots(v_cache, slots).transpose(0, 1).unsqueeze(0).to(dt),
            mask.view(1, 1, n, -1),
            scale,
        )
        out[start : start + n] = o[0].transpose(0, 1).to(q.dtype)
        start += n
    return out
