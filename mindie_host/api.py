"""The public surface for plugin authors: import from here, never from engine internals.

    from mindie_host.api import hookimpl, KVCacheManager, StepPlan, ...
"""

from __future__ import annotations

from . import hookimpl
from .backends.base import LinearDeltas, ModelBackend, ModelInfo, ModelInput, PayloadSlice
from .backends.platform import AttentionMetadata, CudaPlatform, Platform, select_platform
from .backends.torch.backend import TorchBackend, resolve_dtype
from .backends.torch.model import TorchLlama
from .config import Config, ModelConfig
from .content import MediaHandler, register_media_handler, unregister_media_handler
from .context import (
    BackendContext,
    KVContext,
    LifecycleContext,
    PluginContext,
    RequestContext,
    SchedulingContext,
)
from .engine.block_pool import BlockPool, RefCountedBlockPool
from .engine.kv_cache import KVCacheManager
from .engine.policy import (
    SchedulerLimits,
    SchedulerState,
    StepPlan,
    admit_prefills,
    least_urgent,
    order_fcfs,
    order_priority,
    plan_standard,
)
from .engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams, TokenLogprob
from .engine.sequence import SequenceView
from .host import Host
from .models.default import DEFAULT_MODEL_NAME, default_model_path
from .models.rope import Rope, rope_of
from .models.weights import LlamaArch, ModelSource, count_tensors, iter_weights, load_arch, resolve_model
from .tool_parsers import HermesToolParser, JsonToolParser, ToolParser, make_call

__all__ = [
    "BlockPool",
    "RefCountedBlockPool",
    "BackendContext",
    "Config",
    "Host",
    "KVContext",
    "LifecycleContext",
    "LinearDeltas",
    "ModelConfig",
    "PluginContext",
    "RequestContext",
    "SchedulingContext",
    "DEFAULT_MODEL_NAME",
    "AttentionMetadata",
    "CudaPlatform",
    "EngineRequest",
    "HermesToolParser",
    "JsonToolParser",
    "KVCacheManager",
    "LlamaArch",
    "MediaHandler",
    "ModelBackend",
    "ModelInfo",
    "ModelInput",
    "ModelSource",
    "PayloadSlice",
    "Platform",
    "RequestError",
    "RequestOutput",
    "Rope",
    "SamplingParams",
    "rope_of",
    "SchedulerLimits",
    "SchedulerState",
    "SequenceView",
    "StepPlan",
    "TokenLogprob",
    "TorchBackend",
    "TorchLlama",
    "ToolParser",
    "admit_prefills",
    "count_tensors",
    "default_model_path",
    "hookimpl",
    "iter_weights",
    "least_urgent",
    "load_arch",
    "make_call",
    "order_fcfs",
    "order_priority",
    "plan_standard",
    "register_media_handler",
    "resolve_dtype",
    "resolve_model",
    "select_platform",
    "unregister_media_handler",
]
