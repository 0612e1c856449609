"""The names of the quantization schemes and KV-cache precisions the torch backend serves."""

from __future__ import annotations

#: ``quantization`` values: what each one does
SCHEMES: dict[str, str] = {
    "auto": "the model file's own low-bit forms (GGUF Q4/Q8 groups, msModelSlim or compressed-tensors int8 layers)",
    "none": "floating point only: low-bit and int8 matrices are dequantized (the fp32 reference)",
    "w8a16": "int8 weights, one scale per output channel; activations in the model's dtype",
    "w8a8": "int8 weights per output channel and int8 activations per token, multiplied as int8",
}

#: ``kvCacheDtype`` value for the int8 cache (one scale per token and KV head)
KV_INT8 = "int8"

#: the linear layers of a Llama-family decoder layer that the schemes quantize, in HF names
LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)

#: products that run fused (one matrix for several layers): they must share one format
FUSED_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


class QuantizationError(ValueError):
    """An unknown scheme, or a checkpoint whose quantization this host cannot serve."""


def check_scheme(name: str) -> str:
    """``name`` if it is a scheme of :data:`SCHEMES`; otherwise an error naming it and the supported ones."""
    if name not in SCHEMES:
        raise QuantizationError(f"quantization {name!r} is not supported; supported: {', '.join(SCHEMES)}")
    return name


def linear_names(num_layers: int) -> list[str]:
    """HF weight names of every decoder linear layer the schemes quantize."""
    return [f"model.layers.{i}.{s}.weight" for i in range(num_layers) for s in LINEAR_SUFFIXES]
