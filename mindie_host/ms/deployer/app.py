"""``mindie-host deployer``: ms_server's REST API (spec §8.3.2.3) in front of a target.

=====================================  =====================================================================
``POST /v1/servers``                   body ``infer_server.json``; 200 ``{"message":"creating the server!",
                                       "status":"0"}`` once checked (creation goes on in the background)
``GET /v1/servers/{server_name}``      200 ``{"data":{"instances_status":[{"liveness","pod_name",
                                       "readiness"}],"model_info":{TGI /info},"server_name"},
                                       "message":"success","status":"0"}``
``DELETE /v1/servers/{server_name}``   200 ``{"message":"succeed to clear resources","status":"0"}``
``POST /v1/servers/{server_name}``     body ``{"server_name": ...}``: a rolling update to the current server
                                       config; 200 ``{"message":"update server success.","status":"0"}``
=====================================  =====================================================================

Errors answer ``{"message": ..., "status": "1"}``: 400 for a bad body (the message names the key and what
is allowed), 404 for an unknown server or path, 405 for a method a path does not take, 403 for a client
certificate without CN ``msclientuser`` and O ``msgroup``, 500 when the target itself fails. One server at a
time, as the spec says; a second ``POST /v1/servers`` gets 400.

HTTPS with ``server_tls_items`` (client certificates required when ``ca_cert`` is set). Every request is
written to the operation log (``log_info.operation_log_path``). The servers are kept in ``ms_status_file``
(``server_list``: ``namespace``, ``replicas``, ``server_name``, ``server_type``, ``use_service``, and, as a
mindie-host extension, the ``infer_server`` body), so a restarted deployer takes them back. SIGINT and
SIGTERM stop it; the local target's instances stop with it and come back at the next start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.handlers
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ...file_modes import write_file
from ..logs import LogInfo, setup_ms_logging
from ..process import stop_on_signals
from .config import DeployerConfig
from .spec import InferServer, SpecError, check_name, parse_infer_server, parse_update
from .target import NotFound, Target, TargetError

log = logging.getLogger("mindie_host.ms.deployer")
oplog = logging.getLogger("mindie_host.ms.deployer.operation")
CLIENT_CN, CLIENT_O = "msclientuser", "msgroup"
MAX_BODY = 1 << 20

CREATED = "creating the server!"
SUCCESS = "success"
CLEARED = "succeed to clear resources"
UPDATED = "update server success."


def answer(message: str, status: int = 200, data: Any = None) -> web.Response:
    """The spec's answer: ``status`` "0" for 200, "1" otherwise."""
    body: dict[str, Any] = {"data": data} if data is not None else {}
    body.update(message=message, status="0" if status == 200 else "1")
    return web.json_response(body, status=status)


def _subject(cert: dict[str, Any]) -> dict[str, str]:
    return {k: v for rdn in cert.get("subject", ()) for k, v in rdn}


