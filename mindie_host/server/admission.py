"""Who gets in, and how far: the guards in front of every route of the listeners.

* :func:`check_bind_addresses`: 0.0.0.0 only with ``allowAllZeroIpListening`` (the config's own
  rule, checked again at start because a config object can change after it was validated), and
  a warning when allowed.
* :class:`HeaderTimeoutProtocol` closes connections whose headers take longer than
  ``headerReadTimeoutSeconds`` (slowloris).
* :class:`BusinessGuard`, a plain ASGI wrapper on every listener: request id and access log,
  ``apiKey`` bearer check (401; on a port the business plane shares with the management plane,
  every route needs the key), body cap ``maxRequestBodyBytes`` (413), a body-read deadline
  ``bodyReadTimeoutSeconds`` (408; the body is read before a slot is taken), and on business
  routes ``maxLinkNum`` (:class:`LinkGate`): at most ``maxLinkNum`` requests in progress,
  ``2*maxLinkNum`` more wait for a slot, and any further request is refused at once with 503.

The listeners' TLS is :mod:`.tls`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..host_state import CacheSlot
from ..logs import bind_request_id, reset_request_id
from .tls import secret_reader

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger("mindie_host.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = "x-request-id"


def check_bind_addresses(config: Config) -> None:
    """Refuse 0.0.0.0 unless ``allowAllZeroIpListening`` (config validation does this too); warn when allowed."""
    s = config.server
    for key in ("ipAddress", "managementIpAddress"):
        if getattr(s, key) != "0.0.0.0":
            continue
        if not s.allowAllZeroIpListening:
            raise RuntimeError(
                f"ServerConfig.{key} is 0.0.0.0, which listens on every interface; "
                "set ServerConfig.allowAllZeroIpListening to true to allow it"
            )
        log.warning(
            "ServerConfig.%s is 0.0.0.0: the server listens on every network interface and is reachable from "
            "any network this machine is on; bind a specific address unless that is intended", key,
        )


# -- connection limits ------------------------------------------------------------------------------
#: the business plane's ``maxLinkNum`` gate, per host (made by server/runner.py, read by /metrics)
LINK_GATE: CacheSlot[LinkGate] = CacheSlot("maxLinkNum gate")


class LinkGate:
    """``maxLinkNum`` in progress, ``queue_factor * maxLinkNum`` waiting, the rest refused."""

    def __init__(self, limit: int, queue_factor: int = 2) -> None:
        self.limit = limit
        self.queue_limit = queue_factor * limit
        self.active = 0
        self.waiting = 0
        self.rejected = 0
        self._sem: asyncio.Semaphore | None = None

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limit)
        return self._sem

    def try_enter(self) -> bool:
        """False when both the processing slots and the queue are full."""
        if self.active + self.waiting >= self.limit + self.queue_limit:
            self.rejected += 1
            return False
        self.waiting += 1
        return True

    async def acquire(self) -> None:
        """Wait for a processing slot (after :meth:`try_enter`)."""
        try:
            await self._semaphore().acquire()
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._semaphore().release()

    def rejection_message(self) -> str:
        return (
            f"Too many requests: {self.limit} are being processed and {self.queue_limit} are queued "
            f"(ServerConfig.maxLinkNum = {self.limit}); retry later."
        )


# -- slow clients ------------------------------------------------------------------------------------
class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers trickle in (slowloris).

    A deadline of ``header_timeout`` seconds starts when the connection opens and
    whenever the first bytes of a further request arrive on a kept-alive connection;
    it is cancelled once the request line and all headers have arrived. An idle
    kept-alive connection is left to uvicorn's keep-alive timeout.
    """

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self._header_timer is None and self.conn.trailing_data[0]:
                self._arm_header_timer()  # part of a request line or headers is buffered
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete):
            log.info("closing a connection from %s: request headers incomplete after %g s "
                     "(ServerConfig.headerReadTimeoutSeconds)", self.client, self.header_timeout)
            self.transport.close()


