"""The coordinator process: the user port, the management port, and running both.

User port (``predict_ip:predict_port``): every path and method is forwarded to an instance
(:mod:`.proxy`): the OpenAI, TGI, vLLM, Triton/KServe v2 and MindIE native APIs and
``/v1/tokenizer``, with their bodies and answers unchanged. In ``pd_separate`` inference requests
go through a P and a D instead (:mod:`.pd`), and readiness needs at least one P and one D.

Management port (``manage_ip:manage_port``, cluster-internal; spec §4.3):

=========================  ==========================================================================
``GET /v1/startup``        200, empty body, once listening
``GET /v1/health``         200, empty body
``GET /v2/health/live``    200
``GET /v1/readiness``      200 when at least one instance is in rotation, else 503 (empty bodies)
``GET /v2/health/ready``   same as ``/v1/readiness``
``GET /v2/models/{m}/ready``  200 when an instance in rotation serves model ``m``, else 503
``POST /v1/instances/refresh``  the controller's live set; 200 (empty body) when valid, else 400
``POST /v1/instances/offline``  ``{"ids":[...]}`` leave rotation; 200, 400 bad body, 503 not ready
``POST /v1/instances/online``   ``{"ids":[...]}`` back in rotation; same codes
``GET /v1/instances/tasks?id=1&id=2``  ``{"tasks":[n1, n2]}``: requests in flight per instance
``POST /v1/instances/query_tasks``  ``{"p_id":..,"d_id":..}`` -> ``{"is_end": bool}``
``GET /v1/coordinator_info``  per-instance allocated slots and blocks, average request lengths
``GET /metrics``           Prometheus text aggregated over the instances (:mod:`.metrics`), 503 if none
=========================  ==========================================================================

Every 400 carries ``{"error": message}`` naming the problem (:mod:`..bodies`): the spec gives refresh
errors an empty body, which tells the controller's operator nothing. Bodies are capped at
``request_limit.body_limit`` as on the user port.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.applications import Starlette
from starlette.routing import Route

from ..bodies import BodyError, decode_json, read_body, u64
from ..process import run_component, stop_on_signals
from .config import CoordinatorConfig
from .dresult import DResultHub
from .instances import InstanceTable, parse_refresh
from .limits import NOT_READY, Scheduler
from .metrics import MetricsAggregator
from .pd import PDForwarder
from .proxy import Forwarder
from .routing import Router

log = logging.getLogger("mindie_host.ms.coordinator")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
USER_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, separators=(",", ":")), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return _json({"error": message}, status)


class Coordinator:
    """The coordinator's state: instances, routing, scheduling, forwarding and metrics."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.table = InstanceTable()
        self.router = Router(config.algorithm_type, config.cache_size, config.slots_thresh, config.block_thresh)
        self.scheduler = Scheduler(self.table, self.router, max_requests=config.max_requests,
                                   single_node_max_requests=config.single_node_max_requests,
                                   reordering=config.reordering_type, schedule_timeout=config.schedule_timeout)
        data_link = config.tls["mindie_client"]
        mgmt_link = config.tls["mindie_mangment"]
        self.mgmt_client = httpx.AsyncClient(verify=mgmt_link.client_context(), trust_env=False,
                                             headers={"user-agent": config.user_agent})
        self.forwarder = Forwarder(config, self.scheduler, data_link.client_context(), data_link.scheme)
        self.metrics = MetricsAggregator(self.mgmt_client, config.reuse_time, mgmt_link.scheme,
                                         timeout=config.http_timeout_seconds)
        self.hub: DResultHub | None = None
        self.pd: PDForwarder | None = None
        if config.deploy_mode == "pd_separate":
            self.hub = DResultHub(config, self.table, self.scheduler, self.forwarder.ssl, data_link.scheme)
            self.pd = PDForwarder(config, self.forwarder, self.table, self.hub)

    @property
    def ready(self) -> bool:
        """Instances in rotation (pd_separate: at least one P and one D)."""
        if self.pd is not None:
            return self.pd.ready
        return bool(self.table.available())

    async def close(self) -> None:
        """Close the D result channels and the clients."""
        if self.hub is not None:
            await self.hub.close()
        await self.forwarder.aclose()
        await self.mgmt_client.aclose()

    def user_app(self) -> Starlette:
        """The user-facing app: every path is forwarded (a bare Starlette app: no per-request validation cost)."""
        handle = self.pd.handle if self.pd is not None else self.forwarder.handle
        return Starlette(routes=[Route("/{path:path}", handle, methods=USER_METHODS)])

    async def _body(self, request: Request) -> Any:
        """A management request's JSON body, within ``body_limit`` (:class:`BodyError` otherwise)."""
        return decode_json(await read_body(request, self.config.body_limit_bytes))

    def manage_app(self) -> FastAPI:
        """The cluster-internal management app."""
        app = FastAPI(title="mindie-host coordinator management", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/v1/startup")
        async def startup() -> Response:
            return Response(status_code=200)

        @app.get("/v1/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v2/health/live")
        async def live() -> Response:
            return Response(status_code=200)

        @app.get("/v1/readiness")
        async def readiness() -> Response:
            return Response(status_code=200 if self.ready else 503)

        @app.get("/v2/health/ready")
        async def ready() -> Response:
            return Response(status_code=200 if self.ready else 503)

        @app.get("/v2/models/{model}/ready")
        async def model_ready(model: str) -> Response:
            ok = any(model in i.model_name.split("&") for i in self.table.available())
            return Response(status_code=200 if ok else 503)

        @app.post("/v1/instances/refresh")
        async def refresh(request: Request) -> Response:
            try:
                ids, described = parse_refresh(await self._body(request))
            except BodyError as exc:
                log.warning("refresh refused: %s", exc)
                return _error(str(exc), 400)
            before = set(self.table.items)
            missing = self.table.apply_refresh(ids, described)
            for gone in before - set(self.table.items):
                self.router.forget(gone)
            if self.hub is not None:
                self.hub.sync()
            if missing:
                log.warning("refresh lists ids never described, ignored: %s", missing)
            self.scheduler.dispatch()
            return Response(status_code=200)

        async def set_offline(request: Request, offline: bool) -> Response:
            if not self.table.refreshed:
                return _error(NOT_READY, 503)
            try:
                ids = _ids(await self._body(request))
            except BodyError as exc:
                return _error(str(exc), 400)
            unknown = [i for i in ids if i not in self.table]
            if unknown:
                return _error(f"ids: unknown instance ids {unknown}", 400)
            for iid in ids:
                inst = self.table.get(iid)
                if inst is not None:
                    inst.offline = offline
            log.info("instances %s %s", ids, "offline" if offline else "online")
            self.scheduler.dispatch()
            return Response(status_code=200)

        @app.post("/v1/instances/offline")
        async def offline(request: Request) -> Response:
            return await set_offline(request, True)

        @app.post("/v1/instances/online")
        async def online(request: Request) -> Response:
            return await set_offline(request, False)

        @app.get("/v1/instances/tasks")
        async def tasks(request: Request) -> Response:
            out = []
            for text in request.query_params.getlist("id"):
                try:
                    inst = self.table.get(u64(text, "id"))
                except BodyError as exc:
                    return _error(str(exc), 400)
                if inst is None:
                    return _error(f"id: unknown instance id {text!r}", 400)
                out.append(inst.active)
            return _json({"tasks": out})

        @app.post("/v1/instances/query_tasks")
        async def query_tasks(request: Request) -> Response:
            try:
                body = await self._body(request)
                if not isinstance(body, dict):
                    raise BodyError("the body must be {\"p_id\": u64, \"d_id\": u64}")
                instances = [self.table.get(u64(body.get(key), key)) for key in ("p_id", "d_id")]
            except BodyError as exc:
                return _error(str(exc), 400)
            return _json({"is_end": sum(i.active for i in instances if i is not None) == 0})

        @app.get("/v1/coordinator_info")
        async def coordinator_info() -> Response:
            sizes = self.forwarder.sizes
            return _json({
                "schedule_info": [{"id": i.id, "allocated_slots": i.active, "allocated_blocks": i.allocated_blocks}
                                  for i in self.table.items.values()],
                "request_length_info": {"input_len": sizes.mean_input(), "output_len": sizes.mean_output()},
            })

        @app.get("/metrics")
        async def metrics() -> Response:
            text = await self.metrics.text(self.table.available())
            if text is None:
                return _error("no instance answered its /metrics", 503)
            return Response(text, media_type=METRICS_CONTENT_TYPE)

        return app


def _ids(body: Any) -> list[int]:
    if not isinstance(body, dict) or not isinstance(body.get("ids"), list):
        raise BodyError("ids: the body must be {\"ids\": [u64, ...]}")
    return [u64(i, "ids[]") for i in body["ids"]]


class _Server(uvicorn.Server):
    def capture_signals(self) -> Any:  # type: ignore[override]
        import contextlib

        return contextlib.nullcontext()


def _uvicorn(app: Any, host: str, port: int, ssl_ctx: Any, config: CoordinatorConfig) -> _Server:
    kw: dict[str, Any] = {}
    if ssl_ctx is not None:
        kw["ssl_context_factory"] = lambda _config, _default: ssl_ctx
    cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, server_header=False,
                         timeout_keep_alive=config.keep_alive_seconds or 3600, timeout_graceful_shutdown=5,
                         limit_concurrency=3 * config.max_requests, **kw)
    return _Server(cfg)


