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
from ..chat_template import TemplateProfile, template_profile
from ..engine.request import RequestError
from ..host_state import CacheSlot
from ..structured.json_grammar import DEFAULT_MAX_STRING, JsonConstraint, within_subset
from ..structured.llg import GrammarConstraint, bounded
from ..structured.spec import StructuredSpec
from ..structured.vocab import vocab_for
from ..tool_parsers import (
    HermesToolParser,
    JsonToolParser,
    ParserAdapter,
    ToolParser,
    arguments_object,
    builtin_parser,
    call_from_obj,
    make_call,
    new_call_id,
)
from ..tool_parsers.base import first_marker, partial_marker

if TYPE_CHECKING:
    from ..context import HostContext
    from ..host_protocol import Host

__all__ = [
    "HermesToolParser", "JsonToolParser", "ToolParser", "ToolPlan", "ToolStream", "builtin_parser", "make_call",
    "plan_tools", "validate_tools", "vocab_for",
]


@hookimpl(trylast=True)
def mindie_host_tool_call_parser(ctx: HostContext, model_type: str) -> ToolParser:
    """The format the model's chat template writes calls in, else ``model_type``'s family's, else bare JSON."""
    return builtin_parser(model_type, template_profile(ctx.host).template if ctx.host is not None else "")


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

    def prepare(self, messages: list[dict[str, Any]],
                profile: TemplateProfile) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and ``tools`` for the chat template, in the shape it renders.

        The family's parser first reshapes the history its template reads in its own way
        (:meth:`ToolParser.shape_history`: GLM-4's ``observation`` turns, Mistral's call ids).
        Then, for a template that does not render something (``profile``), it goes where the
        model still sees it: past calls into the assistant text in the parser's format, tool
        results into a user turn, the offered tools (and the call format) into the system prompt.
        """
        offered = self.offered()
        messages, tools = self.parser.shape_history(messages, offered or None, profile)
        names = {c.get("id"): c.get("function", {}).get("name") for m in messages for c in m.get("tool_calls") or []}
        out: list[dict[str, Any]] = []
        for msg in messages:
            if msg.get("tool_calls"):
                calls = [self._call_for(c, profile) for c in msg["tool_calls"]]
                content = msg.get("content") or ""
                if not profile.renders_calls:
                    msg = {k: v for k, v in msg.items() if k != "tool_calls"}
                    msg["content"] = (content + "\n" if content else "") + self.parser.render(calls)
                elif content and profile.calls_content is None:  # DeepSeek-V3: calls render only without content
                    out.append({"role": "assistant", "content": content})
                    msg = {**msg, "content": None, "tool_calls": calls}
                else:
                    msg = {**msg, "content": content or profile.calls_content, "tool_calls": calls}
            elif msg.get("role") == "tool" and not profile.renders_tool_role:
                name = names.get(msg.get("tool_call_id"))
                msg = {"role": "user", "content": f"The function {name} returned: {msg.get('content', '')}" if name
                       else f"A function returned: {msg.get('content', '')}"}
            out.append(msg)
        if tools and not profile.renders_tools:
            note = self.parser.instructions(tools)
            if self.mode == "named":
                note += f"\nCall the function {self.function} now."
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
            else:
                out.insert(0, {"role": "system", "content": note})
            tools = None
        return out, tools

    @staticmethod
    def _call_for(call: dict[str, Any], profile: TemplateProfile) -> dict[str, Any]:
        """A past call with its arguments as the template wants them (a dict or the JSON text)."""
        fn = call.get("function", {})
        args = fn.get("arguments")
        if profile.call_arguments == "object":
            decoded = arguments_object(args)
            args = decoded if decoded is not None else args
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        return {"type": "function", **call, "function": {**fn, "arguments": args}}

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
            calls = self.parser.parse_calls(text, self.offered())
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


#: the tool-call parser of the model family, per host
TOOL_PARSER: CacheSlot[ToolParser] = CacheSlot("tool-call parser")


def _model_parser(host: Host) -> ToolParser:
    """A plugin's parser for the model family (``mindie_host_tool_call_parser``), else the builtin one."""
    model_type = host.info.model_type if host.info is not None else "llama"
    parser = host.plugins.hook.mindie_host_tool_call_parser(model_type=model_type)
    if parser is None:
        return builtin_parser(model_type)
    return parser if isinstance(parser, ToolParser) else ParserAdapter(parser)


def _plan_tools(host: Host, tools_raw: Any, choice: Any) -> ToolPlan:
    tools = validate_tools(tools_raw) if tools_raw is not None else []
    parser = host.caches.get_or_make(TOOL_PARSER, lambda: _model_parser(host))
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
    """Turns one choice's streamed content into chat-chunk deltas, with ``tool_calls`` where there are calls.

    Named tool choice streams the arguments as they are generated. For a format whose calls
    follow a marker, text before the marker streams as content (a possible partial marker and
    trailing spaces are held until the next piece); everything from the marker on is held and
    parsed at the end. For a format without a marker, text that may be the start of a call is
    held back until it is clear; at the end, held text becomes ``tool_calls`` or content. The
    content deltas joined equal the non-streamed ``content``.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # all content fed so far
        self.sent = 0  # how much of it went out as content
        self.in_calls = False  # a marker was seen
        self.streaming = not plan.active  # plain content from here on
        self.call_id = new_call_id()
        self.started = False

    @property
    def markers(self) -> tuple[str, ...]:
        return self.plan.parser.markers if self.plan.mode == "auto" else ()

    def _flush(self, upto: int) -> list[dict[str, Any]]:
        if upto <= self.sent:
            return []
        piece, self.sent = self.text[self.sent:upto], upto
        return [{"content": piece}]

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        """Deltas for ``new_text`` (not the last piece)."""
        self.text += new_text
        if self.streaming:
            return self._flush(len(self.text))
        if self.plan.mode == "named":
            return [{"tool_calls": [self._call_delta(new_text)]}] if new_text else []
        if self.markers:
            if self.in_calls:
                return []
            i = first_marker(self.text, self.markers)
            if i >= 0:
                self.in_calls = True
                return self._flush(len(self.text[:i].rstrip()))
            upto = len(self.text) - partial_marker(self.text, self.markers)
            return self._flush(len(self.text[:upto].rstrip()))
        if self.plan.mode == "auto" and not self.plan.parser.might_be_call(self.text):
            self.streaming = True
            return self._flush(len(self.text))
        return []

    def _call_delta(self, args: str) -> dict[str, Any]:
        if self.started:
            return {"index": 0, "function": {"arguments": args}}
        self.started = True
        return {"index": 0, "id": self.call_id, "type": "function",
                "function": {"name": self.plan.function, "arguments": args}}

    def finish(self, new_text: str, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """Deltas for the last piece, and the choice's finish reason."""
        if self.streaming:
            self.text += new_text
            return self._flush(len(self.text)), finish_reason
        if self.plan.mode == "named":
            deltas = self.feed(new_text)
            _, calls, reason = self.plan.finish(self.text, finish_reason)
            if calls and not self.started:
                deltas.append({"tool_calls": [self._call_delta("")]})
            return deltas, reason
        self.text += new_text
        content, calls, reason = self.plan.finish(self.text, finish_reason)
        if self.markers:
            deltas = self._flush(len(content) if calls else len(self.text))
        else:
            deltas = [{"content": content}] if content else []
        if calls:
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        return deltas, reason
