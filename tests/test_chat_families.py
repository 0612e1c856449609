"""Tool calls and reasoning per model family through a real server and the official ``openai`` client.

One tiny random model whose tokenizer has every family's special tokens serves each family's real chat
template in turn (``chat_families.use_template``). A random model writes neither calls nor reasoning, so a
test plugin forces the text a trained model of the family writes (``mindie_host.testing.ForcedTokens`` in
``mindie_host_refine_request``): the engine, the detokenizer (special tokens included), the family's parsers
and the streaming path are the real ones. Constrained tool choice runs unforced.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from chat_families import FAMILIES, union_model, use_template

from mindie_host import hookimpl
from mindie_host.reasoning_parsers import ReasoningParser
from mindie_host.server.reasoning import REASONING_PARSER
from mindie_host.server.tool_calls import TOOL_PARSER
from mindie_host.testing import ForcedTokens, RunningServer, server_config
from mindie_host.tool_parsers import make_call

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris and the time in Oslo?"}]
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})]
THOUGHT = "Two calls."

HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
DEEPSEEK = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
GLM = 'get_weather\n{"city": "Paris"}<|assistant|>get_time\n{"city": "Oslo"}'
MISTRAL = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"city": "Oslo"}}]'
)
JSON_CALLS = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"city": "Oslo"}}]'
)
#: what a trained model of each family writes for ASK (reasoning families think first); one or more templates per
#: family are served (Qwen2.5's, DeepSeek-R1-0528's and Mixtral's share a served template's parser and reasoning,
#: and are rendered and read back in test_chat_templates.py)
ANSWERS = {
    "qwen3": f"<think>\n{THOUGHT}\n</think>\n\n{HERMES}",
    "deepseek_v3": DEEPSEEK,
    "deepseek_r1": f"{THOUGHT}\n</think>\n\n{DEEPSEEK}",  # the template opened <think>
    "glm4_9b_chat": GLM,
    "glm4_0414": GLM,
    "glm_z1_0414": f"{THOUGHT}\n</think>\n{GLM}",  # the template opened <think>
    "mistral_nemo": MISTRAL,  # [TOOL_CALLS] is a special token
    "gemma3": JSON_CALLS,
    "phi3_5_mini": JSON_CALLS,
}


#: one family per parser and reasoning shape streams too (each parser's streaming is checked on every split of
#: the text in test_chat_templates.py; here the engine's incremental detokenizer and special tokens take part)
STREAMED = {"qwen3", "deepseek_r1", "glm_z1_0414", "mistral_nemo"}


class ForceText:
    """Test plugin: chat requests write ``text`` (when set); every rendered prompt is kept."""

    def __init__(self) -> None:
        self.text: str | None = None
        self.prompts: list[str] = []

    @hookimpl
    def mindie_host_refine_request(self, ctx, request, body, protocol):
        self.prompts.append(request.prompt or "")
        if self.text is not None and protocol == "openai":
            host = ctx.host
            ids = host.tokenizer.encode(self.text, add_special_tokens=False)
            request.logits_constraint = ForcedTokens(ids, list(host.info.eos_token_ids))


@pytest.fixture(scope="module")
def force() -> ForceText:
    return ForceText()


@pytest.fixture(scope="module")
def server(tmp_path_factory, force):
    model = union_model(tmp_path_factory.mktemp("chat-families"))
    with RunningServer(server_config(model), plugins=[(force, "force-text")]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def serve(server, force, name: str, text: str | None) -> None:
    use_template(server.host, FAMILIES[name])
    force.text = text


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def streamed(client, **body):
    """The stream's content, reasoning, tool calls and finish reason, joined."""
    content, thought, calls, reasons = "", "", [], []
    for chunk in client.chat.completions.create(model="tiny", stream=True, **body):
        for ch in chunk.choices:
            delta = ch.delta
            content += delta.content or ""
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            calls += delta.tool_calls or []
            reasons.append(ch.finish_reason)
    return content, thought, calls, [r for r in reasons if r][-1]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_family_tool_calls_and_history(server, force, client, name):
    """The family's call format becomes ``tool_calls`` (whole and streamed), and the calls and their results
    go back into the next prompt in the shape the family's template renders."""
    family = FAMILIES[name]
    serve(server, force, name, ANSWERS[name])
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and calls_of(choice.message.tool_calls) == EXPECTED
    assert choice.message.content == ""
    thought = (choice.message.model_extra or {}).get("reasoning_content", "absent")
    assert thought == (THOUGHT if family.thinks else "absent")
    if name in STREAMED:
        content, s_thought, s_calls, reason = streamed(client, messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
        assert (content, reason) == ("", "tool_calls") and s_thought == (THOUGHT if family.thinks else "")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in s_calls] == EXPECTED
        assert [c.index for c in s_calls] == [0, 1]

    answer = "31C, 14:05."
    # GLM-Z1's template opens <think> after tool results too; DeepSeek-R1's does not (the answer follows the outputs)
    opens = family.opens_think and name != "deepseek_r1"
    serve(server, force, name, f"{THOUGHT}\n</think>\n\n{answer}" if opens else answer)
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in choice.message.tool_calls],
            "reasoning_content": thought if family.thinks else None,  # handed back as vLLM's clients do
        },
        {"role": "tool", "content": "31C", "tool_call_id": choice.message.tool_calls[0].id},
        {"role": "tool", "content": "14:05", "tool_call_id": choice.message.tool_calls[1].id},
    ]
    again = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=50, temperature=0)
    assert again.choices[0].message.content == answer and again.choices[0].finish_reason == "stop"
    prompt = force.prompts[-1]
    assert "31C" in prompt and "14:05" in prompt and '"Oslo"' in prompt and "get_time" in prompt
    if name == "qwen3":  # Qwen3's template renders the reasoning of the turns after the last question
        assert f"<think>\n{THOUGHT}\n</think>" in prompt


