"""Helpers for the multi_lora tests: adapter specs, prompts, PEFT adapter building, HF references, configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

#: name -> (rank, alpha, target modules, use_rslora, seed)
ADAPTER_SPECS: dict[str, tuple[int, int, list[str], bool, int]] = {
    "alpha": (4, 8, ALL_MODULES, False, 1),
    "beta": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True, 2),
    "gamma": (16, 8, ["gate_proj", "up_proj", "down_proj"], False, 3),
    "delta": (2, 4, ALL_MODULES, False, 4),
}

PROMPTS: list[list[int]] = [
    [1, 504, 3458, 314, 253, 1234, 28, 17, 999],
    [1, 2500, 77, 13, 8000, 4242, 300, 12, 44, 51, 6, 700, 1000, 2],
    [1, 9, 10, 11, 12],
]


def make_peft_adapter(base_dir: Path, out_dir: Path, rank: int, alpha: int, modules: list[str], rslora: bool,
                      seed: int) -> Path:
    """A random PEFT LoRA adapter for the model in ``base_dir`` (B randomized: peft starts it at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.6)
            elif "lora_A" in name:
                param.normal_(0.0, 0.6)
    model.save_pretrained(str(out_dir))
    return out_dir


def hf_greedy(base_dir: Path, adapter_dir: Path | None, prompt: list[int], max_new: int) -> list[int]:
    """Greedy tokens from HF transformers with ``adapter_dir`` merged into the base (None = base model)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, num_beams=1,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens


def lora_config(model_path: Path, **plugin: Any) -> dict[str, Any]:
    """A server config with multi_lora enabled (``plugin`` goes to ``Plugins.multi_lora``)."""
    from mindie_host.testing import server_config

    return server_config(
        model_path,
        model={"plugin_params": json.dumps({"plugin_type": "multi_lora"})},
        plugins={"multi_lora": plugin},
    )
