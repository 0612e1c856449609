"""Serving: one uvicorn server per listening address (business, management, metrics), one event loop.

Startup order: plugins are enabled and routes registered, the listeners start
(liveness answers at once), then the model loads on a worker thread; readiness
turns true only when the model is loaded and warmed up.

Stopping: the first SIGTERM/SIGINT (or ``/stopService``) drains. New requests get
503 at once; in-flight ones may finish for up to ``shutdownDrainSeconds``, and any
still running then are ended with a normal final event (finish reason ``abort``,
rendered by each protocol as a clean end of stream, never a 500). A second signal
ends the in-flight requests the same way at once and exits without waiting.

Before anything loads, :func:`check_ports_free` makes sure every listening
address can be bound, so a port in use fails in a second, not after the load.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn

from ..config.hot_update import watch_config
from .admission import LINK_GATE, BusinessGuard, LinkGate, check_bind_addresses, listener_protocol
from .app import create_app
from .pd import BUSINESS_APP, PDGate
from .tls import tls_options

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..host_protocol import Host

log = logging.getLogger("mindie_host.server")


class PortInUseError(RuntimeError):
    """A listening address cannot be bound (in use, or not an address of this machine)."""


def check_ports_free(host: Host) -> None:
    """Bind (and release) every address the host will listen on; raise :class:`PortInUseError` if one fails.

    Run before the model loads, so a port in use costs a second, not the whole load.
    """
    for listener in plan_listeners(host):
        family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            try:
                sock.bind((listener.host, listener.port))
            except OSError as exc:
                why = "is already in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise PortInUseError(
                    f"{listener.host}:{listener.port} ({', '.join(listener.planes)}) {why}; stop what holds it or "
                    f"choose another port in config.json (ServerConfig) or with --port/--management-port/--metrics-port"
                ) from None


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
    if s.inferMode == "dmi":  # PD: P instances hand requests to this one (server/pd.py)
        addrs.setdefault((s.ipAddress, s.interCommPort), []).append("intercomm")
    tls = getattr(host, "tls_options", None)
    out = []
    for (ip, port), planes in addrs.items():
        ssl = tls(tuple(planes)) if callable(tls) else tls_options(host.config, tuple(planes))
        out.append(Listener(ip, port, tuple(planes), ssl))
    return out


def build_app(host: Host, planes: tuple[str, ...]) -> FastAPI:
    """One app serving several planes' routes (when they share an address)."""
    app = create_app(host, planes[0])
    app.state.business_routes = list(app.routes) if planes[0] == "business" else []
    for plane in planes[1:]:
        host.plugins.hook.mindie_host_add_routes(app=app, plane=plane)
    return app


def guard(host: Host, app: FastAPI, planes: tuple[str, ...]) -> BusinessGuard:
    """Wrap a listener's app with request ids, and on business routes the API key, body cap and maxLinkNum."""
    gate = None
    if "business" in planes:
        gate = host.caches.get_or_make(LINK_GATE, lambda: LinkGate(host.config.server.maxLinkNum))
    business = {id(r) for r in getattr(app.state, "business_routes", [])}

    def is_business(scope: Any) -> bool:
        if "business" not in planes:
            return False
        if len(planes) == 1:
            return True
        from starlette.routing import Match

        # routes of the other planes sharing this port (read per request: plugins may add routes later)
        return not any(id(r) not in business and r.matches(scope)[0] == Match.FULL for r in app.routes)

    return BusinessGuard(app, host.config, gate, is_business, ready=lambda: host.ready or host.draining)


#: Idle keep-alive connections are closed after this long. Longer than the 5 s after which httpx-based clients
#: (openai, the MindIE client) drop idle pooled connections, so a client never reuses a connection the server is
#: closing at that moment (uvicorn's default is also 5 s, which made that race possible).
KEEP_ALIVE_SECONDS = 75


