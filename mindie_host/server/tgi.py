"""TGI 0.9.4-compatible API: ``POST /``, ``/generate``, ``/generate_stream`` and ``GET /info``.

``POST /generate`` is shared with vLLM 0.2.6: a body with ``inputs`` is TGI, one
with ``prompt`` is vLLM (see :func:`~mindie_host.server.textgen.pick_generate_protocol`).
``GET /health`` lives in the management module. Errors use TGI's
``{"error": ..., "error_type": ...}`` body, plus ``field`` naming the bad field.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from .. import __version__, hookimpl
from ..context import HostContext
from ..engine.request import EngineRequest, RequestError, RequestOutput, TokenLogprob
from .app import error_response, json_response, offload, read_json, sse_event, streaming_response, until_disconnect
from .params import copy_sampling
from .textgen import (
    MAX_BEST_OF,
    TextGenParams,
    check_adapter,
    closing_token_id,
    failure,
    parse_tgi_parameters,
    pick_generate_protocol,
    primed,
    special_ids,
    text_input,
    tgi_finish_reason,
)
from .validation import Fields, check_fan_out

if TYPE_CHECKING:
    from ..host_protocol import Host

PROTOCOL = "tgi"

_ERROR_TYPES = {
    400: "validation", 413: "validation", 422: "validation", 404: "not_found", 408: "timeout",
    424: "generation", 429: "overloaded", 499: "cancelled", 500: "incomplete_generation", 503: "overloaded",
}


def tgi_error_body(err: RequestError) -> dict[str, Any]:
    """TGI's error object, with the offending field when there is one."""
    body: dict[str, Any] = {"error": err.message, "error_type": _ERROR_TYPES.get(err.status, "generation")}
    if err.field:
        body["field"] = err.field
    return body


def tgi_error(err: RequestError) -> Response:
    return error_response(err, tgi_error_body)


