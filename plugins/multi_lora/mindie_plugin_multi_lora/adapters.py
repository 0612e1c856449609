"""Reading and checking PEFT LoRA adapters against the base model's shapes.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
optional ``use_rslora``, ``alpha_pattern``) and ``adapter_model.safetensors`` with
keys ``base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight``
(shape ``[r, in]``) and ``...lora_B.weight`` (``[out, r]``). Anything that does not
fit the base model is refused with an :class:`AdapterError` naming the adapter,
the key and the reason.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Module name -> (parent block, input feature dim name, output feature dim name).
MODULES: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attn", "hidden", "q"),
    "k_proj": ("self_attn", "hidden", "kv"),
    "v_proj": ("self_attn", "hidden", "kv"),
    "o_proj": ("self_attn", "q", "hidden"),
    "gate_proj": ("mlp", "hidden", "inter"),
    "up_proj": ("mlp", "hidden", "inter"),
    "down_proj": ("mlp", "inter", "hidden"),
}

#: Module name -> the fused projection of the backend's per-row deltas that carries it.
PROJECTIONS: dict[str, str] = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
                               "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+)\.(?P<module>[A-Za-z_]+)"
    r"\.lora_(?P<ab>[AB])(?:\.[A-Za-z0-9_]+)?\.weight$"
)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9._/-]{1,256}$")
NAME_RULE = "1 to 256 characters from letters, digits, '.', '-', '_' and '/'"


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the adapter, the key and the reason."""

    def __init__(self, adapter: str, key: str, reason: str) -> None:
        self.adapter = adapter
        self.key = key
        self.reason = reason
        super().__init__(f"LoRA adapter {adapter!r}: {key}: {reason}")


@dataclass(frozen=True)
class ModelDims:
    """The base model's projection sizes that adapters must match."""

    num_layers: int
    hidden: int
    q: int
    kv: int
    inter: int
    #: where the backend's per-row deltas do not reach: projection (``qkv``, ``o``, ``gate_up``, ``down``) ->
    #: {layer: why} (``ModelInfo.extra["delta_gaps"]``: a mixture of experts' MLP, latent attention)
    gaps: dict[str, dict[int, str]] = field(default_factory=dict)

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module."""
        _, fin, fout = MODULES[module]
        return getattr(self, fin), getattr(self, fout)

    @classmethod
    def from_info(cls, info: Any) -> ModelDims:
        """From the host's :class:`~mindie_host.api.ModelInfo`."""
        extra = info.extra
        return cls(
            num_layers=int(info.num_layers),
            hidden=int(extra["hidden_size"]),
            q=int(extra["num_heads"]) * int(info.head_dim),
            kv=int(info.num_kv_heads) * int(info.head_dim),
            inter=int(extra["intermediate_size"]),
            gaps={proj: {int(layer): str(why) for layer, why in layers.items()}
                  for proj, layers in (extra.get("delta_gaps") or {}).items()},
        )

    def gap(self, layer: int, module: str) -> str | None:
        """Why layer ``layer``'s ``module`` (``q_proj`` ... ``down_proj``) takes no delta; None when it does."""
        return self.gaps.get(PROJECTIONS[module], {}).get(layer)


@dataclass
class LoraAdapter:
    """One adapter in host memory: per (layer, module) ``A`` [r, in] and scaled ``B`` [out, r] (float32, CPU)."""

    name: str
    path: str
    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    generation: int = 0

    @property
    def modules(self) -> list[str]:
        """Target modules this adapter touches, in canonical order."""
        present = {m for _, m in self.weights}
        return [m for m in MODULES if m in present]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def check_name(name: Any) -> str:
    """An adapter name as the spec allows it (<= 256 chars, letters/digits/``._-/``)."""
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise AdapterError(str(name), "name", f"adapter names must be {NAME_RULE}")
    return name


