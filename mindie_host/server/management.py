"""Management plane (spec §4.3 and the Mgmt rows of §1, §3): probes, JSON metrics, config, status, stop.

Routes (``managementIpAddress:managementPort``):

* ``GET /health`` (TGI/vLLM), ``GET /v2/health/live``, ``GET /v2/health/ready``:
  liveness answers 200 as soon as the listener is up, and 503 once the engine loop
  has died (so an orchestrator restarts the process); readiness answers 200 with an
  empty body once the model is loaded and warmed up, 503 before that, while
  draining and when the engine loop has died.
* ``GET /health/timed`` and ``GET /health/timed-{TIMEOUT}``: runs a one-token
  generation through the whole pipeline and answers ``{"status":"healthy"}`` if it
  finishes within TIMEOUT seconds (integer in [1, 600], default 10), else 503.
* ``GET /metrics-json``: rolling TTFT/TBT averages, queue depths, free KV blocks.
* ``GET /v1/config``: the static config (``?full=true`` adds the whole config with
  ``apiKey`` redacted). ``GET /v1/status``: role, free slots and blocks.
* ``GET /stopService``: stops taking inference requests (503), waits for running
  and queued ones (at most ``shutdownDrainSeconds``), then the process exits.

``/v2/models/{m}/ready`` (Triton), ``getSlotCount`` (native) and ``/info`` (TGI)
live in their protocol modules.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import hookimpl
from ..context import HostContext
from ..engine.request import RequestError, SamplingParams
from .app import error_response, json_response
from .metrics import metrics_json, read_stats
from .pd import PD_STATE

if TYPE_CHECKING:
    from ..host_protocol import Host

DEFAULT_PROBE_TIMEOUT = 10
MAX_PROBE_TIMEOUT = 600
REDACTED = "******"
SECRET_KEYS = ("apiKey",)


def not_ready_reason(host: Host) -> str | None:
    """Why the server is not ready, or None when it is."""
    if host.draining:
        return "The service has been stopped."
    if not host.ready:
        restarting = getattr(host.engine, "restarting", None)  # engineProcess: the engine died and comes back
        if restarting:
            return f"The service is not ready: the engine is restarting ({restarting})."
        return "The service is not ready: the model is still loading."
    engine = host.engine
    if engine is not None and getattr(engine, "dead", None):
        return f"The engine has stopped: {engine.dead}"
    return None


def parse_probe_timeout(text: str | None) -> int:
    """``TIMEOUT`` of ``/health/timed-TIMEOUT``: an integer in [1, 600]; 10 when absent."""
    if text is None:
        return DEFAULT_PROBE_TIMEOUT
    if not re.fullmatch(r"[0-9]{1,4}", text) or not 1 <= int(text) <= MAX_PROBE_TIMEOUT:
        raise RequestError(
            f"TIMEOUT must be an integer in [1, {MAX_PROBE_TIMEOUT}] seconds, got {text!r}",
            status=400, field="TIMEOUT",
        )
    return int(text)


async def probe_pipeline(host: Host, timeout: float) -> str | None:
    """Generate one token end to end; returns an error message, or None when healthy."""
    reason = not_ready_reason(host)
    if reason:
        return reason
    token = getattr(host.tokenizer, "bos_token_id", None)
    if token is None:
        token = 0
    try:
        req = host.new_request(
            protocol="health", body={}, sampling=SamplingParams(max_tokens=1), prompt_token_ids=[int(token)],
            request_id=host.new_request_id("health_timed"), timeout=float(timeout),
        )
        out = await asyncio.wait_for(host.generate_full(req), timeout)
    except asyncio.TimeoutError:
        return f"the probe request did not finish within {timeout} s"
    except RequestError as exc:
        return exc.message
    except Exception as exc:  # the probe reports any failure instead of raising
        return f"{type(exc).__name__}: {exc}"
    if out.finish_reason in ("error", "timeout", "abort"):
        return out.error or f"the probe request ended with {out.finish_reason}"
    return None


def static_config(host: Host, full: bool = False) -> dict[str, Any]:
    """``/v1/config`` (spec §3.4), optionally with the whole config (secrets redacted)."""
    mc = host.model_config
    body: dict[str, Any] = {
        "modelName": host.model_name,
        "maxSeqLen": host.config.deploy.maxSeqLen,
        "npuMemSize": mc.npuMemSize,
        "cpuMemSize": mc.cpuMemSize,
        "worldSize": mc.worldSize,
        "maxOutputLen": host.config.schedule.maxIterTimes,
        "cacheBlockSize": host.config.schedule.cacheBlockSize,
        # mindie-host additions, for the MS controller's static_info (total_slots_num, total_block_num)
        "maxBatchSize": host.config.schedule.maxBatchSize,
        "totalBlockNum": int(read_stats(host).get("kv_blocks_total", 0)),
        "inferMode": host.config.server.inferMode,
    }
    if host.config.server.inferMode == "dmi":
        body["interCommPort"] = host.config.server.interCommPort
    if full:
        data = host.config.to_dict()
        server = data.get("ServerConfig", {})
        for key in SECRET_KEYS:
            if server.get(key):
                server[key] = REDACTED
        body["config"] = data
    return body


def dynamic_status(host: Host) -> dict[str, Any]:
    """``/v1/status`` (spec §3.5): in dmi mode the role and, on D, the P instances it pulled KV from."""
    stats = read_stats(host)
    slots = host.config.schedule.maxBatchSize * host.config.BackendConfig.modelInstanceNumber  # instances summed
    free_slots = max(0, slots - int(stats.get("num_running", 0)))
    role, role_status = "none", "RoleReady" if host.ready else "RoleUnknown"
    pd = host.caches.get(PD_STATE)
    if host.config.server.inferMode == "dmi":  # PD: the role the controller set (server/pd.py)
        role_status = pd.role_status if (pd is not None and host.ready) else "RoleUnknown"
        role = pd.role if role_status == "RoleReady" else "none"
    status: dict[str, Any] = {
        "service": {"roleStatus": role_status, "currentRole": role},
        "resource": {"availSlotsNum": free_slots, "availBlockNum": int(stats.get("kv_blocks_free", 0))},
    }
    if role == "decode":
        status["peers"] = list(pd.linked)
    return status


def request_stop(host: Host) -> bool:
    """Refuse new inference requests and wake the runner's graceful stop; False if nothing is listening."""
    host.draining = True
    stop = host.runtime.stop_event
    if stop is None:
        return False
    loop = host.runtime.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is not None and loop is not running:
        loop.call_soon_threadsafe(stop.set)
    else:
        stop.set()
    return True


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    """Register the management routes."""
    host = ctx.host
    assert host is not None  # routes are added for a running host
    if plane != "management":
        return

    def readiness() -> Response:
        reason = not_ready_reason(host)
        if reason is None:
            return Response(status_code=200)
        return error_response(RequestError(reason, status=503))

    @app.get("/health")
    async def health() -> Response:
        return readiness()

    @app.get("/v2/health/live")
    async def live() -> Response:
        engine = host.engine
        if engine is not None and getattr(engine, "dead", None):  # the engine loop ended: restart the process
            return error_response(RequestError(f"The engine has stopped: {engine.dead}", status=503))
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return readiness()

    async def timed(timeout_text: str | None) -> Response:
        timeout = parse_probe_timeout(timeout_text)
        problem = await probe_pipeline(host, timeout)
        if problem is None:
            return json_response({"status": "healthy"})
        return json_response({"status": "unhealthy", "error": problem}, status=503)

    @app.get("/health/timed")
    async def health_timed() -> Response:
        return await timed(None)

    @app.get("/health/timed-{timeout}")
    async def health_timed_n(timeout: str) -> Response:
        return await timed(timeout)

    @app.get("/metrics-json")
    async def metrics_json_route() -> Response:
        s = host.config.server
        return json_response(metrics_json(host, f"{s.managementIpAddress}:{s.managementPort}"))

    @app.get("/v1/config")
    async def v1_config(request: Request) -> Response:
        full = request.query_params.get("full", "").lower() in ("1", "true", "yes")
        return json_response(static_config(host, full))

    @app.get("/v1/status")
    async def v1_status() -> Response:
        return json_response(dynamic_status(host))

    @app.get("/stopService")
    async def stop_service() -> Response:
        request_stop(host)
        return Response(status_code=200)
