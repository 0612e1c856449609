"""Bare JSON calls: an object, a list of them, or either in a Markdown code fence (Llama 3, SmolLM, Gemma, Phi-3)."""

from __future__ import annotations

import re
from typing import Any

from .base import ToolParser, call_from_obj, json_values


class JsonToolParser(ToolParser):
    """A bare JSON call, a list of calls, or either in a Markdown code fence: the whole answer is the call."""

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
        for value in json_values(body):
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = call_from_obj(item, self.call_id())
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
