"""Triton / KServe v2 against the real server: tritonclient[http] (JSON and binary tensors),
raw binary requests, metadata/config/ready, and the generate extension (JSON and SSE)."""

from __future__ import annotations

import json
import struct

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

MODEL = "tiny"


def hostport(url: str) -> str:
    return url.split("://", 1)[1]


@pytest.fixture(scope="module")
def client(tiny_server):
    c = triton.InferenceServerClient(url=hostport(tiny_server.url))
    yield c
    c.close()


@pytest.fixture(scope="module")
def mgmt_client(tiny_server):
    c = triton.InferenceServerClient(url=hostport(tiny_server.management_url))
    yield c
    c.close()


@pytest.fixture(scope="module")
def prompt_ids(tiny_server):
    return tiny_server.host.tokenize("The capital of France is", add_special_tokens=False)


def sse_events(text: str) -> list[dict]:
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data:") and not block.startswith("data: "), block
        events.append(json.loads(block[len("data:"):]))
    return events


# -- metadata, config, health ----------------------------------------------------------------
def test_health_and_ready_on_management(mgmt_client, client):
    assert mgmt_client.is_server_live()
    assert mgmt_client.is_server_ready()
    assert mgmt_client.is_model_ready(MODEL)
    assert not mgmt_client.is_model_ready("no-such-model")


def test_server_metadata(tiny_server):
    r = httpx.get(tiny_server.url + "/v2")
    assert r.status_code == 200
    body = r.json()
    assert body["name"] == "MindIE Server"
    ext = body["extensions"]
    sched = tiny_server.host.config.schedule
    assert ext["max_iter_times"] == sched.maxIterTimes
    assert ext["max_prefill_tokens"] == sched.maxPrefillTokens
    assert set(ext) == {"max_iter_times", "prefill_policy_type", "decode_policy_type", "max_prefill_batch_size",
                        "max_prefill_tokens"}


