"""The ``multi_lora`` plugin: its hook implementations.

* ``mindie_host_validate_config`` checks ``Plugins.multi_lora``.
* ``mindie_host_startup`` reads ``lora_adapter.json`` (and ``Plugins.multi_lora.adapters``),
  checks every adapter against the base model, builds the slot pools and hands
  the runtime to the backend (:meth:`ModelBackend.set_lora`).
* ``mindie_host_refine_request`` maps ``model`` / ``adapter_id`` to an adapter
  (404 for an unknown one), and sets ``adapter``, ``adapter_index`` and ``cache_salt``.
* ``mindie_host_filter_waiting`` binds waiting requests to resident slots
  (loading a non-resident adapter when a slot frees); ``mindie_host_request_finished``
  unbinds them.
* ``mindie_host_add_routes`` (management plane): ``POST /v1/load_lora_adapter``,
  ``POST /v1/unload_lora_adapter``, ``GET /v1/lora_adapters``. Runtime loading is off
  unless ``Plugins.multi_lora.runtimeAdapterDir`` names a directory, and loads only
  from inside it; its errors say nothing about paths outside it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from mindie_host import hookimpl
from mindie_host.api import EngineRequest, RequestError, SequenceView

from .adapters import NAME_PATTERN, NAME_RULE, AdapterError, ModelDims, load_adapter, read_adapter_list
from .registry import AdapterRegistry
from .runtime import KERNELS, LoraRuntime

log = logging.getLogger("mindie_plugin_multi_lora")

NAME = "multi_lora"

#: ``Plugins.multi_lora`` keys: name -> (default, checker, allowed text).
DEFAULTS: dict[str, Any] = {
    "maxLoras": 8,
    "maxLoraRank": 16,
    "adapters": {},
    "kernel": "auto",
    "unloadTimeoutS": 60.0,
    "runtimeUpdates": True,
    "runtimeAdapterDir": "",
}

#: Registries of the hosts running in this process (one per Host).
_REGISTRIES: list[AdapterRegistry] = []


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plugin_settings(config: Any) -> dict[str, Any]:
    """``Plugins.multi_lora`` merged over the defaults (unchecked)."""
    section = (getattr(config, "Plugins", None) or {}).get(NAME) or {}
    return {**DEFAULTS, **section} if isinstance(section, dict) else dict(DEFAULTS)


def check_settings(config: Any) -> list[str]:
    """Error messages for ``Plugins.multi_lora`` (each names the key, the value and the allowed range)."""
    section = (getattr(config, "Plugins", None) or {}).get(NAME)
    if section is None:
        return []
    if not isinstance(section, dict):
        return [f"Plugins.multi_lora: got {section!r}; allowed a JSON object"]
    errors: list[str] = []
    s = {**DEFAULTS, **section}

    def bad(key: str, allowed: str) -> None:
        errors.append(f"Plugins.multi_lora.{key}: got {s[key]!r}; allowed {allowed}")

    if not (_is_int(s["maxLoras"]) and 1 <= s["maxLoras"] <= 256):
        bad("maxLoras", "an integer in [1, 256]")
    if not (_is_int(s["maxLoraRank"]) and 1 <= s["maxLoraRank"] <= 512):
        bad("maxLoraRank", "an integer in [1, 512]")
    if s["kernel"] not in KERNELS:
        bad("kernel", "one of " + ", ".join(repr(k) for k in KERNELS))
    t = s["unloadTimeoutS"]
    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 3600):
        bad("unloadTimeoutS", "a number in (0, 3600]")
    if not isinstance(s["runtimeUpdates"], bool):
        bad("runtimeUpdates", "true or false")
    root = s["runtimeAdapterDir"]
    if not isinstance(root, str) or (root and not Path(root).expanduser().is_dir()):
        bad("runtimeAdapterDir", '"" (runtime loading off) or an existing directory')
    adapters = s["adapters"]
    if not isinstance(adapters, dict) or not all(
        isinstance(k, str) and NAME_PATTERN.match(k) and isinstance(v, str) and v for k, v in adapters.items()
    ):
        bad("adapters", f'a JSON object {{"name": "path"}}; names are {NAME_RULE}, paths non-empty strings')
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        log.warning("Plugins.multi_lora: unknown keys %s ignored (known: %s)", unknown, ", ".join(DEFAULTS))
    return errors


def _registry(host: Any) -> AdapterRegistry | None:
    return host.state.get(NAME)


# ---------------------------------------------------------------------------------------------
# lifecycle
# ---------------------------------------------------------------------------------------------
@hookimpl
def mindie_host_validate_config(config: Any, model_config: Any) -> list[str] | None:
    """Check ``Plugins.multi_lora`` when this plugin is enabled for ``model_config``."""
    if NAME not in getattr(model_config, "plugins", []):
        return None
    return check_settings(config)


def _adapter_sources(host: Any, settings: dict[str, Any]) -> dict[str, str]:
    sources: dict[str, str] = {}
    weight_path = host.model_config.modelWeightPath
    if weight_path:
        p = Path(weight_path).expanduser()
        sources.update(read_adapter_list(p if p.is_dir() else p.parent))
    sources.update(settings["adapters"])
    return sources


@hookimpl
def mindie_host_startup(host: Any) -> None:
    """Load and check every listed adapter, build the pools, attach the runtime to the backend."""
    if NAME not in host.model_config.plugins:
        return
    settings = plugin_settings(host.config)
    info = host.info
    dims = ModelDims.from_info(info)
    device = torch.device("cuda") if str(info.device).startswith("cuda") else torch.device("cpu")
    dtype = getattr(torch, str(info.dtype), torch.float32)
    runtime = LoraRuntime(dims, settings["maxLoras"], settings["maxLoraRank"], device=device, dtype=dtype,
                          kernel=settings["kernel"])
    if host.backend is None or not host.backend.set_lora(runtime):
        raise RuntimeError(
            f"plugin multi_lora: backendType {host.model_config.backendType!r} does not apply LoRA runtimes "
            "(ModelBackend.set_lora returned False)"
        )
    registry = AdapterRegistry(runtime, host.adapters)
    for name, path in _adapter_sources(host, settings).items():
        if name == host.model_name:
            raise AdapterError(name, "name", "an adapter may not take the base model's name")
        registry.add(load_adapter(name, path, dims, settings["maxLoraRank"]))
    registry.preload()
    host.state[NAME] = registry
    _REGISTRIES.append(registry)
    log.info(
        "multi_lora: %d adapters known, %d slots of rank %d (%.1f MiB of pools), kernel %s",
        len(registry.entries), runtime.slots, runtime.rank, runtime.pool_bytes() / 2**20, runtime.kernel,
    )


@hookimpl
def mindie_host_shutdown(host: Any) -> None:
    registry = host.state.pop(NAME, None)
    if registry in _REGISTRIES:
        _REGISTRIES.remove(registry)
    if host.backend is not None and registry is not None:
        host.backend.set_lora(None)


@hookimpl
def mindie_host_metrics(host: Any) -> dict[str, float] | None:
    registry = _registry(host)
    return registry.metrics() if registry is not None else None


# ---------------------------------------------------------------------------------------------
# request parsing
# ---------------------------------------------------------------------------------------------
def _adapter_id(body: dict[str, Any], protocol: str) -> tuple[Any, str] | None:
    """The raw ``adapter_id`` a request names, with its field path; None when absent."""
    params = body.get("parameters")
    if protocol in ("tgi", "triton", "native") and isinstance(params, dict) and "adapter_id" in params:
        return params["adapter_id"], "parameters.adapter_id"
    if protocol == "vllm" and "adapter_id" in body:
        return body["adapter_id"], "adapter_id"
    return None


def _is_base(host: Any, model: str) -> bool:
    if model == host.model_name:
        return True
    weight_path = host.model_config.modelWeightPath
    if not weight_path:
        return False
    try:
        return Path(model).expanduser().resolve() == Path(weight_path).expanduser().resolve()
    except (OSError, ValueError, RuntimeError):  # not a path at all
        return False


def select_adapter(host: Any, body: dict[str, Any], protocol: str) -> tuple[str, str] | None:
    """(adapter name, field) the request selects, or None for the base model; raises RequestError."""
    found = _adapter_id(body, protocol)
    chosen: tuple[str, str] | None = None
    if found is not None:
        value, field = found
        if value is not None and value != "None":
            if not isinstance(value, str) or not NAME_PATTERN.match(value):
                raise RequestError("The format of adapter_id is invalid.", status=422, field=field)
            chosen = (value, field)
    model = body.get("model") if protocol in ("openai", "vllm") else None
    if isinstance(model, str) and model and model != "None" and not _is_base(host, model):
        registry = _registry(host)
        known = registry is not None and model in registry.entries  # unloading ones too: they 404 below
        if protocol == "vllm" or known:
            if chosen is not None and chosen[0] != model:
                raise RequestError(
                    f"model {model!r} and {chosen[1]} {chosen[0]!r} name different adapters", field=chosen[1]
                )
            chosen = (model, "model")
    return chosen


@hookimpl
def mindie_host_refine_request(request: EngineRequest, body: dict[str, Any], protocol: str, host: Any) -> None:
    """Resolve the adapter; set ``adapter``, ``adapter_index`` (current slot) and ``cache_salt``."""
    registry = _registry(host)
    if registry is None:
        return
    chosen = select_adapter(host, body, protocol)
    if chosen is None:
        return
    name, field = chosen
    entry = registry.get(name)
    if entry is None:
        known = ", ".join(sorted(registry.entries)) or "none"
        raise RequestError(f"LoRA adapter {name!r} not found (loaded: {known})", status=404, field=field)
    request.adapter = name
    request.adapter_index = entry.slot
    salt = {"lora": entry.salt}
    if request.cache_salt is not None:
        salt["salt"] = request.cache_salt
    request.cache_salt = json.dumps(salt, sort_keys=True, separators=(",", ":"))
    registry.track(request, entry)


# ---------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------
@hookimpl
def mindie_host_filter_waiting(waiting: list[SequenceView]) -> list[SequenceView] | None:
    """Bind waiting adapter requests to resident slots; hold back those with no slot to get."""
    registries = list(_REGISTRIES)
    if not registries:
        return None
    allowed: list[SequenceView] = []
    for seq in waiting:
        owner = next((r for r in registries if r.owns(seq.request_id)), None)
        if owner is None or owner.bind(seq.request_id):
            allowed.append(seq)
    return allowed


@hookimpl
def mindie_host_request_finished(request: EngineRequest, reason: str) -> None:
    """Release the request's slot binding."""
    if request.adapter is None:
        return
    for registry in list(_REGISTRIES):
        if registry.owns(request.request_id):
            registry.finished(request.request_id)
            return


