"""Builtin plugin: serves ``backendType: "torch"`` (CPU or CUDA)."""

from __future__ import annotations

from typing import Any

from ... import hookimpl
from ...models.default import DEFAULT_MODEL_NAME, default_model_path
from ...models.weights import resolve_model
from ..platform import select_platform
from .backend import TorchBackend


@hookimpl
def mindie_host_backend_types(ctx: Any) -> list[str]:
    return ["torch"]


@hookimpl
def mindie_host_model_backend(ctx: Any, backend_type: str) -> TorchBackend | None:
    if backend_type != "torch":
        return None
    model_config = ctx.model
    path = model_config.modelWeightPath or str(default_model_path())
    name = model_config.modelName or DEFAULT_MODEL_NAME
    return TorchBackend(
        resolve_model(path),
        name=name,
        dtype=model_config.dtype,
        kv_cache_dtype=model_config.kvCacheDtype,
        quantization=model_config.quantization,
        compile_decode=model_config.compile,
        platform=select_platform(model_config.device),
        architectures=ctx.architectures,
        expert_parallel=model_config.expertParallel,
    )
