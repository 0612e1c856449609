"""The ``multi_lora`` plugin: its hook implementations.

* ``Params`` declares ``Plugins.multi_lora`` (the host validates it); ``State`` holds the
  runtime and the adapter registry of one engine.
* ``mindie_host_linear_deltas`` builds the slot pools (:class:`LoraRuntime`), which the
  host hands to the backend: the core's generic per-row linear-delta seam.
* ``mindie_host_startup`` reads ``lora_adapter.json`` (and ``Plugins.multi_lora.adapters``)
  and checks every adapter against the base model.
* ``mindie_host_refine_request`` maps ``model`` / ``adapter_id`` to an adapter
  (404 for an unknown one), and sets the request's ``variant`` (its slot),
  ``extensions["multi_lora"]`` (the adapter name) and ``cache_salt``.
* ``mindie_host_served_models`` lists the adapters beside the base model (``/v1/models``).
* ``mindie_host_filter_waiting`` binds waiting requests to resident slots
  (loading a non-resident adapter when a slot frees); ``mindie_host_request_finished``
  unbinds them.
* ``mindie_host_add_routes`` (management plane): ``POST /v1/load_lora_adapter``,
  ``POST /v1/unload_lora_adapter``, ``GET /v1/lora_adapters``. Runtime loading is off
  unless ``Plugins.multi_lora.runtimeAdapterDir`` names a directory, and loads only
  from inside it; its errors say nothing about paths outside it.

With ``ServerConfig.engineProcess`` the runtime and the registry live in the engine process
(linear deltas, startup there, the admission filter, ``mindie_host_request_arrived``, which
tracks the engine's copy of each request, and ``mindie_host_engine_command``, which loads,
unloads and lists adapters); the front end keeps an :class:`~.control.AdapterCatalogue` of
the names requests may select, and its routes act through engine commands (:mod:`.control`).
Adapters loaded at run time do not survive an engine restart (``mindie_host_engine_restarted``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from mindie_host.api import (
    BackendContext,
    EngineContext,
    EngineRequest,
    HostContext,
    LinearDeltas,
    ModelConfig,
    ModelInfo,
    RequestError,
    RequestOutput,
    SequenceView,
    hookimpl,
)
from pydantic import BaseModel, Field, StrictBool, StrictInt, field_validator

from .adapters import NAME_PATTERN, NAME_RULE, AdapterError, ModelDims, load_adapter, read_adapter_list
from .control import AdapterCatalogue, AdapterControl, EngineAdapters, LocalAdapters, engine_command
from .registry import AdapterRegistry
from .runtime import KERNELS, LoraRuntime

NAME = "multi_lora"

class Params(BaseModel):
    """``Plugins.multi_lora``: slot pools, the adapters to load at startup, runtime loading."""

    #: adapters resident at once (the slot pools' size)
    maxLoras: StrictInt = Field(default=8, ge=1, le=256)
    #: the largest rank a slot holds
    maxLoraRank: StrictInt = Field(default=16, ge=1, le=512)
    #: adapters to load at startup, name -> PEFT directory (besides ``lora_adapter.json``)
    adapters: dict[str, str] = Field(default_factory=dict)
    #: the kernel: ``auto``, or one of the runtime's kernels
    kernel: Literal[KERNELS] = "auto"  # type: ignore[valid-type]
    #: how long an unload waits for the adapter's requests, in seconds
    unloadTimeoutS: float = Field(default=60.0, gt=0, le=3600)
    #: allow the load/unload routes at all
    runtimeUpdates: StrictBool = True
    #: the directory runtime loads may read from ("" = runtime loading off)
    runtimeAdapterDir: str = ""

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, value: dict[str, str]) -> dict[str, str]:
        if not all(NAME_PATTERN.match(k) and v for k, v in value.items()):
            raise ValueError(f'a JSON object {{"name": "path"}}; names are {NAME_RULE}, paths non-empty strings')
        return value

    @field_validator("runtimeAdapterDir")
    @classmethod
    def _existing_dir(cls, value: str) -> str:
        if value and not Path(value).expanduser().is_dir():
            raise ValueError('"" (runtime loading off) or an existing directory')
        return value


class State:
    """One engine's LoRA runtime (the slot pools) and adapter registry, and what the routes act on.

    Beside the model, ``catalogue`` is the registry itself; in the front end of an engine
    process it is an :class:`AdapterCatalogue` and ``runtime``/``registry`` stay ``None``.
    """

    def __init__(self) -> None:
        self.runtime: LoraRuntime | None = None
        self.registry: AdapterRegistry | None = None
        self.catalogue: AdapterRegistry | AdapterCatalogue | None = None
        self.control: AdapterControl | None = None


def _adapter_sources(model_config: ModelConfig, params: Params) -> dict[str, str]:
    sources: dict[str, str] = {}
    weight_path = model_config.modelWeightPath
    if weight_path:
        p = Path(weight_path).expanduser()
        sources.update(read_adapter_list(p if p.is_dir() else p.parent))
    sources.update(params.adapters)
    return sources


@hookimpl
def mindie_host_linear_deltas(ctx: BackendContext, info: ModelInfo) -> LinearDeltas | None:
    """The slot pools that add each row's adapter delta to the named projections."""
    if NAME not in ctx.model.plugins:
        return None
    p: Params = ctx.params
    device = torch.device("cuda") if str(info.device).startswith("cuda") else torch.device("cpu")
    dtype = getattr(torch, str(info.dtype), torch.float32)
    ctx.state.runtime = LoraRuntime(ModelDims.from_info(info), p.maxLoras, p.maxLoraRank, device=device,
                                    dtype=dtype, kernel=p.kernel)
    return ctx.state.runtime


