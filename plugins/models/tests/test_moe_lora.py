"""multi_lora on the mixtures of experts: an adapter's MLP deltas cannot reach routed experts, so an adapter with
gate/up/down keys on a sparse layer is refused at load, naming the adapter, the layer and why; on DeepSeek the
latent attention takes no q/k/v/o deltas either. The layers that say so reach the plugin through the backend's
``ModelInfo.extra["delta_gaps"]`` (the family's :meth:`delta_gaps`), from a real load of the tiny models.

The adapters are PEFT-saved on a dense Qwen3 of the same width (its attention and MLP shapes are the MoE models'
dense ones): MLP-only and attention-only. One host load per family, the engine in-process.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from family_cases import SHAPE
from mindie_plugin_multi_lora.adapters import AdapterError, ModelDims, load_adapter

from mindie_host.api import PluginError
from mindie_host.testing import load_host, make_tiny_model, server_config

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``attention`` and ``mlp`` PEFT adapters of a 2-layer dense Qwen3 with the tiny families' width."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    base_dir = make_tiny_model(tmp_path_factory.mktemp("dense-qwen3"), Qwen3Config, Qwen3ForCausalLM, **SHAPE,
                               num_hidden_layers=2)
    out = {}
    for name, modules in (("attention", ATTENTION), ("mlp", MLP)):
        torch.manual_seed(3)
        model = get_peft_model(Qwen3ForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                               LoraConfig(r=4, lora_alpha=8, target_modules=modules, task_type="CAUSAL_LM"))
        out[name] = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(str(out[name]))
    return out


def loaded_dims(path: Path, adapters: dict[str, str]) -> ModelDims:
    """The dims the multi_lora plugin reads from a host loaded with ``adapters`` (the engine in this process)."""
    cfg = server_config(path, model={"dtype": "float32", "quantization": "none",
                                     "plugin_params": json.dumps({"plugin_type": "multi_lora"})},
                        plugins={"multi_lora": {"maxLoras": 2, "maxLoraRank": 8, "adapters": adapters}},
                        server={"engineProcess": False})
    return ModelDims.from_info(load_host(cfg).info)


def test_qwen3_moe_refuses_mlp_deltas_on_sparse_layers(tiny_family: Callable[[str], Path],
                                                       adapters: dict[str, Path]) -> None:
    path = tiny_family("qwen3_moe")  # layer 0 dense (mlp_only_layers), layer 1 sparse
    with pytest.raises((AdapterError, PluginError)) as info:
        loaded_dims(path, {"mlp": str(adapters["mlp"])})
    message = str(info.value)
    assert "'mlp'" in message and "layers.1.mlp." in message and "mixture of 4 routed experts" in message
    dims = loaded_dims(path, {"attn": str(adapters["attention"])})  # attention-only: served
    assert set(dims.gaps) == {"gate_up", "down"} and set(dims.gaps["down"]) == {1}
    with pytest.raises(AdapterError, match=r"layer 1's (down|gate|up)_proj cannot be adapted"):
        load_adapter("mlp", adapters["mlp"], dims, 8)


def test_deepseek_refuses_latent_attention_and_expert_deltas(tiny_family: Callable[[str], Path],
                                                             adapters: dict[str, Path]) -> None:
    dims = loaded_dims(tiny_family("deepseek_v2"), {})  # first_k_dense_replace 1: layer 0 dense, layer 1 experts
    with pytest.raises(AdapterError, match=r"'attention'.*layer 0's \w_proj cannot be adapted: .*latent attention"):
        load_adapter("attention", adapters["attention"], dims, 8)
    # layer 0's MLP keys (read first) pass: the dense first layer takes them
    with pytest.raises(AdapterError, match=r"'mlp'.*layers\.1\.mlp.*shared plus 8 routed experts"):
        load_adapter("mlp", adapters["mlp"], dims, 8)
