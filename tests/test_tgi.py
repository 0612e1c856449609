"""TGI 0.9.4 API against the real server: the official text-generation client and raw HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from text_generation import Client
from text_generation.errors import NotFoundError, ValidationError

from mindie_host.testing import RunningServer, server_config

PROMPT = "My name is Olivier and I"


def sse_events(text: str) -> list[dict]:
    """Parse a TGI SSE body: ``data: {...}`` blocks separated by blank lines."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [json.loads(b[len("data: "):]) for b in blocks]


@pytest.fixture(scope="module")
def full_text_server(tiny_model: Path) -> Iterator[RunningServer]:
    with RunningServer(server_config(tiny_model, server={"fullTextEnabled": True})) as server:
        yield server


@pytest.fixture
def client(tiny_server: RunningServer) -> Client:
    return Client(tiny_server.url, timeout=60)


# -- the official client -------------------------------------------------------------------------
def test_client_generate_details(client: Client, tiny_server: RunningServer) -> None:
    r = client.generate(PROMPT, max_new_tokens=6)
    tok = tiny_server.host.tokenizer
    d = r.details
    assert d.finish_reason.value in ("length", "eos_token")
    assert d.generated_tokens == len(d.tokens) <= 6
    assert d.prefill == []  # decoder_input_details not asked
    assert isinstance(d.seed, int) and d.seed > 0
    assert r.generated_text == tok.decode([t.id for t in d.tokens])
    assert all(isinstance(t.logprob, float) and t.logprob <= 0 for t in d.tokens)
    assert all(t.special is False for t in d.tokens)


def test_client_decoder_input_details(client: Client, tiny_server: RunningServer) -> None:
    r = client.generate(PROMPT, max_new_tokens=3, decoder_input_details=True)
    ids = tiny_server.host.tokenize(PROMPT)
    prefill = r.details.prefill
    assert [t.id for t in prefill] == ids
    assert prefill[0].logprob is None  # nothing precedes the first token
    assert all(isinstance(t.logprob, float) and t.logprob <= 0 for t in prefill[1:])
    assert "".join(t.text for t in prefill) == PROMPT


def test_client_generate_stream_matches_generate(client: Client) -> None:
    whole = client.generate(PROMPT, max_new_tokens=8)
    events = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == whole.generated_text
    assert last.details.finish_reason == whole.details.finish_reason
    assert last.details.generated_tokens == whole.details.generated_tokens
    streamed = "".join(e.token.text for e in events if not e.token.special)
    assert streamed == whole.generated_text
    if whole.details.finish_reason.value == "length":
        assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]


def test_client_best_of_picks_most_likely(client: Client) -> None:
    r = client.generate(PROMPT, max_new_tokens=6, best_of=3, do_sample=True, decoder_input_details=True)
    others = r.details.best_of_sequences
    assert others is not None and len(others) == 2

    def score(tokens: list) -> float:
        return sum(t.logprob for t in tokens)

    best = score(r.details.tokens)
    assert all(best >= score(o.tokens) for o in others)
    assert len({r.details.seed, *(o.seed for o in others)}) == 3
    assert all(len(o.prefill) == len(r.details.prefill) > 0 for o in others)


def test_client_validation_error(client: Client) -> None:
    with pytest.raises(ValidationError, match="max_new_tokens"):
        client.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(ValidationError, match="best_of"):
        client.generate(PROMPT, best_of=2, temperature=0.5)  # the client sends do_sample=false: greedy


def test_client_unknown_adapter(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "nolora"}})
    assert r.status_code == 404
    assert r.json()["field"] == "parameters.adapter_id" and "nolora" in r.json()["error"]
    with pytest.raises(NotFoundError):
        raise_from(r)


def raise_from(r: httpx.Response) -> None:
    from text_generation.errors import parse_error

    raise parse_error(r.status_code, r.json())


# -- raw HTTP ------------------------------------------------------------------------------------
SPEC_PARAMS = {
    "details": True, "decoder_input_details": True, "do_sample": True, "max_new_tokens": 20,
    "repetition_penalty": 1.03, "return_full_text": False, "seed": None, "temperature": 0.5, "top_k": 10,
    "top_p": 0.95, "truncate": None, "typical_p": 0.5, "watermark": False, "stop": ["stop1", "stop2"],
    "adapter_id": "None",
}


