"""OpenAI-compatible API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

Request bodies are parsed in :mod:`.openai_parse` (the ``openAiSupport`` variants, every field's
range); this module runs the requests and writes the answers, whole or streamed, with OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body for errors.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import hookimpl
from ..chat_template import fit_roles, template_kwargs, template_profile
from ..context import HostContext
from ..engine.request import EngineRequest, RequestError, RequestOutput, TokenLogprob
from ..structured import llg, parse_structured
from .app import (
    error_response,
    json_response,
    offload,
    offload_untimed,
    read_json,
    sse_event,
    streaming_response,
    until_disconnect,
)
from .chat_stream import ChoiceStream
from .openai_parse import ParsedRequest, chat_messages, completion_prompts, make_fields, parse_common
from .outcome import failure, finish_reason, raise_for_failure
from .params import copy_sampling
from .reasoning import Reasoning, reasoning_for, special_markers
from .tool_calls import ToolPlan, plan_tools, vocab_for
from .validation import check_fan_out, check_text_size

if TYPE_CHECKING:
    from ..host_protocol import Host

PROTOCOL = "openai"


def openai_error_body(err: RequestError) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = {
        400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
        413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
    }.get(err.status, "server_error")
    code = "model_not_found" if err.status == 404 else None
    return {"error": {"message": err.message, "type": kind, "param": err.field, "code": code}}


def openai_error(err: RequestError) -> JSONResponse:
    return error_response(err, openai_error_body)


# -- rendering -------------------------------------------------------------------------------
def _token_text(host: Host, token_id: int) -> str:
    return host.tokenizer.decode([token_id])


def chat_logprobs(host: Host, items: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of the chat API."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = _token_text(host, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(it.token_id, it.logprob), "top_logprobs": [entry(t, lp) for t, lp in it.top]} for it in items
        ]
    }


def completion_logprobs(host: Host, items: list[TokenLogprob | int], offset: int = 0) -> dict[str, Any]:
    """``choices[].logprobs`` of the legacy completions API.

    A bare token id stands for a token without a logprob (the first prompt token under ``echo``):
    its ``token_logprobs`` and ``top_logprobs`` entries are null.
    """
    tokens = [_token_text(host, it if isinstance(it, int) else it.token_id) for it in items]
    offsets = []
    pos = offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if isinstance(it, int) else it.logprob for it in items],
        "top_logprobs": [None if isinstance(it, int) else {_token_text(host, t): lp for t, lp in it.top}
                         for it in items],
        "text_offset": offsets,
    }


def prompt_logprob_items(req: EngineRequest, out: RequestOutput) -> list[TokenLogprob | int]:
    """The prompt tokens' logprobs for ``echo``: the first token has none, every other one its own."""
    scored = out.prompt_logprobs or []
    items: list[TokenLogprob | int] = []
    for j, token in enumerate(req.prompt_token_ids):
        lp = scored[j] if j < len(scored) else None
        items.append(lp if lp is not None else token)
    return items


def echo_text(host: Host, req: EngineRequest) -> str:
    """The prompt as ``echo`` returns it: the text sent, or the decoded token ids."""
    return req.prompt if req.prompt is not None else host.tokenizer.decode(req.prompt_token_ids)


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return body


def timings(out: RequestOutput) -> dict[str, Any]:
    """MindIE's non-standard ``prefill_time`` and ``decode_time_arr`` (milliseconds)."""
    if out.first_token_time is None:
        return {"prefill_time": None, "decode_time_arr": []}
    prefill = (out.first_token_time - out.arrival_time) * 1000
    times = out.token_times
    decode = [round((b - a) * 1000, 3) for a, b in zip(times, times[1:])]
    return {"prefill_time": round(prefill, 3), "decode_time_arr": decode}


async def constrain(host: Host, reqs: list[EngineRequest], grammar: str | None,
                    reasoning: Reasoning | None = None) -> None:
    """Give every request its own matcher of ``grammar`` (response_format / guided decoding), applied after
    the reasoning of a reasoning model."""
    if grammar is None:
        return
    tokenizer = await asyncio.to_thread(llg.tokenizer_for, host)  # built once per host, off the event loop
    for req in reqs:
        constraint = llg.GrammarConstraint(tokenizer, grammar)
        req.logits_constraint = reasoning.constrain(host, constraint) if reasoning is not None else constraint


