"""MindIE's quantized checkpoint format, as msModelSlim writes it.

A directory holds the HF ``config.json`` and tokenizer, safetensors files and a
``quant_model_description.json`` (older tools name it ``quant_model_description_w8a8.json``
and so on; MindIE Turbo puts the same map under ``quantization_config`` in ``config.json``).
The description maps every tensor name to the type of its layer, plus
``model_quant_type``, the model's overall type. Per layer ``P`` of ``[n, k]``:

- ``FLOAT``: ``P.weight`` in floating point;
- ``W8A16`` and ``W8A8_DYNAMIC``: ``P.weight`` int8, ``P.weight_scale`` and ``P.weight_offset``
  ``[n, 1]``, meaning ``W = (q - offset) * scale``; W8A8_DYNAMIC quantizes activations per token;
- ``W8A8`` (static): ``P.weight`` int8, ``P.input_scale`` / ``P.input_offset`` ``[1]`` (the calibrated
  activation quantizer), ``P.deq_scale`` ``[n]`` (``input_scale * weight_scale``; float32, or int64
  holding float32 bits for float16 models) and ``P.quant_bias`` int32 ``[n]`` (the offset's
  correction plus the layer's bias in product units).

Anti-outlier smoothing stores a norm as ``N.module.weight`` (and ``N.module.bias`` when it
adds one). :func:`read` turns all this into :class:`~mindie_host.backends.int8.Int8Matrix`
objects; :func:`write` produces the format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..backends.int8 import Int8Matrix
from .schemes import QuantizationError

#: the file names msModelSlim has used for the description
DESCRIPTION_GLOB = "quant_model_description*.json"
DESCRIPTION_NAME = "quant_model_description.json"
WEIGHTS_NAME = "quant_model_weights.safetensors"

#: layer types this host reads, and how each one's input is treated
LAYER_TYPES = {"FLOAT": "float", "W8A16": "none", "W8A8_DYNAMIC": "dynamic", "W8A8": "static"}
#: norms whose anti-outlier bias is folded into the products that read them
NORM_CONSUMERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
_METADATA_KEYS = {"model_quant_type", "version", "group_size", "kv_quant_type", "kv_cache_type", "fa_quant_type",
                  "reduce_quant_type", "metadata", "optional"}


def find_description(directory: Path) -> dict[str, Any] | None:
    """The description map of an msModelSlim directory, or None when the directory is not one."""
    files = sorted(directory.glob(DESCRIPTION_GLOB))
    if files:
        try:
            data = json.loads(files[0].read_text())
        except (OSError, ValueError) as exc:
            raise QuantizationError(f"{files[0].name}: unreadable: {exc}") from exc
        if not isinstance(data, dict):
            raise QuantizationError(f"{files[0].name}: must be a JSON object of tensor name -> quant type")
        return data
    cfg_path = directory / "config.json"
    if cfg_path.exists():
        qc = json.loads(cfg_path.read_text()).get("quantization_config")
        if isinstance(qc, dict) and "model_quant_type" in qc:
            return qc
    return None


def check_description(desc: dict[str, Any]) -> None:
    """Refuse a description with a type this host cannot serve, naming the tensor, the type and the supported ones."""
    allowed = ", ".join(LAYER_TYPES)
    for name, kind in desc.items():
        if name in _METADATA_KEYS or not isinstance(kind, str):
            continue
        if kind not in LAYER_TYPES:
            raise QuantizationError(
                f"quant_model_description: {name} is quantized as {kind!r}, which is not supported; supported: {allowed}"
            )
    kv = desc.get("kv_quant_type") or desc.get("kv_cache_type")
    if kv not in (None, "", "FLOAT"):
        raise QuantizationError(
            f"quant_model_description: kv_quant_type {kv!r} (a calibrated KV cache) is not supported; "
            "use kvCacheDtype: int8, which quantizes the cache at run time"
        )


def _deq_scale(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:  # float32 bits in the low 32 bits (the float16 form)
        return (t & 0xFFFFFFFF).to(torch.int32).view(torch.float32).reshape(-1)
    return t.float().reshape(-1)


def read(desc: dict[str, Any], raw: dict[str, torch.Tensor]) -> dict[str, Int8Matrix]:
    """Take the quantized layers out of ``raw`` (all tensors, in their stored dtypes) as int8 matrices.

    Their tensors are removed from ``raw``; smoothed norms are renamed to their plain
    names, and a norm's bias becomes the ``bias`` of the matrices that read the norm.
    """
    check_description(desc)
    out: dict[str, Int8Matrix] = {}
    for name in [n for n in raw if n.endswith(".weight")]:
        kind = desc.get(name, "FLOAT")
        act = LAYER_TYPES.get(kind, "float")
        prefix = name[: -len(".weight")]
        if act == "float" or raw[name].dtype != torch.int8:  # float layers, and norms typed by their layer
            continue
        codes = raw.pop(name).to(torch.int8)
        n = codes.shape[0]
        if act == "static":
            input_scale = float(raw.pop(prefix + ".input_scale").float().reshape(-1)[0])
            input_offset = float(raw.pop(prefix + ".input_offset").float().reshape(-1)[0])
            deq = _deq_scale(raw.pop(prefix + ".deq_scale"))
            qbias = raw.pop(prefix + ".quant_bias").to(torch.float64).reshape(-1)
            scale = deq / input_scale
            # what quant_bias holds beyond the offset's correction is the layer's own bias
            rest = qbias + input_offset * codes.to(torch.float64).sum(dim=1)
            bias = (rest * deq.double()).float() if bool(rest.abs().gt(0.5).any()) else None
            out[name] = Int8Matrix(codes, scale.float(), None, "static", input_scale, input_offset, bias)
            continue
        scale = raw.pop(prefix + ".weight_scale").float().reshape(n)
        offset_t = raw.pop(prefix + ".weight_offset", None)
        offset = None if offset_t is None or not bool(offset_t.any()) else offset_t.float().reshape(n)
        out[name] = Int8Matrix(codes, scale, offset, act)
    for key in [k for k in raw if ".module." in k]:  # smoothed norms
        plain = key.replace(".module.", ".")
        if plain.endswith(".weight"):
            raw[plain] = raw.pop(key)
        else:  # the norm's bias: fold it into the products that read this norm
            bias = raw.pop(key).float()
            layer, norm, _ = plain.rsplit(".", 2)
            for suffix in NORM_CONSUMERS.get(norm, ()):
                target = f"{layer}.{suffix}.weight"
                m = out.get(target)
                if m is None:
                    raise QuantizationError(
                        f"{key}: a smoothed norm's bias feeds {target}, which is stored as FLOAT; "
                        "only quantized layers can take the folded bias"
                    )
                folded = m.dequantize() @ bias
                m.bias = folded if m.bias is None else m.bias + folded
    return out


def write(directory: Path, tensors: dict[str, torch.Tensor], types: dict[str, str], model_type: str) -> None:
    """Write ``tensors`` and their description (tensor name -> layer type; missing = FLOAT) into ``directory``."""
    from safetensors.torch import save_file

    desc: dict[str, Any] = {"model_quant_type": model_type, "version": "1.0.0"}
    for name in sorted(tensors):
        desc[name] = types.get(name, "FLOAT")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    (directory / DESCRIPTION_NAME).write_text(json.dumps(desc, indent=2) + "\n")
