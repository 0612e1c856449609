"""MindIE native API against the real server: /infer, /infer_token, stopInfer, getSlotCount."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mindie_host.server.native import CLIENT_IDS
from mindie_host.testing import RunningServer, server_config

PROMPT = "My name is Olivier and I"
SPEC_PARAMS = {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20, "do_sample": True, "seed": None,
               "repetition_penalty": 1.03, "details": True, "typical_p": 0.5, "watermark": False, "priority": 5,
               "timeout": 10}


def native_events(text: str) -> list[dict]:
    """``data: {...}`` (with a space) blocks separated by blank lines."""
    blocks = [b.strip("\n") for b in text.split("\n\n") if b.strip()]
    assert all(b.startswith("data: {") for b in blocks), blocks
    return [json.loads(b[len("data: "):]) for b in blocks]


@pytest.fixture(scope="module")
def full_text_server(tiny_model: Path) -> Iterator[RunningServer]:
    with RunningServer(server_config(tiny_model, server={"fullTextEnabled": True})) as server:
        yield server


def infer(server: RunningServer, body: dict, path: str = "/infer") -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_infer_spec_example(tiny_server: RunningServer) -> None:
    r = infer(tiny_server, {"inputs": PROMPT, "stream": False, "parameters": SPEC_PARAMS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["generated_text", "details"]
    d = body["details"]
    assert list(d) == ["finish_reason", "generated_tokens", "seed"]
    assert d["finish_reason"] in ("length", "eos_token") and 1 <= d["generated_tokens"] <= 20
    assert isinstance(d["seed"], int) and d["seed"] > 0
    plain = infer(tiny_server, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}).json()
    assert list(plain) == ["generated_text"]


def test_infer_stream_format(tiny_server: RunningServer) -> None:
    params = {"max_new_tokens": 6, "details": True}
    whole = infer(tiny_server, {"inputs": PROMPT, "parameters": params}).json()
    r = infer(tiny_server, {"inputs": PROMPT, "stream": True, "parameters": params})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text
    events = native_events(r.text)
    first, last = events[0], events[-1]
    assert isinstance(first["prefill_time"], float) and first["decode_time"] is None
    for e in events[:-1]:
        assert list(e) == ["prefill_time", "decode_time", "token"]
        assert set(e["token"]) == {"id", "text"} and isinstance(e["token"]["text"], str)
    for e in events[1:]:
        assert e["prefill_time"] is None and isinstance(e["decode_time"], float)
    assert list(last) == ["prefill_time", "decode_time", "generated_text", "details", "token"]
    assert last["token"]["text"] is None and isinstance(last["token"]["id"], int)
    assert last["generated_text"] == whole["generated_text"]
    assert last["details"] == {**whole["details"], "seed": last["details"]["seed"]}
    assert whole["generated_text"].startswith("".join(e["token"]["text"] for e in events[:-1]))


def test_infer_token_matches_infer(tiny_server: RunningServer) -> None:
    ids = tiny_server.host.tokenize(PROMPT)
    params = {"max_new_tokens": 5, "details": True}
    a = infer(tiny_server, {"input_id": ids, "stream": False, "parameters": params}, "/infer_token").json()
    b = infer(tiny_server, {"inputs": PROMPT, "parameters": params}).json()
    assert a["generated_text"] == b["generated_text"]
    assert a["details"]["generated_tokens"] == b["details"]["generated_tokens"]
    r = infer(tiny_server, {"input_id": ids, "stream": True, "parameters": params}, "/infer_token")
    assert native_events(r.text)[-1]["generated_text"] == a["generated_text"]


def test_full_text_stream_is_cumulative(full_text_server: RunningServer) -> None:
    r = infer(full_text_server, {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 6}})
    events = native_events(r.text)
    texts = [e["token"]["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert events[-1]["token"]["text"] is None
    assert events[-1]["generated_text"].startswith(texts[-1])


def test_seed_determinism(tiny_server: RunningServer) -> None:
    def run(seed: int) -> dict:
        params = {"do_sample": True, "temperature": 1.5, "seed": seed, "max_new_tokens": 8, "details": True}
        return infer(tiny_server, {"inputs": PROMPT, "parameters": params}).json()

    a, b, c = run(5), run(5), run(55)
    assert a == b and a["details"]["seed"] == 5
    assert a["generated_text"] != c["generated_text"]


@pytest.mark.parametrize("path,body,field", [
    ("/infer", {"inputs": PROMPT, "parameters": {"top_p": 1.0}}, "parameters.top_p"),
    ("/infer", {"inputs": PROMPT, "parameters": {"top_k": 0}}, "parameters.top_k"),
    ("/infer", {"inputs": PROMPT, "parameters": {"temperature": 0}}, "parameters.temperature"),
    ("/infer", {"inputs": PROMPT, "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ("/infer", {"inputs": PROMPT, "parameters": {"seed": 0}}, "parameters.seed"),
    ("/infer", {"inputs": PROMPT, "parameters": {"priority": 6}}, "parameters.priority"),
    ("/infer", {"inputs": PROMPT, "parameters": {"priority": 0}}, "parameters.priority"),
    ("/infer", {"inputs": PROMPT, "parameters": {"timeout": 0}}, "parameters.timeout"),
    ("/infer", {"inputs": PROMPT, "parameters": {"timeout": 3601}}, "parameters.timeout"),
    ("/infer", {"inputs": PROMPT, "parameters": {"typical_p": 0}}, "parameters.typical_p"),
    ("/infer", {"inputs": PROMPT, "parameters": {"repetition_penalty": -1}}, "parameters.repetition_penalty"),
    ("/infer", {"inputs": ""}, "inputs"),
    ("/infer", {"stream": True}, "inputs"),
    ("/infer", {"inputs": PROMPT, "stream": 1}, "stream"),
    ("/infer", {"inputs": PROMPT, "id": ""}, "id"),
    ("/infer_token", {"input_id": []}, "input_id"),
    ("/infer_token", {"input_id": [1, -1]}, "input_id[1]"),
    ("/infer_token", {"input_id": [1, 1024 * 1024 + 1]}, "input_id[1]"),
    ("/infer_token", {"input_id": [1, 2], "parameters": {"top_k": 0}, "stream": True}, "parameters.top_k"),
    ("/infer_token", {"inputs": PROMPT}, "input_id"),
    ("/infer_token", {"input_id": [1] * 800}, "input_id"),  # over maxInputTokenLen
])
def test_bad_input_is_422(tiny_server: RunningServer, path: str, body: dict, field: str) -> None:
    r = infer(tiny_server, body, path)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field and r.json()["error"]


def test_input_id_outside_vocab_is_422(tiny_server: RunningServer) -> None:
    vocab = tiny_server.host.vocab_size
    r = infer(tiny_server, {"input_id": [1, vocab]}, "/infer_token")
    assert r.status_code == 422 and r.json()["field"] == "input_id"


def test_stop_infer_stops_a_long_generation(tiny_server: RunningServer) -> None:
    aborted = tiny_server.wait_idle().get("finished_abort", 0)
    body = {"id": "long-one", "inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 500, "details": True}}
    with httpx.stream("POST", tiny_server.url + "/infer", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        # a second request with the same id while the first runs is refused
        dup = infer(tiny_server, {**body, "stream": False})
        assert dup.status_code == 422 and dup.json()["field"] == "id"
        stop = httpx.post(tiny_server.url + "/v2/models/tiny/stopInfer", json={"id": "long-one"})
        assert stop.status_code == 200 and stop.json() == {"id": "long-one"}
        rest = "\n".join(lines)
    last = native_events(rest)[-1]
    assert last["details"]["finish_reason"] == "stop_sequence"
    assert last["details"]["generated_tokens"] < 500
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["finished_abort"] == aborted + 1


def test_stop_infer_non_stream(tiny_server: RunningServer) -> None:
    result: dict = {}

    def run() -> None:
        body = {"id": "long-two", "inputs": PROMPT, "parameters": {"max_new_tokens": 500, "details": True}}
        result["r"] = infer(tiny_server, body)

    t = threading.Thread(target=run)
    t.start()
    stopped = None
    for _ in range(200):
        stopped = httpx.post(tiny_server.url + "/v2/models/tiny/stopInfer", json={"id": "long-two"})
        if stopped.status_code == 200:
            break
        t.join(0.01)
    t.join(60)
    assert stopped is not None and stopped.status_code == 200
    body = result["r"].json()
    assert body["details"]["finish_reason"] == "stop_sequence" and body["details"]["generated_tokens"] < 500
    assert tiny_server.wait_idle()["kv_blocks_used"] == 0


@pytest.mark.parametrize("model,body,status,field", [
    ("tiny", {"id": "nobody-runs-this"}, 404, "id"),
    ("tiny", {}, 422, "id"),
    ("tiny", {"id": 5}, 422, "id"),
    ("tiny", {"id": "x" * 257}, 422, "id"),
    ("other-model", {"id": "a123"}, 404, "model"),
])
def test_stop_infer_errors(tiny_server: RunningServer, model: str, body: dict, status: int, field: str) -> None:
    r = httpx.post(tiny_server.url + f"/v2/models/{model}/stopInfer", json=body)
    assert r.status_code == status and r.json()["field"] == field


def test_slot_count(tiny_server: RunningServer) -> None:
    stats = tiny_server.wait_idle()
    r = httpx.get(tiny_server.management_url + "/v2/models/tiny/getSlotCount")
    assert r.status_code == 200
    body = r.json()
    assert list(body) == ["total_slots", "free_slots", "available_tokens_length"]
    cfg = tiny_server.host.config.schedule
    assert body["total_slots"] == body["free_slots"] == cfg.maxBatchSize
    assert body["available_tokens_length"] == stats["kv_blocks_total"] * cfg.cacheBlockSize
    body = {"id": "slot-user", "inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 500}}
    with httpx.stream("POST", tiny_server.url + "/infer", json=body, timeout=60) as s:
        lines = s.iter_lines()  # keep a reference: a collected iterator closes the connection
        next(lines)
        busy = httpx.get(tiny_server.management_url + "/v2/models/tiny/getSlotCount").json()
        httpx.post(tiny_server.url + "/v2/models/tiny/stopInfer", json={"id": "slot-user"})
    assert busy["free_slots"] == cfg.maxBatchSize - 1
    assert busy["available_tokens_length"] < stats["kv_blocks_total"] * cfg.cacheBlockSize
    missing = httpx.get(tiny_server.management_url + "/v2/models/other/getSlotCount")
    assert missing.status_code == 404 and missing.json()["field"] == "model"


def test_stop_infer_stops_a_triton_generate_stream(tiny_server: RunningServer) -> None:
    aborted = tiny_server.wait_idle().get("finished_abort", 0)
    body = {"id": "a123", "text_input": PROMPT, "parameters": {"max_new_tokens": 500, "details": True}}
    with httpx.stream("POST", tiny_server.url + "/v2/models/tiny/generate_stream", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        stop = httpx.post(tiny_server.url + "/v2/models/tiny/stopInfer", json={"id": "a123"})
        assert stop.status_code == 200 and stop.json() == {"id": "a123"}
        events = [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]
    assert len(events) < 499
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["finished_abort"] == aborted + 1
    again = httpx.post(tiny_server.url + "/v2/models/tiny/stopInfer", json={"id": "a123"})
    assert again.status_code == 404
    assert tiny_server.host.caches.get(CLIENT_IDS).engine_ids("a123") == []  # finished requests are forgotten
