"""Tokenizers that carry each model family's real chat template and its special tokens, for the chat tests.

The templates are the families' own (``tests/fixtures/chat_templates``, sources in ``SOURCES.md``). The
vocabulary is SmolLM2's with the family's role and tool tokens added, marked special or not as in the
family's own tokenizer, so the templates render and the parsers read exactly the family's text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mindie_host.server.reasoning import REASONING_PARSER
from mindie_host.server.tool_calls import TOOL_PARSER

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"

QWEN_TOKENS = (
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|endoftext|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)
THINK_TOKENS = (("<think>", False), ("</think>", False))
DEEPSEEK_TOKENS = (
    ("<｜begin▁of▁sentence｜>", True),
    ("<｜end▁of▁sentence｜>", True),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    ("<｜tool▁calls▁begin｜>", False),
    ("<｜tool▁calls▁end｜>", False),
    ("<｜tool▁call▁begin｜>", False),
    ("<｜tool▁call▁end｜>", False),
    ("<｜tool▁sep｜>", False),
    ("<｜tool▁outputs▁begin｜>", False),
    ("<｜tool▁outputs▁end｜>", False),
    ("<｜tool▁output▁begin｜>", False),
    ("<｜tool▁output▁end｜>", False),
)
GLM_TOKENS = (
    ("[gMASK]", True),
    ("<sop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<|endoftext|>", True),
)
MISTRAL_TOKENS = (
    ("<s>", True),
    ("</s>", True),
    ("[INST]", True),
    ("[/INST]", True),
    ("[AVAILABLE_TOOLS]", True),
    ("[/AVAILABLE_TOOLS]", True),
    ("[TOOL_CALLS]", True),
    ("[TOOL_RESULTS]", True),
    ("[/TOOL_RESULTS]", True),
)


@dataclass(frozen=True)
class Family:
    """One family's chat template and tokens, and what the host should make of them."""

    #: the template's fixture file (without ``.jinja``)
    name: str
    tokens: tuple[tuple[str, bool], ...]
    eos: str
    bos: str | None = None
    #: the builtin tool-call parser the template selects
    parser: str = "json"
    #: what the template renders (TemplateProfile fields)
    renders: dict[str, Any] = field(default_factory=dict)
    #: the template writes ``</think>`` and the prompt leaves a ``<think>`` open
    thinks: bool = False
    opens_think: bool = False
    #: the ``model_type`` of the family's checkpoints
    model_type: str = "llama"

    @property
    def template(self) -> str:
        return (FIXTURES / f"{self.name}.jinja").read_text()