class Deployer:
    """The servers the deployer manages, their status file, and the REST handlers."""

    def __init__(self, config: DeployerConfig, target: Target) -> None:
        self.config = config
        self.target = target
        self.servers: dict[str, InferServer] = {}
        self.lock = asyncio.Lock()
        self.check_client = bool(config.server_tls.enabled and config.server_tls.ca_cert)

    # -- status file --------------------------------------------------------------------------
    def save(self) -> None:
        """Write ``ms_status_file`` (mode 0640) in one step."""
        path = Path(self.config.status_file)
        entries = [
            {
                "namespace": s.namespace,
                "replicas": s.replicas,
                "server_name": s.server_name,
                "server_type": s.server_type,
                "use_service": True,
                "infer_server": s.body,
            }
            for s in self.servers.values()
        ]
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps({"server_list": entries}, indent=2))

    async def restore(self) -> None:
        """Take back the servers the status file lists (an unreadable entry is logged and dropped)."""
        path = Path(self.config.status_file)
        if not path.exists():
            self.save()
            return
        try:
            entries = json.loads(path.read_text())["server_list"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("cannot read %s (%s); starting with no servers", path, exc)
            return
        for entry in entries if isinstance(entries, list) else []:
            try:
                spec = parse_infer_server(entry.get("infer_server") if isinstance(entry, dict) else None)
                self.target.check(spec)
                await self.target.restore(spec)
            except (SpecError, TargetError) as exc:
                log.error(
                    "%s: cannot restore the server listed in %s: %s",
                    path,
                    entry.get("server_name") if isinstance(entry, dict) else entry,
                    exc,
                )
                continue
            self.servers[spec.server_name] = spec
            log.info("restored server %s from %s", spec.server_name, path)
        self.save()

    # -- handlers -------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise SpecError(f"the body is not valid JSON: {str(exc)[:200]}") from None

    def _known(self, name: str) -> InferServer:
        check_name(name)
        spec = self.servers.get(name)
        if spec is None:
            raise NotFound(name)
        return spec

    async def create(self, request: web.Request) -> web.Response:
        spec = parse_infer_server(await self._body(request))
        async with self.lock:
            if self.servers:
                existing = next(iter(self.servers))
                what = "exists already" if spec.server_name == existing else f"is deployed ({existing!r})"
                raise SpecError(
                    f"server_name: server {existing!r} {what}; the deployer manages one server at a "
                    "time (delete it first)"
                )
            self.target.check(spec)
            await self.target.create(spec)
            self.servers[spec.server_name] = spec
            self.save()
        log.info("creating server %s (%s, %d replicas)", spec.server_name, self.target.kind, spec.replicas)
        return answer(CREATED)

    async def get(self, request: web.Request) -> web.Response:
        spec = self._known(request.match_info["server_name"])
        state = await self.target.status(spec)
        return answer(SUCCESS, data={**state, "server_name": spec.server_name})

    async def delete(self, request: web.Request) -> web.Response:
        async with self.lock:
            spec = self._known(request.match_info["server_name"])
            await self.target.delete(spec)
            del self.servers[spec.server_name]
            self.save()
        log.info("deleted server %s", spec.server_name)
        return answer(CLEARED)

    async def update(self, request: web.Request) -> web.Response:
        name = request.match_info["server_name"]
        async with self.lock:
            spec = self._known(name)
            parse_update(await self._body(request), name)
            if not spec.single_node:
                raise SpecError("server_name: the rolling update is for 'mindie_single_node' servers only")
            await self.target.update(spec)
        log.info("rolling update of server %s started", name)
        return answer(UPDATED)

    # -- the app --------------------------------------------------------------------------------
    @web.middleware
    async def middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response: web.StreamResponse
        try:
            if self.check_client:
                subject = _subject(request.transport.get_extra_info("peercert") or {}) if request.transport else {}
                if subject.get("commonName") != CLIENT_CN or subject.get("organizationName") != CLIENT_O:
                    raise PermissionError(f"the client certificate must have CN={CLIENT_CN}, O={CLIENT_O}")
            response = await handler(request)
        except SpecError as exc:
            response = answer(str(exc), 400)
        except NotFound as exc:
            response = answer(f"server {exc.args[0]!r} not found", 404)
        except PermissionError as exc:
            response = answer(str(exc), 403)
        except web.HTTPRequestEntityTooLarge:
            response = answer(f"the body is larger than {MAX_BODY} bytes", 413)
        except web.HTTPMethodNotAllowed as exc:
            response = answer(
                f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.allowed_methods))}",
                405,
            )
        except web.HTTPException as exc:
            response = answer(f"no such path: {request.path}" if exc.status == 404 else exc.reason, exc.status)
        except TargetError as exc:
            log.error("%s %s failed: %s", request.method, request.path, exc)
            response = answer(str(exc), 500)
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = answer("internal error; see the deployer's run log", 500)
        peer = request.remote or "-"
        oplog.info("%s %s %s -> %d", peer, request.method, request.path, response.status)
        return response

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.middleware], client_max_size=MAX_BODY)
        app.router.add_post("/v1/servers", self.create)
        app.router.add_get("/v1/servers/{server_name}", self.get)
        app.router.add_delete("/v1/servers/{server_name}", self.delete)
        app.router.add_post("/v1/servers/{server_name}", self.update)
        return app


def setup_deployer_logging(config: DeployerConfig) -> None:
    """The run log: ``run_log_path`` and stderr, level from ``log_level`` or the environment."""
    setup_ms_logging(
        LogInfo(log_level=config.log_level, to_file=True, to_stdout=True, run_log_path=config.run_log_path),
        "deployer",
    )


def setup_operation_log(path: str) -> logging.Handler:
    """The operation log: one line per API request, in ``operation_log_path`` only."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=20 << 20, backupCount=9)
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(process)d] [ms] [operation] %(message)s"))
    oplog.addHandler(handler)
    oplog.setLevel(logging.INFO)
    oplog.propagate = False
    return handler


async def serve_deployer(
    config: DeployerConfig,
    target: Target,
    stop: asyncio.Event | None = None,
    started: Callable[[Deployer], None] | None = None,
) -> None:
    """Restore the status file's servers, serve the API until SIGINT/SIGTERM (or ``stop``), then close the target."""
    deployer = Deployer(config, target)
    handler = setup_operation_log(config.operation_log_path)
    stop = stop or asyncio.Event()
    stop_on_signals(stop)
    runner = web.AppRunner(deployer.app(), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await deployer.restore()
        site = web.TCPSite(runner, config.ip, config.port, ssl_context=config.server_tls.server_context())
        await site.start()
        log.info(
            "deployer listening on %s://%s:%d (target: %s)",
            config.server_tls.scheme,
            config.ip,
            config.port,
            target.kind,
        )
        if started is not None:
            started(deployer)
        await stop.wait()
        log.info("deployer stopping")
    finally:
        await runner.cleanup()
        await target.close()
        oplog.removeHandler(handler)
        handler.close()
