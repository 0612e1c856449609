"""``mindie-host quantize``: an HF directory (or GGUF file) to a w8a16 or w8a8 checkpoint in MindIE's format.

1. **Calibration.** The floating-point model runs over a small local text (the packaged
   :data:`~mindie_host.quant.calibration.CALIBRATION_TEXT` or ``--calib-file``) on a
   :class:`CalibrationPlatform`, which records the per-channel minimum and maximum of every
   linear layer's input.
2. **Smoothing** (w8a8). The input channels that carry outliers make per-token int8
   activations coarse; SmoothQuant's migration divides channel ``j`` of the input by
   ``s_j = max|X_j|^a / max|W_j|^(1-a)`` and multiplies the weights' column ``j`` by it, so the
   product is unchanged. The division is folded into what produces the input: the RMSNorm
   weight for QKV and gate/up (written as ``N.module.weight``, msModelSlim's anti-outlier name),
   the up projection's rows for down.
3. **Quantization.** Each decoder linear layer becomes int8 codes with one symmetric scale per
   output channel. ``w8a16`` layers are ``W8A16``, ``w8a8`` layers ``W8A8_DYNAMIC`` (per-token
   activations at run time) or, with ``static=True``, ``W8A8`` with the calibrated per-tensor
   ``input_scale`` / ``input_offset``, ``deq_scale`` and ``quant_bias``. The embedding and LM
   head stay in floating point (``FLOAT``), as msModelSlim leaves them.
4. **Output.** ``quant_model_weights.safetensors``, ``quant_model_description.json``,
   ``config.json`` and the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..backends.base import ModelInput
from ..backends.int8 import quantize_per_channel
from ..backends.linear import LazyDense
from ..backends.platform import Platform
from ..models.weights import LlamaArch, ModelSource, iter_weights, load_arch, resolve_model
from . import msmodelslim
from .calibration import CALIBRATION_TEXT
from .schemes import FUSED_GROUPS, LINEAR_SUFFIXES, QuantizationError

QUANTIZE_SCHEMES = ("w8a16", "w8a8")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


@dataclass
class ChannelStats:
    """Per-input-channel minimum and maximum of a linear layer's input, over the calibration tokens."""

    lo: torch.Tensor
    hi: torch.Tensor
    tokens: int = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.lo = torch.minimum(self.lo, x.amin(dim=0))
        self.hi = torch.maximum(self.hi, x.amax(dim=0))
        self.tokens += x.shape[0]

    @property
    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.lo.abs(), self.hi.abs())


class CalibrationPlatform(Platform):
    """The CPU platform with plain fp32 products that records the input range of each one."""

    def __init__(self) -> None:
        self.stats: dict[int, ChannelStats] = {}

    def prepare_linear(self, weight: Any, stored: Any = None) -> Any:
        return weight() if isinstance(weight, LazyDense) else weight

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None,
               prompt_rows: Any = None) -> torch.Tensor:
        st = self.stats.get(id(weight))
        if st is None:
            inf = torch.full((x.shape[-1],), float("inf"))
            st = self.stats[id(weight)] = ChannelStats(inf.clone(), -inf)
        st.update(x)
        return F.linear(x, weight, bias)


@dataclass
class QuantizeReport:
    """What :func:`quantize_model` wrote."""

    out: Path
    scheme: str
    calibration_tokens: int
    quantized_layers: int
    float_layers: list[str] = field(default_factory=list)
    bytes_written: int = 0


def calibration_token_ids(source: ModelSource, text: str, seq_len: int = 256, max_tokens: int = 2048) -> list[list[int]]:
    """The calibration text as token-id chunks of at most ``seq_len`` tokens, ``max_tokens`` in all."""
    from ..tokenizer import load_tokenizer

    ids = list(load_tokenizer(source).encode(text, add_special_tokens=False))[:max_tokens]
    if len(ids) < 16:
        raise QuantizationError(f"the calibration text has {len(ids)} tokens; at least 16 are needed")
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i : i + seq_len]) >= 2]


