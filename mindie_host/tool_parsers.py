"""Tool-call parsers per model family: generated text to OpenAI ``tool_calls``.

The parser is chosen by model family through the firstresult hook
``mindie_host_tool_call_parser(model_type, host)`` (the builtin answer lives in
:mod:`mindie_host.server.tool_calls` and comes last, so any plugin wins).
:class:`HermesToolParser` reads ``<tool_call>{json}</tool_call>`` blocks (Qwen,
Hermes), :class:`JsonToolParser` reads a bare JSON object or list (Llama, SmolLM).
Several calls in one answer (parallel tool calls) come back as several entries.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from typing import Any

HERMES_FAMILIES = ("qwen", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "hermes", "mistral")


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` is encoded as a JSON string if it is not one."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {},
                                                                   ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def call_from_obj(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return make_call(name, args)


def _json_values(text: str) -> list[Any]:
    """Every top-level JSON object or array that appears in ``text``, in order."""
    decoder = json.JSONDecoder()
    out = []
    i = 0
    while i < len(text):
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            break
        try:
            value, end = decoder.raw_decode(text, j)
        except ValueError:
            i = j + 1
            continue
        out.append(value)
        i = end
    return out


class ToolParser(abc.ABC):
    """Base tool-call parser: subclasses set the text format a model family uses.

    ``parse(text)`` returns OpenAI ``tool_calls`` or ``None``; ``content(text)``
    is the text left once the calls are removed; ``might_be_call(prefix)`` tells
    a stream whether to hold text back; ``instructions(tools)`` is the system
    prompt used when the model's chat template does not render ``tools``;
    ``render(calls)`` writes past calls back as assistant text.
    """

    name = "base"

    @abc.abstractmethod
    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI ``tool_calls`` found in ``text``, or None."""

    def content(self, text: str) -> str:
        return ""

    @abc.abstractmethod
    def might_be_call(self, prefix: str) -> bool:
        """Whether streamed text starting with ``prefix`` could still turn into a call."""

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return (
            "You can call functions. The available functions are:\n" + specs + "\n"
            "To call a function, answer only with " + self.example() + ". Otherwise answer normally."
        )

    def example(self) -> str:
        return '{"name": <function name>, "arguments": <JSON object of arguments>}'

    def render(self, calls: list[dict[str, Any]]) -> str:
        parts = []
        for call in calls:
            fn = call.get("function", {})
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                args = fn.get("arguments")
            parts.append(json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False))
        return "\n".join(parts)


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2/3, Hermes)."""

    name = "hermes"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        if "<tool_call>" not in text:
            return None
        calls = []
        for body in self._block.findall(text):
            for value in _json_values(body):
                call = call_from_obj(value)
                if call is not None:
                    calls.append(call)
        return calls or None

    def content(self, text: str) -> str:
        return text.split("<tool_call>", 1)[0].strip()

    def might_be_call(self, prefix: str) -> bool:
        stripped = prefix.lstrip()
        return "<tool_call>".startswith(stripped) or stripped.startswith("<tool_call>")

    def example(self) -> str:
        return '<tool_call>{"name": <function name>, "arguments": <JSON object of arguments>}</tool_call>'

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>{line}</tool_call>" for line in super().render(calls).splitlines())


class JsonToolParser(ToolParser):
    """A bare JSON call, a list of calls, or either in a Markdown code fence (Llama 3, SmolLM)."""

    name = "json"
    _fence = re.compile(r"^```(?:json)?\s*(.*?)\s*(?:```)?\s*$", re.DOTALL)

    def _body(self, text: str) -> str:
        s = text.strip()
        m = self._fence.match(s)
        return m.group(1) if m else s

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        body = self._body(text)
        if not body.startswith(("{", "[")):
            return None
        calls = []
        for value in _json_values(body):
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = call_from_obj(item)
                if call is None:
                    return None
                calls.append(call)
        return calls or None

    def might_be_call(self, prefix: str) -> bool:
        s = prefix.lstrip()
        return not s or s.startswith(("{", "[")) or "```".startswith(s[:3]) or s.startswith("```")


class ParserAdapter(JsonToolParser):
    """Wraps a plugin's parser that only has ``parse(text)``; the rest comes from :class:`JsonToolParser`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", type(inner).__name__)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        return self.inner.parse(text)

    def content(self, text: str) -> str:
        return self.inner.content(text) if hasattr(self.inner, "content") else ""

    def might_be_call(self, prefix: str) -> bool:
        return self.inner.might_be_call(prefix) if hasattr(self.inner, "might_be_call") else True


def builtin_parser(model_type: str) -> ToolParser:
    """The builtin parser for a model family."""
    family = (model_type or "").lower()
    if family.startswith(HERMES_FAMILIES):
        return HermesToolParser()
    return JsonToolParser()
