"""Int8 prompt rows (mindie_host/backends/lowbit_q8_rows.cpp) against their torch reference, bit for bit.

Prompt rows quantized per row and group of 32 inputs to int8 (``cpu_matmul.quantize_rows``) multiply a low-bit
weight's exact integer codes with integer dot products, the scales applied per group in float32.
``cpu_matmul.q8_rows_reference`` fixes every rounding, so each variant this CPU executes (portable, avx2, avx512
with VNNI) must give its bits exactly: GGUF Q4_0 (derived offsets), Q4_1 (stored offsets), Q8_0 (int8 groups of 32)
and per-channel int8 weights, float16 and float32 scales, K from one tile's two groups to 2048, a ragged last tile,
and every row count's blocking (1 to 600 rows). A row's result must not depend on the other rows.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from mindie_host.backends import cpu_extensions, cpu_selfcheck
from mindie_host.backends.cpu_matmul import (
    LowBitTiles,
    QuantizedRows,
    q8_rows_reference,
    quantize_rows,
    quantize_rows_kernel,
)

pytestmark = pytest.mark.skipif(cpu_extensions.compiler() is None, reason="no C++ compiler")

N = 45  # a whole tile of 32 output columns and a ragged one
KINDS = ("q4_0", "q4_1", "q8_0", "int8_channel")


def weight(kind: str, n: int, k: int, half: bool, seed: int = 0) -> LowBitTiles:
    """Random tiles of ``kind`` with float16-exact scales (kept as float16) or float32 ones."""
    g = torch.Generator().manual_seed(seed)

    def scales(shape: tuple[int, ...]) -> torch.Tensor:
        s = torch.rand(shape, generator=g) * 0.02 + 1e-3
        return s.half().float() if half else s

    if kind == "int8_channel":  # one group of the whole row: the weights' group size is K
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        tiles = LowBitTiles.per_channel(codes, scales((n,)))
    elif kind == "q8_0":  # -128 too: the kernels take any int8 code
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        s = scales((n, k // 32))
        tiles = LowBitTiles(codes, s, torch.zeros_like(s), 32)
    else:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        s = scales((n, k // 32))
        offset = -8 * s if kind == "q4_0" else (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1
        tiles = LowBitTiles.four_bit(codes, s, offset.half().float() if half else offset, 32)
    assert tiles.half_scales == half and tiles.stored_offsets == (kind == "q4_1")
    return tiles


def rows(m: int, k: int, seed: int = 1) -> QuantizedRows:
    """``m`` random rows quantized, with an all-zero group (scale 0) and a group of large values."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0
    x[-1, -32:] *= 1000
    return quantize_rows(x)


def run(kernels: Any, r: QuantizedRows, tiles: LowBitTiles) -> torch.Tensor:
    return kernels.lowbit_q8_rows(r.q, r.scale, r.qsum, tiles.codes, tiles.scale, tiles.offset, tiles.n,
                                  tiles.group_size)


@pytest.mark.parametrize("k", [64, 576, 1536, 2048])
@pytest.mark.parametrize("half", [True, False], ids=["f16", "f32"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_variant_gives_the_references_bits(cpu_variant: Any, kind: str, half: bool, k: int) -> None:
    tiles = weight(kind, N, k, half, seed=k)
    values = tiles.int_values()
    for m in (1, 2, 5, 6, 7, 13, 64, 600 if k <= 576 else 100):  # each blocking of rows, and a prompt's worth
        r = rows(m, k, seed=m)
        got = run(cpu_variant, r, tiles)
        assert got.dtype == torch.float32 and got.shape == (m, N)
        assert torch.equal(got, q8_rows_reference(r, tiles, values)), (cpu_variant.variant, kind, half, k, m)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_has_the_same_bits_alone_and_among_others(cpu_variant: Any, kind: str) -> None:
    tiles = weight(kind, 100, 576, half=True, seed=3)
    r = rows(37, 576, seed=4)
    together = run(cpu_variant, r, tiles)
    for i in (0, 5, 6, 36):  # first, last of a block of six, first of the next, the lone last row
        alone = QuantizedRows(r.q[i : i + 1].clone(), r.scale[i : i + 1].clone(), r.qsum[i : i + 1].clone())
        assert torch.equal(run(cpu_variant, alone, tiles), together[i : i + 1])
    flipped = QuantizedRows(r.q.flip(0).contiguous(), r.scale.flip(0).contiguous(), r.qsum.flip(0).contiguous())
    assert torch.equal(run(cpu_variant, flipped, tiles), together.flip(0))


def test_the_int8_product_is_close_to_the_float_one(cpu_variant: Any) -> None:
    # the reference's integers are the weights' exact values: the product differs from x @ W.T by the rows'
    # rounding to int8 alone (about 1% of a row's scale per element)
    tiles = weight("q4_1", 64, 1536, half=True, seed=5)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(6))
    want = x @ tiles.dequantize().T
    got = run(cpu_variant, quantize_rows(x), tiles)
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())


