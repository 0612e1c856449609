"""The public surface for plugin authors and embedding applications: import from here, never from internals.

    from mindie_host.api import hookimpl, EngineContext, KVCacheManager, StepPlan, ...

It holds the plugin contract's version (``CONTRACT_VERSION``, 3: every hook takes ``ctx`` and no argument that
duplicates it; docs/plugins.md says what changed in each version), the hook marker, the context types (one per
shape: ``HostContext``, ``EngineContext``, ``BackendContext``), the config types, ``Host`` (the running host's
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
from .context import RENAMED_CONTEXTS, BackendContext, EngineContext, HostContext, PluginContext
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
from .plugins import CONTRACT_VERSION, MIGRATION_DOC, PluginError
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
    "CONTRACT_VERSION",
    "Config",
    "EngineContext",
    "Host",
    "HostContext",
    "LinearDeltas",
    "ModelConfig",
    "PluginContext",
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


def __getattr__(name: str) -> object:
    """A name contract 2 exported and contract 3 renamed: one ImportError that says what to import instead."""
    if name in RENAMED_CONTEXTS:
        raise ImportError(
            f"mindie_host.api.{name} is {RENAMED_CONTEXTS[name]} since plugin contract {CONTRACT_VERSION} (one "
            f"context class per shape); see {MIGRATION_DOC}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