def listener_protocol(config: Config) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that bound how long request headers may take to arrive."""
    timeout = float(config.server.headerReadTimeoutSeconds)
    return {"http": type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": timeout})}


# -- the ASGI wrapper ---------------------------------------------------------------------------------
async def _send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": data})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class BusinessGuard:
    """Wraps a listener's app: request ids, the access log and the body cap everywhere; on business
    routes the API key and ``maxLinkNum`` too.

    ``is_business(scope)`` tells business routes from management ones when planes share a port.
    """

    def __init__(self, app: ASGIApp, config: Config, gate: LinkGate | None,
                 is_business: Callable[[Scope], bool], ready: Callable[[], bool] = lambda: True,
                 business_port: bool | None = None) -> None:
        self.app = app
        self.config = config
        self.gate = gate
        self.is_business = is_business
        self.ready = ready
        key = secret_reader(config).reveal(config.server.apiKey, "ServerConfig.apiKey")
        self.api_key = key.encode() if key else None
        #: the listener serves the business plane: then every route on it (management ones included) needs the key
        self.business_port = gate is not None if business_port is None else business_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = (_header(scope, REQUEST_ID_HEADER.encode()) or uuid.uuid4().hex)[:128]
        token = bind_request_id(rid)
        started = time.perf_counter()
        status_box = [0]
        rid_header = (REQUEST_ID_HEADER.encode(), rid.encode("latin-1", "replace"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        business = self.is_business(scope)
        try:
            if business:
                await self._business(scope, receive, send_with_id)
            elif self.business_port and self.api_key is not None and not self._authorized(scope):
                await self._unauthorized(send_with_id)  # a management route sharing the business port
            else:
                capped = await self._capped_body(scope, receive, send_with_id)
                if capped is not None:
                    await self.app(scope, capped, send_with_id)
        finally:
            # method, path, status and timing only: never a body (no prompt text in the logs)
            log.log(logging.INFO if business else logging.DEBUG, "%s %s -> %s (%.3f s)", scope.get("method"),
                    scope.get("path"), status_box[0] or "aborted", time.perf_counter() - started)
            reset_request_id(token)

    @staticmethod
    async def _unauthorized(send: Send) -> None:
        await _send_json(send, 401, {"type": "Unauthorized", "error": "missing or invalid API key: send "
                                     "'Authorization: Bearer <ServerConfig.apiKey>'"},
                         [(b"www-authenticate", b"Bearer")])

    async def _capped_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The one place the body cap (``maxRequestBodyBytes``, 413) and the body deadline
        (``bodyReadTimeoutSeconds``, 408) are enforced, for every route of every plane.

        :return: a ``receive`` that replays the buffered body, or ``None`` when the request
            was answered here.
        """
        limit = self.config.server.maxRequestBodyBytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_json(send, 413, {"type": "Payload Too Large", "error": f"request body of {declared} bytes "
                                         f"exceeds the {limit}-byte limit (ServerConfig.maxRequestBodyBytes)",
                                         "field": "body"}, [])
            return None
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return receive
        # the whole body is read before a maxLinkNum slot is taken, within bodyReadTimeoutSeconds,
        # so a client trickling its body holds no slot and is cut off
        body_timeout = self.config.server.bodyReadTimeoutSeconds
        try:
            buffered = await asyncio.wait_for(self._buffer_body(receive, limit), body_timeout)
        except asyncio.TimeoutError:
            log.info("request body incomplete after %g s: 408", body_timeout)
            await _send_json(send, 408, {"type": "Timeout", "error": f"the request body did not arrive within "
                                         f"{body_timeout:g} s (ServerConfig.bodyReadTimeoutSeconds)",
                                         "field": "body"}, [(b"connection", b"close")])
            return None
        if buffered is None:
            await _send_json(send, 413, {"type": "Payload Too Large", "error": f"request body exceeds the "
                                         f"{limit}-byte limit (ServerConfig.maxRequestBodyBytes)",
                                         "field": "body"}, [(b"connection", b"close")])
            return None
        return _replay(buffered, receive)

    async def _business(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is not None and not self._authorized(scope):
            await self._unauthorized(send)
            return
        if scope.get("method") == "POST" and not self.ready():
            await _send_json(send, 503, {"type": "Service Unavailable",
                                         "error": "The service is not ready: the model is still loading."}, [])
            return
        capped = await self._capped_body(scope, receive, send)
        if capped is None:
            return
        receive = capped
        gate = self.gate
        if gate is None:
            await self.app(scope, receive, send)
            return
        if not gate.try_enter():
            log.warning("rejected: %s", gate.rejection_message())
            await _send_json(send, 503, {"type": "Service Unavailable", "error": gate.rejection_message()},
                             [(b"retry-after", b"1")])
            return
        await gate.acquire()
        try:
            await self.app(scope, receive, send)
        finally:
            gate.release()

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        auth = _header(scope, b"authorization") or ""
        scheme, _, value = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.strip().encode(), self.api_key)

    @staticmethod
    async def _buffer_body(receive: Receive, limit: int) -> list[Message] | None:
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            size += len(message.get("body", b""))
            if size > limit:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
