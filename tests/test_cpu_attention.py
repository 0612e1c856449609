"""The CPU attention kernels (mindie_host/backends/attention.cpp) against torch's attention, in every variant.

Decode attention serves every single-token query of a batch-invariant CPU step in one call; each
sequence's output must match torch's scaled-dot-product attention over its own context (rtol and atol
1e-5: float32 arithmetic in another order), and carry the same bits whether it is computed alone or
beside other sequences. Prompt attention serves a sequence's prompt tokens (a whole prompt, or a chunk
after a cached prefix) causally; it must match torch's attention with the causal mask such a chunk
needs, and give the same bits on any number of threads. Every variant this CPU executes (portable,
avx2, avx512) runs every case: head dims 64 and 128 (the vector paths) and 80, 48 (the generic ones),
grouped-query ratios 1 to 12, contexts that end inside and at the edges of the kernels' blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindie_host.backends import cpu_attention, cpu_extensions
from mindie_host.backends.platform import AttentionMetadata, Platform

pytestmark = pytest.mark.skipif(cpu_extensions.compiler() is None, reason="no C++ compiler to build the kernel")

SLOTS, KV, D, H = 16384, 3, 64, 9


def case(dtype: torch.dtype, lens: list[int], seed: int = 0, heads: int = H, kv: int = KV,
         dim: int = D) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, kv, dim, generator=g).to(dtype)
    v = torch.randn(SLOTS, kv, dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, dim, generator=g)
    # each sequence's context in 16-slot blocks at random places, as a paged cache holds it
    blocks = torch.randperm(SLOTS // 16, generator=g)[: len(lens) * 64].view(len(lens), 64)
    slots = (blocks[:, :, None] * 16 + torch.arange(16)).reshape(len(lens), -1)[:, : max(lens)].contiguous()
    return q, k, v, slots, torch.tensor(lens)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
              scale: float = 0.125) -> torch.Tensor:
    out = []
    for b, n in enumerate(lens.tolist()):
        keys = k[slots[b, :n]].float().transpose(0, 1).unsqueeze(0)
        values = v[slots[b, :n]].float().transpose(0, 1).unsqueeze(0)
        out.append(F.scaled_dot_product_attention(q[b][None, :, None], keys, values, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv", "dim"), [(H, KV, D), (8, 2, 128), (4, 4, 64), (12, 1, 128), (6, 2, 80),
                                                 (4, 2, 48)])
def test_kernel_matches_torch_attention(cpu_variant: object, dtype: torch.dtype, heads: int, kv: int,
                                        dim: int) -> None:
    # contexts that end inside and at the edges of the kernel's 4-token score groups and 32-token chunks
    q, k, v, slots, lens = case(dtype, [1, 2, 7, 16, 17, 31, 33, 300, 999], heads=heads, kv=kv, dim=dim)
    got = cpu_attention.decode_attention(q, k, v, slots, lens, dim ** -0.5)
    assert got is not None
    want = reference(q, k, v, slots, lens, scale=dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(cpu_variant: object) -> None:
    lens = [5, 640, 33, 128, 1, 900, 250, 64]
    q, k, v, slots, ctx = case(torch.bfloat16, lens, seed=3)
    batch = cpu_attention.decode_attention(q, k, v, slots, ctx, 0.125)
    assert batch is not None
    for b, n in enumerate(lens):
        alone = cpu_attention.decode_attention(q[b : b + 1], k, v, slots[b : b + 1, :n], ctx[b : b + 1], 0.125)
        assert torch.equal(alone[0], batch[b]), b


def run_case(dtype: torch.dtype, runs: list[tuple[int, int]], heads: int, kv: int, dim: int,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A batch of runs (context, rows): each a sequence's verification rows, row r seeing the run's first
    context + r slots, as the engine lays a sequence's one-token rows at consecutive positions."""
    total = sum(n for _, n in runs)
    q, k, v, base, _ = case(dtype, [c + n - 1 for c, n in runs], seed=seed, heads=heads, kv=kv, dim=dim)
    q = torch.randn(total, heads, dim, generator=torch.Generator().manual_seed(seed + 1))
    slots = torch.zeros(total, base.shape[1], dtype=base.dtype)
    lens = []
    at = 0
    for b, (c, n) in enumerate(runs):
        for r in range(n):
            slots[at] = base[b]
            lens.append(c + r)
            at += 1
    return q, k, v, slots, torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv", "dim"), [(H, KV, D), (8, 2, 128), (12, 1, 128), (6, 2, 80)])
@pytest.mark.parametrize("runs", [[(600, 9)], [(31, 2)], [(15, 5), (1, 1), (300, 3)], [(200, 17), (40, 1)],
                                  [(1, 4)] + [(33 * i, 1) for i in range(1, 6)]])
def test_verification_rows_get_the_bits_they_get_alone(cpu_variant: object, dtype: torch.dtype, heads: int, kv: int,
                                                         dim: int, runs: list[tuple[int, int]]) -> None:
    """Rows of one sequence at consecutive positions share the cache walk (a run): each row's output carries the
    bits it gets computed alone, whatever shares its batch, and matches torch's attention. Runs alone (cut into
    parts across threads), beside other runs, and contexts that end inside and at the edges of the kernels' blocks."""
    q, k, v, slots, lens = run_case(dtype, runs, heads, kv, dim)
    got = cpu_attention.decode_attention(q, k, v, slots, lens, dim ** -0.5)
    assert got is not None
    for b, n in enumerate(lens.tolist()):
        alone = cpu_attention.decode_attention(q[b : b + 1], k, v, slots[b : b + 1, :n], lens[b : b + 1], dim ** -0.5)
        assert torch.equal(alone[0], got[b]), (b, n)
    torch.testing.assert_close(got, reference(q, k, v, slots, lens, scale=dim ** -0.5), rtol=1e-5, atol=1e-5)