def _pattern_value(patterns: dict[str, Any], module_key: str, default: float) -> float:
    """PEFT's ``alpha_pattern`` lookup: a key matches a module name ending in ``.<key>``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_key):
            return float(value)
    return default


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    cfg_path = directory / "adapter_config.json"
    if not cfg_path.is_file():
        raise AdapterError(name, "adapter_config.json", f"not found in {directory}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(name, "adapter_config.json", f"unreadable: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(name, "adapter_config.json", "must be a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, "adapter_config.json peft_type", f"{peft_type!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise AdapterError(name, "adapter_config.json use_dora", "DoRA adapters are not supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(name, f"adapter_config.json {key}", f"must be a positive number, got {value!r}")
    return cfg


def load_adapter(name: str, path: str | Path, dims: ModelDims, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT adapter; raises :class:`AdapterError` on any mismatch."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_name(name)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise AdapterError(name, "path", f"{str(directory)!r} is not a directory")
    cfg = _read_config(name, directory)
    weights_path = directory / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise AdapterError(name, "adapter_model.safetensors", f"not found in {directory}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(name, "adapter_model.safetensors", f"unreadable: {exc}") from exc
    if not tensors:
        raise AdapterError(name, "adapter_model.safetensors", "holds no tensors")
    alpha = float(cfg["lora_alpha"])
    alpha_pattern = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key in sorted(tensors):
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(
                name, key, "unknown module: only lora_A/lora_B of q, k, v, o, gate, up and down projections are supported"
            )
        module, parent = m.group("module"), m.group("parent")
        if module not in MODULES or MODULES[module][0] != parent:
            raise AdapterError(
                name, key, f"unknown module {parent}.{module}: supported are {', '.join(MODULES)} (self_attn / mlp)"
            )
        layer = int(m.group("layer"))
        if layer >= dims.num_layers:
            raise AdapterError(name, key, f"layer {layer} does not exist (the base model has layers 0-{dims.num_layers - 1})")
        gap = dims.gap(layer, module)
        if gap is not None:
            raise AdapterError(name, key, f"layer {layer}'s {module} cannot be adapted: {gap}")
        pairs.setdefault((layer, module), {})[m.group("ab")] = tensors[key]

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_seen = 0
    for (layer, module), ab in sorted(pairs.items()):
        stem = f"base_model.model.model.layers.{layer}.{MODULES[module][0]}.{module}"
        for part in "AB":
            if part not in ab:
                raise AdapterError(name, f"{stem}.lora_{part}.weight", "missing (lora_A and lora_B come in pairs)")
        a, b = ab["A"], ab["B"]
        fin, fout = dims.features(module)
        if a.dim() != 2 or b.dim() != 2:
            raise AdapterError(name, f"{stem}.lora_A.weight", "lora_A and lora_B must be 2-D matrices")
        r = int(a.shape[0])
        if tuple(a.shape) != (r, fin):
            raise AdapterError(
                name, f"{stem}.lora_A.weight", f"wrong shape {list(a.shape)}; the base model needs [r, {fin}]"
            )
        if tuple(b.shape) != (fout, r):
            raise AdapterError(
                name, f"{stem}.lora_B.weight", f"wrong shape {list(b.shape)}; the base model needs [{fout}, {r}]"
            )
        if r > max_rank:
            raise AdapterError(
                name, f"{stem}.lora_A.weight", f"rank {r} exceeds the configured maximum maxLoraRank={max_rank}"
            )
        module_alpha = _pattern_value(alpha_pattern, f"model.layers.{layer}.{MODULES[module][0]}.{module}", alpha)
        scaling = module_alpha / (math.sqrt(r) if rslora else r)
        a32 = a.detach().to(torch.float32).contiguous()
        b32 = (b.detach().to(torch.float32) * scaling).contiguous()
        if not (torch.isfinite(a32).all() and torch.isfinite(b32).all()):
            raise AdapterError(name, f"{stem}.lora_A.weight", "holds NaN or infinite values")
        weights[(layer, module)] = (a32, b32)
        max_seen = max(max_seen, r)
    return LoraAdapter(name=name, path=str(directory), rank=max_seen, alpha=alpha, weights=weights)


def read_adapter_list(model_dir: Path) -> dict[str, str]:
    """``lora_adapter.json`` in the base model directory (``{}`` when absent); relative paths resolve against it."""
    listing = model_dir / "lora_adapter.json"
    if not listing.is_file():
        return {}
    try:
        data = json.loads(listing.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError("lora_adapter.json", str(listing), f"unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise AdapterError("lora_adapter.json", str(listing), 'must be a JSON object {"name": "path", ...}')
    out: dict[str, str] = {}
    for name, path in data.items():
        check_name(name)
        if not isinstance(path, str) or not path:
            raise AdapterError(name, str(listing), f"the path must be a non-empty string, got {path!r}")
        p = Path(path).expanduser()
        out[name] = str(p if p.is_absolute() else model_dir / p)
    return out