async def serve(host: Host, *, load: Callable[[], None] | None = None, on_ready: Callable[[], None] | None = None,
                engine_thread: bool = True, loaded: Any = None) -> None:
    """Run every listener until SIGTERM/SIGINT (or ``host.runtime.stop_event``).

    ``load()`` loads the model (the runtime's ``load_host``) on a worker thread once the listeners are up.
    With ``engine_thread=False`` the engine is not started here: the caller runs
    ``host.engine.run_here()`` once ``on_ready`` fires (see :func:`serve_with_engine_on_main_thread`).
    Without ``load`` and with a ``loaded`` event, the model is loaded elsewhere and
    the listeners wait for the event before turning ready.
    """
    host.plugins.enable_from_config(host.config)
    check_bind_addresses(host.config)
    servers: list[_Server] = []
    for listener in plan_listeners(host):
        app = guard(host, build_app(host, listener.planes), listener.planes)
        if "business" in listener.planes:
            host.caches.put(BUSINESS_APP, app)
            app = PDGate(host, app)
        cfg = uvicorn.Config(
            app, host=listener.host, port=listener.port, log_level="warning", access_log=False,
            timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_SECONDS, **listener.ssl,
            **listener_protocol(host.config),
        )
        servers.append(_Server(cfg))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    force = asyncio.Event()
    host.runtime.stop_event = stop
    host.runtime.force_stop_event = force
    host.runtime.loop = loop
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_stop_signal, host)
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
    watch = watch_config(host.config)  # LogConfig.logLevel's hot update (the engine process runs its own)
    try:
        if load is not None:
            await asyncio.to_thread(load)
        elif loaded is not None:
            await asyncio.to_thread(loaded.wait)
            if host.runtime.load_error is not None:
                raise host.runtime.load_error
        host.start(engine_thread=engine_thread)
        log.info("model %s ready", host.model_name)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        host.draining = True
        active = host.engine.num_active if host.engine else 0
        seconds = host.config.server.shutdownDrainSeconds
        if active and not force.is_set():
            log.info("stopping: draining; new requests are refused, %d in flight may finish within %g s "
                     "(send the signal again to stop now)", active, seconds)
        else:
            log.info("stopping: draining %d requests in flight", active)
        await drain(host, seconds, force)
        await end_in_flight(host, force)
    finally:
        for srv in servers:
            srv.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        if watch is not None:
            watch.stop()
        host.shutdown()
        log.info("stopped")


def serve_with_engine_on_main_thread(host: Host, load: Callable[[], None]) -> None:
    """``mindie-host serve``: HTTP listeners on a helper thread, ``load()`` and then the engine stepping on
    this (main) thread.

    Signals are caught here and forwarded to the serving loop, which drains and
    then stops the engine, ending :meth:`AsyncEngine.run_here`.
    """
    import threading

    ready = threading.Event()
    loaded = threading.Event()
    failure: list[BaseException] = []

    def http() -> None:
        try:
            asyncio.run(serve(host, loaded=loaded, on_ready=ready.set, engine_thread=False))
        except BaseException as exc:  # reported on the main thread
            failure.append(exc)
        finally:
            ready.set()
            if host.engine is not None:
                host.engine.stop()

    signals = [0]

    def on_signal(signum: int, frame: object) -> None:
        signals[0] += 1
        if signals[0] >= 2 and not host.ready and host.engine is None:
            raise KeyboardInterrupt  # asked twice while the model is still loading: give up the load now
        loop = host.runtime.loop
        if loop is not None:
            loop.call_soon_threadsafe(on_stop_signal, host)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    check_ports_free(host)  # before the (long) load: a port in use fails now, with one line
    thread = threading.Thread(target=http, name="mindie-http")
    thread.start()
    try:
        # Load (and warm up) on this thread too: the thread that first runs OpenMP work keeps the fast
        # thread team, and the engine must step on that thread (bench/PERF.md).
        try:
            load()
        except BaseException as exc:
            host.runtime.load_error = exc
        finally:
            loaded.set()
        ready.wait()
        if not failure and host.engine is not None:
            host.engine.run_here()
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]


def on_stop_signal(host: Host) -> None:
    """SIGTERM/SIGINT on the serving loop: the first one drains, a second one stops at once."""
    stop, force = host.runtime.stop_event, host.runtime.force_stop_event
    if stop is None:
        return
    if stop.is_set() and force is not None and not force.is_set():
        log.warning("second stop signal: ending %d in-flight requests now", host.engine.num_active if host.engine else 0)
        force.set()
    host.draining = True
    stop.set()


#: After in-flight requests are ended, how long their final events get to reach the clients.
FINAL_EVENT_SECONDS = 5.0


async def drain(host: Host, timeout: float, force: asyncio.Event | None = None) -> None:
    """Refuse new requests and wait up to ``timeout`` seconds (or until ``force``) for in-flight ones to finish."""
    host.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while host.engine is not None and host.engine.num_active and loop.time() < deadline:
        if force is not None and force.is_set():
            return
        await asyncio.sleep(0.05)


async def end_in_flight(host: Host, force: asyncio.Event | None = None) -> None:
    """End every request still in flight with a normal final event, and wait (briefly) until they are sent."""
    engine = host.engine
    if engine is None or not engine.num_active:
        return
    if force is None or not force.is_set():
        log.warning("drain time (%g s) is up: ending %d requests", host.config.server.shutdownDrainSeconds,
                    engine.num_active)
    engine.abort_all()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (1.0 if force is not None and force.is_set() else FINAL_EVENT_SECONDS)
    while engine.num_active and loop.time() < deadline:
        await asyncio.sleep(0.02)
