"""OpenAI-compatible API: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

``ServerConfig.openAiSupport`` picks the chat variant (spec §4.2.3 / §4.2.4):
``"vllm"`` (the default) accepts ``null`` for optional fields, ``temperature >= 0``
with no upper bound and ``top_k = -1``; any other value is the plain variant
(``temperature`` in [0, 2], ``top_k`` in [0, 2^31-1], no nulls). Errors use
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import hookimpl
from ..chat_template import fit_roles, template_kwargs, template_profile
from ..content import MEDIA_TYPES, media_text
from ..engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams, TokenLogprob
from ..structured import llg, parse_structured
from .app import error_response, json_response, offload, read_json, sse_event, streaming_response, until_disconnect
from .chat_stream import ChoiceStream
from .outcome import failure, finish_reason, raise_for_failure
from .params import build_sampling, copy_sampling
from .reasoning import Reasoning, reasoning_for, special_markers
from .tool_calls import ToolPlan, plan_tools, vocab_for
from .validation import INT32_MAX, Fields, check_fan_out, check_seed, check_text_size

if TYPE_CHECKING:
    from ..host_protocol import Host

PROTOCOL = "openai"
ROLES = ("system", "developer", "user", "assistant", "tool")


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


# -- request parsing ---------------------------------------------------------------------
@dataclass
class ParsedRequest:
    """What both endpoints share after parsing."""

    model: str
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    #: ``max_tokens: 0`` on /v1/completions with echo: only the prompt (and its logprobs) comes back
    prompt_only: bool = False


#: Fields the plain variant also accepts as ``null`` (the spec's example sends ``"seed": null``;
#: ``stop``/``stop_token_ids`` default to null, ``tool_choice`` is nullable) plus our extensions.
PLAIN_NULLABLE = ("seed", "stop", "stop_token_ids", "tools", "tool_choice", "n", "logprobs", "top_logprobs",
                  "stream_options", "max_completion_tokens", "min_p", "min_tokens", "user", "response_format",
                  "logit_bias")


def make_fields(host: Host, body: dict[str, Any]) -> Fields:
    """``Fields`` with the variant's null rule: every optional field nullable (vllm) or only some (plain)."""
    if host.config.server.openAiSupport == "vllm":
        return Fields(body, nullable=True)
    return Fields({k: v for k, v in body.items() if not (v is None and k in PLAIN_NULLABLE)})


def resolve_model(host: Host, fields: Fields) -> str:
    """``model`` must name the served model or a loaded adapter (404 otherwise)."""
    model = fields.str("model", None, min_len=1)
    if model is None:
        raise RequestError("model is required", field="model")
    if model not in host.served_model_names:
        raise RequestError(
            f"The model `{model}` does not exist; served: {host.served_model_names}", status=404, field="model"
        )
    return model


#: OpenAI request fields this server does not implement, with why: a request that sends one (other than
#: as null, or the no-op value given) gets a 400 naming it rather than an answer that silently ignores it.
UNSUPPORTED_CHAT = {
    "functions": "the deprecated functions API; send tools", "function_call": "deprecated; send tool_choice",
    "audio": "audio output is not supported", "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported; where the chat template reads it, "
                        "chat_template_kwargs.enable_thinking turns thinking off or on",
    "chat_template": "a request cannot replace the model's chat template",
    "documents": "documents for retrieval-augmented templates are not supported",
}
UNSUPPORTED_COMPLETIONS = {"suffix": "insertion (suffix) is not supported"}
NO_OP_VALUES = {"modalities": ["text"], "store": False, "service_tier": ("auto", "default"), "best_of": 1,
                "add_generation_prompt": True, "continue_final_message": False}


def refuse_unsupported(f: Fields, *, chat: bool) -> None:
    """A 400 for an OpenAI field that would otherwise be ignored (see docs/compatibility.md)."""
    for key, why in (UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETIONS).items():
        if f.raw(key) is not None:
            raise RequestError(f"{key} is not supported: {why}", field=key, status=400)
    for key, ok in NO_OP_VALUES.items():
        value = f.raw(key)
        if value is not None and value != ok and not (isinstance(ok, tuple) and value in ok):
            raise RequestError(f"{key} is only supported as {ok!r}, got {value!r}", field=key, status=400)


