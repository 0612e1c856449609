"""Low-bit weights on CPU: a GGUF file's 4-bit groups and 8-bit blocks, read as they are.

The file's values are the reference: the low-bit copies (4-bit groups and Q8_0's 8-bit blocks)
must stand for exactly those values, products of many rows must be bit-identical to
``quantization: "none"`` outside batch-invariant mode, and products of few rows (activations in
the CPU profile's dtype) must stay within bfloat16 error of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mindie_host.backends import cpu_matmul, cpu_profile
from mindie_host.backends.base import ModelInput
from mindie_host.backends.cpu_matmul import LowBitTiles
from mindie_host.backends.linear import (
    FourBitWeight,
    Int8Weight,
    LowBitWeight,
    PackedWeight,
    PromptRows,
    mkl_packing_available,
)
from mindie_host.backends.platform import Platform
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.config import ConfigError, config_from_dict
from mindie_host.models.weights import (
    EightBitGroups,
    FourBitGroups,
    iter_weights,
    load_arch,
    low_bit_matrices,
    resolve_model,
)
from mindie_host.testing import server_config

pytestmark = pytest.mark.skipif(cpu_matmul.kernel() is None, reason="no C++ compiler for the low-bit kernel")

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96


def write_tiny_gguf(path: Path, matrix_type: str = "Q4_1", embed_type: str = "Q8_0", head_type: str | None = None) -> Path:
    """A random tiny Llama GGUF whose matrices are stored as ``matrix_type`` and its tied embedding as ``embed_type``
    (with ``head_type``, an untied LM head stored so)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(512)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)

    def add(name: str, shape: tuple[int, ...], kind: str, scale: float = 0.2) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), embed_type, 1.0)
    if head_type is not None:
        add("output.weight", (VOCAB, HIDDEN), head_type)
    add("output_norm.weight", (HIDDEN,), "F32", 1.0)
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32", 1.0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32", 1.0)
        add(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), matrix_type)
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * head, HIDDEN), matrix_type)
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * head, HIDDEN), matrix_type)
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), matrix_type)
        add(f"blk.{i}.ffn_gate.weight", (INTER, HIDDEN), matrix_type)
        add(f"blk.{i}.ffn_up.weight", (INTER, HIDDEN), matrix_type)
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, INTER), matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def loaded(path: Path, quantization: str) -> TorchBackend:
    backend = TorchBackend(resolve_model(path), name="tiny", dtype="float32", quantization=quantization, platform=Platform())
    backend.load()
    backend.allocate_kv_cache(64, 16)
    return backend


