#!/usr/bin/env python3
"""GEMM rates of the low-bit weight products on this CPU, by row count.

For the default model's two product shapes (576 -> 1536, the gate/up projection's halves, and
1536 -> 576, the down projection) with random 4-bit codes in groups of 32, it times ``x @ W.T`` for
bfloat16 ``x`` of ``--rows`` rows three ways (median of ``--repeat`` calls):

* ``package``: this package's kernel (mindie_host/backends/lowbit_matmul.cpp, what decode steps use);
* ``torch int4``: torch's ``_weight_int4pack_mm_for_cpu`` (what they used before);
* ``bf16 dense``: oneDNN's bfloat16 GEMM over the dequantized weight (what prompt rows use).

    python bench/lowbit_matmul.py --rows 1,16,64,512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mindie_host.backends import cpu_matmul
from mindie_host.backends.cpu_matmul import LowBitTiles


def timed(fn: Callable[[], torch.Tensor], repeat: int) -> float:
    """Median seconds of one call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    if cpu_matmul.kernel() is None:
        raise SystemExit("the kernels could not be built here (no compiler)")
    g = torch.Generator().manual_seed(0)
    report = []
    for n, k in ((1536, 576), (576, 1536)):
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, k // 32, generator=g) * 0.02
        offset = -8 * scale
        tiles = LowBitTiles.four_bit(codes, scale, offset, 32)
        dense = tiles.dequantize().to(torch.bfloat16)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        scales_zeros = torch.stack([scale, offset + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            ways: dict[str, Callable[[], torch.Tensor]] = {
                "package": lambda x=x, t=tiles: t(x),
                "torch int4": lambda x=x, p=packed, sz=scales_zeros: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, p, 32, sz),
                "bf16 dense": lambda x=x, w=dense: F.linear(x, w),
            }
            row = {"n": n, "k": k, "rows": m}
            for name, fn in ways.items():
                row[name] = round(2 * m * n * k / timed(fn, args.repeat) / 1e9, 1)  # GFLOP/s
            print(f"{k:5d} -> {n:5d}, {m:4d} rows: " + ", ".join(f"{w} {row[w]:7.1f}" for w in ways) + " GFLOP/s",
                  flush=True)
            report.append(row)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
