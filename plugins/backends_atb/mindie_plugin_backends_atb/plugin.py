"""Hook implementations of the ``atb`` plugin (entry point ``atb`` in group ``mindie_host.plugins``).

Importing this module needs neither torch_npu nor an NPU; asking for the backend does.
"""

from __future__ import annotations

import logging
from typing import Any

from mindie_host import hookimpl
from mindie_host.api import DEFAULT_MODEL_NAME, BackendContext, HostContext, default_model_path, resolve_model

from .backend import DEFAULT_MEMORY_FRACTION, AtbBackend
from .platform import NpuPlatform, load_torch_npu

BACKEND_TYPE = "atb"
OPTION_KEYS = ("memoryFraction",)


def _options(config: Any) -> Any:
    return (getattr(config, "Plugins", None) or {}).get(BACKEND_TYPE, {})


@hookimpl
def mindie_host_backend_types(ctx: BackendContext) -> list[str]:
    """This plugin serves ``backendType: "atb"``."""
    return [BACKEND_TYPE]


@hookimpl
def mindie_host_validate_config(ctx: HostContext) -> list[str]:
    """Refuse what the NPU path cannot do: another device, float32, unknown options (worldSize > 1: a warning)."""
    config, model_config = ctx.config, ctx.model
    if model_config.backendType != BACKEND_TYPE:
        return []
    errors: list[str] = []
    if model_config.device not in ("auto", "npu"):
        errors.append(f"ModelConfig.device is {model_config.device!r} but backendType 'atb' runs on an Ascend NPU; "
                      "allowed: \"auto\" or \"npu\"")
    if model_config.dtype not in ("auto", "float16", "bfloat16"):
        errors.append(f"ModelConfig.dtype is {model_config.dtype!r}; backendType 'atb' uses torch_npu fused "
                      "attention, which takes float16 or bfloat16; allowed: \"auto\" (float16), \"float16\", "
                      "\"bfloat16\"")
    if model_config.worldSize != 1:
        logging.getLogger("mindie_host.plugins.atb").warning(
            "ModelConfig.worldSize is %d: tensor parallelism over HCCL on backendType 'atb' is written to torch_npu's "
            "API (torch.npu.set_device per rank, the 'hccl' process group) and unverified: no NPU was available "
            "where it was built", model_config.worldSize)
    if model_config.quantization not in ("auto", "none"):
        errors.append(f"ModelConfig.quantization is {model_config.quantization!r}; backendType 'atb' has no int8 "
                      "kernels in this version; allowed: \"auto\" or \"none\"")
    if model_config.kvCacheDtype != "auto":
        errors.append(f"ModelConfig.kvCacheDtype is {model_config.kvCacheDtype!r}; backendType 'atb' keeps its KV "
                      "cache in the weights' dtype; allowed: \"auto\"")
    if model_config.compile:
        errors.append("ModelConfig.compile is true; backendType 'atb' runs its decode steps eagerly through "
                      "torch_npu's fused operators (no torch.compile or NPU graph capture in this version); "
                      "allowed: false")
    section = _options(config)
    if not isinstance(section, dict):
        return [*errors, f"Plugins.atb must be a JSON object, got {section!r}"]
    for key in section:
        if key not in OPTION_KEYS:
            errors.append(f"Plugins.atb.{key} is not a known key (allowed: {', '.join(OPTION_KEYS)})")
    fraction = section.get("memoryFraction", DEFAULT_MEMORY_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        errors.append(f"Plugins.atb.memoryFraction is {fraction!r}; allowed: a number in (0, 1]")
    return errors


@hookimpl
def mindie_host_model_backend(ctx: BackendContext, backend_type: str) -> AtbBackend | None:
    """An unloaded :class:`AtbBackend` on the NPU; raises ``NpuUnavailable`` (a ``RuntimeError``) naming what
    is missing (torch_npu, or a visible NPU) and how to install it."""
    if backend_type != BACKEND_TYPE:
        return None
    ops = load_torch_npu()
    config, model_config = ctx.config, ctx.model
    path = model_config.modelWeightPath or str(default_model_path())
    return AtbBackend(
        resolve_model(path),
        name=model_config.modelName or DEFAULT_MODEL_NAME,
        dtype=model_config.dtype,
        platform=NpuPlatform(ops),
        memory_fraction=float(_options(config).get("memoryFraction", DEFAULT_MEMORY_FRACTION)),
        architectures=ctx.architectures,
    )
