"""maxLinkNum and its queue, the body cap, the 4 MB text limit and the API key, over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mindie_host.config import ConfigError, config_from_dict, default_config_dict
from mindie_host.server.admission import LINK_GATE
from mindie_host.testing import RunningServer, server_config

API_KEY = "sk-test-limits-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def limited(tiny_model: Path) -> Iterator[RunningServer]:
    cfg = server_config(tiny_model, server={"maxLinkNum": 1, "maxRequestBodyBytes": 4096, "apiKey": API_KEY,
                                            "engineProcess": False})  # a test holds the backend
    with RunningServer(cfg) as server:
        yield server


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


def complete(url: str, headers: dict[str, str] | None = AUTH, **body: Any) -> httpx.Response:
    payload = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, **body}
    return httpx.post(url + "/v1/completions", json=payload, headers=headers, timeout=120)


def test_requests_beyond_the_queue_are_rejected_and_queued_ones_are_served(limited: RunningServer) -> None:
    """maxLinkNum=1: one in progress, two queued, the fourth refused with 503; nothing accepted is dropped."""
    host = limited.host
    gate = host.caches.get(LINK_GATE)
    backend = host.backend
    assert backend is not None
    original = backend.execute
    hold = threading.Event()

    def held(batch: Any) -> Any:
        hold.wait(60)
        return original(batch)

    backend.execute = held  # type: ignore[method-assign]
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def send() -> None:
        r = complete(limited.url, max_tokens=5, ignore_eos=True)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=send) for _ in range(3)]
    try:
        threads[0].start()
        wait_for(lambda: gate.active == 1)
        threads[1].start()
        threads[2].start()
        wait_for(lambda: gate.waiting == 2)
        rejected = complete(limited.url)
        assert rejected.status_code == 503
        assert "maxLinkNum = 1" in rejected.json()["error"]
        assert rejected.headers["retry-after"] == "1"
        assert gate.rejected >= 1
        metrics = httpx.get(limited.metrics_url + "/metrics", timeout=30).text
        assert 'mindie_host_http_requests_queued{model_name="tiny"} 2' in metrics
        assert 'mindie_host_http_requests_processing{model_name="tiny"} 1' in metrics
    finally:
        hold.set()
        for t in threads:
            t.join(120)
        backend.execute = original  # type: ignore[method-assign]
    assert [r.status_code for r in results] == [200, 200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 5 for r in results)
    # the gate is released when the app returns, which may be just after the client has read the last bytes
    wait_for(lambda: gate.active == 0 and gate.waiting == 0)
    assert limited.wait_idle()["kv_blocks_used"] == 0
    # management probes are never limited by maxLinkNum nor need the key
    assert httpx.get(limited.management_url + "/v2/health/ready", timeout=30).status_code == 200


def test_body_over_the_cap_is_refused_with_413(limited: RunningServer) -> None:
    big = complete(limited.url, prompt="x" * 5000)
    assert big.status_code == 413
    assert "4096-byte limit" in big.json()["error"]

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    chunked = httpx.post(limited.url + "/v1/completions", content=chunks(), headers=AUTH, timeout=60)
    assert chunked.status_code == 413
    small_chunked = httpx.post(limited.url + "/v1/completions", headers={**AUTH, "content-type": "application/json"},
                               content=iter([b'{"model":"tiny","prompt":"Hi",', b'"max_tokens":2}']), timeout=60)
    assert small_chunked.status_code == 200
    assert small_chunked.json()["usage"]["completion_tokens"] == 2


def test_api_key_is_required_on_the_business_port(limited: RunningServer) -> None:
    missing = complete(limited.url, headers=None)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "API key" in missing.json()["error"]
    assert complete(limited.url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert complete(limited.url, headers={"Authorization": API_KEY}).status_code == 401
    assert httpx.get(limited.url + "/v1/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.url + "/v1", api_key="nope").models.list()
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key=API_KEY)
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens == 2
    assert httpx.get(limited.management_url + "/v1/status", timeout=30).status_code == 200
    assert httpx.get(limited.metrics_url + "/metrics", timeout=30).status_code == 200


def test_text_over_4mb_is_refused_naming_the_field(tiny_server: RunningServer) -> None:
    r = httpx.post(tiny_server.url + "/v1/completions",
                   json={"model": "tiny", "prompt": "a" * (4 * 1024 * 1024 + 1), "max_tokens": 1}, timeout=120)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "prompt"
    assert "4194304" in err["message"]
    assert httpx.get(tiny_server.management_url + "/health/timed", timeout=60).status_code == 200


def test_many_concurrent_streams_are_all_served(tiny_server: RunningServer) -> None:
    """More streams than maxBatchSize at once: every one finishes with all its tokens."""
    n = 48
    counts: list[int] = [0] * n
    errors: list[str] = []

    def stream(i: int) -> None:
        try:
            with httpx.stream("POST", tiny_server.url + "/v1/completions", timeout=120,
                              json={"model": "tiny", "prompt": f"Story {i}:", "max_tokens": 8, "ignore_eos": True,
                                    "stream": True}) as r:
                if r.status_code != 200:
                    errors.append(f"{i}: {r.status_code}")
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        counts[i] += 1
        except httpx.HTTPError as exc:
            errors.append(f"{i}: {exc!r}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert errors == []
    assert all(c >= 8 for c in counts)
    assert tiny_server.wait_idle()["kv_blocks_used"] == 0


def test_shared_port_keeps_probes_outside_the_business_guard(tiny_model: Path) -> None:
    """managementPort == port: one listener serves both planes; every route needs the key (issue 15),
    but management routes stay outside maxLinkNum."""
    cfg = server_config(tiny_model, server={"apiKey": API_KEY, "maxLinkNum": 1})
    cfg["ServerConfig"]["managementPort"] = cfg["ServerConfig"]["port"]
    with RunningServer(cfg) as server:
        assert server.management_url == server.url
        assert httpx.get(server.url + "/v2/health/ready", timeout=30).status_code == 401
        assert httpx.get(server.url + "/v2/health/ready", headers=AUTH, timeout=30).status_code == 200
        assert httpx.get(server.url + "/health/timed", headers=AUTH, timeout=60).json() == {"status": "healthy"}
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(server.url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
        assert complete(server.url).status_code == 200


def test_a_tokenization_past_tokenizer_encode_timeout_fails_alone(tiny_server: RunningServer,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENIZER_ENCODE_TIMEOUT: a prompt whose tokenization runs past it gets the spec's 422, while a request
    beside it is served. The tokenizer is held on one prompt until the test lets it go; the deadline is set to
    0.3 s on the live config (the variable's smallest value, 5 s, would only make the test slower)."""
    host = tiny_server.host
    monkeypatch.setattr(host.config, "environment", replace(host.config.environment, tokenizer_encode_timeout=0.3))
    encode, release = host.tokenizer.encode, threading.Event()

    def stuck_on_one_prompt(text: str, *args: Any, **kwargs: Any) -> Any:
        if "stuck here" in text:
            release.wait(30)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(host.tokenizer, "encode", stuck_on_one_prompt)
    try:
        with ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(complete, tiny_server.url, None, prompt="stuck here")
            assert complete(tiny_server.url, None).status_code == 200
            r = stuck.result(60)
    finally:
        release.set()
    assert r.status_code == 422, r.text
    assert "Tokenizer encode wait sub process timeout." in r.text and "TOKENIZER_ENCODE_TIMEOUT" in r.text


@pytest.mark.parametrize("value", ["4", "301", "60.5", "a minute"])
def test_a_bad_tokenizer_encode_timeout_stops_startup(value: str) -> None:
    with pytest.raises(ConfigError, match=r"TOKENIZER_ENCODE_TIMEOUT: .* allowed an integer number of seconds in \[5, 300\]"):
        config_from_dict(default_config_dict(), environ={"TOKENIZER_ENCODE_TIMEOUT": value})
