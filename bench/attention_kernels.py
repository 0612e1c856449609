#!/usr/bin/env python3
"""The CPU attention kernels (mindie_host/backends/attention.cpp) against torch's attention, per layer.

Two cases, shaped like the default model's layers (9 query heads, 3 KV heads, head dim 64) over a bf16
paged cache whose 16-token blocks sit at random places:

* ``prompt``: a ``--chunk``-token prompt chunk after ``--prefix`` cached tokens (what a mixed step runs per
  layer): :func:`cpu_attention.prompt_attention` against torch's ``scaled_dot_product_attention`` over the
  gathered context with the causal mask the chunk needs (what the server ran before the kernel), median of
  ``--repeat`` calls;
* ``decode``: one query token for each of ``--seqs`` sequences whose contexts spread evenly around
  ``--context`` (+-75%), through :func:`cpu_attention.decode_attention`, once per layer over ``--layers``
  separate caches, so each call reads its K/V from memory as a decode step does (the caches do not fit in
  the last-level cache); reported per layer with the bytes of K/V it read per second.

    python bench/attention_kernels.py
    python bench/attention_kernels.py --chunk 512 --prefix 512 --seqs 52 --context 600
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from mindie_host.backends import cpu_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowbit_matmul import timed  # noqa: E402

H, KV, D, BLOCK = 9, 3, 64, 16


def paged_slots(lengths: list[int], total_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Each sequence's cache slots, in 16-token blocks at random places: ``[len(lengths), max(lengths)]``."""
    per_seq = -(-max(lengths) // BLOCK)
    blocks = torch.randperm(total_blocks, generator=g)[: len(lengths) * per_seq].view(len(lengths), per_seq)
    return (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(len(lengths), -1)[:, : max(lengths)].contiguous()


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median milliseconds of one call (:func:`lowbit_matmul.timed`, the same warm-up and median)."""
    return 1000 * timed(fn, repeat)  # type: ignore[arg-type]


def prompt_case(chunk: int, prefix: int, repeat: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    ctx = prefix + chunk
    blocks = -(-ctx // BLOCK) * 2
    k = torch.randn(blocks * BLOCK, KV, D, generator=g).bfloat16()
    v = torch.randn(blocks * BLOCK, KV, D, generator=g).bfloat16()
    slots = paged_slots([ctx], blocks, g)[0]
    q = torch.randn(chunk, H, D, generator=g)

    def torch_attention() -> torch.Tensor:
        keys = k.index_select(0, slots).transpose(0, 1).unsqueeze(0).float()
        values = v.index_select(0, slots).transpose(0, 1).unsqueeze(0).float()
        mask = torch.ones(chunk, ctx, dtype=torch.bool).tril(ctx - chunk).view(1, 1, chunk, ctx)
        return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                              scale=D ** -0.5, enable_gqa=True)

    kernel_ms = median_ms(lambda: cpu_attention.prompt_attention(q, k, v, slots, D ** -0.5), repeat)
    torch_ms = median_ms(torch_attention, repeat)
    visible = chunk * prefix + chunk * (chunk + 1) / 2  # (query, key) pairs the causal mask lets through
    flops = 4 * H * D * visible
    return {"kernel_ms": round(kernel_ms, 2), "torch_sdpa_ms": round(torch_ms, 2),
            "kernel_gflops": round(flops / kernel_ms / 1e6, 1)}


def decode_case(seqs: int, context: int, layers: int, repeat: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    lengths = [max(1, round(context * (0.25 + 1.5 * i / max(seqs - 1, 1)))) for i in range(seqs)]
    blocks = seqs * -(-max(lengths) // BLOCK)
    caches = [(torch.randn(blocks * BLOCK, KV, D, generator=g).bfloat16(),
               torch.randn(blocks * BLOCK, KV, D, generator=g).bfloat16()) for _ in range(layers)]
    slots = paged_slots(lengths, blocks, g)
    lens = torch.tensor(lengths)
    q = torch.randn(seqs, H, D, generator=g)

    def step() -> None:
        for k, v in caches:
            cpu_attention.decode_attention(q, k, v, slots, lens, D ** -0.5)

    per_layer = median_ms(step, repeat) / layers
    read = sum(lengths) * KV * D * 2 * 2  # bf16 K and V of every context token
    return {"ms_per_layer": round(per_layer, 3), "gb_per_s": round(read / per_layer / 1e6, 1),
            "context_tokens": sum(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=52)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    if cpu_attention.kernel() is None:
        raise SystemExit("the attention kernels could not be built here (see the log)")
    prompt = prompt_case(args.chunk, args.prefix, args.repeat)
    print(f"prompt chunk {args.chunk} after {args.prefix}: kernel {prompt['kernel_ms']} ms "
          f"({prompt['kernel_gflops']} GFLOP/s), torch SDPA {prompt['torch_sdpa_ms']} ms a layer", flush=True)
    decode = decode_case(args.seqs, args.context, args.layers, max(3, args.repeat // 3))
    print(f"decode {args.seqs} sequences, {decode['context_tokens']} context tokens: {decode['ms_per_layer']} ms "
          f"a layer ({decode['gb_per_s']} GB/s of K/V)", flush=True)
    print(json.dumps({"args": vars(args), "prompt": prompt, "decode": decode}))


if __name__ == "__main__":
    main()
