"""PD disaggregation on the server (spec §3; ``inferMode: "dmi"``): roles, the P answer, the D channel.

In dmi mode a server is a prefill (P) or a decode (D) instance; MindIE MS's controller sets
the role and the coordinator talks to the servers (docs/scale-out.md has the whole flow).

* ``POST /v1/role/{prefill|decode}`` (management port): the spec's body; 200 ``{"result":"OK"}``,
  400/422 ``{"error","error_type"}``. ``/v1/status`` then reports ``RoleReady`` and the role.
* **P** (business port): an inference request of any of the five API families with the headers
  ``req-id``, ``d-target``, ``req-type: prefill`` and optionally ``is-recompute``. The route runs
  as usual (:mod:`mindie_host.pd.call`) until the first token is out; P then asks D to continue
  (``POST /dmi/decode`` on D's ``interCommPort``, with the original request and where to pull
  the KV from) and answers the envelope ``{reqId, isStream, output, isLastResp, contentType}``:
  a stream's ``output`` is its first event(s); ``isLastResp`` true means P finished the request
  alone and ``output`` is the whole answer. Refusals keep the protocol's own status and body.
  ``d-target`` is ``IP`` or ``IP:PORT`` (a mindie-host extension so several servers can share
  one address; PORT is D's ``interCommPort``, by default P's own).
* **D**: ``/dmi/decode`` replays the request through the business app with the KV import
  attached; every result goes out on ``GET /dresult`` (business port), one JSON envelope per
  line: per generated token for a stream (``seq`` 1, 2, ...; P's event was unit 0), the whole
  answer for a non-stream request, and ``"error": {status, message, recompute}`` when D failed.
  Envelopes made while no ``/dresult`` connection is open wait (up to :data:`BACKLOG_SECONDS`).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from .. import hookimpl
from ..context import HostContext
from ..engine.handoff import HOLD_SECONDS
from ..host_state import CacheSlot
from ..pd.call import DECODE, PREFILL, PDCall, current_call
from .app import json_response

if TYPE_CHECKING:
    from ..host_protocol import Host

log = logging.getLogger("mindie_host.server.pd")

#: The routes that generate (P answers them with an envelope; a D refuses them from users).
INFERENCE_PATHS = re.compile(
    r"^/(v1/chat/completions|v1/completions|generate|generate_stream|infer|infer_token"
    r"|v2/models/[^/]+(/versions/[^/]+)?/(generate|generate_stream|infer))$"
)
PD_HEADERS = ("req-id", "d-target", "req-type", "is-recompute")
#: Headers P does not pass on to D (hop-by-hop, PD's own, and what the replay recomputes).
DROP_HEADERS = frozenset({*PD_HEADERS, "host", "content-length", "connection", "transfer-encoding", "keep-alive"})
BACKLOG_SECONDS = 30.0
MAX_BODY = 64 << 20
#: How long P waits for D to accept a request.
SEND_D_TIMEOUT = 10.0


@dataclass
class PDState:
    """The server's PD role, its envelope channels (D) and the KV it holds for D (P)."""

    role: str = "none"
    role_status: str = "RoleUnknown"
    peers: list[str] = field(default_factory=list)
    linked: dict[str, float] = field(default_factory=dict)
    channels: set[asyncio.Queue[bytes]] = field(default_factory=set)
    backlog: deque[tuple[float, bytes]] = field(default_factory=deque)
    #: P: req-id -> (engine request id, when) of KV held for D; a recompute releases it first
    held: dict[str, tuple[str, float]] = field(default_factory=dict)
    client: httpx.AsyncClient | None = None

    def publish(self, envelope: dict[str, Any]) -> None:
        """Send ``envelope`` on every ``/dresult`` channel (kept for a while when none is open)."""
        line = (json.dumps(envelope, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        if not self.channels:
            self.backlog.append((time.monotonic(), line))
            return
        for queue in self.channels:
            queue.put_nowait(line)

    def open_channel(self) -> asyncio.Queue[bytes]:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        cutoff = time.monotonic() - BACKLOG_SECONDS
        while self.backlog:
            made, line = self.backlog.popleft()
            if made >= cutoff:
                queue.put_nowait(line)
        self.channels.add(queue)
        return queue

    def remember_held(self, req_id: str, engine_request_id: str) -> None:
        now = time.monotonic()
        for key in [k for k, (_, t) in self.held.items() if now - t > HOLD_SECONDS]:
            del self.held[key]
        self.held[req_id] = (engine_request_id, now)


#: this instance's PD role, channels and held KV, per host (made on first use)
PD_STATE: CacheSlot[PDState] = CacheSlot("PD disaggregation state")
#: the business app behind the PD gate (set by server/runner.py), for requests a P instance hands to this D
BUSINESS_APP: CacheSlot[Any] = CacheSlot("business app")


def pd_state(host: Host) -> PDState:
    """This instance's :class:`PDState`, made on first use."""
    return host.caches.get_or_make(PD_STATE, PDState)


def dmi(host: Host) -> bool:
    return host.config.server.inferMode == "dmi"


def _error(message: str, status: int = 400, error_type: str = "Bad Request") -> Response:
    return json_response({"error": message, "error_type": error_type}, status=status)


# -- role --------------------------------------------------------------------------------------------
class RoleError(ValueError):
    """A ``/v1/role`` body that does not follow the spec; the message names the field."""


def _devices(obj: Any, where: str) -> list[dict[str, Any]]:
    devices = obj.get("device") if isinstance(obj, dict) else None
    if not isinstance(devices, list) or not devices:
        raise RoleError(f"{where}.device must be a non-empty list of devices")
    for i, dev in enumerate(devices):
        if not isinstance(dev, dict):
            raise RoleError(f"{where}.device[{i}] must be an object")
        lid = dev.get("device_logical_id")
        if not isinstance(lid, str) or not lid.isdigit():
            raise RoleError(f"{where}.device[{i}].device_logical_id must be an integer string such as \"0\"")
        if not isinstance(dev.get("device_ip"), str):
            raise RoleError(f"{where}.device[{i}].device_ip must be a string")
    return devices


def _server_ip(obj: Any, where: str) -> str:
    ip = obj.get("server_ip") if isinstance(obj, dict) else None
    try:
        return str(ipaddress.IPv4Address(ip))
    except (ipaddress.AddressValueError, ValueError, TypeError):
        raise RoleError(f"{where}.server_ip must be an IPv4 address, got {ip!r}") from None


def parse_role_body(body: Any) -> list[str]:
    """Check a ``/v1/role`` body (spec Table 4-15); returns the peers' server IPs."""
    if not isinstance(body, dict) or not isinstance(body.get("local"), dict):
        raise RoleError("local is required: {\"server_ip\": ..., \"device\": [...]}")
    _server_ip(body["local"], "local")
    local = _devices(body["local"], "local")
    peers = body.get("peers", [])
    if not isinstance(peers, list):
        raise RoleError("peers must be a list")
    ips = []
    for i, peer in enumerate(peers):
        ips.append(_server_ip(peer, f"peers[{i}]"))
        if len(_devices(peer, f"peers[{i}]")) != len(local):
            raise RoleError(f"peers[{i}].device must list as many devices as local.device ({len(local)})")
    return ips


# -- P ---------------------------------------------------------------------------------------------
def _header_problem(host: Host, headers: dict[str, str]) -> str | None:
    """The spec's 400 message for bad PD headers, or None."""
    if not all(headers.get(h) for h in ("req-type", "req-id", "d-target")):
        return "DMI request must have req-type, req-id, d-target headers."
    req_id = headers["req-id"]
    if len(req_id) > 1024:
        return "The length of req-id cannot exceed 1024."
    if not req_id.isdigit():
        return "req-id must be a numeric string."
    if headers["req-type"] != "prefill":
        return f"req-type must be prefill but got {headers['req-type']}."
    target = d_target(host, headers["d-target"])
    if target is None:
        return "d-target must be an IPv4 address."
    s = host.config.server
    if target == (s.ipAddress, s.interCommPort):
        return "d-target should not be itself."
    recompute = headers.get("is-recompute")
    if recompute is not None and recompute not in ("true", "false"):
        return f"is-recompute must be true or false, got {recompute!r}."
    return None


def d_target(host: Host, text: str) -> tuple[str, int] | None:
    """``IP`` or ``IP:PORT`` (PORT: D's interCommPort, by default this server's)."""
    ip, _, port = text.strip().partition(":")
    try:
        ip = str(ipaddress.IPv4Address(ip))
    except (ipaddress.AddressValueError, ValueError):
        return None
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        return None
    return ip, int(port) if port else host.config.server.interCommPort


class _Capture:
    """What an inner app sent: status, headers, body chunks."""

    def __init__(self, frozen: asyncio.Event | None = None) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.done = False
        self.frozen = frozen

    async def send(self, message: dict[str, Any]) -> None:
        if self.frozen is not None and self.frozen.is_set():
            return  # P handed off: what the route sends now is not part of the answer
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.append(message["body"])
            if not message.get("more_body"):
                self.done = True

    @property
    def streamed(self) -> bool:
        """A streamed answer: started, without a Content-Length."""
        return self.status != 0 and "content-length" not in self.headers

    def take(self) -> str:
        text = b"".join(self.chunks).decode("utf-8", "replace")
        self.chunks = []
        return text


def _body_once(body: bytes, then: Any) -> Any:
    """An ASGI ``receive`` that gives ``body`` whole, then whatever ``then()`` gives."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()  # type: ignore[no-any-return]

    return receive


async def _never_disconnect() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def _read_body(receive: Any) -> bytes | None:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY:
            return None
        if not message.get("more_body"):
            return b"".join(parts)


class PDGate:
    """ASGI wrapper of the business app: PD headers, the P envelope, ``/dresult``, and refusals by role."""

    def __init__(self, host: Host, app: Any) -> None:
        self.host = host
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host, path = self.host, scope["path"]
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path == "/dresult":
            await self._dresult(scope, receive, send)
            return
        has_pd = any(h in headers for h in ("req-type", "req-id", "d-target"))
        if not INFERENCE_PATHS.match(path) or (not dmi(host) and not has_pd):
            await self.app(scope, receive, send)
            return
        if not dmi(host):
            await _error("DMI request headers (req-type, req-id, d-target) were sent to a server in standard "
                         "(mixed) mode: ServerConfig.inferMode is 'standard'")(scope, receive, send)
            return
        state = pd_state(host)
        if state.role_status != "RoleReady":
            # the spec's sentence, as a 503 naming what is missing (the spec's table gives it 500): the instance is
            # up and will serve once the MS controller gives it its role; retrying elsewhere or later is right
            await _error(
                f"Role status is invalid. This dmi instance has no PD role yet (roleStatus {state.role_status}): it "
                "serves once the MS controller assigns it prefill or decode (POST /v1/role/{prefill|decode} on the "
                "management port)",
                503,
                "Service Unavailable",
            )(scope, receive, send)
            return
        if state.role != PREFILL:
            await _error("DMI inference requests can be sent only to the prefill node.")(scope, receive, send)
            return
        problem = _header_problem(host, headers)
        if problem is None and ("inference-header-content-length" in headers
                                or headers.get("content-type", "").startswith("application/octet-stream")):
            problem = "binary tensor data (Inference-Header-Content-Length) is not supported in dmi mode"
        if problem is not None:
            await _error(problem)(scope, receive, send)
            return
        await self._prefill(scope, receive, send, headers)

    async def _prefill(self, scope: Any, receive: Any, send: Any, headers: dict[str, str]) -> None:
        host, state = self.host, pd_state(self.host)
        req_id = headers["req-id"]
        if headers.get("is-recompute") == "true" and req_id in state.held:
            host.engine.release(state.held.pop(req_id)[0])  # type: ignore[union-attr]
        body = await _read_body(receive)
        if body is None:
            await _error("the request body could not be read (client gone, or over 64 MiB)", 413)(scope, receive, send)
            return
        replay = _body_once(body, receive)  # then the connection's own messages (a disconnect)
        call = PDCall(PREFILL, req_id)
        capture = _Capture(call.handed_off)
        token = current_call.set(call)
        try:
            route = asyncio.ensure_future(self.app(scope, replay, capture.send))
        finally:
            current_call.reset(token)
        handed = asyncio.ensure_future(call.handed_off.wait())
        await asyncio.wait({route, handed}, return_when=asyncio.FIRST_COMPLETED)
        if not call.handed_off.is_set():
            handed.cancel()
            await route
            if capture.status != 200:  # refused or failed before generating: the protocol's own answer
                await _replay_response(capture, send)
                return
            envelope = {"reqId": req_id, "isStream": capture.streamed, "output": capture.take(), "isLastResp": True,
                        "contentType": capture.headers.get("content-type", "application/json")}
            await json_response(envelope)(scope, receive, send)
            return
        try:
            await route  # it ends at once (HandedOff); what it sends now is dropped
        except Exception:
            log.exception("request %s: the route failed after the handoff", req_id)
        rid = call.engine_request_id
        assert rid is not None
        state.remember_held(req_id, rid)
        envelope = {"reqId": req_id, "isStream": capture.streamed, "isLastResp": False,
                    "contentType": capture.headers.get("content-type", "application/json")}
        if capture.streamed:
            envelope["output"] = capture.take()
        problem = await self._send_to_d(scope, headers, body, rid)
        if problem is not None:
            host.engine.release(rid)  # type: ignore[union-attr]
            state.held.pop(req_id, None)
            log.warning("request %s: %s", req_id, problem)
            message = f"[P Node] Send D request failed! {problem}"
            envelope = {"reqId": req_id, "isStream": capture.streamed, "isLastResp": True,
                        "contentType": "application/json", "output": json.dumps({"error": message}),
                        "error": {"status": 503, "message": message, "recompute": True}}
        await json_response(envelope)(scope, receive, send)

    async def _send_to_d(self, scope: Any, headers: dict[str, str], body: bytes, rid: str) -> str | None:
        host, state = self.host, pd_state(self.host)
        target = d_target(host, headers["d-target"])
        assert target is not None
        kv_address = (host.info.extra.get("kv_address") if host.info is not None else None) or ""
        message = {
            "reqId": headers["req-id"], "method": scope["method"], "path": scope["path"],
            "query": scope.get("query_string", b"").decode("latin-1"),
            "headers": {k: v for k, v in headers.items() if k not in DROP_HEADERS},
            "body": base64.b64encode(body).decode(), "source": kv_address, "handle": rid,
            "p": host.config.server.ipAddress,
        }
        if state.client is None:
            state.client = httpx.AsyncClient(timeout=SEND_D_TIMEOUT, trust_env=False)
        try:
            resp = await state.client.post(f"http://{target[0]}:{target[1]}/dmi/decode", json=message)
        except httpx.HTTPError as exc:
            return f"D {target[0]}:{target[1]} could not be reached ({type(exc).__name__})"
        if resp.status_code != 200:
            return f"D {target[0]}:{target[1]} refused the request ({resp.status_code}: {resp.text[:200]})"
        return None

    async def _dresult(self, scope: Any, receive: Any, send: Any) -> None:
        host = self.host
        if not dmi(host):
            await _error("Non DMI does not support dresult request.")(scope, receive, send)
            return
        state = pd_state(host)
        if state.role != DECODE:
            await _error(f"Only the Decode node supports dresult but you send to {state.role}.")(scope, receive, send)
            return
        queue = state.open_channel()

        async def lines() -> Any:
            try:
                while not host.draining:
                    try:
                        yield await asyncio.wait_for(queue.get(), 1.0)
                    except asyncio.TimeoutError:
                        continue
            finally:
                state.channels.discard(queue)

        response = StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await response(scope, receive, send)


async def _replay_response(capture: _Capture, send: Any) -> None:
    headers = [(k.encode(), v.encode()) for k, v in capture.headers.items() if k != "content-length"]
    body = b"".join(capture.chunks)
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": capture.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# -- D ---------------------------------------------------------------------------------------------
async def decode_replay(host: Host, app: Any, message: dict[str, Any]) -> None:
    """Run a request P handed over through the business ``app``, publishing its results on ``/dresult``."""
    state = pd_state(host)
    req_id = str(message["reqId"])
    call = PDCall(DECODE, req_id, source=str(message["source"]), handle=str(message["handle"]))
    capture = _Capture()
    units = {"last": 0}

    def on_unit(k: int) -> None:
        units["last"] = k
        if k == 0:
            if call.failure is None:
                state.linked[str(message.get("p", ""))] = time.monotonic()
            if capture.streamed and capture.status == 200:
                capture.take()  # P delivered the first token's events
            return
        if capture.streamed and capture.status == 200:
            state.publish({"reqId": req_id, "isStream": True, "output": capture.take(), "isLastResp": False,
                           "seq": k})

    call.on_unit = on_unit
    body = base64.b64decode(message["body"])
    receive = _body_once(body, _never_disconnect)  # D runs to the end; the coordinator reads /dresult

    headers = [(k.encode(), str(v).encode("latin-1")) for k, v in message.get("headers", {}).items()]
    headers.append((b"content-length", str(len(body)).encode()))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": message.get("method", "POST"),
        "scheme": "http", "path": message["path"], "raw_path": message["path"].encode(),
        "query_string": str(message.get("query", "")).encode(), "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 0), "server": (host.config.server.ipAddress, host.config.server.port),
    }
    token = current_call.set(call)
    try:
        await app(scope, receive, capture.send)
    except Exception:  # the replay must end with an envelope whatever happens
        log.exception("request %s failed on D", req_id)
        capture.status = capture.status or 500
    finally:
        current_call.reset(token)
    envelope: dict[str, Any] = {"reqId": req_id, "isStream": capture.streamed and capture.status == 200,
                                "output": capture.take(), "isLastResp": True}
    if envelope["isStream"]:
        envelope["seq"] = units["last"] + 1
    failure = call.failure or ((capture.status, envelope["output"][:500]) if capture.status != 200 else None)
    if failure is not None:
        status, text = failure
        if status == 502:  # the KV transfer failed: this P is not linked any more
            state.linked.pop(str(message.get("p", "")), None)
        envelope["error"] = {"status": status, "message": text, "recompute": status >= 500}
    state.publish(envelope)


# -- routes ----------------------------------------------------------------------------------------
@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    """``/v1/role`` on the management plane, ``/dmi/decode`` on the inter-instance plane (dmi only)."""
    host = ctx.host
    assert host is not None  # routes are added for a running host
    if plane == "management":

        @app.post("/v1/role/{role}")
        async def set_role(role: str, request: Request) -> Response:
            if not dmi(host):
                return _error("this server runs in standard (mixed) mode: ServerConfig.inferMode is not 'dmi'")
            if role not in (PREFILL, DECODE):
                return _error(f"role must be prefill or decode, got {role!r}")
            try:
                body = json.loads(await request.body() or b"null")
            except (ValueError, UnicodeDecodeError):
                return _error("the body is not valid JSON", 422, "Input Validation Error")
            try:
                peers = parse_role_body(body)
            except RoleError as exc:
                return _error(str(exc), 422, "Input Validation Error")
            state = pd_state(host)
            state.role_status = "RoleSwitching"
            if role != state.role:
                state.linked.clear()
            state.role, state.peers = role, peers
            state.role_status = "RoleReady"
            log.info("role set to %s (peers: %s)", role, ", ".join(peers) or "none")
            return json_response({"result": "OK"})

    elif plane == "intercomm":

        @app.post("/dmi/decode")
        async def decode(request: Request) -> Response:
            state = pd_state(host)
            if state.role != DECODE or state.role_status != "RoleReady":
                return _error(f"this instance is not a decode instance (role {state.role})")
            try:
                message = json.loads(await request.body())
                assert isinstance(message, dict)
                for key in ("reqId", "path", "body", "source", "handle"):
                    assert isinstance(message.get(key), str), key
            except (ValueError, AssertionError, UnicodeDecodeError):
                return _error("the body must be P's request: reqId, path, body, source, handle", 422,
                              "Input Validation Error")
            business = host.caches.get(BUSINESS_APP)
            if business is None or not host.ready:
                return _error("D is not ready", 503, "Service Unavailable")
            task = asyncio.create_task(decode_replay(host, business, message))
            host.runtime.background.add(task)
            task.add_done_callback(host.runtime.background.discard)
            return json_response({"result": "OK"})
