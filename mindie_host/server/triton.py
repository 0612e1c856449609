"""Triton / KServe v2 protocol (spec §4.2.5) with the binary tensor and generate extensions.

Business plane:

* ``GET /v2``: server metadata (MindIE's object-valued ``extensions``);
* ``GET /v2/models/{m}`` and ``GET /v2/models/{m}/config``: model metadata and config;
* ``POST /v2/models/{m}/infer``: token ids in (tensor ``input0``), generated ids out,
  as JSON or with the binary tensor data extension (``Inference-Header-Content-Length``,
  ``binary_data_size``, ``binary_data``, ``binary_data_output``, raw binary requests);
* ``POST /v2/models/{m}/generate`` and ``/generate_stream``: the generate extension
  (``text_input`` in, ``text_output`` out; SSE ``data:`` events without a space and
  without ``[DONE]``; errors as ``{"error": ...}``).

Management plane: ``GET /v2/models/{m}/ready`` (``/v2/health/live|ready`` live in
:mod:`mindie_host.server.management`). ``stopInfer`` belongs to :mod:`.native`.

Errors are ``{"error": message, "type": ..., "field": ...}``: Triton clients read
``error``. Body-framing problems of the binary extension are 400 (KServe's rule);
a field out of range is 422; an unknown model is 404.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__, hookimpl
from ..content import media_text
from ..context import HostContext
from ..engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams
from .app import error_response, json_response, offload, read_json, sse_event, streaming_response, until_disconnect
from .management import not_ready_reason
from .outcome import failure, raise_for_failure
from .params import build_sampling
from .textgen import tgi_finish_reason
from .triton_binary import TensorCodecError, decode_infer_request, encode_infer_response, wants_binary_output
from .validation import INT32_MAX, Fields, check_seed, check_text_size, parse_json_body

if TYPE_CHECKING:
    from ..host_protocol import Host

PROTOCOL = "triton"
HEADER_LENGTH = "Inference-Header-Content-Length"
INPUT_NAME = "input0"
TOKEN_DATATYPES = ("UINT32", "INT32", "INT64", "UINT64")
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,256}$")
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
MULTIMODAL_TYPES = ("image_url", "video_url", "audio_url")


def triton_error(err: RequestError) -> Response:
    """Triton's ``{"error": "..."}`` (plus MindIE's ``type`` and the field name)."""
    return error_response(err)


def check_model(host: Host, model: str) -> None:
    """404 unless ``model`` is served."""
    if model not in host.served_model_names:
        raise RequestError(f"Request for unknown model: '{model}' is not found; served: {host.served_model_names}",
                           status=404, field="model")


def request_id(host: Host, f: Fields) -> str:
    """``id``: optional, 1-256 characters of ``[A-Za-z0-9_-]``; generated when absent."""
    rid = f.raw("id")
    if rid is None:
        return host.new_request_id()
    if not isinstance(rid, str) or not ID_PATTERN.match(rid):
        raise RequestError(f"id must be 1-256 characters of [A-Za-z0-9_-], got {rid!r}", field="id")
    return rid


@dataclass
class TritonParams:
    """Parsed ``parameters`` of the infer and generate routes."""

    sampling: SamplingParams
    details: bool
    perf_stat: bool
    priority: int
    timeout: float


def parse_parameters(host: Host, raw: Any, *, text_route: bool) -> TritonParams:
    """The ``parameters`` object with the spec's ranges (§4.2.5.5 / §4.2.5.6)."""
    p = Fields(raw, "parameters.", nullable=True)
    values = {
        "temperature": p.float("temperature", lo=1e-6, lo_open=True),
        "top_k": p.int("top_k", lo=0, hi=INT32_MAX),
        "top_p": p.float("top_p", lo=1e-6, hi=1.0, lo_open=True),
        "repetition_penalty": p.float("repetition_penalty", lo=0.0, lo_open=True),
    }
    if text_route:
        values["typical_p"] = p.float("typical_p", lo=0.0, hi=1.0, lo_open=True)
    do_sample = p.bool("do_sample")
    seed = check_seed(p, "seed", zero_allowed=False)
    max_new = p.int("max_new_tokens", 20, lo=0, hi=INT32_MAX, lo_open=True)
    p.bool("watermark")
    details = bool(p.bool("details", False))
    perf_stat = bool(p.bool("perf_stat", False))
    p.int("batch_size", lo=0, hi=INT32_MAX, lo_open=True)
    priority = p.int("priority", 5, lo=1, hi=5) or 5
    timeout = p.int("timeout", 600, lo=0, hi=3600, lo_open=True) or 600
    if text_route:
        p.int("firstTokenCost", lo=0, hi=2**64 - 1)
        cost = p.raw("decodeTime")
        if cost is not None and (not isinstance(cost, list) or not all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**64 for c in cost)):
            raise RequestError("parameters.decodeTime must be a list of integers in [0, 2^64-1]",
                               field="parameters.decodeTime")
    sampling = build_sampling(host, values, do_sample, seed=seed, max_tokens=max_new)
    return TritonParams(sampling, details, perf_stat, priority, float(timeout))


