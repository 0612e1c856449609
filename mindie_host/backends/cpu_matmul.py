"""The CPU low-bit matrix product (``lowbit_matmul.cpp``): 4-bit groups and 8-bit channels, any row count.

torch's CPU int4 and int8 weight-only kernels read few bytes per weight, which is what a decode
step of one or two sequences needs, but they run at 100-370 GFLOP/s whatever the row count, so a
decode step of 16 to 64 sequences spends most of its time in them (bench/PERF.md). This kernel
keeps the file's codes in tiles of 32 output columns and multiplies every row by them, each row's
result the same bits at any row count (batch-invariant decoding):

* avx512 kernels: bfloat16 activations against the exact codes with AVX512-BF16 dot products,
  the file's scales and offsets applied per group in float32; as fast as torch's kernel for one
  row, 2-4x faster at 16 to 64 rows;
* avx2, neon and portable kernels (CPUs without native bfloat16): float32 activations against each
  weight dequantized exactly (``code * scale + offset``) as the codes stream by, in float32
  multiply-adds: the reference's values, read at 4 or 8 bits; prompt rows run through it too (no
  float32 copy). Generated rows of 4-bit codes with derived offsets (GGUF Q4_0) apply each group's
  scale once to its sum of ``x * (code - 8)`` instead (llama.cpp's factoring), which one sequence's
  decode on AVX2 is bound by: :meth:`LowBitTiles.prompt` and :attr:`LowBitTiles.kinds_differ`.

It is built with the other kernels (then cached: :mod:`~mindie_host.backends.cpu_extensions`);
otherwise torch's kernels serve.
"""

from __future__ import annotations

from typing import Any

import torch

from . import cpu_extensions
from .cpu_extensions import enabled

__all__ = ["Q8_GROUP", "LowBitTiles", "QuantizedRows", "activation_dtype", "enabled", "kernel", "loaded",
           "quantize_rows", "quantize_rows_kernel"]

TILE = 32  # output columns per tile (lowbit_matmul.cpp's kTile)

#: inputs per group of int8 prompt rows (:func:`quantize_rows`): GGUF Q8_0's block, as llama.cpp quantizes activations
Q8_GROUP = 32


def kernel() -> Any:
    """The active CPU kernels (building them the first time), or None."""
    return cpu_extensions.kernels()


def loaded() -> bool:
    """Whether the low-bit product is built and on (never builds it: safe while tracing)."""
    return cpu_extensions.active("lowbit_matmul") is not None


def q8_rows_loaded() -> bool:
    """Whether the active kernels have the int8 prompt-row product (``lowbit_q8_rows``, which the self-check may turn
    off on its own; never builds them)."""
    mod = cpu_extensions.active("lowbit_q8_rows")
    return mod is not None and bool(getattr(mod, "has_q8_rows", False))


def activation_dtype() -> torch.dtype:
    """The dtype the active kernel's activations take (bfloat16 on the avx512 kernels, else float32)."""
    mod = cpu_extensions.active("lowbit_matmul")
    return torch.bfloat16 if mod is not None and mod.lowbit_takes_bfloat16 else torch.float32


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` in bfloat16 from a gated MLP's bfloat16 ``[M, 2I]`` ``[gate | up]`` product, with
    float32 arithmetic and one rounding per element; None when the kernel is not on."""
    mod = cpu_extensions.active("silu_mul")
    return mod.silu_mul(gate_up.contiguous()) if mod is not None else None


def _exact_in_half(t: torch.Tensor) -> bool:
    """Whether every value of float32 ``t`` is a float16 value (float16 -> float32 gives back its bits)."""
    return torch.equal(t.half().float().view(torch.int32), t.view(torch.int32))


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` padded to whole tiles of output rows, as ``[N / 32, 32, ...]``."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.view(t.shape[0] // TILE, TILE, *t.shape[1:])


