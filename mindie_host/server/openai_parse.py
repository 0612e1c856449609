"""Parsing OpenAI request bodies: ``/v1/chat/completions`` and ``/v1/completions`` into sampling and prompts.

``ServerConfig.openAiSupport`` picks the chat variant (spec §4.2.3 / §4.2.4):
``"vllm"`` (the default) accepts ``null`` for optional fields, ``temperature >= 0``
with no upper bound and ``top_k = -1``; any other value is the plain variant
(``temperature`` in [0, 2], ``top_k`` in [0, 2^31-1], no nulls). A field this server does not
implement gets a 400 naming it (:data:`UNSUPPORTED_CHAT`). Every problem is a
:class:`~mindie_host.engine.request.RequestError` naming the field; :mod:`.openai` serves the
endpoints and renders the answers.

This module has no hook implementations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..content import MEDIA_TYPES, media_text
from ..engine.request import RequestError, SamplingParams
from .params import build_sampling
from .validation import INT32_MAX, Fields, check_seed, check_text_size

if TYPE_CHECKING:
    from ..host_protocol import Host

ROLES = ("system", "developer", "user", "assistant", "tool")


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
