"""Tool-call parsers per model family: generated text to OpenAI ``tool_calls``.

The parser is chosen through the firstresult hook ``mindie_host_tool_call_parser(ctx, model_type)``;
the builtin answer (:mod:`mindie_host.server.tool_calls`, registered last so any plugin wins) is
:func:`builtin_parser`: the format the model's own chat template writes calls in, else the family's.

* :class:`HermesToolParser`: ``<tool_call>{json}</tool_call>`` (Qwen2.5, Qwen3, Hermes);
* :class:`DeepSeekToolParser`: ``<｜tool▁calls▁begin｜>...`` tokens (DeepSeek-V3, R1 and its distills);
* :class:`GlmToolParser`: ``name\\n{json}`` (GLM-4: glm-4-9b-chat, GLM-4-0414);
* :class:`MistralToolParser`: ``[TOOL_CALLS][{json}, ...]`` (Mistral, Mixtral);
* :class:`JsonToolParser`: a bare JSON call or list (Llama, SmolLM, Gemma, Phi-3 and everything else).

Several calls in one answer (parallel tool calls) come back as several entries.
"""

from __future__ import annotations

from .base import ToolParser, arguments_object, call_from_obj, json_values, make_call, new_call_id
from .deepseek import DeepSeekToolParser
from .glm import GlmToolParser
from .hermes import HermesToolParser
from .json_calls import JsonToolParser, ParserAdapter
from .mistral import MistralToolParser, mistral_id

__all__ = [
    "DeepSeekToolParser",
    "GlmToolParser",
    "HermesToolParser",
    "JsonToolParser",
    "MistralToolParser",
    "ParserAdapter",
    "ToolParser",
    "arguments_object",
    "builtin_parser",
    "call_from_obj",
    "json_values",
    "make_call",
    "mistral_id",
    "new_call_id",
]

#: text a chat template writes calls with, and the parser of that format: a template names its own format
#: (DeepSeek-R1's distills are ``qwen2`` and ``llama`` checkpoints with DeepSeek's call tokens)
TEMPLATE_FORMATS: tuple[tuple[str, type[ToolParser]], ...] = (
    ("<｜tool▁call▁begin｜>", DeepSeekToolParser),
    ("[TOOL_CALLS]", MistralToolParser),
    ("<tool_call>", HermesToolParser),
    ("<|observation|>", GlmToolParser),
    ("[gMASK]", GlmToolParser),  # glm-4-9b-chat's template names its roles from the messages
)
#: ``model_type`` prefixes and their parser, for templates that write no calls (Mixtral-8x7B's, DeepSeek-V3's ...)
FAMILY_FORMATS: tuple[tuple[str, type[ToolParser]], ...] = (
    ("deepseek", DeepSeekToolParser),
    ("glm", GlmToolParser),
    ("chatglm", GlmToolParser),
    ("mistral", MistralToolParser),
    ("mixtral", MistralToolParser),
    ("qwen", HermesToolParser),
    ("hermes", HermesToolParser),
)


def builtin_parser(model_type: str, template: str = "") -> ToolParser:
    """The builtin parser for a model: the format its chat template writes, else its family's, else JSON."""
    for marker, parser in TEMPLATE_FORMATS:
        if marker in (template or ""):
            return parser()
    family = (model_type or "").lower()
    for prefix, parser in FAMILY_FORMATS:
        if family.startswith(prefix):
            return parser()
    return JsonToolParser()
