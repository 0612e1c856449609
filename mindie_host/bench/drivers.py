"""Load drivers: one per protocol (client mode) plus the in-process engine driver.

A driver's ``send(item, record)`` fills the :class:`RequestRecord` with the arrival time of every
generated-text event (``time.perf_counter()`` minus the run's origin), the text and the token counts.
"""

from __future__ import annotations

import abc
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from ..client import AsyncMindIEHTTPClient, MindIEClientException
from ..client import protocol as cp
from .datasets import BenchItem
from .metrics import RequestRecord

TEST_TYPES = ("engine", "client", "triton_client", "tgi_client", "vllm_client", "openai", "native_client")
TASK_KINDS = ("stream", "text", "stream_token")


@dataclass
class DriverOptions:
    """Everything a driver needs besides the item."""

    model_name: str
    url: str = "http://127.0.0.1:1025"
    task_kind: str = "stream"
    do_sampling: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1
    verify: Any = True
    ssl_options: dict[str, Any] | None = None
    chat_template: bool = False
    encode: Callable[[str], list[int]] | None = None
    decode: Callable[[list[int]], str] | None = None
    model_version: str = ""


class Driver(abc.ABC):
    """Base class: owns the clock origin and tokenizer-side bookkeeping."""

    name = "base"

    def __init__(self, opts: DriverOptions) -> None:
        self.opts = opts
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections / load the engine."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    @abc.abstractmethod
    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        """Send one request and fill ``record`` with its timings and output."""

    # -- helpers ------------------------------------------------------------------------------
    def sampling_body(self, item: BenchItem, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` plus greedy (unless sampling), ``ignore_eos`` and the user's sampling options
        (the OpenAI and vLLM request bodies share these)."""
        if not self.opts.do_sampling:
            body["temperature"] = 0.0
        if item.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.opts.sampling)
        return body

    def count_input(self, item: BenchItem, record: RequestRecord) -> None:
        """Input token count from the local tokenizer (timed as Tokenizer)."""
        if item.token_ids is not None:
            record.input_tokens = len(item.token_ids)
            record.input_token_ids = list(item.token_ids)
            if self.opts.decode is not None and not item.prompt:
                t = time.perf_counter()
                item.prompt = self.opts.decode(item.token_ids)
                record.detokenizer_ms = (time.perf_counter() - t) * 1000
            return
        if self.opts.encode is not None:
            t = time.perf_counter()
            ids = self.opts.encode(item.prompt)
            record.tokenizer_ms = (time.perf_counter() - t) * 1000
            record.input_tokens = len(ids)
            record.input_token_ids = ids

    def count_output(self, record: RequestRecord, server_count: int | None) -> None:
        """Output tokens: the server's count when it gives one, else the local tokenizer's."""
        if server_count is not None:
            record.output_tokens = int(server_count)
        elif self.opts.encode is not None and record.output_text:
            t = time.perf_counter()
            record.output_tokens = len(self.opts.encode(record.output_text))
            record.detokenizer_ms = (time.perf_counter() - t) * 1000
        else:
            record.output_tokens = len(record.token_times)

    def greedy_params(self) -> dict[str, Any]:
        """MindIE-style sampling params: ``do_sample`` plus ``--SamplingParams`` (no added defaults)."""
        params = dict(self.opts.sampling)
        params.setdefault("do_sample", self.opts.do_sampling)
        return params


class _HTTPDriver(Driver):
    """A driver with one pooled httpx.AsyncClient."""

    def __init__(self, opts: DriverOptions) -> None:
        super().__init__(opts)
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.opts.concurrency + 4,
                              max_keepalive_connections=self.opts.concurrency + 4)
        self.http = httpx.AsyncClient(base_url=self.opts.url, timeout=httpx.Timeout(3600.0, connect=60.0),
                                      limits=limits, verify=self.opts.verify)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        assert self.http is not None
        response = await self.http.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(cp.error_text(response.status_code, response.content))
        return response.json()

    async def _stream_lines(self, path: str, body: dict[str, Any], delimiter: str | None = None
                            ) -> AsyncIterator[str]:
        assert self.http is not None
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(cp.error_text(response.status_code, response.content))
            if delimiter is None:
                async for line in response.aiter_lines():
                    yield line
                return
            buf = ""
            async for chunk in response.aiter_text():
                buf += chunk
                while delimiter in buf:
                    part, buf = buf.split(delimiter, 1)
                    yield part
            if buf.strip():
                yield buf


class OpenAIDriver(_HTTPDriver):
    """``/v1/chat/completions`` exactly as loadgen.py drives it (plus usage for token counts)."""

    name = "openai"

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        self.count_input(item, record)
        body = self.sampling_body(item, {"model": self.opts.model_name,
                                         "messages": [{"role": "user", "content": item.payload}],
                                         "max_tokens": item.max_tokens})
        if self.opts.task_kind == "text":
            record.start = self.now()
            data = await self._post_json("/v1/chat/completions", body)
            record.end = self.now()
            record.output_text = cp.chat_response_text(data)
            record.finish_reason = data["choices"][0].get("finish_reason")
            usage = data.get("usage") or {}
            record.input_tokens = usage.get("prompt_tokens", record.input_tokens)
            self.count_output(record, usage.get("completion_tokens"))
            return
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        usage: dict[str, Any] = {}
        parts: list[str] = []
        record.start = self.now()
        async for line in self._stream_lines("/v1/chat/completions", body):
            event = cp.parse_sse_line(line)
            if event is None:
                continue
            text = cp.chat_event_text(event)
            if text:
                record.token_times.append(self.now())
                parts.append(text)
            for choice in event.get("choices") or []:
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            if event.get("usage"):
                usage = event["usage"]
        record.end = self.now()
        record.output_text = "".join(parts)
        record.input_tokens = usage.get("prompt_tokens", record.input_tokens)
        self.count_output(record, usage.get("completion_tokens"))


class TGIDriver(_HTTPDriver):
    """TGI ``/generate_stream`` (stream) or ``/generate`` (text)."""

    name = "tgi_client"

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        self.count_input(item, record)
        params = self.greedy_params()
        params.update({"max_new_tokens": item.max_tokens, "details": True})
        body = {"inputs": item.payload, "parameters": params}
        if self.opts.task_kind == "text":
            record.start = self.now()
            data = await self._post_json("/generate", body)
            record.end = self.now()
            data = data[0] if isinstance(data, list) else data
            record.output_text = data.get("generated_text") or ""
            details = data.get("details") or {}
            record.finish_reason = details.get("finish_reason")
            self.count_output(record, details.get("generated_tokens"))
            return
        parts: list[str] = []
        details: dict[str, Any] = {}
        record.start = self.now()
        async for line in self._stream_lines("/generate_stream", body):
            event = cp.parse_sse_line(line)
            if event is None:
                continue
            record.token_times.append(self.now())
            token = event.get("token") or {}
            if token.get("id") is not None:
                record.output_token_ids.append(int(token["id"]))
            if not token.get("special"):
                parts.append(token.get("text") or "")
            if event.get("details"):
                details = event["details"]
            if event.get("generated_text") is not None:
                record.output_text = event["generated_text"]
        record.end = self.now()
        record.output_text = record.output_text or "".join(parts)
        record.finish_reason = details.get("finish_reason")
        if details.get("prompt_tokens"):
            record.input_tokens = int(details["prompt_tokens"])
        self.count_output(record, details.get("generated_tokens") or len(record.token_times))


class VLLMDriver(_HTTPDriver):
    """vLLM 0.2.6 ``/generate``: NUL-delimited ``{"text":[...]}`` objects when streaming."""

    name = "vllm_client"

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        self.count_input(item, record)
        body = self.sampling_body(item, {"prompt": item.payload, "max_tokens": item.max_tokens,
                                         "stream": self.opts.task_kind != "text"})
        if self.opts.task_kind == "text":
            record.start = self.now()
            data = await self._post_json("/generate", body)
            record.end = self.now()
            text = (data.get("text") or [""])[0]
            record.output_text = text[len(item.prompt):] if text.startswith(item.prompt) else text
            self.count_output(record, None)
            return
        parts: list[str] = []
        record.start = self.now()
        async for chunk in self._stream_lines("/generate", body, delimiter="\0"):
            chunk = chunk.strip()
            if not chunk:
                continue
            obj = json.loads(chunk)
            if "error" in obj and "text" not in obj:
                raise RuntimeError(str(obj["error"]))
            text = (obj.get("text") or [""])[0]
            record.token_times.append(self.now())
            parts.append(text)
        record.end = self.now()
        record.output_text = "".join(parts)
        self.count_output(record, len(record.token_times))


class TritonDriver(_HTTPDriver):
    """Triton generate extension, raw (``triton_client``): ``/v2/models/{m}/generate[_stream]``."""

    name = "triton_client"

    def _path(self, tail: str) -> str:
        return cp.model_path(self.opts.model_name, self.opts.model_version, tail)

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        self.count_input(item, record)
        params = self.greedy_params()
        params.update({"max_new_tokens": item.max_tokens, "details": True})
        body = {"text_input": item.payload, "parameters": params}
        if self.opts.task_kind == "text":
            record.start = self.now()
            data = await self._post_json(self._path("generate"), body)
            record.end = self.now()
            record.output_text = data.get("text_output") or ""
            details = data.get("details") or {}
            record.finish_reason = details.get("finish_reason")
            self.count_output(record, details.get("generated_tokens"))
            return
        parts: list[str] = []
        generated: int | None = None
        record.start = self.now()
        async for line in self._stream_lines(self._path("generate_stream"), body):
            event = cp.parse_sse_line(line)
            if event is None:
                continue
            record.token_times.append(self.now())
            detail = cp.triton_event_detail(event)
            parts.append(detail.get("text_output") or "")
            _triton_details(record, detail)
            generated = detail.get("generated_tokens") or generated
        record.end = self.now()
        record.output_text = "".join(parts)
        self.count_output(record, generated or len(record.token_times))


def _triton_details(record: RequestRecord, detail: dict[str, Any]) -> None:
    """Batch sizes and queue wait from a Triton stream event's details."""
    if detail.get("batch_size") is not None:
        target = record.prefill_batch_sizes if not record.prefill_batch_sizes and len(record.token_times) <= 1 \
            else record.decode_batch_sizes
        target.append(int(detail["batch_size"]))
    if detail.get("queue_wait_time") is not None:
        record.queue_wait_us.append(float(detail["queue_wait_time"]))
    if detail.get("finish_reason"):
        record.finish_reason = detail["finish_reason"]


class ClientDriver(Driver):
    """MindIE ``client`` mode: this package's :class:`AsyncMindIEHTTPClient` (Triton text APIs and
    ``stream_token`` over native ``/infer_token``)."""

    name = "client"

    def __init__(self, opts: DriverOptions) -> None:
        super().__init__(opts)
        self.client: AsyncMindIEHTTPClient | None = None

    async def start(self) -> None:
        self.client = AsyncMindIEHTTPClient(self.opts.url, concurrency=min(max(self.opts.concurrency, 1), 1000),
                                            ssl_options=self.opts.ssl_options, network_timeout=3600.0,
                                            connection_timeout=60.0)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        assert self.client is not None
        self.count_input(item, record)
        params = self.greedy_params()
        params["max_new_tokens"] = item.max_tokens
        name, version = self.opts.model_name, self.opts.model_version
        try:
            if self.opts.task_kind == "text":
                params["details"] = True
                record.start = self.now()
                result = await self.client.generate(name, item.prompt, version, parameters=params)
                record.end = self.now()
                data = result.get_response()
                record.output_text = data.get("text_output") or ""
                details = data.get("details") or {}
                record.finish_reason = details.get("finish_reason")
                self.count_output(record, details.get("generated_tokens"))
                return
            if self.opts.task_kind == "stream_token":
                if item.token_ids is None:
                    raise RuntimeError("--TaskKind stream_token needs token-id input (--Tokenizer False)")
                parts = []
                record.start = self.now()
                async for text in self.client.generate_stream_self(np.asarray(item.token_ids, dtype=np.int64),
                                                                   parameters=params):
                    record.token_times.append(self.now())
                    parts.append(text)
                record.end = self.now()
                record.output_text = "".join(parts)
                self.count_output(record, len(record.token_times))
                return
            params["details"] = True
            parts = []
            generated = None
            record.start = self.now()
            async for detail in self.client.generate_stream_with_details(name, item.prompt, version,
                                                                         parameters=params):
                record.token_times.append(self.now())
                parts.append(detail.get("text_output") or "")
                _triton_details(record, detail)
                generated = detail.get("generated_tokens") or generated
            record.end = self.now()
            record.output_text = "".join(parts)
            self.count_output(record, generated or len(record.token_times))
        except MindIEClientException as exc:
            raise RuntimeError(exc.get_message()) from exc


class NativeDriver(_HTTPDriver):
    """MindIE native ``/infer`` (text) or ``/infer_token`` (token ids), stream or not."""

    name = "native_client"

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        self.count_input(item, record)
        params = self.greedy_params()
        params.update({"max_new_tokens": item.max_tokens, "details": True})
        stream = self.opts.task_kind != "text"
        if item.token_ids is not None and not item.prompt:
            path, body = "/infer_token", {"input_id": item.token_ids, "stream": stream, "parameters": params}
        else:
            path, body = "/infer", {"inputs": item.payload, "stream": stream, "parameters": params}
        if not stream:
            record.start = self.now()
            data = await self._post_json(path, body)
            record.end = self.now()
            record.output_text = data.get("generated_text") or ""
            details = data.get("details") or {}
            record.finish_reason = details.get("finish_reason")
            self.count_output(record, details.get("generated_tokens"))
            return
        decoder = cp.TokenStreamText()
        details: dict[str, Any] = {}
        record.start = self.now()
        async for line in self._stream_lines(path, body):
            event = cp.parse_sse_line(line)
            if event is None:
                continue
            record.token_times.append(self.now())
            decoder.feed(event)
            token = event.get("token") or {}
            if token.get("id") is not None:
                record.output_token_ids.append(int(token["id"]))
            if event.get("details"):
                details = event["details"]
        record.end = self.now()
        record.output_text = decoder.seen
        record.finish_reason = details.get("finish_reason")
        self.count_output(record, details.get("generated_tokens") or len(record.token_times))


class EngineDriver(Driver):
    """Engine mode: a :class:`~mindie_host.host.Host` in this process, ``host.generate`` directly (no HTTP)."""

    name = "engine"

    def __init__(self, opts: DriverOptions, host: Any) -> None:
        super().__init__(opts)
        self.host = host

    async def send(self, item: BenchItem, record: RequestRecord) -> None:
        from ..api import SamplingParams

        sampling = SamplingParams(max_tokens=item.max_tokens, ignore_eos=item.ignore_eos)
        sp = dict(self.opts.sampling)
        if self.opts.do_sampling:
            sampling.do_sample = True
            sampling.temperature = float(sp.pop("temperature", 1.0))
        else:
            sampling.temperature = 0.0
            sp.pop("temperature", None)
        for key, value in sp.items():
            if key == "max_new_tokens":
                sampling.max_tokens = int(value)
            elif hasattr(sampling, key):
                setattr(sampling, key, value)
        record.start = self.now()
        t = time.perf_counter()
        if item.token_ids is not None and not item.prompt:
            req = self.host.new_request(protocol="bench", body={}, sampling=sampling,
                                        prompt_token_ids=list(item.token_ids))
        elif self.opts.chat_template:  # as the OpenAI chat route renders and tokenizes one user turn
            text = self.host.apply_chat_template([{"role": "user", "content": item.prompt}])
            req = self.host.new_request(protocol="bench", body={}, sampling=sampling, prompt=text,
                                        prompt_token_ids=self.host.tokenize(text, add_special_tokens=False))
        else:
            req = self.host.new_request(protocol="bench", body={}, sampling=sampling, prompt=item.prompt)
        record.tokenizer_ms = (time.perf_counter() - t) * 1000
        record.input_tokens = len(req.prompt_token_ids)
        record.input_token_ids = list(req.prompt_token_ids)
        last = None
        async for out in self.host.generate(req):
            if out.new_token_ids:
                record.token_times.append(self.now())
                record.output_token_ids.extend(out.new_token_ids)
            last = out
        record.end = self.now()
        if last is not None:
            record.output_text = last.text
            record.finish_reason = last.finish_reason
            if last.error:
                raise RuntimeError(last.error)
            if last.first_scheduled_time is not None and last.arrival_time:
                record.queue_wait_us.append(max(0.0, (last.first_scheduled_time - last.arrival_time) * 1e6))
        record.output_tokens = len(record.output_token_ids)


def make_driver(test_type: str, opts: DriverOptions, host: Any = None) -> Driver:
    """The driver for ``--TestType``."""
    classes: dict[str, type[Driver]] = {"openai": OpenAIDriver, "tgi_client": TGIDriver, "vllm_client": VLLMDriver,
                                        "triton_client": TritonDriver, "client": ClientDriver,
                                        "native_client": NativeDriver}
    if test_type == "engine":
        return EngineDriver(opts, host)
    if test_type not in classes:
        raise ValueError(f"--TestType must be one of {', '.join(TEST_TYPES)}, got {test_type!r}")
    return classes[test_type](opts)
