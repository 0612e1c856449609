"""Chat messages in the shape the model's own chat template renders, and the template's own arguments.

Templates differ in what they accept, and many drop what they do not (Phi-3's ignores ``tool``
turns, DeepSeek-V3's renders a call only when the content is null, Gemma 3's refuses a ``tool``
turn and reads a system message only as content parts, Mistral's refuses consecutive user turns).
:func:`profile_of` finds out once per template, by rendering small probe conversations with it,
what it renders; :func:`fit_roles` then reshapes a request's messages so that nothing the client
sent is silently lost: a system message the template cannot take goes into the first user turn,
consecutive turns of one role are joined where the template refuses them. Tool calls and results
are fitted by :meth:`mindie_host.server.tool_calls.ToolPlan.prepare` with the same profile.

``chat_template_kwargs`` (vLLM's field) are the template's own variables, such as Qwen3's
``enable_thinking``: :func:`template_kwargs` accepts only the variables this template reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .engine.request import RequestError
from .host_state import CacheSlot

log = logging.getLogger("mindie_host.chat_template")

#: names the renderer itself passes to a template (a request may not set them through chat_template_kwargs)
PROVIDED = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "raise_exception",
        "strftime_now",
        "tokenize",
        "return_dict",
        "return_tensors",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
#: ``chat_template_kwargs`` whose values must be booleans
BOOLEAN_KWARGS = ("enable_thinking",)

_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "zqprobetool", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_PROBE_CALL = {"id": "zqprobe01", "type": "function", "function": {"name": "zqprobecall", "arguments": '{"a": 1}'}}
_PROBE_RESULT = {"role": "tool", "content": "zqproberesult", "tool_call_id": "zqprobe01"}


@dataclass(frozen=True)
class TemplateProfile:
    """What one chat template renders, found by rendering probe conversations with it."""

    #: the template's text
    template: str
    #: the ``tools`` argument shows up in the prompt
    renders_tools: bool
    #: an assistant turn's ``tool_calls`` show up in the prompt
    renders_calls: bool
    #: the content an assistant turn with calls must carry for its calls to render ("" or None)
    calls_content: str | None
    #: how a call's arguments must be given for the template to write them as JSON: ``"object"`` (a dict, which
    #: Qwen2.5's and Mistral's templates encode themselves) or ``"string"`` (DeepSeek's concatenate the text)
    call_arguments: str
    #: a ``tool`` turn's content shows up in the prompt
    renders_tool_role: bool
    #: how a system message renders: ``"text"``, ``"parts"`` (only as a list of text parts), ``"none"``
    system: str
    #: two user turns in a row are refused (the turns must alternate)
    alternates: bool
    #: the variables the template reads that a request may set (None: the template could not be parsed)
    variables: frozenset[str] | None

    @property
    def thinks(self) -> bool:
        """The template writes ``</think>``: the model reasons before it answers."""
        return "</think>" in self.template


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str | None:
    try:
        return str(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True))
    except Exception:  # a template refusing a probe is the answer
        return None


def _shows(
    tokenizer: Any, sentinel: str, *conversations: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> int:
    """The index of the first conversation whose rendering shows ``sentinel`` (-1 if none)."""
    for i, messages in enumerate(conversations):
        out = _render(tokenizer, messages, tools)
        if out is not None and sentinel in out:
            return i
    return -1


def _variables(tokenizer: Any, template: str) -> frozenset[str] | None:
    try:
        from jinja2 import meta, nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        ast = env.parse(template)
    except Exception:  # transformers-only tags ({% generation %}): the variables are unknown
        return None
    # jinja reports a name set inside a loop or a branch as read from outside too: those are the template's own
    assigned = {n.name for n in ast.find_all(nodes.Name) if n.ctx in ("store", "param")}
    special = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    return frozenset(meta.find_undeclared_variables(ast) - assigned - PROVIDED - special - set(env.globals))


def profile_of(tokenizer: Any) -> TemplateProfile:
    """Probe the tokenizer's chat template (a few renders of tiny conversations, milliseconds)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    user = {"role": "user", "content": "Hi"}
    renders_tools = _shows(tokenizer, "zqprobetool", [user], tools=[_PROBE_TOOL]) >= 0
    contents: tuple[str | None, ...] = ("", None)
    shapes = []
    for content in contents:
        call = {"role": "assistant", "content": content, "tool_calls": [_PROBE_CALL]}
        shapes += [[user, call, _PROBE_RESULT], [user, call, {"role": "user", "content": "ok"}], [user, call]]
    found = _shows(tokenizer, "zqprobecall", *shapes)
    renders_calls = found >= 0
    calls_content = contents[found // 3] if renders_calls else ""
    before = (
        {"role": "assistant", "content": calls_content, "tool_calls": [_PROBE_CALL]}
        if renders_calls
        else {"role": "assistant", "content": "ok"}
    )
    call_arguments = "string"
    if renders_calls:
        as_object = {**_PROBE_CALL, "function": {"name": "zqprobecall", "arguments": {"zqarg": "zqvalue"}}}
        call = {"role": "assistant", "content": calls_content, "tool_calls": [as_object]}
        conversation = shapes[found][:1] + [call] + shapes[found][2:]
        call_arguments = "object" if _shows(tokenizer, '"zqarg": "zqvalue"', conversation) >= 0 else "string"
    renders_tool_role = _shows(tokenizer, "zqproberesult", [user, before, _PROBE_RESULT]) >= 0
    system_text = {"role": "system", "content": "zqprobesystem"}
    system_parts = {"role": "system", "content": [{"type": "text", "text": "zqprobesystem"}]}
    which = _shows(tokenizer, "zqprobesystem", [system_text, user], [system_parts, user])
    system = ("text", "parts")[which] if which >= 0 else "none"
    alternates = _render(tokenizer, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) is None
    profile = TemplateProfile(
        template,
        renders_tools,
        renders_calls,
        calls_content,
        call_arguments,
        renders_tool_role,
        system,
        alternates,
        _variables(tokenizer, template),
    )
    log.info(
        "chat template renders: tools %s, tool calls %s, tool turns %s, system %s, alternating turns %s, variables %s",
        renders_tools,
        renders_calls,
        renders_tool_role,
        system,
        alternates,
        sorted(profile.variables) if profile.variables is not None else "unknown",
    )
    return profile


#: what the host's chat template renders, probed once per template
TEMPLATE_PROFILE: CacheSlot[TemplateProfile] = CacheSlot("chat template profile")


def template_profile(host: Any) -> TemplateProfile:
    """The profile of the host's tokenizer's chat template, computed once."""
    template = str(getattr(host.tokenizer, "chat_template", None) or "")
    profile = host.caches.get(TEMPLATE_PROFILE)
    if profile is None or profile.template != template:
        profile = profile_of(host.tokenizer)
        host.caches.put(TEMPLATE_PROFILE, profile)
    return profile


def template_kwargs(raw: Any, profile: TemplateProfile) -> dict[str, Any]:
    """``chat_template_kwargs``: an object of variables this template reads (a 422 naming the key otherwise)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RequestError(
            "chat_template_kwargs must be an object of the chat template's variables", field="chat_template_kwargs"
        )
    for key, value in raw.items():
        field = f"chat_template_kwargs.{key}"
        if key in PROVIDED:
            raise RequestError(f"{field} is set by the server, not by the request", field=field)
        if profile.variables is not None and key not in profile.variables:
            reads = ", ".join(sorted(profile.variables)) or "none"
            raise RequestError(f"{field} is not read by this model's chat template (it reads: {reads})", field=field)
        if key in BOOLEAN_KWARGS and not isinstance(value, bool):
            raise RequestError(f"{field} must be a boolean, got {value!r}", field=field)
    return dict(raw)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def fit_roles(messages: list[dict[str, Any]], profile: TemplateProfile) -> list[dict[str, Any]]:
    """Messages reshaped so the template renders all of them: system messages it drops or refuses go into
    the first user turn, a system message it reads only as parts becomes parts, consecutive user (or
    assistant) turns are joined where it wants the turns to alternate."""
    out = [dict(m) for m in messages]
    if profile.system == "none" and any(m["role"] == "system" for m in out):
        note = "\n\n".join(_text(m["content"]) for m in out if m["role"] == "system")
        out = [m for m in out if m["role"] != "system"]
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            out.insert(0, {"role": "user", "content": note})
        else:
            first["content"] = note + "\n\n" + _text(first["content"])
    if profile.alternates:
        joined: list[dict[str, Any]] = []
        for m in out:
            prev = joined[-1] if joined else None
            if (
                prev is not None
                and m["role"] == prev["role"]
                and m["role"] in ("user", "assistant")
                and not m.get("tool_calls")
                and not prev.get("tool_calls")
            ):
                prev["content"] = _text(prev["content"]) + "\n\n" + _text(m["content"])
            else:
                joined.append(m)
        out = joined
    if profile.system == "parts":
        for m in out:
            if m["role"] == "system" and isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    return out
