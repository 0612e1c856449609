"""HF checkpoints quantized by compressed-tensors (llm-compressor's output), int8 formats.

``config.json`` carries ``quantization_config`` with ``quant_method: "compressed-tensors"``,
a ``format`` and ``config_groups`` whose ``weights`` / ``input_activations`` say the bits,
strategy and whether activations are dynamic. A quantized layer ``P`` stores ``P.weight``
(int8 for ``int-quantized``; int8 values in a float dtype for ``naive-quantized``),
``P.weight_scale`` (``[n, 1]`` per channel or ``[1]`` per tensor) and optionally
``P.weight_zero_point``, meaning ``W = (q - zero_point) * scale``; static activations add
``P.input_scale`` (and ``P.input_zero_point``).

Read here: 8-bit integer weights per channel or per tensor, with no, dynamic per-token or
static per-tensor activations. ``pack-quantized`` (4-bit values packed into int32),
float8 formats, grouped strategies and sparsity compressors are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..backends.int8 import Int8Matrix
from .schemes import QuantizationError

SUPPORTED_FORMATS = ("int-quantized", "naive-quantized")


def find_config(directory: Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of a compressed-tensors checkpoint, or None when it is not one."""
    cfg_path = directory / "config.json"
    if not cfg_path.exists():
        return None
    qc = json.loads(cfg_path.read_text()).get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        return qc
    return None


def _group_act(group: dict[str, Any], name: str) -> str:
    """How a config group treats its input: none, dynamic or static (refusing what it cannot serve)."""
    weights = group.get("weights") or {}
    bits, kind = weights.get("num_bits", 8), weights.get("type", "int")
    strategy = weights.get("strategy", "channel")
    if bits != 8 or kind != "int" or strategy not in ("channel", "tensor"):
        raise QuantizationError(
            f"compressed-tensors group {name!r}: weights of {bits}-bit {kind} with strategy {strategy!r} are not "
            "supported; supported: 8-bit int, strategy channel or tensor"
        )
    acts = group.get("input_activations")
    if not acts:
        return "none"
    if acts.get("num_bits", 8) != 8 or acts.get("type", "int") != "int":
        raise QuantizationError(
            f"compressed-tensors group {name!r}: {acts.get('num_bits')}-bit {acts.get('type')} activations are not "
            "supported; supported: none or 8-bit int"
        )
    return "dynamic" if acts.get("dynamic") else "static"


def check_config(qc: dict[str, Any]) -> dict[str, str]:
    """Refuse what this host cannot read; return each config group's activation treatment."""
    fmt = qc.get("format", "int-quantized")
    if fmt not in SUPPORTED_FORMATS:
        raise QuantizationError(
            f"compressed-tensors format {fmt!r} is not supported; supported: {', '.join(SUPPORTED_FORMATS)}"
        )
    if qc.get("sparsity_config"):
        raise QuantizationError("compressed-tensors sparsity_config is not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise QuantizationError("compressed-tensors quantization_config has no config_groups")
    return {name: _group_act(g, name) for name, g in groups.items()}


def read(qc: dict[str, Any], raw: dict[str, torch.Tensor]) -> dict[str, Int8Matrix]:
    """Take every quantized layer (a ``.weight`` with a ``.weight_scale``) out of ``raw`` as an int8 matrix."""
    acts = set(check_config(qc).values())
    if len(acts) > 1:
        raise QuantizationError(f"compressed-tensors groups mix activation treatments {sorted(acts)}; one is supported")
    act = acts.pop()
    out: dict[str, Int8Matrix] = {}
    for name in [n for n in raw if n.endswith(".weight")]:
        prefix = name[: -len(".weight")]
        if prefix + ".weight_scale" not in raw:
            continue
        codes = raw.pop(name).round().clamp(-128, 127).to(torch.int8)
        n = codes.shape[0]
        scale = raw.pop(prefix + ".weight_scale").float().reshape(-1).expand(n).contiguous()
        zp = raw.pop(prefix + ".weight_zero_point", None)
        offset = None if zp is None or not bool(zp.any()) else zp.float().reshape(-1).expand(n).contiguous()
        input_scale = input_offset = None
        if act == "static":
            input_scale = float(raw.pop(prefix + ".input_scale").float().reshape(-1)[0])
            izp = raw.pop(prefix + ".input_zero_point", None)
            input_offset = float(izp.float().reshape(-1)[0]) if izp is not None else 0.0
        out[name] = Int8Matrix(codes, scale, offset, act, input_scale, input_offset)
    return out
