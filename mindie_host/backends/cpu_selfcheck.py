"""Each CPU kernel, once built, against torch's operator on random inputs of the loaded model's own shapes.

A kernel's paths depend on its shapes (head dim, grouped-query ratio, hidden size, group size, row
counts, tails that are not a multiple of the vector width), and a variant may be built for a CPU
the tests never ran on. So before a model uses them, the backend runs every kernel once beside
torch's operator on inputs shaped like the model's (:func:`check`, a few milliseconds); a kernel
whose answer is not within its tolerance is turned off with one warning that names it, and torch's
operator serves it. No CPU gets a silent wrong answer from a kernel.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("mindie_host.backends")


@dataclass(frozen=True)
class ModelShapes:
    """What the kernels' paths depend on in a model: its layer sizes, its KV cache's dtype, and its low-bit matrices
    as ``(kind, input size, group size)`` with ``kind`` ``"int4"`` (4-bit groups) or ``"int8"`` (8-bit groups)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    kv_dtype: torch.dtype = torch.float32
    low_bit: tuple[tuple[str, int, int], ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Mismatch:
    """A kernel that disagreed with torch: by how much (relative to the reference's largest value) and what is
    allowed."""

    kernel: str
    error: float
    allowed: float
    case: str


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-6)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _layer_ops(k: Any, s: ModelShapes, g: torch.Generator) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
    rows = 5
    x, r, w = torch.randn(rows, s.hidden, generator=g), torch.randn(rows, s.hidden, generator=g), torch.randn(
        s.hidden, generator=g)
    want = F.rms_norm(x + r, (s.hidden,), w, 1e-6)
    got = k.add_rms_norm(x.clone(), r, w, 1e-6)
    d = s.head_dim
    qkv = torch.randn(3, (s.heads + 2 * s.kv_heads) * d, generator=g)
    q, kk = qkv[:, : s.heads * d].view(3, s.heads, d), qkv[:, s.heads * d : (s.heads + s.kv_heads) * d].view(3, -1, d)
    angle = torch.rand(3, d // 2, generator=g) * 100
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    qo, ko = k.rope(q, kk, cos, sin)
    return [("add_rms_norm", 1e-5, got, want),
            ("rope", 1e-6, torch.cat([qo.flatten(), ko.flatten()]),
             torch.cat([_rope(q, cos[:, None], sin[:, None]).flatten(), _rope(kk, cos[:, None], sin[:, None]).flatten()]))]


def _attention(k: Any, s: ModelShapes, g: torch.Generator, kernel: str) -> list[tuple[str, float, torch.Tensor,
                                                                                       torch.Tensor]]:
    slots_total, d, scale = 320, s.head_dim, s.head_dim ** -0.5
    cache_k = torch.randn(slots_total, s.kv_heads, d, generator=g).to(s.kv_dtype)
    cache_v = torch.randn(slots_total, s.kv_heads, d, generator=g).to(s.kv_dtype)
    keys, values = cache_k.float(), cache_v.float()
    gqa = s.heads != s.kv_heads
    if kernel == "decode_attention":
        # three sequences, then a run: five rows of one sequence at consecutive positions (verification rows),
        # which share one walk over the cache
        lens = [1, 19, 70, 40, 41, 42, 43, 44]
        q = torch.randn(len(lens), s.heads, d, generator=g)
        slots = torch.randperm(slots_total, generator=g)[: 4 * 70].view(4, 70)
        slots = torch.cat([slots[:3], slots[3:].expand(5, 70)]).contiguous()
        got = k.decode_attention(q, cache_k, cache_v, slots, torch.tensor(lens), scale)
        want = torch.stack([F.scaled_dot_product_attention(
            q[b][None, :, None], keys[slots[b, :n]].transpose(0, 1)[None], values[slots[b, :n]].transpose(0, 1)[None],
            scale=scale, enable_gqa=gqa)[0, :, 0] for b, n in enumerate(lens)])
        return [("decode_attention", 1e-4, got, want)]
    n, ctx = 21, 37
    q = torch.randn(n, s.heads, d, generator=g)
    slots = torch.randperm(slots_total, generator=g)[:ctx]
    got = k.prompt_attention(q, cache_k, cache_v, slots, scale)
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n).view(1, 1, n, ctx)
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[slots].transpose(0, 1)[None],
                                          values[slots].transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                          enable_gqa=gqa)[0].transpose(0, 1)
    # over a bf16 cache the avx512 kernel's two products take bf16 operands (bench/PERF.md): about bf16's precision
    bf16_products = s.kv_dtype == torch.bfloat16 and k.lowbit_takes_bfloat16
    return [("prompt_attention", 2e-2 if bf16_products else 1e-4, got, want)]


