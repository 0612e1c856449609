"""The CPU attention kernels (``attention.cpp``), built on first use: decode and prompt attention.

Batch-invariant decoding runs attention one sequence at a time (bench/PERF.md, "Batch
invariance"). Through torch's operators that costs a gather, a dtype conversion and a
scaled-dot-product call per sequence and layer, about 90 µs each at 600 tokens of context:
two thirds of a 64-sequence decode step. The kernel does every generated token of a step in one
call, each (sequence, KV head) by one thread in a fixed order, reading the cache in place; its
output for a sequence is the same whatever shares the step.

It is built with the other kernels (then cached: :mod:`~mindie_host.backends.cpu_extensions`);
without a compiler, or with ``MINDIE_HOST_CPU_KERNELS=0``, decode attention stays on torch's
operators (logged once).

Prompt tokens (a whole prompt, or a chunk of one beside decodes) go through
:func:`prompt_attention`: flash-style over the paged cache in place, scoring only the keys each row
can see. torch's CPU scaled-dot-product kernel with the causal mask such a chunk needs (its rows sit
after a cached prefix) scores every key of the context, about a quarter of the cores' float32 rate on
the pairs the mask lets through; it took almost half of a 512-token chunk's step (bench/PERF.md,
"Prompt attention, balanced decode attention and one-row products").
"""

from __future__ import annotations

from typing import Any

import torch

from . import cpu_extensions
from .cpu_extensions import enabled

__all__ = ["decode_attention", "decode_attention_op", "enabled", "kernel", "loaded", "prompt_attention",
           "readable"]


def kernel() -> Any:
    """The active CPU kernels (building them the first time), or None when they are off or cannot be built."""
    return cpu_extensions.kernels()


def readable(cache: torch.Tensor) -> bool:
    """Whether the kernel reads a cache like ``cache`` (bfloat16 or float32, contiguous)."""
    return cache.dtype in (torch.bfloat16, torch.float32) and cache.is_contiguous()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     context_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Attention of one query token per sequence over its cached context, or None when the kernel is unavailable.

    ``q``: ``[B, H, D]`` float32; caches ``[slots, KV, D]`` (bfloat16 or float32, contiguous); ``slots``:
    ``[B, >= max context]`` int64 cache slots of each sequence's context; ``context_lens``: ``[B]`` int64.
    Returns ``[B, H, D]`` float32.
    """
    mod = cpu_extensions.active("decode_attention")
    if mod is None or not readable(k_cache):
        return None
    return mod.decode_attention(q.float().contiguous(), k_cache, v_cache, slots.contiguous(), context_lens, scale)


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """Causal attention of one sequence's ``n`` newest tokens over its ``ctx`` cached tokens, or None when the
    kernel is unavailable (no compiler, kernels off, a head dim that is not a multiple of 8).

    ``q``: ``[n, H, D]`` (row ``r`` is the token at position ``ctx - n + r`` and sees keys ``0 .. ctx - n + r``);
    caches ``[slots, KV, D]`` (bfloat16 or float32, contiguous), already holding the new tokens' K and V;
    ``slots``: ``[ctx]`` int64 cache slots of the context in order. Returns ``[n, H, D]`` float32. Over a
    bfloat16 cache with the avx512 kernels, its products take bf16 operands with float32 sums.
    """
    mod = cpu_extensions.active("prompt_attention")
    if mod is None or not readable(k_cache) or q.shape[-1] % 8:
        return None
    return mod.prompt_attention(q.float().contiguous(), k_cache, v_cache, slots.contiguous(), scale)


def loaded(cache: torch.Tensor) -> bool:
    """Whether decode attention is built and on, and can read ``cache`` (never builds it: safe while tracing)."""
    return cpu_extensions.active("decode_attention") is not None and readable(cache)


def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`decode_attention` as the registered torch operator, which a compiled decode step calls without
    going through Python. Only for after :func:`loaded` said yes; the arguments are as for
    :func:`decode_attention`."""
    return torch.ops.mindie_host_cpu.decode_attention(q.float().contiguous(), k_cache, v_cache, slots.contiguous(),
                                                      context_lens.contiguous(), scale)