def test_model_metadata_and_config(client, tiny_server):
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["platform"] == "MindIE Server"
    assert meta["inputs"] == [{"name": "input0", "shape": [-1], "datatype": "UINT32"}]
    assert meta["outputs"] == [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]
    cfg = client.get_model_config(MODEL)
    assert cfg["model_name"] == MODEL
    assert cfg["max_seq_len"] == tiny_server.host.config.deploy.maxSeqLen
    assert cfg["world_size"] == 1 and cfg["model_instance_type"] == "Standard"
    assert "/" not in cfg["model_weight_path"] and cfg["model_weight_path"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")
    assert httpx.get(tiny_server.url + "/v2/models/nope/config").status_code == 404


# -- token inference -------------------------------------------------------------------------
def _infer(client, ids, *, binary_in: bool, binary_out: bool, max_new: int = 6, model: str = MODEL):
    inp = triton.InferInput("input0", [1, len(ids)], "UINT32")
    inp.set_data_from_numpy(np.asarray([ids], dtype=np.uint32), binary_data=binary_in)
    out = triton.InferRequestedOutput("output0", binary_data=binary_out)
    return client.infer(model, [inp], outputs=[out], request_id="req-1",
                        parameters={"max_new_tokens": max_new, "temperature": 0.5, "top_k": 1})


@pytest.mark.parametrize("binary_in", [False, True])
@pytest.mark.parametrize("binary_out", [False, True])
def test_infer_json_and_binary(client, prompt_ids, binary_in, binary_out):
    res = _infer(client, prompt_ids, binary_in=binary_in, binary_out=binary_out)
    ids = res.as_numpy("output0")
    assert ids.dtype == np.uint32 and ids.shape == (1, 6)
    response = res.get_response()
    assert response["id"] == "req-1"
    entry = response["outputs"][0]
    assert entry["datatype"] == "UINT32" and entry["shape"] == [1, 6]
    assert ("data" in entry) is (not binary_out)
    if binary_out:
        assert entry["parameters"]["binary_data_size"] == 24
    # top_k 1 is greedy: every encoding gives the same tokens
    again = _infer(client, prompt_ids, binary_in=not binary_in, binary_out=not binary_out)
    assert again.as_numpy("output0").tolist() == ids.tolist()


def test_infer_raw_binary_request(tiny_server, client, prompt_ids):
    raw = np.asarray(prompt_ids, dtype="<u4").tobytes()
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/infer", content=raw,
                   headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    head_len = int(r.headers["Inference-Header-Content-Length"])
    header = json.loads(r.content[:head_len])
    entry = header["outputs"][0]
    size = entry["parameters"]["binary_data_size"]
    assert "data" not in entry and len(r.content) == head_len + size
    ids = np.frombuffer(r.content[head_len:], dtype="<u4")
    assert entry["shape"] == [1, len(ids)] and len(ids) == 20  # max_new_tokens defaults to 20
    greedy = _infer(client, prompt_ids, binary_in=False, binary_out=False, max_new=20)
    assert greedy.as_numpy("output0")[0].tolist() == ids.tolist()  # no parameters: greedy


def test_infer_binary_request_by_hand(tiny_server, prompt_ids):
    header = {"id": "abc_1", "inputs": [{"name": "input0", "shape": [len(prompt_ids)], "datatype": "UINT32",
                                         "parameters": {"binary_data_size": 4 * len(prompt_ids)}}],
              "outputs": [{"name": "out"}], "parameters": {"binary_data_output": True, "max_new_tokens": 3}}
    head = json.dumps(header).encode()
    body = head + struct.pack(f"<{len(prompt_ids)}I", *prompt_ids)
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/infer", content=body,
                   headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 200, r.text
    hl = int(r.headers["Inference-Header-Content-Length"])
    resp = json.loads(r.content[:hl])
    assert resp["id"] == "abc_1" and resp["outputs"][0]["name"] == "out"
    assert len(r.content) - hl == 12


@pytest.mark.parametrize(
    ("mutate", "field", "status"),
    [
        (lambda b: b["inputs"][0].update(name="x"), "inputs[0].name", 422),
        (lambda b: b["inputs"][0].update(datatype="FP32", data=[1.0, 2.0]), "inputs[0].datatype", 422),
        (lambda b: b["inputs"][0].update(shape=[2, 1], data=[1, 2]), "inputs[0].shape", 422),
        (lambda b: b["inputs"][0].update(shape=[1, 2], data=[1, 10**6]), "inputs[0].data", 422),
        (lambda b: b.update(inputs=[]), "inputs", 422),
        (lambda b: b.pop("outputs"), "outputs", 422),
        (lambda b: b.update(id="bad id!"), "id", 422),
        (lambda b: b["parameters"].update(temperature=0), "parameters.temperature", 422),
        (lambda b: b["parameters"].update(top_p=1.5), "parameters.top_p", 422),
        (lambda b: b["parameters"].update(priority=6), "parameters.priority", 422),
        (lambda b: b["parameters"].update(timeout=3601), "parameters.timeout", 422),
        (lambda b: b["parameters"].update(max_new_tokens=0), "parameters.max_new_tokens", 422),
        (lambda b: b["parameters"].update(seed=0), "parameters.seed", 422),
        (lambda b: b["inputs"][0].update(shape=[1, 3]), "inputs[0]", 400),
    ],
)
def test_infer_bad_inputs(tiny_server, mutate, field, status):
    body = {"inputs": [{"name": "input0", "shape": [1, 2], "datatype": "UINT32", "data": [1, 2]}],
            "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": 2, "seed": None}}
    mutate(body)
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/infer", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert isinstance(err["error"], str) and err["field"].startswith(field)


def test_infer_bad_framing_and_unknown_model(tiny_server, client, prompt_ids):
    url = tiny_server.url + f"/v2/models/{MODEL}/infer"
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["field"] == "body"
    r = httpx.post(url, content=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert r.status_code == 400 and r.json()["field"] == "Inference-Header-Content-Length"
    r = httpx.post(url, content=b"abc", headers={"Inference-Header-Content-Length": "0"})  # not whole uint32s
    assert r.status_code == 400
    with pytest.raises(InferenceServerException, match="unknown model"):
        _infer(client, prompt_ids, binary_in=True, binary_out=True, model="nope")


# -- generate extension ------------------------------------------------------------------------
def test_generate(tiny_server):
    body = {"id": "a123", "text_input": "My name is Olivier and I",
            "parameters": {"details": True, "do_sample": True, "max_new_tokens": 5, "repetition_penalty": 1.1,
                           "seed": 123, "temperature": 1, "top_k": 10, "top_p": 0.99, "batch_size": 100,
                           "typical_p": 0.5, "watermark": False, "perf_stat": True, "priority": 5, "timeout": 10}}
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    out = r.json()
    assert out["id"] == "a123" and out["model_name"] == MODEL and out["model_version"] is None
    d = out["details"]
    assert d["finish_reason"] in ("length", "eos_token") and d["first_token_cost"] is None
    assert len(d["perf_stat"]) == d["generated_tokens"] <= 5
    again = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/generate", json=body, timeout=60).json()
    assert again["text_output"] == out["text_output"]  # same seed, same text
    plain = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/generate",
                       json={"text_input": [{"type": "text", "text": "Hello"}]}, timeout=60).json()
    assert "details" not in plain and plain["id"]


