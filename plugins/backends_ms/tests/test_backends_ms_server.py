"""``backendType: "ms"`` behind the real HTTP server: every protocol, prefix_cache, splitfuse, startup refusals.

Greedy outputs of an ``ms`` server are compared with a ``torch`` server on the
same tiny random model (same prompts, same protocol bodies).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.api import ModelInput
from mindie_host.testing import RunningServer, child_process, load_host, make_tiny_llama, new_host, server_config

PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"
NEW = 12


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ms-server-tiny"))


def _cfg(path: Path | None, backend: str, plugins: str = "", in_process: bool = False,
         **schedule: Any) -> dict[str, Any]:
    """``in_process``: the engine on a thread of the server's process, where a test can spy on the backend."""
    model: dict[str, Any] = {"backendType": backend}
    if plugins:
        model["plugin_params"] = json.dumps({"plugin_type": plugins})
    return server_config(path, model=model, schedule=schedule, server={"engineProcess": not in_process})


def _protocol_requests(model: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) of one greedy request per protocol."""
    return [
        ("openai-completions", "/v1/completions",
         {"model": model, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}),
        ("openai-chat", "/v1/chat/completions",
         {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": NEW, "temperature": 0}),
        ("tgi", "/generate", {"inputs": PROMPT, "parameters": {"do_sample": False, "max_new_tokens": NEW}}),
        ("vllm", "/generate", {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0}),
        ("native", "/infer",
         {"inputs": PROMPT, "stream": False, "parameters": {"do_sample": False, "max_new_tokens": NEW}}),
        ("triton", f"/v2/models/{model}/generate",
         {"text_input": PROMPT, "parameters": {"do_sample": False, "max_new_tokens": NEW}}),
    ]


def _text(name: str, data: Any) -> str:
    """The generated text of a protocol's non-streaming answer."""
    if name.startswith("openai"):
        choice = data["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    if name == "tgi":
        return data["generated_text"] if isinstance(data, dict) else data[0]["generated_text"]
    if name == "vllm":
        return data["text"][0]
    if name == "triton":
        return data["text_output"]
    if isinstance(data, dict):  # native
        for key in ("generated_text", "text", "text_output"):
            if key in data:
                value = data[key]
                return value[0] if isinstance(value, list) else value
    return json.dumps(data)


def _run_all(server: RunningServer, model: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for name, path, body in _protocol_requests(model):
            r = client.post(path, json=body)
            assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:300]}"
            out[name] = _text(name, r.json())
    return out


@pytest.fixture(scope="module")
def torch_outputs(tiny_path: Path) -> dict[str, str]:
    with RunningServer(_cfg(tiny_path, "torch")) as server:
        return _run_all(server, "tiny")


@pytest.fixture(scope="module")
def ms_server(tiny_path: Path) -> Iterator[RunningServer]:
    with RunningServer(_cfg(tiny_path, "ms")) as server:
        yield server


def test_backends_ms_every_protocol_matches_torch(ms_server: RunningServer, torch_outputs: dict[str, str]) -> None:
    assert ms_server.host.info.extra["framework"].startswith("mindspore")  # the engine process runs MindSpore
    outputs = _run_all(ms_server, "tiny")
    assert set(outputs) == set(torch_outputs)
    for name, text in outputs.items():
        assert text, f"{name}: empty output"
        assert text == torch_outputs[name], f"{name}: ms {text!r} != torch {torch_outputs[name]!r}"


def test_backends_ms_openai_client_streaming(ms_server: RunningServer, torch_outputs: dict[str, str]) -> None:
    import openai

    client = openai.OpenAI(base_url=ms_server.url + "/v1", api_key="x", timeout=300)
    chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == torch_outputs["openai-completions"]


class StepSpy:
    """Wraps a live backend's ``execute`` to record each step's (query_lens, context_lens); computes nothing."""

    def __init__(self, backend: Any) -> None:
        self.steps: list[tuple[list[int], list[int]]] = []
        self._inner = backend.execute
        backend.execute = self

    def __call__(self, batch: ModelInput) -> Any:
        self.steps.append((list(batch.query_lens), list(batch.context_lens)))
        return self._inner(batch)

    def partial_prefills(self) -> int:
        """Sequences that ran more than one new token on top of context already in the cache."""
        return sum(1 for q, c in self.steps for ql, cl in zip(q, c) if ql > 1 and cl > ql)


