"""The batched LoRA kernels against a per-token reference, with mixed ranks and base-only tokens."""

from __future__ import annotations

import pytest
import torch
from mindie_host.api import ModelInput

from mindie_plugin_multi_lora.adapters import MODULES, LoraAdapter, ModelDims
from mindie_plugin_multi_lora.runtime import GROUPS, LoraRuntime

DIMS = ModelDims(num_layers=2, hidden=24, q=24, kv=8, inter=40)


def random_adapter(name: str, rank: int, modules: list[str], seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(DIMS.num_layers):
        for m in modules:
            fin, fout = DIMS.features(m)
            weights[(layer, m)] = (torch.randn(rank, fin, generator=g), torch.randn(fout, rank, generator=g))
    return LoraAdapter(name, "/x", rank, 1.0, weights)


def reference(group: str, layer: int, x: torch.Tensor, out: torch.Tensor, token_adapters: list) -> torch.Tensor:
    """Token by token: out_t + B_a (A_a x_t) for the token's adapter a (nothing for base tokens)."""
    ref = out.clone()
    for t, adapter in enumerate(token_adapters):
        if adapter is None:
            continue
        off = 0
        for m in GROUPS[group]:
            size = DIMS.features(m)[1]
            if (layer, m) in adapter.weights:
                a, b = adapter.weights[(layer, m)]
                ref[t, off : off + size] += b @ (a @ x[t])
            off += size
    return ref


@pytest.mark.parametrize("kernel", ["grouped", "masked", "segment", "auto"])
@pytest.mark.parametrize("slots", [3, 8])
def test_kernels_match_per_token_reference(kernel: str, slots: int) -> None:
    adapters = [
        random_adapter("a", 2, list(MODULES), 1),
        random_adapter("b", 8, ["q_proj", "v_proj", "down_proj"], 2),
        random_adapter("c", 5, ["o_proj", "gate_proj", "up_proj", "k_proj"], 3),
    ]
    rt = LoraRuntime(DIMS, slots, 8, kernel=kernel, segment_min_run=4)
    slot_of = {}
    for i, ad in enumerate(adapters):
        slot = slots - 1 - i  # not in slot order, so the gather path is exercised
        rt.write_slot(slot, ad)
        slot_of[ad.name] = slot
    # sequences: (adapter or None, query_len); mixes prefills and decodes, neighbours on one adapter
    seqs = [(adapters[0], 5), (None, 3), (adapters[1], 1), (adapters[1], 4), (adapters[2], 1), (None, 1),
            (adapters[0], 1)]
    batch = ModelInput(
        input_ids=[0] * sum(q for _, q in seqs), positions=[0] * sum(q for _, q in seqs),
        query_lens=[q for _, q in seqs], context_lens=[q for _, q in seqs], block_tables=[[0]] * len(seqs),
        logits_indices=[0], row_variants=[slot_of[a.name] if a else -1 for a, _ in seqs],
    )
    token_adapters = [a for a, q in seqs for _ in range(q)]
    rt.prepare(batch)
    n = len(token_adapters)
    g = torch.Generator().manual_seed(9)
    for layer in range(DIMS.num_layers):
        for group in ("qkv", "o", "gate_up", "down"):
            fin = DIMS.features(GROUPS[group][0])[0]
            width = sum(DIMS.features(m)[1] for m in GROUPS[group])
            x = torch.randn(n, fin, generator=g)
            out = torch.randn(n, width, generator=g)
            want = reference(group, layer, x, out, token_adapters)
            got = rt.apply(group, layer, x, out.clone())
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert rt.max_kinds_in_step == 4  # three adapters and the base model in one step


def test_single_adapter_batch_and_cleared_slot() -> None:
    ad = random_adapter("a", 4, list(MODULES), 5)
    rt = LoraRuntime(DIMS, 4, 8, kernel="masked")
    rt.write_slot(2, ad)
    batch = ModelInput(input_ids=[0, 0, 0], positions=[0, 1, 2], query_lens=[3], context_lens=[3],
                       block_tables=[[0]], logits_indices=[2], row_variants=[2])
    rt.prepare(batch)
    x = torch.randn(3, DIMS.hidden)
    out = torch.zeros(3, DIMS.q + 2 * DIMS.kv)
    want = reference("qkv", 1, x, out, [ad] * 3)
    torch.testing.assert_close(rt.apply("qkv", 1, x, out.clone()), want, rtol=1e-4, atol=1e-4)
    rt.clear_slot(2)
    rt.prepare(batch)
    torch.testing.assert_close(rt.apply("qkv", 1, x, out.clone()), out)
