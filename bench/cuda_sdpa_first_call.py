#!/usr/bin/env python3
"""What a new attention shape costs on a GPU, per choice of SDPA kernels (bench/PERF.md, round 3).

A serving step's context length changes every step, so an attention kernel that
plans per shape pays that planning over and over. For ten fresh shapes each, this
times the first call and a warm call of ``scaled_dot_product_attention`` (bf16,
32 heads of 64, boolean mask) with torch's default choice, with the kernels
``CudaPlatform.attention`` allows, and with cuDNN's alone.

    python bench/cuda_sdpa_first_call.py
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mindie_host.backends.platform import CudaPlatform


def timed(fn: Callable[[], torch.Tensor]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0)


def case(q_len: int, ctx: int) -> Callable[[], torch.Tensor]:
    q = torch.randn(1, 32, q_len, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32, ctx, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.ones(1, 1, q_len, ctx, dtype=torch.bool, device="cuda").tril(ctx - q_len)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)


def main() -> None:
    choices: dict[str, list[SDPBackend] | None] = {
        "torch's default": None,
        "CudaPlatform's": [getattr(SDPBackend, b) for b in CudaPlatform.ATTENTION_BACKENDS],
        "cuDNN only": [SDPBackend.CUDNN_ATTENTION],
    }
    print("| SDPA kernels | shapes | first call ms | warm ms |\n| --- | --- | --- | --- |")
    base = 0
    for name, backends in choices.items():
        for kind, shapes in (("decode (q=1)", [(1, c + base) for c in range(40, 50)]),
                             ("prefill", [(q + base, q + base + 32) for q in range(8, 18)])):
            firsts, warms = [], []
            for shape in shapes:
                fn = case(*shape)
                with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                    firsts.append(timed(fn))
                    warms.append(timed(fn))
            print(f"| {name} | {kind} | {sum(firsts) / len(firsts):.2f} | {sum(warms) / len(warms):.3f} |")
        base += 100  # fresh shapes for the next choice


if __name__ == "__main__":
    main()
