"""Management plane: health and readiness probes, JSON metrics, service stop."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import Response

from .. import hookimpl
from .app import json_response

if TYPE_CHECKING:
    from ..host import Host


@hookimpl
def mindie_host_add_routes(app: FastAPI, host: Host, plane: str) -> None:
    if plane != "management":
        return

    def ready_response() -> Response:
        return Response(status_code=200 if host.ready and not host.draining else 503)

    @app.get("/health")
    async def health() -> Response:
        return ready_response()

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return ready_response()

    @app.get("/metrics-json")
    async def metrics_json() -> Response:
        return json_response(host.stats())

    @app.get("/stopService")
    async def stop_service() -> Response:
        stop = host.state.get("stop_event")
        if stop is not None:
            stop.set()
        return json_response({"status": "stopping"})
