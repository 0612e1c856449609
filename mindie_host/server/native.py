"""MindIE native API (spec §4.2.6): ``POST /infer``, ``POST /infer_token``, early termination, slot statistics.

* ``/infer`` (text in) and ``/infer_token`` (``input_id`` token ids in): non-stream
  ``{"generated_text", "details"}``; stream ``data: {...}`` events (with a space)
  carrying ``prefill_time``/``decode_time`` (ms) and the token; the last event
  carries the full ``generated_text`` and ``details`` and a null ``token.text``.
* ``POST /v2/models/{m}/stopInfer`` (business plane) aborts a running request by
  the ``id`` its client gave (Triton routes, and ``/infer`` with our ``id`` extension);
  :class:`ClientIds` maps client ids to engine request ids.
* ``GET /v2/models/{m}/getSlotCount`` (management plane): batch slots and free KV tokens.

Errors use MindIE's ``{"type", "error", "field"}`` body.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import hookimpl
from ..engine.request import EngineRequest, RequestError, RequestOutput
from ..host_state import CacheSlot
from .app import (
    error_response,
    json_response,
    mindie_error_body,
    offload,
    read_json,
    sse_event,
    streaming_response,
    until_disconnect,
)
from .textgen import (
    TextGenParams,
    client_id,
    closing_token_id,
    failure,
    parse_tgi_parameters,
    primed,
    text_input,
    tgi_finish_reason,
)
from .validation import Fields

if TYPE_CHECKING:
    from ..context import HostContext
    from ..host_protocol import Host

PROTOCOL = "native"
#: ``input_id`` values must lie in [0, 1024*1024] (and in the vocabulary).
MAX_INPUT_ID = 1024 * 1024


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class ClientIds:
    """Client-given ``id`` -> engine request ids of requests that have not finished (for ``stopInfer``).

    Filled by the request-refinement hook for the Triton and native protocols (a
    protocol may run a client id under a longer engine id); entries leave when the
    engine reports the request finished. At most ``cap`` ids are kept (oldest dropped),
    so requests refused before they reach the engine cannot grow it without bound.
    """

    def __init__(self, cap: int = 65536) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._by_client: OrderedDict[str, set[str]] = OrderedDict()
        self._client_of: dict[str, str] = {}

    def add(self, client_id: str, engine_id: str) -> None:
        with self._lock:
            self._by_client.setdefault(client_id, set()).add(engine_id)
            self._client_of[engine_id] = client_id
            while len(self._by_client) > self.cap:
                _, dropped = self._by_client.popitem(last=False)
                for eid in dropped:
                    self._client_of.pop(eid, None)

    def engine_ids(self, client_id: str) -> list[str]:
        with self._lock:
            return sorted(self._by_client.get(client_id, ()))

    def on_step(self, outputs: Iterable[RequestOutput]) -> None:
        """Engine step hook (worker thread): forget finished requests."""
        done = [o.request_id for o in outputs if o.finished]
        if not done:
            return
        with self._lock:
            for eid in done:
                cid = self._client_of.pop(eid, None)
                if cid is None:
                    continue
                ids = self._by_client.get(cid)
                if ids is not None:
                    ids.discard(eid)
                    if not ids:
                        del self._by_client[cid]


#: MindIE native client-id bookkeeping, per host
CLIENT_IDS: CacheSlot[ClientIds] = CacheSlot("native client ids")


def client_ids(host: Host) -> ClientIds:
    """The host's :class:`ClientIds` registry."""
    return host.caches.get_or_make(CLIENT_IDS, ClientIds)


