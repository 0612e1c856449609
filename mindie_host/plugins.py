"""The plugin manager: builtins, entry-point discovery, and which plugins config enables.

Builtins are always registered. A third-party plugin is a distribution with an
entry point in the ``mindie_host.plugins`` group; its entry-point *name* is the
name used in ``config.json``: in ``plugin_params`` (``{"plugin_type":
"prefix_cache"}``) or, for a backend, as ``backendType``. Installed plugins that
config does not enable are listed but never imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

from . import hookspecs
from .logs import adopt_logger

if TYPE_CHECKING:
    from .config import Config

ENTRY_POINT_GROUP = "mindie_host.plugins"

#: Modules of the host that implement hooks, registered on every start.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "mindie_host.engine.builtin_policy",
    "mindie_host.backends.torch.plugin",
    "mindie_host.server.openai",
    "mindie_host.server.tool_calls",
    "mindie_host.server.tgi",
    "mindie_host.server.vllm",
    "mindie_host.server.triton",
    "mindie_host.server.native",
    "mindie_host.server.tokenize",
    "mindie_host.server.management",
    "mindie_host.server.metrics",
)

#: pip packages that provide the plugins we publish, for install hints.
KNOWN_PACKAGES: dict[str, str] = {
    "prefix_cache": "mindie-plugin-prefix-cache",
    "splitfuse": "mindie-plugin-splitfuse",
    "multi_lora": "mindie-plugin-multi-lora",
    "multimodal": "mindie-plugin-multimodal",
    "ms": "mindie-plugin-backends-ms",
    "atb": "mindie-plugin-backends-atb",
}


class PluginError(RuntimeError):
    """An enabled plugin is missing, fails to import, or rejects its config."""


@dataclass
class InstalledPlugin:
    """One entry point in the ``mindie_host.plugins`` group."""

    name: str
    value: str
    distribution: str
    version: str


def installed_plugins() -> list[InstalledPlugin]:
    """Every plugin entry point installed in this environment (nothing is imported)."""
    found: list[InstalledPlugin] = []
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        found.append(
            InstalledPlugin(
                name=ep.name,
                value=ep.value,
                distribution=dist.metadata["Name"] if dist else "?",
                version=dist.version if dist else "?",
            )
        )
    return sorted(found, key=lambda p: p.name)


def enabled_plugin_names(config: Config) -> list[str]:
    """Plugin names config switches on: every model's ``plugin_params`` and non-builtin ``backendType``."""
    names: list[str] = []
    for model in config.BackendConfig.ModelDeployConfig.ModelConfig:
        for name in [*model.plugins, model.backendType]:
            if name and name != "torch" and name not in names:
                names.append(name)
    return names


def install_hint(name: str) -> str:
    """The pip command that would provide plugin ``name``."""
    package = KNOWN_PACKAGES.get(name)
    if package:
        return f"pip install {package}"
    return f"install a package that declares entry point {name!r} in group {ENTRY_POINT_GROUP!r}"


class PluginHost:
    """The pluggy manager plus the bookkeeping of what is enabled."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("mindie_host")
        self.pm.add_hookspecs(hookspecs)
        self.enabled: list[str] = []
        # `mindie-host serve` loads the model on the main thread while the HTTP thread starts; both enable plugins
        self._enable_lock = threading.Lock()
        for module_name in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(module_name), name=f"builtin:{module_name}")

    @property
    def hook(self) -> pluggy.HookRelay:
        return self.pm.hook

    def register(self, plugin: object, name: str) -> None:
        """Register an already-imported plugin object (tests and embedding use this)."""
        self.pm.register(plugin, name=name)
        if name not in self.enabled:
            self.enabled.append(name)

    def enable_from_config(self, config: Config) -> None:
        """Import and register every plugin config enables; fail loudly if one is missing.

        ``backendType`` values served by a builtin (``torch``) need no plugin.
        """
        with self._enable_lock:
            self._enable(config)

    def _enable(self, config: Config) -> None:
        available = {ep.name: ep for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
        for name in enabled_plugin_names(config):
            if self.pm.has_plugin(name):
                continue
            ep = available.get(name)
            if ep is None:
                raise PluginError(f"plugin {name!r} is enabled in config.json but not installed: {install_hint(name)}")
            try:
                plugin = ep.load()
            except Exception as exc:  # an import error inside the plugin
                raise PluginError(f"plugin {name!r} ({ep.value}) failed to import: {exc}") from exc
            self.register(plugin, name)
            adopt_logger(ep.module.split(".")[0])  # the plugin's own `logging.getLogger(__name__)` lines
        self.pm.check_pending()

    def validate(self, config: Config) -> list[str]:
        """Run every plugin's config validation hook; returns all error messages."""
        errors: list[str] = []
        for model in config.BackendConfig.ModelDeployConfig.ModelConfig:
            for result in self.hook.mindie_host_validate_config(config=config, model_config=model):
                errors.extend(result or [])
        return errors

    def backend_types(self) -> list[str]:
        """Every ``backendType`` the registered plugins can serve."""
        types: list[str] = []
        for result in self.hook.mindie_host_backend_types():
            types.extend(t for t in (result or []) if t not in types)
        return types

    def registered_names(self) -> list[str]:
        """Names of every registered plugin, builtins included."""
        return [name for name, _ in self.pm.list_name_plugin()]
