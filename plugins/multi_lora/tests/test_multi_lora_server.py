"""Through the real server: greedy outputs per adapter match HF transformers with the adapter merged,
alone and in one batch mixing three adapters and the base model; selection on every protocol."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from mindie_host.api import RequestError, SamplingParams
from mindie_host.testing import RunningServer
from multi_lora_helpers import PROMPTS, lora_config
from transformers import AutoTokenizer

MAX_NEW = 12


@pytest.fixture(scope="module")
def lora_server(lora_base: Path, lora_adapters: dict[str, Path]) -> Iterator[RunningServer]:
    with RunningServer(lora_config(lora_base, maxLoras=4, maxLoraRank=16)) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(lora_base: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(str(lora_base))


def complete(server: RunningServer, model: str, prompt_index: int) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=model, prompt=PROMPTS[prompt_index], max_tokens=MAX_NEW, temperature=0)
    return out.choices[0].text


def expected_text(tokenizer, ref: Callable, adapter: str | None, prompt_index: int) -> str:  # noqa: ANN001
    return tokenizer.decode(ref(adapter, prompt_index, MAX_NEW), skip_special_tokens=True)


def test_adapters_change_the_output(hf_reference: Callable) -> None:
    """Guard against a vacuous comparison: every adapter's merged output differs from the base model's."""
    base = hf_reference(None, 0, MAX_NEW)
    for name in ("alpha", "beta", "gamma"):
        assert hf_reference(name, 0, MAX_NEW) != base, name


@pytest.mark.parametrize("adapter", ["alpha", "beta", "gamma", None])
def test_alone_matches_hf_merged(lora_server: RunningServer, tokenizer, hf_reference: Callable,  # noqa: ANN001
                                 adapter: str | None) -> None:
    for i in range(len(PROMPTS)):
        got = complete(lora_server, adapter or "tiny", i)
        assert got == expected_text(tokenizer, hf_reference, adapter, i), (adapter, i)


def test_mixed_batch_matches_hf_merged(lora_server: RunningServer, tokenizer, hf_reference: Callable) -> None:  # noqa: ANN001
    """Three adapters and the base model, concurrently: every answer matches its own HF reference."""
    jobs = [(m, i) for i in range(len(PROMPTS)) for m in ("alpha", "beta", "gamma", "tiny")]
    before = lora_server.host.stats()["lora_max_kinds_per_step"]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(lora_server, *job), jobs))
    for (model, i), got in zip(jobs, results):
        adapter = None if model == "tiny" else model
        assert got == expected_text(tokenizer, hf_reference, adapter, i), (model, i)
    stats = lora_server.host.stats()
    # the batches really mixed adapters with the base model in one forward step
    assert stats["lora_max_kinds_per_step"] >= 3
    assert stats["lora_max_kinds_per_step"] >= before


def test_models_lists_adapters(lora_server: RunningServer) -> None:
    data = httpx.get(lora_server.url + "/v1/models").json()["data"]
    ids = [m["id"] for m in data]
    assert ids[0] == "tiny" and {"alpha", "beta", "gamma"} <= set(ids)
    assert "delta" not in ids  # built, but not listed in lora_adapter.json


def test_unknown_adapter_is_404_naming_it(lora_server: RunningServer) -> None:
    r = httpx.post(lora_server.url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and "nope" in r.text


def _refine(server: RunningServer, protocol: str, body: dict) -> tuple[str | None, str | None]:
    req = server.host.new_request(protocol=protocol, body=body, sampling=SamplingParams(max_tokens=2),
                                  prompt_token_ids=[1, 2, 3])
    server.host.plugins.state("multi_lora").catalogue.finished(req.request_id)  # never submitted: untrack
    return req.extensions.get("multi_lora"), req.cache_salt


@pytest.mark.parametrize(
    ("protocol", "body", "adapter"),
    [
        ("openai", {"model": "beta"}, "beta"),
        ("openai", {"model": "tiny"}, None),
        ("vllm", {"model": "gamma"}, "gamma"),
        ("vllm", {"adapter_id": "alpha"}, "alpha"),
        ("vllm", {"adapter_id": "None"}, None),
        ("vllm", {"model": "None"}, None),
        ("vllm", {"model": "tiny"}, None),
        ("tgi", {"parameters": {"adapter_id": "alpha"}}, "alpha"),
        ("tgi", {"parameters": {}}, None),
        ("triton", {"parameters": {"adapter_id": "gamma"}}, "gamma"),
        ("native", {"parameters": {"adapter_id": "beta"}}, "beta"),
    ],
)
def test_selection_per_protocol(lora_server: RunningServer, protocol: str, body: dict, adapter: str | None) -> None:
    got, salt = _refine(lora_server, protocol, body)
    assert got == adapter
    assert (salt is not None) == (adapter is not None)


@pytest.mark.parametrize(
    ("protocol", "body", "status", "field"),
    [
        ("tgi", {"parameters": {"adapter_id": "zeta"}}, 404, "parameters.adapter_id"),
        ("tgi", {"parameters": {"adapter_id": "bad name!"}}, 422, "parameters.adapter_id"),
        ("tgi", {"parameters": {"adapter_id": 5}}, 422, "parameters.adapter_id"),
        ("vllm", {"model": "zeta"}, 404, "model"),
        ("vllm", {"model": "alpha", "adapter_id": "beta"}, 422, "adapter_id"),
        ("triton", {"parameters": {"adapter_id": "zeta"}}, 404, "parameters.adapter_id"),
        ("native", {"parameters": {"adapter_id": "zeta"}}, 404, "parameters.adapter_id"),
    ],
)
def test_bad_selection(lora_server: RunningServer, protocol: str, body: dict, status: int, field: str) -> None:
    with pytest.raises(RequestError) as info:
        _refine(lora_server, protocol, body)
    assert info.value.status == status and info.value.field == field
    if status == 404:
        assert "zeta" in info.value.message


def test_cache_salt_differs_per_adapter(lora_server: RunningServer) -> None:
    salts = {name: _refine(lora_server, "openai", {"model": name})[1] for name in ("alpha", "beta", "gamma")}
    assert len(set(salts.values())) == 3 and None not in salts.values()


@pytest.mark.parametrize(("kernel", "slots"), [("masked", 8), ("segment", 3), ("grouped", 3)])
def test_mixed_batch_each_kernel(lora_base: Path, lora_adapters: dict[str, Path], tokenizer,  # noqa: ANN001
                                 hf_reference: Callable, kernel: str, slots: int) -> None:
    """The same mixed batch with each kernel forced (masked with a slot gather, segment runs, grouped over all slots)."""
    with RunningServer(lora_config(lora_base, maxLoras=slots, kernel=kernel)) as server:
        jobs = [(m, i) for i in range(len(PROMPTS)) for m in ("alpha", "beta", "gamma", "tiny")]
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: complete(server, *job), jobs))
        for (model, i), got in zip(jobs, results):
            adapter = None if model == "tiny" else model
            assert got == expected_text(tokenizer, hf_reference, adapter, i), (kernel, model, i)
        assert server.host.stats()["lora_max_kinds_per_step"] >= 3


def test_every_protocol_selects_over_http(lora_server: RunningServer) -> None:
    """OpenAI (checked against HF above) is the reference; TGI, vLLM, Triton generate and native agree."""
    url, text = lora_server.url, "The quick brown fox"
    for adapter in ("gamma", "beta"):
        r = httpx.post(url + "/v1/completions", json={"model": adapter, "prompt": text, "max_tokens": 8, "temperature": 0})
        want = r.json()["choices"][0]["text"]
        params = {"max_new_tokens": 8, "adapter_id": adapter}
        got = {
            "tgi": httpx.post(url + "/generate", json={"inputs": text, "parameters": params}).json()["generated_text"],
            "vllm": httpx.post(url + "/generate", json={"model": adapter, "prompt": text, "max_tokens": 8,
                                                        "temperature": 0}).json()["text"][0].removeprefix(text),
            "triton": httpx.post(url + "/v2/models/tiny/generate",
                                 json={"text_input": text, "parameters": params}).json()["text_output"],
            "native": httpx.post(url + "/infer", json={"inputs": text, "stream": False,
                                                       "parameters": params}).json()["generated_text"],
        }
        assert got == dict.fromkeys(got, want), adapter
    base = httpx.post(url + "/generate", json={"inputs": text, "parameters": {"max_new_tokens": 8}}).json()
    assert base["generated_text"] != want  # no adapter = the base model
    for path, body, field in [
        ("/generate", {"inputs": text, "parameters": {"adapter_id": "zeta"}}, "parameters.adapter_id"),
        ("/generate", {"model": "zeta", "prompt": text}, "model"),
        ("/v2/models/tiny/generate", {"text_input": text, "parameters": {"adapter_id": "zeta"}}, "parameters.adapter_id"),
        ("/infer", {"inputs": text, "parameters": {"adapter_id": "zeta"}}, "parameters.adapter_id"),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 404 and "zeta" in r.text and r.json()["field"] == field, (path, r.text)