class NativeServer:
    """Handlers of the MindIE native routes for one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def check_model(self, model: str) -> None:
        if model not in self.host.served_model_names:
            raise RequestError(
                f"model {model!r} is not served (served: {self.host.served_model_names})", status=404, field="model"
            )

    # -- inference ------------------------------------------------------------------------------
    def parse(self, body: dict[str, Any], *, tokens: bool) -> tuple[bool, TextGenParams, EngineRequest]:
        host = self.host
        f = Fields(body, nullable=True)
        stream = bool(f.bool("stream", False))
        params = parse_tgi_parameters(host, f.raw("parameters"), native=True)
        rid = client_id(body) or host.new_request_id()
        common: dict[str, Any] = {"protocol": PROTOCOL, "body": body, "sampling": params.sampling, "request_id": rid,
                                  "priority": params.priority, "timeout": params.timeout}
        if tokens:
            ids = body.get("input_id")
            if not isinstance(ids, list) or not ids:
                raise RequestError("input_id must be a non-empty list of token ids", field="input_id")
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_INPUT_ID:
                    raise RequestError(f"input_id[{i}] must be an integer in [0, {MAX_INPUT_ID}], got {t!r}",
                                       field=f"input_id[{i}]")
            req = host.new_request(prompt_token_ids=ids, field="input_id", **common)
        else:
            req = host.new_request(prompt=text_input(body.get("inputs"), "inputs"), field="inputs", **common)
        return stream, params, req

    async def infer(self, request: Request, *, tokens: bool) -> Response:
        host = self.host
        try:
            body = await read_json(request, host)
            stream, params, req = await offload(host, self.parse, body, tokens=tokens)
            if stream:
                outputs = await primed(host.generate(req))
                return streaming_response(self.events(outputs, req, params))
            out: RequestOutput = await until_disconnect(request, host.generate_full(req))
            err = failure(out)
            if err is not None:
                raise err
            result: dict[str, Any] = {"generated_text": out.text}
            if params.details:
                result["details"] = self.details(req, out)
            return json_response(result)
        except RequestError as err:
            return error_response(err)

    @staticmethod
    def details(req: EngineRequest, out: RequestOutput) -> dict[str, Any]:
        return {
            "finish_reason": tgi_finish_reason(out),
            "generated_tokens": len(out.token_ids),
            "seed": out.seed if out.seed is not None else req.sampling.seed,
        }

    async def events(self, outputs: AsyncIterator[RequestOutput], req: EngineRequest,
                     params: TextGenParams) -> AsyncIterator[bytes]:
        """One event per token; the last one has ``generated_text``, ``details`` and ``token.text`` null."""
        full_text = self.host.config.server.fullTextEnabled
        last_time: float | None = None
        carry = ""
        try:
            async for out in outputs:
                err = failure(out)
                if err is not None:
                    yield sse_event(mindie_error_body(err))
                    return
                ids = list(out.new_token_ids)
                if not ids and not out.finished:
                    carry += out.new_text
                    continue
                if not ids:
                    ids = [closing_token_id(self.host, out)]
                now = time.monotonic()
                for j, tid in enumerate(ids):
                    final = out.finished and j == len(ids) - 1
                    if last_time is None:
                        start = out.first_token_time or now
                        prefill, decode = _ms(start - req.arrival_time), None
                    else:
                        prefill, decode = None, _ms(now - last_time)
                    last_time = now
                    event: dict[str, Any] = {"prefill_time": prefill, "decode_time": decode}
                    if final:
                        event["generated_text"] = out.text
                        event["details"] = self.details(req, out) if params.details else None
                        event["token"] = {"id": tid, "text": None}
                    else:
                        if full_text:
                            text = out.text
                        elif j == len(ids) - 1:
                            text, carry = carry + out.new_text, ""
                        else:
                            text = ""
                        event["token"] = {"id": tid, "text": text}
                    yield sse_event(event)
        except RequestError as err:
            yield sse_event(mindie_error_body(err))

    # -- control --------------------------------------------------------------------------------
    async def stop_infer(self, request: Request, model: str) -> Response:
        """Abort the running request whose client-given id is ``id``."""
        host = self.host
        try:
            self.check_model(model)
            body = await read_json(request, host)
            rid = client_id(body)
            if rid is None:
                raise RequestError("id is required", field="id")
            engine = host.engine
            targets = [rid, *client_ids(host).engine_ids(rid)]
            stopped = [eid for eid in dict.fromkeys(targets) if engine is not None and engine.abort(eid)]
            if not stopped:
                raise RequestError(f"no running request has id {rid!r}", status=404, field="id")
            return json_response({"id": rid})
        except RequestError as err:
            return error_response(err)

    def slot_count(self, model: str) -> Response:
        """Total and free batch slots, and how many more tokens the free KV blocks hold."""
        try:
            self.check_model(model)
        except RequestError as err:
            return error_response(err)
        stats = self.host.stats()
        total = self.host.config.schedule.maxBatchSize
        used = int(stats.get("num_running", 0))
        return json_response({
            "total_slots": total,
            "free_slots": max(0, total - used),
            "available_tokens_length": int(stats.get("kv_blocks_free", 0)) * self.host.config.schedule.cacheBlockSize,
        })


@hookimpl
def mindie_host_step_outputs(ctx: HostContext, outputs: list[RequestOutput]) -> None:
    """Forget the client ids of requests that finished in this step."""
    if ctx.host is not None:
        client_ids(ctx.host).on_step(outputs)


@hookimpl
def mindie_host_refine_request(ctx: HostContext, request: EngineRequest, body: dict[str, Any], protocol: str) -> None:
    """Remember which engine request runs under a client-given ``id`` (Triton and native routes)."""
    cid = body.get("id") if protocol in ("triton", "native") else None
    if isinstance(cid, str) and cid and ctx.host is not None:
        client_ids(ctx.host).add(cid, request.request_id)


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    host = ctx.host
    assert host is not None  # routes are added for a running host
    server = NativeServer(host)
    if plane == "management":
        @app.get("/v2/models/{model}/getSlotCount")
        async def get_slot_count(model: str) -> Response:
            return server.slot_count(model)
        return
    if plane != "business":
        return

    @app.post("/infer")
    async def infer(request: Request) -> Response:
        return await server.infer(request, tokens=False)

    @app.post("/infer_token")
    async def infer_token(request: Request) -> Response:
        return await server.infer(request, tokens=True)

    @app.post("/v2/models/{model}/stopInfer")
    async def stop_infer(request: Request, model: str) -> Response:
        return await server.stop_infer(request, model)
