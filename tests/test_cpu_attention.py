"""The CPU decode-attention kernel (mindie_host/backends/decode_attention.cpp) against torch's attention.

It serves every single-token query of a batch-invariant CPU step in one call; each sequence's output
must match torch's scaled-dot-product attention over its own context, and carry the same bits whether
it is computed alone or beside other sequences.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindie_host.backends import cpu_attention
from mindie_host.backends.platform import AttentionMetadata, Platform

pytestmark = pytest.mark.skipif(cpu_attention.kernel() is None, reason="no C++ compiler to build the kernel")

SLOTS, KV, D, H = 16384, 3, 64, 9


def case(dtype: torch.dtype, lens: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, KV, D, generator=g).to(dtype)
    v = torch.randn(SLOTS, KV, D, generator=g).to(dtype)
    q = torch.randn(len(lens), H, D, generator=g)
    # each sequence's context in 16-slot blocks at random places, as a paged cache holds it
    blocks = torch.randperm(SLOTS // 16, generator=g)[: len(lens) * 64].view(len(lens), 64)
    slots = (blocks[:, :, None] * 16 + torch.arange(16)).reshape(len(lens), -1)[:, : max(lens)].contiguous()
    return q, k, v, slots, torch.tensor(lens)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    out = []
    for b, n in enumerate(lens.tolist()):
        keys = k[slots[b, :n]].float().transpose(0, 1).unsqueeze(0)
        values = v[slots[b, :n]].float().transpose(0, 1).unsqueeze(0)
        out.append(F.scaled_dot_product_attention(q[b][None, :, None], keys, values, scale=0.125, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_torch_attention(dtype: torch.dtype) -> None:
    q, k, v, slots, lens = case(dtype, [1, 7, 16, 17, 300, 999])
    got = cpu_attention.decode_attention(q, k, v, slots, lens, 0.125)
    assert got is not None
    torch.testing.assert_close(got, reference(q, k, v, slots, lens), rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch() -> None:
    lens = [5, 640, 33, 128, 1, 900, 250, 64]
    q, k, v, slots, ctx = case(torch.bfloat16, lens, seed=3)
    batch = cpu_attention.decode_attention(q, k, v, slots, ctx, 0.125)
    assert batch is not None
    for b, n in enumerate(lens):
        alone = cpu_attention.decode_attention(q[b : b + 1], k, v, slots[b : b + 1, :n], ctx[b : b + 1], 0.125)
        assert torch.equal(alone[0], batch[b]), b


def test_platform_sends_single_token_rows_to_the_kernel_and_the_rest_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (a 6-token prompt chunk between two decodes) gives what torch's operators give."""
    lens, qlens = [40, 6, 300], [1, 6, 1]
    _, k, v, slots, _ = case(torch.bfloat16, lens, seed=5)
    q = torch.randn(sum(qlens), H, D, generator=torch.Generator().manual_seed(9))

    def meta() -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.zeros(sum(qlens), dtype=torch.long), gather_index=slots,
                                 attn_mask=None, pad_index=None, num_seqs=3, max_query_len=6, max_context_len=300,
                                 query_lens=qlens, context_lens=lens)

    with_kernel = Platform()._per_sequence_attention(q, k, v, meta(), 0.125)
    monkeypatch.setenv("MINDIE_HOST_CPU_KERNELS", "0")
    without = Platform()._per_sequence_attention(q, k, v, meta(), 0.125)
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-5)
    assert torch.equal(with_kernel[1:7], without[1:7])  # the prompt chunk ran on torch's operators both times
