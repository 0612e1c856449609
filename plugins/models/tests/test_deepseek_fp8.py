"""DeepSeek-V3's own checkpoint format: FP8 (e4m3) weights with block scales (``weight_scale_inv``) and a
multi-token-prediction layer. The tiny model's linear weights are quantized block by block (32 x 32 blocks, some
partial), and the MTP layer's tensors are added: served, it gives exactly the tokens and prompt logprobs of the same
model saved in float32 with the dequantized weights (the MTP layer skipped), through one rank and two."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from family_cases import served_with_logprobs
from safetensors.torch import load_file, save_file

from mindie_host.testing import server_config

BLOCK = 32
PROMPTS = [[300 + 7 * i for i in range(n)] for n in (9, 23)]


def _copies(src: Path, out: Path) -> tuple[Path, Path]:
    """An FP8 block-scaled copy of ``src`` (with an MTP layer) and a float32 copy of its dequantized weights."""
    fp8, deq = out / "fp8", out / "dequantized"
    for d in (fp8, deq):
        shutil.copytree(src, d)
    tensors = load_file(str(src / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if w.dim() == 2 and "layers." in name and ".mlp.gate." not in name and "norm" not in name:
            rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
            blocks = torch.nn.functional.pad(w, (0, cols * BLOCK - w.shape[1], 0, rows * BLOCK - w.shape[0]))
            amax = blocks.view(rows, BLOCK, cols, BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-8)
            scale = amax / 448.0
            full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: w.shape[0], : w.shape[1]]
            codes = (w / full).to(torch.float8_e4m3fn)
            quantized[name], quantized[name + "_scale_inv"] = codes, scale
            dequantized[name] = codes.float() * full
        else:
            quantized[name] = dequantized[name] = w
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for part in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        quantized[f"model.layers.{layers}.{part}"] = tensors["model.norm.weight"].clone()
    save_file(quantized, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(deq / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, deq


def _served(path: Path, world: int = 1) -> list[tuple[list[int], list[float]]]:
    cfg = server_config(path, model={"dtype": "float32", "quantization": "none", "worldSize": world})
    cfg["BackendConfig"]["npuDeviceIds"] = [list(range(world))]
    return served_with_logprobs(cfg, PROMPTS)


def test_fp8_block_scaled_checkpoint_equals_its_dequantized_weights(
    tiny_family: Callable[[str], Path], tmp_path: Path
) -> None:
    fp8, deq = _copies(tiny_family("deepseek_v3"), tmp_path)
    want = _served(deq)
    assert _served(fp8) == want
    two_ranks = _served(fp8, world=2)  # each rank dequantizes only its slices (the block rows/columns it reads)
    for (tokens, lps), (want_tokens, want_lps) in zip(two_ranks, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-4)
