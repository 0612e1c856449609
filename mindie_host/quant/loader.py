"""What a quantization scheme does to a model's weights at load time.

:func:`int8_matrices` takes the loaded weights (float32 under HF names) and returns the
matrices to serve in int8, by HF name, taking them out of the float weights:

- an int8 checkpoint (msModelSlim's or compressed-tensors') gives its layers as stored;
  ``auto`` keeps each layer's own activation treatment, ``w8a16`` serves them weight-only,
  ``w8a8`` quantizes the input of weight-only layers per token, ``none`` dequantizes them;
- a floating-point model under ``w8a16`` / ``w8a8`` has its decoder linear layers quantized
  per output channel here (no calibration: ``mindie-host quantize`` writes a calibrated,
  smoothed ``w8a8`` checkpoint); the embedding and LM head stay in floating point.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends.int8 import Int8Matrix, quantize_per_channel
from ..models.weights import ModelSource
from . import compressed_tensors, msmodelslim
from .schemes import FUSED_GROUPS, QuantizationError, check_scheme, linear_names


def checkpoint_format(source: ModelSource) -> tuple[str, dict[str, Any]] | None:
    """``("msmodelslim" | "compressed-tensors", its description)`` for an int8 checkpoint; None otherwise."""
    if source.kind != "hf":
        return None
    desc = msmodelslim.find_description(source.directory)
    if desc is not None:
        return "msmodelslim", desc
    qc = compressed_tensors.find_config(source.directory)
    if qc is not None:
        return "compressed-tensors", qc
    return None


def smoothed_checkpoint(source: ModelSource) -> bool:
    """Whether ``source`` is an msModelSlim checkpoint with smoothed (anti-outlier, ``.module.``) norms."""
    found = checkpoint_format(source)
    return found is not None and found[0] == "msmodelslim" and any(".module." in k for k in found[1])


def read_raw(source: ModelSource) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory in its stored dtype (int8 codes, int64 scales stay exact)."""
    from safetensors import safe_open

    from ..models.weights import _safetensor_files

    out: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(source.directory):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                out[key] = st.get_tensor(key)
    return out


def _scheme_act(scheme: str, m: Int8Matrix) -> str:
    if scheme == "w8a16":
        return "none"
    if scheme == "w8a8":
        return "static" if m.act == "static" else "dynamic"
    if scheme == "none":
        return "float"
    return m.act


def int8_matrices(
    source: ModelSource, num_layers: int, weights: dict[str, torch.Tensor], scheme: str
) -> dict[str, Int8Matrix]:
    """The int8 matrices to serve under ``scheme``, taken out of ``weights`` (see the module docstring)."""
    check_scheme(scheme)
    found = checkpoint_format(source)
    matrices: dict[str, Int8Matrix] = {}
    if found is not None:
        fmt, desc = found
        raw = read_raw(source)
        matrices = msmodelslim.read(desc, raw) if fmt == "msmodelslim" else compressed_tensors.read(desc, raw)
        for name in list(weights):
            if name not in raw:
                weights.pop(name)  # taken out as int8, or a scale/offset tensor
        for name, tensor in raw.items():  # renamed (smoothed norms) or float tensors
            if name not in weights:
                weights[name] = tensor.float()
        for m in matrices.values():
            m.act = _scheme_act(scheme, m)
    elif scheme in ("w8a16", "w8a8"):
        act = "none" if scheme == "w8a16" else "dynamic"
        for name in linear_names(num_layers):
            if name in weights:
                matrices[name] = quantize_per_channel(weights.pop(name), act)
    _settle(matrices, weights, num_layers)
    return matrices


def _settle(matrices: dict[str, Int8Matrix], weights: dict[str, torch.Tensor], num_layers: int) -> None:
    """Keep only what the model can serve in int8: fused groups share one format, the rest goes back to float."""
    allowed = set(linear_names(num_layers))
    for name in list(matrices):
        if name not in allowed or (matrices[name].act == "float" and matrices[name].bias is None):
            _to_float(name, matrices, weights)
    for i in range(num_layers):
        for group in FUSED_GROUPS:
            names = [f"model.layers.{i}.{s}.weight" for s in group]
            present = [n for n in names if n in matrices]
            acts = {matrices[n].act for n in present}
            if present and (len(present) < len(names) or len(acts) > 1):
                if any(matrices[n].bias is not None for n in present):
                    raise QuantizationError(f"layer {i}: {', '.join(names)} mix quantized and float forms")
                for n in present:
                    _to_float(n, matrices, weights)


def _to_float(name: str, matrices: dict[str, Int8Matrix], weights: dict[str, torch.Tensor]) -> None:
    m = matrices.pop(name)
    if m.bias is not None:
        raise QuantizationError(f"{name}: a folded norm bias needs an int8 layer")
    weights[name] = m.dequantize()