# ---------------------------------------------------------------------------------------------
# management routes
# ---------------------------------------------------------------------------------------------
def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json")


async def _body(request: Request, host: Any) -> dict[str, Any]:
    """The JSON object body, capped at ``maxRequestBodyBytes``."""
    limit = host.config.server.maxRequestBodyBytes
    raw = await request.body()
    if len(raw) > limit:
        raise RequestError(f"request body of {len(raw)} bytes exceeds the {limit}-byte limit", status=413, field="body")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError("body is nested too deeply", status=400, field="body") from None
    except ValueError as exc:
        raise RequestError(f"body is not valid JSON: {exc}", status=400, field="body") from exc
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object", field="body")
    return body


def _string(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        raise RequestError(f"{key} is required", field=key)
    if not isinstance(value, str) or not value:
        raise RequestError(f"{key} must be a non-empty string", field=key)
    return value


def runtime_adapter_path(root: str, lora_path: str) -> Path:
    """The adapter directory ``lora_path`` names inside the allow-listed ``root`` (403 for anything else).

    ``lora_path`` is relative to ``root`` or an absolute path under it; symbolic links
    are resolved first, so none leads out. The refusal is the same whether or not
    the path exists, and never echoes it.
    """
    if not root:
        raise RequestError(
            "loading adapters at runtime is off: set Plugins.multi_lora.runtimeAdapterDir to the directory "
            "adapters may be loaded from", status=403, field="lora_path",
        )
    base = Path(root).expanduser().resolve()
    refused = RequestError(
        "lora_path must name an adapter directory inside Plugins.multi_lora.runtimeAdapterDir "
        "(relative to it, or an absolute path under it)", status=403, field="lora_path",
    )
    if "\x00" in lora_path:
        raise refused
    try:
        candidate = (base / Path(lora_path).expanduser()).resolve()
    except (OSError, RuntimeError, ValueError):
        raise refused from None
    if candidate == base or not candidate.is_relative_to(base):
        raise refused
    for name in ("adapter_config.json", "adapter_model.safetensors"):  # a file may not link out either
        inner = candidate / name
        if inner.is_symlink() and not inner.resolve().is_relative_to(base):
            raise refused
    return candidate


def _ready_registry(host: Any) -> AdapterRegistry:
    registry = _registry(host)
    if registry is None:
        raise RequestError("multi_lora is not running (model still loading or plugin not enabled)", status=503)
    return registry


@hookimpl
def mindie_host_add_routes(app: FastAPI, host: Any, plane: str) -> None:
    """Runtime adapter management on the management plane."""
    if plane != "management" or NAME not in host.model_config.plugins:
        return
    settings = plugin_settings(host.config)

    def check_updates() -> None:
        if not settings["runtimeUpdates"]:
            raise RequestError("runtime adapter updates are disabled (Plugins.multi_lora.runtimeUpdates)", status=403)

    @app.get("/v1/lora_adapters")
    async def list_adapters() -> Response:
        registry = _ready_registry(host)
        return _json({"adapters": registry.describe(), "slots": registry.runtime.slots,
                      "max_rank": registry.runtime.rank})

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        check_updates()
        registry = _ready_registry(host)
        body = await _body(request, host)
        name = _string(body, "lora_name")
        path = runtime_adapter_path(settings["runtimeAdapterDir"], _string(body, "lora_path"))
        if not NAME_PATTERN.match(name):
            raise RequestError(f"lora_name must be {NAME_RULE}", field="lora_name")
        if name == host.model_name or name in registry.entries:
            raise RequestError(f"LoRA adapter {name!r} is already loaded", status=409, field="lora_name")
        dims = ModelDims.from_info(host.info)
        try:
            adapter = await asyncio.to_thread(load_adapter, name, path, dims, registry.runtime.rank)
        except AdapterError as exc:
            raise RequestError(str(exc), status=422, field="lora_path") from exc
        try:
            registry.add(adapter)
        except KeyError as exc:
            raise RequestError(f"LoRA adapter {name!r} is already loaded", status=409, field="lora_name") from exc
        log.info("multi_lora: loaded adapter %s (rank %d) from %s", name, adapter.rank, path)
        return _json({"status": "loaded", "lora_name": name, "rank": adapter.rank, "modules": adapter.modules})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        check_updates()
        registry = _ready_registry(host)
        body = await _body(request, host)
        name = _string(body, "lora_name")
        if registry.begin_unload(name) is None:
            raise RequestError(f"LoRA adapter {name!r} not found", status=404, field="lora_name")
        deadline = time.monotonic() + float(settings["unloadTimeoutS"])
        while not registry.remove(name):
            if time.monotonic() > deadline:
                busy = registry.inflight(name)
                registry.cancel_unload(name)
                raise RequestError(
                    f"LoRA adapter {name!r} still has {busy} requests in flight after "
                    f"{settings['unloadTimeoutS']} s; it stays loaded",
                    status=409, field="lora_name",
                )
            await asyncio.sleep(0.02)
        log.info("multi_lora: unloaded adapter %s", name)
        return _json({"status": "unloaded", "lora_name": name})
