"""Plugins registered by object in one process, rebuilt in the processes the runtime starts.

The engine process and the tensor-parallel ranks enable the plugins ``config.json`` names
themselves; plugins a test or an embedding application registered by object travel to them:
modules by name, other objects pickled. An object that cannot be pickled stays in the front
end when it implements no engine hook, and stops the startup when it does.
"""

from __future__ import annotations

import importlib
import logging
import pickle
import types

from ..engine.handle import EngineStartError
from ..plugins import PluginHost

log = logging.getLogger("mindie_host.runtime")

#: Hooks the engine process calls; every other hook is called in the front end (docs/architecture.md).
ENGINE_HOOKS = frozenset(
    {
        "mindie_host_model_backend",
        "mindie_host_backend_types",
        "mindie_host_kv_cache_manager",
        "mindie_host_order_waiting",
        "mindie_host_order_running",
        "mindie_host_filter_waiting",
        "mindie_host_plan_step",
        "mindie_host_preemption_victim",
        "mindie_host_linear_deltas",
        "mindie_host_request_arrived",
        "mindie_host_request_finished",
        "mindie_host_engine_command",
        "mindie_host_kv_connector",
        "mindie_host_model_architectures",
        "mindie_host_propose_drafts",
        "mindie_host_drafts_accepted",
    }
)

#: ``(name, "module" | "pickle", module name or pickled object)`` of each plugin registered by object
PluginSpecs = list[tuple[str, str, bytes]]


def plugin_specs(plugins: PluginHost) -> PluginSpecs:
    """The plugins registered on ``plugins`` by object (not by config), in a form another process can rebuild.

    Builtins and config-enabled plugins are re-enabled by that process itself.
    """
    specs: PluginSpecs = []
    for name, plugin in plugins.pm.list_name_plugin():
        if name.startswith("builtin:") or plugin is None:
            continue
        if isinstance(plugin, types.ModuleType):
            specs.append((name, "module", plugin.__name__.encode()))
            continue
        try:
            specs.append((name, "pickle", pickle.dumps(plugin)))
        except Exception as exc:
            hooks = {caller.name for caller in plugins.pm.get_hookcallers(plugin) or []}
            if hooks & ENGINE_HOOKS:
                raise EngineStartError(
                    f"plugin {name!r} implements engine hooks ({', '.join(sorted(hooks & ENGINE_HOOKS))}) but "
                    f"cannot be sent to the engine process ({exc}); register it as a module or set "
                    "ServerConfig.engineProcess to false"
                ) from exc
            log.info("plugin %r has no engine hooks and cannot be pickled: it runs in the front end only", name)
    return specs


def register_specs(plugins: PluginHost, specs: PluginSpecs) -> None:
    """Register on ``plugins`` the plugins :func:`plugin_specs` sent from another process."""
    for name, kind, data in specs:
        plugin = importlib.import_module(data.decode()) if kind == "module" else pickle.loads(data)
        plugins.register(plugin, name)
