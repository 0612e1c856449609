"""The streaming loader: a GGUF model is read one tensor at a time, each turned into the form it is served in.

A model loaded by the torch backend (each tensor read when a layer takes it; a matrix the file holds low-bit never
read dense unless a bfloat16 prompt copy of it is kept) must answer exactly as the same model built from every
tensor read first (the loader before streaming, with the dense embedding table). Over the prompt-copy budget no
low-bit matrix keeps a dense or bfloat16 copy; under it (the default model's size) they keep one. The embedding is
looked up from the low-bit form, the file's exact values.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from test_low_bit_weights import HIDDEN, VOCAB, loaded, write_tiny_gguf

from mindie_host.backends import cpu_matmul
from mindie_host.backends.base import ModelInput
from mindie_host.backends.cpu_matmul import LowBitTiles
from mindie_host.backends.linear import LowBitWeight, prompt_bf16_enabled
from mindie_host.backends.torch.backend import TorchBackend
from mindie_host.backends.torch.model import DecoderModel
from mindie_host.models.weights import (
    EightBitGroups,
    FourBitGroups,
    iter_weights,
    load_arch,
    low_bit_matrices,
    resolve_model,
)

pytestmark = pytest.mark.skipif(cpu_matmul.kernel() is None, reason="no C++ compiler for the low-bit kernel")

#: (matrices, embedding, untied head) of each file
FILES = {"q8_0": ("Q8_0", "Q8_0", None), "q4_0": ("Q4_0", "Q4_0", None), "q4_0-untied": ("Q4_0", "Q8_0", "Q4_0")}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("streaming")
    return {name: write_tiny_gguf(d / f"{name}.gguf", m, e, h) for name, (m, e, h) in FILES.items()}


def eager_model(backend: TorchBackend, path: Path) -> DecoderModel:
    """The model as the loader built it before streaming: every tensor read (float32) before any layer takes its
    form, the low-bit forms read at once, the embedding looked up in its dense table."""
    source = resolve_model(path)
    arch = load_arch(source)
    dense = {n: torch.from_numpy(np.require(a, requirements="W")) for n, a in iter_weights(source, arch)}
    table = dense["model.embed_tokens.weight"].clone()
    model = DecoderModel(arch, dense, backend.platform, torch.float32, dict(low_bit_matrices(source, arch)))
    model.embed = table
    return model


def prompts_then_decode(backend: TorchBackend, seqs: int = 3, ctx: int = 19) -> torch.Tensor:
    """Each sequence's prompt (its rows marked as prompt rows), then three decode steps of all of them; every
    step's logits, stacked."""
    blocks = -(-(ctx + 4) // 16)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(seqs)]
    out = []
    for s in range(seqs):
        n = ctx + s
        out.append(backend.execute(ModelInput(
            input_ids=[(7 * s + 3 * t) % VOCAB for t in range(n)], positions=list(range(n)), query_lens=[n],
            context_lens=[n], block_tables=[tables[s]], logits_indices=[n - 1], row_variants=[-1], prompt_lens=[n])))
    for step in range(3):
        out.append(backend.execute(ModelInput(
            input_ids=[(5 * s + step) % VOCAB for s in range(seqs)], positions=[ctx + s + step for s in range(seqs)],
            query_lens=[1] * seqs, context_lens=[ctx + s + step + 1 for s in range(seqs)], block_tables=tables,
            logits_indices=list(range(seqs)), row_variants=[-1] * seqs, prompt_lens=[ctx + s for s in range(seqs)])))
    return torch.cat(out)


def low_bit_products(backend: TorchBackend) -> list[LowBitWeight]:
    assert backend.model is not None
    layer = backend.model.layers[0]
    found = [layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down, backend.model.lm_head_linear]
    return [w for w in found if isinstance(w, LowBitWeight)]


@pytest.mark.parametrize("budget_mib", ["0", "512"])
@pytest.mark.parametrize("name", sorted(FILES))
def test_streaming_answers_exactly_as_reading_everything_first(files: dict[str, Path], name: str, budget_mib: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINDIE_HOST_PROMPT_COPY_MIB", budget_mib)
    streamed, eager = loaded(files[name], "auto"), loaded(files[name], "auto")
    eager.model = eager_model(eager, files[name])
    assert isinstance(streamed.model.embed, LowBitTiles)  # type: ignore[union-attr]
    assert len(low_bit_products(streamed)) == 5
    assert torch.equal(prompts_then_decode(streamed), prompts_then_decode(eager))


def test_over_the_budget_no_low_bit_matrix_keeps_a_dense_or_bf16_copy(
        files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MINDIE_HOST_PROMPT_COPY_MIB", "0")
    with caplog.at_level(logging.INFO, logger="mindie_host.backends.platform"):
        backend = loaded(files["q4_0"], "auto")
    for w in low_bit_products(backend):
        assert w.dense is None and w.prompt_weight is None and w._dequantized is None and w.tiles is not None
    assert "low-bit kernel" in caplog.text and "bfloat16 copies" in caplog.text


@pytest.mark.skipif(not prompt_bf16_enabled(), reason="bfloat16 prompt copies need a CPU with native bfloat16")
def test_under_the_budget_low_bit_matrices_keep_their_prompt_copy(
        files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MINDIE_HOST_PROMPT_COPY_MIB", "1")  # the tiny model's copies take well under 1 MiB
    with caplog.at_level(logging.INFO, logger="mindie_host.backends.platform"):
        backend = loaded(files["q8_0"], "auto")
    for w in low_bit_products(backend):
        assert w.dense is None and w.prompt_weight is not None and w.prompt_weight.dtype == torch.bfloat16
    assert "through bfloat16 copies" in caplog.text


def test_a_bad_budget_is_refused_by_name(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINDIE_HOST_PROMPT_COPY_MIB", "lots")
    with pytest.raises(ValueError, match="MINDIE_HOST_PROMPT_COPY_MIB"):
        loaded(files["q8_0"], "auto")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_embedding_rows_from_the_low_bit_form_equal_the_dense_lookup(tmp_path: Path, kind: str) -> None:
    source = resolve_model(write_tiny_gguf(tmp_path / "t.gguf", "Q4_0", kind))
    form = low_bit_matrices(source)["model.embed_tokens.weight"]
    dense = torch.from_numpy(dict(iter_weights(source))["model.embed_tokens.weight"])
    if isinstance(form, FourBitGroups):
        tiles = LowBitTiles.four_bit(*(torch.from_numpy(a) for a in (form.codes, form.scale, form.offset)), 32)
    else:
        assert isinstance(form, EightBitGroups)
        scale = torch.from_numpy(form.scale)
        tiles = LowBitTiles(torch.from_numpy(form.codes), scale, torch.zeros_like(scale), 32)
    ids = torch.tensor([0, 5, 31, 32, 33, VOCAB - 1, 5, 64])
    assert torch.equal(tiles.rows(ids), torch.nn.functional.embedding(ids, dense))
    assert tiles.rows(ids).shape == (len(ids), HIDDEN)


def test_q6_k_reads_as_exact_eight_bit_groups_of_16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-quantize stores a Q4_0 file's tied embedding as Q6_K: its 8-bit groups of 16 are the file's values,
    bit for bit (gguf's own dequantize), unpacked a few rows at a time, and the kernel multiplies them."""
    import gguf
    from gguf.quants import dequantize

    from mindie_host.models import low_bit
    from mindie_host.models.gguf_header import gguf_tensors

    rows, cols = 70, 512
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    d = (rng.random((rows, cols // 256)) * 0.01 + 1e-3).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    w = gguf.GGUFWriter(str(tmp_path / "q6k.gguf"), "llama")
    w.add_tensor("token_embd.weight", blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = gguf_tensors(tmp_path / "q6k.gguf")
    monkeypatch.setattr(low_bit, "Q6_K_ROWS", 16)  # several chunks, the last one short
    groups = low_bit.six_bit_from_gguf(tensor)
    want = np.asarray(dequantize(tensor.data, gguf.GGMLQuantizationType.Q6_K), dtype=np.float32).reshape(rows, cols)
    assert groups.group_size == 16 and groups.codes.min() >= -32 and groups.codes.max() <= 31
    assert np.array_equal(groups.dequantize().view(np.uint32), want.view(np.uint32))
    scale = torch.from_numpy(groups.scale)
    tiles = LowBitTiles(torch.from_numpy(groups.codes), scale, torch.zeros_like(scale), 16)
    ids = torch.arange(rows)
    assert torch.equal(tiles.rows(ids).view(torch.int32), torch.from_numpy(want).view(torch.int32))
    x = torch.randn(3, cols)
    ref = x.to(cpu_matmul.activation_dtype()).float() @ torch.from_numpy(want).T
    torch.testing.assert_close(tiles(x), ref, rtol=1e-4, atol=1e-4)
