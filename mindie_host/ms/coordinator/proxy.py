"""Forwarding user requests to an instance, bytes in and bytes out, streams as they arrive.

A request is admitted (``max_requests``), given an instance (:class:`~.limits.Scheduler`) and
sent with a pooled :class:`aiohttp.ClientSession`. Until the first byte of the answer reaches the
user nothing is lost, so a request whose instance fails before that (connection refused or
reset, the server dying mid-generation, a 503 from a draining server) is sent to another
instance, at most ``max_retry`` more times; the failed instance leaves rotation. A complete
answer (one with a Content-Length) is passed on whole; a streamed one is passed on chunk by
chunk, never buffered. When the instance fails after the stream started, the stream ends with
an error event in the protocol's format (OpenAI's error object for ``/v1/*``, ``{"error": ...}``
as an SSE event for the other SSE streams, as a NUL-terminated JSON object for vLLM's
``/generate`` stream).

Deadlines: ``first_token_timeout`` bounds the wait for a stream's first chunk,
``infer_timeout`` the whole request (``tokenizer_timeout`` for ``/v1/tokenizer``), both with
the spec's messages; 0 switches one off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl as ssl_module
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .config import CoordinatorConfig
from .instances import Instance
from .limits import NOT_READY, Refused, Scheduler
from .routing import CHAT_PATH, RequestInfo, conversation_keys

log = logging.getLogger("mindie_host.ms.coordinator")

T = TypeVar("T")
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length", "date", "server",
})
FIRST_TOKEN_TIMEOUT = "Request first token timeout"
INFER_TIMEOUT = "Request inference timeout"
TOKENIZER_TIMEOUT = "Request tokenizer timeout"
TOKENIZER_PATH = "/v1/tokenizer"
BYTES_PER_TOKEN = 4  # rough token estimate from a body's size, for coordinator_info


class _Retry(Exception):
    """The instance failed before any byte reached the user: try another."""


def error_body(path: str, message: str, status: int, error_type: str) -> dict[str, Any]:
    """An error object in the protocol's shape (OpenAI for ``/v1/...`` completions, MindIE otherwise)."""
    if path.startswith("/v1/") and path != TOKENIZER_PATH:
        kind = {429: "rate_limit_error", 413: "invalid_request_error", 400: "invalid_request_error"}.get(
            status, "server_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return {"error": message, "error_type": error_type}


def error_response(path: str, refused: Refused) -> Response:
    body = error_body(path, refused.message, refused.status, refused.error_type)
    return Response(json.dumps(body, separators=(",", ":")), status_code=refused.status,
                    media_type="application/json")


def stream_error_event(path: str, content_type: str, message: str) -> bytes:
    """The last chunk of a stream cut short, in the stream's own format."""
    body = error_body(path, message, 500, "Internal Server Error")
    payload = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    if "text/event-stream" in content_type:
        return f"data: {payload}\n\n".encode()
    if path == "/generate":  # vLLM: NUL-separated JSON objects
        return payload.encode() + b"\0"
    return payload.encode() + b"\n"


async def _within(deadline: float | None, work: Awaitable[T]) -> T:
    """Await ``work`` until the loop time ``deadline`` (None: no limit)."""
    if deadline is None:
        return await work
    remaining = deadline - asyncio.get_running_loop().time()
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(max(0.0, remaining)):
            return await work
    return await asyncio.wait_for(work, max(0.0, remaining))


def request_info(path: str, body: bytes, routing_chat: bool) -> RequestInfo:
    """What routing needs: the conversation keys of an OpenAI chat body (cache_affinity only)."""
    info = RequestInfo(path=path, size=len(body), est_tokens=len(body) // BYTES_PER_TOKEN)
    if routing_chat and path == CHAT_PATH:
        try:
            info.own_key, info.history_key = conversation_keys(json.loads(body))
        except (ValueError, RecursionError):
            pass  # not JSON (or nested too deeply): no conversation key; routed like any request, the server's 4xx
    return info


class LengthStats:
    """Average request lengths for ``/v1/coordinator_info``, in estimated tokens.

    Input: the request body's bytes / 4. Output: a complete answer's bytes / 4, or a stream's
    chunk count (servers send about one token per chunk).
    """

    def __init__(self) -> None:
        self.inputs = self.input_sum = self.outputs = self.output_sum = 0

    def add_input(self, tokens: int) -> None:
        self.inputs += 1
        self.input_sum += tokens

    def add_output(self, tokens: int) -> None:
        self.outputs += 1
        self.output_sum += tokens

    def mean_input(self) -> int:
        return self.input_sum // self.inputs if self.inputs else 0

    def mean_output(self) -> int:
        return self.output_sum // self.outputs if self.outputs else 0


class Forwarder:
    """Sends user requests to instances and their answers back."""

    def __init__(self, config: CoordinatorConfig, scheduler: Scheduler, ssl: ssl_module.SSLContext | bool = True,
                 scheme: str = "http") -> None:
        self.config = config
        self.scheduler = scheduler
        self.ssl = ssl
        self._session: aiohttp.ClientSession | None = None
        self.scheme = scheme
        self.routing_chat = config.algorithm_type == "cache_affinity"
        self.retries = 0
        self.failed_streams = 0
        self.sizes = LengthStats()

    @property
    def client(self) -> aiohttp.ClientSession:
        """The pooled client to the instances, made on first use inside the running loop."""
        if self._session is None:
            timeout = self.config.http_timeout_seconds
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ssl=self.ssl),
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout, sock_read=None),
                headers={"user-agent": self.config.user_agent}, auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "Content-Type"),  # forward the user's headers, add none
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.body_limit_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise Refused(f"request body of {declared} bytes exceeds body_limit ({self.config.body_limit_mb} MB)",
                          413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused(f"request body exceeds body_limit ({self.config.body_limit_mb} MB)", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    def _headers(self, request: Request) -> list[tuple[str, str]]:
        out = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        if request.client is not None:
            out.append(("x-forwarded-for", request.client.host))
        return out

    async def handle(self, request: Request) -> Response:
        """Forward one user request; every refusal is a JSON error naming the reason."""
        path = request.url.path
        try:
            body = await self._read_body(request)
            self.scheduler.admit()
        except Refused as refused:
            return error_response(path, refused)
        try:
            response = await self._forward(request, path, body)
        except Refused as refused:
            self.scheduler.leave()
            return error_response(path, refused)
        except BaseException:
            self.scheduler.leave()
            raise
        if not isinstance(response, _RelayResponse):
            self.scheduler.leave()
        return response

    async def _forward(self, request: Request, path: str, body: bytes) -> Response:
        cfg = self.config
        info = request_info(path, body, self.routing_chat)
        self.sizes.add_input(info.est_tokens)
        loop = asyncio.get_running_loop()
        total = cfg.tokenizer_timeout if path == TOKENIZER_PATH else cfg.infer_timeout
        total_message = TOKENIZER_TIMEOUT if path == TOKENIZER_PATH else INFER_TIMEOUT
        deadline = loop.time() + total if total else None
        headers = self._headers(request)
        tried: set[int] = set()
        last_failure = ""
        for attempt in range(cfg.max_retry + 1):
            try:
                inst = await self.scheduler.acquire(info, frozenset(tried))
            except Refused as refused:
                if refused.message == NOT_READY and last_failure:
                    raise Refused(f"{NOT_READY}: {last_failure}", 503) from None
                raise
            try:
                return await self._attempt(inst, request, path, body, headers, info, deadline, total_message)
            except _Retry as retry:
                tried.add(inst.id)
                last_failure = str(retry)
                self.retries += 1
                log.warning("Apply connection to node failed: instance %d (%s): %s; attempt %d of %d",
                            inst.id, inst.base_url, retry, attempt + 1, cfg.max_retry + 1)
        raise Refused(f"Apply connection to node failed after {cfg.max_retry + 1} attempts: {last_failure}", 503)

    async def _attempt(self, inst: Instance, request: Request, path: str, body: bytes,
                       headers: list[tuple[str, str]], info: RequestInfo, deadline: float | None,
                       total_message: str) -> Response:
        """One try on ``inst``; raises :class:`_Retry` when nothing reached the user and another may serve it."""
        url = f"{self.scheme}://{inst.ip}:{inst.port}{request.url.path}"
        if request.url.query:
            url += "?" + request.url.query
        upstream: aiohttp.ClientResponse | None = None
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.scheduler.release(inst, info)

        try:
            try:
                upstream = await _within(deadline, self.client.request(request.method, url, data=body,
                                                                       headers=headers))
            except aiohttp.ClientError as exc:
                inst.mark_failed(f"{type(exc).__name__}: {exc}")
                raise _Retry(f"{type(exc).__name__}: {exc or 'connection failed'}") from None
            except (asyncio.TimeoutError, TimeoutError):
                raise Refused(total_message, 504) from None
            if upstream.status == 503:
                upstream.release()
                raise _Retry("the instance answered 503 (not ready or overloaded)")
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
            out_headers["server"] = self.config.server_name
            if "content-length" in upstream.headers:  # a complete answer: pass it on whole
                try:
                    content = await _within(deadline, upstream.read())
                except aiohttp.ClientError as exc:
                    inst.mark_failed(f"{type(exc).__name__}: {exc}")
                    raise _Retry(f"{type(exc).__name__} while reading the answer") from None
                except (asyncio.TimeoutError, TimeoutError):
                    raise Refused(total_message, 504) from None
                finally:
                    upstream.release()
                    release()
                self.sizes.add_output(len(content) // BYTES_PER_TOKEN)
                return Response(content, status_code=upstream.status, headers=out_headers)
            chunks = upstream.content.iter_any().__aiter__()
            first_deadline = deadline
            if self.config.first_token_timeout:
                first = asyncio.get_running_loop().time() + self.config.first_token_timeout
                first_deadline = first if deadline is None else min(first, deadline)
            try:
                first_chunk = await _within(first_deadline, chunks.__anext__())
            except StopAsyncIteration:
                first_chunk = b""
            except aiohttp.ClientError as exc:
                inst.mark_failed(f"{type(exc).__name__}: {exc}")
                raise _Retry(f"{type(exc).__name__} before the first chunk") from None
            except (asyncio.TimeoutError, TimeoutError):
                hit_total = deadline is not None and first_deadline == deadline
                raise Refused(total_message if hit_total else FIRST_TOKEN_TIMEOUT, 504) from None
        except BaseException:
            if upstream is not None:
                upstream.close()
            release()
            raise
        content_type = upstream.headers.get("content-type", "")
        stream = upstream

        async def close() -> None:
            if stream.content.at_eof():
                stream.release()  # read to the end: the connection goes back to the pool
            else:
                stream.close()  # the user left mid-stream: drop the connection
            release()
            self.scheduler.leave()

        return _RelayResponse(self._relay(inst, chunks, first_chunk, deadline, path, content_type, total_message),
                              close, status_code=upstream.status, headers=out_headers)

    async def _relay(self, inst: Instance, chunks: AsyncIterator[bytes], first: bytes, deadline: float | None,
                     path: str, content_type: str, total_message: str) -> AsyncIterator[bytes]:
        """The stream's chunks as they come; an error event when the instance fails or time runs out."""
        count = 0
        try:
            if first:
                yield first
            while True:
                try:
                    chunk = await _within(deadline, chunks.__anext__())
                except StopAsyncIteration:
                    self.sizes.add_output(count)
                    return
                count += 1
                yield chunk
        except aiohttp.ClientError as exc:
            self.failed_streams += 1
            inst.mark_failed(f"{type(exc).__name__} mid-stream")
            log.warning("instance %d (%s) failed mid-stream: %s", inst.id, inst.base_url, type(exc).__name__)
            yield stream_error_event(path, content_type, f"the inference instance {inst.base_url} failed during "
                                     "the stream; the request was ended")
        except (asyncio.TimeoutError, TimeoutError):
            yield stream_error_event(path, content_type, total_message)


class _RelayResponse(StreamingResponse):
    """A streamed answer whose ``close`` runs however the response ends (done, failed, client gone)."""

    def __init__(self, content: AsyncIterator[bytes], close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self._close()
