"""The public surface for *backend* plugins: the torch model runner and its building blocks.

A plugin that serves a ``backendType`` (``ms``, ``atb``) or extends the torch
runner (``multimodal``) imports these from here. Everything else a plugin needs,
including the backend contract itself (:class:`~mindie_host.api.ModelBackend`,
``ModelInfo``, ``ModelInput``), is in :mod:`mindie_host.api`, which exports
nothing backend-specific.

    from mindie_host.backend_api import TorchBackend, select_platform
"""

from __future__ import annotations

from .backends.platform import AttentionMetadata, CudaPlatform, Platform, select_platform
from .backends.torch.backend import TorchBackend, resolve_dtype
from .backends.torch.model import TorchLlama
from .models.rope import Rope, rope_of
from .models.weights import LlamaArch, count_tensors, iter_weights, load_arch

__all__ = [
    "AttentionMetadata",
    "CudaPlatform",
    "LlamaArch",
    "Platform",
    "Rope",
    "TorchBackend",
    "TorchLlama",
    "count_tensors",
    "iter_weights",
    "load_arch",
    "resolve_dtype",
    "rope_of",
    "select_platform",
]