def test_root_non_stream_is_an_array(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/", json={"inputs": PROMPT, "parameters": SPEC_PARAMS, "stream": False},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and len(body) == 1
    d = body[0]["details"]
    assert list(d) == ["prompt_tokens", "finish_reason", "generated_tokens", "prefill", "seed", "tokens"]
    assert d["prompt_tokens"] == len(d["prefill"]) == len(tiny_server.host.tokenize(PROMPT))
    assert d["generated_tokens"] == len(d["tokens"]) <= 20
    assert set(d["tokens"][0]) == {"id", "text", "logprob", "special"}


def test_generate_object_and_no_details(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
                   timeout=60)
    assert r.status_code == 200
    assert list(r.json()) == ["generated_text"]
    full = httpx.post(tiny_server.url + "/generate",
                      json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "return_full_text": True}}, timeout=60)
    assert full.json()["generated_text"] == PROMPT + r.json()["generated_text"]


@pytest.mark.parametrize("path,extra", [("/generate_stream", {}), ("/", {"stream": True})])
def test_stream_format(tiny_server: RunningServer, path: str, extra: dict) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}, **extra}
    r = httpx.post(tiny_server.url + path, json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = sse_events(r.text)
    for e in events[:-1]:
        assert list(e) == ["token", "generated_text", "details"]
        assert e["generated_text"] is None and e["details"] is None
        assert set(e["token"]) == {"id", "text", "logprob", "special"}
    last = events[-1]
    assert list(last["details"]) == ["prompt_tokens", "finish_reason", "generated_tokens", "seed"]
    assert last["details"]["generated_tokens"] == len([e for e in events if not e["token"]["special"]])
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)


def test_stream_details_only_when_asked(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}},
                   timeout=60)
    last = sse_events(r.text)[-1]
    assert last["details"] is None and isinstance(last["generated_text"], str)


def test_seed_determinism(tiny_server: RunningServer) -> None:
    def run(seed: int) -> dict:
        params = {"do_sample": True, "temperature": 1.5, "seed": seed, "max_new_tokens": 8, "details": True}
        return httpx.post(tiny_server.url + "/generate", json={"inputs": PROMPT, "parameters": params},
                          timeout=60).json()

    a, b, c = run(1234), run(1234), run(98765)
    assert a["generated_text"] == b["generated_text"] and a["details"]["seed"] == 1234
    assert a["generated_text"] != c["generated_text"]
    assert run(2**64 - 1)["details"]["seed"] == 2**64 - 1  # the top of the range


def test_stop_sequence_and_truncate(tiny_server: RunningServer) -> None:
    url = tiny_server.url + "/generate"
    base = httpx.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10}}, timeout=60).json()
    text = base["generated_text"]
    stop = text[len(text) // 2:][:3]
    assert stop
    cut = httpx.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "stop": [stop],
                                                                  "details": True}}, timeout=60).json()
    assert cut["generated_text"] == text[: text.index(stop)]
    assert cut["details"]["finish_reason"] == "stop_sequence"
    short = httpx.post(url, json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "truncate": 3,
                                                                    "details": True}}, timeout=60).json()
    assert short["details"]["prompt_tokens"] == 3