def test_low_bit_tiles_use_the_active_kernel_else_the_reference(cpu_variant: Any) -> None:
    tiles = weight("q4_0", N, 576, half=True, seed=7)
    r = rows(9, 576, seed=8)
    want = q8_rows_reference(r, tiles)
    assert torch.equal(tiles.q8_rows(r), want)
    with cpu_extensions.using(cpu_variant, off=frozenset({"lowbit_q8_rows"})):
        assert torch.equal(tiles.q8_rows(r), want)  # the reference serves, with the same bits
        assert torch.equal(tiles.q8_rows(r, tiles.int_values()), want)
    with cpu_extensions.using(None):
        assert torch.equal(tiles.q8_rows(r), want)
    sixteen = LowBitTiles(torch.zeros(N, 576, dtype=torch.int8), torch.ones(N, 36), torch.zeros(N, 36), 16)
    with pytest.raises(ValueError, match="multiple of 32"):  # a Q6_K head's groups of 16: not whole groups of rows
        sixteen.q8_rows(r)


def assert_same_rows(got: QuantizedRows, want: QuantizedRows) -> None:
    assert got.q.dtype == torch.int8 and got.scale.dtype == torch.float32 and got.qsum.dtype == torch.int32
    assert torch.equal(got.q, want.q) and torch.equal(got.qsum, want.qsum)
    assert torch.equal(got.scale.view(torch.int32), want.scale.view(torch.int32))  # bit for bit


@pytest.mark.parametrize("k", [32, 576, 8192])
def test_the_kernels_quantize_the_rows_as_torch_does(cpu_variant: Any, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    for m in (1, 7, 300):
        x = torch.randn(m, k, generator=g) * torch.logspace(-6, 4, m)[:, None]  # rows of every size
        x[0, :32] = 0  # a group of zeros: scale 0, codes 0
        if k >= 64:
            x[-1, 32:64] = torch.arange(-16, 16) * 127 / 16 + 0.5 * 127 / 16 * (torch.arange(32) % 2)  # ties
        assert_same_rows(QuantizedRows(*cpu_variant.quantize_rows(x)), quantize_rows(x))
    ties = torch.tensor([[127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 3.5, -126.5] + [0.0] * 24])  # scale 1: halves to even
    got = QuantizedRows(*cpu_variant.quantize_rows(ties))
    assert got.q[0, :8].tolist() == [127, 2, -2, 0, 0, 2, 4, -126]
    assert_same_rows(got, quantize_rows(ties))
    bf16 = torch.randn(5, k, generator=g).bfloat16()  # what the prompt rows may come as: converted exactly first
    assert_same_rows(quantize_rows_kernel(bf16), quantize_rows(bf16))


def test_the_binding_checks_the_rows_shapes(cpu_variant: Any) -> None:
    tiles = weight("q8_0", N, 64, half=False)
    r = rows(3, 64)
    with pytest.raises(RuntimeError, match="xscale"):
        cpu_variant.lowbit_q8_rows(r.q, r.scale[:, :1].contiguous(), r.qsum, tiles.codes, tiles.scale, tiles.offset,
                                   N, 32)
    with pytest.raises(RuntimeError, match="xqsum"):
        cpu_variant.lowbit_q8_rows(r.q, r.scale, r.qsum.long(), tiles.codes, tiles.scale, tiles.offset, N, 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_variant.lowbit_q8_rows(r.q, r.scale, r.qsum, tiles.codes, tiles.scale, tiles.offset, N, 16)


def test_the_self_check_covers_the_int8_rows(cpu_variant: Any) -> None:
    shapes = cpu_selfcheck.ModelShapes(576, 9, 3, 64, 1536, torch.bfloat16, (("int4", 576, 32), ("int8", 1536, 1536)))
    cases = cpu_selfcheck.CHECKS["lowbit_q8_rows"](cpu_variant, shapes, torch.Generator().manual_seed(0))
    assert cases and all(allowed == 0 and torch.equal(got, want) for _, allowed, got, want in cases)


class _TableV2(ctypes.Structure):
    """The head of a kernel library's table (kernels.h) as interface version 2 has it: no lowbit_q8_rows."""

    _fields_ = [("abi", ctypes.c_int), ("variant", ctypes.c_char_p), ("set_runtime", ctypes.c_void_p),
                ("pointers", ctypes.c_void_p * 12)]


def test_a_library_of_interface_version_2_loads_without_the_int8_rows(cpu_variants: dict[str, Any]) -> None:
    binding = cpu_extensions._BINDING.get()
    set_runtime = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda runtime: None)
    table = _TableV2(2, b"portable", ctypes.cast(set_runtime, ctypes.c_void_p))
    old = binding.Kernels(ctypes.addressof(table))
    assert old.variant == "portable" and not old.has_q8_rows
    tiles = weight("q4_0", N, 64, half=False)
    r = rows(2, 64)
    with pytest.raises(RuntimeError, match="interface version 2"):
        run(old, r, tiles)
    with pytest.raises(RuntimeError, match="interface version 2"):
        old.quantize_rows(torch.zeros(2, 64))
    with cpu_extensions.using(old):  # the reference serves it, and torch quantizes
        assert torch.equal(tiles.q8_rows(r), q8_rows_reference(r, tiles))
        assert_same_rows(quantize_rows_kernel(torch.ones(2, 64)), quantize_rows(torch.ones(2, 64)))
    assert not old.has_prompt_rows  # nor lowbit_matmul_prompt (version 4): prompt rows take lowbit_matmul
    table.abi = 5  # a newer library than this binding knows is refused
    with pytest.raises(RuntimeError, match="another interface version"):
        binding.Kernels(ctypes.addressof(table))