def _lowbit(k: Any, s: ModelShapes, g: torch.Generator) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
    from .cpu_matmul import LowBitTiles

    act = torch.bfloat16 if k.lowbit_takes_bfloat16 else torch.float32
    out = []
    for kind, cols, group_size in s.low_bit:
        n = 40  # a whole tile of 32 output columns and a ragged one
        # both forms of the scales: float16 ones (a GGUF file's d: LowBitTiles keeps them so) and float32 ones
        for half in (True, False):
            scale = torch.rand(n, cols // group_size, generator=g) * 0.02 + 1e-3
            scale = scale.half().float() if half else scale
            if kind == "int4":
                codes = torch.randint(0, 16, (n, cols), generator=g, dtype=torch.uint8)
                tiles = LowBitTiles.four_bit(codes, scale, -8 * scale, group_size)
            else:
                codes = torch.randint(-127, 128, (n, cols), generator=g, dtype=torch.int8)
                tiles = LowBitTiles(codes, scale, torch.zeros_like(scale), group_size)
            weight = tiles.dequantize()
            # the paths of one and two rows, and of many, for generated rows and (where the library has their own
            # entry) prompt rows
            products = [("", k.lowbit_matmul)]
            if getattr(k, "has_prompt_rows", False):
                products.append((" (prompt rows)", k.lowbit_matmul_prompt))
            for rows in (1, 2, 7):
                x = torch.randn(rows, cols, generator=g).to(act)
                for which, product in products:
                    got = product(x, tiles.codes, tiles.scale, tiles.offset, tiles.n, tiles.group_size)
                    out.append((f"lowbit_matmul{which} {kind} {cols} columns, groups of {tiles.group_size}, "
                                f"{tiles.scale.dtype} scales, {rows} rows", 1e-4, got, x.float() @ weight.T))
    return out


def _q8_rows(k: Any, s: ModelShapes, g: torch.Generator) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
    """int8 prompt rows (and the kernels' quantizing of them) against their torch reference, bit for bit (allowed
    error 0): every rounding is fixed."""
    from .cpu_matmul import Q8_GROUP, LowBitTiles, q8_rows_reference, quantize_rows

    if not getattr(k, "has_q8_rows", False):  # a library before the int8 rows (interface version 2): nothing to run
        return []
    out = []
    for kind, cols, group_size in s.low_bit:
        if cols % Q8_GROUP or group_size % Q8_GROUP:  # not a shape the int8 rows take
            continue
        n = 40
        scale = (torch.rand(n, cols // group_size, generator=g) * 0.02 + 1e-3).half().float()
        if kind == "int4":  # stored offsets (Q4_1) here; the float16 scales of a GGUF file
            codes = torch.randint(0, 16, (n, cols), generator=g, dtype=torch.uint8)
            offset = ((torch.rand(n, cols // group_size, generator=g) - 0.5) * 0.1).half().float()
            forms = [LowBitTiles.four_bit(codes, scale, -8 * scale, group_size),
                     LowBitTiles.four_bit(codes, scale, offset, group_size)]
        else:
            codes = torch.randint(-127, 128, (n, cols), generator=g, dtype=torch.int8)
            forms = [LowBitTiles(codes, scale, torch.zeros_like(scale), group_size)]
        for tiles in forms:
            # seven rows: a block of six and a lone one (the reference loops over the groups in torch: ~10 ms at K 8192)
            x = torch.randn(7, cols, generator=g) * torch.logspace(-3, 3, 7)[:, None]
            q = quantize_rows(x)
            mine = k.quantize_rows(x)
            out.append((f"quantize_rows {cols} columns: codes, scales and sums", 0.0,
                        torch.cat([mine[0].flatten().float(), mine[1].flatten(), mine[2].flatten().float()]),
                        torch.cat([q.q.flatten().float(), q.scale.flatten(), q.qsum.flatten().float()])))
            got = k.lowbit_q8_rows(q.q, q.scale, q.qsum, tiles.codes, tiles.scale, tiles.offset, tiles.n,
                                   tiles.group_size)
            out.append((f"lowbit_q8_rows {kind} {cols} columns, groups of {group_size}, "
                        f"{'stored' if tiles.stored_offsets else 'derived'} offsets, 7 rows", 0.0, got,
                        q8_rows_reference(q, tiles)))
    return out


def _silu_mul(k: Any, s: ModelShapes, g: torch.Generator) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
    gate_up = (torch.randn(3, 2 * s.intermediate, generator=g) * 4).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    return [("silu_mul", 2 ** -7, k.silu_mul(gate_up), F.silu(gate) * up)]


#: each kernel the self-check covers, and what runs it
CHECKS: dict[str, Callable[[Any, ModelShapes, torch.Generator], list[tuple[str, float, torch.Tensor,
                                                                            torch.Tensor]]]] = {
    "layer_ops": _layer_ops,
    "decode_attention": lambda k, s, g: _attention(k, s, g, "decode_attention"),
    "prompt_attention": lambda k, s, g: _attention(k, s, g, "prompt_attention"),
    "lowbit_matmul": _lowbit,
    "silu_mul": _silu_mul,
    "lowbit_q8_rows": _q8_rows,
}


def check(kernels: Any, shapes: ModelShapes, seed: int = 0) -> list[Mismatch]:
    """Run each kernel of ``kernels`` (a loaded variant) beside torch on ``shapes``; the kernels that disagreed
    (or raised) with their worst case. A prompt-attention head dim that is not a multiple of 8 is not checked
    (torch's attention serves it)."""
    bad: dict[str, Mismatch] = {}
    g = torch.Generator().manual_seed(seed)
    for kernel, run in CHECKS.items():
        if kernel == "prompt_attention" and shapes.head_dim % 8:
            continue
        try:
            cases = run(kernels, shapes, g)
        except Exception as exc:  # a kernel that raises on its model's shapes is as wrong as one that answers wrong
            bad[kernel] = Mismatch(kernel, math.inf, 0.0, f"raised {type(exc).__name__}: {exc}")
            continue
        for case, allowed, got, want in cases:
            error = _relative_error(got, want)
            if not error <= allowed and (kernel not in bad or error > bad[kernel].error):
                bad[kernel] = Mismatch(kernel, error, allowed, case)
    return list(bad.values())


def check_and_turn_off(kernels: Any, shapes: ModelShapes) -> list[Mismatch]:
    """:func:`check`, then turn off each kernel that disagreed, with one warning that names it."""
    from . import cpu_extensions

    bad = check(kernels, shapes)
    for m in bad:
        log.warning("the %s CPU kernel %s disagreed with torch's operator on this model's shapes (%s: error %.3g of "
                    "the largest value, allowed %.3g); it is turned off and torch's operator serves it",
                    kernels.variant, m.kernel, m.case, m.error, m.allowed)
    if bad:
        cpu_extensions.turn_off({m.kernel for m in bad})
    return bad