def decode_logits(backend: TorchBackend, seqs: int, ctx: int = 20) -> torch.Tensor:
    """Prefill ``seqs`` different prompts of ``ctx`` tokens, then one decode step of all of them; its logits."""
    blocks = -(-(ctx + 1) // 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    prompts = [[(7 * s + 3 * t) % VOCAB for t in range(ctx)] for s in range(seqs)]
    for s in range(seqs):
        backend.execute(ModelInput(
            input_ids=prompts[s], positions=list(range(ctx)), query_lens=[ctx], context_lens=[ctx],
            block_tables=[tables[s]], logits_indices=[ctx - 1], row_variants=[-1],
        ))
    return backend.execute(ModelInput(
        input_ids=[(5 * s) % VOCAB for s in range(seqs)], positions=[ctx] * seqs, query_lens=[1] * seqs,
        context_lens=[ctx + 1] * seqs, block_tables=tables, logits_indices=list(range(seqs)),
        row_variants=[-1] * seqs,
    ))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_four_bit_groups_stand_for_exactly_the_files_values(tmp_path: Path, kind: str) -> None:
    source = resolve_model(write_tiny_gguf(tmp_path / f"tiny-{kind}.gguf", kind))
    arch = load_arch(source)
    stored = low_bit_matrices(source, arch)
    dense = dict(iter_weights(source, arch))
    four_bit = {k: v for k, v in stored.items() if isinstance(v, FourBitGroups)}
    assert len(four_bit) == 7 * LAYERS  # q, k, v, o, gate, up, down of every layer
    eight_bit = stored["model.embed_tokens.weight"]  # Q8_0
    assert isinstance(eight_bit, EightBitGroups) and eight_bit.codes.dtype == np.int8
    np.testing.assert_array_equal(eight_bit.dequantize(), dense["model.embed_tokens.weight"])
    for name, groups in four_bit.items():
        assert groups.codes.max() <= 15
        np.testing.assert_array_equal(groups.dequantize(), dense[name], err_msg=name)  # q/k rows un-permuted too


def test_default_models_4bit_groups_match_its_dequantized_weights() -> None:
    from mindie_host.models.default import default_model_path

    source = resolve_model(default_model_path())
    arch = load_arch(source)
    stored = low_bit_matrices(source, arch)
    assert sum(isinstance(v, FourBitGroups) for v in stored.values()) == 7 * arch.num_layers
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.29.mlp.down_proj.weight"}
    for name, array in iter_weights(source, arch):
        if name in wanted:
            np.testing.assert_array_equal(stored[name].dequantize(), array, err_msg=name)  # type: ignore[union-attr]


def test_hf_checkpoints_have_no_low_bit_matrices(tiny_model: Path) -> None:
    assert low_bit_matrices(resolve_model(tiny_model)) == {}


def test_low_bit_products_are_within_bfloat16_error_and_large_ones_are_dense(tmp_path: Path) -> None:
    source = resolve_model(write_tiny_gguf(tmp_path / "tiny.gguf", embed_type="Q8_0"))
    stored = low_bit_matrices(source)
    groups, embed = stored["model.layers.0.mlp.gate_proj.weight"], stored["model.embed_tokens.weight"]
    assert isinstance(groups, FourBitGroups) and isinstance(embed, EightBitGroups)
    weight = torch.from_numpy(groups.dequantize())
    four = FourBitWeight(groups, PackedWeight(weight))
    eight_weight = torch.from_numpy(embed.dequantize())[:, :HIDDEN].contiguous()
    eight = Int8Weight(EightBitGroups(embed.codes[:, :HIDDEN].copy(), embed.scale[:, : HIDDEN // 32].copy()),
                       eight_weight)
    for rows in (1, 3, Int8Weight.max_rows):
        x = torch.randn(rows, HIDDEN)
        for low, w in ((four, weight), (eight, eight_weight)):
            ref = x @ w.T
            assert (low(x) - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    x = torch.randn(LowBitWeight.max_rows + 1, HIDDEN)
    assert torch.equal(four(x), PackedWeight(weight)(x))  # above the threshold: the dense fp32 product
    assert torch.equal(eight(x), torch.nn.functional.linear(x, eight_weight))


def test_auto_reads_the_files_low_bit_form_and_agrees_with_none(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    auto, none = loaded(path, "auto"), loaded(path, "none")
    assert auto.model is not None and none.model is not None
    assert isinstance(auto.model.layers[0].attn.qkv, FourBitWeight)
    assert isinstance(auto.model.lm_head_linear, Int8Weight)  # the tied Q8_0 embedding
    assert not isinstance(none.model.layers[0].attn.qkv, LowBitWeight)
    for seqs in (1, 4):
        a, n = decode_logits(auto, seqs), decode_logits(none, seqs)
        assert (a - n).abs().max().item() < 0.05 * n.abs().max().item()
        assert (a.argmax(-1) == n.argmax(-1)).float().mean().item() >= 0.75
    # with batch invariance off, a decode batch above the low-bit threshold runs the same dense fp32
    # products as "none" (by default every product reads the low-bit form: tests/test_batch_invariance.py)
    monkeypatch.setenv("MINDIE_HOST_BATCH_INVARIANT", "0")
    auto, none = loaded(path, "auto"), loaded(path, "none")
    big = LowBitWeight.max_rows + 2
    assert torch.equal(decode_logits(auto, big), decode_logits(none, big))


def test_int8_prompt_rows_build_each_matrixs_tiles_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With int8 prompt rows, :meth:`Platform.prepare_linear` builds a low-bit matrix's tiles once: a Q4_0 matrix
    (groups of 32) multiplies its prompt rows in int8; a Q6_K head (unpacked as 8-bit groups of 16, which int8 rows
    cannot take) keeps the weight built for that check, prompt rows through its low-bit kernel."""
    if cpu_profile.profile().int8_products is None:
        # deliberate: MINDIE_HOST_PROMPT_INT8=1 is a startup error on the portable and neon profiles (no native int8
        # products: linear.prompt_int8_enabled), so there is no int8 path to build tiles for; x86-64 CI runs it
        pytest.skip("int8 prompt rows need a CPU profile with native int8 products")
    monkeypatch.setenv("MINDIE_HOST_PROMPT_INT8", "1")
    built: list[LowBitTiles] = []
    init = LowBitTiles.__init__

    def counted(self: LowBitTiles, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(LowBitTiles, "__init__", counted)
    rng = np.random.default_rng(0)
    scale = (rng.random((VOCAB, HIDDEN // 32), dtype=np.float32) + 0.5) / 64
    q4_0 = FourBitGroups(rng.integers(0, 16, (VOCAB, HIDDEN), dtype=np.uint8), scale, -8 * scale, 32)
    q6_k = EightBitGroups(rng.integers(-32, 32, (VOCAB, HIDDEN), dtype=np.int8),
                          (rng.random((VOCAB, HIDDEN // 16), dtype=np.float32) + 0.5) / 64, 16)
    platform = Platform()
    platform.plan_prompt_copies(2 * VOCAB * HIDDEN * 2)
    for groups, kind, int8_rows in ((q4_0, FourBitWeight, True), (q6_k, Int8Weight, False)):
        built.clear()
        weight = platform.prepare_linear(torch.from_numpy(groups.dequantize()), groups)
        assert isinstance(weight, kind) and weight.prompt_int8 == int8_rows and weight.prompt_weight is None
        assert len(built) == 1 and built[0] is weight.tiles
        x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
        prompt = weight(x, None, PromptRows(torch.ones(5, dtype=torch.bool)))
        ref = x @ torch.from_numpy(groups.dequantize()).T
        assert (prompt - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_quantization_is_validated_by_name() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(server_config(None, model={"quantization": "int3"}))
    assert "quantization" in str(err.value) and "none" in str(err.value)


@pytest.mark.skipif(not mkl_packing_available(), reason="no MKL packed GEMM in this torch build")
def test_mkl_packed_copies_are_made_on_a_buckets_first_product_and_match_the_plain_product() -> None:
    weight = torch.randn(96, HIDDEN)
    packed = PackedWeight(weight)
    assert packed.packed == {}  # nothing packed at load: each bucket's copy is as large as the weight
    for rows in (1, 2, 100):  # below and above the buckets: the plain weight, and still nothing packed
        x = torch.randn(rows, HIDDEN)
        assert torch.equal(packed(x), torch.nn.functional.linear(x, weight))
    assert packed.packed == {}
    for rows, made in ((5, {8}), (8, {8}), (12, {8, 16}), (40, {8, 16, 64})):
        x = torch.randn(rows, HIDDEN)
        torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
        assert set(packed.packed) == made
