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

import logging
import weakref
from typing import Any

from mindie_host import hookimpl
from mindie_host.api import KVCacheManager

from .manager import PrefixCachingKVCacheManager, block_key

__all__ = ["PLUGIN_NAME", "PrefixCachingKVCacheManager", "block_key", "is_enabled"]

PLUGIN_NAME = "prefix_cache"
log = logging.getLogger("mindie_host.plugins.prefix_cache")

#: the manager built for each live config (keyed by ``id(config)``), for the metrics hook
_managers: weakref.WeakValueDictionary[int, PrefixCachingKVCacheManager] = weakref.WeakValueDictionary()


def _options(config: Any) -> dict[str, Any]:
    section = getattr(config, "Plugins", {}) or {}
    opts = section.get(PLUGIN_NAME, {})
    return opts if isinstance(opts, dict) else {}


def is_enabled(config: Any) -> bool:
    """True when the first model lists ``prefix_cache`` in ``plugin_params`` and ``enablePrefixCache`` is true."""
    return PLUGIN_NAME in config.model.plugins and bool(config.schedule.enablePrefixCache)


@hookimpl
def mindie_host_validate_config(config: Any, model_config: Any) -> list[str]:
    """Both switches must be on; ``Plugins.prefix_cache`` must hold only known, valid keys."""
    if PLUGIN_NAME not in model_config.plugins:
        return []
    errors: list[str] = []
    if not config.schedule.enablePrefixCache:
        errors.append(
            "BackendConfig.ScheduleConfig.enablePrefixCache is false but ModelConfig.plugin_params enables "
            "'prefix_cache'; set enablePrefixCache to true (MindIE needs both to turn Prefix Cache on) "
            "or remove prefix_cache from plugin_type"
        )
    section = getattr(config, "Plugins", {}).get(PLUGIN_NAME, {})
    if not isinstance(section, dict):
        return [*errors, f"Plugins.prefix_cache must be a JSON object, got {section!r}"]
    for key in section:
        if key != "numBlocks":
            errors.append(f"Plugins.prefix_cache.{key} is not a known key (allowed: numBlocks)")
    if "numBlocks" in section:
        value = section["numBlocks"]
        lo = -(-config.deploy.maxSeqLen // config.schedule.cacheBlockSize)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= 2**31 - 1:
            errors.append(
                f"Plugins.prefix_cache.numBlocks is {value!r}; allowed: an integer in [{lo}, {2**31 - 1}] "
                f"(at least enough blocks of cacheBlockSize={config.schedule.cacheBlockSize} for one sequence "
                f"of maxSeqLen={config.deploy.maxSeqLen})"
            )
    return errors


@hookimpl
def mindie_host_kv_cache_manager(num_blocks: int, block_size: int, config: Any) -> KVCacheManager | None:
    """The prefix-sharing manager when the feature is on; ``None`` (the builtin) otherwise."""
    if not is_enabled(config):
        return None
    cap = _options(config).get("numBlocks")
    if isinstance(cap, int) and not isinstance(cap, bool) and 0 < cap < num_blocks:
        num_blocks = cap
    manager = PrefixCachingKVCacheManager(num_blocks, block_size)
    _managers[id(config)] = manager
    log.info("prefix cache on: %d blocks of %d tokens", num_blocks, block_size)
    return manager


@hookimpl
def mindie_host_metrics(host: Any) -> dict[str, float] | None:
    """``npu_prefix_cache_hit_rate``: cached blocks found / prompt blocks looked up, since startup."""
    manager = _managers.get(id(host.config))
    if manager is None:
        return None
    return {"npu_prefix_cache_hit_rate": manager.counters.hit_rate}