def parse_common(host: Host, f: Fields, *, chat: bool) -> ParsedRequest:
    """Fields both endpoints share, with the variant's ranges."""
    refuse_unsupported(f, chat=chat)
    vllm = host.config.server.openAiSupport == "vllm"
    model = resolve_model(host, f)
    if vllm:
        temperature = f.float("temperature", lo=0.0)
        top_k = f.int("top_k", lo=0, hi=INT32_MAX, lo_open=True, allow=(-1,))
        stop = f.stop_list("stop", max_items=None, item_max=None, total_max=32768, str_max=32768)
    else:
        temperature = f.float("temperature", lo=0.0, hi=2.0)
        top_k = f.int("top_k", lo=0, hi=INT32_MAX)
        stop = f.stop_list("stop", max_items=1024, item_max=1024, total_max=32768, str_max=1024)
    values = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": f.float("top_p", lo=1e-6, hi=1.0, lo_open=True),
        "min_p": f.float("min_p", lo=0.0, hi=1.0),
        "presence_penalty": f.float("presence_penalty", lo=-2.0, hi=2.0),
        "frequency_penalty": f.float("frequency_penalty", lo=-2.0, hi=2.0),
        "repetition_penalty": f.float("repetition_penalty", lo=0.0, hi=2.0, lo_open=True),
    }
    prompt_only = not chat and f.raw("max_tokens") == 0 and bool(f.bool("echo", False))
    max_tokens = 1 if prompt_only else f.int("max_tokens", lo=0, hi=INT32_MAX, lo_open=True)
    if chat and max_tokens is None:
        max_tokens = f.int("max_completion_tokens", lo=0, hi=INT32_MAX, lo_open=True)
    n = f.int("n", 1, lo=1, hi=128) or 1
    stream = f.bool("stream", False) or False
    opts = Fields(f.raw("stream_options"), "stream_options.", nullable=True)
    include_usage = bool(opts.bool("include_usage", False))
    if chat:
        want = f.bool("logprobs", False)
        top = f.int("top_logprobs", None, lo=0, hi=20)
        if top is not None and not want:
            raise RequestError("top_logprobs requires logprobs to be true", field="top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = f.int("logprobs", None, lo=0, hi=20)
    sampling = build_sampling(
        host,
        values,
        None,  # do_sample is not part of the OpenAI APIs and is not validated (spec §4.1)
        seed=check_seed(f, "seed", zero_allowed=True),
        max_tokens=max_tokens,
        min_tokens=f.int("min_tokens", 0, lo=0, hi=INT32_MAX),
        stop=stop,
        stop_token_ids=f.int_list("stop_token_ids", allow_null_items=not vllm),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        ignore_eos=f.bool("ignore_eos", False),
        logprobs=logprobs,
    )
    sampling.logit_bias = parse_logit_bias(host, f.raw("logit_bias"))
    if not chat and logprobs is not None and f.bool("echo", False):
        sampling.prompt_logprobs = logprobs  # echo with logprobs scores every prompt token
    return ParsedRequest(model, sampling, n, stream, include_usage, logprobs, prompt_only)


def parse_logit_bias(host: Host, raw: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token id (a string key in JSON) to a bias in [-100, 100]."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError("logit_bias must be an object mapping token ids to numbers in [-100, 100]",
                           field="logit_bias")
    vocab = host.info.vocab_size if getattr(host, "info", None) is not None else None
    out: dict[int, float] = {}
    for key, value in raw.items():
        name = f"logit_bias.{key}"
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"logit_bias keys must be token ids, got {key!r}", field=name) from None
        if token < 0 or (vocab is not None and token >= vocab):
            limit = f"[0, {vocab - 1}]" if vocab is not None else ">= 0"
            raise RequestError(f"logit_bias key {key!r} must be a token id in {limit}", field=name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"{name} must be a number in [-100, 100], got {value!r}", field=name)
        out[token] = float(value)
    return out or None


