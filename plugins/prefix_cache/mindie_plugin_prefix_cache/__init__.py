"""mindie-host plugin ``prefix_cache``: reuse the KV blocks of shared prompt prefixes (MindIE §7.7).

Enabled per model, as in MindIE, by *both*::

    "ModelConfig": [{"plugin_params": "{\\"plugin_type\\":\\"prefix_cache\\"}", ...}]
    "ScheduleConfig": {"enablePrefixCache": true, ...}

Enabling the plugin without ``enablePrefixCache`` (or the reverse) is refused at
startup with a message naming the missing key: the spec lists both as required,
and a half-enabled feature that silently does nothing is harder to notice than
an error.

Optional settings, in ``config.json``'s ``Plugins`` section::

    "Plugins": {"prefix_cache": {"numBlocks": 64}}

``numBlocks`` caps the KV pool (default: every block the memory budget allows);
useful to bound the memory the cache may hold, and to test eviction.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, StrictInt

from mindie_host.api import EngineContext, HostContext, KVCacheManager, hookimpl

from .manager import PrefixCachingKVCacheManager, block_key

__all__ = ["PLUGIN_NAME", "PrefixCachingKVCacheManager", "block_key", "is_enabled"]

PLUGIN_NAME = "prefix_cache"


class Params(BaseModel):
    """``Plugins.prefix_cache``."""

    #: cap on the KV pool, in blocks (0: every block the memory budget allows)
    numBlocks: StrictInt = Field(default=0, ge=0, le=2**31 - 1)


class State:
    """The manager this plugin built for the engine (read by the metrics hook)."""

    def __init__(self) -> None:
        self.manager: PrefixCachingKVCacheManager | None = None


def is_enabled(config: Any) -> bool:
    """True when the first model lists ``prefix_cache`` in ``plugin_params`` and ``enablePrefixCache`` is true."""
    return PLUGIN_NAME in config.model.plugins and bool(config.schedule.enablePrefixCache)


@hookimpl
def mindie_host_validate_config(ctx: HostContext) -> list[str]:
    """Both switches must be on; ``numBlocks`` must hold one sequence of ``maxSeqLen``."""
    if PLUGIN_NAME not in ctx.model.plugins:
        return []
    config, errors = ctx.config, []
    if not config.schedule.enablePrefixCache:
        errors.append(
            "BackendConfig.ScheduleConfig.enablePrefixCache is false but ModelConfig.plugin_params enables "
            "'prefix_cache'; set enablePrefixCache to true (MindIE needs both to turn Prefix Cache on) "
            "or remove prefix_cache from plugin_type"
        )
    value = ctx.params.numBlocks
    lo = -(-config.deploy.maxSeqLen // config.schedule.cacheBlockSize)
    if value and value < lo:
        errors.append(
            f"Plugins.prefix_cache.numBlocks is {value!r}; allowed: an integer in [{lo}, {2**31 - 1}] "
            f"(at least enough blocks of cacheBlockSize={config.schedule.cacheBlockSize} for one sequence "
            f"of maxSeqLen={config.deploy.maxSeqLen})"
        )
    return errors


@hookimpl
def mindie_host_kv_cache_manager(ctx: EngineContext, num_blocks: int, block_size: int) -> KVCacheManager | None:
    """The prefix-sharing manager when the feature is on; ``None`` (the builtin) otherwise."""
    if not is_enabled(ctx.config):
        return None
    if 0 < ctx.params.numBlocks < num_blocks:
        num_blocks = ctx.params.numBlocks
    manager = ctx.state.manager = PrefixCachingKVCacheManager(num_blocks, block_size)
    ctx.log.info("prefix cache on: %d blocks of %d tokens", num_blocks, block_size)
    return manager


@hookimpl
def mindie_host_metrics(ctx: HostContext) -> dict[str, float] | None:
    """``npu_prefix_cache_hit_rate``: cached blocks found / prompt blocks looked up, since startup."""
    manager = ctx.state.manager
    if manager is None:
        return None
    return {"npu_prefix_cache_hit_rate": manager.counters.hit_rate}
