"""The public surface for *backend* plugins: the torch model runner and its building blocks.

A plugin that serves a ``backendType`` (``ms``, ``atb``), extends the torch
runner (``multimodal``) or provides model families (``models``) imports these from here. Everything else a plugin needs,
including the backend contract itself (:class:`~mindie_host.api.ModelBackend`,
``ModelInfo``, ``ModelInput``), is in :mod:`mindie_host.api`, which exports
nothing backend-specific.

    from mindie_host.backend_api import TorchBackend, select_platform
"""

from __future__ import annotations

from .backends.platform import AttentionMetadata, CudaPlatform, Platform, gather_slots, select_platform
from .backends.torch.backend import TorchBackend, resolve_dtype
from .backends.torch.layers import (
    Attention,
    DecoderLayer,
    GatedMLP,
    KVSpec,
    ModelWeights,
    Step,
    dense_attention,
    dense_layer,
    dense_mlp,
)
from .backends.torch.model import DecoderModel, TorchLlama
from .distributed.tensor_parallel import TensorParallel
from .models.architecture import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Architecture,
    Architectures,
    ModelArch,
    ModelLoadError,
    Norms,
    Piece,
    rename_prefixes,
    split_rows,
)
from .models.gguf_files import GGUFInfo, base_config
from .models.llama import LlamaFamily
from .models.rope import Rope, rope_of
from .models.weights import LlamaArch, count_tensors, family_of, iter_weights, load_arch

__all__ = [
    "gather_slots",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "Architecture",
    "Architectures",
    "Attention",
    "AttentionMetadata",
    "CudaPlatform",
    "DecoderLayer",
    "DecoderModel",
    "GGUFInfo",
    "GatedMLP",
    "KVSpec",
    "LlamaArch",
    "LlamaFamily",
    "ModelArch",
    "ModelLoadError",
    "ModelWeights",
    "Norms",
    "Piece",
    "Platform",
    "Rope",
    "Step",
    "TensorParallel",
    "TorchBackend",
    "TorchLlama",
    "base_config",
    "count_tensors",
    "dense_attention",
    "dense_layer",
    "dense_mlp",
    "family_of",
    "iter_weights",
    "load_arch",
    "rename_prefixes",
    "resolve_dtype",
    "rope_of",
    "select_platform",
    "split_rows",
]
