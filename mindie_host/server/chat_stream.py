"""One streamed chat choice: its reasoning first (``reasoning_content`` deltas), then its content and tool calls."""

from __future__ import annotations

from typing import Any

from .reasoning import Reasoning
from .tool_calls import ToolPlan, ToolStream


class ChoiceStream:
    """Turns one choice's generated text into chat-chunk deltas.

    With a reasoning model the text goes through the reasoning splitter first; its content part
    goes on to the :class:`ToolStream`. ``content`` is the content sent so far (``fullTextEnabled``
    sends it whole in every chunk).
    """

    def __init__(self, plan: ToolPlan, reasoning: Reasoning | None) -> None:
        self.tools = ToolStream(plan)
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.content = ""

    def _note(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for d in deltas:
            self.content += d.get("content", "")
        return deltas

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        """Deltas for ``new_text`` (not the last piece)."""
        if self.reasoning is None:
            return self._note(self.tools.feed(new_text))
        thought, content = self.reasoning.feed(new_text)
        deltas = [{"reasoning_content": thought}] if thought else []
        return deltas + (self._note(self.tools.feed(content)) if content else [])

    def finish(self, new_text: str, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """Deltas for the last piece, and the choice's finish reason."""
        if self.reasoning is None:
            deltas, reason = self.tools.finish(new_text, finish_reason)
            return self._note(deltas), reason
        thought, content = self.reasoning.feed(new_text)
        more_thought, more_content = self.reasoning.finish()
        thought += more_thought
        deltas, reason = self.tools.finish(content + more_content, finish_reason)
        return ([{"reasoning_content": thought}] if thought else []) + self._note(deltas), reason
