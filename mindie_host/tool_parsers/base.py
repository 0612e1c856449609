"""What every tool-call parser shares: the OpenAI ``tool_calls`` entry, JSON scanning, the base class."""

from __future__ import annotations

import abc
import json
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..chat_template import TemplateProfile


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(arguments: Any) -> str:
    """``arguments`` as the JSON string OpenAI puts in ``function.arguments``."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def make_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """One OpenAI ``tool_calls`` entry; ``arguments`` is encoded as a JSON string if it is not one."""
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments_text(arguments)},
    }


def arguments_object(arguments: Any) -> dict[str, Any] | None:
    """A call's arguments as a dict (a JSON string is decoded), or None if they are not an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def call_from_obj(obj: Any, call_id: str | None = None) -> dict[str, Any] | None:
    """A ``tool_calls`` entry from ``{"name", "arguments"}`` (or OpenAI's ``{"function": {...}}``), or None."""
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = arguments_object(fn.get("arguments", fn.get("parameters", {})))
    if args is None:
        return None
    return make_call(name, args, call_id)


def json_values(text: str) -> list[Any]:
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


def first_marker(text: str, markers: tuple[str, ...]) -> int:
    """Where the first of ``markers`` starts in ``text`` (-1 if none does)."""
    return min((i for i in (text.find(m) for m in markers) if i >= 0), default=-1)


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of a marker (0 if none)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ToolParser(abc.ABC):
    """Base tool-call parser: subclasses set the text format a model family writes its calls in.

    ``parse(text)`` returns OpenAI ``tool_calls`` or ``None``; ``content(text)``
    is the text left once the calls are removed; ``might_be_call(prefix)`` tells
    a stream whether to hold text back; ``instructions(tools)`` is the system
    prompt used when the model's chat template does not render ``tools``;
    ``render(calls)`` writes past calls back as assistant text when the template
    does not render ``tool_calls``.

    A format whose calls follow a marker (``<tool_call>``, ``[TOOL_CALLS]``, DeepSeek's
    ``<｜tool▁calls▁begin｜>``) lists it in ``markers``: text before the marker is the
    answer's content and streams as it comes, everything from the marker on is held
    and parsed at the end. A format without one (a bare JSON call, GLM-4's
    ``name\\n{...}``) is a call only if the whole answer is; ``might_be_call`` decides
    how long a stream holds its start back.
    """

    name = "base"
    #: strings that open the calls (empty: the whole answer is either a call or text)
    markers: tuple[str, ...] = ()

    @abc.abstractmethod
    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI ``tool_calls`` found in ``text``, or None."""

    def parse_calls(self, text: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """The calls in ``text`` given the offered ``tools`` (a format without a marker only counts calls of them)."""
        return self.parse(text)

    def content(self, text: str) -> str:
        """The answer's text beside its calls: what comes before the first marker, without trailing space."""
        if not self.markers:
            return ""
        i = first_marker(text, self.markers)
        return (text if i < 0 else text[:i]).rstrip()

    def might_be_call(self, prefix: str) -> bool:
        """Whether streamed text starting with ``prefix`` could still turn into a call (formats without a marker)."""
        s = prefix.lstrip()
        return any(m.startswith(s) or s.startswith(m) for m in self.markers)

    def call_id(self) -> str:
        """A fresh id for a parsed call (Mistral's template wants its own shape)."""
        return new_call_id()

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        """The system prompt that offers ``tools`` when the chat template does not render them."""
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return (
            "You can call functions. The available functions are:\n" + specs + "\n"
            "To call a function, answer only with " + self.example() + ". Otherwise answer normally."
        )

    def example(self) -> str:
        """The call format, as the instructions show it."""
        return '{"name": <function name>, "arguments": <JSON object of arguments>}'

    def render(self, calls: list[dict[str, Any]]) -> str:
        """Past ``calls`` as assistant text, in this format."""
        parts = []
        for call in calls:
            fn = call.get("function", {})
            args = arguments_object(fn.get("arguments") or "{}")
            parts.append(
                json.dumps(
                    {"name": fn.get("name"), "arguments": args if args is not None else fn.get("arguments")},
                    ensure_ascii=False,
                )
            )
        return "\n".join(parts)

    def shape_history(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, profile: TemplateProfile
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and ``tools`` in the shape this family's own template reads (default: unchanged).

        GLM-4's templates read a call as an assistant turn with ``metadata`` and a result as an
        ``observation`` turn; Mistral's want nine-character call ids. ``profile`` says what the
        template renders; what a family does not take over here is fitted generically afterwards
        (:mod:`mindie_host.chat_template`).
        """
        return messages, tools
