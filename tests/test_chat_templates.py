"""Each family's real chat template (tests/fixtures/chat_templates) with the host's chat plumbing, no server:
what the template renders, tool calls and results of a multi-turn history rendered by it and read back by the
family's parser, the parsers on model-like output (streamed and whole alike), reasoning splits, the constraint
that waits for the end of the reasoning, and ``chat_template_kwargs`` validation."""

from __future__ import annotations

import json
import random

import pytest
from chat_families import FAMILIES, Family, union_tokenizer, with_family

from mindie_host.chat_template import fit_roles, profile_of, template_kwargs
from mindie_host.engine.request import RequestError
from mindie_host.reasoning_parsers import ReasoningParser
from mindie_host.server.reasoning import AfterReasoning
from mindie_host.server.tool_calls import ToolPlan, ToolStream
from mindie_host.tool_parsers import (
    DeepSeekToolParser,
    GlmToolParser,
    HermesToolParser,
    JsonToolParser,
    MistralToolParser,
    builtin_parser,
    make_call,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER, TIME]
CALLS = [make_call("get_weather", {"city": "Paris"}), make_call("get_time", {"city": "Oslo"})]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and the time in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": CALLS},
    {"role": "tool", "content": "31C", "tool_call_id": CALLS[0]["id"]},
    {"role": "tool", "content": "14:05", "tool_call_id": CALLS[1]["id"]},
    {"role": "assistant", "content": "Paris: 31C. Oslo: 14:05."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]
#: where a family's template opens and closes the assistant turn that carries the calls
TURNS = {
    "qwen": ("<|im_start|>assistant\n", "<|im_end|>"),
    "deepseek": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "glm": ("<|assistant|>", "<|observation|>"),
    "mi": ("[/INST]", "</s>"),
    "gemma3": ("<start_of_turn>model\n", "<end_of_turn>"),
    "phi3": ("<|assistant|>\n", "<|end|>"),
}


class Tokenizers:
    """The union tokenizer wearing the family's template when asked for it."""

    def __getitem__(self, name: str):
        return with_family(union_tokenizer(), FAMILIES[name])


@pytest.fixture(scope="module")
def tokenizers() -> Tokenizers:
    return Tokenizers()


def turn_of(family: Family) -> tuple[str, str]:
    return next(v for k, v in TURNS.items() if family.name.startswith(k))


def rendered(tok, family: Family, messages, tools=TOOLS, mode="auto", **kwargs) -> tuple[str, ToolPlan]:
    profile = profile_of(tok)
    plan = ToolPlan(mode, tools, builtin_parser(family.model_type, profile.template))
    msgs, offered = plan.prepare([dict(m) for m in messages], profile)
    prompt = tok.apply_chat_template(
        fit_roles(msgs, profile), tools=offered, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return prompt, plan


# -- what each template renders -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_profile(tokenizers, name):
    family = FAMILIES[name]
    profile = profile_of(tokenizers[name])
    assert {k: getattr(profile, k) for k in family.renders} == family.renders
    assert profile.thinks == family.thinks
    assert builtin_parser(family.model_type, profile.template).name == family.parser
    assert profile.variables == ({"enable_thinking"} if name == "qwen3" else set())


def test_parser_by_family_without_a_template_format():
    """A template that writes no call (Mixtral-8x7B's, DeepSeek-V3's ...) falls back to the family's format."""
    expect = {
        "qwen3": "hermes",
        "qwen2": "hermes",
        "deepseek_v3": "deepseek_v3",
        "glm": "glm4",
        "glm4": "glm4",
        "mistral": "mistral",
        "mixtral": "mistral",
        "llama": "json",
        "gemma3_text": "json",
        "phi3": "json",
    }
    assert {t: builtin_parser(t).name for t in expect} == expect
    # the template's own format wins over the family (DeepSeek-R1's Qwen distill is a qwen2 checkpoint)
    assert builtin_parser("qwen2", FAMILIES["deepseek_r1"].template).name == "deepseek_v3"


# -- a multi-turn tool conversation through each real template ------------------------------------------
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_tool_history_renders_and_reads_back(tokenizers, name):
    """Every part of a tool conversation reaches the prompt, and the calls the template wrote parse back."""
    family = FAMILIES[name]
    prompt, plan = rendered(tokenizers[name], family, HISTORY)
    for text in (
        "You are terse.",
        "Weather in Paris",
        "31C",
        "14:05",
        "Paris: 31C. Oslo",
        "And tomorrow?",
        "Get the weather in a city",
    ):
        assert text in prompt, (text, prompt)
    start, end = turn_of(family)
    turn = prompt.split("Weather in Paris and the time in Oslo?", 1)[1]
    turn = turn[turn.index(start) + len(start) :]
    turn = turn[: turn.index(end)]
    calls = plan.parser.parse_calls(turn, TOOLS)
    assert calls is not None, turn
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Oslo"}),
    ]