class LowBitTiles:
    """A weight's low-bit codes in the kernel's layout: tiles of 32 output columns, codes in pairs along K.

    ``W[n, k] == codes[n, k] * scale[n, k // group_size] + offset[n, k // group_size]``.

    The scales (and any stored offsets) are kept as float16 where every one of them is a float16 value (a GGUF
    Q4_0 / Q4_1 / Q8_0 file's ``d`` and ``m``), checked bit for bit: the kernel converts them back to the same
    float32 values, so the product's bits do not change, with fewer bytes to stream (Q4_0 0.625 -> 0.5625 a
    weight, Q8_0 1.125 -> 1.0625); otherwise float32 (a Q6_K head's ``d * scale_j``).
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int) -> None:
        n, k = codes.shape
        if k % group_size or group_size % 2:
            raise ValueError(f"{k} columns do not split into groups of {group_size} (an even number)")
        self.n, self.group_size = n, group_size
        pairs = _tiles(codes).view(-1, TILE, k // 2, 2)  # [NT, 32, K/2, 2]
        if codes.dtype == torch.uint8:  # 4-bit: both codes of a pair in one byte
            self.codes = (pairs[..., 0] | (pairs[..., 1] << 4)).permute(0, 2, 1).contiguous()  # [NT, K/2, 32]
        else:  # int8: a pair per column, the 32 columns in a row
            self.codes = pairs.permute(0, 2, 1, 3).reshape(pairs.shape[0], k // 2, 2 * TILE).contiguous()
        scale = scale.float()
        self.scale = _tiles(scale).transpose(1, 2).contiguous()  # [NT, G, 32]
        #: whether any group has an offset (4-bit groups; 8-bit ones have none)
        self.has_offset = codes.dtype == torch.uint8 or bool(offset.any())
        #: the groups' offsets in the tiles' layout, or empty where each is what the kernel derives from its scale
        #: (-8 * scale for 4-bit codes, as GGUF Q4_0 has; 0 for 8-bit ones), bit for bit: neither kept nor streamed
        self.offset = torch.zeros(0)
        if codes.dtype == torch.uint8:
            offset = offset.float()
            if not torch.equal(offset.view(torch.int32), (-8 * scale.float()).view(torch.int32)):
                self.offset = _tiles(offset).transpose(1, 2).contiguous()
        elif self.has_offset:
            self.offset = _tiles(offset.float()).transpose(1, 2).contiguous()
        if all(_exact_in_half(t) for t in (self.scale, self.offset)):
            self.scale, self.offset = self.scale.half(), self.offset.half()

    @property
    def half_scales(self) -> bool:
        """Whether the scales (and stored offsets) are kept as float16 (see the class)."""
        return self.scale.dtype == torch.float16

    @staticmethod
    def four_bit(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int) -> LowBitTiles:
        """From 4-bit codes (uint8 in 0..15, ``[N, K]``) and their groups' float scales and offsets ``[N, K / gs]``."""
        return LowBitTiles(codes.to(torch.uint8), scale, offset, group_size)

    @staticmethod
    def per_channel(codes: torch.Tensor, scale: torch.Tensor) -> LowBitTiles:
        """From int8 codes ``[N, K]`` and one scale per output channel ``[N]``."""
        return LowBitTiles(codes.to(torch.int8), scale.float()[:, None], torch.zeros(codes.shape[0], 1),
                           codes.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in float32 for ``x [M, K]``, in the kernel's activation dtype (:func:`activation_dtype`)."""
        if x.shape[1] % 2:
            raise ValueError("K must be even")
        if torch.compiler.is_compiling():  # the registered operator (C++ all the way; see lowbit_matmul.cpp)
            return torch.ops.mindie_host_cpu.lowbit_matmul(x.to(activation_dtype()).contiguous(), self.codes,
                                                           self.scale, self.offset, self.n, self.group_size)
        mod = cpu_extensions.active("lowbit_matmul")  # one lookup per call: a decode step makes ~200 of them
        x = x.to(torch.bfloat16 if mod.lowbit_takes_bfloat16 else torch.float32).contiguous()
        return mod.lowbit_matmul(x, self.codes, self.scale, self.offset, self.n, self.group_size)

    def prompt(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` as :meth:`__call__`, for rows that are prompt tokens: the kernels' arithmetic for them, which
        differs from generated rows' only where :attr:`kinds_differ` says so (eager; prompt rows are not compiled)."""
        mod = cpu_extensions.active("lowbit_matmul")
        x = x.to(torch.bfloat16 if mod.lowbit_takes_bfloat16 else torch.float32).contiguous()
        if not getattr(mod, "has_prompt_rows", False):  # a library before lowbit_matmul_prompt: one arithmetic
            return mod.lowbit_matmul(x, self.codes, self.scale, self.offset, self.n, self.group_size)
        return mod.lowbit_matmul_prompt(x, self.codes, self.scale, self.offset, self.n, self.group_size)

    @property
    def kinds_differ(self) -> bool:
        """Whether the active kernels multiply these tiles' prompt rows and generated rows by different arithmetic:
        4-bit codes with derived offsets (GGUF Q4_0) on the float32 variants (avx2, neon, portable), whose generated
        rows apply each group's scale once to its sum of ``x * (code - 8)`` and whose prompt rows dequantize every
        weight (lowbit_matmul.cpp). Each kind of row gets the same bits at any row count either way."""
        mod = cpu_extensions.active("lowbit_matmul")
        return (mod is not None and getattr(mod, "has_prompt_rows", False) and not mod.lowbit_takes_bfloat16
                and self.codes.dtype == torch.uint8 and not self.stored_offsets)

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes ``[N, K]`` (uint8 4-bit codes or int8), scales and offsets ``[N, K / group_size]`` back out of
        the tiles."""
        nt, half, _ = self.codes.shape
        if self.codes.dtype == torch.uint8:
            lo, hi = (self.codes & 15).permute(0, 2, 1), (self.codes >> 4).permute(0, 2, 1)  # [NT, 32, K/2]
            codes = torch.stack([lo, hi], -1).reshape(nt * TILE, 2 * half)
        else:
            codes = self.codes.view(nt, half, TILE, 2).permute(0, 2, 1, 3).reshape(nt * TILE, 2 * half)
        scale = self.scale.float().transpose(1, 2).reshape(nt * TILE, -1)
        offset = self.full_offset().transpose(1, 2).reshape(nt * TILE, -1)
        return codes[: self.n], scale[: self.n], offset[: self.n]

    def full_offset(self) -> torch.Tensor:
        """The groups' offsets ``[NT, G, 32]`` in float32, derived from the scales where :attr:`offset` is empty."""
        if self.offset.numel():
            return self.offset.float()
        scale = self.scale.float()
        return -8 * scale if self.codes.dtype == torch.uint8 else torch.zeros_like(scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight as float32 ``[len(ids), K]``, gathered from the tiles (an embedding lookup
        from a tied LM head's or the embedding's own low-bit form): the exact values, only the rows asked for
        dequantized."""
        tile, col = ids // TILE, ids % TILE
        nt, half, _ = self.codes.shape
        if self.codes.dtype == torch.uint8:  # 4-bit: a pair of codes per byte
            packed = self.codes[tile, :, col]  # [M, K/2]
            codes = torch.stack([packed & 15, packed >> 4], -1).reshape(ids.shape[0], 2 * half)
        else:
            codes = self.codes.view(nt, half, TILE, 2)[tile, :, col].reshape(ids.shape[0], 2 * half)
        scale = self.scale[tile, :, col].float()[..., None]  # [M, G, 1]
        groups = codes.float().view(ids.shape[0], -1, self.group_size) * scale
        if self.has_offset:
            groups = groups + self.full_offset()[tile, :, col][..., None]
        return groups.view(ids.shape[0], -1)

    @property
    def stored_offsets(self) -> bool:
        """Whether the groups' offsets are stored (GGUF Q4_1's ``m``), rather than what the kernel derives from the
        scales (-8 * scale for 4-bit codes, 0 for 8-bit ones)."""
        return bool(self.offset.numel())

    def int_values(self) -> torch.Tensor:
        """Each weight's integer value ``c`` as float32 ``[N, K]``: ``W = c * scale + offset`` with the offset term
        left only where it is stored (:attr:`stored_offsets`): 4-bit codes minus 8 where the offsets are derived
        (GGUF Q4_0), the codes otherwise (Q4_1's 0..15, int8 codes)."""
        codes = self.groups()[0].float()
        return codes - 8 if self.codes.dtype == torch.uint8 and not self.stored_offsets else codes

    def q8_rows(self, rows: QuantizedRows, values: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T`` in float32 for int8 rows (:func:`quantize_rows`): the active kernels' ``lowbit_q8_rows``
        (integer dot products per group of 32 inputs), else :func:`q8_rows_reference` (given ``values``,
        :meth:`int_values`, when the caller keeps them), the same bits. The weights' groups must be whole groups of
        the rows (a multiple of :data:`Q8_GROUP` inputs; not a Q6_K head's 16)."""
        if self.group_size % Q8_GROUP:
            raise ValueError(f"int8 rows take weight groups of a multiple of {Q8_GROUP} inputs, not {self.group_size}")
        mod = cpu_extensions.active("lowbit_q8_rows")
        if mod is None or not getattr(mod, "has_q8_rows", False):
            return q8_rows_reference(rows, self, values)
        return mod.lowbit_q8_rows(rows.q, rows.scale, rows.qsum, self.codes, self.scale, self.offset, self.n,
                                  self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[N, K]`` weight these tiles stand for (for tests)."""
        codes, scale, offset = self.groups()
        groups = codes.float().view(self.n, -1, self.group_size)
        return (groups * scale[..., None] + offset[..., None]).view(self.n, -1)



class QuantizedRows:
    """Rows of activations in int8 groups of :data:`Q8_GROUP`: ``x[m, k] ~ q[m, k] * scale[m, k // 32]``.

    ``q`` int8 ``[M, K]`` in -127..127, ``scale`` float32 ``[M, K / 32]`` (each group's largest magnitude over 127),
    ``qsum`` int32 ``[M, K / 32]`` (each group's sum of codes, for the weights' offsets).
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, qsum: torch.Tensor) -> None:
        self.q, self.scale, self.qsum = q, scale, qsum


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """``x [M, K]`` (K a multiple of :data:`Q8_GROUP`) as int8 groups: per row and group of 32, the scale
    ``max|x| / 127`` and codes ``round(x * (1 / scale))`` (half to even; an all-zero group has scale 0 and codes 0).

    Both the kernels and the reference multiply these same codes, so the rounding happens here once."""
    m, k = x.shape
    groups = x.float().reshape(m, k // Q8_GROUP, Q8_GROUP)
    scale = groups.abs().amax(-1) / 127
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(groups * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedRows(q.reshape(m, k), scale, q.sum(-1, dtype=torch.int32))


def quantize_rows_kernel(x: torch.Tensor) -> QuantizedRows:
    """:func:`quantize_rows` through the active kernels' ``quantize_rows`` (one pass over ``x``, the same bits;
    torch's dozen passes took 12-17 ms for 512 x 8192 rows, bench/PERF.md), else :func:`quantize_rows` itself."""
    mod = cpu_extensions.active("lowbit_q8_rows")
    if mod is None or not getattr(mod, "has_q8_rows", False) or x.shape[1] % Q8_GROUP:
        return quantize_rows(x)
    return QuantizedRows(*mod.quantize_rows(x.float().contiguous()))


def q8_rows_reference(rows: QuantizedRows, tiles: LowBitTiles, values: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for int8 rows, in torch, with the bits of the kernels' ``lowbit_q8_rows``:

    for each group g of 32 inputs in order, with ``w = g * 32 // group_size`` the weights' group,
        ``isum = sum_k c[n, k] * q[m, k]``  (exact integers: c the weight's integer value, see :meth:`LowBitTiles.int_values`)
        ``acc = acc + (scale[n, w] * xscale[m, g]) * isum``
        and where the weights store offsets: ``acc = acc + (offset[n, w] * xscale[m, g]) * qsum[m, g]``
    each product and sum rounded to float32 on its own (no fused multiply-add), ``acc`` starting at 0.
    ``values`` is :meth:`LowBitTiles.int_values` when the caller keeps it."""
    c = tiles.int_values() if values is None else values
    _, scale, offset = tiles.groups()
    m, k = rows.q.shape
    q = rows.q.float()
    acc = torch.zeros(m, tiles.n)
    per = tiles.group_size // Q8_GROUP
    stored = tiles.stored_offsets
    for g in range(k // Q8_GROUP):
        cols = slice(g * Q8_GROUP, (g + 1) * Q8_GROUP)
        isum = q[:, cols] @ c[:, cols].T  # integers below 2**24 in magnitude: exact in float32, in any order
        xs = rows.scale[:, g, None]
        acc = acc + (scale[None, :, g // per] * xs) * isum
        if stored:
            acc = acc + (offset[None, :, g // per] * xs) * rows.qsum[:, g, None].float()
    return acc