@hookimpl
def mindie_host_startup(ctx: HostContext) -> None:
    """Load and check every listed adapter into the registry over the runtime's slots."""
    host = ctx.host
    if host is None or NAME not in ctx.model.plugins:
        return
    runtime, sources = ctx.state.runtime, _adapter_sources(ctx.model, ctx.params)
    if host.model_name in sources:
        raise AdapterError(host.model_name, "name", "an adapter may not take the base model's name")
    if runtime is None:  # the front end of an engine process: the engine checked and loaded the adapters
        catalogue = AdapterCatalogue(list(sources))
        ctx.state.catalogue, ctx.state.control = catalogue, EngineAdapters(host, catalogue)
        ctx.log.info("multi_lora: %d adapters known; slot pools in the engine process", len(sources))
        return
    dims = ModelDims.from_info(host.info)
    registry = AdapterRegistry(runtime)
    for name, path in sources.items():
        registry.add(load_adapter(name, path, dims, ctx.params.maxLoraRank))
    registry.preload()
    ctx.state.registry = ctx.state.catalogue = registry
    ctx.state.control = LocalAdapters(registry, dims)
    ctx.log.info(
        "multi_lora: %d adapters known, %d slots of rank %d (%.1f MiB of pools), kernel %s",
        len(registry.entries), runtime.slots, runtime.rank, runtime.pool_bytes() / 2**20, runtime.kernel,
    )


@hookimpl
def mindie_host_shutdown(ctx: HostContext) -> None:
    ctx.state.registry = ctx.state.catalogue = ctx.state.control = None


@hookimpl
def mindie_host_engine_restarted(ctx: HostContext) -> None:
    """The new engine process loaded the startup adapters only: forget those loaded at run time."""
    catalogue = ctx.state.catalogue
    if isinstance(catalogue, AdapterCatalogue):
        catalogue.reset()
        ctx.log.warning("multi_lora: the engine restarted; adapters loaded at run time must be loaded again")


@hookimpl
def mindie_host_step_outputs(ctx: HostContext, outputs: list[RequestOutput]) -> None:
    """Front end of an engine process: requests with outputs have reached the engine, which counts them."""
    catalogue = ctx.state.catalogue
    if isinstance(catalogue, AdapterCatalogue):
        catalogue.seen([out.request_id for out in outputs])


@hookimpl
def mindie_host_engine_command(ctx: HostContext, target: str, command: str, payload: Any) -> Any:
    """In the engine: load, unload and list adapters for the front end's routes (:mod:`.control`)."""
    if target != NAME:
        return None
    info = ctx.host.info if ctx.host is not None else None
    dims = ModelDims.from_info(info) if info is not None else None
    result = engine_command(ctx.state.registry, dims, command, payload)  # type: ignore[arg-type]
    if command == "load":
        ctx.log.info("multi_lora: loaded adapter %s (rank %d) from %s", payload["name"], result["rank"],
                     payload["path"])
    return result


@hookimpl
def mindie_host_metrics(ctx: HostContext) -> dict[str, float] | None:
    registry = ctx.state.registry
    return registry.metrics() if registry is not None else None


@hookimpl
def mindie_host_served_models(ctx: HostContext) -> list[str] | None:
    """Every known adapter, listed by ``/v1/models`` after the base model."""
    catalogue = ctx.state.catalogue
    return list(catalogue.entries) if catalogue is not None else None


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


def select_adapter(
    host: Any, registry: AdapterRegistry | AdapterCatalogue | None, body: dict[str, Any], protocol: str
) -> tuple[str, str] | None:
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
        known = registry is not None and model in registry.entries  # unloading ones too: they 404 below
        if protocol == "vllm" or known:
            if chosen is not None and chosen[0] != model:
                raise RequestError(
                    f"model {model!r} and {chosen[1]} {chosen[0]!r} name different adapters", field=chosen[1]
                )
            chosen = (model, "model")
    return chosen


