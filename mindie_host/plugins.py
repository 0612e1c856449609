"""The plugin manager: builtins, entry-point discovery, and which plugins config enables.

Builtins are always registered. A third-party plugin is a distribution with an
entry point in the ``mindie_host.plugins`` group; its entry-point *name* is the
name used in ``config.json``: in ``plugin_params`` (``{"plugin_type":
"prefix_cache"}``) or, for a backend, as ``backendType``. Installed plugins that
config does not enable are listed but never imported, with one exception: a
plugin that provides model families declares their model types in the
``mindie_host.architectures`` group (``qwen3 = "mindie_plugin_models"``), and is
enabled without a config entry when a served checkpoint is of one of them.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .context import (
    PluginContext,
    concern_of,
    declared_params,
    declared_state,
    param_fields,
    plugin_logger,
    validate_params,
)
from .logs import adopt_logger
from .models.architecture import Architectures

if TYPE_CHECKING:
    from .config import Config, ModelConfig
    from .host_protocol import Host

ENTRY_POINT_GROUP = "mindie_host.plugins"
#: entry points named by the model types a plugin's families serve (the value: the plugin's module)
ARCHITECTURE_GROUP = "mindie_host.architectures"
log = logging.getLogger("mindie_host.plugins")

#: Modules of the host that implement hooks, registered on every start.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "mindie_host.engine.builtin_policy",
    "mindie_host.models.llama",
    "mindie_host.backends.torch.plugin",
    "mindie_host.pd.tcp_connector",
    "mindie_host.server.openai",
    "mindie_host.server.tool_calls",
    "mindie_host.server.reasoning",
    "mindie_host.server.tgi",
    "mindie_host.server.vllm",
    "mindie_host.server.triton",
    "mindie_host.server.native",
    "mindie_host.server.tokenize",
    "mindie_host.server.management",
    "mindie_host.server.pd",
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
    "models": "mindie-plugin-models",
}

#: model types served by plugins we publish (for install hints): model_type -> plugin name
KNOWN_ARCHITECTURES: dict[str, str] = {
    model_type: "models" for model_type in ("qwen3", "glm", "glm4", "gemma3", "gemma3_text", "phi3", "qwen3_moe",
                                            "mixtral", "deepseek_v3", "deepseek_v2", "qwen3moe", "deepseek2",
                                            "chatglm")
}


#: The plugin contract this host speaks (exported as ``mindie_host.api.CONTRACT_VERSION``; docs/plugins.md says
#: what changed in each version).
CONTRACT_VERSION = 3
#: Where a plugin author reads how to move a plugin to this contract.
MIGRATION_DOC = "docs/plugins.md, 'Migrating to contract 3'"
#: Contract 2's arguments that duplicated ``ctx``, and where contract 3 carries them.
V2_ARGUMENTS: dict[str, str] = {
    "config": "read ctx.config",
    "model_config": "read ctx.model",
    "host": "read ctx.host",
}


class PluginError(RuntimeError):
    """An enabled plugin is missing, fails to import, was written for an older contract, or rejects its config."""


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


@dataclass
class PluginDescription:
    """What ``mindie-host plugins`` shows of one plugin: its hooks and its parameters."""

    hooks: list[str]
    #: ``Plugins.<name>`` key -> (type, default; ``...`` when required)
    params: dict[str, tuple[str, Any]]
    error: str | None = None


def describe_plugin(plugin: object) -> PluginDescription:
    """The hooks ``plugin`` implements (marked with ``@hookimpl``) and the parameters its ``Params`` declares."""
    hooks = sorted(
        name for name in dir(plugin)
        if name.startswith("mindie_host_") and hasattr(getattr(plugin, name, None), "mindie_host_impl")
    )
    schema = declared_params(plugin)
    return PluginDescription(hooks=hooks, params=param_fields(schema) if schema is not None else {})


def describe_installed(entry_point_name: str) -> PluginDescription:
    """Import the installed plugin ``entry_point_name`` and describe it (an import error, or hooks written for an
    older contract, are reported, not raised)."""
    for ep in md.entry_points(group=ENTRY_POINT_GROUP, name=entry_point_name):
        try:
            plugin = ep.load()
        except Exception as exc:  # a plugin whose dependencies are missing here
            return PluginDescription(hooks=[], params={}, error=f"cannot import: {type(exc).__name__}: {exc}")
        description = describe_plugin(plugin)
        description.error = older_contract(plugin, entry_point_name)
        return description
    return PluginDescription(hooks=[], params={}, error="not installed")


def describe_builtins() -> PluginDescription:
    """The hooks of the host's builtin modules together (builtins declare no parameters)."""
    hooks: set[str] = set()
    for module_name in BUILTIN_PLUGINS:
        hooks.update(describe_plugin(importlib.import_module(module_name)).hooks)
    return PluginDescription(hooks=sorted(hooks), params={})


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


