"""DeepSeek-V3 / R1 calls, written with the tokenizer's tool-call tokens.

The chat templates of DeepSeek-V3 and DeepSeek-R1 (``tests/fixtures/chat_templates``) write a call as::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

with any text before the first token being the answer's content. DeepSeek-V3.1 drops the type and the
fence (``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``); both read.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolParser, arguments_object, json_values, make_call

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*(?:```)?\s*$", re.DOTALL)


class DeepSeekToolParser(ToolParser):
    """DeepSeek-V3 / R1 (and V3.1) tool-call tokens."""

    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALL_BEGIN)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        if CALL_BEGIN not in text:
            return None
        calls = []
        for piece in text.split(CALL_BEGIN)[1:]:
            body = piece.split(CALL_END, 1)[0]
            call = self._call(body.replace(CALLS_END, ""))
            if call is not None:
                calls.append(call)
        return calls or None

    def _call(self, body: str) -> dict[str, Any] | None:
        head, sep, rest = body.partition(SEP)
        if not sep:
            return None
        if head.strip() in ("function", ""):  # V3 / R1: type, then the name and a fenced JSON object
            name, _, args_text = rest.partition("\n")
        else:  # V3.1: the name, then the JSON object
            name, args_text = head, rest
        fenced = _FENCE.match(args_text)
        values = json_values(fenced.group(1) if fenced else args_text)
        args = arguments_object(values[0]) if values else None
        name = name.strip()
        if not name or args is None:
            return None
        return make_call(name, args, self.call_id())

    def example(self) -> str:
        return (
            f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<function name>\n```json\n<JSON object of arguments>\n```"
            f"{CALL_END}{CALLS_END} (one {CALL_BEGIN}...{CALL_END} per call)"
        )

    def render(self, calls: list[dict[str, Any]]) -> str:
        parts = []
        for call in calls:
            fn = call.get("function", {})
            args = arguments_object(fn.get("arguments") or "{}")
            text = json.dumps(args, ensure_ascii=False) if args is not None else str(fn.get("arguments"))
            parts.append(f"{CALL_BEGIN}function{SEP}{fn.get('name')}\n```json\n{text}\n```{CALL_END}")
        return CALLS_BEGIN + "\n".join(parts) + CALLS_END
