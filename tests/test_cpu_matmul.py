"""The CPU low-bit matrix product (mindie_host/backends/lowbit_matmul.cpp) against float32 products.

It multiplies generated tokens by the model file's 4-bit groups and 8-bit channels at every row
count, in every kernel variant this CPU executes: bfloat16 activations on the avx512 kernels (the
codes are exact in bfloat16), float32 activations on the avx2 and portable ones. Each row must match
``x @ W.T`` for the file's exact values with the activations rounded as the variant rounds them
(rtol 1e-5: float32 sums in another order), and carry the same bits alone or among other rows,
whatever the row count (each variant's paths: one or two rows in registers, up to six, more through
a buffer): batch-invariant decoding relies on it. On the float32 variants a Q4_0 matrix's generated
rows apply each group's scale to its sum of x * (code - 8) and its prompt rows dequantize every
weight: both kinds are checked, each at every row count. Shapes cover ragged tiles (100, 17 columns) and
blocks of k (576 = 4 x 128 + 64). The model-level checks (the same greedy tokens alone and in a
batch) are in tests/test_batch_invariance.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mindie_host.backends import cpu_extensions, cpu_matmul
from mindie_host.backends.cpu_matmul import LowBitTiles
from mindie_host.backends.linear import FourBitWeight, Int8Weight
from mindie_host.models.weights import EightBitGroups, FourBitGroups

pytestmark = pytest.mark.skipif(cpu_extensions.compiler() is None, reason="no C++ compiler")


def four_bit(n: int, k: int, seed: int = 0, q4_1: bool = False) -> FourBitGroups:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    offset = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1 if q4_1 else -8 * scale
    return FourBitGroups(codes.numpy(), scale.numpy(), offset.numpy(), 32)


@pytest.mark.parametrize("n,k,q4_1", [(1536, 576, False), (576, 1536, True), (100, 64, False), (17, 96, True)])
def test_four_bit_product_matches_the_files_values_in_float32(cpu_variant: object, n: int, k: int, q4_1: bool) -> None:
    groups = four_bit(n, k, q4_1=q4_1)
    tiles = LowBitTiles.four_bit(torch.from_numpy(groups.codes), torch.from_numpy(groups.scale),
                                 torch.from_numpy(groups.offset), 32)
    w = torch.from_numpy(groups.dequantize())
    torch.testing.assert_close(tiles.dequantize(), w, rtol=0, atol=1e-6)  # the packing keeps every value
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))
    for rows in (1, 2, 70):  # in registers, and through the buffer
        ref = x[:rows].to(cpu_matmul.activation_dtype()).float() @ w.T
        for product in (tiles, tiles.prompt):  # generated rows, prompt rows
            got = product(x[:rows])
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=5e-5)  # float32 sums of products up to ~10


def test_eight_bit_groups_match_the_codes_times_their_scale(cpu_variant: object) -> None:
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-127, 128, (300, 576), generator=g, dtype=torch.int8)
    scale = torch.rand(300, 576 // 32, generator=g) * 0.01
    low = Int8Weight(EightBitGroups(codes.numpy(), scale.numpy()), None)
    assert low.tiles is not None
    w = torch.from_numpy(EightBitGroups(codes.numpy(), scale.numpy()).dequantize())
    torch.testing.assert_close(low.tiles.dequantize(), w, rtol=0, atol=0)  # the file's exact values
    x = torch.randn(33, 576, generator=g)
    torch.testing.assert_close(low.small_product(x), x.to(low.act_dtype).float() @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 3, 5, 7, 64, 96])  # 96: x over 512 KB, the buffer's prompt-sized order
@pytest.mark.parametrize("form", ["q4_0", "q4_1", "q8_0"])
def test_a_row_has_the_same_bits_alone_and_among_any_number_of_rows(cpu_variant: object, rows: int, form: str) -> None:
    if form != "q8_0":  # 100 columns: a ragged last tile
        weight: FourBitWeight | Int8Weight = FourBitWeight(four_bit(100, 1536, seed=3, q4_1=form == "q4_1"), None)
    else:  # 8-bit groups (Q8_0, e.g. the default model's tied LM head), 300 columns: a ragged last tile
        g = torch.Generator().manual_seed(5)
        codes = torch.randint(-127, 128, (300, 1536), generator=g, dtype=torch.int8)
        weight = Int8Weight(EightBitGroups(codes.numpy(), (torch.rand(300, 1536 // 32, generator=g) * 0.01).numpy()),
                            None)
    x = torch.randn(96, 1536, generator=torch.Generator().manual_seed(4))
    together = weight.small_product(x[:rows])
    alone = torch.cat([weight.small_product(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(together, alone)
    # and a row's bits do not depend on its place among the others
    assert torch.equal(weight.small_product(x[:rows].flip(0)), together.flip(0))
    # prompt rows, by their own arithmetic where it differs (Q4_0 on the float32 variants), alike
    assert weight.tiles is not None
    prompt = weight.tiles.prompt(x[:rows])
    assert torch.equal(prompt, torch.cat([weight.tiles.prompt(x[i : i + 1]) for i in range(rows)]))
    assert torch.equal(weight.tiles.prompt(x[:rows].flip(0)), prompt.flip(0))
    assert torch.equal(prompt, together) == (not weight.tiles.kinds_differ)


@pytest.mark.parametrize("bits", [4, 8])
def test_offsets_derived_from_the_scales_give_the_bits_of_stored_ones(cpu_variant: object, bits: int) -> None:
    # Q4_0's offsets (-8 * scale) and 8-bit groups' (0) are not kept: the kernel derives them from the scales
    if bits == 4:
        groups = four_bit(100, 576, seed=6)
        codes, scale, offset = (torch.from_numpy(a) for a in (groups.codes, groups.scale, groups.offset))
    else:  # groups of 16, as a Q6_K LM head loads
        g = torch.Generator().manual_seed(7)
        codes = torch.randint(-127, 128, (100, 576), generator=g, dtype=torch.int8)
        scale, offset = torch.rand(100, 576 // 16, generator=g) * 0.01, torch.zeros(100, 576 // 16)
    derived = LowBitTiles(codes, scale, offset, 576 // scale.shape[1])
    assert derived.offset.numel() == 0
    stored = LowBitTiles(codes, scale, offset, 576 // scale.shape[1])
    stored.offset = derived.full_offset().clone()  # the same values, streamed
    torch.testing.assert_close(derived.dequantize(), stored.dequantize(), rtol=0, atol=0)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(8))
    for rows in (1, 2, 3, 7):
        # where a Q4_0 matrix's generated rows have their own arithmetic (kinds_differ), its prompt rows keep the
        # stored offsets' bits; the generated rows' factored sums are checked against float32 products above
        derived_rows = derived.prompt if derived.kinds_differ else derived
        assert torch.equal(derived_rows(x[:rows]), stored(x[:rows]))
        assert torch.equal(derived.prompt(x[:rows]), stored.prompt(x[:rows]))


@pytest.mark.parametrize("form", ["q4_0", "q4_1", "q8_0"])
def test_float16_scales_give_the_bits_of_float32_ones(cpu_variant: object, form: str) -> None:
    # the file's float16 scales (and Q4_1's offsets) are kept as float16 and converted in the kernel: the same
    # float32 values, so the same bits at every row count (each variant's paths: 1-2 rows in registers, up to six,
    # more through a buffer), with a ragged last tile (100 columns)
    g = torch.Generator().manual_seed(9)
    if form == "q8_0":
        codes = torch.randint(-127, 128, (100, 576), generator=g, dtype=torch.int8)
        scale, offset = (torch.rand(100, 18, generator=g) * 0.01).half().float(), torch.zeros(100, 18)
    else:
        groups = four_bit(100, 576, seed=10, q4_1=form == "q4_1")
        codes, scale, offset = (torch.from_numpy(a) for a in (groups.codes, groups.scale, groups.offset))
        scale[0, :4] = torch.tensor([0.0, 2.0**-24, 3 * 2.0**-20, 65504.0])  # zero, float16 subnormals, the largest
        scale, offset = scale.half().float(), offset.half().float()
        if form == "q4_0":
            offset = -8 * scale
    half = LowBitTiles(codes, scale, offset, 32)
    assert half.half_scales and half.scale.dtype == torch.float16
    assert (half.offset.numel() > 0) == (form == "q4_1")
    full = LowBitTiles(codes, scale, offset, 32)
    full.scale, full.offset = full.scale.float(), full.offset.float()  # the same values as float32, streamed
    assert not full.half_scales
    torch.testing.assert_close(half.dequantize(), full.dequantize(), rtol=0, atol=0)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(11))
    for rows in (1, 2, 3, 7, 9):
        assert torch.equal(half(x[:rows]), full(x[:rows]))
        assert torch.equal(half.prompt(x[:rows]), full.prompt(x[:rows]))
    # scales that float16 does not hold exactly stay float32 (a Q6_K head's d * scale_j)
    assert not LowBitTiles(codes, scale + 2.0**-30, offset, 32).half_scales


def test_q4_0_prompt_and_generated_rows_go_by_kind_of_token(cpu_variant: Any) -> None:
    """A step's Q4_0 products send prompt tokens and generated tokens each through their own arithmetic (on the
    float32 variants; one arithmetic for both on avx512, where the bfloat16 kernel already scales a group's sum),
    so a token's bits depend only on its kind, not on what shares its step."""
    from mindie_host.backends.linear import PromptRows

    weight = FourBitWeight(four_bit(100, 576, seed=12), None)
    assert weight.tiles is not None
    assert weight.tiles.kinds_differ == (cpu_variant.variant != "avx512")
    assert not FourBitWeight(four_bit(100, 576, seed=12, q4_1=True), None).tiles.kinds_differ  # type: ignore[union-attr]
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(13))
    kinds = torch.tensor([False] * 2 + [True] * 9 + [False])  # two decodes, a 9-token chunk, a decode
    got = weight(x, None, PromptRows(kinds))
    generated = [0, 1, 11]
    assert torch.equal(got[generated], weight.small_product(x[generated]))
    assert torch.equal(got[2:11], weight.tiles.prompt(x[2:11]))
    assert torch.equal(weight(x[2:11], None, PromptRows(torch.ones(9, dtype=torch.bool))), got[2:11])
    if weight.tiles.kinds_differ:  # the two arithmetics really differ (else the routing above proves nothing)
        assert not torch.equal(weight.tiles.prompt(x), weight.small_product(x))


