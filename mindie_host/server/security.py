"""TLS, the optional API key, connection limits and request bookkeeping for the listeners.

TLS (``httpsEnabled``):

* the business listener uses ``tlsCert``/``tlsPk``/``tlsPkPwd``, CA files
  ``tlsCaPath``+``tlsCaFile`` and CRLs ``tlsCrlPath``+``tlsCrlFiles``;
* the management and metrics listeners use the ``managementTls*`` set (CA files
  under ``tlsCaPath`` as in MindIE) when ``managementIpAddress`` differs from
  ``ipAddress``, and the business set otherwise;
* CA files present => mutual TLS (clients must show a certificate the CA signed);
  CRL files present => revoked client certificates are refused;
* relative paths are under ``MIES_INSTALL_PATH`` when set, else under the config
  file's directory, else the working directory; absolute paths are used as is;
* an RSA server key shorter than 3072 bits is refused (the spec's rule);
* ``tlsPkPwd`` names a file holding the key's password, encrypted under the master key in
  ``kmcKsfMaster``/``kmcKsfStandby`` (:mod:`mindie_host.keystore`; plain text is read with a
  warning); ``apiKey`` may be such a token too.

Business-plane requests pass through :class:`BusinessGuard`, a plain ASGI wrapper:
request id and access log, ``apiKey`` bearer check (401; on a port the business
plane shares with the management plane, every route needs the key), body cap
``maxRequestBodyBytes`` (413), a body-read deadline ``bodyReadTimeoutSeconds`` (408;
the body is read before a slot is taken), and ``maxLinkNum``: at most ``maxLinkNum``
requests in progress, ``2*maxLinkNum`` more wait for a slot, and any further request
is refused at once with 503. :class:`HeaderTimeoutProtocol` closes connections whose
headers take longer than ``headerReadTimeoutSeconds`` (slowloris).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..file_modes import SECRET_MODE, FileModeError, check_mode
from ..host_state import CacheSlot
from ..keystore import SecretReader
from ..logs import bind_request_id, reset_request_id

if TYPE_CHECKING:
    from ..config import Config, ServerConfig

log = logging.getLogger("mindie_host.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MIN_RSA_BITS = 3072
REQUEST_ID_HEADER = "x-request-id"


class TLSConfigError(RuntimeError):
    """A certificate, key, CA or CRL file named by the config is missing or unusable."""


# -- TLS ---------------------------------------------------------------------------------------------
def security_base(config: Config) -> Path:
    """The directory relative TLS paths start from (see the module docstring)."""
    install = os.environ.get("MIES_INSTALL_PATH")
    if install:
        return Path(install)
    if config.source_path:
        return Path(config.source_path).resolve().parent
    return Path.cwd()


def resolve(base: Path, *parts: str) -> Path:
    """Join ``parts`` under ``base``; an absolute part restarts the path."""
    path = base
    for part in parts:
        path = path / Path(part).expanduser()
    return path


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


def _files(base: Path, directory: str, names: list[str]) -> list[Path]:
    return [resolve(base, directory, name) for name in names if name]


def secret_reader(config: Config) -> SecretReader:
    """Decrypts the server's secrets under ``kmcKsfMaster``/``kmcKsfStandby`` (relative to :func:`security_base`)."""
    base, s = security_base(config), config.server
    return SecretReader(resolve(base, s.kmcKsfMaster) if s.kmcKsfMaster else None,
                        resolve(base, s.kmcKsfStandby) if s.kmcKsfStandby else None, "ServerConfig")


def _read_password(path: Path | None, secrets: SecretReader | None = None) -> str | None:
    """A key-password file's secret: a token decrypts under ``secrets``' keystore, plain text is used as it is."""
    return (secrets or SecretReader(None, None, "this component")).read_file(path)


def _check_key_strength(key_path: Path, password: str | None) -> None:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
    except ImportError:  # optional: without it the key length is not checked
        log.warning("the 'cryptography' package is not installed; the server key length is not checked")
        return
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password.encode() if password else None)
    except (TypeError, ValueError) as exc:
        raise TLSConfigError(f"cannot read private key {key_path}: {exc} (is the password file right?)") from exc
    if isinstance(key, rsa.RSAPrivateKey) and key.key_size < MIN_RSA_BITS:
        raise TLSConfigError(
            f"private key {key_path} is RSA-{key.key_size}; the server key must be at least RSA-{MIN_RSA_BITS} "
            "(or an EC key)"
        )


