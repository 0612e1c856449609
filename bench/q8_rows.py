#!/usr/bin/env python3
"""The int8 prompt rows kernel (``lowbit_q8_rows``) against the low-bit product it may replace for prompt rows.

For prompt-sized row counts (``--rows``, default 64, 256, 512) and each matrix shape (a 1B Llama's square, gate/up
and down products, the 135M model's MLP), in GGUF Q4_0 and Q8_0 form (the loader's tiles: float16 scales), it times
on each kernel variant (``--variants``, default avx512 and avx2 where this CPU runs them):

* ``lowbit_matmul``: the activations in the variant's dtype (bfloat16 on avx512, float32 on avx2);
* ``lowbit_q8_rows``: the rows already quantized (``quantize_rows``, whose own time is the ``quant`` column in
  torch, ``qkern`` in the kernels' ``quantize_rows``);

calls interleaved one by one, median of ``--repeat`` each (and the ratio of the fastest calls, ``(min)``, which a
busy machine disturbs less), on ``--threads`` of torch's threads, and checks once (up to 64 rows) that the int8
product is the reference's bits. GOP/s count 2 * M * N * K, at the median.

    nice -n 19 python bench/q8_rows.py                     # the table of bench/PERF.md
    nice -n 19 python bench/q8_rows.py --rows 64 --only 2048x2048 --variants avx512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from mindie_host.backends import cpu_extensions, cpu_profile
from mindie_host.backends.cpu_matmul import LowBitTiles, q8_rows_reference, quantize_rows

#: (name, K in, N out): the 1B Llama's square product (o), gate/up fused, down; the 135M model's up and down
SHAPES = [("1B o", 2048, 2048), ("1B gate/up", 2048, 16384), ("1B down", 8192, 2048), ("135M up", 576, 1536),
          ("135M down", 1536, 576)]


def make_tiles(form: str, n: int, k: int, g: torch.Generator) -> LowBitTiles:
    """Random codes as the loader keeps a GGUF Q4_0 or Q8_0 matrix (float16 scales, derived offsets)."""
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    if form == "q4_0":
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        return LowBitTiles.four_bit(codes, scale, -8 * scale, 32)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return LowBitTiles(codes, scale, torch.zeros_like(scale), 32)


def timed(fns: list[Callable[[], object]], repeat: int) -> list[list[float]]:
    """Each function's seconds a call, their calls interleaved one by one (after one warm-up call each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


def measure(kernels: Any, tiles: LowBitTiles, x: torch.Tensor, act: torch.dtype, repeat: int) -> list[list[float]]:
    """Seconds of lowbit_matmul, lowbit_q8_rows, quantize_rows (torch) and the kernels' quantize_rows on rows ``x``
    (checking the int8 product's bits against the reference once, up to 64 rows)."""
    xa = x.to(act).contiguous()
    rows = quantize_rows(x)

    def q8() -> torch.Tensor:
        return kernels.lowbit_q8_rows(rows.q, rows.scale, rows.qsum, tiles.codes, tiles.scale, tiles.offset, tiles.n,
                                      tiles.group_size)

    if x.shape[0] <= 64 and not torch.equal(q8(), q8_rows_reference(rows, tiles)):
        raise SystemExit(f"{kernels.variant} {tuple(x.shape)} x {tiles.n}: not the reference's bits")
    return timed([lambda: kernels.lowbit_matmul(xa, tiles.codes, tiles.scale, tiles.offset, tiles.n, tiles.group_size),
                  q8, lambda: quantize_rows(x), lambda: kernels.quantize_rows(x)], repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256,512")
    ap.add_argument("--variants", default="avx512,avx2")
    ap.add_argument("--forms", default="q4_0,q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", default="", help="comma-separated KxN shapes, e.g. 2048x2048")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    isas = tuple(v for v in args.variants.split(",") if cpu_profile.features().runs(v))
    loaded = cpu_extensions.load_variants(isas)
    only = {s for s in args.only.split(",") if s}
    print(f"# {args.threads} threads, median of {args.repeat}, load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'variant':8} {'shape':12} {'K x N':>11} {'form':5} {'M':>4} {'matmul ms':>10} {'q8 ms':>8} "
          f"{'speedup':>7} {'(min)':>7} {'q8 GOP/s':>8} {'quant ms':>8} {'qkern ms':>8}")
    g = torch.Generator().manual_seed(0)
    for isa in isas:
        kernels = loaded.get(isa)
        if kernels is None or not kernels.has_q8_rows:
            print(f"{isa}: not built, or without lowbit_q8_rows")
            continue
        act = torch.bfloat16 if kernels.lowbit_takes_bfloat16 else torch.float32
        for name, k, n in SHAPES:
            if only and f"{k}x{n}" not in only:
                continue
            for form in args.forms.split(","):
                tiles = make_tiles(form, n, k, g)
                for m in (int(r) for r in args.rows.split(",")):
                    matmul, q8, quant, quant_kernel = measure(kernels, tiles, torch.randn(m, k, generator=g), act,
                                                              args.repeat)
                    matmul_s, q8_s = statistics.median(matmul), statistics.median(q8)
                    print(f"{isa:8} {name:12} {f'{k}x{n}':>11} {form:5} {m:4} {matmul_s * 1e3:10.2f} "
                          f"{q8_s * 1e3:8.2f} {matmul_s / q8_s:6.2f}x {min(matmul) / min(q8):6.2f}x "
                          f"{2 * m * n * k / q8_s / 1e9:8.0f} {statistics.median(quant) * 1e3:8.2f} "
                          f"{statistics.median(quant_kernel) * 1e3:8.2f}", flush=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
