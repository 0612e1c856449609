"""Fuzz every business endpoint with hypothesis-generated bodies: never a 5xx, and the server lives on.

Routes are discovered from the business app at collection time, so protocol modules
added later are covered without touching this file. Bodies are random JSON values,
valid bodies of each protocol with fields replaced by hostile values, and raw bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mindie_host.config import config_from_dict
from mindie_host.host import Host
from mindie_host.server.runner import build_app
from mindie_host.testing import RunningServer, server_config

MODEL = "tiny"


def business_routes() -> list[tuple[str, str]]:
    """(method, path template) of every business route but the OpenAPI schema."""
    host = Host(config_from_dict(server_config(None)))
    app = build_app(host, ("business",))
    out: list[tuple[str, str]] = []
    for route in app.routes:
        path = getattr(route, "path", "")
        if path in ("/openapi.json", "") or not hasattr(route, "methods"):
            continue
        for method in sorted(route.methods - {"HEAD"}):  # type: ignore[attr-defined]
            out.append((method, path))
    return out


ROUTES = business_routes()

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)

HOSTILE = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 1, 2**31, 2**63, 2**64 + 1, -(2**63), 1e308, -1e308, 1e-320,
                     0.5, 2.5, "", " ", "\u0000", "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
                     "x" * 2000, [], {}, [None], [[]], [1, 2, 3], ["a", 1], {"a": {"b": {}}}, "NaN", "-1", "true"]),
    json_values,
)

FIELDS = [
    "model", "prompt", "messages", "inputs", "text_input", "input_id", "parameters", "max_tokens", "max_new_tokens",
    "max_completion_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "n", "best_of", "stop", "stop_token_ids", "stream",
    "stream_options", "logprobs", "top_logprobs", "echo", "details", "decoder_input_details", "do_sample", "truncate",
    "return_full_text", "watermark", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
    "tools", "tool_choice", "response_format", "priority", "timeout", "id", "outputs", "adapter_id", "use_beam_search",
    "logit_bias", "user", "suffix", "batch_size", "perf_stat",
]


COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
TGI = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": True}}
VLLM = {"prompt": "Hi", "max_tokens": 2}
NATIVE = {"inputs": "Hi", "stream": False, "parameters": {"max_new_tokens": 2}}
NATIVE_TOKENS = {"input_id": [1, 2, 3], "stream": False, "parameters": {"max_new_tokens": 2}}
TRITON_GENERATE = {"id": "a1", "text_input": "Hi", "parameters": {"max_new_tokens": 2}}
TRITON_INFER = {"id": "a1", "inputs": [{"name": "input0", "shape": [3], "datatype": "UINT32", "data": [1, 2, 3]}],
                "outputs": [{"name": "output0"}], "parameters": {"max_new_tokens": 2}}
STOP = {"id": "a1"}


def seeds_for(path: str) -> list[dict[str, Any]]:
    """Valid bodies (small outputs) for a route; every family for routes this file does not know."""
    known = {
        "/v1/completions": [COMPLETION, {**COMPLETION, "stream": True}],
        "/v1/chat/completions": [CHAT, {**CHAT, "stream": True}],
        "/generate": [TGI, VLLM, {**VLLM, "stream": True}],
        "/": [TGI, {**TGI, "stream": True}],
        "/generate_stream": [TGI],
        "/infer": [NATIVE, {**NATIVE, "stream": True}],
        "/infer_token": [NATIVE_TOKENS, {**NATIVE_TOKENS, "stream": True}],
        "/v2/models/{model}/infer": [TRITON_INFER],
        "/v2/models/{model}/generate": [TRITON_GENERATE],
        "/v2/models/{model}/generate_stream": [TRITON_GENERATE],
        "/v2/models/{model}/stopInfer": [STOP],
    }
    return known.get(path) or [COMPLETION, CHAT, TGI, VLLM, NATIVE, NATIVE_TOKENS, TRITON_GENERATE, TRITON_INFER]


PLAUSIBLE = st.one_of(st.integers(-3, 40), st.floats(-1.0, 3.0), st.booleans(), st.sampled_from(["Hi", "stop", ""]),
                      st.lists(st.integers(-2, 50000), max_size=4), st.lists(st.sampled_from(["\n", "a"]), max_size=3))


@st.composite
def mutated(draw: st.DrawFn, path: str) -> dict[str, Any]:
    body = json.loads(json.dumps(draw(st.sampled_from(seeds_for(path)))))
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        action = draw(st.sampled_from(["set", "set", "drop", "nest"]))
        params = body.get("parameters")
        target = params if action == "nest" and isinstance(params, dict) else body
        key = draw(st.sampled_from(sorted(target)) if target and draw(st.booleans()) else st.sampled_from(FIELDS))
        if action == "drop":
            target.pop(key, None)
        else:
            target[key] = draw(PLAUSIBLE if draw(st.booleans()) else HOSTILE)
    return body


def bodies(path: str) -> st.SearchStrategy[Any]:
    return st.one_of(
        mutated(path),
        mutated(path),
        mutated(path),
        st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=6),
        json_values,
    )


RAW = st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"{", b"[]", b"null", b'{"a":', b"\xff\xfe{}",
                                                          b'{"prompt": "' + b"\xc3\x28" + b'"}']))
PATH_VALUES = st.one_of(st.just(MODEL), st.just(MODEL), st.sampled_from(["nope", "x" * 300, "%2e%2e", "a.b", "-"]),
                        st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/?#%"),
                                min_size=1, max_size=20))


def fill(path: str, value: str) -> str:
    return re.sub(r"\{[^}]+\}", lambda _: value, path)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model: Path) -> Iterator[RunningServer]:
    cfg = server_config(tiny_model, schedule={"maxIterTimes": 16, "maxBatchSize": 16, "maxPrefillBatchSize": 8},
                        model={"modelName": MODEL})
    with RunningServer(cfg) as server:
        yield server


def check(client: httpx.Client, method: str, url: str, **kwargs: Any) -> None:
    with client.stream(method, url, **kwargs) as r:
        body = r.read()
    assert r.status_code < 500, f"{method} {url} -> {r.status_code}: {body[:500]!r} (sent {kwargs})"


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_fuzz_business_endpoint(fuzz_server: RunningServer, method: str, path: str) -> None:
    client = httpx.Client(timeout=120)

    @settings(max_examples=40 if method == "POST" else 10, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(body=bodies(path), raw=RAW, path_value=PATH_VALUES, use_raw=st.integers(0, 9))
    def run(body: Any, raw: bytes, path_value: str, use_raw: int) -> None:
        url = fuzz_server.url + fill(path, path_value)
        if method != "POST":
            check(client, method, url)
        elif use_raw == 0:
            check(client, method, url, content=raw, headers={"content-type": "application/json"})
        else:
            check(client, method, url, json=body)

    try:
        run()
    finally:
        client.close()
    r = httpx.get(fuzz_server.management_url + "/health/timed", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "healthy"}
    assert fuzz_server.wait_idle(30)["kv_blocks_used"] == 0
