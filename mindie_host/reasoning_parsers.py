"""Reasoning parsers: a reasoning model's answer split into its reasoning and its content.

Qwen3 writes ``<think>\\n...\\n</think>\\n\\nanswer``; DeepSeek-R1's and GLM-Z1's templates open the
``<think>`` block in the prompt, so their output has only the closing tag. The reasoning goes to the
OpenAI response as ``reasoning_content`` (vLLM's field name), the rest is the answer's ``content``
(and is what tool calls are parsed from).

The parser is chosen through the firstresult hook ``mindie_host_reasoning_parser(ctx, model_type)``;
the builtin answer (:mod:`mindie_host.server.reasoning`, registered last so any plugin wins) is a
:class:`ReasoningParser` whenever the model's chat template writes ``</think>``. A family with other
tags subclasses it and sets ``start`` and ``end``.
"""

from __future__ import annotations


class ReasoningParser:
    """``<think>…</think>`` reasoning (Qwen3, QwQ, DeepSeek-R1 and its distills, GLM-Z1).

    :meth:`split` splits a whole answer; :meth:`stream` returns a :class:`ReasoningStream` that does
    the same piece by piece. ``opened`` says whether the prompt left a reasoning block open
    (:meth:`opens`): then the answer starts inside the reasoning; otherwise the answer is reasoning
    only if it starts with ``start``. Reasoning that never ends (``max_tokens`` reached) is all
    reasoning. Newlines around the reasoning and before the content are dropped, as the templates
    drop them when they render a past answer.
    """

    name = "think"
    start = "<think>"
    end = "</think>"

    def applies(self, template: str) -> bool:
        """Whether a model with this chat template reasons (the template writes ``end``)."""
        return self.end in template

    def opens(self, prompt: str) -> bool:
        """Whether ``prompt`` ends inside an open reasoning block."""
        return prompt.rstrip().endswith(self.start)

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole answer; reasoning is None when there is none."""
        if not opened:
            s = text.lstrip()
            if not s.startswith(self.start):
                return None, text
            body = s[len(self.start) :]
        else:
            body = text
        i = body.find(self.end)
        if i < 0:
            reasoning, content = body.strip("\n"), ""
        else:
            reasoning, content = body[:i].strip("\n"), body[i + len(self.end) :].lstrip("\n")
        return (reasoning or None), content

    def stream(self, opened: bool) -> ReasoningStream:
        """A splitter for one streamed answer."""
        return ReasoningStream(self, opened)


class ReasoningStream:
    """Splits a streamed answer as :meth:`ReasoningParser.split` splits the whole: the pieces joined equal it.

    Text that may still turn out to be a tag, and newlines that :meth:`ReasoningParser.split` would
    drop if nothing but the end followed them, are held back until the next piece shows what they are.
    """

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.state = "reasoning" if opened else "start"
        self.held = ""
        self.reasoned = False  # some reasoning text went out
        self.answered = False  # content after the end tag started (its leading newlines are dropped until then)

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` pieces for the next piece of the answer."""
        self.held += text
        reasoning = content = ""
        if self.state == "start":
            s = self.held.lstrip()
            if s.startswith(self.parser.start):
                self.state, self.held = "reasoning", s[len(self.parser.start) :]
            elif self.parser.start.startswith(s):
                return "", ""
            else:
                self.state, content, self.held = "plain", self.held, ""
        if self.state == "reasoning":
            i = self.held.find(self.parser.end)
            if i >= 0:
                reasoning = self._reasoning(self.held[:i].rstrip("\n"))
                self.state, self.held = "content", self.held[i + len(self.parser.end) :]
            else:
                keep = _partial(self.held, self.parser.end)
                body = self.held[: len(self.held) - keep]
                out = body.rstrip("\n")
                reasoning = self._reasoning(out)
                self.held = self.held[len(out) :]
        if self.state == "content":
            content += self._content(self.held)
            self.held = ""
        elif self.state == "plain":
            content += self.held
            self.held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held text once the answer is complete."""
        held, self.held = self.held, ""
        if self.state == "start":
            return "", held
        if self.state == "reasoning":
            return self._reasoning(held.rstrip("\n")), ""
        return "", (self._content(held) if self.state == "content" else held)

    def _reasoning(self, text: str) -> str:
        if not self.reasoned:
            text = text.lstrip("\n")
        if text:
            self.reasoned = True
        return text

    def _content(self, text: str) -> str:
        if not self.answered:
            text = text.lstrip("\n")
            self.answered = bool(text)
        return text


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
