"""vLLM 0.2.6 ``POST /generate`` against the real server, with the spec's example bodies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mindie_host.testing import RunningServer, server_config

PROMPT = "My name is Olivier and I"
SPEC_BODY = {
    "prompt": PROMPT, "max_tokens": 20, "repetition_penalty": 1.03, "presence_penalty": 1.2,
    "frequency_penalty": 1.2, "temperature": 0.5, "top_p": 0.95, "top_k": 10, "seed": None, "stream": False,
    "stop": None, "stop_token_ids": None, "model": "None", "include_stop_str_in_output": False,
    "skip_special_tokens": True, "ignore_eos": False,
}


def nul_chunks(raw: bytes) -> list[dict]:
    """The stream: JSON objects, each followed by a NUL byte."""
    assert raw.endswith(b"\0")
    return [json.loads(part) for part in raw[:-1].split(b"\0")]


@pytest.fixture(scope="module")
def full_text_server(tiny_model: Path) -> Iterator[RunningServer]:
    with RunningServer(server_config(tiny_model, server={"fullTextEnabled": True})) as server:
        yield server


def post(server: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=60)


def test_spec_example_non_stream(tiny_server: RunningServer) -> None:
    r = post(tiny_server, SPEC_BODY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["text"] and len(body["text"]) == 1
    assert body["text"][0].startswith(PROMPT) and len(body["text"][0]) > len(PROMPT)


def test_stream_is_nul_separated_deltas(tiny_server: RunningServer) -> None:
    greedy = {"prompt": PROMPT, "max_tokens": 8}
    whole = post(tiny_server, greedy).json()["text"][0]
    r = post(tiny_server, {**greedy, "stream": True})
    assert r.status_code == 200
    assert not r.content.startswith(b"data:") and b"[DONE]" not in r.content
    chunks = nul_chunks(r.content)
    assert all(list(c) == ["text"] and len(c["text"]) == 1 for c in chunks)
    assert PROMPT + "".join(c["text"][0] for c in chunks) == whole


def test_spec_example_stream(tiny_server: RunningServer) -> None:
    r = post(tiny_server, {**SPEC_BODY, "stream": True, "seed": 7})
    chunks = nul_chunks(r.content)
    again = nul_chunks(post(tiny_server, {**SPEC_BODY, "stream": True, "seed": 7}).content)
    assert chunks == again  # same seed, same sample


def test_full_text_stream_is_cumulative(full_text_server: RunningServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8}
    whole = post(full_text_server, body).json()["text"][0]
    chunks = [c["text"][0] for c in nul_chunks(post(full_text_server, {**body, "stream": True}).content)]
    assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:]))
    assert PROMPT + chunks[-1] == whole


def test_seed_determinism(tiny_server: RunningServer) -> None:
    def run(seed: int) -> str:
        return post(tiny_server, {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.5, "seed": seed}).json()["text"][0]

    assert run(42) == run(42)
    assert run(42) != run(4242)


def test_top_k_minus_one_and_stop_token_ids(tiny_server: RunningServer) -> None:
    base = post(tiny_server, {"prompt": PROMPT, "max_tokens": 6}).json()["text"][0]
    assert post(tiny_server, {"prompt": PROMPT, "max_tokens": 6, "top_k": -1, "temperature": 0}).json()["text"][0] == base
    ids = tiny_server.host.tokenize(base[len(PROMPT):], add_special_tokens=False)
    stopped = post(tiny_server, {"prompt": PROMPT, "max_tokens": 6, "stop_token_ids": [ids[1], 2**40]})
    assert stopped.status_code == 200  # out-of-int32 ids are ignored
    assert stopped.json()["text"][0] == PROMPT + tiny_server.host.tokenizer.decode(ids[:1])


def test_stop_string(tiny_server: RunningServer) -> None:
    base = post(tiny_server, {"prompt": PROMPT, "max_tokens": 10}).json()["text"][0][len(PROMPT):]
    stop = base[len(base) // 2:][:3]
    out = post(tiny_server, {"prompt": PROMPT, "max_tokens": 10, "stop": stop}).json()["text"][0]
    assert out == PROMPT + base[: base.index(stop)]
    kept = post(tiny_server, {"prompt": PROMPT, "max_tokens": 10, "stop": [stop],
                              "include_stop_str_in_output": True}).json()["text"][0]
    assert kept == PROMPT + base[: base.index(stop) + len(stop)]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1),
    ("top_k", 0),
    ("top_k", -2),
    ("top_p", 0),
    ("top_p", 1.01),
    ("repetition_penalty", 0),
    ("repetition_penalty", 2.5),
    ("presence_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("seed", 0),
    ("max_tokens", 0),
    ("stop", ""),
    ("stop", ["x" * 40000]),
    ("stream", "true"),
    ("prompt", ""),
    ("prompt", 5),
    ("ignore_eos", 1),
])
def test_bad_field_is_422(tiny_server: RunningServer, field: str, value: object) -> None:
    r = post(tiny_server, {"prompt": PROMPT, field: value})
    assert r.status_code == 422, r.text
    assert r.json()["field"].split("[")[0] == field


def test_unknown_lora_is_404(tiny_server: RunningServer) -> None:
    r = post(tiny_server, {"prompt": PROMPT, "model": "my-lora"})
    assert r.status_code == 404 and r.json()["field"] == "model" and "my-lora" in r.json()["error"]
    assert post(tiny_server, {"prompt": PROMPT, "model": "tiny", "max_tokens": 2}).status_code == 200


def test_do_sample_is_not_validated(tiny_server: RunningServer) -> None:
    assert post(tiny_server, {"prompt": PROMPT, "max_tokens": 2, "do_sample": "anything"}).status_code == 200


def test_disconnect_mid_stream_frees_blocks(tiny_server: RunningServer) -> None:
    aborted = tiny_server.wait_idle().get("finished_abort", 0)
    with httpx.stream("POST", tiny_server.url + "/generate", json={"prompt": PROMPT, "max_tokens": 500, "stream": True},
                      timeout=60) as r:
        assert next(r.iter_bytes())
    stats = tiny_server.wait_idle()
    assert stats["num_active_requests"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["finished_abort"] == aborted + 1
