"""The CPU low-bit matrix product (mindie_host/backends/lowbit_matmul.cpp) against float32 products.

It multiplies generated tokens by the model file's 4-bit groups and 8-bit channels at every row
count. Each row must match ``x @ W.T`` for the file's exact values (the codes are exact in
bfloat16; only the activations are rounded), and carry the same bits alone or among other rows,
whatever the row count: batch-invariant decoding relies on it. The model-level checks (the same
greedy tokens alone and in a batch) are in tests/test_batch_invariance.py.
"""

from __future__ import annotations

import pytest
import torch

from mindie_host.backends import cpu_matmul
from mindie_host.backends.cpu_matmul import LowBitTiles
from mindie_host.backends.linear import FourBitWeight, Int8Weight
from mindie_host.models.weights import FourBitGroups

pytestmark = pytest.mark.skipif(cpu_matmul.kernel() is None, reason="no C++ compiler or no AVX512-BF16 on this CPU")


def four_bit(n: int, k: int, seed: int = 0, q4_1: bool = False) -> FourBitGroups:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    offset = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1 if q4_1 else -8 * scale
    return FourBitGroups(codes.numpy(), scale.numpy(), offset.numpy(), 32)


@pytest.mark.parametrize("n,k,q4_1", [(1536, 576, False), (576, 1536, True), (100, 64, False), (17, 96, True)])
def test_four_bit_product_matches_the_files_values_in_float32(n: int, k: int, q4_1: bool) -> None:
    groups = four_bit(n, k, q4_1=q4_1)
    tiles = LowBitTiles.four_bit(torch.from_numpy(groups.codes), torch.from_numpy(groups.scale),
                                 torch.from_numpy(groups.offset), 32)
    w = torch.from_numpy(groups.dequantize())
    torch.testing.assert_close(tiles.dequantize(), w, rtol=0, atol=1e-6)  # the packing keeps every value
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))
    got = tiles(x)
    ref = x.bfloat16().float() @ w.T
    assert got.dtype == torch.float32 and got.shape == (70, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=5e-5)  # float32 sums of products up to ~10


def test_int8_channels_match_the_codes_times_their_scale() -> None:
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 576, generator=g)
    low = Int8Weight(weight, keep_dense=False)
    assert low.tiles is not None
    w = low.codes.float() * low.scale.float()[:, None]
    assert torch.equal(low.tiles.dequantize(), w)
    x = torch.randn(33, 576, generator=g)
    torch.testing.assert_close(low.small_product(x.bfloat16()), x.bfloat16().float() @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 16, 64])
def test_a_row_has_the_same_bits_alone_and_among_any_number_of_rows(rows: int) -> None:
    groups = four_bit(576, 1536, seed=3, q4_1=True)
    weight = FourBitWeight(groups, None)
    x = torch.randn(64, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    together = weight.small_product(x[:rows])
    alone = torch.cat([weight.small_product(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
    # and a row's bits do not depend on its place among the others
    assert torch.equal(weight.small_product(x[:rows].flip(0)), together.flip(0))


def test_the_kernel_is_a_torch_operator_that_compiles() -> None:
    groups = four_bit(64, 64, seed=5)
    weight = FourBitWeight(groups, None)
    x = torch.randn(8, 64).bfloat16()
    compiled = torch.compile(lambda t: weight.small_product(t) * 2, fullgraph=True)
    assert torch.equal(compiled(x), weight.small_product(x) * 2)
