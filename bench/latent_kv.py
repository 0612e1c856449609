"""DeepSeek's latent KV cache against an expanded one: bytes per token, from the torch backend's own cache sizing.

A tiny random DeepSeek-V3 / V2 model (transformers' config class, save_pretrained) is loaded through the torch
backend, whose ``kv_cache_bytes_per_block`` sums each layer's ``kv_spec`` (a latent of ``kv_lora_rank`` values
beside the shared rotary key); the expanded cache is what per-head keys (``qk_nope + qk_rope``) and values
(``v_head_dim``) would take. The same sums are printed for the published shapes of DeepSeek-V3 and V2-Lite
(their config.json values), in bfloat16.

    python bench/latent_kv.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

#: the published shapes (config.json of deepseek-ai/DeepSeek-V3 and DeepSeek-V2-Lite)
PUBLISHED = {
    "DeepSeek-V3": {"layers": 61, "heads": 128, "kv_lora_rank": 512, "rope": 64, "nope": 128, "v": 128},
    "DeepSeek-V2-Lite": {"layers": 27, "heads": 16, "kv_lora_rank": 512, "rope": 64, "nope": 128, "v": 128},
}


def per_token(shape: dict[str, int], elem: int) -> tuple[int, int]:
    """(latent, expanded) cache bytes per token over all layers."""
    latent = shape["layers"] * (shape["kv_lora_rank"] + shape["rope"]) * elem
    expanded = shape["layers"] * shape["heads"] * (shape["nope"] + shape["rope"] + shape["v"]) * elem
    return latent, expanded


def tiny(directory: Path) -> dict[str, Any]:
    """The tiny model's bytes per token, as the torch backend sizes its cache, against the expanded count."""
    from mindie_plugin_models import FAMILIES
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from mindie_host.api import resolve_model
    from mindie_host.backend_api import Architectures, LlamaFamily, TorchBackend
    from mindie_host.testing import make_tiny_model

    keys = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1}
    path = make_tiny_model(directory / "deepseek", DeepseekV3Config, DeepseekV3ForCausalLM, **keys)
    backend = TorchBackend(resolve_model(path), name="tiny", dtype="bfloat16", kv_cache_dtype="bfloat16",
                           architectures=Architectures.of(LlamaFamily(), *FAMILIES))
    backend.load()
    served = backend.kv_cache_bytes_per_block(16) // 16
    shape = {"layers": 2, "heads": 4, "kv_lora_rank": 32, "rope": 16, "nope": 32, "v": 32}
    latent, expanded = per_token(shape, 2)
    assert served == latent, (served, latent)
    return {"served_bytes_per_token": served, "expanded_bytes_per_token": expanded, "ratio": round(expanded / served, 1)}


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        result: dict[str, Any] = {"tiny (backend)": tiny(Path(d))}
    for name, shape in PUBLISHED.items():
        latent, expanded = per_token(shape, 2)
        result[name] = {"latent_bytes_per_token": latent, "expanded_bytes_per_token": expanded,
                        "ratio": round(expanded / latent, 1)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
