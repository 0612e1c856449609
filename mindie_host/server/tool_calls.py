"""Function calling on the OpenAI chat endpoint: ``tools``/``tool_choice``, prompting, reading the answer.

The per-model parsers live in :mod:`mindie_host.tool_parsers`; the builtin answer
to the ``mindie_host_tool_call_parser`` hook is here (``trylast``, so any plugin
wins). A named ``tool_choice`` (and ``required``) is decoded under a grammar from
:mod:`mindie_host.structured`, so it always yields a valid call.
``parallel_tool_calls`` (default true) lets one turn carry several calls; when it
is false only the first call is returned. A named ``tool_choice`` is exactly one
call of that function (as OpenAI does); ``required`` is decoded as exactly one call
of one of the tools (vLLM's grammar allows a list; here a forced turn carries one
call, and the model may call again in the next turn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import hookimpl
from ..engine.request import RequestError
from ..structured.json_grammar import DEFAULT_MAX_STRING, JsonConstraint, within_subset
from ..structured.llg import GrammarConstraint, bounded
from ..structured.spec import StructuredSpec
from ..structured.vocab import vocab_for
from ..tool_parsers import (
    HermesToolParser,
    JsonToolParser,
    ParserAdapter,
    ToolParser,
    builtin_parser,
    call_from_obj,
    make_call,
    new_call_id,
)

if TYPE_CHECKING:
    from ..host import Host

__all__ = [
    "HermesToolParser", "JsonToolParser", "ToolParser", "ToolPlan", "ToolStream", "builtin_parser", "make_call",
    "plan_tools", "validate_tools", "vocab_for",
]


@hookimpl(trylast=True)
def mindie_host_tool_call_parser(model_type: str, host: Host) -> ToolParser:
    return builtin_parser(model_type)


# =============================================================================================
# the chat endpoint's side: validating tools/tool_choice, prompting, and reading the answer
# =============================================================================================
TOOL_CHOICES = ("none", "auto", "required")


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` (spec §4.2.3): a list of ``{"type": "function", "function": {name, description, parameters, strict}}``."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of tool objects", field="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object", field=where)
        if tool.get("type") != "function":
            raise RequestError(f"{where}.type must be 'function', got {tool.get('type')!r}", field=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", field=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name must be a non-empty string", field=f"{where}.function.name")
        if name in names:
            raise RequestError(f"{where}.function.name {name!r} is not unique", field=f"{where}.function.name")
        names.add(name)
        for key, kind in (("description", str), ("strict", bool)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise RequestError(f"{where}.function.{key} must be a {kind.__name__}", field=f"{where}.function.{key}")
        params = fn.get("parameters")
        if params is None:
            continue
        pw = f"{where}.function.parameters"
        if not isinstance(params, dict):
            raise RequestError(f"{pw} must be a JSON Schema object", field=pw)
        if params.get("type", "object") != "object":
            raise RequestError(f"{pw}.type must be 'object', got {params.get('type')!r}", field=f"{pw}.type")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise RequestError(f"{pw}.properties must be an object of schemas", field=f"{pw}.properties")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise RequestError(f"{pw}.required must be a list of strings", field=f"{pw}.required")
        missing = [r for r in required if r not in props]
        if missing:
            raise RequestError(f"{pw}.required names unknown properties {missing}", field=f"{pw}.required")
        extra = params.get("additionalProperties")
        if extra is not None and not isinstance(extra, (bool, dict)):
            raise RequestError(f"{pw}.additionalProperties must be a boolean", field=f"{pw}.additionalProperties")
    return tools


@dataclass
class ToolPlan:
    """What a chat request asked of its tools, and how to turn the output into ``tool_calls``.

    ``mode`` is ``none``, ``auto``, ``required`` or ``named`` (``function`` names the tool).
    """

    mode: str
    tools: list[dict[str, Any]]
    parser: ToolParser
    function: str | None = None
    #: ``parallel_tool_calls``: several calls may come back from one turn (only the first when false)
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def constrained(self) -> bool:
        return self.mode in ("named", "required")

    def offered(self) -> list[dict[str, Any]]:
        """The tools the model is told about."""
        if self.mode == "named":
            return [t for t in self.tools if t["function"]["name"] == self.function]
        return self.tools if self.active else []

    def prepare(self, messages: list[dict[str, Any]], template: str) -> tuple[list[dict[str, Any]], Any]:
        """Messages and ``tools`` for the chat template.

        A template that renders ``tools`` / ``tool_calls`` itself gets them; for one that
        does not (SmolLM2's), the tools go into the system prompt and past calls into the
        assistant text, in the parser's format, so the model sees both.
        """
        offered = self.offered()
        knows_tools = "tools" in template
        knows_calls = "tool_calls" in template
        out = []
        for msg in messages:
            if msg.get("tool_calls") and not knows_calls:
                text = self.parser.render(msg["tool_calls"])
                msg = {**msg, "content": (msg.get("content") + "\n" if msg.get("content") else "") + text}
                msg.pop("tool_calls")
            out.append(msg)
        if offered and not knows_tools:
            note = self.parser.instructions(offered)
            if self.mode == "named":
                note += f"\nCall the function {self.function} now."
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
            return out, None
        return out, (offered or None)

    def constraint(self, host: Host) -> JsonConstraint | GrammarConstraint | None:
        """A fresh logits constraint for one generated choice (``None`` when unconstrained).

        The builtin decoder serves schemas within its subset: it bounds strings (64 characters),
        numbers (15 digits) and arrays (8 items), so even a random or greedy model ends its call.
        Any other schema goes to llguidance, which enforces all of it, with free strings bounded
        and objects closed (JSON Schema cannot bound a number's digits, so numbers there are not).
        """
        if self.mode not in ("named", "required"):
            return None
        offered = self.offered()
        schemas = [t["function"].get("parameters") or {"type": "object", "properties": {}} for t in offered]
        if all(within_subset(s) for s in schemas):
            if self.mode == "named":
                return JsonConstraint.for_schema(host, schemas[0])
            return JsonConstraint.for_tools(host, offered)
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]}, "arguments": s}}
                 for t, s in zip(offered, schemas)]
        schema = bounded(schemas[0] if self.mode == "named" else {"anyOf": calls}, DEFAULT_MAX_STRING)
        return GrammarConstraint.for_spec(host, StructuredSpec("json", schema, "tools"))

    def finish(self, text: str, finish_reason: str) -> tuple[str, list[dict[str, Any]] | None, str]:
        """``(content, tool_calls, finish_reason)`` for a complete output."""
        if not self.active:
            return text, None, finish_reason
        calls: list[dict[str, Any]] | None = None
        if self.mode == "named":
            try:
                args = json.loads(text)
            except ValueError:
                args = None
            if isinstance(args, dict):
                calls = [make_call(self.function or "", text)]
        elif self.mode == "required":
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            found = [call_from_obj(o) for o in (obj if isinstance(obj, list) else [obj])]
            calls = found if found and all(found) else None  # type: ignore[assignment]
        else:
            calls = self.parser.parse(text)
        if not calls:
            return text, None, finish_reason
        if not self.parallel:
            calls = calls[:1]
        content = self.parser.content(text) if self.mode == "auto" else ""
        return content, calls, "tool_calls"


def plan_tools(host: Host, tools_raw: Any, choice: Any, parallel: bool = True) -> ToolPlan:
    """Validate ``tools`` and ``tool_choice`` and pick the model family's parser."""
    plan = _plan_tools(host, tools_raw, choice)
    plan.parallel = parallel
    return plan


def _plan_tools(host: Host, tools_raw: Any, choice: Any) -> ToolPlan:
    tools = validate_tools(tools_raw) if tools_raw is not None else []
    parser = host.caches.tool_parser
    if parser is None:
        model_type = host.info.model_type if host.info is not None else "llama"
        parser = host.plugins.hook.mindie_host_tool_call_parser(model_type=model_type, host=host)
        if parser is None:
            parser = builtin_parser(model_type)
        elif not isinstance(parser, ToolParser):
            parser = ParserAdapter(parser)
        host.caches.tool_parser = parser
    if choice is None:
        return ToolPlan("auto" if tools else "none", tools, parser)
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestError(f"tool_choice must be one of {list(TOOL_CHOICES)} or a function object, got {choice!r}",
                               field="tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice 'required' needs a non-empty tools list", field="tool_choice")
        return ToolPlan(choice, tools, parser)
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError('tool_choice object must be {"type": "function", "function": {"name": ...}}',
                               field="tool_choice")
        name = fn["name"]
        if name not in {t["function"]["name"] for t in tools}:
            raise RequestError(f"tool_choice.function.name {name!r} is not one of the tools",
                               field="tool_choice.function.name")
        return ToolPlan("named", tools, parser, name)
    raise RequestError("tool_choice must be a string or an object", field="tool_choice")


class ToolStream:
    """Turns one choice's streamed text into chat-chunk deltas, with ``tool_calls`` where there are calls.

    Named tool choice streams the arguments as they are generated. Otherwise
    text that may be the start of a call is held back until it is clear; at the
    end, held text becomes ``tool_calls`` (parsed) or content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.held = ""
        self.streaming = not plan.active  # plain content from here on
        self.call_id = new_call_id()
        self.started = False

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        """Deltas for ``new_text`` (not the last piece)."""
        if self.streaming:
            return [{"content": new_text}] if new_text else []
        if self.plan.mode == "named":
            if not new_text:
                return []
            return [{"tool_calls": [self._call_delta(new_text)]}]
        self.held += new_text
        if self.plan.mode == "auto" and not self.plan.parser.might_be_call(self.held):
            self.streaming = True
            text, self.held = self.held, ""
            return [{"content": text}]
        return []

    def _call_delta(self, args: str) -> dict[str, Any]:
        if self.started:
            return {"index": 0, "function": {"arguments": args}}
        self.started = True
        return {"index": 0, "id": self.call_id, "type": "function",
                "function": {"name": self.plan.function, "arguments": args}}

    def finish(self, new_text: str, full_text: str, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """Deltas for the last piece, and the choice's finish reason."""
        if self.streaming:
            return ([{"content": new_text}] if new_text else []), finish_reason
        if self.plan.mode == "named":
            deltas = self.feed(new_text)
            _, calls, reason = self.plan.finish(full_text, finish_reason)
            if calls and not self.started:
                deltas.append({"tool_calls": [self._call_delta("")]})
            return deltas, reason
        self.held += new_text
        content, calls, reason = self.plan.finish(self.held, finish_reason)
        deltas: list[dict[str, Any]] = []
        if content:
            deltas.append({"content": content})
        if calls:
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        return deltas, reason
