"""What the family tests share: each family's tiny model spec (transformers' own config and model classes), the
prompts, and helpers. The session fixture that builds the models is in conftest.py; test modules import these from
here (a module named ``conftest`` is ambiguous when several test directories run in one pytest process).

Each config is small (a few layers, hidden 128, head dim 64 so the CPU attention kernels serve it) but sets what
makes its family different: Qwen3's per-head norms and a sliding layer, Qwen2.5's (random) bias, Mistral's window (both
builtin), GLM's partial interleaved
rotary (and GLM-4's extra norms), Gemma 3's sliding and global layers with their own RoPE and a window shorter than
the prompts, Phi-3's LongRoPE with prompts past ``original_max_position_embeddings``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: every family's tiny model sees prompts of these lengths: all past the windows (16) and Phi-3's original context
PROMPT_LENGTHS = (17, 24, 33, 47)
WINDOW = 16
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
}


@dataclass
class Spec:
    """A family's tiny model: transformers' config and model class names, and the config's keys."""

    config: str
    model: str
    keys: dict[str, Any] = field(default_factory=dict)

    def classes(self) -> tuple[Any, Any]:
        import transformers

        return getattr(transformers, self.config), getattr(transformers, self.model)


#: what DeepSeek-V3's and V2's tiny configs share: MLA's ranks and head parts, 8 experts in 4 groups (2 kept, 2
#: routed), the first layer dense
DEEPSEEK = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
}
SPECS: dict[str, Spec] = {
    "qwen3": Spec(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            **SHAPE,
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    ),
    "qwen2": Spec("Qwen2Config", "Qwen2ForCausalLM", {**SHAPE, "num_hidden_layers": 2}),
    "mistral": Spec("MistralConfig", "MistralForCausalLM", {**SHAPE, "num_hidden_layers": 2, "sliding_window": WINDOW}),
    "glm": Spec("GlmConfig", "GlmForCausalLM", {**SHAPE, "num_hidden_layers": 2}),
    "glm4": Spec("Glm4Config", "Glm4ForCausalLM", {**SHAPE, "num_hidden_layers": 2}),
    "gemma3_text": Spec(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **SHAPE,
            "num_hidden_layers": 3,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 48,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "final_logit_softcapping": 20.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
            },
        },
    ),
    "gemma3": Spec(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "text_config": {
                **SHAPE,
                "num_hidden_layers": 2,
                "sliding_window": WINDOW,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "vision_config": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 28,
                "patch_size": 14,
            },
            "mm_tokens_per_image": 4,
        },
    ),
    "qwen3_moe": Spec(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **SHAPE,
            "num_hidden_layers": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "mixtral": Spec(
        "MixtralConfig",
        "MixtralForCausalLM",
        {**SHAPE, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    ),
    "deepseek_v3": Spec(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **DEEPSEEK,
            "q_lora_rank": 64,
            "n_shared_experts": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        },
    ),
    "deepseek_v2": Spec(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {
            **DEEPSEEK,
            "q_lora_rank": None,
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 1.5,
            "n_shared_experts": 2,
        },
    ),
    "phi3": Spec(
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            **{k: v for k, v in SHAPE.items() if k != "head_dim"},
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10_000.0,
                "short_factor": [1.0 + 0.05 * i for i in range(32)],
                "long_factor": [1.0 + 0.5 * i for i in range(32)],
            },
        },
    ),
}


#: the families of this plugin with layers of their own (``gemma3`` is ``gemma3_text``'s behind a multimodal checkpoint)
PLUGIN_FAMILIES = ["qwen3", "glm", "glm4", "gemma3_text", "phi3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2"]
#: the families whose every MLP product the int8 weight schemes serve (a mixture keeps its experts in float)
DENSE_FAMILIES = PLUGIN_FAMILIES[:5]


def randomize_zero_biases(directory: Path) -> None:
    """Give the saved model's all-zero biases (Qwen2's and GLM's Q/K/V: transformers' initialisation leaves them
    zero, which would check nothing of how a family reads them) random values, in place."""
    import torch
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    for f in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(f))
        zero = [k for k, v in tensors.items() if k.endswith(".bias") and not v.any()]
        if zero:
            tensors.update({k: 0.2 * torch.randn(tensors[k].shape, generator=generator) for k in zero})
            save_file(tensors, str(f), metadata={"format": "pt"})


def prompts(vocab: int) -> list[list[int]]:
    """The four prompts (token ids below ``vocab``), of :data:`PROMPT_LENGTHS`."""
    return [[(37 * i + 101 * n + 7) % (vocab - 200) + 100 for i in range(n)] for n in PROMPT_LENGTHS]


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while transformers computes a reference: its tiny steps gain nothing from two, and on a
    busy machine the idle thread's spinning costs more than the step."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def served_with_logprobs(
    cfg: dict[str, Any], batch: list[list[int]], check: Callable[[Any], None] | None = None, new: int = 12,
) -> list[tuple[list[int], list[float]]]:
    """Each prompt of ``batch``'s ``new`` greedy tokens and prompt logprobs, served by an engine of config ``cfg``
    (one engine for the batch); ``check(backend)`` looks at the loaded backend first."""
    from mindie_host.api import EngineRequest, SamplingParams
    from mindie_host.testing import loaded_host, run_engine

    host = loaded_host(cfg)
    try:
        if check is not None:
            check(host.backend)
        reqs = [EngineRequest(f"r{i}", p, SamplingParams(max_tokens=new, ignore_eos=True, prompt_logprobs=0))
                for i, p in enumerate(batch)]
        out = run_engine(host, reqs)
    finally:
        host.shutdown()
    return [(out[f"r{i}"].token_ids, [lp.logprob for lp in out[f"r{i}"].prompt_logprobs[1:]])
            for i in range(len(batch))]
