#!/usr/bin/env python3
"""Per-matrix rates of the low-bit product at a model's decode shapes (default: a 1B Llama), by row count and threads.

For each of a Llama layer's products (the fused Q/K/V, O, the gated MLP's gate/up and its down projection) in GGUF
Q4_0 form (4-bit codes, groups of 32, offset -8 * scale) and Q8_0 form (int8, groups of 32), and the LM head in
the form the loader gives a Q6_K head (int8 groups of 16, a float32 scale each; groups of 32 with Q8_0's float16
scales for comparison), it times ``LowBitTiles(x)`` on random codes for ``--rows`` bfloat16/float32 rows (median of ``--repeat`` calls,
interleaved call by call across the builds compared) and prints GB/s of the bytes the kernel streams (codes,
scales, offsets) and of the GGUF file's bytes for the same matrix (Q4_0 18 bytes / 32 weights, Q8_0 34 / 32,
Q6_K 210 / 256), so the second figure compares with llama.cpp at the same weights.

``--compare OTHER.so`` alternates another build's kernel library (copied aside from
``$TORCH_EXTENSIONS_DIR/.../kernels``) with this build's in the same process, call by call, and checks that both
give the same bits; the other builds are given float32 scales (builds before the kernel took float16 ones need them),
with the offsets as this build keeps them, or every group's offset stored with ``--stored-offsets`` (builds before
the kernel derived Q4_0's and 8-bit groups' offsets from their scales need them); this build gets the tiles as the
loader makes them (float16 scales for Q4_0 and Q8_0). Run under ``nice -n 19`` when the machine is shared.

    python bench/lowbit_shapes.py                               # 1B shapes, rows 1..5, 1 and 2 threads
    python bench/lowbit_shapes.py --rows 1 --threads 2 --compare /tmp/before.so
    python bench/lowbit_shapes.py --rows 1 --threads 1 --compare /tmp/before.so --same-tiles   # both take float16
    MINDIE_HOST_CPU_ISA=avx2 python bench/lowbit_shapes.py --rows 1,2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from mindie_host.backends import cpu_extensions, cpu_matmul
from mindie_host.backends.cpu_matmul import LowBitTiles

GGUF_BYTES_PER_WEIGHT = {"q4_0": 18 / 32, "q8_0": 34 / 32, "q6_k": 210 / 256, "int8/32": 34 / 32}


def matrices(hidden: int, q_out: int, mlp: int, vocab: int) -> list[tuple[str, int, int, list[str]]]:
    """(name, out features, in features, forms) of one layer's products and the head."""
    layer = ["q4_0", "q8_0"]
    return [("qkv", q_out, hidden, layer), ("o", hidden, hidden, layer), ("gate_up", 2 * mlp, hidden, layer),
            ("down", hidden, mlp, layer), ("head", vocab, hidden, ["q6_k", "int8/32"])]


def make_tiles(form: str, n: int, k: int, g: torch.Generator) -> LowBitTiles:
    """Random codes in ``form``'s layout, as the loader builds them (linear.FourBitWeight / Int8Weight)."""
    if form == "q4_0":
        scale = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
        return LowBitTiles.four_bit(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scale, -8 * scale,
                                    32)
    gs = 16 if form == "q6_k" else 32
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // gs, generator=g) * 0.001
    if gs == 32:  # Q8_0's scales are the file's float16 d; a Q6_K head's d * scale_j stay float32
        scale = scale.half().float()
    return LowBitTiles(codes, scale, torch.zeros_like(scale), gs)


def streamed_bytes(t: LowBitTiles) -> int:
    """The bytes of the tiles' codes, scales and offsets the kernel reads."""
    return sum(a.numel() * a.element_size() for a in (t.codes, t.scale, t.offset) if a is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,5")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--shape", default="2048,3072,8192,49152", help="hidden, fused QKV out, MLP, vocab")
    ap.add_argument("--only", default="", help="comma-separated matrix names (qkv,o,gate_up,down,head)")
    ap.add_argument("--compare", help="other builds' kernel libraries (comma-separated), alternated call by call with this build's")
    ap.add_argument("--stored-offsets", action="store_true",
                    help="give the other builds every group's offset (builds before derived offsets)")
    ap.add_argument("--same-tiles", action="store_true",
                    help="give the other builds the tiles this build gets (builds that take float16 scales)")
    args = ap.parse_args(argv)
    if cpu_matmul.kernel() is None:
        raise SystemExit("the kernels could not be built here (no compiler)")
    sides: dict[str, Any] = {"this": cpu_extensions.active("lowbit_matmul")}
    for other in filter(None, (args.compare or "").split(",")):
        sides[Path(other).stem] = cpu_extensions.load_library(Path(other))
    hidden, q_out, mlp, vocab = (int(v) for v in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    only = set(filter(None, args.only.split(",")))
    report = []
    for name, n, k, forms in matrices(hidden, q_out, mlp, vocab):
        if only and name not in only:
            continue
        for form in forms:
            tiles = make_tiles(form, n, k, g)
            stored = copy.copy(tiles)  # the tiles other builds are given
            if not args.same_tiles:
                stored.scale = tiles.scale.float()  # what builds before float16 scales take
                stored.offset = tiles.full_offset() if args.stored_offsets else tiles.offset.float()
            nbytes = {side: streamed_bytes(tiles if side == "this" else stored) for side in sides}
            gguf = n * k * GGUF_BYTES_PER_WEIGHT[form]
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for m in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(m, k, generator=g)
                    times: dict[str, list[float]] = {s: [] for s in sides}
                    outs: dict[str, torch.Tensor] = {}
                    for i in range(args.repeat + 2):
                        for side, lib in sides.items():
                            with cpu_extensions.using(lib):
                                t0 = time.perf_counter()
                                outs[side] = (tiles if side == "this" else stored)(x)
                                if i >= 2:
                                    times[side].append(time.perf_counter() - t0)
                    row: dict[str, Any] = {"matrix": name, "form": form, "n": n, "k": k, "rows": m,
                                           "threads": threads}
                    for side, ts in times.items():
                        med = statistics.median(ts)
                        row[side] = {"us": round(med * 1e6), "GB/s": round(nbytes[side] / med / 1e9, 1),
                                     "GB/s gguf": round(gguf / med / 1e9, 1)}
                    if len(outs) > 1:
                        first = next(iter(outs.values()))
                        row["same_bits"] = all(torch.equal(first, o) for o in outs.values())
                    print(f"{name:8s} {form:8s} {k:5d}->{n:6d} rows {m} threads {threads}: " + ", ".join(
                        f"{s} {row[s]['us']:6d} us {row[s]['GB/s']:5.1f} GB/s ({row[s]['GB/s gguf']:5.1f} gguf)"
                        for s in times) + (f" same bits {row['same_bits']}" if "same_bits" in row else ""),
                        flush=True)
                    report.append(row)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