FULL = {
    "renders_tools": True,
    "renders_calls": True,
    "call_arguments": "object",
    "renders_tool_role": True,
    "system": "text",
}
FAMILIES = {
    f.name: f
    for f in (
        Family(
            "qwen3",
            QWEN_TOKENS + THINK_TOKENS,
            "<|im_end|>",
            parser="hermes",
            renders=FULL,
            thinks=True,
            model_type="qwen3",
        ),
        Family("qwen2_5", QWEN_TOKENS, "<|im_end|>", parser="hermes", renders=FULL, model_type="qwen2"),
        Family(
            "deepseek_v3",
            DEEPSEEK_TOKENS,
            "<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
            parser="deepseek_v3",
            model_type="deepseek_v3",
            # its calls render only under a null content, which transformers drops: they go in as text
            renders={"renders_tools": False, "renders_calls": False, "renders_tool_role": True},
        ),
        Family(
            "deepseek_r1",
            DEEPSEEK_TOKENS + THINK_TOKENS,
            "<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
            parser="deepseek_v3",
            thinks=True,
            opens_think=True,
            model_type="deepseek_v3",
            renders={"renders_tools": False, "renders_calls": True, "calls_content": "", "renders_tool_role": True},
        ),
        Family(
            "deepseek_r1_0528",
            DEEPSEEK_TOKENS + THINK_TOKENS,
            "<｜end▁of▁sentence｜>",
            bos="<｜begin▁of▁sentence｜>",
            parser="deepseek_v3",
            thinks=True,
            model_type="deepseek_v3",
            renders={"renders_tools": False, "renders_calls": True, "renders_tool_role": True},
        ),
        Family(
            "glm4_9b_chat",
            GLM_TOKENS,
            "<|user|>",
            parser="glm4",
            model_type="glm",
            renders={"renders_tools": False, "renders_calls": False, "system": "text"},
        ),
        Family(
            "glm4_0414",
            GLM_TOKENS,
            "<|user|>",
            parser="glm4",
            model_type="glm4",
            renders={"renders_tools": True, "renders_calls": False, "renders_tool_role": False},
        ),
        Family(
            "glm_z1_0414",
            GLM_TOKENS + THINK_TOKENS,
            "<|user|>",
            parser="glm4",
            thinks=True,
            opens_think=True,
            model_type="glm4",
            renders={"renders_tools": True, "renders_calls": False, "renders_tool_role": False},
        ),
        Family(
            "mistral_nemo",
            MISTRAL_TOKENS,
            "</s>",
            bos="<s>",
            parser="mistral",
            model_type="mistral",
            renders={"renders_tools": True, "renders_calls": True, "renders_tool_role": True, "alternates": True},
        ),
        Family(
            "mixtral_8x7b",
            MISTRAL_TOKENS[:2],
            "</s>",
            bos="<s>",
            parser="mistral",
            model_type="mixtral",
            renders={
                "renders_tools": False,
                "renders_calls": False,
                "renders_tool_role": False,
                "system": "text",
                "alternates": True,
            },
        ),
        Family(
            "gemma3",
            (("<bos>", True), ("<start_of_turn>", True), ("<end_of_turn>", True)),
            "<end_of_turn>",
            bos="<bos>",
            model_type="gemma3_text",
            renders={
                "renders_tools": False,
                "renders_calls": False,
                "renders_tool_role": False,
                "system": "parts",
                "alternates": True,
            },
        ),
        Family(
            "phi3_mini",
            (("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|end|>", True)),
            "<|end|>",
            model_type="phi3",
            renders={"renders_tools": False, "renders_calls": False, "renders_tool_role": False, "system": "text"},
        ),
        Family(
            "phi3_5_mini",
            (("<|system|>", True), ("<|user|>", True), ("<|assistant|>", True), ("<|end|>", True)),
            "<|end|>",
            model_type="phi3",
            renders={"renders_tools": False, "renders_calls": False, "renders_tool_role": False, "system": "text"},
        ),
    )
}


def base_tokenizer() -> Any:
    """The default model's (SmolLM2) tokenizer, as the other tests' tiny models use it."""
    from mindie_host.models.default import default_model_path
    from mindie_host.models.weights import resolve_model
    from mindie_host.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(default_model_path()))


@functools.cache
def union_tokenizer() -> Any:
    """SmolLM2's tokenizer with every family's tokens added, marked special or not as in the family's own
    tokenizer (no token is special in one family and plain in another). Built once per process; whoever
    uses it sets the family first (:func:`with_family`)."""
    from tokenizers import AddedToken

    tok = base_tokenizer()
    seen: dict[str, bool] = {}
    for family in FAMILIES.values():
        for text, special in family.tokens:
            assert seen.setdefault(text, special) == special, text
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in seen.items()])
    return tok


def with_family(tok: Any, family: Family) -> Any:
    """``tok`` with ``family``'s chat template and bos/eos strings."""
    tok.chat_template = family.template
    tok.bos_token = family.bos
    tok.eos_token = family.eos
    return tok


def union_model(directory: Path) -> Path:
    """A tiny random Llama with the union tokenizer (Qwen3's template; ``<|im_end|>`` ends the answer).

    One server serves every family's template in turn (:func:`use_template`): a template, its special
    tokens and its parsers are what the chat endpoint sees; the weights do not matter because the test
    plugin forces the model's text.
    """
    from mindie_host.testing import make_tiny_llama

    with_family(union_tokenizer(), FAMILIES["qwen3"]).save_pretrained(str(directory / "tokenizer"))
    return make_tiny_llama(directory / "model", tokenizer_dir=directory / "tokenizer")


def use_template(host: Any, family: Family) -> None:
    """Serve ``family``'s chat template and bos/eos strings from now on (the parsers are chosen again)."""
    with_family(host.tokenizer, family)
    host.caches.put(TOOL_PARSER, None)
    host.caches.put(REASONING_PARSER, None)