def test_platform_sends_each_kind_of_row_to_its_kernel(cpu_variant: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed step (a 6-token prompt chunk between two decodes) gives what torch's operators give."""
    lens, qlens = [40, 6, 300], [1, 6, 1]
    _, k, v, slots, _ = case(torch.bfloat16, lens, seed=5)
    q = torch.randn(sum(qlens), H, D, generator=torch.Generator().manual_seed(9))
    calls = []
    real = cpu_attention.prompt_attention
    monkeypatch.setattr(cpu_attention, "prompt_attention", lambda *a: calls.append(a[0].shape) or real(*a))

    def meta() -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=torch.zeros(sum(qlens), dtype=torch.long), gather_index=slots,
                                 attn_mask=None, pad_index=None, num_seqs=3, max_query_len=6, max_context_len=300,
                                 query_lens=qlens, context_lens=lens)

    with_kernel = Platform()._per_sequence_attention(q, k, v, meta(), 0.125)
    assert calls == [torch.Size([6, H, D])]  # the chunk, and only the chunk, went to the prompt kernel
    monkeypatch.setenv("MINDIE_HOST_CPU_KERNELS", "0")
    without = Platform()._per_sequence_attention(q, k, v, meta(), 0.125)
    assert len(calls) == 1
    decodes = [0, sum(qlens) - 1]  # float32 arithmetic; the chunk's rows take bf16 products (see BF16_PRODUCTS)
    torch.testing.assert_close(with_kernel[decodes], without[decodes], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_kernel[1:-1], without[1:-1], **prompt_tolerance(cpu_variant, torch.bfloat16))


#: how close the avx512 prompt kernel's bf16 products come to torch's float32 attention (inputs of unit scale)
BF16_PRODUCTS = {"rtol": 1e-2, "atol": 1e-2}


def prompt_tolerance(kernels: object, dtype: torch.dtype) -> dict[str, float]:
    """Over a bf16 cache the avx512 kernel's two products take bf16 operands (queries and softmax numerators rounded
    to bf16, float32 sums), as flash attention does on bf16 inputs: about bf16's precision, 2^-8 of the values'
    scale. Otherwise float32 arithmetic in another order than torch's."""
    if dtype == torch.bfloat16 and kernels.variant == "avx512":  # type: ignore[attr-defined]
        return BF16_PRODUCTS
    return {"rtol": 1e-5, "atol": 2e-6}


def prompt_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """torch's attention of ``q [n, H, D]``, the newest n of ``len(slots)`` tokens, with the causal mask."""
    n, ctx = q.shape[0], slots.shape[0]
    keys = k[slots].float().transpose(0, 1).unsqueeze(0)
    values = v[slots].float().transpose(0, 1).unsqueeze(0)
    mask = torch.ones(n, ctx, dtype=torch.bool).tril(ctx - n).view(1, 1, n, ctx)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
                                         scale=q.shape[-1] ** -0.5, enable_gqa=keys.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "ctx", "heads", "kv", "dim"), [
    (1, 1, 9, 3, 64),        # a one-token prompt
    (37, 37, 9, 3, 64),      # a whole prompt, not a multiple of the key or row blocks
    (512, 1100, 9, 3, 64),   # a 512-token chunk after 588 cached tokens
    (5, 700, 9, 3, 64),      # a short chunk after a long prefix
    (100, 133, 8, 2, 128),   # head dim 128
    (17, 50, 4, 4, 64),      # one query head per KV head
    (40, 90, 6, 2, 80),      # a head dim of the generic path (16 + 8 dims a pass with AVX-512)
    (9, 9, 12, 1, 48),       # and another, twelve query heads a KV head
])
def test_prompt_kernel_matches_torch_attention(cpu_variant: object, dtype: torch.dtype, n: int, ctx: int, heads: int,
                                               kv: int, dim: int) -> None:
    g = torch.Generator().manual_seed(n + ctx)
    k = torch.randn(4096, kv, dim, generator=g).to(dtype)
    v = torch.randn(4096, kv, dim, generator=g).to(dtype)
    slots = torch.randperm(4096, generator=g)[:ctx]
    q = torch.randn(n, heads, dim, generator=g)
    got = cpu_attention.prompt_attention(q, k, v, slots, dim ** -0.5)
    assert got is not None
    torch.testing.assert_close(got, prompt_reference(q, k, v, slots), **prompt_tolerance(cpu_variant, dtype))


def test_prompt_kernel_gives_the_same_bits_on_any_number_of_threads(cpu_variant: object) -> None:
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2048, KV, D, generator=g).bfloat16(), torch.randn(2048, KV, D, generator=g).bfloat16()
    slots, q = torch.randperm(2048, generator=g)[:900], torch.randn(300, H, D, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(cpu_attention.prompt_attention(q, k, v, slots, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