@hookimpl
def mindie_host_refine_request(ctx: HostContext, request: EngineRequest, body: dict[str, Any],
                               protocol: str) -> None:
    """Resolve the adapter; set ``extensions["multi_lora"]``, ``variant`` (current slot) and ``cache_salt``."""
    registry = ctx.state.catalogue
    if registry is None:
        return
    chosen = select_adapter(ctx.host, registry, body, protocol)
    if chosen is None:
        return
    name, field = chosen
    entry = registry.get(name)
    if entry is None:
        known = ", ".join(sorted(registry.entries)) or "none"
        raise RequestError(f"LoRA adapter {name!r} not found (loaded: {known})", status=404, field=field)
    request.extensions[NAME] = name
    request.variant = entry.slot  # the engine binds the slot again at admission (-1 until then)
    salt = {"lora": entry.salt}
    if request.cache_salt is not None:
        salt["salt"] = request.cache_salt
    request.cache_salt = json.dumps(salt, sort_keys=True, separators=(",", ":"))
    registry.track(request, entry)  # type: ignore[arg-type]


@hookimpl
def mindie_host_request_arrived(ctx: HostContext, request: EngineRequest) -> None:
    """In the engine process: track the engine's own copy of an adapter request (refine tracked the front end's)."""
    registry: AdapterRegistry | None = ctx.state.registry
    name = request.extensions.get(NAME)
    if registry is None or name is None or registry.owns(request.request_id):
        return
    entry = registry.get(name)
    if entry is None:  # unloaded, or lost with an engine restart, after the front end resolved it
        raise RequestError(f"LoRA adapter {name!r} is not loaded (any more); load it again", status=404)
    registry.track(request, entry)


# ---------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------
@hookimpl
def mindie_host_filter_waiting(ctx: EngineContext, waiting: list[SequenceView]) -> list[SequenceView] | None:
    """Bind waiting adapter requests to resident slots; hold back those with no slot to get."""
    registry: AdapterRegistry | None = ctx.state.registry
    if registry is None:
        return None
    return [seq for seq in waiting if not registry.owns(seq.request_id) or registry.bind(seq.request_id)]


@hookimpl
def mindie_host_request_finished(ctx: HostContext, request: EngineRequest) -> None:
    """Release the request's slot binding."""
    registry: AdapterRegistry | None = ctx.state.registry
    if NAME in request.extensions and registry is not None and registry.owns(request.request_id):
        registry.finished(request.request_id)


# ---------------------------------------------------------------------------------------------
# management routes
# ---------------------------------------------------------------------------------------------
def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json")


async def _body(request: Request, host: Any) -> dict[str, Any]:
    """The JSON object body (the host caps it at ``maxRequestBodyBytes`` before any route runs)."""
    raw = await request.body()
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


def _ready(state: State) -> AdapterControl:
    control = state.control
    if control is None:
        raise RequestError("multi_lora is not running (model still loading or plugin not enabled)", status=503)
    return control


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    """Runtime adapter management on the management plane."""
    host = ctx.host
    if plane != "management" or NAME not in ctx.model.plugins or host is None:
        return
    settings: Params = ctx.params
    state: State = ctx.state

    def check_updates() -> None:
        if not settings.runtimeUpdates:
            raise RequestError("runtime adapter updates are disabled (Plugins.multi_lora.runtimeUpdates)", status=403)

    @app.get("/v1/lora_adapters")
    async def list_adapters() -> Response:
        return _json(await _ready(state).describe())

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        check_updates()
        control = _ready(state)
        body = await _body(request, host)
        name = _string(body, "lora_name")
        path = runtime_adapter_path(settings.runtimeAdapterDir, _string(body, "lora_path"))
        if not NAME_PATTERN.match(name):
            raise RequestError(f"lora_name must be {NAME_RULE}", field="lora_name")
        if name == host.model_name:
            raise RequestError(f"LoRA adapter {name!r} is already loaded", status=409, field="lora_name")
        loaded = await control.load(name, path)
        ctx.log.info("multi_lora: loaded adapter %s (rank %d) from %s", name, loaded["rank"], path)
        return _json({"status": "loaded", "lora_name": name, **loaded})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        check_updates()
        control = _ready(state)
        body = await _body(request, host)
        name = _string(body, "lora_name")
        await control.unload(name, settings.unloadTimeoutS)
        ctx.log.info("multi_lora: unloaded adapter %s", name)
        return _json({"status": "unloaded", "lora_name": name})
