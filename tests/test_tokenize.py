"""Tokenizer routes against the real server: MindIE's ``POST /v1/tokenizer`` and vLLM's ``/tokenize`` and
``/detokenize``, checked against the model's own tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mindie_host.testing import RunningServer

MODEL = "tiny"


def post(server: RunningServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_mindie_token_count(tiny_server: RunningServer) -> None:
    tok = tiny_server.host.tokenizer
    text = "The capital of France is Paris."
    r = post(tiny_server, "/v1/tokenizer", {"inputs": text})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode(text)
    assert body == {"token_number": len(ids), "tokens": [tok.decode([i]) for i in ids]}
    assert "".join(body["tokens"]) == text
    # a CJK character made of several byte tokens is one piece; the count still counts every token
    cjk = "你好，世界"
    body = post(tiny_server, "/v1/tokenizer", {"inputs": cjk}).json()
    assert body["token_number"] == len(tok.encode(cjk))
    assert "".join(body["tokens"]) == cjk and all("\ufffd" not in p for p in body["tokens"])
    assert len(body["tokens"]) <= body["token_number"]
    assert post(tiny_server, "/v1/tokenizer", {"inputs": ""}).json() == {"token_number": 0, "tokens": []}


@pytest.mark.parametrize(("body", "field"), [
    ({}, "inputs"), ({"inputs": 5}, "inputs"), ({"inputs": None}, "inputs"),
    ({"inputs": "x" * (4 * 1024 * 1024 + 1)}, "inputs"), ({"inputs": "x", "other": 1}, "other"),
])
def test_mindie_token_count_errors(tiny_server: RunningServer, body: dict[str, Any], field: str) -> None:
    r = post(tiny_server, "/v1/tokenizer", body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["field"] == field and "error" in r.json()


def test_vllm_tokenize_prompt_and_messages(tiny_server: RunningServer) -> None:
    host = tiny_server.host
    text = "Hello there, general Kenobi"
    r = post(tiny_server, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    ids = host.tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": host.config.deploy.maxSeqLen, "tokens": ids}
    strs = post(tiny_server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == host.tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = post(tiny_server, "/tokenize", {"model": MODEL, "messages": messages}).json()
    rendered = host.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == host.tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["count"] == len(chat["tokens"])
    # the chat request's prompt_tokens agree with /tokenize
    done = post(tiny_server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"]
    bare = post(tiny_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]


def test_vllm_detokenize_round_trip(tiny_server: RunningServer) -> None:
    text = "Round trips are nice. 你好"
    ids = post(tiny_server, "/tokenize", {"prompt": text}).json()["tokens"]
    r = post(tiny_server, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert post(tiny_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(("path", "body", "field", "status"), [
    ("/tokenize", {"model": "nope", "prompt": "x"}, "model", 404),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages", 400),
    ("/tokenize", {}, "prompt", 400),
    ("/tokenize", {"prompt": 3}, "prompt", 422),
    ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate", 400),
    ("/tokenize", {"messages": [{"role": "bogus", "content": "x"}]}, "messages[0].role", 422),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]", 400),
    ("/detokenize", {"tokens": [10**9]}, "tokens[0]", 400),
    ("/detokenize", {"tokens": "abc"}, "tokens", 400),
])
def test_vllm_routes_refuse_bad_input(tiny_server: RunningServer, path: str, body: dict[str, Any], field: str,
                                      status: int) -> None:
    r = post(tiny_server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field