def calibrate(source: ModelSource, chunks: list[list[int]]) -> dict[str, ChannelStats]:
    """Input ranges of every decoder product, by fused product name (``model.layers.3.qkv`` ...)."""
    from ..backends.torch.backend import TorchBackend

    platform = CalibrationPlatform()
    backend = TorchBackend(source, name="calibration", dtype="float32", quantization="none", platform=platform)
    backend.load()
    block = 16
    longest = max(len(c) for c in chunks)
    blocks = -(-longest // block)
    backend.allocate_kv_cache(blocks + 1, block)
    for chunk in chunks:
        n = len(chunk)
        backend.execute(ModelInput(
            input_ids=chunk, positions=list(range(n)), query_lens=[n], context_lens=[n],
            block_tables=[list(range(1, blocks + 1))], logits_indices=[n - 1], row_variants=[-1],
        ))
    assert backend.model is not None
    out: dict[str, ChannelStats] = {}
    for i, layer in enumerate(backend.model.layers):
        products = {"qkv": layer.attn.qkv, "o_proj": layer.attn.o_proj, "gate_up": layer.mlp.gate_up,
                    "down": layer.mlp.down}
        for part, weight in products.items():
            out[f"model.layers.{i}.{part}"] = platform.stats[id(weight)]
    backend.shutdown()
    return out


def _smooth(weights: dict[str, torch.Tensor], arch: LlamaArch, stats: dict[str, ChannelStats], alpha: float) -> None:
    """SmoothQuant migration folded into the norms (QKV, gate/up) and the up projection (down), in place."""
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        pairs = (
            ("qkv", [p + s + ".weight" for s in FUSED_GROUPS[0]], [p + "input_layernorm.weight"]),
            ("gate_up", [p + s + ".weight" for s in FUSED_GROUPS[1]], [p + "post_attention_layernorm.weight"]),
            ("down", [p + "mlp.down_proj.weight"], None),
        )
        for part, consumers, norms in pairs:
            x_max = stats[p + part].absmax.clamp_min(1e-5)
            w_max = torch.stack([weights[n].abs().amax(dim=0) for n in consumers]).amax(dim=0).clamp_min(1e-5)
            s = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(1e-2, 1e2)
            for n in consumers:
                weights[n] = weights[n] * s
            if norms is not None:
                for n in norms:
                    weights[n] = weights[n] / s
            else:  # down's input is silu(gate) * up: scale up's rows
                weights[p + "mlp.up_proj.weight"] = weights[p + "mlp.up_proj.weight"] / s[:, None]
            st = stats[p + part]
            lo, hi = st.lo / s, st.hi / s
            st.lo, st.hi = torch.minimum(lo, hi), torch.maximum(lo, hi)


def _static_params(st: ChannelStats) -> tuple[float, float]:
    """Per-tensor asymmetric int8 activation scale and offset covering the calibrated range (and 0)."""
    lo = min(float(st.lo.min()), 0.0)
    hi = max(float(st.hi.max()), 0.0)
    scale = max(hi - lo, 1e-8) / 255
    offset = float(np.clip(round(-128 - lo / scale), -128, 127))
    return scale, offset


def _hf_config(source: ModelSource, arch: LlamaArch) -> dict[str, Any]:
    if source.kind == "hf":
        cfg = json.loads((source.directory / "config.json").read_text())
        cfg.pop("quantization_config", None)
        return cfg
    model_type = "llama" if arch.model_type in ("llama", "smollm") else arch.model_type
    return {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[model_type]],
        "model_type": model_type, "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "vocab_size": arch.vocab_size,
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta, "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings, "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_bias": arch.attention_bias, "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1 else arch.eos_token_ids,
        "torch_dtype": "float32",
    }


def _copy_tokenizer(source: ModelSource, out: Path) -> None:
    if source.kind == "hf":
        for name in _TOKENIZER_FILES:
            if (source.directory / name).exists():
                shutil.copy2(source.directory / name, out / name)
        return
    from ..tokenizer import load_tokenizer

    load_tokenizer(source).save_pretrained(str(out))


