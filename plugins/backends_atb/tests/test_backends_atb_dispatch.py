"""Operator dispatch of NpuPlatform, run on the CPU with a STAND-IN torch_npu module (not the real one).

The real host model (DecoderModel, tiny random Llama) runs through AtbBackend on an
NpuPlatform whose ``ops`` is :class:`StandInTorchNpu`: a recorder that computes
each documented operator with plain torch. The logits must equal the plain torch
backend's, and every operator must have gone to the named torch_npu function
with the argument conventions the platform documents. Nothing here touches an
Ascend NPU or the real torch_npu kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mindie_plugin_backends_atb.backend import AtbBackend
from mindie_plugin_backends_atb.platform import CAUSAL_MASK_SIZE, NpuPlatform
from standin_torch_npu import StandInTorchNpu

from mindie_host.api import ModelInput, resolve_model
from mindie_host.backend_api import Platform, TorchBackend
from mindie_host.testing import make_tiny_llama

BLOCK = 8


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("atb-tiny"))


def _backends(path: Path) -> tuple[TorchBackend, AtbBackend, StandInTorchNpu]:
    source = resolve_model(path)
    ref = TorchBackend(source, name="ref", dtype="float32", quantization="none", platform=Platform())
    ref.load()
    ref.allocate_kv_cache(32, BLOCK)
    standin = StandInTorchNpu()
    platform = NpuPlatform(standin, device_type="cpu", mem_get_info=lambda: (8 << 30, 16 << 30))
    atb = AtbBackend(source, name="atb", dtype="float32", platform=platform)
    atb.load()
    atb.allocate_kv_cache(32, BLOCK)
    return ref, atb, standin


def _steps() -> list[ModelInput]:
    a = list(range(200, 219))  # 19 tokens
    b = list(range(400, 405))  # 5 tokens
    return [
        # prefill of two sequences of different lengths
        ModelInput(input_ids=a + b, positions=list(range(19)) + list(range(5)), query_lens=[19, 5],
                   context_lens=[19, 5], block_tables=[[3, 0, 7], [5]], logits_indices=[18, 23]),
        # decode of both
        ModelInput(input_ids=[11, 12], positions=[19, 5], query_lens=[1, 1], context_lens=[20, 6],
                   block_tables=[[3, 0, 7], [5]], logits_indices=[0, 1]),
        # chunked prefill over cached context (b gets 4 more prompt tokens) mixed with a decode of a
        ModelInput(input_ids=[13, 500, 501, 502, 503], positions=[20, 6, 7, 8, 9], query_lens=[1, 4],
                   context_lens=[21, 10], block_tables=[[3, 0, 7], [5, 9]], logits_indices=[0, 4]),
    ]


def test_backends_atb_standin_dispatch_matches_torch_logits(tiny_path: Path) -> None:
    """Stand-in torch_npu: same logits as the torch backend at prefill, decode and chunked-prefill steps."""
    ref, atb, standin = _backends(tiny_path)
    assert isinstance(atb.model.platform, NpuPlatform)  # the host's DecoderModel, run through the NPU platform
    assert type(atb.model).__name__ == "DecoderModel"
    assert atb.kv_caches[0][0].shape == (32, BLOCK, 2, 16)  # [blocks, block_size, KV, D]
    for batch in _steps():
        expect = ref.execute(batch)
        got = atb.execute(batch)
        torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)


def test_backends_atb_standin_records_each_named_operator(tiny_path: Path) -> None:
    """Stand-in torch_npu: which function each platform operator reached, with which conventions."""
    _, atb, standin = _backends(tiny_path)
    prefill, decode, chunked = _steps()
    layers = atb.arch.num_layers

    standin.calls.clear()
    atb.execute(prefill)
    names = [n for n, _ in standin.calls]
    assert names.count("npu_rms_norm") == 2 * layers + 1
    assert names.count("npu_apply_rotary_pos_emb") == layers
    assert names.count("_npu_reshape_and_cache") == layers
    assert names.count("npu_fused_infer_attention_score") == layers
    assert "_npu_paged_attention" not in names
    fia = next(kw for n, kw in standin.calls if n == "npu_fused_infer_attention_score")
    assert fia["actual_seq_lengths"] == [19, 24]  # cumulative query lengths (TND)
    assert fia["actual_seq_lengths_kv"] == [19, 5]
    assert fia["block_size"] == BLOCK and fia["sparse_mode"] == 3
    assert fia["mask"] == (CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE)
    rope = next(kw for n, kw in standin.calls if n == "npu_apply_rotary_pos_emb")
    assert rope["q"] == (1, 24, 4, 16) and rope["cos"] == (1, 24, 1, 16)
    cache = next(kw for n, kw in standin.calls if n == "_npu_reshape_and_cache")
    assert cache["slot_dtype"] == torch.int32

    standin.calls.clear()
    atb.execute(decode)
    names = [n for n, _ in standin.calls]
    assert names.count("_npu_paged_attention") == layers
    assert "npu_fused_infer_attention_score" not in names
    pa = next(kw for n, kw in standin.calls if n == "_npu_paged_attention")
    assert pa == {"num_heads": 4, "num_kv_heads": 2, "context_lens": [20, 6]}

    standin.calls.clear()
    atb.execute(chunked)
    fia = next(kw for n, kw in standin.calls if n == "npu_fused_infer_attention_score")
    assert fia["actual_seq_lengths"] == [1, 5] and fia["actual_seq_lengths_kv"] == [21, 10]


def test_backends_atb_prepare_step_block_table() -> None:
    platform = NpuPlatform(StandInTorchNpu(), device_type="cpu")
    from mindie_host.backend_api import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=torch.tensor([9, 17], dtype=torch.long), gather_index=torch.zeros(2, 1),
                             attn_mask=None, pad_index=None, num_seqs=2, max_query_len=1, max_context_len=18,
                             query_lens=[1, 1], context_lens=[10, 18])
    batch = ModelInput(input_ids=[1, 2], positions=[9, 17], query_lens=[1, 1], context_lens=[10, 18],
                       block_tables=[[1, 2], [0, 3, 4]], logits_indices=[0, 1])
    out = platform.prepare_step(meta, batch, block_size=8)
    assert out.extra["block_table"].tolist() == [[1, 2, 0], [0, 3, 4]]
    assert out.extra["block_table"].dtype == torch.int32
    assert out.extra["slot_indices"].dtype == torch.int32
    assert out.extra["context_lens"].tolist() == [10, 18] and out.extra["context_lens"].device.type == "cpu"
    assert out.extra["query_cumulative"] == [1, 2]
