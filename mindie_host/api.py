"""The public surface for plugin authors: import from here, never from engine internals.

    from mindie_host.api import hookimpl, KVCacheManager, StepPlan, ...
"""

from __future__ import annotations

from . import hookimpl
from .backends.base import ModelBackend, ModelInfo, ModelInput
from .backends.platform import AttentionMetadata, Platform, select_platform
from .engine.kv_cache import KVCacheManager
from .engine.policy import (
    SchedulerLimits,
    SchedulerState,
    StepPlan,
    admit_prefills,
    order_fcfs,
    order_priority,
    plan_standard,
)
from .engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams, TokenLogprob
from .engine.sequence import SequenceView
from .models.weights import LlamaArch, ModelSource, iter_weights, load_arch, resolve_model

__all__ = [
    "AttentionMetadata",
    "EngineRequest",
    "KVCacheManager",
    "LlamaArch",
    "ModelBackend",
    "ModelInfo",
    "ModelInput",
    "ModelSource",
    "Platform",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerLimits",
    "SchedulerState",
    "SequenceView",
    "StepPlan",
    "TokenLogprob",
    "admit_prefills",
    "hookimpl",
    "iter_weights",
    "load_arch",
    "order_fcfs",
    "order_priority",
    "plan_standard",
    "resolve_model",
    "select_platform",
]
