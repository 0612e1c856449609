"""``MindIEHTTPClient``: the synchronous MindIE Client on httpx (pooled connections, TLS/mTLS, retries)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np

from . import protocol as p
from .types import AsyncRequest, MindIEClientException, Result, check_model_name, check_request_id

log = logging.getLogger("mindie_host.client")


def _positive(value: Any, name: str, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (hi is not None and value > hi):
        rng = f"(0, {hi:g}]" if hi is not None else "> 0"
        raise MindIEClientException(f"{name} must be a number in {rng}, got {value!r}")


class _ClientBase:
    """Argument checking and settings common to the sync and asyncio clients."""

    def __init__(self, url: str, greenlet_size: int | None = None, enable_ssl: bool = True,
                 ssl_options: dict[str, Any] | None = None, network_timeout: float = 600.0,
                 connection_timeout: float = 600.0, concurrency: int = 1, verbose: bool = False,
                 enable_management: bool = False, management_url: str | None = None,
                 retries: int = 2) -> None:
        url = p.check_url(url)
        management_url = p.check_url(management_url or p.default_management_url(url), "management_url")
        if url.split(":", 1)[0] != management_url.split(":", 1)[0]:
            raise MindIEClientException("management_url must use the same scheme as url")
        if greenlet_size is not None:
            if isinstance(greenlet_size, bool) or not isinstance(greenlet_size, int) or not 0 < greenlet_size <= 1e9:
                raise MindIEClientException(f"greenlet_size must be an int in (0, 1e9], got {greenlet_size!r}")
        _positive(network_timeout, "network_timeout")
        _positive(connection_timeout, "connection_timeout")
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 0 < concurrency <= 1000:
            raise MindIEClientException(f"concurrency must be an int in (0, 1000], got {concurrency!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise MindIEClientException("retries must be an int >= 0")
        self.valid_url = httpx.URL(url)
        self.manage_url = management_url
        self.verbose = bool(verbose)
        self.enable_management = bool(enable_management)
        self.concurrency = concurrency
        self.greenlet_size = greenlet_size or concurrency
        self._endpoint = p.Endpoint(url, management_url)
        self._verify = p.build_ssl_context(url, enable_ssl, ssl_options)
        self._manage_verify = p.build_ssl_context(management_url, enable_ssl, ssl_options)
        self._timeout = httpx.Timeout(network_timeout, connect=connection_timeout)
        self._limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._retries = retries

    def _log(self, method: str, url: str, body: Any = None) -> None:
        if self.verbose:
            print(f"{method} {url}" + (f" {json.dumps(body)[:1000]}" if body is not None else ""))


class MindIEHTTPClient(_ClientBase):
    """The MindIE Client API over HTTP(S).

    ``url`` is the business plane; health, readiness and slot queries go to ``management_url`` (the
    spec's default ``127.0.0.2:1026``, with ``url``'s scheme), whatever ``enable_management`` says. Connections are pooled (``concurrency`` of them);
    connection failures are retried ``retries`` times; ``connection_timeout`` bounds connecting and
    ``network_timeout`` every read/write. Every method raises :class:`MindIEClientException` on bad
    arguments, a transport failure or an HTTP status other than 200.
    """

    def __init__(self, url: str, greenlet_size: int | None = None, enable_ssl: bool = True,
                 ssl_options: dict[str, Any] | None = None, network_timeout: float = 600.0,
                 connection_timeout: float = 600.0, concurrency: int = 1, verbose: bool = False,
                 enable_management: bool = False, management_url: str | None = None,
                 retries: int = 2) -> None:
        self._client: httpx.Client | None = None
        self._manage_client: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None
        super().__init__(url, greenlet_size, enable_ssl, ssl_options, network_timeout, connection_timeout,
                         concurrency, verbose, enable_management, management_url, retries)
        self._client = self._make_client(self._verify)
        self._manage_client = self._make_client(self._manage_verify)

    def _make_client(self, verify: Any) -> httpx.Client:
        transport = httpx.HTTPTransport(verify=verify, retries=self._retries, limits=self._limits)
        return httpx.Client(transport=transport, timeout=self._timeout)

    # -- plumbing ----------------------------------------------------------------------------------
    def _request(self, method: str, url: str, body: Any = None, management: bool = False) -> httpx.Response:
        if self._client is None:
            raise MindIEClientException("client is closed")
        client = self._manage_client if management else self._client
        assert client is not None
        self._log(method, url, body)
        try:
            return client.request(method, url, json=body) if body is not None else client.request(method, url)
        except httpx.TimeoutException as exc:
            raise MindIEClientException(f"{method} {url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise MindIEClientException(f"{method} {url} failed: {exc!r}") from exc

    def _json(self, method: str, url: str, body: Any = None, management: bool = False) -> Any:
        response = self._request(method, url, body, management)
        if response.status_code != 200:
            raise MindIEClientException(p.error_text(response.status_code, response.content), response.status_code)
        try:
            return response.json() if response.content else {}
        except json.JSONDecodeError as exc:
            raise MindIEClientException(f"{url} returned non-JSON: {response.text[:500]!r}") from exc

    def _probe(self, path: str) -> bool:
        url = self._endpoint.health_base() + path
        try:
            response = self._request("GET", url, management=True)
        except MindIEClientException:
            return False
        return response.status_code == 200

    @contextmanager
    def _stream_lines(self, url: str, body: dict[str, Any]) -> Iterator[Iterator[str]]:
        if self._client is None:
            raise MindIEClientException("client is closed")
        self._log("POST", url, body)
        try:
            with self._client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise MindIEClientException(p.error_text(response.status_code, response.content),
                                                response.status_code)
                yield response.iter_lines()
        except httpx.TimeoutException as exc:
            raise MindIEClientException(f"POST {url} timed out: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise MindIEClientException(f"POST {url} failed: {exc!r}") from exc

    def _events(self, url: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._stream_lines(url, body) as lines:
            yield from p.iter_events(lines)

    # -- health and metadata ----------------------------------------------------------------------
    def is_server_live(self) -> bool:
        """``GET /v2/health/live``: True when the server answers 200."""
        return self._probe("/v2/health/live")

    def is_server_ready(self) -> bool:
        """``GET /v2/health/ready``: True when the server is ready to serve."""
        return self._probe("/v2/health/ready")

    def is_model_ready(self, model_name: str, model_version: str = "") -> bool:
        """``GET /v2/models/{m}/ready``: True when the model can serve."""
        return self._probe(p.model_path(model_name, model_version, "ready"))

    def get_server_metadata(self) -> dict[str, Any]:
        """``GET /v2`` (business plane): ``{"name","version","extensions"}``."""
        return self._json("GET", f"{self._endpoint.base}/v2")

    def get_model_metadata(self, model_name: str, model_version: str = "") -> dict[str, Any]:
        """``GET /v2/models/{m}``: name, platform, inputs, outputs."""
        return self._json("GET", self._endpoint.base + p.model_path(model_name, model_version, ""))

    def get_model_config(self, model_name: str, model_version: str = "") -> dict[str, Any]:
        """``GET /v2/models/{m}/config``: max_seq_len, world_size, ..."""
        return self._json("GET", self._endpoint.base + p.model_path(model_name, model_version, "config"))

    # -- token inference --------------------------------------------------------------------------
    def infer(self, model_name: str, inputs: list[Any], model_version: str = "", outputs: list[Any] | None = None,
              request_id: str = "", parameters: dict[str, Any] | None = None) -> Result:
        """``POST /v2/models/{m}/infer`` with one UINT32 ``Input``; returns a :class:`Result`."""
        url = self._endpoint.base + p.model_path(model_name, model_version, "infer")
        body = p.infer_body(inputs, outputs, request_id, parameters)
        return Result(self._json("POST", url, body), self.verbose)

    def async_infer(self, model_name: str, inputs: list[Any], model_version: str = "",
                    outputs: list[Any] | None = None, request_id: str = "",
                    parameters: dict[str, Any] | None = None) -> AsyncRequest:
        """Like :meth:`infer` but returns at once; ``AsyncRequest.get_result()`` waits for the Result.

        Arguments are checked before this returns (bad ones raise here, not in ``get_result``).
        """
        url = self._endpoint.base + p.model_path(model_name, model_version, "infer")
        body = p.infer_body(inputs, outputs, request_id, parameters)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(self.greenlet_size, 1000),
                                            thread_name_prefix="mindie-client")
        future = self._pool.submit(lambda: Result(self._json("POST", url, body), self.verbose))
        return AsyncRequest(future, self.verbose)

    # -- text generation --------------------------------------------------------------------------
    def generate(self, model_name: str, prompt: str, model_version: str = "", request_id: str = "",
                 parameters: dict[str, Any] | None = None) -> Result:
        """``POST /v2/models/{m}/generate``: the whole text; the Result holds ``text_output`` (and details)."""
        url = self._endpoint.base + p.model_path(model_name, model_version, "generate")
        return Result(self._json("POST", url, p.generate_body(prompt, request_id, parameters)), self.verbose)

    def generate_stream(self, model_name: str, prompt: str, model_version: str = "", request_id: str = "",
                        parameters: dict[str, Any] | None = None) -> Iterator[str]:
        """``POST /v2/models/{m}/generate_stream``: yields the new text of each step."""
        for detail in self.generate_stream_with_details(model_name, prompt, model_version, request_id, parameters):
            yield detail["text_output"]

    def generate_stream_with_details(self, model_name: str, prompt: str, model_version: str = "",
                                     request_id: str = "", parameters: dict[str, Any] | None = None
                                     ) -> Iterator[dict[str, Any]]:
        """Like :meth:`generate_stream` but yields dicts.

        Always ``{"text_output"}``; with ``details=True`` also ``batch_size``, ``queue_wait_time`` (μs),
        ``generated_tokens``, ``prefill_time``/``decode_time`` (ms) and, on the last, ``finish_reason``.
        """
        url = self._endpoint.base + p.model_path(model_name, model_version, "generate_stream")
        body = p.generate_body(prompt, request_id, parameters)
        for event in self._events(url, body):
            yield p.triton_event_detail(event)

    def generate_stream_self(self, token: np.ndarray, request_id: str = "",
                             parameters: dict[str, Any] | None = None) -> Iterator[str]:
        """Token-id streaming: ``POST /infer_token`` (MindIE native, stream); yields each step's text.

        ``request_id`` is checked but not sent: the native body has no id field.
        """
        check_request_id(request_id)
        body = p.token_stream_body(token, parameters)
        decoder = p.TokenStreamText()
        for event in self._events(f"{self._endpoint.base}/infer_token", body):
            text = decoder.feed(event)
            if text is not None:
                yield text

    def generate_chat(self, model_name: str, prompt: str | list[dict[str, Any]], request_id: str = "",
                      parameters: dict[str, Any] | None = None) -> str:
        """OpenAI ``POST /v1/chat/completions`` (non-stream); returns the generated text."""
        check_request_id(request_id)
        data = self._json("POST", f"{self._endpoint.base}/v1/chat/completions",
                          p.chat_body(model_name, prompt, parameters, stream=False))
        return p.chat_response_text(data)

    def generate_chat_stream(self, model_name: str, prompt: str | list[dict[str, Any]], request_id: str = "",
                             parameters: dict[str, Any] | None = None) -> Iterator[str]:
        """OpenAI ``POST /v1/chat/completions`` with ``stream: true``; yields each content delta."""
        check_request_id(request_id)
        body = p.chat_body(model_name, prompt, parameters, stream=True)
        for event in self._events(f"{self._endpoint.base}/v1/chat/completions", body):
            text = p.chat_event_text(event)
            if text is not None:
                yield text

    # -- control --------------------------------------------------------------------------------------
    def cancel(self, model_name: str, request_id: str, model_version: str = "") -> bool:
        """``POST /v2/models/{m}/stopInfer`` ``{"id": request_id}``: True when the server stopped it."""
        check_model_name(model_name)
        if not isinstance(request_id, str) or not request_id:
            raise MindIEClientException("request_id is required to cancel a request")
        check_request_id(request_id)
        url = self._endpoint.base + p.model_path(model_name, model_version, "stopInfer")
        response = self._request("POST", url, {"id": request_id})
        if response.status_code == 200:
            return True
        if response.status_code in (400, 404):
            return False
        raise MindIEClientException(p.error_text(response.status_code, response.content), response.status_code)

    def get_slot_count(self, model_name: str, model_version: str = "") -> Result:
        """``GET /v2/models/{m}/getSlotCount``: ``{"total_slots","free_slots","available_tokens_length"}``."""
        url = self._endpoint.health_base() + p.model_path(model_name, model_version, "getSlotCount")
        return Result(self._json("GET", url, management=True), self.verbose)

    def close(self) -> None:
        """Close the connection pools and the async_infer workers."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for client in {id(c): c for c in (self._client, self._manage_client) if c is not None}.values():
            client.close()
        self._client = self._manage_client = None

    def __enter__(self) -> MindIEHTTPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
