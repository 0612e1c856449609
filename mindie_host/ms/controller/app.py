"""The controller process: its HTTP server (``http_server.ip:port``) and its loop.

``GET /v1/startup`` and ``GET /v1/health`` answer 200 ``{"message":"","status":"0"}`` (spec §4.2);
``/v1/health`` answers 503 ``{"message": ..., "status": "1"}`` once the loop has stopped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from ..process import run_component, stop_on_signals
from .config import ControllerConfig
from .poller import Controller

log = logging.getLogger("mindie_host.ms.controller")


def _status(message: str = "", ok: bool = True) -> Response:
    body = json.dumps({"message": message, "status": "0" if ok else "1"}, separators=(",", ":"))
    return Response(body, status_code=200 if ok else 503, media_type="application/json")


def controller_app(controller: Controller, loop_task: asyncio.Task[Any] | None = None) -> FastAPI:
    """The controller's HTTP API."""
    app = FastAPI(title="mindie-host controller", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/v1/startup")
    async def startup() -> Response:
        return _status()

    @app.get("/v1/health")
    async def health() -> Response:
        task = app.state.loop_task
        if task is not None and task.done():
            return _status("the controller loop has stopped", ok=False)
        return _status()

    app.state.loop_task = loop_task
    return app


class _Server(uvicorn.Server):
    def capture_signals(self) -> Any:  # type: ignore[override]
        import contextlib

        return contextlib.nullcontext()


async def serve_controller(config: ControllerConfig, stop: asyncio.Event | None = None) -> None:
    """Run the loop and the HTTP server until SIGINT/SIGTERM (or ``stop``)."""
    controller = Controller(config)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    app = controller_app(controller)
    ssl_ctx = config.tls["http_server"].server_context()
    kw: dict[str, Any] = {"ssl_context_factory": lambda _c, _d: ssl_ctx} if ssl_ctx is not None else {}
    server = _Server(uvicorn.Config(app, host=config.http_ip, port=config.http_port, log_level="warning",
                                    access_log=False, timeout_graceful_shutdown=2, **kw))
    http_task = asyncio.create_task(server.serve())
    while not server.started and not http_task.done():
        await asyncio.sleep(0.02)
    if http_task.done():
        await controller.close()
        exc = http_task.exception() if not http_task.cancelled() else None
        raise RuntimeError(f"could not start the controller's HTTP server: {exc or 'address in use?'}")
    log.info("controller listening on %s://%s:%d (%s)", config.tls["http_server"].scheme, config.http_ip,
             config.http_port, config.deploy_mode)
    loop_task = asyncio.create_task(controller.run(stop))
    app.state.loop_task = loop_task
    try:
        await asyncio.wait([loop_task, http_task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        server.should_exit = True
        await asyncio.gather(loop_task, http_task, return_exceptions=True)
        controller.write_files()
        await controller.close()


def run_controller(config: ControllerConfig) -> None:
    """``mindie-host controller``: set up logging and serve."""
    run_component("controller", config, serve_controller)
