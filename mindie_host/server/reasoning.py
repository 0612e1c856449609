"""Reasoning on the OpenAI chat endpoint: ``reasoning_content``, and output constraints that wait for the answer.

The builtin answer to ``mindie_host_reasoning_parser`` is here (``trylast``, so any plugin wins): a
:class:`~mindie_host.reasoning_parsers.ReasoningParser` when the model's chat template writes
``</think>``. A request turns thinking off or on with ``chat_template_kwargs.enable_thinking`` where the
template reads it (Qwen3); whether the rendered prompt leaves a ``<think>`` block open decides where the
answer starts (:meth:`ReasoningParser.opens`).

An output constraint (a named or ``required`` ``tool_choice``, ``response_format``) on a reasoning
model applies from the end of the reasoning on, as vLLM does: :class:`AfterReasoning` lets the model
think freely, then hands every later token to the constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import hookimpl
from ..chat_template import template_profile
from ..host_state import CacheSlot
from ..reasoning_parsers import ReasoningParser, ReasoningStream

if TYPE_CHECKING:
    from ..context import HostContext
    from ..host_protocol import Host

#: the model's reasoning parser, ``False`` when the model does not reason
REASONING_PARSER: CacheSlot[ReasoningParser | bool] = CacheSlot("reasoning parser")


@hookimpl(trylast=True)
def mindie_host_reasoning_parser(ctx: HostContext, model_type: str) -> ReasoningParser | None:
    """The ``<think>`` parser when the model's chat template writes ``</think>``."""
    parser = ReasoningParser()
    return parser if ctx.host is not None and parser.applies(template_profile(ctx.host).template) else None


def reasoning_parser(host: Host) -> ReasoningParser | None:
    """The model's reasoning parser (asked of the plugins once per host), or None."""

    def ask() -> ReasoningParser | bool:
        model_type = host.info.model_type if host.info is not None else "llama"
        return host.plugins.hook.mindie_host_reasoning_parser(model_type=model_type) or False

    cached = host.caches.get_or_make(REASONING_PARSER, ask)
    return cached if isinstance(cached, ReasoningParser) else None


@dataclass
class Reasoning:
    """One chat request's reasoning: the parser, and whether its prompt left a reasoning block open."""

    parser: ReasoningParser
    opened: bool

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning_content, content)`` of a whole answer."""
        return self.parser.split(text, self.opened)

    def stream(self) -> ReasoningStream:
        """A splitter for one streamed answer."""
        return self.parser.stream(self.opened)

    def constrain(self, host: Host, constraint: Any) -> AfterReasoning:
        """``constraint`` applied from the end of the reasoning on."""
        start = _tag_ids(host, self.parser.start)
        return AfterReasoning(
            constraint, start[0] if len(start) == 1 else None, _tag_ids(host, self.parser.end), self.opened
        )


def reasoning_for(host: Host, prompt: str) -> Reasoning | None:
    """The reasoning of a chat request whose rendered prompt is ``prompt`` (None for a model that does not reason)."""
    parser = reasoning_parser(host)
    return Reasoning(parser, parser.opens(prompt)) if parser is not None else None


def _tag_ids(host: Host, tag: str) -> list[int]:
    return list(host.tokenizer.encode(tag, add_special_tokens=False))


class AfterReasoning:
    """``EngineRequest.logits_constraint`` that applies ``inner`` once the reasoning has ended.

    With the reasoning block open in the prompt, every token is free until the end tag's tokens
    appear; after them ``inner`` sees only the answer's tokens. Otherwise the first token is either
    the start tag (then the same) or one ``inner`` allows (then ``inner`` holds from the first token).
    """

    def __init__(self, inner: Any, start_id: int | None, end_ids: list[int], opened: bool) -> None:
        self.inner = inner
        self.start_id = start_id
        self.end_ids = end_ids
        self.state = "reasoning" if opened else "start"
        self.answer_from = 0
        self.scanned = 0

    def fork(self) -> AfterReasoning | None:
        """An independent copy at the same point, or None when the inner constraint cannot fork."""
        inner_fork = getattr(self.inner, "fork", None)
        inner = inner_fork() if inner_fork is not None else None
        if inner is None:
            return None
        twin = AfterReasoning(inner, self.start_id, self.end_ids, False)
        twin.state, twin.answer_from, twin.scanned = self.state, self.answer_from, self.scanned
        return twin

    def __call__(self, output_token_ids: list[int]) -> Any:
        if self.state == "start":
            if not output_token_ids:
                allowed = self.inner(output_token_ids)
                if allowed is None or self.start_id is None:
                    return allowed
                return [*[int(t) for t in allowed], self.start_id]
            self.state = "reasoning" if output_token_ids[0] == self.start_id else "answer"
        if self.state == "reasoning":
            n = len(self.end_ids)
            ids = output_token_ids
            found = (
                next(
                    (
                        i
                        for i in range(max(0, self.scanned - n + 1), len(ids) - n + 1)
                        if ids[i : i + n] == self.end_ids
                    ),
                    None,
                )
                if n
                else None
            )
            self.scanned = len(ids)
            if found is None:
                return None
            self.state, self.answer_from = "answer", found + n
        return self.inner(output_token_ids[self.answer_from :])


def special_markers(host: Host, markers: tuple[str, ...]) -> bool:
    """Whether any of ``markers`` is a special token of the model's tokenizer (stripped unless asked to keep)."""
    special = set(getattr(host.tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(host.tokenizer, "added_tokens_decoder", {}) or {}
    special |= {t.content for t in decoder.values() if getattr(t, "special", False)}
    return any(m in special for m in markers)