# -- endpoints ---------------------------------------------------------------------------------
class OpenAIServer:
    """Handlers for one host."""

    def __init__(self, host: Host) -> None:
        self.host = host

    def make_requests(self, body: dict[str, Any], parsed: ParsedRequest, prompts: list[tuple[str | None, list[int] | None]],
                      base_id: str) -> list[EngineRequest]:
        check_fan_out(self.host.config.schedule.maxBatchSize, len(prompts), parsed.n)
        reqs = []
        for p_index, (text, ids) in enumerate(prompts):
            for k in range(parsed.n):
                sampling = copy_sampling(parsed.sampling, k if parsed.n > 1 else 0)
                reqs.append(
                    self.host.new_request(
                        protocol=PROTOCOL, body=body, sampling=sampling, prompt=text, prompt_token_ids=ids,
                        request_id=f"{base_id}-{p_index}-{k}", add_special_tokens=ids is None and text is not None,
                        field="prompt" if "prompt" in body else "messages",
                    )
                )
        return reqs

    async def chat(self, request: Request) -> Response:
        host = self.host
        try:
            body = await read_json(request, host)
            f = make_fields(host, body)
            parsed = parse_common(host, f, chat=True)
            messages = chat_messages(f)
            profile = await offload_untimed(host, template_profile, host)  # probed once per template, off the event loop
            plan = plan_tools(host, f.raw("tools"), f.raw("tool_choice"),
                              parallel=f.bool("parallel_tool_calls", True) is not False)
            structured = parse_structured(body)
            if structured is not None and plan.constrained:
                raise RequestError(f"{structured.field} cannot be combined with a required or named tool_choice",
                                   field=structured.field, status=400)
            grammar = await offload_untimed(host, llg.compile_grammar, structured) if structured is not None else None
            kwargs = template_kwargs(f.raw("chat_template_kwargs"), profile)
            messages, tools = plan.prepare(messages, profile)
            prompt = await offload(host, host.apply_chat_template, fit_roles(messages, profile), tools=tools, **kwargs)
            check_text_size(prompt, "messages")
            reasoning = reasoning_for(host, prompt)
            base_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
            reqs = await offload(host, lambda: self.make_requests(
                body, parsed, [(prompt, host.tokenize(prompt, add_special_tokens=False))], base_id))
            keep = (plan.parser.markers if plan.mode == "auto" else ()) + (
                (reasoning.parser.start, reasoning.parser.end) if reasoning is not None else ())
            if keep and special_markers(host, keep):  # the parsers must see the markers the tokenizer calls special
                for req in reqs:
                    req.sampling.skip_special_tokens = False
            if plan.constrained:
                await asyncio.to_thread(vocab_for, host)  # built once per tokenizer, off the event loop
                await asyncio.to_thread(llg.tokenizer_for, host)
                for req in reqs:
                    constraint = plan.constraint(host)
                    req.logits_constraint = reasoning.constrain(host, constraint) if reasoning is not None \
                        else constraint
            await constrain(host, reqs, grammar, reasoning)
            created = int(time.time())
            if parsed.stream:
                return streaming_response(self._chat_stream(reqs, parsed, base_id, created, plan, reasoning))
            outs = await until_disconnect(request, asyncio.gather(*(host.generate_full(r) for r in reqs)))
            choices = []
            for i, out in enumerate(outs):
                raise_for_failure(out)
                thought, text = reasoning.split(out.text) if reasoning is not None else (None, out.text)
                content, calls, reason = plan.finish(text, finish_reason(out))
                message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
                if reasoning is not None:
                    message["reasoning_content"] = thought
                choice: dict[str, Any] = {
                    "index": i,
                    "message": message,
                    "logprobs": chat_logprobs(host, out.logprobs) if parsed.logprobs is not None else None,
                    "finish_reason": reason,
                }
                if out.stop_reason is not None:
                    choice["stop_reason"] = out.stop_reason
                choices.append(choice)
            first = outs[0]
            return json_response({
                "id": base_id,
                "object": "chat.completion",
                "created": created,
                "model": parsed.model,
                "choices": choices,
                "usage": usage(first.num_prompt_tokens, sum(len(o.token_ids) for o in outs), first.num_cached_tokens),
                **timings(first),
            })
        except RequestError as err:
            return openai_error(err)

    async def _merged(self, reqs: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come, tagged with the request's index."""
        if len(reqs) == 1:
            async for out in self.host.generate(reqs[0]):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, req: EngineRequest) -> None:
            try:
                async for out in self.host.generate(req):
                    await queue.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _chat_stream(self, reqs: list[EngineRequest], parsed: ParsedRequest, base_id: str,
                           created: int, plan: ToolPlan, reasoning: Reasoning | None = None) -> AsyncIterator[bytes]:
        full_text = self.host.config.server.fullTextEnabled
        totals = [0] * len(reqs)
        prompt_tokens = len(reqs[0].prompt_token_ids)
        streams = [ChoiceStream(plan, reasoning) for _ in reqs]

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return sse_event({"id": base_id, "object": "chat.completion.chunk", "created": created,
                              "model": parsed.model, **extra, "choices": choices})

        def choice(i: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None) -> dict[str, Any]:
            return {"index": i, "delta": {"role": "assistant", **delta}, "logprobs": logprobs, "finish_reason": reason}

        try:
            async for i, out in self._merged(reqs):
                err = failure(out) if out.finished else None
                if err is not None:
                    yield sse_event(openai_error_body(err))
                    break
                totals[i] = len(out.token_ids)
                if not out.finished and not out.new_text:
                    continue
                logprobs = chat_logprobs(self.host, out.logprobs) if parsed.logprobs is not None and out.logprobs \
                    else None
                cs = streams[i]
                if not out.finished:
                    for delta in cs.feed(out.new_text):
                        if full_text and "content" in delta:  # cumulative content (MindIE's fullTextEnabled)
                            delta = {**delta, "content": cs.content}
                        yield chunk([choice(i, delta, logprobs)])
                        logprobs = None
                    continue
                deltas, reason = cs.finish(out.new_text, finish_reason(out))
                if full_text and not any("tool_calls" in d for d in deltas):
                    deltas = [d for d in deltas if "reasoning_content" in d] + [{"content": cs.content}]
                for delta in deltas[:-1]:
                    yield chunk([choice(i, delta, logprobs)])
                    logprobs = None
                extra: dict[str, Any] = {}
                if full_text:
                    extra["full_text"] = out.text
                last = deltas[-1] if deltas else {"content": ""}
                yield chunk([choice(i, last, logprobs, reason)], **extra)
            if parsed.include_usage:
                yield chunk([], usage=usage(prompt_tokens, sum(totals)))
            yield b"data: [DONE]\n\n"
        except RequestError as err:
            yield sse_event(openai_error_body(err))
            yield b"data: [DONE]\n\n"

    async def completions(self, request: Request) -> Response:
        host = self.host
        try:
            body = await read_json(request, host)
            f = make_fields(host, body)
            parsed = parse_common(host, f, chat=False)
            prompts = completion_prompts(f.raw("prompt"))
            echo = bool(f.bool("echo", False))
            structured = parse_structured(body)
            grammar = await offload_untimed(host, llg.compile_grammar, structured) if structured is not None else None
            base_id = f"cmpl-{uuid.uuid4().hex[:24]}"
            reqs = await offload(host, self.make_requests, body, parsed, prompts, base_id)
            await constrain(host, reqs, grammar)
            created = int(time.time())
            if parsed.stream:
                return streaming_response(self._completion_stream(reqs, parsed, base_id, created, echo))
            outs = await until_disconnect(request, asyncio.gather(*(host.generate_full(r) for r in reqs)))
            choices = []
            for i, (out, req) in enumerate(zip(outs, reqs)):
                raise_for_failure(out)
                if parsed.prompt_only:  # max_tokens 0: the token the engine made is not part of the answer
                    out.text, out.token_ids, out.logprobs, out.stop_reason = "", [], [], None
                prefix = echo_text(host, req) if echo else ""
                logprobs = None
                if parsed.logprobs is not None:
                    items: list[TokenLogprob | int] = list(out.logprobs)
                    if echo:
                        items = prompt_logprob_items(req, out) + items
                    logprobs = completion_logprobs(host, items)
                choices.append({
                    "index": i,
                    "text": prefix + out.text,
                    "logprobs": logprobs,
                    "finish_reason": "length" if parsed.prompt_only else finish_reason(out),
                    "stop_reason": out.stop_reason,
                })
            return json_response({
                "id": base_id,
                "object": "text_completion",
                "created": created,
                "model": parsed.model,
                "choices": choices,
                "usage": usage(sum(len(r.prompt_token_ids) for r in reqs) // max(1, parsed.n),
                               sum(len(o.token_ids) for o in outs), sum(o.num_cached_tokens for o in outs) // max(1, parsed.n)),
            })
        except RequestError as err:
            return openai_error(err)

    async def _completion_stream(self, reqs: list[EngineRequest], parsed: ParsedRequest, base_id: str,
                                 created: int, echo: bool = False) -> AsyncIterator[bytes]:
        host = self.host
        full_text = host.config.server.fullTextEnabled
        totals = [0] * len(reqs)
        echoed = [not echo] * len(reqs)

        def event(choice: dict[str, Any]) -> bytes:
            return sse_event({"id": base_id, "object": "text_completion", "created": created,
                              "model": parsed.model, "choices": [choice]})

        try:
            async for i, out in self._merged(reqs):
                err = failure(out) if out.finished else None
                if err is not None:
                    yield sse_event(openai_error_body(err))
                    break
                prefix = ""
                if not echoed[i]:  # the echoed prompt comes first, with its logprobs
                    echoed[i] = True
                    prefix = echo_text(host, reqs[i])
                    lps = completion_logprobs(host, prompt_logprob_items(reqs[i], out)) \
                        if parsed.logprobs is not None else None
                    yield event({"index": i, "text": prefix, "logprobs": lps, "finish_reason": None})
                if parsed.prompt_only:  # max_tokens 0: nothing but the prompt
                    if out.finished:
                        yield event({"index": i, "text": prefix if full_text else "", "logprobs": None,
                                     "finish_reason": "length"})
                    continue
                totals[i] = len(out.token_ids)
                if not out.finished and not out.new_text:
                    continue
                choice = {
                    "index": i,
                    "text": (echo_text(host, reqs[i]) if echo else "") + out.text if full_text else out.new_text,
                    "logprobs": completion_logprobs(host, list(out.logprobs)) if parsed.logprobs is not None else None,
                    "finish_reason": finish_reason(out) if out.finished else None,
                }
                yield event(choice)
            if parsed.include_usage:
                prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs) // max(1, parsed.n)
                yield sse_event({"id": base_id, "object": "text_completion", "created": created,
                                 "model": parsed.model, "choices": [], "usage": usage(prompt_tokens, sum(totals))})
            yield b"data: [DONE]\n\n"
        except RequestError as err:
            yield sse_event(openai_error_body(err))
            yield b"data: [DONE]\n\n"

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card(name) for name in self.host.served_model_names]}

    def model_card(self, name: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": name, "object": "model", "created": self.host.created, "owned_by": "MindIE Server"}
        if name != self.host.model_name:
            card["parent"] = self.host.model_name
        if self.host.info is not None:
            card["max_model_len"] = self.host.config.deploy.maxSeqLen
        return card


@hookimpl
def mindie_host_add_routes(ctx: HostContext, app: FastAPI, plane: str) -> None:
    host = ctx.host
    assert host is not None  # routes are added for a running host
    if plane != "business":
        return
    server = OpenAIServer(host)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(server.models())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        if model not in host.served_model_names:
            return openai_error(RequestError(f"Model {model} not found.", status=404, field="model"))
        return json_response(server.model_card(model))

    app.post("/v1/chat/completions")(server.chat)
    app.post("/v1/completions")(server.completions)
