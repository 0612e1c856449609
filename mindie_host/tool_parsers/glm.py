"""GLM-4 calls: the function's name on the first line of the answer, its JSON arguments after it.

Both GLM-4 generations write a call as an assistant turn whose ``metadata`` is the function's name
and whose content is the arguments (``<|assistant|>get_weather\\n{"city": "Paris"}``), and a result
as an ``<|observation|>`` turn. glm-4-9b-chat(-hf)'s template reads the tools from a message's
``tools`` key; GLM-4-0414's from the ``tools`` argument. An ordinary answer starts with a newline
after ``<|assistant|>``, so a call is recognised only when the whole answer is ``name\\n{...}``
(several in a row for parallel calls) naming one of the offered tools.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from .base import ToolParser, arguments_object, arguments_text, make_call

if TYPE_CHECKING:
    from ..chat_template import TemplateProfile

_NAME = re.compile(r"([\w.\-]+)[ \t]*\n\s*")
_GAP = re.compile(r"\s*(?:<\|assistant\|>)?")
_PARTIAL_NAME = re.compile(r"[\w.\-]*[ \t]*")


class GlmToolParser(ToolParser):
    """``name\\n{arguments}`` answers (GLM-4, glm and glm4 architectures)."""

    name = "glm4"

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        decoder = json.JSONDecoder()
        calls: list[dict[str, Any]] = []
        end = len(text.rstrip())
        pos = 0
        while pos < end:
            if calls:
                pos = _GAP.match(text, pos).end()  # type: ignore[union-attr]
            m = _NAME.match(text, pos)
            if m is None:
                return None
            try:
                value, pos = decoder.raw_decode(text, m.end())
            except ValueError:
                return None
            args = arguments_object(value)
            if args is None:
                return None
            calls.append(make_call(m.group(1), args, self.call_id()))
        return calls or None

    def parse_calls(self, text: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        calls = self.parse(text)
        names = {t["function"]["name"] for t in tools}
        return calls if calls and all(c["function"]["name"] in names for c in calls) else None

    def might_be_call(self, prefix: str) -> bool:
        if not prefix:
            return True
        first, newline, rest = prefix.partition("\n")
        if not _PARTIAL_NAME.fullmatch(first) or not first.strip():
            return not newline and not first  # an answer's leading newline or space: ordinary text
        return not newline or not rest.strip() or rest.lstrip().startswith("{")

    def example(self) -> str:
        return "<function name>\n<JSON object of arguments> (the name alone on the first line)"

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"{c.get('function', {}).get('name')}\n{arguments_text(c.get('function', {}).get('arguments'))}"
            for c in calls
        )

    def shape_history(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, profile: TemplateProfile
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out: list[dict[str, Any]] = []
        for msg in messages:
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                if msg.get("content"):
                    out.append({"role": "assistant", "content": msg["content"]})
                for call in msg["tool_calls"]:
                    fn = call.get("function", {})
                    out.append(
                        {
                            "role": "assistant",
                            "metadata": fn.get("name", ""),
                            "content": arguments_text(fn.get("arguments")),
                        }
                    )
            elif msg.get("role") == "tool":
                out.append({"role": "observation", "content": msg.get("content", "")})
            else:
                out.append(msg)
        if tools and not profile.renders_tools and "['tools']" in profile.template:
            # glm-4-9b-chat: the tools travel in the first message's ``tools`` key (a system turn)
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "tools": tools}
            else:
                out.insert(0, {"role": "system", "content": "", "tools": tools})
            return out, None
        return out, tools
