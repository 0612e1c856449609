"""Serving: one uvicorn server per listening address (business, management, metrics), one event loop.

Startup order: plugins are enabled and routes registered, the listeners start
(liveness answers at once), then the model loads on a worker thread; readiness
turns true only when the model is loaded and warmed up. SIGTERM/SIGINT drain
in-flight requests (up to ``shutdownDrainSeconds``) before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

from .app import create_app

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..host import Host

log = logging.getLogger("mindie_host.server")


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to us (several share one loop)."""

    def capture_signals(self) -> Any:  # type: ignore[override]
        import contextlib

        return contextlib.nullcontext()


@dataclass
class Listener:
    """One address the host listens on, and the planes it serves."""

    host: str
    port: int
    planes: tuple[str, ...]
    ssl: dict[str, Any]


def plan_listeners(host: Host) -> list[Listener]:
    """Group planes by address: business, management and metrics may share a port or not."""
    s = host.config.server
    addrs: dict[tuple[str, int], list[str]] = {}
    addrs.setdefault((s.ipAddress, s.port), []).append("business")
    addrs.setdefault((s.managementIpAddress, s.managementPort), []).append("management")
    addrs.setdefault((s.managementIpAddress, s.metricsPort), []).append("metrics")
    tls = getattr(host, "tls_options", None)
    out = []
    for (ip, port), planes in addrs.items():
        ssl = tls(tuple(planes)) if callable(tls) else {}
        out.append(Listener(ip, port, tuple(planes), ssl))
    return out


def build_app(host: Host, planes: tuple[str, ...]) -> FastAPI:
    """One app serving several planes' routes (when they share an address)."""
    app = create_app(host, planes[0])
    for plane in planes[1:]:
        host.plugins.hook.mindie_host_add_routes(app=app, host=host, plane=plane)
    return app


async def serve(host: Host, *, load: bool = True, on_ready: Callable[[], None] | None = None) -> None:
    """Run every listener until SIGTERM/SIGINT (or ``host.request_stop``)."""
    host.plugins.enable_from_config(host.config)
    servers: list[_Server] = []
    for listener in plan_listeners(host):
        app = build_app(host, listener.planes)
        cfg = uvicorn.Config(
            app, host=listener.host, port=listener.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=5, **listener.ssl,
        )
        servers.append(_Server(cfg))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    host.state["stop_event"] = stop
    host.state["loop"] = loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    tasks = [asyncio.create_task(srv.serve()) for srv in servers]
    for srv in servers:
        while not srv.started and not any(t.done() for t in tasks):
            await asyncio.sleep(0.02)
    failed = [t for t in tasks if t.done()]
    if failed:
        for t in tasks:
            t.cancel()
        exc = failed[0].exception() if not failed[0].cancelled() else None
        raise RuntimeError(f"could not start listeners: {exc or 'address in use?'}")
    for listener in plan_listeners(host):
        scheme = "https" if listener.ssl else "http"
        log.info("listening on %s://%s:%d (%s)", scheme, listener.host, listener.port, ", ".join(listener.planes))
    try:
        if load:
            await asyncio.to_thread(host.load)
        host.start()
        log.info("model %s ready", host.model_name)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        log.info("stopping: draining %d in-flight requests", host.engine.num_active if host.engine else 0)
        await drain(host, host.config.server.shutdownDrainSeconds)
    finally:
        for srv in servers:
            srv.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        host.shutdown()


async def drain(host: Host, timeout: float) -> None:
    """Refuse new requests and wait up to ``timeout`` seconds for in-flight ones to finish."""
    host.draining = True
    deadline = asyncio.get_running_loop().time() + timeout
    while host.engine is not None and host.engine.num_active and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
