"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters and loses the spaces some
tokenizers attach to a word's first piece. Instead we decode a short window of
recent tokens twice (without and with the new ones) and emit the difference,
holding it back while it ends in the replacement character U+FFFD. The window
starts inside the prompt so the first output token decodes in context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5


@dataclass
class DetokState:
    """Token indices (into prompt + output) of the decode window."""

    prefix_offset: int
    read_offset: int


class Detokenizer:
    """Wraps a Hugging Face tokenizer for streaming decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode a whole token list."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def start(prompt_len: int) -> DetokState:
        """The state for a sequence whose output starts after ``prompt_len`` tokens."""
        return DetokState(prefix_offset=max(0, prompt_len - _PROMPT_CONTEXT), read_offset=prompt_len)

    def step(self, token_ids: list[int], state: DetokState, skip_special_tokens: bool = True) -> str:
        """Text added by the tokens after ``state.read_offset``; updates ``state``.

        Returns "" while the new tokens only make up part of a character.
        """
        decode = self.tokenizer.decode
        prefix = decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special_tokens)
        full = decode(token_ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            if len(full) <= len(prefix) and not full.endswith(REPLACEMENT):
                # tokens that decode to nothing (special tokens): move past them
                state.read_offset = len(token_ids)
            return ""
        state.prefix_offset = state.read_offset
        state.read_offset = len(token_ids)
        return full[len(prefix) :]
