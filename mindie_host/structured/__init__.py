"""Grammar-constrained decoding, apart from any protocol.

* :mod:`.spec`: what a request asks for (``response_format``, ``guided_*``, ``structured_outputs``).
* :mod:`.llg`: JSON Schema, regex, choice and Lark/GBNF grammars on the llguidance library.
* :mod:`.json_grammar` and :mod:`.vocab`: the builtin hand-written JSON decoder used for tool calls.

Each produces an ``EngineRequest.logits_constraint``: a callable the engine calls per row
with the output token ids so far, returning the allowed next token ids.
"""

from __future__ import annotations

from .spec import StructuredSpec, parse_structured

__all__ = ["StructuredSpec", "parse_structured"]
