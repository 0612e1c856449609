"""The public surface for plugin authors and embedding applications: import from here, never from internals.

    from mindie_host.api import hookimpl, SchedulingContext, KVCacheManager, StepPlan, ...

It holds the hook marker, the context types, the config types, ``Host`` (the running host's
protocol: annotate with it), the engine's request, sequence and scheduling types, the KV block-pool protocol and the model-backend contract
(``ModelBackend``, ``ModelInput``, ``LinearDeltas``), the KV connector's types (``KVConnector``, ``KVLayout``,
``TransferEvent``), the errors a plugin raises or a startup raises (``PluginError``, ``EngineStartError``),
``config_from_dict`` and ``load_tokenizer``, and nothing backend-specific: backend plugins take the torch
runner and its building blocks from :mod:`mindie_host.backend_api`. Plugin tests take their helpers from
:mod:`mindie_host.testing`. These three modules are the whole public surface: a plugin, or its tests, that
imports anything else from ``mindie_host`` (but ``mindie_host.hookimpl``) fails ``tests/test_house.py``.
"""

from __future__ import annotations

from . import hookimpl
from .backends.base import LinearDeltas, ModelBackend, ModelInfo, ModelInput, PayloadSlice
from .config import Config, ModelConfig, config_from_dict
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
from .engine.handle import EngineStartError
from .engine.kv_cache import KVCacheManager
from .engine.kv_transfer import KVConnector, KVLayout, TransferEvent
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
from .engine.speculation import (
    OPT_OUT_FIELD,
    DraftOutcome,
    DraftRequest,
    Drafts,
    opted_out,
    read_opt_out,
    speculation_metrics,
)
from .host_protocol import Host
from .models.default import DEFAULT_MODEL_NAME, default_model_path
from .models.weights import ModelSource, resolve_model
from .plugins import PluginError
from .reasoning_parsers import ReasoningParser
from .tokenizer import load_tokenizer
from .tool_parsers import (
    DeepSeekToolParser,
    GlmToolParser,
    HermesToolParser,
    JsonToolParser,
    MistralToolParser,
    ToolParser,
    make_call,
)

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
    "DraftOutcome",
    "DraftRequest",
    "Drafts",
    "EngineRequest",
    "DeepSeekToolParser",
    "GlmToolParser",
    "HermesToolParser",
    "JsonToolParser",
    "MistralToolParser",
    "KVCacheManager",
    "MediaHandler",
    "ModelBackend",
    "ModelInfo",
    "ModelInput",
    "ModelSource",
    "PayloadSlice",
    "ReasoningParser",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerLimits",
    "SchedulerState",
    "SequenceView",
    "StepPlan",
    "TokenLogprob",
    "ToolParser",
    "admit_prefills",
    "default_model_path",
    "hookimpl",
    "least_urgent",
    "OPT_OUT_FIELD",
    "opted_out",
    "read_opt_out",
    "speculation_metrics",
    "make_call",
    "order_fcfs",
    "order_priority",
    "plan_standard",
    "register_media_handler",
    "resolve_model",
    "unregister_media_handler",
    "EngineStartError",
    "KVConnector",
    "KVLayout",
    "TransferEvent",
    "PluginError",
    "config_from_dict",
    "load_tokenizer",
]