def perf_stat(out: RequestOutput) -> list[list[int]]:
    """``[[token id, milliseconds to infer it], ...]``."""
    pairs = []
    prev = out.arrival_time
    for tid, t in zip(out.token_ids, out.token_times):
        pairs.append([tid, int(round((t - prev) * 1000))])
        prev = t
    return pairs


async def read_body(request: Request, host: Host) -> bytes:
    """The raw body (the body cap is enforced before any route runs: admission.py)."""
    return await request.body()


def header_length(request: Request) -> int | None:
    """``Inference-Header-Content-Length`` as an int, or ``None`` when absent."""
    value = request.headers.get(HEADER_LENGTH)
    if value is None:
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 19):  # at most an int64
        raise RequestError(f"{HEADER_LENGTH} must be a non-negative integer, got {value!r}", status=400,
                           field=HEADER_LENGTH)
    return int(value)


class TritonServer:
    """Handlers for one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    # -- metadata ---------------------------------------------------------------------------
    def server_metadata(self) -> dict[str, Any]:
        sc = self.host.config.schedule
        return {
            "name": "MindIE Server",
            "version": __version__,
            "extensions": {
                "max_iter_times": sc.maxIterTimes,
                "prefill_policy_type": sc.prefillPolicyType,
                "decode_policy_type": sc.decodePolicyType,
                "max_prefill_batch_size": sc.maxPrefillBatchSize or sc.maxBatchSize,
                "max_prefill_tokens": sc.maxPrefillTokens,
            },
        }

    def model_metadata(self, model: str) -> dict[str, Any]:
        check_model(self.host, model)
        return {
            "name": model,
            "platform": "MindIE Server",
            "inputs": [{"name": INPUT_NAME, "shape": [-1], "datatype": "UINT32"}],
            "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}],
        }

    def model_config(self, model: str) -> dict[str, Any]:
        check_model(self.host, model)
        mc = self.host.model_config
        path = mc.modelWeightPath or ""
        return {
            "model_name": model,
            "input_datatype": "UINT32",
            "output_datatype": "UINT32",
            "max_seq_len": self.host.config.deploy.maxSeqLen,
            "npu_mem_size": mc.npuMemSize,
            "cpu_mem_size": mc.cpuMemSize,
            "world_size": mc.worldSize,
            "model_weight_path": PurePath(path.rstrip("/")).name if path else "",
            "model_instance_type": mc.modelInstanceType,
        }

    # -- token inference ---------------------------------------------------------------------
    async def infer(self, request: Request, model: str) -> Response:
        host = self.host
        try:
            check_model(host, model)
            body = await read_body(request, host)
            hlen = header_length(request)
            try:
                if hlen is None:
                    parse_json_body(body)  # a plain JSON body: report bad JSON as such
                    header, tensors = await offload(host, decode_infer_request, body, None)
                else:
                    header, tensors = await offload(
                        host, decode_infer_request, body, hlen, raw_input_name=INPUT_NAME, raw_input_datatype="UINT32", raw_input_shape=[-1]
                    )
            except TensorCodecError as exc:
                raise RequestError(str(exc), status=400, field=exc.field) from None
            f = Fields(header)
            rid = request_id(host, f)
            ids = self._input_ids(header, tensors)
            out_name = self._output_name(header, hlen == 0)
            params = parse_parameters(host, header.get("parameters"), text_route=False)
            req = host.new_request(
                protocol=PROTOCOL, body=header, sampling=params.sampling, prompt_token_ids=ids,
                request_id=f"{rid}-{host.new_request_id('triton')}", priority=params.priority,
                timeout=params.timeout, field="inputs[0].data",
            )
            out = await until_disconnect(request, host.generate_full(req))
            raise_for_failure(out)
            as_binary = hlen == 0 or wants_binary_output(header, out_name)
            array = np.asarray([out.token_ids], dtype=np.uint32).reshape(1, len(out.token_ids))
            payload, head_len = await offload(
                host, encode_infer_response, {"id": rid}, [(out_name, "UINT32", array, as_binary)])
            if head_len is None:
                return Response(payload, media_type="application/json")
            return Response(payload, media_type="application/octet-stream", headers={HEADER_LENGTH: str(head_len)})
        except RequestError as err:
            return triton_error(err)

    def _input_ids(self, header: dict[str, Any], tensors: dict[str, np.ndarray]) -> list[int]:
        inputs = header.get("inputs")
        if not isinstance(inputs, list) or len(inputs) != 1:
            got = len(inputs) if isinstance(inputs, list) else "none"
            raise RequestError(f"inputs must hold exactly 1 tensor ('{INPUT_NAME}'), got {got}", field="inputs")
        entry = inputs[0]
        name = entry.get("name")
        if not isinstance(name, str) or name.lower() != INPUT_NAME:  # the spec's client samples send "INPUT0"
            raise RequestError(f"inputs[0].name must be '{INPUT_NAME}' (any case), got {name!r}",
                               field="inputs[0].name")
        datatype = entry.get("datatype")
        if datatype not in TOKEN_DATATYPES:
            raise RequestError(f"inputs[0].datatype must be UINT32 (token ids), got {datatype!r}",
                               field="inputs[0].datatype")
        array = tensors[name]
        shape = list(array.shape)
        if not (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)) or array.size == 0:
            raise RequestError(f"inputs[0].shape must be [n] or [1, n] with n > 0, got {shape}",
                               field="inputs[0].shape")
        return [int(t) for t in array.reshape(-1).tolist()]

    def _output_name(self, header: dict[str, Any], raw: bool) -> str:
        outputs = header.get("outputs")
        if raw and outputs is None:
            return "output0"
        if not isinstance(outputs, list) or len(outputs) != 1:
            got = len(outputs) if isinstance(outputs, list) else "none"
            raise RequestError(f"outputs must hold exactly as many entries as inputs (1), got {got}", field="outputs")
        name = outputs[0].get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 256:
            raise RequestError("outputs[0].name must be a string of 1-256 characters", field="outputs[0].name")
        return name

    # -- text inference (generate extension) ---------------------------------------------------
    async def _prepare(self, request: Request, model: str) -> tuple[EngineRequest, TritonParams, str]:
        host = self.host
        check_model(host, model)
        body = await read_json(request, host)
        f = Fields(body)
        rid = request_id(host, f)
        prompt = text_input(f.raw("text_input"))
        params = parse_parameters(host, body.get("parameters"), text_route=True)
        req = await offload(
            host, host.new_request, protocol=PROTOCOL, body=body, sampling=params.sampling, prompt=prompt,
            request_id=f"{rid}-{host.new_request_id('triton')}", priority=params.priority,
            timeout=params.timeout, field="text_input",
        )
        return req, params, rid

    async def generate(self, request: Request, model: str) -> Response:
        host = self.host
        try:
            req, params, rid = await self._prepare(request, model)
            out = await until_disconnect(request, host.generate_full(req))
            raise_for_failure(out)
            body: dict[str, Any] = {"id": rid, "model_name": model, "model_version": None, "text_output": out.text}
            if params.details:
                details: dict[str, Any] = {
                    "finish_reason": tgi_finish_reason(out),
                    "generated_tokens": len(out.token_ids),
                    "first_token_cost": None,
                    "decode_cost": None,
                }
                if params.perf_stat:
                    details["perf_stat"] = perf_stat(out)
                body["details"] = details
            return json_response(body)
        except RequestError as err:
            return triton_error(err)

    async def generate_stream(self, request: Request, model: str) -> Response:
        try:
            req, params, rid = await self._prepare(request, model)
        except RequestError as err:
            return triton_error(err)
        return streaming_response(self._stream(req, params, rid, model), media_type=SSE_MEDIA_TYPE)

    async def _stream(self, req: EngineRequest, params: TritonParams, rid: str, model: str) -> AsyncIterator[bytes]:
        host = self.host
        full_text = host.config.server.fullTextEnabled
        last_time: float | None = None
        stats: list[list[int]] = []
        try:
            async for out in host.generate(req):
                err = failure(out) if out.finished else None
                if err is not None:
                    yield sse_event({"error": err.message}, space=False)
                    return
                if not out.finished and not out.new_token_ids:
                    continue
                now = time.monotonic()
                first = last_time is None
                if first:
                    now = out.first_token_time or now
                    gap = (now - out.arrival_time) * 1000
                else:
                    gap = (now - last_time) * 1000
                for tid in out.new_token_ids:
                    stats.append([tid, int(round(gap / max(1, len(out.new_token_ids))))])
                details: dict[str, Any] = {}
                if out.finished:
                    details["finish_reason"] = tgi_finish_reason(out)
                details.update(generated_tokens=len(out.token_ids), first_token_cost=None, decode_cost=None)
                if params.perf_stat:
                    details["perf_stat"] = perf_stat(out) if out.token_times else [list(x) for x in stats]
                details["batch_size"] = max(1, int(getattr(host.engine, "num_active", 1) or 1))
                wait = 0
                if first and out.first_scheduled_time is not None:
                    wait = int((out.first_scheduled_time - out.arrival_time) * 1e6)
                details["queue_wait_time"] = wait
                prefill = round(gap, 3) if first else None
                decode = None if first else round(gap, 3)
                last_time = now
                yield sse_event({
                    "id": rid, "model_name": model, "model_version": None,
                    "text_output": out.text if full_text else out.new_text,
                    "details": details, "prefill_time": prefill, "decode_time": decode,
                }, space=False)
        except RequestError as err:
            yield sse_event({"error": err.message}, space=False)


def text_input(value: Any) -> str:
    """``text_input``: a non-empty string (4 MB), or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(value, str):
        check_text_size(value, "text_input")
        return value
    if isinstance(value, list) and value:
        parts = []
        for i, item in enumerate(value):
            name = f"text_input[{i}]"
            if not isinstance(item, dict):
                raise RequestError(f"{name} must be an object", field=name)
            kind = item.get("type", "text")
            if kind in MULTIMODAL_TYPES:  # a plugin's placeholder text, or a 422 (mindie_host.content)
                parts.append(media_text(kind, item, name))
                continue
            if kind != "text":
                raise RequestError(f"{name}.type must be one of ['text', 'image_url', 'video_url', 'audio_url'], "
                                   f"got {kind!r}", field=f"{name}.type")
            text = item.get("text")
            if not isinstance(text, str) or not text:
                raise RequestError(f"{name}.text must be a non-empty string", field=f"{name}.text")
            parts.append(text)
        prompt = "".join(parts)
        check_text_size(prompt, "text_input")
        return prompt
    if value is None:
        raise RequestError("text_input is required", field="text_input")
    raise RequestError("text_input must be a non-empty string or a list of content parts", field="text_input")


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    host = ctx.host
    assert host is not None  # routes are added for a running host
    server = TritonServer(host)
    if plane == "management":
        @app.get("/v2/models/{model}/ready")
        async def model_ready(model: str) -> Response:
            try:
                check_model(host, model)
            except RequestError as err:
                return triton_error(err)
            return Response(status_code=200 if not_ready_reason(host) is None else 503)  # a dead engine too
        return
    if plane != "business":
        return

    @app.get("/v2")
    async def server_metadata() -> Response:
        return json_response(server.server_metadata())

    @app.get("/v2/models/{model}")
    async def model_metadata(model: str) -> Response:
        try:
            return json_response(server.model_metadata(model))
        except RequestError as err:
            return triton_error(err)

    @app.get("/v2/models/{model}/config")
    async def model_config(model: str) -> Response:
        try:
            return json_response(server.model_config(model))
        except RequestError as err:
            return triton_error(err)

    @app.post("/v2/models/{model}/infer")
    async def infer(request: Request, model: str) -> Response:
        return await server.infer(request, model)

    @app.post("/v2/models/{model}/generate")
    async def generate(request: Request, model: str) -> Response:
        return await server.generate(request, model)

    @app.post("/v2/models/{model}/generate_stream")
    async def generate_stream(request: Request, model: str) -> Response:
        return await server.generate_stream(request, model)
