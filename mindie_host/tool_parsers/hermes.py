"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes)."""

from __future__ import annotations

import re
from typing import Any

from .base import ToolParser, call_from_obj, json_values


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any text before them being content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        if "<tool_call>" not in text:
            return None
        calls = []
        for body in self._block.findall(text):
            for value in json_values(body):
                call = call_from_obj(value, self.call_id())
                if call is not None:
                    calls.append(call)
        return calls or None

    def example(self) -> str:
        return '<tool_call>{"name": <function name>, "arguments": <JSON object of arguments>}</tool_call>'

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>{line}</tool_call>" for line in super().render(calls).splitlines())
