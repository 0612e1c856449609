"""One request pipeline: every protocol hands the same internal request to the host, and the rules live once.

The output length rule (``Host.new_request``), the body cap (``server/admission.py``) and the
finish-reason mapping (``server/outcome.py``) each live in one place, so every protocol answers
the same case the same way, in its own wire format.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.api import EngineRequest, RequestOutput, SamplingParams
from mindie_host.server.outcome import failure, finish_reason
from mindie_host.testing import RunningServer, server_config

PROMPT = "one two three four five six"


@pytest.fixture(scope="module")
def short_server(tiny_model: Path) -> Iterator[RunningServer]:
    """maxSeqLen 64: a prompt of a few tokens leaves room for fewer than 60 new ones."""
    cfg = server_config(tiny_model, deploy={"maxSeqLen": 64, "maxInputTokenLen": 48},
                        schedule={"maxIterTimes": 64, "maxPrefillTokens": 512},
                        server={"maxRequestBodyBytes": 4096})
    with RunningServer(cfg) as server:
        yield server


def _requests(max_new: int) -> list[tuple[str, str, dict[str, Any], str]]:
    """(protocol, path, body, field that carries the output length) for every generate route."""
    return [
        ("openai", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": max_new}, "max_tokens"),
        ("openai-chat", "/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_new}, "max_tokens"),
        ("vllm", "/generate", {"prompt": PROMPT, "max_tokens": max_new}, "max_tokens"),
        ("tgi", "/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new}},
         "parameters.max_new_tokens"),
        ("native", "/infer", {"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": max_new}},
         "parameters.max_new_tokens"),
        ("triton", "/v2/models/tiny/generate", {"text_input": PROMPT, "parameters": {"max_new_tokens": max_new}},
         "parameters.max_new_tokens"),
    ]


@pytest.mark.parametrize("case", range(len(_requests(1))), ids=[r[0] for r in _requests(1)])
def test_an_output_longer_than_max_seq_len_allows_is_refused_naming_the_field(short_server: RunningServer,
                                                                             case: int) -> None:
    protocol, path, body, field = _requests(60)[case]
    r = httpx.post(short_server.url + path, json=body, timeout=60)
    assert 400 <= r.status_code < 500, (protocol, r.status_code, r.text)
    assert field in r.text and "maxSeqLen is 64" in r.text and "an integer in [1, " in r.text, r.text


@pytest.mark.parametrize("case", range(len(_requests(1))), ids=[r[0] for r in _requests(1)])
def test_an_output_within_max_seq_len_is_served(short_server: RunningServer, case: int) -> None:
    protocol, path, body, _ = _requests(4)[case]
    r = httpx.post(short_server.url + path, json=body, timeout=60)
    assert r.status_code == 200, (protocol, r.text)


def test_without_max_tokens_the_output_stops_at_max_seq_len_with_length(short_server: RunningServer) -> None:
    """No max_tokens: the budget is what the prompt leaves (a default, not a clamp), reported as "length"."""
    r = httpx.post(short_server.url + "/v1/completions",
                   json={"model": "tiny", "prompt": PROMPT, "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "content", "headers"),
    [
        ("/v1/completions", b'{"prompt": "' + b"x" * 5000 + b'"}', {"content-type": "application/json"}),
        ("/generate", b'{"inputs": "' + b"x" * 5000 + b'"}', {"content-type": "application/json"}),
        ("/v2/models/tiny/infer", b"\x00" * 5000,
         {"content-type": "application/octet-stream", "inference-header-content-length": "10"}),
        ("/v1/tokenize", b'{"prompt": "' + b"x" * 5000 + b'"}', {"content-type": "application/json"}),
    ],
)
def test_the_body_cap_answers_413_on_every_route(short_server: RunningServer, path: str, content: bytes,
                                                 headers: dict[str, str]) -> None:
    r = httpx.post(short_server.url + path, content=content, headers=headers, timeout=60)
    assert r.status_code == 413 and "4096-byte limit" in r.text, (path, r.status_code, r.text)


def test_the_body_cap_covers_the_management_plane(short_server: RunningServer) -> None:
    r = httpx.post(short_server.management_url + "/v1/unload_lora_adapter", content=b"x" * 5000, timeout=60)
    assert r.status_code == 413 and "maxRequestBodyBytes" in r.text


def _out(reason: str, stop_reason: str | int | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=[1], new_text="", text="", token_ids=[1], num_prompt_tokens=1,
                         finished=True, finish_reason=reason, stop_reason=stop_reason)


def test_finish_reasons_are_spelt_per_protocol_from_one_table() -> None:
    assert [finish_reason(_out(r, s)) for r, s in [("length", None), ("stop", None), ("stop", "END"), ("abort", None)]] \
        == ["length", "stop", "stop", "stop"]
    assert [finish_reason(_out(r, s), "tgi") for r, s in [("length", None), ("stop", None), ("stop", 7)]] \
        == ["length", "eos_token", "stop_sequence"]
    assert failure(_out("timeout")).status == 408 and failure(_out("error")).status == 500
    assert failure(_out("stop")) is None and failure(_out("length")) is None


def test_the_engine_never_changes_a_requests_sampling_parameters(short_server: RunningServer) -> None:
    host = short_server.host
    sampling = SamplingParams(max_tokens=3, temperature=0.8, do_sample=True, top_k=10**6)
    before = SamplingParams(**vars(sampling))
    req = host.new_request(protocol="openai", body={}, sampling=sampling, prompt=PROMPT)
    assert req.sampling.top_k == 0 and sampling == before  # normalised on a copy
    import asyncio

    async def run() -> RequestOutput:
        return await host.generate_full(req)

    out = asyncio.run_coroutine_threadsafe(run(), short_server._loop).result(60)  # type: ignore[arg-type]
    assert out.seed is not None and req.sampling.seed is None  # the drawn seed is reported, not written back
    assert isinstance(req, EngineRequest)