def test_generate_stream_matches_generate(tiny_server):
    body = {"id": "s1", "text_input": "Once upon a time", "parameters": {"max_new_tokens": 8, "details": True,
                                                                         "perf_stat": True}}
    full = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/generate", json=body, timeout=60).json()
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/generate_stream", json=body, timeout=60)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert "[DONE]" not in r.text
    events = sse_events(r.text)
    assert "".join(e["text_output"] for e in events) == full["text_output"]
    assert all("finish_reason" not in e["details"] for e in events[:-1])
    last = events[-1]
    assert list(last["details"])[0] == "finish_reason"
    assert last["details"]["finish_reason"] == full["details"]["finish_reason"]
    assert last["details"]["generated_tokens"] == full["details"]["generated_tokens"]
    assert len(last["details"]["perf_stat"]) == last["details"]["generated_tokens"]
    assert events[0]["prefill_time"] is not None and events[0]["decode_time"] is None
    if len(events) > 1:
        assert events[1]["prefill_time"] is None and events[1]["decode_time"] is not None
    assert all(e["id"] == "s1" and e["model_version"] is None for e in events)


def test_generate_stream_full_text(tiny_model):
    from mindie_host.testing import RunningServer, server_config

    with RunningServer(server_config(tiny_model, server={"fullTextEnabled": True})) as srv:
        body = {"text_input": "Hello there", "parameters": {"max_new_tokens": 6}}
        full = httpx.post(srv.url + f"/v2/models/{MODEL}/generate", json=body, timeout=60).json()
        events = sse_events(httpx.post(srv.url + f"/v2/models/{MODEL}/generate_stream", json=body, timeout=60).text)
        texts = [e["text_output"] for e in events]
        assert texts[-1] == full["text_output"]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "text_input"),
        ({"text_input": ""}, "text_input"),
        ({"text_input": 5}, "text_input"),
        ({"text_input": [{"type": "image_url", "image_url": "/x.png"}]}, "text_input[0].type"),
        ({"text_input": "hi", "id": "x" * 257}, "id"),
        ({"text_input": "hi", "parameters": {"typical_p": -1.0}}, "parameters.typical_p"),
        ({"text_input": "hi", "parameters": {"top_k": -1}}, "parameters.top_k"),
        ({"text_input": "hi", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
        ({"text_input": "hi", "parameters": {"details": "yes"}}, "parameters.details"),
        ({"text_input": "hi", "parameters": {"decodeTime": [1, -2]}}, "parameters.decodeTime"),
        ({"text_input": "hi", "parameters": "x"}, "parameters"),
    ],
)
def test_generate_bad_inputs(tiny_server, route, body, field):
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/{route}", json=body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert isinstance(r.json()["error"], str) and r.json()["field"] == field


def test_generate_unknown_model_and_bad_json(tiny_server):
    r = httpx.post(tiny_server.url + "/v2/models/nope/generate_stream", json={"text_input": "hi"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(tiny_server.url + f"/v2/models/{MODEL}/generate", content=b"[1,2")
    assert r.status_code == 422 and r.json()["field"] == "body"


def test_stop_infer_ends_generate_stream(tiny_server):
    """``stopInfer`` (native module) aborts a Triton stream by its client id; the last event says so."""
    body = {"id": "stop-me", "text_input": "Count forever:", "parameters": {"max_new_tokens": 500}}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", tiny_server.url + f"/v2/models/{MODEL}/generate_stream", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[len("data:"):])["id"] == "stop-me"
            stop = http.post(tiny_server.url + f"/v2/models/{MODEL}/stopInfer", json={"id": "stop-me"})
            assert stop.status_code == 200, stop.text
            events = [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]
    assert events and events[-1]["details"]["finish_reason"] == "stop_sequence"
    assert events[-1]["details"]["generated_tokens"] < 500