def contract_mismatches(plugin: object) -> list[str]:
    """What in ``plugin`` was written for an older plugin contract: one line per implementation that names an
    argument its hook spec does not have (contract 2's ``config``, ``model_config`` and ``host`` above all).

    Hooks without a spec are left to pluggy's own check (an unknown hook fails when plugins are enabled)."""
    problems: list[str] = []
    for attr in dir(plugin):
        spec = getattr(hookspecs, attr, None) if attr.startswith("mindie_host_") else None
        function = getattr(plugin, attr, None)
        if spec is None or not hasattr(function, "mindie_host_impl"):
            continue
        allowed = set(inspect.signature(spec).parameters)
        extra = [a for a in _argument_names(function) if a not in allowed]
        if extra:
            now = ", ".join(V2_ARGUMENTS.get(a, f"no argument {a!r}") for a in extra)
            problems.append(f"{attr} takes {', '.join(extra)} ({now})")
    return problems


def _argument_names(function: Any) -> list[str]:
    """The arguments pluggy would pass ``function`` (a bound method's ``self`` and defaulted ones aside)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # not introspectable: pluggy says what it makes of it
        return []
    names = [p.name for p in parameters
             if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[1:] if names[:1] == ["self"] else names  # a class's function, as pluggy reads it


def older_contract(plugin: object, name: str) -> str | None:
    """The one message that refuses ``plugin`` (registered as ``name``) when it was written for an older contract."""
    problems = contract_mismatches(plugin)
    if not problems:
        return None
    return (f"plugin {name!r} was written for an older plugin contract (this host speaks contract {CONTRACT_VERSION}): "
            + "; ".join(problems) + f"; see {MIGRATION_DOC}")


class ContextPluginManager(pluggy.PluginManager):
    """pluggy's manager, handing each implementation that names ``ctx`` the context of its own plugin.

    Calls keep pluggy's semantics (order, ``tryfirst``/``trylast``, wrappers,
    firstresult). A plugin written for an older contract is refused before pluggy
    sees it (:func:`contract_mismatches`, one :class:`PluginError`). On registration
    every implementation that takes ``ctx`` is wrapped once: the wrapper looks the
    context up (:meth:`PluginHost.context`) and passes it with the other arguments
    the implementation names.
    """

    def __init__(self, owner: PluginHost) -> None:
        super().__init__("mindie_host")
        self._owner = owner

    def register(self, plugin: object, name: str | None = None) -> str | None:
        problem = older_contract(plugin, name or self.get_canonical_name(plugin))
        if problem:
            raise PluginError(problem)
        plugin_name = super().register(plugin, name)
        if plugin_name is not None:
            for caller in self.get_hookcallers(plugin) or []:
                concern = concern_of(caller.name)
                for impl in caller.get_hookimpls():
                    if impl.plugin is plugin and "ctx" in impl.argnames:
                        self._bind_context(impl, plugin_name, concern)
        return plugin_name

    def _bind_context(self, impl: Any, plugin_name: str, concern: type[PluginContext]) -> None:
        function, names = impl.function, tuple(a for a in impl.argnames if a != "ctx")
        context = self._owner.context

        def with_context(*args: Any) -> Any:
            return function(ctx=context(plugin_name, concern), **dict(zip(names, args, strict=True)))

        with_context.__wrapped__ = function  # type: ignore[attr-defined]
        impl.function, impl.argnames = with_context, names


class _ContextCall:
    """One hook of :class:`ContextHookRelay`: pluggy's caller, with the ``ctx`` slot filled per implementation."""

    __slots__ = ("_caller",)

    def __init__(self, caller: pluggy.HookCaller) -> None:
        self._caller = caller

    def __call__(self, **kwargs: Any) -> Any:
        # every implementation that takes ctx was wrapped to fetch its own (ContextPluginManager._bind_context);
        # ctx=None only tells pluggy the spec's argument is accounted for
        return self._caller(ctx=None, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._caller, name)


