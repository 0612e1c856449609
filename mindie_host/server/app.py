"""Building the FastAPI applications of each plane and running them with uvicorn.

Protocol modules add their routes through the ``mindie_host_add_routes`` hook.
This module only provides what they share: error rendering, JSON and SSE
responses, request bodies with a size cap, and disconnect-aware waiting.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..content import bind_host
from ..engine.request import RequestError
from ..logs import current_request_id
from .validation import parse_json_body

if TYPE_CHECKING:
    from ..host_protocol import Host

log = logging.getLogger("mindie_host.server")

ErrorRenderer = Callable[[RequestError], dict[str, Any]]
T = TypeVar("T")


def mindie_error_body(err: RequestError) -> dict[str, Any]:
    """MindIE's error body (spec §10.2): ``{"type": ..., "error": ...}`` plus the field name."""
    body: dict[str, Any] = {"type": err.error_type, "error": err.message}
    if err.field:
        body["field"] = err.field
    return body


def error_response(err: RequestError, render: ErrorRenderer = mindie_error_body) -> JSONResponse:
    """A JSON error response in a protocol's format."""
    return JSONResponse(render(err), status_code=err.status)


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Compact UTF-8 JSON."""
    return Response(
        json.dumps(data, ensure_ascii=False, separators=(",", ":")),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def read_json(request: Request, host: Host) -> dict[str, Any]:
    """The request body as a JSON object (the body cap is enforced before any route runs: admission.py)."""
    bind_host(host)  # media parts in the body are served by this host's plugins (mindie_host/content.py)
    return parse_json_body(await request.body())


def request_pool(host: Host) -> ThreadPoolExecutor:
    """The threads that tokenize prompts and decode tensors: ``tokenizerProcessNumber`` of them, made on first use."""
    pool = host.runtime.request_pool
    if pool is None:
        pool = host.runtime.request_pool = ThreadPoolExecutor(
            max_workers=host.config.backend.tokenizerProcessNumber, thread_name_prefix="mindie-tokenize"
        )
    return pool


async def offload(host: Host, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a request's tokenization (with its chat template, or a tensor's decoding) off the event loop, within
    ``TOKENIZER_ENCODE_TIMEOUT`` (60 s unless set): past it the request fails with the spec's 422, "Tokenizer
    encode wait sub process timeout.", and the worker thread is left to finish and its result dropped.

    Probes and other requests keep being answered while a big prompt is tokenized
    (the tokenizer releases the GIL). The request id context goes along for the logs.
    """
    timeout = host.config.environment.tokenizer_encode_timeout
    try:
        return await asyncio.wait_for(offload_untimed(host, fn, *args, **kwargs), timeout)
    except TimeoutError:
        log.warning("tokenization ran past TOKENIZER_ENCODE_TIMEOUT (%g s): the request fails", timeout)
        raise RequestError(f"Tokenizer encode wait sub process timeout. (TOKENIZER_ENCODE_TIMEOUT is {timeout:g} s)",
                           status=422) from None


async def offload_untimed(host: Host, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """:func:`offload` without the tokenization deadline: other CPU-heavy work (a grammar, a template's probe)."""
    ctx = contextvars.copy_context()
    call = functools.partial(ctx.run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(request_pool(host), call)


def sse_event(data: Any, *, event: str | None = None, space: bool = True) -> bytes:
    """One server-sent event; ``data`` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    sep = "data: " if space else "data:"
    return f"{head}{sep}{payload}\n\n".encode()


def streaming_response(chunks: AsyncIterator[bytes], media_type: str = "text/event-stream") -> StreamingResponse:
    """A streamed response; leaving early (client gone) closes ``chunks``, which aborts the request."""
    return StreamingResponse(chunks, media_type=media_type, headers={"Cache-Control": "no-cache"})


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` but cancel it if the client disconnects first (frees the request's blocks)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
            raise RequestError("client disconnected", status=499)


def create_app(host: Host, plane: str) -> FastAPI:
    """A FastAPI app for ``plane`` (``business`` or ``management``) with every plugin's routes."""
    app = FastAPI(title=f"mindie-host {plane}", docs_url=None, redoc_url=None)
    app.state.host = host

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return error_response(RequestError(f"{field}: {first.get('msg', 'invalid')}", field=field))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = RequestError(str(exc.detail), status=exc.status_code)
        return error_response(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # the details go to the log only: a response never carries internal exception text
        rid = current_request_id()
        log.exception("unhandled error on %s %s (request id %s)", request.method, request.url.path, rid)
        return error_response(RequestError(
            f"internal server error; the server log has the details under request id {rid}", status=500
        ))

    host.plugins.hook.mindie_host_add_routes(app=app, plane=plane)
    return app
