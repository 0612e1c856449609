"""The typed context every hook implementation takes as its ``ctx`` argument.

A hook implementation takes ``ctx`` first and receives a frozen dataclass
built for *its own* plugin, of the shape its hook needs::

    @hookimpl
    def mindie_host_kv_cache_manager(ctx: EngineContext, num_blocks: int, block_size: int):
        ctx.log.info("pool of %d blocks", num_blocks)
        ctx.state.manager = MyManager(num_blocks, block_size, ctx.params.numBlocks)
        return ctx.state.manager

What a context carries (:class:`PluginContext`): the whole config, the model
entry being served, the plugin's own validated parameters, a logger named
``mindie_host.plugins.<name>`` and the plugin's per-engine state object. There
is one context class per shape: :class:`HostContext` adds the running host (the
lifecycle and request-parsing hooks), :class:`BackendContext` the model families
(the model-backend hooks), and :class:`EngineContext` adds nothing (the
scheduling and KV-cache hooks, which run in the engine).

A plugin declares its parameters and its state as attributes of the plugin
module (or object):

* ``Params``: a pydantic model or a dataclass. The host validates the plugin's
  ``config.json`` section, ``Plugins.<name>``, into it before anything loads;
  an unknown key or a wrong type stops startup with an error that names
  ``Plugins.<name>.<key>``. Without ``Params`` a non-empty section is refused
  (never silently ignored) and ``ctx.params`` is ``None``.
* ``State``: any class with a zero-argument constructor. One instance is made
  per plugin and engine, on first use, and every hook of that plugin sees the
  same one as ``ctx.state`` (``None`` without ``State``). It replaces module
  globals keyed by object id.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config, ModelConfig
    from .host_protocol import Host
    from .models.architecture import Architectures

#: Logger names of plugins hang under this one.
PLUGIN_LOGGER_PREFIX = "mindie_host.plugins"


@dataclass(frozen=True)
class PluginContext:
    """What every hook implementation receives as ``ctx`` (the base of the concern types).

    :ivar plugin: the plugin's registered name (its entry-point name, e.g.
        ``"prefix_cache"``; builtins are ``"builtin:<module>"``).
    :ivar config: the whole parsed ``config.json`` (:class:`~mindie_host.config.Config`).
    :ivar model: the ``ModelConfig`` entry this engine serves.
    :ivar params: the plugin's validated parameters: an instance of its declared
        ``Params`` built from ``Plugins.<name>``, or ``None`` if it declares none.
    :ivar log: the plugin's logger, ``mindie_host.plugins.<name>``.
    :ivar state: the plugin's per-engine state: one instance of its declared
        ``State`` class shared by all its hooks, or ``None`` if it declares none.
    """

    plugin: str
    config: Config
    model: ModelConfig
    params: Any
    log: logging.Logger
    state: Any


@dataclass(frozen=True)
class HostContext(PluginContext):
    """Context of the hooks that run beside the running host: the lifecycle hooks (config validation,
    startup, shutdown, metrics, step outputs, engine commands, engine restarts) and the request-parsing
    hooks (routes, request refinement, request arrival and end, tool-call and reasoning parsers, served
    model names).

    :ivar host: the running :class:`~mindie_host.host_protocol.Host` (tokenizer, limits, statistics,
        ``generate``); ``None`` during ``mindie_host_validate_config``, which runs before anything is loaded.
    """

    host: Host | None = None


@dataclass(frozen=True)
class EngineContext(PluginContext):
    """Context of the hooks the engine calls while it schedules: the scheduling-policy hooks (queue order,
    admission filter, step plan, preemption, draft tokens) and the KV-cache hooks (the block manager, the
    connector).

    These run on the engine thread (in the engine process when ``engineProcess`` is on), the scheduling
    ones once per step: keep them cheap. ``config.schedule`` holds the ``ScheduleConfig`` limits; the pool
    size and block size come as hook arguments.
    """


@dataclass(frozen=True)
class BackendContext(PluginContext):
    """Context of the model-backend hooks: building the runner for a ``backendType``, per-row variants, the
    model families.

    :ivar architectures: the model families the registered plugins provide, by ``model_type``
        (:class:`~mindie_host.models.architecture.Architectures`, asked of the plugins on first use): a backend
        reads its checkpoint through the family that serves it.
    """

    architectures: Architectures | None = None


#: Which context type each hook receives.
HOOK_CONCERNS: dict[str, type[PluginContext]] = {
    "mindie_host_validate_config": HostContext,
    "mindie_host_startup": HostContext,
    "mindie_host_shutdown": HostContext,
    "mindie_host_metrics": HostContext,
    "mindie_host_step_outputs": HostContext,
    "mindie_host_engine_command": HostContext,
    "mindie_host_engine_restarted": HostContext,
    "mindie_host_add_routes": HostContext,
    "mindie_host_refine_request": HostContext,
    "mindie_host_request_arrived": HostContext,
    "mindie_host_request_finished": HostContext,
    "mindie_host_tool_call_parser": HostContext,
    "mindie_host_reasoning_parser": HostContext,
    "mindie_host_served_models": HostContext,
    "mindie_host_order_waiting": EngineContext,
    "mindie_host_order_running": EngineContext,
    "mindie_host_filter_waiting": EngineContext,
    "mindie_host_plan_step": EngineContext,
    "mindie_host_preemption_victim": EngineContext,
    "mindie_host_propose_drafts": EngineContext,
    "mindie_host_drafts_accepted": EngineContext,
    "mindie_host_kv_cache_manager": EngineContext,
    "mindie_host_kv_connector": EngineContext,
    "mindie_host_model_backend": BackendContext,
    "mindie_host_backend_types": BackendContext,
    "mindie_host_linear_deltas": BackendContext,
    "mindie_host_model_architectures": BackendContext,
}

#: Contract 2's context classes, merged in contract 3 into the class of their shape (old name -> new name).
RENAMED_CONTEXTS: dict[str, str] = {
    "LifecycleContext": "HostContext",
    "RequestContext": "HostContext",
    "SchedulingContext": "EngineContext",
    "KVContext": "EngineContext",
}


def concern_of(hook_name: str) -> type[PluginContext]:
    """The context type of ``hook_name`` (hooks added later without an entry get :class:`HostContext`)."""
    return HOOK_CONCERNS.get(hook_name, HostContext)


def plugin_logger(name: str) -> logging.Logger:
    """``mindie_host.plugins.<name>`` (a builtin's ``builtin:pkg.mod`` becomes ``builtin.pkg.mod``)."""
    return logging.getLogger(f"{PLUGIN_LOGGER_PREFIX}.{name.replace(':', '.')}")


def declared_params(plugin: object) -> type | None:
    """The plugin's ``Params`` declaration (a pydantic model or a dataclass), or ``None``."""
    return getattr(plugin, "Params", None)


def declared_state(plugin: object) -> type | None:
    """The plugin's ``State`` declaration (a zero-argument class), or ``None``."""
    return getattr(plugin, "State", None)


def param_fields(schema: type) -> dict[str, tuple[str, Any]]:
    """Each parameter of a ``Params`` schema: name -> (type text, default or ``...`` when required)."""
    fields: dict[str, tuple[str, Any]] = {}
    model_fields = getattr(schema, "model_fields", None)
    if model_fields is not None:  # a pydantic model
        for name, f in model_fields.items():
            key = f.alias or name
            text = _type_text(f.annotation) + _bounds_text(f.metadata)
            fields[key] = (text, ... if f.is_required() else f.get_default(call_default_factory=True))
        return fields
    if dataclasses.is_dataclass(schema):
        for f in dataclasses.fields(schema):
            if f.default is not dataclasses.MISSING:
                default: Any = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = ...
            fields[f.name] = (_type_text(f.type), default)
        return fields
    raise TypeError(f"Params must be a pydantic model or a dataclass, not {schema!r}")


def _bounds_text(metadata: list[Any]) -> str:
    """`` in [lo, hi]`` (or half-open) from a pydantic field's ``ge``/``gt``/``le``/``lt`` constraints."""
    bounds = {name: getattr(m, name) for m in metadata for name in ("ge", "gt", "le", "lt")
              if type(m).__name__.lower() == name}
    if not bounds:
        return ""
    lo = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}" if "gt" in bounds else "(-inf"
    hi = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})" if "lt" in bounds else "inf)"
    return f" in {lo}, {hi}"


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def validate_params(name: str, schema: type | None, section: Any) -> tuple[Any, list[str]]:
    """Validate ``Plugins.<name>`` against the plugin's ``Params``.

    :return: (the parameters object or ``None``, error messages that each name
        ``Plugins.<name>.<key>``, the value given and what is allowed).
    """
    where = f"Plugins.{name}"
    if section is None:
        section = {}
    if not isinstance(section, dict):
        return None, [f"{where}: got {section!r}; allowed a JSON object"]
    if schema is None:
        if section:
            return None, [f"{where}: plugin {name!r} declares no parameters, so keys {sorted(section)} would be "
                          "ignored; remove them"]
        return None, []
    import pydantic  # deferred: only plugins that declare parameters pay for it

    known = param_fields(schema)
    errors = [f"{where}.{key}: not a parameter of plugin {name!r} (allowed: {', '.join(known) or 'none'})"
              for key in sorted(set(section) - set(known))]
    try:
        params = pydantic.TypeAdapter(schema).validate_python({k: v for k, v in section.items() if k in known})
        return (None, errors) if errors else (params, [])
    except pydantic.ValidationError as exc:
        for err in exc.errors():
            key = ".".join(str(p) for p in err["loc"])
            given = section.get(err["loc"][0], "(missing)") if err["loc"] else section
            allowed = known.get(str(err["loc"][0]), ("a valid value", None))[0] if err["loc"] else "a JSON object"
            why = err["msg"].removeprefix("Input should be ").removeprefix("Value error, ")
            errors.append(f"{where}.{key}: got {given!r}; allowed: {allowed} ({why})")
        return None, errors
