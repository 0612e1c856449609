"""Mistral calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral-7B-v0.3, Nemo, Mixtral-8x22B).

Mistral's templates (``mistral_nemo.jinja`` in the test fixtures) refuse call ids that are not nine
alphanumeric characters and write the arguments as a JSON object, so the history is reshaped before
rendering: ids become nine characters (the same mapping for a call and its result) and string
arguments are decoded. Newer Mistral tokenizers write ``[TOOL_CALLS]name[ARGS]{...}``; both read.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from typing import TYPE_CHECKING, Any

from .base import ToolParser, arguments_object, json_values, make_call

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
if TYPE_CHECKING:
    from ..chat_template import TemplateProfile

_ALNUM = string.ascii_letters + string.digits


def mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates accept it: nine alphanumeric characters, the same for the same id."""
    if len(call_id) == 9 and call_id.isalnum() and call_id.isascii():
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list of calls (or ``name[ARGS]{...}`` pieces)."""

    name = "mistral"
    markers = (TOOL_CALLS,)

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        if TOOL_CALLS not in text:
            return None
        calls: list[dict[str, Any]] = []
        for piece in text.split(TOOL_CALLS)[1:]:
            piece = piece.strip()
            if ARGS in piece:  # name[ARGS]{...}
                name, _, rest = piece.partition(ARGS)
                values = json_values(rest)
                args = arguments_object(values[0]) if values else None
                if name.strip() and args is not None:
                    calls.append(make_call(name.strip(), args, self.call_id()))
                continue
            for value in json_values(piece)[:1]:
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, dict) and isinstance(item.get("name"), str):
                        args = arguments_object(item.get("arguments", {}))
                        if args is not None:
                            calls.append(make_call(item["name"], args, self.call_id()))
        return calls or None

    def call_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def example(self) -> str:
        return f'{TOOL_CALLS}[{{"name": <function name>, "arguments": <JSON object of arguments>}}, ...]'

    def render(self, calls: list[dict[str, Any]]) -> str:
        items = []
        for call in calls:
            fn = call.get("function", {})
            args = arguments_object(fn.get("arguments") or "{}")
            items.append({"name": fn.get("name"), "arguments": args if args is not None else fn.get("arguments")})
        return TOOL_CALLS + json.dumps(items, ensure_ascii=False)

    def shape_history(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, profile: TemplateProfile
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        out = []
        for msg in messages:
            if msg.get("tool_calls"):
                calls = []
                for call in msg["tool_calls"]:
                    fn = call.get("function", {})
                    args = arguments_object(fn.get("arguments") or "{}")
                    calls.append(
                        {
                            **call,
                            "id": mistral_id(call.get("id", "")),
                            "function": {**fn, "arguments": args if args is not None else fn.get("arguments")},
                        }
                    )
                msg = {**msg, "tool_calls": calls}
            elif msg.get("role") == "tool" and isinstance(msg.get("tool_call_id"), str):
                msg = {**msg, "tool_call_id": mistral_id(msg["tool_call_id"])}
            out.append(msg)
        return out, tools