class ContextHookRelay:
    """``plugins.hook.mindie_host_xxx(**kwargs)``: call a hook without passing ``ctx``."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm
        self._calls: dict[str, _ContextCall] = {}

    def __getattr__(self, name: str) -> _ContextCall:
        call = self._calls.get(name)
        if call is None:
            call = self._calls[name] = _ContextCall(getattr(self._pm.hook, name))
        return call


class PluginHost:
    """The pluggy manager, the bookkeeping of what is enabled, and each plugin's context.

    One ``PluginHost`` serves one engine: :meth:`bind` ties it to the config,
    the model entry and the :class:`~mindie_host.host_protocol.Host`, which every
    context carries; each plugin's ``Params`` and ``State`` are made once here.
    """

    def __init__(self) -> None:
        #: the model families the registered plugins provide (asked of them on first use)
        self.architectures = Architectures(lambda: self.hook.mindie_host_model_architectures())
        self.pm = ContextPluginManager(self)
        self.pm.add_hookspecs(hookspecs)
        self.enabled: list[str] = []
        # `mindie-host serve` loads the model on the main thread while the HTTP thread starts; both enable plugins
        self._enable_lock = threading.Lock()
        self._config: Config | None = None
        self._model: ModelConfig | None = None
        self._host: Host | None = None
        self._params: dict[str, Any] = {}
        self._states: dict[str, Any] = {}
        self._contexts: dict[tuple[str, type[PluginContext]], PluginContext] = {}
        self._context_lock = threading.Lock()
        self._relay = ContextHookRelay(self.pm)
        for module_name in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(module_name), name=f"builtin:{module_name}")

    @property
    def hook(self) -> ContextHookRelay:
        """Call a hook: ``plugins.hook.mindie_host_plan_step(state=state)``; each implementation gets its ``ctx``."""
        return self._relay

    def call_observers(self, name: str, **kwargs: Any) -> None:
        """Call every implementation of hook ``name``; one that raises is logged and skipped.

        For observers (``mindie_host_step_outputs``) whose failure must not reach requests.
        """
        for impl in reversed(getattr(self.pm.hook, name).get_hookimpls()):
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception:
                log.exception("plugin %s failed in %s", impl.plugin_name, name)

    # -- contexts ------------------------------------------------------------------------------
    def bind(self, config: Config, model: ModelConfig | None = None, host: Host | None = None) -> None:
        """Set what every context carries: the config, the served model entry and the running host."""
        with self._context_lock:
            self._config, self._model, self._host = config, model or config.model, host
            self._contexts.clear()

    def context(self, name: str, concern: type[PluginContext]) -> PluginContext:
        """The context of plugin ``name`` for hooks of ``concern`` (built once, then cached)."""
        key = (name, concern)
        ctx = self._contexts.get(key)
        if ctx is not None:
            return ctx
        if self._config is None:
            raise PluginError(f"plugin {name!r} was called before the plugin host was bound to a config")
        plugin = self.pm.get_plugin(name)
        with self._context_lock:
            fields: dict[str, Any] = {
                "plugin": name,
                "config": self._config,
                "model": self._model,
                "params": self.params(name, plugin),
                "log": plugin_logger(name),
                "state": self.state(name, plugin),
            }
            if "host" in concern.__dataclass_fields__:
                fields["host"] = self._host
            if "architectures" in concern.__dataclass_fields__:
                fields["architectures"] = self.architectures
            ctx = self._contexts[key] = concern(**fields)
        return ctx

    def params(self, name: str, plugin: object) -> Any:
        """Plugin ``name``'s validated ``Params`` (validated on first use; bad ones raise :class:`PluginError`)."""
        if name not in self._params:
            assert self._config is not None
            value, errors = validate_params(name, declared_params(plugin), self._section(name, plugin))
            if errors:
                raise PluginError("plugin configuration rejected:\n  " + "\n  ".join(errors))
            self._params[name] = value
        return self._params[name]

    def state(self, name: str, plugin: object | None = None) -> Any:
        """Plugin ``name``'s per-engine ``State`` instance (made on first use), or ``None``."""
        if name not in self._states:
            plugin = plugin if plugin is not None else self.pm.get_plugin(name)
            factory = declared_state(plugin)
            self._states[name] = factory() if factory is not None else None
        return self._states[name]

    def _section(self, name: str, plugin: object) -> Any:
        """``Plugins.<name>``, or ``None`` when the plugin still reads its section in its own validate hook."""
        assert self._config is not None
        section = self._config.Plugins.get(name)
        legacy = declared_params(plugin) is None and hasattr(plugin, "mindie_host_validate_config")
        return None if legacy else section

    def register(self, plugin: object, name: str) -> None:
        """Register an already-imported plugin object (tests and embedding use this)."""
        self.pm.register(plugin, name=name)
        self.architectures.reset()
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
            self._load(name, ep)
        if self._config is None:  # the families' hook may take ctx
            self.bind(config)
        for model in config.BackendConfig.ModelDeployConfig.ModelConfig:
            if model.modelInstanceType != "StandardMock":  # it reads no checkpoint
                self._enable_architecture(model, available)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:  # a hook no spec declares (a misspelt name): one message
            name = self.pm.get_name(exc.plugin) or "?"
            raise PluginError(f"plugin {name!r}: {exc}; the hooks are the functions of mindie_host/hookspecs.py "
                              f"(docs/plugins.md, 'The hooks')") from exc

    def _load(self, name: str, ep: md.EntryPoint) -> None:
        """Import and register the plugin of entry point ``ep`` as ``name``."""
        try:
            plugin = ep.load()
        except Exception as exc:  # an import error inside the plugin
            raise PluginError(f"plugin {name!r} ({ep.value}) failed to import: {exc}") from exc
        self.register(plugin, name)
        adopt_logger(ep.module.split(".")[0])  # the plugin's own `logging.getLogger(__name__)` lines

    def _enable_architecture(self, model: ModelConfig, available: dict[str, md.EntryPoint]) -> None:
        """Enable the installed plugin that provides the checkpoint's model type, when no registered plugin does.

        Only the plugins that declare the model type in the ``mindie_host.architectures`` group are imported. A
        checkpoint that cannot be read is left to the backend, which says why (so is one that the plugin serving its
        model type, once enabled, refuses: a GGUF file whose tensors are not its family's); a model type that a
        plugin we publish would serve, with that plugin not installed, is refused with the command that installs it.
        """
        from .models.architecture import ModelLoadError
        from .models.default import default_model_path
        from .models.weights import checkpoint_model_type, family_of, resolve_model

        def served() -> bool:  # a GGUF file's family is told by its tensors too (Mixtral is written as llama)
            try:
                family_of(source, self.architectures)
            except (ModelLoadError, OSError, ValueError):  # the backend says why the checkpoint cannot be read
                return False
            return True

        try:
            source = resolve_model(model.modelWeightPath or str(default_model_path()))
            model_type = checkpoint_model_type(source)
        except Exception:  # the backend reports an unreadable checkpoint (and backends that read other formats)
            return
        if served():
            return
        for ep in md.entry_points(group=ARCHITECTURE_GROUP, name=model_type):
            dist = getattr(ep, "dist", None)
            names = [p.name for p in (dist.entry_points if dist is not None else []) if p.group == ENTRY_POINT_GROUP]
            for name in names:
                if not self.pm.has_plugin(name) and name in available:
                    self._load(name, available[name])
                    log.info("model_type %r is served by the installed plugin %r (%s): enabled", model_type, name,
                             dist.metadata["Name"] if dist is not None else "?")
            if served():
                return
        known = KNOWN_ARCHITECTURES.get(model_type)
        if known is not None and not self.pm.has_plugin(known):
            raise PluginError(
                f"model_type {model_type!r} ({source.path}) is not served by any installed plugin: "
                f"{install_hint(known)} (the host itself serves {', '.join(self.architectures.model_types())})"
            )

    def validate(self, config: Config) -> list[str]:
        """Validate each enabled plugin's ``Params`` and run every config validation hook.

        :return: every error message (each names the plugin's key), empty when the config is fine.
        """
        if self._config is not config:
            self.bind(config, self._model, self._host)
        errors = [f"Plugins.{name}: no enabled plugin is named {name!r} (enabled: {', '.join(self.enabled) or 'none'}); "
                  "enable it in ModelConfig.plugin_params or remove the section"
                  for name in config.Plugins if name not in self.enabled]
        rejected: set[str] = set()
        for name in self.enabled:
            plugin = self.pm.get_plugin(name)
            if plugin is None or name in self._params:
                continue
            value, problems = validate_params(name, declared_params(plugin), self._section(name, plugin))
            errors.extend(problems)
            if problems:
                rejected.add(name)
            else:
                self._params[name] = value
        model = self._model
        # each plugin's own checks too, all problems in one report: one whose Params were rejected is checked with
        # ctx.params None, and a check of its that needs them is skipped (the rejection is reported already)
        self._params.update(dict.fromkeys(rejected))
        try:
            for entry in config.BackendConfig.ModelDeployConfig.ModelConfig:
                self.bind(config, entry, self._host)
                for impl in reversed(self.pm.hook.mindie_host_validate_config.get_hookimpls()):
                    try:
                        errors.extend(impl.function() or [])  # its ctx carries the config and the entry
                    except Exception:
                        if impl.plugin_name not in rejected:
                            raise
        finally:
            for name in rejected:
                self._params.pop(name, None)
            self.bind(config, model, self._host)
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
