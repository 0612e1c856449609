"""OpenAI conformance with real clients against the real server (issue 18): ``logit_bias``, usage in streams
(exactly once, only with ``include_usage``; LangChain's callbacks see the server's figures), the message forms
the API accepts, and legacy completions ``echo`` with prompt logprobs (``max_tokens: 0``, streaming, splitfuse
chunks of one token)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from mindie_host.testing import RunningServer, server_config

MODEL = "tiny"
HI = [{"role": "user", "content": "Hello, who are you?"}]
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def client(tiny_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def sse_events(text: str) -> list[Any]:
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# -- logit_bias ------------------------------------------------------------------------------------
def _token_id(server: RunningServer, text: str) -> int:
    ids = server.host.tokenize(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_logit_bias_bans_the_greedy_token(client: openai.OpenAI, tiny_server: RunningServer) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    greedy = plain.choices[0].logprobs.tokens[0]
    tid = _token_id(tiny_server, greedy)
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(tid): -100})
    assert banned.choices[0].logprobs.tokens[0] != greedy
    # a chat request: the greedy first token of the reply is banned too
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0, logprobs=True)
    first = chat.choices[0].logprobs.content[0].token
    again = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, temperature=0, logprobs=True,
                                           logit_bias={str(_token_id(tiny_server, first)): -100})
    assert again.choices[0].logprobs.content[0].token != first
    # +100 makes a chosen token win every step
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(tid): 100})
    assert forced.choices[0].text == greedy * 3


@pytest.mark.parametrize(("bias", "field"), [
    ({"5": 101}, "logit_bias.5"), ({"5": -100.5}, "logit_bias.5"), ({"abc": 1}, "logit_bias.abc"),
    ({"-1": 1}, "logit_bias.-1"), ({"99999999": 1}, "logit_bias.99999999"), ({"5": "x"}, "logit_bias.5"),
    ([1, 2], "logit_bias"),
])
def test_logit_bias_validation(tiny_server: RunningServer, bias: Any, field: str) -> None:
    for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": HI})):
        r = post(tiny_server, path, {"model": MODEL, "max_tokens": 2, "logit_bias": bias, **extra})
        assert r.status_code in (400, 422), r.text
        err = r.json()["error"]
        assert err["param"] == field and "logit_bias" in err["message"]


# -- usage in streams --------------------------------------------------------------------------------
@pytest.mark.parametrize("include", [True, False])
def test_stream_usage_exactly_once(client: openai.OpenAI, tiny_server: RunningServer, include: bool) -> None:
    full = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0)
    opts = {"include_usage": True} if include else None
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0,
                                                 stream=True, stream_options=opts))
    with_usage = [c for c in chunks if c.usage is not None]
    if include:
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1].choices == []
        assert with_usage[0].usage.model_dump(exclude_none=True) == full.usage.model_dump(exclude_none=True)
    else:
        assert with_usage == []
    assert chunks[-1 if not include else -2].choices[0].finish_reason == full.choices[0].finish_reason
    done = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=5, temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=5,
                                              temperature=0, stream=True, stream_options=opts))
    with_usage = [c for c in streamed if c.usage is not None]
    if include:
        assert len(with_usage) == 1 and streamed[-1].choices == []
        assert streamed[-1].usage.model_dump(exclude_none=True) == done.usage.model_dump(exclude_none=True)
    else:
        assert with_usage == []


def test_langchain_usage_equals_server_usage(tiny_server: RunningServer, client: openai.OpenAI) -> None:
    from langchain_core.callbacks import get_usage_metadata_callback
    from langchain_openai import ChatOpenAI

    server = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=7, temperature=0,
                                            extra_body={"ignore_eos": True})
    llm = ChatOpenAI(model=MODEL, base_url=tiny_server.url + "/v1", api_key="x", temperature=0, max_tokens=7,
                     stream_usage=True, max_retries=0, extra_body={"ignore_eos": True})
    for streaming in (True, False):
        with get_usage_metadata_callback() as cb:
            if streaming:
                for _ in llm.stream(HI[0]["content"]):
                    pass
            else:
                llm.invoke(HI[0]["content"])
        (usage,) = cb.usage_metadata.values()
        assert usage["input_tokens"] == server.usage.prompt_tokens, streaming
        assert usage["output_tokens"] == server.usage.completion_tokens == 7, streaming
        assert usage["total_tokens"] == server.usage.total_tokens, streaming


# -- messages the API accepts ------------------------------------------------------------------------
def _chat(server: RunningServer, messages: list[dict[str, Any]]) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3,
                                                 "temperature": 0})


def test_developer_role_is_system(tiny_server: RunningServer) -> None:
    dev = _chat(tiny_server, [{"role": "developer", "content": "Be terse."}, *HI])
    system = _chat(tiny_server, [{"role": "system", "content": "Be terse."}, *HI])
    assert dev.status_code == 200, dev.text
    assert dev.json()["usage"] == system.json()["usage"]
    assert dev.json()["choices"][0]["message"] == system.json()["choices"][0]["message"]


def test_empty_and_list_content(tiny_server: RunningServer) -> None:
    empty = _chat(tiny_server, [{"role": "system", "content": ""}, {"role": "user", "content": ""}])
    assert empty.status_code == 200, empty.text
    parts = _chat(tiny_server, [{"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                                              {"type": "text", "text": "who are you?"}]}])
    whole = _chat(tiny_server, HI)
    assert parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["message"] == whole.json()["choices"][0]["message"]
    assert parts.json()["usage"] == whole.json()["usage"]
    empty_part = _chat(tiny_server, [{"role": "user", "content": [{"type": "text", "text": ""}]}])
    assert empty_part.status_code == 200, empty_part.text
    image = _chat(tiny_server, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert image.status_code in (400, 422) and image.json()["error"]["param"] == "messages[0].content[0].type"


def test_assistant_tool_calls_with_null_content(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    r = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ])
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": None}])


# -- echo with prompt logprobs -------------------------------------------------------------------------
def _score(server: RunningServer, prompt: Any, **extra: Any) -> dict[str, Any]:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2,
                                         "max_tokens": 0, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_max_tokens_zero_scores_every_prompt_token(tiny_server: RunningServer) -> None:
    ids = tiny_server.host.tokenize(PROMPT)
    body = _score(tiny_server, PROMPT)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) <= 2 and max(t.values()) >= lp["token_logprobs"][j + 1] - 1e-5
               for j, t in enumerate(lp["top_logprobs"][1:]))
    # each logprob is the model's: generating from the prefix gives the same number for the same token
    k = 5
    step = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": ids[:k], "max_tokens": 1,
                                                 "temperature": 0, "logprobs": 20}).json()
    top = step["choices"][0]["logprobs"]["top_logprobs"][0]
    token_text = lp["tokens"][k]
    if token_text in top:
        assert top[token_text] == pytest.approx(lp["token_logprobs"][k], abs=1e-4)
    # max_tokens 1 with echo: the prompt's entries, then the generated token's
    one = _score(tiny_server, ids, max_tokens=1)["choices"][0]
    assert one["logprobs"]["token_logprobs"][: len(ids)] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert len(one["logprobs"]["tokens"]) == len(ids) + 1


def test_echo_streams_the_prompt_first(tiny_server: RunningServer) -> None:
    whole = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 4,
                                                  "temperature": 0, "logprobs": 1}).json()["choices"][0]
    r = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 4,
                                              "temperature": 0, "logprobs": 1, "stream": True})
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    streamed_lps = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed_lps[0] is None
    assert streamed_lps[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-5)
    zero = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                 "stream": True})
    events = [e for e in sse_events(zero.text) if e != "[DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_zero_needs_echo(tiny_server: RunningServer) -> None:
    r = post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert r.status_code in (400, 422) and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_with_one_token_splitfuse_chunks(tiny_model, tiny_server: RunningServer) -> None:
    """A prompt fed one token per step by splitfuse scores exactly like one fed whole."""
    ids = tiny_server.host.tokenize(PROMPT)
    reference = _score(tiny_server, ids)["choices"][0]["logprobs"]
    sched = {"templateType": "Mix", "enableSplit": True, "splitChunkTokens": 1, "splitStartBatchSize": 0,
             "splitType": False}
    cfg = server_config(tiny_model, model={"plugin_params": json.dumps({"plugin_type": "splitfuse"})},
                        schedule=sched)
    with RunningServer(cfg) as server:
        chunked = _score(server, ids)["choices"][0]["logprobs"]
    assert chunked["token_logprobs"][0] is None
    assert chunked["token_logprobs"][1:] == pytest.approx(reference["token_logprobs"][1:], abs=1e-4)
    assert chunked["tokens"] == reference["tokens"]
