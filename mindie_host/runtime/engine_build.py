"""The engine over a loaded backend: the KV pool sized and allocated, the KV manager, the swap space,
the PD connector, the scheduler limits, and the :class:`~mindie_host.engine.core.LLMEngine` itself."""

from __future__ import annotations

import logging
from typing import Any

from ..backends.base import ModelBackend, ModelInfo
from ..config import Config
from ..engine.block_pool import RefCountedBlockPool
from ..engine.core import EngineLimits, LLMEngine
from ..engine.kv_transfer import KVConnector, KVLayout
from ..engine.policy import SchedulerLimits
from ..engine.swap import SwapSpace
from ..kv_sizing import plan_kv_pool
from ..plugins import PluginError, PluginHost
from .diagnostics import install_diagnostics

log = logging.getLogger("mindie_host")


def build_engine(
    plugins: PluginHost, config: Config, backend: ModelBackend, info: ModelInfo, tokenizer: Any
) -> LLMEngine:
    """Size and allocate the KV pool on ``backend``, warm it up, and build the engine with the plugins' KV manager."""
    sc, deploy = config.schedule, config.deploy
    on_cpu = info.device == "cpu"
    if deploy.maxSeqLen > info.max_position_embeddings:
        log.warning(
            "ModelDeployConfig.maxSeqLen %d is above the model's max_position_embeddings %d: positions "
            "past it are extrapolated with the model's RoPE, as transformers does, and outputs there may "
            "degrade",
            deploy.maxSeqLen,
            info.max_position_embeddings,
        )
    backend.set_max_positions(deploy.maxSeqLen)
    plan = plan_kv_pool(config, backend, info.device)
    num_blocks, block_size = plan.num_blocks, plan.block_size
    if num_blocks * block_size < deploy.maxSeqLen:
        raise PluginError(
            f"KV cache budget too small: {num_blocks} blocks of {block_size} tokens cannot hold one "
            f"sequence of maxSeqLen={deploy.maxSeqLen} ({plan.limited_by}); raise "
            f"{'cpuMemSize' if on_cpu else 'npuMemSize'} or lower maxSeqLen"
        )
    backend.allocate_kv_cache(num_blocks, block_size)
    backend.warmup()
    kv = plugins.hook.mindie_host_kv_cache_manager(num_blocks=num_blocks, block_size=block_size)
    limits = SchedulerLimits.from_schedule(sc, config.environment.recompute_threshold)
    swap = swap_space(config, backend)
    connector = kv_connector(plugins, config, backend, info, block_size) if config.server.inferMode == "dmi" else None
    llm = LLMEngine(
        backend=backend,
        model_info=info,
        tokenizer=tokenizer,
        kv=kv,
        scheduler_limits=limits,
        limits=EngineLimits(max_seq_len=deploy.maxSeqLen, max_iter_times=sc.maxIterTimes),
        hook=plugins.hook,
        config=config,
        swap=swap,
        connector=connector,
    )
    log.info("%s", plan.describe(info.device))
    install_diagnostics(llm, config)  # MIES_PROFILER_MODE, MIES_MEMORY_DETECTOR_MODE
    return llm


def kv_connector(
    plugins: PluginHost, config: Config, backend: ModelBackend, info: ModelInfo, block_size: int
) -> KVConnector:
    """PD disaggregation: the KV connector, started with this engine's cache layout; its address goes
    into ``info.extra["kv_address"]`` (the front end puts it in the requests it hands to D)."""
    shapes = backend.kv_block_shapes()
    if shapes is None:
        raise PluginError(
            f"ServerConfig.inferMode 'dmi': backendType {config.model.backendType!r} cannot "
            "export and import KV blocks (with kvCacheDtype int8 neither can the torch backend)"
        )
    connector: KVConnector = plugins.hook.mindie_host_kv_connector()
    layout = KVLayout(
        model=info.name,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype=shapes[0],
        block_size=block_size,
        block_shapes=shapes[1],
    )
    info.extra["kv_address"] = connector.start(layout, backend.export_blocks)
    return connector


def swap_space(config: Config, backend: ModelBackend) -> SwapSpace | None:
    """The CPU swap space for preempted sequences: ``cpuMemSize`` GB when ``maxPreemptCount`` > 0 and
    ``MIES_USE_MB_SWAPPER=1`` (spec §5.1: maxPreemptCount takes effect with the variable at 1)."""
    count, gb = config.schedule.maxPreemptCount, config.model.cpuMemSize
    if count == 0:
        return None
    if not config.environment.use_mb_swapper:
        log.warning("ScheduleConfig.maxPreemptCount is %d but MIES_USE_MB_SWAPPER is not 1: swap is off and "
                    "preempted sequences are recomputed (export MIES_USE_MB_SWAPPER=1 to swap them to cpuMemSize)",
                    count)
        return None
    per_block = backend.swap_block_bytes()
    blocks = gb * (1 << 30) // per_block if per_block else 0
    if blocks == 0 or not backend.allocate_swap_space(blocks):
        log.warning(
            "ScheduleConfig.maxPreemptCount is %d but backendType %r cannot swap KV blocks to CPU "
            "memory (or cpuMemSize holds none): preempted sequences are recomputed instead",
            count,
            config.model.backendType,
        )
        return None
    log.info("swap space: %d KV blocks (cpuMemSize %d GB); at most %d swap preemptions per step", blocks, gb, count)
    return SwapSpace(RefCountedBlockPool(blocks), max_per_step=count)