def _shared_prefix_prompts() -> list[str]:
    stem = "In a quiet village by the river there lived an old clockmaker who repaired every clock in town. " * 2
    return [stem + tail for tail in ("One morning", "Every evening", "On his birthday")]


def _completions(server: RunningServer, prompts: list[str]) -> list[str]:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        texts = []
        for p in prompts:
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts


@pytest.fixture(scope="module")
def torch_prefix_outputs(tiny_path: Path) -> list[str]:
    with RunningServer(_cfg(tiny_path, "torch")) as server:
        return _completions(server, _shared_prefix_prompts())


@pytest.mark.parametrize(
    ("plugins", "schedule"),
    [
        ("prefix_cache", {"enablePrefixCache": True}),
        ("splitfuse", {"templateType": "Mix", "enableSplit": True, "splitChunkTokens": 16, "splitStartBatchSize": 0}),
    ],
)
def test_backends_ms_with_prefix_cache_and_splitfuse(
    child: Executor, tiny_path: Path, torch_prefix_outputs: list[str], plugins: str, schedule: dict[str, Any]
) -> None:
    """The feature plugins change only scheduling and block sharing: outputs equal plain torch."""
    texts, partial_prefills, steps, stats = child.submit(_spied_run, str(tiny_path), plugins, schedule).result()
    assert texts == torch_prefix_outputs
    assert partial_prefills > 0, f"{plugins}: no step prefilled over cached context: {steps}"
    if plugins == "prefix_cache":
        assert stats.get("npu_prefix_cache_hit_rate", 0) > 0


@pytest.fixture(scope="module")
def child() -> Iterator[Executor]:
    """The process the spied ``ms`` servers run in: MindSpore's runtime (0.4 GB once imported, and what its graphs
    allocated) leaves with it when the module ends, instead of staying in the test process."""
    with child_process() as pool:
        yield pool


def _spied_run(path: str, plugins: str, schedule: dict[str, Any]) -> tuple[list[str], int, list[Any], dict[str, Any]]:
    """In the child: an ``ms`` server with its engine on a thread (where :class:`StepSpy` sees the backend's
    steps) answers the shared-prefix prompts; its texts, partial prefills, steps and idle stats."""
    with RunningServer(_cfg(Path(path), "ms", plugins, in_process=True, **schedule)) as server:
        spy = StepSpy(server.host.backend)
        texts = _completions(server, _shared_prefix_prompts())
        stats = server.wait_idle()
    return texts, spy.partial_prefills(), spy.steps, stats


@pytest.mark.parametrize(
    ("model", "plugins", "needle"),
    [
        ({"device": "cuda"}, "", "ModelConfig.device"),
        ({"dtype": "float16"}, "", "ModelConfig.dtype"),
        ({"worldSize": 2}, "", "ModelConfig.worldSize"),
        ({"quantization": "w8a8"}, "", "ModelConfig.quantization"),
        ({"kvCacheDtype": "int8"}, "", "ModelConfig.kvCacheDtype"),
        ({"compile": True}, "", "ModelConfig.compile"),
        ({}, "multi_lora", "multi_lora"),
    ],
)
def test_backends_ms_refuses_unsupported_config_at_startup(
    tiny_path: Path, model: dict[str, Any], plugins: str, needle: str
) -> None:
    from mindie_host.api import PluginError

    cfg = _cfg(tiny_path, "ms", plugins)
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(model)
    cfg["BackendConfig"]["npuDeviceIds"] = [list(range(model.get("worldSize", 1)))]  # one device per rank
    host = new_host(cfg)
    with pytest.raises(PluginError, match=needle) as info:
        load_host(host)
    assert "backendType 'ms'" in str(info.value)


@pytest.mark.slow
def test_backends_ms_serves_default_model() -> None:
    """The default model (SmolLM2-135M-Instruct GGUF) on backendType ms, through OpenAI (official client) and TGI."""
    import openai

    with RunningServer(_cfg(None, "ms")) as server:
        assert server.host.info.extra["framework"].startswith("mindspore")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=600)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        r = httpx.post(server.url + "/generate", timeout=600,
                       json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 4,
                                                                                  "do_sample": False}})
        assert r.status_code == 200 and r.json()["generated_text"].strip()