def chat_messages(f: Fields) -> list[dict[str, Any]]:
    """Validate ``messages`` (roles, content, tool calls) and return them for the chat template."""
    messages = f.raw("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", field="messages")
    out: list[dict[str, Any]] = []
    total = 0
    for i, msg in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(f"{name} must be an object", field=name)
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(f"{name}.role must be one of {list(ROLES)}, got {role!r}", field=f"{name}.role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        content = msg.get("content")
        tool_calls = msg.get("tool_calls")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise RequestError(f"{name}.content[{j}] must be an object", field=f"{name}.content[{j}]")
                kind = part.get("type", "text")
                if kind in MEDIA_TYPES:  # a plugin's placeholder text, or a 422 (mindie_host.content)
                    parts.append(media_text(kind, part, f"{name}.content[{j}]"))
                    continue
                if kind != "text":
                    raise RequestError(
                        f"{name}.content[{j}].type {kind!r} is not supported by this text-only model",
                        field=f"{name}.content[{j}].type",
                    )
                text = part.get("text")
                if not isinstance(text, str):
                    raise RequestError(f"{name}.content[{j}].text must be a string",
                                       field=f"{name}.content[{j}].text")
                parts.append(text)
            content = "".join(parts)
        if content is None:
            if not (role == "assistant" and tool_calls):
                raise RequestError(f"{name}.content may be null only in an assistant message with tool_calls",
                                   field=f"{name}.content")
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"{name}.content must be a string or a list of parts", field=f"{name}.content")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise RequestError(f"{name}.tool_call_id is required when role is tool", field=f"{name}.tool_call_id")
        total += len(content)
        entry: dict[str, Any] = {"role": role, "content": content}
        thought = msg.get("reasoning_content")
        if thought is not None and role == "assistant":
            if not isinstance(thought, str):
                raise RequestError(f"{name}.reasoning_content must be a string", field=f"{name}.reasoning_content")
            entry["reasoning_content"] = thought  # Qwen3's template renders it back after the last user turn
        if tool_calls:
            entry["tool_calls"] = validate_tool_calls(tool_calls, f"{name}.tool_calls")
        if role == "tool":
            entry["tool_call_id"] = msg["tool_call_id"]
        out.append(entry)
    if total > 4 * 1024 * 1024:
        raise RequestError(f"messages total content must be at most 4 MB, got {total} characters", field="messages")
    return out


def validate_tool_calls(calls: Any, name: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (type function, name, JSON-string arguments)."""
    if not isinstance(calls, list):
        raise RequestError(f"{name} must be a list", field=name)
    for k, call in enumerate(calls):
        if isinstance(call, dict) and not isinstance(call.get("id"), str):
            raise RequestError(f"{name}[{k}].id must be a string", field=f"{name}[{k}].id")
        if isinstance(call, dict) and call.get("type", "function") != "function":
            raise RequestError(f"{name}[{k}].type must be 'function'", field=f"{name}[{k}].type")
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise RequestError(f"{name}[{k}].function needs string name and arguments", field=f"{name}[{k}].function")
    return calls


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
            profile = await offload(host, template_profile, host)  # probed once per template, off the event loop
            plan = plan_tools(host, f.raw("tools"), f.raw("tool_choice"),
                              parallel=f.bool("parallel_tool_calls", True) is not False)
            structured = parse_structured(body)
            if structured is not None and plan.constrained:
                raise RequestError(f"{structured.field} cannot be combined with a required or named tool_choice",
                                   field=structured.field, status=400)
            grammar = await offload(host, llg.compile_grammar, structured) if structured is not None else None
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
            grammar = await offload(host, llg.compile_grammar, structured) if structured is not None else None
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


def completion_prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    """``prompt`` as a string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        check_text_size(prompt, "prompt")
        return [(prompt, None)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            for i, p in enumerate(prompt):
                check_text_size(p, f"prompt[{i}]")
            return [(p, None) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [(None, list(prompt))]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [(None, list(p)) for p in prompt]
    raise RequestError("prompt must be a non-empty string, list of strings, or list of token ids", field="prompt")


@hookimpl
def mindie_host_add_routes(app: FastAPI, host: Host, plane: str) -> None:
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
