"""``AsyncMindIEHTTPClient``: the MindIE Client API for asyncio (same methods, awaitable)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np

from . import protocol as p
from .http import _ClientBase
from .types import MindIEClientException, Result, check_model_name, check_request_id


class AsyncioRequest:
    """A pending :meth:`AsyncMindIEHTTPClient.async_infer`; ``await get_result()`` returns its Result."""

    def __init__(self, task: asyncio.Task[Result], verbose: bool = False) -> None:
        self._task = task
        self.verbose = verbose

    async def get_result(self, timeout: float | None = None) -> Result:
        """Wait at most ``timeout`` seconds (> 0; None waits forever)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout <= 0):
            raise MindIEClientException(f"timeout must be a number > 0 or None, got {timeout!r}")
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError as exc:
            raise MindIEClientException(f"async request did not finish within {timeout} s") from exc


class AsyncMindIEHTTPClient(_ClientBase):
    """The asyncio twin of :class:`~mindie_host.client.MindIEHTTPClient`.

    Same constructor and methods; request methods are coroutines, streaming methods are async
    iterators, ``async_infer`` returns an :class:`AsyncioRequest`, and ``close`` is ``aclose``.
    Use ``async with AsyncMindIEHTTPClient(url) as client: ...``.
    """

    def __init__(self, url: str, greenlet_size: int | None = None, enable_ssl: bool = True,
                 ssl_options: dict[str, Any] | None = None, network_timeout: float = 600.0,
                 connection_timeout: float = 600.0, concurrency: int = 1, verbose: bool = False,
                 enable_management: bool = False, management_url: str | None = None,
                 retries: int = 2) -> None:
        super().__init__(url, greenlet_size, enable_ssl, ssl_options, network_timeout, connection_timeout,
                         concurrency, verbose, enable_management, management_url, retries)
        self._client: httpx.AsyncClient | None = self._make_client(self._verify)
        self._manage_client: httpx.AsyncClient | None = self._make_client(self._manage_verify)
        self._tasks: set[asyncio.Task[Result]] = set()

    def _make_client(self, verify: Any) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(verify=verify, retries=self._retries, limits=self._limits)
        return httpx.AsyncClient(transport=transport, timeout=self._timeout)

    async def _request(self, method: str, url: str, body: Any = None, management: bool = False) -> httpx.Response:
        client = self._manage_client if management else self._client
        if client is None:
            raise MindIEClientException("client is closed")
        self._log(method, url, body)
        try:
            if body is not None:
                return await client.request(method, url, json=body)
            return await client.request(method, url)
        except httpx.TimeoutException as exc:
            raise MindIEClientException(f"{method} {url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise MindIEClientException(f"{method} {url} failed: {exc!r}") from exc

    async def _json(self, method: str, url: str, body: Any = None, management: bool = False) -> Any:
        response = await self._request(method, url, body, management)
        if response.status_code != 200:
            raise MindIEClientException(p.error_text(response.status_code, response.content), response.status_code)
        try:
            return response.json() if response.content else {}
        except json.JSONDecodeError as exc:
            raise MindIEClientException(f"{url} returned non-JSON: {response.text[:500]!r}") from exc

    async def _probe(self, path: str) -> bool:
        try:
            response = await self._request("GET", self._endpoint.health_base() + path,
                                           management=True)
        except MindIEClientException:
            return False
        return response.status_code == 200

    async def _events(self, url: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        if self._client is None:
            raise MindIEClientException("client is closed")
        self._log("POST", url, body)
        try:
            async with self._client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise MindIEClientException(p.error_text(response.status_code, response.content),
                                                response.status_code)
                async for line in response.aiter_lines():
                    event = p.parse_sse_line(line)
                    if event is not None:
                        yield event
        except httpx.TimeoutException as exc:
            raise MindIEClientException(f"POST {url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise MindIEClientException(f"POST {url} failed: {exc!r}") from exc

    # -- health and metadata ----------------------------------------------------------------------
    async def is_server_live(self) -> bool:
        """``GET /v2/health/live``."""
        return await self._probe("/v2/health/live")

    async def is_server_ready(self) -> bool:
        """``GET /v2/health/ready``."""
        return await self._probe("/v2/health/ready")

    async def is_model_ready(self, model_name: str, model_version: str = "") -> bool:
        """``GET /v2/models/{m}/ready``."""
        return await self._probe(p.model_path(model_name, model_version, "ready"))

    async def get_server_metadata(self) -> dict[str, Any]:
        """``GET /v2``."""
        return await self._json("GET", f"{self._endpoint.base}/v2")

    async def get_model_metadata(self, model_name: str, model_version: str = "") -> dict[str, Any]:
        """``GET /v2/models/{m}``."""
        return await self._json("GET", self._endpoint.base + p.model_path(model_name, model_version, ""))

    async def get_model_config(self, model_name: str, model_version: str = "") -> dict[str, Any]:
        """``GET /v2/models/{m}/config``."""
        return await self._json("GET", self._endpoint.base + p.model_path(model_name, model_version, "config"))

    # -- inference ----------------------------------------------------------------------------------
    async def infer(self, model_name: str, inputs: list[Any], model_version: str = "",
                    outputs: list[Any] | None = None, request_id: str = "",
                    parameters: dict[str, Any] | None = None) -> Result:
        """``POST /v2/models/{m}/infer``."""
        url = self._endpoint.base + p.model_path(model_name, model_version, "infer")
        body = p.infer_body(inputs, outputs, request_id, parameters)
        return Result(await self._json("POST", url, body), self.verbose)

    def async_infer(self, model_name: str, inputs: list[Any], model_version: str = "",
                    outputs: list[Any] | None = None, request_id: str = "",
                    parameters: dict[str, Any] | None = None) -> AsyncioRequest:
        """Start :meth:`infer` as a task (call inside a running loop); arguments are checked here."""
        url = self._endpoint.base + p.model_path(model_name, model_version, "infer")
        body = p.infer_body(inputs, outputs, request_id, parameters)

        async def run() -> Result:
            return Result(await self._json("POST", url, body), self.verbose)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return AsyncioRequest(task, self.verbose)

    async def generate(self, model_name: str, prompt: str, model_version: str = "", request_id: str = "",
                       parameters: dict[str, Any] | None = None) -> Result:
        """``POST /v2/models/{m}/generate``."""
        url = self._endpoint.base + p.model_path(model_name, model_version, "generate")
        return Result(await self._json("POST", url, p.generate_body(prompt, request_id, parameters)), self.verbose)

    async def generate_stream(self, model_name: str, prompt: str, model_version: str = "", request_id: str = "",
                              parameters: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """``POST /v2/models/{m}/generate_stream``: each step's new text."""
        async for detail in self.generate_stream_with_details(model_name, prompt, model_version, request_id,
                                                              parameters):
            yield detail["text_output"]

    async def generate_stream_with_details(self, model_name: str, prompt: str, model_version: str = "",
                                           request_id: str = "", parameters: dict[str, Any] | None = None
                                           ) -> AsyncIterator[dict[str, Any]]:
        """Dicts per step (see the sync client)."""
        url = self._endpoint.base + p.model_path(model_name, model_version, "generate_stream")
        async for event in self._events(url, p.generate_body(prompt, request_id, parameters)):
            yield p.triton_event_detail(event)

    async def generate_stream_self(self, token: np.ndarray, request_id: str = "",
                                   parameters: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """``POST /infer_token`` streaming; each step's text."""
        check_request_id(request_id)
        decoder = p.TokenStreamText()
        async for event in self._events(f"{self._endpoint.base}/infer_token", p.token_stream_body(token, parameters)):
            text = decoder.feed(event)
            if text is not None:
                yield text

    async def generate_chat(self, model_name: str, prompt: str | list[dict[str, Any]], request_id: str = "",
                            parameters: dict[str, Any] | None = None) -> str:
        """OpenAI chat, non-stream; the generated text."""
        check_request_id(request_id)
        data = await self._json("POST", f"{self._endpoint.base}/v1/chat/completions",
                                p.chat_body(model_name, prompt, parameters, stream=False))
        return p.chat_response_text(data)

    async def generate_chat_stream(self, model_name: str, prompt: str | list[dict[str, Any]], request_id: str = "",
                                   parameters: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """OpenAI chat, stream; each content delta."""
        check_request_id(request_id)
        body = p.chat_body(model_name, prompt, parameters, stream=True)
        async for event in self._events(f"{self._endpoint.base}/v1/chat/completions", body):
            text = p.chat_event_text(event)
            if text is not None:
                yield text

    async def cancel(self, model_name: str, request_id: str, model_version: str = "") -> bool:
        """``POST /v2/models/{m}/stopInfer``."""
        check_model_name(model_name)
        if not isinstance(request_id, str) or not request_id:
            raise MindIEClientException("request_id is required to cancel a request")
        check_request_id(request_id)
        url = self._endpoint.base + p.model_path(model_name, model_version, "stopInfer")
        response = await self._request("POST", url, {"id": request_id})
        if response.status_code == 200:
            return True
        if response.status_code in (400, 404):
            return False
        raise MindIEClientException(p.error_text(response.status_code, response.content), response.status_code)

    async def get_slot_count(self, model_name: str, model_version: str = "") -> Result:
        """``GET /v2/models/{m}/getSlotCount``."""
        url = self._endpoint.health_base() + p.model_path(model_name, model_version, "getSlotCount")
        return Result(await self._json("GET", url, management=True), self.verbose)

    async def close(self) -> None:
        """Close the connection pools (pending async_infer tasks are cancelled)."""
        for task in list(self._tasks):
            task.cancel()
        for client in {id(c): c for c in (self._client, self._manage_client) if c is not None}.values():
            await client.aclose()
        self._client = self._manage_client = None

    aclose = close

    async def __aenter__(self) -> AsyncMindIEHTTPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
