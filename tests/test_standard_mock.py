"""``modelInstanceType: "StandardMock"``: servers that load no model answer every protocol with the placeholder text.

Two StandardMock servers (no modelWeightPath: the built-in byte-level tokenizer), a controller and a coordinator,
each its own process, as ``mindie-host cluster`` starts them: every protocol is asked on one server directly and
through the coordinator, which routes to both; the probes answer as on a served model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.backends.mock import PLACEHOLDER, MockBackend
from mindie_host.config import config_from_dict
from mindie_host.models.default import default_model_path
from mindie_host.ms.cluster import Cluster
from mindie_host.runtime.assemble import mock_tokenizer
from mindie_host.testing import server_config
from mindie_host.tokenizer import byte_level_tokenizer

MODEL = "mock-model"
PROMPT = "Write one sentence about the sea."
MOCK = {"modelInstanceType": "StandardMock", "modelName": MODEL}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("mock-cluster")
    cfg = server_config(None, model=MOCK, server={"engineProcess": False})
    with Cluster(tmp, 2, server_config=cfg, controller={"rank_table_detecting_seconds": 1}) as c:
        yield c


def received(cluster: Cluster) -> list[float]:
    """request_received_total of each server, from its own /metrics."""
    counts = []
    for srv in cluster.servers:
        text = httpx.get(f"http://127.0.0.1:{srv['metric_port']}/metrics", timeout=10).text
        counts.append(next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("request_received_total")))
    return counts


def sse_text(response: httpx.Response, pick: Any) -> str:
    """The text of a stream of ``data:`` events, ``pick(event)`` each (None: nothing)."""
    parts = []
    for line in response.text.splitlines():
        payload = line.removeprefix("data:").strip()
        if line.startswith("data:") and payload != "[DONE]":
            parts.append(pick(json.loads(payload)) or "")
    return "".join(parts)


def ask(url: str) -> dict[str, str]:
    """The answer text of every protocol at ``url``."""
    post = lambda path, body: httpx.post(url + path, json=body, timeout=60)  # noqa: E731
    answers: dict[str, str] = {}
    r = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                      "max_tokens": 200})
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    answers["openai-chat"] = r.json()["choices"][0]["message"]["content"]
    r = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                      "max_tokens": 200, "stream": True})
    answers["openai-chat-stream"] = sse_text(r, lambda e: e["choices"][0]["delta"].get("content") if e["choices"]
                                             else None)
    r = post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 1.5})
    answers["openai-completions"] = r.json()["choices"][0]["text"]
    r = post("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 200}})
    answers["tgi"] = r.json()["generated_text"]
    r = post("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 200}})
    answers["tgi-stream"] = sse_text(r, lambda e: None if e["token"]["special"] else e["token"]["text"])
    r = post("/generate", {"prompt": PROMPT, "max_tokens": 200})
    answers["vllm"] = r.json()["text"][0].removeprefix(PROMPT)
    r = post(f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"max_new_tokens": 200}})
    answers["triton-generate"] = r.json()["text_output"]
    r = post("/infer", {"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": 200}})
    answers["mindie"] = r.json()["generated_text"]
    tok = byte_level_tokenizer()  # token ids in, token ids out
    ids = tok.encode(PROMPT)
    r = post(f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "input0", "datatype": "UINT32", "shape": [1, len(ids)],
                                                        "data": ids}], "outputs": [{"name": "output0"}],
                                           "parameters": {"max_new_tokens": 200}})
    assert r.status_code == 200, r.text
    answers["triton-infer"] = tok.decode(r.json()["outputs"][0]["data"], skip_special_tokens=True)
    return answers


def test_every_protocol_answers_the_placeholder_directly_and_through_the_coordinator(cluster: Cluster) -> None:
    direct = ask(cluster.server_url(0))
    assert direct == dict.fromkeys(direct, PLACEHOLDER)
    before = received(cluster)
    routed = ask(cluster.url)
    assert routed == direct
    after = received(cluster)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both servers served some


def test_probes_and_model_listing(cluster: Cluster) -> None:
    for k, srv in enumerate(cluster.servers):
        manage = f"http://127.0.0.1:{srv['management_port']}"
        assert httpx.get(manage + "/health", timeout=10).status_code == 200
        assert httpx.get(manage + "/v2/health/ready", timeout=10).status_code == 200
        assert httpx.get(manage + "/health/timed-5", timeout=10).json() == {"status": "healthy"}
        assert httpx.get(manage + f"/v2/models/{MODEL}/ready", timeout=10).status_code == 200
        assert httpx.get(cluster.server_url(k) + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    assert httpx.get(cluster.manage_url + "/v1/readiness", timeout=10).status_code == 200
    assert httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL


def test_pd_disaggregation_through_the_coordinator(tmp_path: Path) -> None:
    """Two StandardMock servers in dmi mode, one made P and one D by the controller: the coordinator joins P's first
    token and D's rest into the placeholder (a block carries no KV; the transfer still runs)."""
    cfg = server_config(None, model=MOCK, server={"engineProcess": False, "inferMode": "dmi",
                                                  "interCommTLSEnabled": False})
    pd = {"deploy_mode": "pd_separate", "scheduler_type": "digs_scheduler", "algorithm_type": "load_balance"}
    with Cluster(tmp_path, 2, server_config=cfg, coordinator={"digs_scheduler_config": pd},
                 controller={"deploy_mode": "pd_separate", "default_p_rate": 1, "default_d_rate": 1,
                             "rank_table_detecting_seconds": 1, "check_role_wait_seconds": 1}) as c:
        roles = sorted(httpx.get(f"http://127.0.0.1:{s['management_port']}/v1/status", timeout=10).json()["service"]
                       ["currentRole"] for s in c.servers)
        assert roles == ["decode", "prefill"]
        r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200})
        assert r.json()["choices"][0]["message"]["content"] == PLACEHOLDER, r.text
        r = httpx.post(c.url + "/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 200}},
                       timeout=60)
        assert sse_text(r, lambda e: None if e["token"]["special"] else e["token"]["text"]) == PLACEHOLDER


def test_the_tokenizer_at_model_weight_path_is_used() -> None:
    """With a modelWeightPath the placeholder is that tokenizer's tokens (here the default model's; none is loaded)."""
    mc = config_from_dict(server_config(default_model_path(), model=MOCK)).model
    tok = mock_tokenizer(mc)
    assert len(tok) > 259  # not the byte-level tokenizer
    backend = MockBackend(tok, MODEL, 64)
    assert tok.decode(backend.cycle[:-1]) == PLACEHOLDER and backend.cycle[-1] == tok.eos_token_id