def test_the_kernel_is_a_torch_operator_that_compiles() -> None:
    assert cpu_matmul.kernel() is not None  # the binding's operator calls the active variant: this CPU's
    groups = four_bit(64, 64, seed=5)
    weight = FourBitWeight(groups, None)
    x = torch.randn(8, 64)
    compiled = torch.compile(lambda t: weight.small_product(t) * 2, fullgraph=True)
    assert torch.equal(compiled(x), weight.small_product(x) * 2)


@pytest.mark.parametrize("width", [1536, 40])  # vector lanes only, and a tail of scalar elements
def test_silu_mul_rounds_the_float32_activation_once(cpu_variant: object, width: int) -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(37, 2 * width, generator=g) * 4).bfloat16()
    got = cpu_matmul.silu_mul(gate_up)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == (37, width)
    gate, up = gate_up.float().chunk(2, dim=-1)
    exact = torch.nn.functional.silu(gate) * up
    # one rounding of a float32 result a few ulps from torch's: within one bf16 step of the exact value
    assert bool(((got.float() - exact).abs() <= exact.abs() * 2**-7 + 1e-30).all())
    alone = cpu_matmul.silu_mul(gate_up[5:6])
    assert alone is not None and torch.equal(alone[0], got[5])


def test_a_gated_mlp_keeps_prompt_rows_in_bf16_and_generated_rows_as_the_two_products_give_them() -> None:
    from mindie_host.backends.linear import PromptRows, apply_linear, bf16_gated_mlp

    gate_up = FourBitWeight(four_bit(2 * 96, 64, seed=4), dense=None)
    down = FourBitWeight(four_bit(64, 96, seed=5), dense=None)
    gate_up.keep_prompt_copy(torch.from_numpy(four_bit(2 * 96, 64, seed=4).dequantize()))
    down.keep_prompt_copy(torch.from_numpy(four_bit(64, 96, seed=5).dequantize()))
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(6))
    rows = PromptRows(torch.tensor([False] * 2 + [True] * 9 + [False]))  # a decode, a 9-token chunk, a decode
    got = bf16_gated_mlp(x, gate_up, down, rows)
    assert got is not None and got.dtype == torch.float32
    gate, up = apply_linear(gate_up, x, None, rows).chunk(2, dim=-1)
    two_products = apply_linear(down, torch.nn.functional.silu(gate) * up, None, rows)
    generated = [0, 1, 11]
    assert torch.equal(got[generated], two_products[generated])  # the same bits as before for generated tokens
    torch.testing.assert_close(got[2:11], two_products[2:11], rtol=2e-2, atol=2e-2)  # bf16 throughout
    alone = bf16_gated_mlp(x[2:11], gate_up, down, PromptRows(torch.ones(9, dtype=torch.bool)))
    assert alone is not None and torch.equal(alone, got[2:11])  # a prompt row alone or beside decodes


def test_adding_to_a_gated_mlps_products_leaves_the_other_rows_bits_alone() -> None:
    """Per-row linear deltas run the two products one by one; the rows they do not touch keep the fused path's bits."""
    from mindie_host.backends.linear import PromptRows
    from mindie_host.backends.platform import Platform

    groups_gu, groups_down = four_bit(2 * 96, 64, seed=7), four_bit(64, 96, seed=8)
    gate_up, down = FourBitWeight(groups_gu, dense=None), FourBitWeight(groups_down, dense=None)
    gate_up.keep_prompt_copy(torch.from_numpy(groups_gu.dequantize()))
    down.keep_prompt_copy(torch.from_numpy(groups_down.dequantize()))
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(9))
    rows = PromptRows(torch.tensor([False] + [True] * 10 + [False]))

    def add(name: str, inp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[4] += 0.5  # one prompt row's delta
        return out

    plain = Platform().gated_mlp(x, gate_up, down, rows)
    with_add = Platform().gated_mlp(x, gate_up, down, rows, add)
    others = [i for i in range(12) if i != 4]
    assert torch.equal(with_add[others], plain[others])
    assert not torch.equal(with_add[4], plain[4])
