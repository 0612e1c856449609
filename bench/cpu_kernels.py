#!/usr/bin/env python3
"""Each CPU kernel of one variant against the torch operators it replaces, at a model's shapes.

``--isa portable|avx2|avx512|neon`` picks the kernels' variant and the CPU profile's dtypes (it sets
``MINDIE_HOST_CPU_ISA``; ``neon`` on an aarch64 machine, where it is the way to time the opt-in NEON low-bit
product against ``portable``); ``--profile avx2`` also runs torch as on an AVX2 CPU: the process re-executes
itself with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (what
``bench/peers.py --profile avx2`` gives the servers). Medians of ``--repeat`` calls, in ms, for:

* ``lowbit``: ``x @ W.T`` for the model's 4-bit matrices (Q4_0 groups of 32) at ``--rows`` rows: the kernel
  reading the codes, against torch's float32 product over the dequantized weight (MKL; what
  ``quantization: none`` or a float32 copy would run) and, in the avx512 profile, oneDNN's bfloat16
  product (what the prompt rows' copy runs), with GFLOP/s;
* ``attention``: a ``--chunk``-token prompt chunk after ``--prefix`` cached tokens, and one decode token for
  each of ``--seqs`` sequences with ``--context`` tokens, per layer over a float32 cache, against torch's
  ``scaled_dot_product_attention`` over the gathered context (the masked chunk; the sequences one by one);
* ``layer``: the residual add with its RMSNorm and the rotary embedding of q and k for ``--rows`` rows,
  against torch's operators.

On a shared machine wall times swing with the other tenants: ``--threads 1 --clock cpu`` times each call
by this process's CPU time on one thread instead (what the work costs a core, not how long it waited).

    python bench/cpu_kernels.py --isa avx2 --profile avx2
    python bench/cpu_kernels.py --isa avx2 --profile avx2 --threads 1 --clock cpu
    python bench/cpu_kernels.py --isa avx512 --shape 1b
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

#: model shapes: hidden, intermediate, heads, KV heads, head dim
SHAPES = {"135m": (576, 1536, 9, 3, 64), "1b": (2048, 8192, 32, 8, 64), "3b": (3072, 8192, 24, 8, 128)}


#: "wall" (the median of wall times) or "cpu" (this process's CPU time per call), set by --clock
CLOCK = "wall"


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    """Milliseconds of one call: the median wall time (bench/lowbit_matmul.py's timer), or the mean CPU time."""
    if CLOCK == "cpu":
        fn()
        start = time.process_time()
        for _ in range(repeat):
            fn()
        return (time.process_time() - start) / repeat * 1e3
    sys.path.insert(0, str(Path(__file__).parent))
    from lowbit_matmul import timed

    return timed(fn, repeat) * 1e3  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", choices=["portable", "avx2", "avx512", "neon"], required=True)
    ap.add_argument("--profile", choices=["native", "avx2"], default="native", help="torch's instruction set")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--only", choices=["lowbit", "attention", "layer"])
    ap.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from cpu_profiles import TORCH_AVX2, run_as

    if args.profile == "avx2":
        run_as(TORCH_AVX2)
    os.environ["MINDIE_HOST_CPU_ISA"] = args.isa

    import torch
    import torch.nn.functional as F

    from mindie_host.backends import cpu_extensions, cpu_profile
    from mindie_host.backends.cpu_matmul import LowBitTiles
    from mindie_host.backends.platform import _rope

    global CLOCK
    CLOCK = args.clock
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_extensions.kernels()
    if kernels is None:
        raise SystemExit(f"the {args.isa} kernels could not be built here")
    prof = cpu_profile.profile()
    print(f"{prof.describe()}; torch {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads",
          flush=True)
    hidden, inter, heads, kv, dim = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    report: dict[str, list[dict[str, object]]] = {"lowbit": [], "attention": [], "layer": []}
    rows = [int(r) for r in args.rows.split(",")]

    if args.only in (None, "lowbit"):
        for n, k in ((2 * inter, hidden), (hidden, inter)):  # the gate/up product and the down product
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            scale = torch.rand(n, k // 32, generator=g) * 0.02
            tiles = LowBitTiles.four_bit(codes, scale, -8 * scale, 32)
            dense = tiles.dequantize()
            bf16 = dense.bfloat16() if prof.native_bf16 else None
            for m in rows:
                x = torch.randn(m, k, generator=g)
                ways: dict[str, Callable[[], object]] = {"kernel": lambda x=x, t=tiles: t(x),
                                                         "torch fp32": lambda x=x, w=dense: F.linear(x, w)}
                if bf16 is not None:
                    ways["torch bf16"] = lambda x=x.bfloat16(), w=bf16: F.linear(x, w)
                row: dict[str, object] = {"k": k, "n": n, "rows": m}
                for name, fn in ways.items():
                    ms = median_ms(fn, args.repeat)
                    row[name] = {"ms": round(ms, 3), "gflops": round(2 * m * n * k / ms / 1e6, 1)}
                print(f"lowbit {k:5d} -> {n:5d}, {m:4d} rows: " + ", ".join(
                    f"{w} {row[w]['ms']:8.3f} ms ({row[w]['gflops']:6.1f} GFLOP/s)" for w in ways), flush=True)
                report["lowbit"].append(row)

    if args.only in (None, "attention"):
        scale = dim ** -0.5
        slots_total = 65536
        kc, vc = torch.randn(slots_total, kv, dim, generator=g), torch.randn(slots_total, kv, dim, generator=g)
        ctx = args.prefix + args.chunk
        slots = torch.randperm(slots_total, generator=g)[:ctx]
        q = torch.randn(args.chunk, heads, dim, generator=g)
        mask = torch.ones(args.chunk, ctx, dtype=torch.bool).tril(ctx - args.chunk)[None, None]

        def torch_prompt() -> object:
            keys = kc.index_select(0, slots).transpose(0, 1)[None]
            values = vc.index_select(0, slots).transpose(0, 1)[None]
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)

        p_kernel = median_ms(lambda: kernels.prompt_attention(q, kc, vc, slots, scale), args.repeat)
        p_torch = median_ms(torch_prompt, args.repeat)
        print(f"prompt attention, {args.chunk} rows after {args.prefix}: kernel {p_kernel:.2f} ms, torch {p_torch:.2f} ms",
              flush=True)
        seq_slots = torch.randperm(slots_total, generator=g)[: args.seqs * args.context].view(args.seqs, args.context)
        lens = torch.full((args.seqs,), args.context)
        qd = torch.randn(args.seqs, heads, dim, generator=g)

        def torch_decode() -> object:
            for b in range(args.seqs):
                keys = kc.index_select(0, seq_slots[b]).transpose(0, 1)[None]
                values = vc.index_select(0, seq_slots[b]).transpose(0, 1)[None]
                F.scaled_dot_product_attention(qd[b][None, :, None], keys, values, scale=scale, enable_gqa=True)
            return None

        d_kernel = median_ms(lambda: kernels.decode_attention(qd, kc, vc, seq_slots, lens, scale), args.repeat)
        d_torch = median_ms(torch_decode, args.repeat)
        print(f"decode attention, {args.seqs} sequences x {args.context} tokens: kernel {d_kernel:.2f} ms, "
              f"torch {d_torch:.2f} ms", flush=True)
        report["attention"].append({"prompt_kernel_ms": round(p_kernel, 3), "prompt_torch_ms": round(p_torch, 3),
                                    "decode_kernel_ms": round(d_kernel, 3), "decode_torch_ms": round(d_torch, 3)})

    if args.only in (None, "layer"):
        w = torch.randn(hidden, generator=g)
        for m in rows:
            x, r = torch.randn(m, hidden, generator=g), torch.randn(m, hidden, generator=g)
            qkv = torch.randn(m, (heads + 2 * kv) * dim, generator=g)
            qv, kvv = qkv[:, : heads * dim].view(m, heads, dim), qkv[:, heads * dim : (heads + kv) * dim].view(m, kv, dim)
            cos, sin = torch.randn(m, 1, dim, generator=g), torch.randn(m, 1, dim, generator=g)
            c2, s2 = cos.view(m, dim), sin.view(m, dim)
            norm_k = median_ms(lambda x=x, r=r: kernels.add_rms_norm(x, r, w, 1e-5), args.repeat)
            norm_t = median_ms(lambda x=x, r=r: F.rms_norm(x + r, (hidden,), w, 1e-5), args.repeat)
            rope_k = median_ms(lambda qv=qv, kvv=kvv, c2=c2, s2=s2: kernels.rope(qv, kvv, c2, s2), args.repeat)
            rope_t = median_ms(lambda qv=qv, kvv=kvv, c=cos, s=sin: (_rope(qv, c, s), _rope(kvv, c, s)), args.repeat)
            print(f"layer ops, {m:4d} rows: add+RMSNorm kernel {norm_k:.3f} ms, torch {norm_t:.3f} ms; "
                  f"RoPE kernel {rope_k:.3f} ms, torch {rope_t:.3f} ms", flush=True)
            report["layer"].append({"rows": m, "norm_kernel_ms": round(norm_k, 4), "norm_torch_ms": round(norm_t, 4),
                                    "rope_kernel_ms": round(rope_k, 4), "rope_torch_ms": round(rope_t, 4)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": args.isa, "profile": args.profile, "shape": args.shape, "clock": args.clock,
                   "threads": torch.get_num_threads(), **report}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