def test_family_shapes(tokenizers):
    """The families' own shapes: GLM-4 calls as metadata turns and results as observations (tools in the system
    turn for glm-4-9b-chat), Mistral's nine-character ids, DeepSeek's call tokens, Gemma's merged user turns."""
    glm, _ = rendered(tokenizers["glm4_9b_chat"], FAMILIES["glm4_9b_chat"], HISTORY)
    assert '<|assistant|>get_weather\n{"city": "Paris"}<|assistant|>get_time' in glm
    assert "<|observation|>\n31C<|observation|>\n14:05<|assistant|>" in glm and "## get_weather" in glm
    z1, _ = rendered(tokenizers["glm_z1_0414"], FAMILIES["glm_z1_0414"], HISTORY)
    assert "<|assistant|>get_time\n" in z1 and "<|observation|>\n14:05" in z1 and z1.endswith("<|assistant|>\n<think>")
    g0414, _ = rendered(tokenizers["glm4_0414"], FAMILIES["glm4_0414"], HISTORY)
    assert '<|assistant|>get_time \n{"city": "Oslo"}<|observation|>\n31C<|observation|>\n14:05<|assistant|>\n' in g0414
    assert "## get_time" in g0414 and g0414.endswith("tomorrow?<|assistant|>")  # no <think>: GLM-4-0414 answers at once
    nemo, plan = rendered(tokenizers["mistral_nemo"], FAMILIES["mistral_nemo"], HISTORY)
    ids = [c["id"] for c in json.loads(nemo.split("[TOOL_CALLS]")[1].split("</s>")[0])]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and f'"call_id": "{ids[1]}"' in nemo
    assert len(plan.parser.call_id()) == 9
    r1, _ = rendered(tokenizers["deepseek_r1"], FAMILIES["deepseek_r1"], HISTORY)
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" in r1 and r1.endswith("<think>\n")
    gemma, _ = rendered(tokenizers["gemma3"], FAMILIES["gemma3"], HISTORY)
    assert gemma.count("<start_of_turn>user") == 3 and "You are terse.\n\n" in gemma


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "glm_z1_0414"])
def test_reasoning_templates_open_or_close_thinking(tokenizers, name):
    family = FAMILIES[name]
    prompt, _ = rendered(tokenizers[name], family, HISTORY[1:2])
    parser = ReasoningParser()
    assert parser.applies(family.template) and parser.opens(prompt) == family.opens_think
    if name == "qwen3":  # thinking off: the template closes an empty block, the answer is all content
        off, _ = rendered(tokenizers[name], family, HISTORY[1:2], enable_thinking=False)
        assert off.endswith("<think>\n\n</think>\n\n") and not parser.opens(off)


# -- the parsers on what a model writes ---------------------------------------------------------------
OUTPUTS = [
    (
        HermesToolParser(),
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "Let me check.",
    ),
    (
        DeepSeekToolParser(),
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
        '<｜tool▁sep｜>get_time\n```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking.",
    ),
    (
        DeepSeekToolParser(),
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"city": "Oslo"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
    ),  # V3.1
    (
        MistralToolParser(),
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"city": "Oslo"}}]',
        "",
    ),
    (
        MistralToolParser(),
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"city": "Oslo"}',
        "",
    ),
    (GlmToolParser(), 'get_weather\n{"city": "Paris"}\nget_time\n{"city": "Oslo"}', ""),
    (
        JsonToolParser(),
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"city": "Oslo"}}]',
        "",
    ),
]


@pytest.mark.parametrize("parser,text,content", OUTPUTS, ids=lambda v: getattr(v, "name", None))
def test_parsers_read_calls_streamed_or_whole(parser, text, content):
    plan = ToolPlan("auto", TOOLS, parser)
    got_content, calls, reason = plan.finish(text, "stop")
    assert reason == "tool_calls" and got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"city": "Oslo"}),
    ]
    rng = random.Random(0)
    for _ in range(20):  # any split of the text into pieces streams the same content and calls
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ToolStream(plan)
        deltas = [d for p in pieces[:-1] for d in stream.feed(p)]
        last, reason = stream.finish(pieces[-1], "stop")
        deltas += last
        assert "".join(d.get("content", "") for d in deltas) == content and reason == "tool_calls"
        (streamed,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]