async def serve_coordinator(config: CoordinatorConfig, stop: asyncio.Event | None = None) -> None:
    """Run both ports until SIGINT/SIGTERM (or ``stop``)."""
    coordinator = Coordinator(config)
    servers = [
        _uvicorn(coordinator.user_app(), config.predict_ip, config.predict_port,
                 config.tls["request_server"].server_context(), config),
        _uvicorn(coordinator.manage_app(), config.manage_ip, config.manage_port,
                 config.tls["controller_server"].server_context(), config),
    ]
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    try:
        for srv in servers:
            while not srv.started and not any(t.done() for t in tasks):
                await asyncio.sleep(0.02)
        failed = [t for t in tasks if t.done()]
        if failed:
            exc = failed[0].exception() if not failed[0].cancelled() else None
            raise RuntimeError(f"could not start the coordinator's listeners: {exc or 'address in use?'}")
        log.info("coordinator listening: user %s://%s:%d, management %s://%s:%d (%s)",
                 config.tls["request_server"].scheme, config.predict_ip, config.predict_port,
                 config.tls["controller_server"].scheme, config.manage_ip, config.manage_port, config.algorithm_type)
        stop_wait = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
    finally:
        for srv in servers:
            srv.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        await coordinator.close()


def run_coordinator(config: CoordinatorConfig) -> None:
    """``mindie-host coordinator``: set up logging and serve."""
    run_component("coordinator", config, serve_coordinator)
