"""OpenAI API against the real server with the official ``openai`` client: chat and completions,
streams, n, logprobs, stop, seeds, both ``openAiSupport`` variants, ``fullTextEnabled``, function
calling (parsers, the parser hook, constrained decoding) and bad inputs."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from mindie_host.server import tool_calls as tc
from mindie_host.structured.json_grammar import JsonConstraint
from mindie_host.structured.vocab import vocab_for
from mindie_host.testing import RunningServer, server_config

MODEL = "tiny"
HI = [{"role": "user", "content": "Hello, who are you?"}]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "detailed": {"type": "boolean"},
            },
            "required": ["city", "unit", "days", "detailed"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]},
    },
}


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return client_for(tiny_server)


@pytest.fixture(scope="module")
def plain_server(tiny_model):
    """The plain OpenAI variant, with fullTextEnabled."""
    with RunningServer(server_config(tiny_model, server={"openAiSupport": "openai", "fullTextEnabled": True})) as s:
        yield s


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def sse_data(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# -- chat and completions ----------------------------------------------------------------------
def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "MindIE Server"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_and_stream_agree(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    raw = r.model_dump()
    assert "prefill_time" in raw and isinstance(raw["decode_time_arr"], list)
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert all(c.choices[0].delta.role == "assistant" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_stream_wire_format(tiny_server):
    r = post(tiny_server, "/v1/chat/completions",
             {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    last = events[-2]
    # OpenAI's rule: without stream_options.include_usage no chunk carries usage, the finish chunk included
    assert all("usage" not in e for e in events[:-1]) and last["choices"][0]["finish_reason"] in ("stop", "length")


def test_completions(client, tiny_server):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 6
    text = r.choices[0].text
    streamed = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    assert streamed[-1].usage.completion_tokens == r.usage.completion_tokens
    ids = tiny_server.host.tokenize("The capital of France is")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == "The capital of France is" + text
    many = client.completions.create(model=MODEL, prompt=["a b c", "The capital of France is"], max_tokens=6,
                                     temperature=0)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[1].text == text
    lp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == lp.usage.completion_tokens
    assert all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)


def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # different seeds per choice
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, n=3, temperature=1.0,
                                                 seed=7, stream=True))
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == r.choices[i].message.content


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)  # greedy picks the top token
        assert item.logprob <= 0
    none = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


def test_stop(client):
    full = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(full) > 6
    stop = full[3:6]
    cut = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]
    kept = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, temperature=0, stop=stop,
                                          extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content.endswith(stop)


def test_seed_determinism_alone_and_concurrent(client):
    def ask(seed: int | None, prompt: str = "Tell me a story") -> str:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=10, temperature=1.0, top_p=0.95, seed=seed)
        return r.choices[0].message.content

    alone = ask(1234)
    assert ask(1234) == alone
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, 1234)] + [pool.submit(ask, None, f"Other prompt {i}") for i in range(5)]
        futures.append(pool.submit(ask, 1234))
        results = [f.result() for f in futures]
    assert results[0] == alone and results[-1] == alone


# -- the two variants ----------------------------------------------------------------------------
def test_vllm_variant_ranges(tiny_server):
    base = {"model": MODEL, "messages": HI, "max_tokens": 2}
    for extra in ({"temperature": 3.0}, {"top_k": -1}, {"top_k": 5}, {"temperature": None, "top_p": None,
                                                                      "seed": None, "stream": None},
                  {"stop": "x" * 5000}, {"stop": ["a"] * 2000}, {"tool_choice": None, "tools": None}):
        r = post(tiny_server, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 200, (extra, r.text)
    for extra, field in (({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"), ({"stop_token_ids": [1, None]},
                                                                              "stop_token_ids[1]"),
                         ({"stop": "x" * 40000}, "stop"), ({"temperature": -0.5}, "temperature")):
        r = post(tiny_server, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 422, (extra, r.text)
        assert r.json()["error"]["param"] == field


def test_plain_variant_ranges(plain_server):
    base = {"model": MODEL, "messages": HI, "max_tokens": 2}
    for extra in ({"temperature": 2.0}, {"top_k": 0}, {"seed": None}, {"stop": None}, {"tool_choice": None},
                  {"stop_token_ids": [1, None]}, {"stop": ["ab"] * 1024}):
        r = post(plain_server, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 200, (extra, r.text)
    for extra, field in (({"temperature": 3.0}, "temperature"), ({"top_k": -1}, "top_k"),
                         ({"temperature": None}, "temperature"), ({"stream": None}, "stream"),
                         ({"stop": "x" * 1025}, "stop"), ({"stop": ["a"] * 1025}, "stop"),
                         ({"stop": ["x" * 1025]}, "stop[0]")):
        r = post(plain_server, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 422, (extra, r.text)
        assert r.json()["error"]["param"] == field


def test_full_text_enabled(plain_server):
    c = client_for(plain_server)
    full = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0).choices[0].message.content
    r = post(plain_server, "/v1/chat/completions",
             {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": 0, "stream": True})
    events = [e for e in sse_data(r.text) if e != "[DONE]"]
    texts = [e["choices"][0]["delta"]["content"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full and events[-1]["full_text"] == full
    comp = post(plain_server, "/v1/completions",
                {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "temperature": 0, "stream": True})
    ctexts = [e["choices"][0]["text"] for e in sse_data(comp.text) if e != "[DONE]"]
    assert all(b.startswith(a) for a, b in zip(ctexts, ctexts[1:])) and ctexts[-1]


# -- bad inputs ------------------------------------------------------------------------------------
CHAT_BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),  # "" is accepted (issue 18)
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "/x.png"}]}]},
     "messages[0].content[0].type"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
    ({"stop": 5}, "stop"),
    ({"tools": {"x": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].id"),
]


@pytest.mark.parametrize(("extra", "field"), CHAT_BAD)
def test_chat_bad_inputs(tiny_server, extra, field):
    r = post(tiny_server, "/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2, **extra})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [({"prompt": None}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
     ({"prompt": [10**7]}, "prompt"), ({"logprobs": 21}, "logprobs"), ({"echo": "y"}, "echo"),
     ({"temperature": 2.5, "top_k": 0}, "top_k")],
)
def test_completions_bad_inputs(tiny_server, extra, field):
    r = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == field


def test_unknown_model_and_bad_json(client, tiny_server):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=HI)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=b"{bad", timeout=10)
    assert r.status_code == 422 and r.json()["error"]["param"] == "body"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)


# -- function calling: parsers --------------------------------------------------------------------
def test_hermes_parser():
    p = tc.HermesToolParser()
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    calls = p.parse(text)
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert p.content(text) == "Sure."
    assert p.parse("no calls here") is None
    assert p.might_be_call("<tool") and not p.might_be_call("Hello")


def test_json_parser():
    p = tc.JsonToolParser()
    assert p.parse('{"name": "add", "arguments": {"a": 1}}')[0]["function"]["name"] == "add"
    calls = p.parse('```json\n[{"name": "add", "parameters": {"a": 1}}, {"name": "f", "arguments": "{}"}]\n```')
    assert [c["function"]["name"] for c in calls] == ["add", "f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert p.parse("Hello {there}") is None and p.parse('{"a": 1}') is None
    assert p.might_be_call(' {"na') and not p.might_be_call("The answer")
    assert tc.builtin_parser("qwen2").name == "hermes" and tc.builtin_parser("llama").name == "json"


def test_constraint_random_walks_stay_valid(tiny_server):
    """Any path through the allowed tokens ends in JSON that matches the schema."""
    host = tiny_server.host
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": 12}, "e": {"enum": ["a", "b", 3, None]}, "i": {"type": "integer"},
        "n": {"type": "number"}, "b": {"type": "boolean"}, "arr": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}},
        "required": ["s", "e", "i", "n", "b", "arr", "o"]}
    vocab = vocab_for(host)
    for seed in range(8):
        c = JsonConstraint.for_schema(host, schema)
        rng = random.Random(seed)
        out: list[int] = []
        for _ in range(400):
            allowed = c(out)
            assert allowed
            tok = rng.choice(allowed)
            if tok in vocab.eos:
                break
            out.append(tok)
        value = json.loads("".join(vocab.strings[t] for t in out))
        jsonschema.validate(value, schema)
        assert len(value["s"]) <= 12


# -- function calling through the server ----------------------------------------------------------
def test_named_tool_choice_tiny(client):
    """Even a random model gives schema-valid arguments under a named tool_choice."""
    for seed in (1, 2):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather in Oslo?"}],
                                           tools=[WEATHER, ADD], max_tokens=200, temperature=1.0, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_and_stream_tiny(client):
    r = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER, ADD], tool_choice="required",
                                       max_tokens=200, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        chunks = list(client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER, ADD],
                                                     tool_choice=choice, max_tokens=200, temperature=0, stream=True))
        deltas = [tcall for c in chunks if c.choices for tcall in (c.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].id and deltas[0].function.name
        args = "".join(d.function.arguments or "" for d in deltas)
        name = deltas[0].function.name
        jsonschema.validate(json.loads(args), {"get_weather": WEATHER, "add": ADD}[name]["function"]["parameters"])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_and_role_tool_round_trip(client):
    plain = client.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER], tool_choice="none",
                                           max_tokens=4, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=[ADD], max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "5", "tool_call_id": call.id},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[ADD], max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    without_call = client.chat.completions.create(model=MODEL, messages=[history[0], {"role": "assistant",
                                                  "content": "ok"}, history[2]], max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens > without_call.usage.prompt_tokens  # the call is rendered for the model


@pytest.mark.slow
def test_named_tool_choice_default_model(default_server):
    c = client_for(default_server)
    name = default_server.host.model_name
    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                                  tools=[WEATHER, ADD], max_tokens=120, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    assert "paris" in args["city"].lower()
    r = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                  tools=[WEATHER, ADD], max_tokens=120, temperature=0, tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
