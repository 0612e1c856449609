"""Hook implementations of the ``ms`` plugin (the entry point ``ms`` in group ``mindie_host.plugins``).

Importing this module does not import MindSpore; :func:`mindie_host_model_backend` does.
"""

from __future__ import annotations

from typing import Any

from mindie_host import hookimpl
from mindie_host.api import DEFAULT_MODEL_NAME, BackendContext, HostContext, default_model_path, resolve_model

BACKEND_TYPE = "ms"
#: plugins whose contract this backend does not implement, with the reason given at startup
INCOMPATIBLE_PLUGINS = {
    "multi_lora": "backendType 'ms' does not implement the LoRA hooks of the torch model; "
                  "serve adapters with backendType 'torch'",
}
OPTION_KEYS = ("numThreads",)


def _options(config: Any) -> dict[str, Any]:
    section = (getattr(config, "Plugins", None) or {}).get(BACKEND_TYPE, {})
    return section if isinstance(section, dict) else {}


@hookimpl
def mindie_host_backend_types(ctx: BackendContext) -> list[str]:
    """This plugin serves ``backendType: "ms"``."""
    return [BACKEND_TYPE]


@hookimpl
def mindie_host_validate_config(ctx: HostContext) -> list[str]:
    """Refuse settings the MindSpore backend cannot honour (device, dtype, worldSize, LoRA, options)."""
    config, model_config = ctx.config, ctx.model
    if model_config.backendType != BACKEND_TYPE:
        return []
    errors: list[str] = []
    if model_config.device not in ("auto", "cpu"):
        errors.append(f"ModelConfig.device is {model_config.device!r} but backendType 'ms' runs on the CPU; "
                      "allowed: \"auto\" or \"cpu\"")
    if model_config.dtype not in ("auto", "float32"):
        errors.append(f"ModelConfig.dtype is {model_config.dtype!r} but backendType 'ms' computes in float32 on "
                      "the CPU; allowed: \"auto\" or \"float32\"")
    if model_config.worldSize != 1:
        errors.append(f"ModelConfig.worldSize is {model_config.worldSize} but backendType 'ms' runs on one "
                      "device; allowed: 1")
    if model_config.quantization not in ("auto", "none"):
        errors.append(f"ModelConfig.quantization is {model_config.quantization!r} but backendType 'ms' computes "
                      "dequantized float32 weights; allowed: \"auto\" or \"none\"")
    if model_config.kvCacheDtype not in ("auto", "float32"):
        errors.append(f"ModelConfig.kvCacheDtype is {model_config.kvCacheDtype!r} but backendType 'ms' keeps a "
                      "float32 KV cache; allowed: \"auto\" or \"float32\"")
    if model_config.compile:
        errors.append("ModelConfig.compile is true but backendType 'ms' runs MindSpore in eager (PyNative) mode; "
                      "allowed: false")
    for name, reason in INCOMPATIBLE_PLUGINS.items():
        if name in model_config.plugins:
            errors.append(f"ModelConfig.plugin_params enables {name!r} with backendType 'ms': {reason}")
    section = (getattr(config, "Plugins", None) or {}).get(BACKEND_TYPE, {})
    if not isinstance(section, dict):
        return [*errors, f"Plugins.ms must be a JSON object, got {section!r}"]
    for key in section:
        if key not in OPTION_KEYS:
            errors.append(f"Plugins.ms.{key} is not a known key (allowed: {', '.join(OPTION_KEYS)})")
    threads = section.get("numThreads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024):
        errors.append(f"Plugins.ms.numThreads is {threads!r}; allowed: an integer in [1, 1024]")
    return errors


@hookimpl
def mindie_host_model_backend(ctx: BackendContext, backend_type: str) -> Any:
    """An unloaded :class:`~mindie_plugin_backends_ms.backend.MsBackend` for ``backendType: "ms"``.

    Raises ``RuntimeError`` naming the install command when MindSpore is missing.
    """
    if backend_type != BACKEND_TYPE:
        return None
    from .backend import MsBackend
    from .runtime import mindspore_module

    config, model_config = ctx.config, ctx.model
    threads = _options(config).get("numThreads")
    mindspore_module(threads)  # fail here, with the install hint, before any weights are read
    path = model_config.modelWeightPath or str(default_model_path())
    return MsBackend(resolve_model(path), name=model_config.modelName or DEFAULT_MODEL_NAME, num_threads=threads)