def quantize_model(
    model: str | Path,
    scheme: str,
    out: str | Path,
    *,
    calib_text: str | None = None,
    alpha: float = 0.5,
    smooth: bool = True,
    static: bool = False,
    float_layers: tuple[str, ...] = (),
    max_calib_tokens: int = 2048,
) -> QuantizeReport:
    """Write ``model`` quantized with ``scheme`` into ``out`` (see the module docstring).

    ``smooth=False`` skips the w8a8 smoothing (a checkpoint LoRA adapters of the original model
    still apply to). ``float_layers`` names layers (HF prefixes such as ``model.layers.0.mlp.down_proj``) kept
    in floating point (``FLOAT``); a fused group (QKV, gate/up) must be named whole.
    """
    if scheme not in QUANTIZE_SCHEMES:
        raise QuantizationError(f"scheme {scheme!r} is not supported; supported: {', '.join(QUANTIZE_SCHEMES)}")
    source = resolve_model(model)
    arch = load_arch(source)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise QuantizationError(f"output directory {str(out)!r} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: torch.from_numpy(np.array(a, dtype=np.float32)) for name, a in iter_weights(source, arch)}
    chunks = calibration_token_ids(source, calib_text or CALIBRATION_TEXT, max_tokens=max_calib_tokens)
    stats = calibrate(source, chunks)
    smooth = smooth and scheme == "w8a8"
    if smooth:
        _smooth(weights, arch, stats, alpha)
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    layer_type = "W8A16" if scheme == "w8a16" else "W8A8" if static else "W8A8_DYNAMIC"
    kept = {f.removesuffix(".weight") for f in float_layers}
    quantized = 0
    part_of = {s: part for part, group in (("qkv", FUSED_GROUPS[0]), ("gate_up", FUSED_GROUPS[1]),
                                           ("o_proj", ("self_attn.o_proj",)), ("down", ("mlp.down_proj",)))
               for s in group}
    for name, w in weights.items():
        prefix = name.removesuffix(".weight")
        layer, _, suffix = prefix.partition(".self_attn.") if ".self_attn." in prefix else prefix.partition(".mlp.")
        full_suffix = ("self_attn." if ".self_attn." in prefix else "mlp.") + suffix
        if not name.endswith(".weight") or full_suffix not in LINEAR_SUFFIXES or prefix in kept:
            tensors[name] = w
            continue
        m = quantize_per_channel(w)
        n = m.codes.shape[0]
        tensors[name] = m.codes
        types[name] = layer_type
        if layer_type == "W8A8":
            in_scale, in_offset = _static_params(stats[f"{layer}.{part_of[full_suffix]}"])
            extra = {
                ".input_scale": torch.tensor([in_scale], dtype=torch.float32),
                ".input_offset": torch.tensor([in_offset], dtype=torch.float32),
                ".deq_scale": (m.scale * in_scale).float(),
                ".quant_bias": torch.round(-in_offset * m.codes.float().sum(dim=1)).to(torch.int32),
            }
        else:
            extra = {".weight_scale": m.scale.reshape(n, 1).float(), ".weight_offset": torch.zeros(n, 1)}
        for key, t in extra.items():
            tensors[prefix + key] = t
            types[prefix + key] = layer_type
        quantized += 1
    if smooth:  # smoothed norms carry msModelSlim's anti-outlier name
        for name in [n for n in tensors if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))]:
            smoothed = name.replace("layernorm.weight", "layernorm.module.weight")
            tensors[smoothed] = tensors.pop(name)
            types[smoothed] = layer_type
    msmodelslim.write(out, tensors, types, layer_type)
    (out / "config.json").write_text(json.dumps(_hf_config(source, arch), indent=2) + "\n")
    _copy_tokenizer(source, out)
    return QuantizeReport(
        out=out, scheme=scheme, calibration_tokens=sum(len(c) for c in chunks), quantized_layers=quantized,
        float_layers=sorted(kept), bytes_written=sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
    )