@pytest.mark.parametrize(
    "parser,text",
    [
        (HermesToolParser(), "Paris is sunny, no <tool call> needed."),
        (DeepSeekToolParser(), "No call here."),
        (MistralToolParser(), "[TOOL] is not a call"),
        (GlmToolParser(), "\nParis is sunny."),
        (GlmToolParser(), 'unknown_tool\n{"city": "Paris"}'),  # GLM-4 counts only calls of offered tools
        (JsonToolParser(), "Paris is sunny."),
    ],
    ids=lambda v: getattr(v, "name", None),
)
def test_plain_answers_stay_content(parser, text):
    plan = ToolPlan("auto", TOOLS, parser)
    assert plan.finish(text, "stop") == (text, None, "stop")
    stream = ToolStream(plan)
    deltas = [d for ch in text for d in stream.feed(ch)]
    deltas += stream.finish("", "stop")[0]
    assert "".join(d.get("content", "") for d in deltas) == text


# -- reasoning -------------------------------------------------------------------------------------------
SPLITS = [
    ("<think>\nThe user wants Paris.\n</think>\n\nIt is sunny.", False, "The user wants Paris.", "It is sunny."),
    ("The user wants Paris.\n</think>\n\nIt is sunny.", True, "The user wants Paris.", "It is sunny."),  # R1
    ("It is sunny.", False, None, "It is sunny."),  # thinking off
    ("\n\nIt is sunny.", False, None, "\n\nIt is sunny."),
    ("Still thinking about\n\nParis", True, "Still thinking about\n\nParis", ""),  # cut by max_tokens
    ("<think>\n\n</think>\n\nIt is sunny.", False, None, "It is sunny."),
    ("<thin", False, None, "<thin"),
]


@pytest.mark.parametrize("text,opened,reasoning,content", SPLITS)
def test_reasoning_split_streamed_or_whole(text, opened, reasoning, content):
    parser = ReasoningParser()
    assert parser.split(text, opened) == (reasoning, content)
    rng = random.Random(1)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = parser.stream(opened)
        got = [stream.feed(p) for p in pieces] + [stream.finish()]
        assert "".join(r for r, _ in got) == (reasoning or "") and "".join(c for _, c in got) == content


def test_after_reasoning_applies_the_constraint_from_the_answer_on():
    start, end, answer = 7, 8, [1, 2]

    def inner(ids):  # a constraint that wants exactly ``answer`` and sees only the answer's tokens
        return [answer[len(ids)]] if len(ids) < len(answer) else [0]

    opened = AfterReasoning(inner, start, [end], opened=True)
    assert opened([]) is None and opened([5, 6]) is None and opened([5, 6, end]) == [1]
    assert opened([5, 6, end, 1]) == [2]
    fresh = AfterReasoning(inner, start, [end], opened=False)
    assert sorted(fresh([])) == [1, start]  # think first, or answer at once
    assert fresh([start, 5]) is None and fresh([start, 5, end]) == [1]
    direct = AfterReasoning(inner, start, [end], opened=False)
    direct([])
    assert direct([1]) == [2]  # answered at once: the constraint holds from the first token


# -- chat_template_kwargs -----------------------------------------------------------------------------
def test_chat_template_kwargs(tokenizers):
    qwen3 = profile_of(tokenizers["qwen3"])
    assert template_kwargs({"enable_thinking": False}, qwen3) == {"enable_thinking": False}
    assert template_kwargs(None, qwen3) == {}
    bad = [
        ([1], qwen3, "chat_template_kwargs"),
        ({"enable_thinking": "no"}, qwen3, "chat_template_kwargs.enable_thinking"),
        ({"thinking_budget": 5}, qwen3, "chat_template_kwargs.thinking_budget"),
        ({"add_generation_prompt": False}, qwen3, "chat_template_kwargs.add_generation_prompt"),
        ({"enable_thinking": False}, profile_of(tokenizers["deepseek_r1"]), "chat_template_kwargs.enable_thinking"),
    ]
    for raw, profile, field in bad:
        with pytest.raises(RequestError) as info:
            template_kwargs(raw, profile)
        assert info.value.field == field and info.value.status == 422