def test_reasoning_and_enable_thinking(server, force, client):
    serve(server, force, "qwen3", f"<think>\n{THOUGHT}\n</think>\n\nHello there.")
    msg = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0).choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"], msg.tool_calls) == ("Hello there.", THOUGHT, None)
    content, thought, _, reason = streamed(client, messages=ASK, max_tokens=60, temperature=0)
    assert (content, thought, reason) == ("Hello there.", THOUGHT, "stop")
    # thinking off: the template closes the block in the prompt, so the answer is all content
    force.text = "Hello there."
    off = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=60,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.content == "Hello there."
    assert off.choices[0].message.model_extra["reasoning_content"] is None
    assert force.prompts[-1].endswith("<think>\n\n</think>\n\n")
    # /tokenize renders messages as the chat endpoint does, chat_template_kwargs included
    tokenized = httpx.post(
        server.url + "/tokenize",
        timeout=30,
        json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()
    assert tokenized["count"] == off.usage.prompt_tokens
    # cut by max_tokens inside the reasoning: all of it is reasoning
    force.text = f"<think>\n{THOUGHT} And more thinking that goes on"
    cut = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8, temperature=0).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == ""
    assert THOUGHT.startswith(cut.message.model_extra["reasoning_content"][:10])
    # a template that does not reason has no reasoning_content and refuses enable_thinking
    serve(server, force, "deepseek_v3", "Hello there.")
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0).choices[0]
    assert plain.message.content == "Hello there." and "reasoning_content" not in (plain.message.model_extra or {})
    for name, kwargs, field in [
        ("deepseek_r1", {"enable_thinking": False}, "chat_template_kwargs.enable_thinking"),
        ("qwen3", {"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
        ("qwen3", {"unknown": 1}, "chat_template_kwargs.unknown"),
        ("qwen3", ["enable_thinking"], "chat_template_kwargs"),
    ]:
        serve(server, force, name, None)
        bad = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": ASK, "max_tokens": 5, "chat_template_kwargs": kwargs},
        )
        assert bad.status_code == 422 and bad.json()["error"]["param"] == field, bad.text
        bad = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": ASK, "chat_template_kwargs": kwargs})
        assert bad.status_code == 422 and bad.json()["error"]["param"] == field, bad.text


def test_constrained_tool_choice_waits_for_the_answer(server, force, client):
    """A named or required tool choice or a response_format on a reasoning model (the template's open
    ``<think>`` or the model's own): free reasoning, then a schema-valid answer."""
    end_id = server.host.tokenizer.convert_tokens_to_ids("</think>")
    schema = {**WEATHER["function"]["parameters"], "additionalProperties": False}
    for name, extra in [
        ("deepseek_r1", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ("qwen3", {"tools": TOOLS, "tool_choice": "required"}),
        ("qwen3", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}),
    ]:
        serve(server, force, name, None)
        r = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=120, temperature=0, logit_bias={str(end_id): 100}, **extra
        )
        choice = r.choices[0]
        if "tools" in extra:
            (call,) = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)


class BracketReasoning(ReasoningParser):
    """A family whose reasoning is written between ``[R]`` and ``[/R]``."""

    name = "bracket"
    start, end = "[R]", "[/R]"


class AlwaysCallParser:
    """A plugin's tool-call parser with only ``parse``: every answer is a call of ``ping``."""

    def parse(self, text):
        return [make_call("ping", {"text": text})]


class FamilyPlugin:
    """A plugin giving the model family its own reasoning and tool-call parsers."""

    @hookimpl
    def mindie_host_reasoning_parser(self, ctx, model_type):
        return BracketReasoning()

    @hookimpl
    def mindie_host_tool_call_parser(self, ctx, model_type):
        return AlwaysCallParser()


def test_parser_hooks_pick_plugin(server, force, client):
    """A plugin's parsers win over the builtins: its reasoning tags, and a parser with only ``parse`` (the rest
    from the builtin JSON parser), streamed and whole."""
    plugin = FamilyPlugin()
    server.host.plugins.register(plugin, "family-parsers")
    try:
        serve(server, force, "qwen2_5", "[R]why not[/R]Because.")
        msg = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=30, temperature=0).choices[0]
        assert (msg.message.model_extra["reasoning_content"], msg.message.content) == ("why not", "Because.")
        ping = [{"type": "function", "function": {"name": "ping"}}]
        r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=30, temperature=0, tools=ping)
        assert r.choices[0].finish_reason == "tool_calls"
        assert calls_of(r.choices[0].message.tool_calls) == [("ping", {"text": "Because."})]
        _, thought, calls, reason = streamed(client, messages=ASK, max_tokens=30, temperature=0, tools=ping)
        assert (thought, reason) == ("why not", "tool_calls") and calls_of(calls) == [("ping", {"text": "Because."})]
    finally:
        server.host.plugins.pm.unregister(plugin)
        server.host.caches.put(REASONING_PARSER, None)
        server.host.caches.put(TOOL_PARSER, None)


def test_refused_template_fields(server, force):
    serve(server, force, "qwen3", None)
    for body, field in [
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"documents": []}, "documents"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ]:
        r = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=30,
            json={"model": "tiny", "messages": ASK, "max_tokens": 5, **body},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_fixture_sources_are_recorded():
    sources = (Path(__file__).parent / "fixtures" / "chat_templates" / "SOURCES.md").read_text()
    for name in FAMILIES:
        assert f"`{name}.jinja`" in sources