class TGIServer:
    """Handlers of the TGI routes for one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    # -- parsing ------------------------------------------------------------------------------
    def parse(self, body: dict[str, Any], *, stream: bool) -> tuple[str, TextGenParams, list[EngineRequest]]:
        """Validate a TGI body and build its engine request(s) (``best_of`` of them)."""
        host = self.host
        prompt = text_input(body.get("inputs"), "inputs")
        params = parse_tgi_parameters(host, body.get("parameters"))
        if stream and params.decoder_input_details:
            raise RequestError(
                "parameters.decoder_input_details must be false when streaming",
                field="parameters.decoder_input_details",
            )
        if stream and params.best_of > 1:
            raise RequestError("parameters.best_of > 1 is not supported when streaming", field="parameters.best_of")
        check_fan_out(host.config.schedule.maxBatchSize, 1, params.best_of, "parameters.best_of")
        sampling = params.sampling
        if sampling.logprobs is None:
            sampling.logprobs = 0  # every token carries its logprob
        if params.decoder_input_details:
            sampling.prompt_logprobs = 0
        base_id = host.new_request_id("tgi")
        reqs = []
        for k in range(params.best_of):
            req = host.new_request(
                protocol=PROTOCOL, body=body, sampling=copy_sampling(sampling, k), prompt=prompt,
                request_id=base_id if params.best_of == 1 else f"{base_id}-{k}", truncate=params.truncate,
                field="inputs",
            )
            check_adapter(host, req, params.adapter_id, "parameters.adapter_id")
            reqs.append(req)
        return prompt, params, reqs

    # -- rendering ------------------------------------------------------------------------------
    def token(self, token_id: int, text: str, logprob: float | None) -> dict[str, Any]:
        return {"id": token_id, "text": text, "logprob": logprob, "special": token_id in special_ids(self.host)}

    def tokens(self, out: RequestOutput) -> list[dict[str, Any]]:
        decode = self.host.tokenizer.decode
        lps: list[TokenLogprob | None] = list(out.logprobs)
        lps += [None] * (len(out.token_ids) - len(lps))
        return [self.token(t, decode([t]), lp.logprob if lp else None) for t, lp in zip(out.token_ids, lps)]

    def top_tokens(self, out: RequestOutput) -> list[list[dict[str, Any]]]:
        decode = self.host.tokenizer.decode
        return [[self.token(t, decode([t]), lp) for t, lp in item.top] for item in out.logprobs]

    def prefill(self, req: EngineRequest, out: RequestOutput) -> list[dict[str, Any]]:
        decode = self.host.tokenizer.decode
        lps = out.prompt_logprobs or []
        items = []
        for i, t in enumerate(req.prompt_token_ids):
            lp = lps[i] if i < len(lps) else None
            items.append({"id": t, "text": decode([t]), "logprob": lp.logprob if lp is not None else None})
        return items

    def details(self, req: EngineRequest, out: RequestOutput, params: TextGenParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": out.num_prompt_tokens,
            "finish_reason": tgi_finish_reason(out),
            "generated_tokens": len(out.token_ids),
            "prefill": self.prefill(req, out) if params.decoder_input_details else [],
            "seed": out.seed if out.seed is not None else req.sampling.seed,
            "tokens": self.tokens(out),
        }
        if params.top_n_tokens:
            body["top_tokens"] = self.top_tokens(out)
        return body

    # -- non-stream -----------------------------------------------------------------------------
    async def run(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        """One TGI generation (``best_of`` sequences, keeping the most likely) as a response object."""
        prompt, params, reqs = await offload(self.host, self.parse, body, stream=False)
        host = self.host
        outs: list[RequestOutput] = await until_disconnect(
            request, asyncio.gather(*(host.generate_full(r) for r in reqs))
        )
        for out in outs:
            err = failure(out)
            if err is not None:
                raise err
        order = sorted(range(len(outs)), key=lambda i: -sum(lp.logprob for lp in outs[i].logprobs))
        best = order[0]
        prefix = prompt if params.return_full_text else ""
        result: dict[str, Any] = {"generated_text": prefix + outs[best].text}
        if params.details or params.decoder_input_details:
            details = self.details(reqs[best], outs[best], params)
            if len(outs) > 1:
                details["best_of_sequences"] = [
                    {"generated_text": prefix + outs[i].text, **self.details(reqs[i], outs[i], params)}
                    for i in order[1:]
                ]
            result = {"details": details, **result}
        return result

    async def generate(self, request: Request, body: dict[str, Any]) -> Response:
        """``POST /generate`` with a TGI body: one object."""
        try:
            return json_response(await self.run(request, body))
        except RequestError as err:
            return tgi_error(err)

    async def root(self, request: Request) -> Response:
        """``POST /``: ``stream`` picks SSE or a one-element JSON array."""
        try:
            body = await read_json(request, self.host)
            stream = Fields(body, nullable=True).bool("stream", False)
            if stream:
                return await self.start_stream(body)
            return json_response([await self.run(request, body)])
        except RequestError as err:
            return tgi_error(err)

    # -- stream ---------------------------------------------------------------------------------
    async def generate_stream(self, request: Request) -> Response:
        """``POST /generate_stream``: always SSE."""
        try:
            body = await read_json(request, self.host)
            return await self.start_stream(body)
        except RequestError as err:
            return tgi_error(err)

    async def start_stream(self, body: dict[str, Any]) -> Response:
        prompt, params, reqs = await offload(self.host, self.parse, body, stream=True)
        outputs = await primed(self.host.generate(reqs[0]))
        return streaming_response(self.events(outputs, reqs[0], prompt, params))

    async def events(self, outputs: AsyncIterator[RequestOutput], req: EngineRequest, prompt: str,
                     params: TextGenParams) -> AsyncIterator[bytes]:
        """``data: {token, generated_text, details}`` per token; the last event closes the stream."""
        full_text = self.host.config.server.fullTextEnabled
        carry = ""  # text that arrived without a token (given to the next token)
        try:
            async for out in outputs:
                err = failure(out)
                if err is not None:
                    yield sse_event(tgi_error_body(err))
                    return
                ids = out.new_token_ids
                lps: list[TokenLogprob | None] = list(out.logprobs)
                lps += [None] * (len(ids) - len(lps))
                if not ids and not out.finished:
                    carry += out.new_text
                    continue
                if not ids:  # finished without a new token (EOS is not part of the output)
                    ids, lps = [closing_token_id(self.host, out)], [None]
                for j, (tid, lp) in enumerate(zip(ids, lps)):
                    last = j == len(ids) - 1
                    if full_text:
                        text = out.text
                    elif last:
                        text, carry = carry + out.new_text, ""
                    else:
                        text = ""
                    event: dict[str, Any] = {
                        "token": self.token(tid, text, lp.logprob if lp else None),
                        "generated_text": None,
                        "details": None,
                    }
                    if params.top_n_tokens and lp is not None:
                        event["top_tokens"] = [self.token(t, self.host.tokenizer.decode([t]), v) for t, v in lp.top]
                    if out.finished and last:
                        event["generated_text"] = (prompt if params.return_full_text else "") + out.text
                        if params.details:
                            event["details"] = {
                                "prompt_tokens": out.num_prompt_tokens,
                                "finish_reason": tgi_finish_reason(out),
                                "generated_tokens": len(out.token_ids),
                                "seed": out.seed if out.seed is not None else req.sampling.seed,
                            }
                    yield sse_event(event)
        except RequestError as err:
            yield sse_event(tgi_error_body(err))

    # -- info -----------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """``GET /info`` (spec §1.2); fields MindIE does not support are null."""
        host = self.host
        cfg = host.config
        dtype = getattr(host.info, "dtype", None) if host.info is not None else None
        return {
            "docker_label": None,
            "max_batch_total_tokens": cfg.schedule.maxPrefillTokens,
            "max_best_of": MAX_BEST_OF,
            "max_concurrent_requests": cfg.schedule.maxBatchSize,
            "max_stop_sequences": None,
            "max_waiting_tokens": None,
            "sha": None,
            "validation_workers": None,
            "version": __version__,
            "waiting_served_ratio": None,
            "models": [{
                "model_device_type": host.info.device if host.info is not None else None,
                "model_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
                "model_id": host.model_name,
                "model_pipeline_tag": "text-generation",
                "model_sha": None,
                "max_total_tokens": cfg.deploy.maxSeqLen,
            }],
            "max_input_length": cfg.deploy.maxInputTokenLen,
        }


async def dispatch_generate(host: Host, tgi: TGIServer, request: Request) -> Response:
    """``POST /generate``: TGI for ``inputs`` bodies, vLLM for ``prompt`` bodies."""
    from .vllm import VLLMServer

    try:
        body = await read_json(request, host)
        protocol = pick_generate_protocol(body)
    except RequestError as err:
        return tgi_error(err)
    if protocol == "tgi":
        return await tgi.generate(request, body)
    return await VLLMServer(host).generate(request, body)


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    host = ctx.host
    assert host is not None  # routes are added for a running host
    server = TGIServer(host)
    if plane == "management":
        @app.get("/info")
        async def info() -> Response:
            return json_response(server.info())
        return
    if plane != "business":
        return

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await dispatch_generate(host, server, request)

    app.post("/")(server.root)
    app.post("/generate_stream")(server.generate_stream)