def check_tls_file_modes(paths: list[Path | None], what: str) -> None:
    """``MINDIE_CHECK_INPUTFILES_PERMISSION``: certificates, keys, CA/CRL and password files at most 0600."""
    for path in paths:
        if path is None:
            continue
        try:
            check_mode(path, SECRET_MODE, f"a TLS file of the {what}")
        except FileModeError as exc:
            raise TLSConfigError(f"{what}: {exc}") from None


def build_ssl_context(
    cert: Path, key: Path, password_file: Path | None, ca_files: list[Path], crl_files: list[Path], what: str,
    secrets: SecretReader | None = None,
) -> ssl.SSLContext:
    """A server-side context: our cert and key, client certificates required if CA files are given."""
    for path, name in ((cert, "certificate"), (key, "private key")):
        if not path.is_file():
            raise TLSConfigError(f"{what}: TLS {name} {path} does not exist")
    check_tls_file_modes([cert, key, password_file, *ca_files, *crl_files], what)
    password = _read_password(password_file, secrets)
    _check_key_strength(key, password)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key), password=password)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"{what}: cannot load {cert} with {key}: {exc}") from exc
    cas = [p for p in ca_files if p.is_file()]
    missing = [p for p in ca_files if not p.is_file()]
    if missing:
        raise TLSConfigError(f"{what}: CA file(s) not found: {', '.join(map(str, missing))}")
    for ca in cas:
        ctx.load_verify_locations(cafile=str(ca))
    if cas:
        ctx.verify_mode = ssl.CERT_REQUIRED
        crls = [p for p in crl_files if p.is_file()]
        for crl in crls:
            ctx.load_verify_locations(cafile=str(crl))
        if crls:
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        elif crl_files:
            log.info("%s: no CRL file found (%s); revocation is not checked", what, ", ".join(map(str, crl_files)))
    return ctx


def plane_ssl_context(config: Config, planes: tuple[str, ...]) -> ssl.SSLContext | None:
    """The SSL context for a listener serving ``planes``, or None when HTTPS is off."""
    s: ServerConfig = config.server
    if not s.httpsEnabled:
        return None
    base = security_base(config)
    separate = "business" not in planes and s.managementIpAddress != s.ipAddress
    if separate:
        return build_ssl_context(
            cert=resolve(base, s.managementTlsCert),
            key=resolve(base, s.managementTlsPk),
            password_file=resolve(base, s.managementTlsPkPwd) if s.managementTlsPkPwd else None,
            ca_files=_files(base, s.tlsCaPath, s.managementTlsCaFile),
            crl_files=_files(base, s.managementTlsCrlPath, s.managementTlsCrlFiles),
            what="management plane",
            secrets=secret_reader(config),
        )
    return build_ssl_context(
        cert=resolve(base, s.tlsCert),
        key=resolve(base, s.tlsPk),
        password_file=resolve(base, s.tlsPkPwd) if s.tlsPkPwd else None,
        ca_files=_files(base, s.tlsCaPath, s.tlsCaFile),
        crl_files=_files(base, s.tlsCrlPath, s.tlsCrlFiles),
        what="business plane" if "business" in planes else "management plane",
        secrets=secret_reader(config),
    )


def tls_options(config: Config, planes: tuple[str, ...]) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for a listener (empty when HTTPS is off).

    The context is built here, so a bad certificate fails before anything listens.
    """
    ctx = plane_ssl_context(config, planes)
    if ctx is None:
        return {}
    import inspect

    import uvicorn

    if "ssl_context_factory" not in inspect.signature(uvicorn.Config.__init__).parameters:
        raise TLSConfigError("HTTPS needs a uvicorn whose Config takes ssl_context_factory; pip install -U uvicorn")
    return {"ssl_context_factory": lambda _config, _default: ctx}


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