BAD_PARAMS = [
    ({"temperature": 0}, "parameters.temperature"),
    ({"temperature": 1e-7}, "parameters.temperature"),
    ({"top_k": 0}, "parameters.top_k"),
    ({"top_k": 2**31}, "parameters.top_k"),
    ({"top_p": 1.0}, "parameters.top_p"),
    ({"top_p": 1e-6}, "parameters.top_p"),
    ({"typical_p": 0}, "parameters.typical_p"),
    ({"typical_p": 1.5}, "parameters.typical_p"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens"),
    ({"max_new_tokens": "5"}, "parameters.max_new_tokens"),
    ({"seed": 0}, "parameters.seed"),
    ({"seed": 2**64}, "parameters.seed"),
    ({"truncate": 0}, "parameters.truncate"),
    ({"stop": ["x" * 1025]}, "parameters.stop[0]"),
    ({"stop": ["a"] * 1025}, "parameters.stop"),
    ({"stop": ""}, "parameters.stop"),
    ({"adapter_id": "bad id!"}, "parameters.adapter_id"),
    ({"adapter_id": "x" * 257}, "parameters.adapter_id"),
    ({"best_of": 0}, "parameters.best_of"),
    ({"best_of": 2}, "parameters.best_of"),  # greedy
    ({"do_sample": "yes"}, "parameters.do_sample"),
    ({"details": 1}, "parameters.details"),
    ({"grammar": {"type": "json", "value": {}}}, "parameters.grammar"),
]


@pytest.mark.parametrize("params,field", BAD_PARAMS)
def test_bad_parameters_are_422(tiny_server: RunningServer, params: dict, field: str) -> None:
    for path, extra in (("/generate", {}), ("/", {"stream": False})):
        r = httpx.post(tiny_server.url + path, json={"inputs": PROMPT, "parameters": params, **extra}, timeout=60)
        assert r.status_code == 422, r.text
        body = r.json()
        assert body["error_type"] == "validation" and body["field"] == field, body
        assert field.split("[")[0].split(".")[-1] in body["error"]


@pytest.mark.parametrize("path,body,field", [
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"decoder_input_details": True}},
     "parameters.decoder_input_details"),
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"decoder_input_details": True}},
     "parameters.decoder_input_details"),
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"best_of": 2, "do_sample": True}}, "parameters.best_of"),
    ("/", {"inputs": PROMPT, "stream": "yes"}, "stream"),
    ("/generate_stream", {"inputs": ""}, "inputs"),
    ("/generate_stream", {"parameters": {}}, "inputs"),
    ("/", {"inputs": [{"type": "image_url", "image_url": "/x.png"}]}, "inputs[0].type"),
    ("/", {"inputs": PROMPT, "parameters": [1]}, "parameters"),
    ("/generate", {"inputs": PROMPT, "prompt": PROMPT}, "inputs,prompt"),
    ("/generate", {"parameters": {}}, "inputs,prompt"),
    ("/generate", {"inputs": "word " * 2000}, "inputs"),  # over maxInputTokenLen
])
def test_bad_bodies_are_422(tiny_server: RunningServer, path: str, body: dict, field: str) -> None:
    r = httpx.post(tiny_server.url + path, json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field


def test_not_json_is_422(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/generate_stream", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_inputs_as_text_parts(tiny_server: RunningServer) -> None:
    parts = [{"type": "text", "text": "My name is "}, {"type": "text", "text": "Olivier and I"}]
    a = httpx.post(tiny_server.url + "/generate", json={"inputs": parts, "parameters": {"max_new_tokens": 4}},
                   timeout=60).json()
    b = httpx.post(tiny_server.url + "/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4}},
                   timeout=60).json()
    assert a == b


def test_top_n_tokens(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/generate",
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True, "top_n_tokens": 2}},
                   timeout=60).json()
    tops = r["details"]["top_tokens"]
    assert len(tops) == 3 and all(len(t) == 2 for t in tops)
    assert all(tops[i][0]["logprob"] >= r["details"]["tokens"][i]["logprob"] - 1e-5 for i in range(3))


def test_info_and_health(tiny_server: RunningServer) -> None:
    info = httpx.get(tiny_server.management_url + "/info").json()
    cfg = tiny_server.host.config
    assert list(info)[-2:] == ["models", "max_input_length"]
    assert info["max_batch_total_tokens"] == cfg.schedule.maxPrefillTokens
    assert info["max_concurrent_requests"] == cfg.schedule.maxBatchSize
    assert info["max_input_length"] == cfg.deploy.maxInputTokenLen
    assert info["docker_label"] is None and info["sha"] is None
    model = info["models"][0]
    assert model["model_id"] == "tiny" and model["max_total_tokens"] == cfg.deploy.maxSeqLen
    assert model["model_pipeline_tag"] == "text-generation"
    health = httpx.get(tiny_server.management_url + "/health")
    assert health.status_code == 200 and health.content == b""


def test_full_text_stream_is_cumulative(full_text_server: RunningServer) -> None:
    r = httpx.post(full_text_server.url + "/generate_stream",
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6, "details": True}}, timeout=60)
    events = sse_events(r.text)
    texts = [e["token"]["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == events[-1]["generated_text"]
    client = Client(full_text_server.url, timeout=60)
    streamed = list(client.generate_stream(PROMPT, max_new_tokens=6))
    assert streamed[-1].token.text == streamed[-1].generated_text == texts[-1]


def test_disconnect_mid_stream_frees_blocks(tiny_server: RunningServer) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 500}}
    aborted = tiny_server.wait_idle().get("finished_abort", 0)
    with httpx.stream("POST", tiny_server.url + "/generate_stream", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    stats = tiny_server.wait_idle()
    assert stats["num_active_requests"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["finished_abort"] == aborted + 1


@pytest.mark.slow
def test_default_model_answers_and_ends_on_eos(default_server: RunningServer) -> None:
    tok = default_server.host.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                     add_generation_prompt=True)
    client = Client(default_server.url, timeout=120)
    whole = client.generate(prompt, max_new_tokens=64)
    assert "Paris" in whole.generated_text
    assert whole.details.finish_reason.value == "eos_token"
    events = list(client.generate_stream(prompt, max_new_tokens=64))
    last = events[-1]
    assert last.token.special and last.token.id in default_server.host.info.eos_token_ids and last.token.text == ""
    assert last.generated_text == whole.generated_text
    assert last.details.generated_tokens == len(events) - 1
