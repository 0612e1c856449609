"""PD disaggregation end to end: a real controller, coordinator, one P and two D servers (inferMode dmi).

The servers run the default model (SmolLM2-135M-Instruct) as child processes; the reference
is one mixed (standard) server with the same config, whose answers are collected before the cluster starts. Through the coordinator every protocol,
streamed or not, answers exactly what the mixed server answers (greedy), apart from ids and
timings. Then a D instance is killed mid-load: every request completes through recompute and
P holds no KV block afterwards.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from mindie_host.config import config_from_dict
from mindie_host.host import Host
from mindie_host.ms.cluster import Cluster
from mindie_host.server.pd import PDGate
from mindie_host.testing import RunningServer, server_config

MODEL = "SmolLM2-135M-Instruct"
SCHEDULE = {"maxBatchSize": 16, "maxPrefillBatchSize": 8, "maxIterTimes": 256}
DEPLOY = {"maxSeqLen": 1024, "maxInputTokenLen": 768}
PROMPT = "Write one sentence about the sea."
CHAT = [{"role": "user", "content": PROMPT}]

#: (path, body) per protocol, non-streamed and streamed
CASES: dict[str, tuple[str, dict[str, Any], str, dict[str, Any]]] = {
    "openai-chat": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0},
                    "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 16, "temperature": 0,
                                             "stream": True}),
    "openai-completions": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0},
                           "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                               "stream": True}),
    "tgi": ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": 16}},
            "/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 16}}),
    "vllm": ("/generate", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0},
             "/generate", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}),
    "triton": (f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"max_new_tokens": 16}},
               f"/v2/models/{MODEL}/generate_stream", {"text_input": PROMPT, "parameters": {"max_new_tokens": 16}}),
    "mindie": ("/infer", {"inputs": PROMPT, "stream": False, "parameters": {"max_new_tokens": 16}},
               "/infer", {"inputs": PROMPT, "stream": True, "parameters": {"max_new_tokens": 16}}),
}

#: fields that differ between any two runs (ids, clocks, timings)
VOLATILE = {"id", "created", "prefill_time", "decode_time_arr", "queue_wait_time", "first_token_cost", "decode_cost",
            "prefillTime", "decodeTime", "decode_time", "perf_stat", "system_fingerprint", "batch_size",
            "model_version"}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def normalize(text: str) -> Any:
    """The answer without ids and timings: a JSON body, or the events of a stream (SSE, NUL- or line-delimited)."""
    text = text.strip()
    try:
        return _strip(json.loads(text))
    except ValueError:
        pass
    events = []
    for part in text.replace("\0", "\n").splitlines():
        part = part.strip()
        if not part or part.startswith(("event:", ":")):
            continue
        payload = part.split(":", 1)[1].strip() if part.startswith("data:") else part
        try:
            events.append(_strip(json.loads(payload)))
        except ValueError:
            events.append(payload)
    return events


def _configs(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    mixed = server_config(None, schedule=SCHEDULE, deploy=DEPLOY, model={"maxKvBlocks": 400})
    dmi = server_config(None, schedule=SCHEDULE, deploy=DEPLOY, model={"maxKvBlocks": 400},
                        server={"inferMode": "dmi", "interCommTLSEnabled": False})
    return mixed, dmi


def _kill_test_bodies() -> list[dict[str, Any]]:
    return [{"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to {i + 40}."}],
             "max_tokens": 48, "temperature": 0, "stream": i % 2 == 0} for i in range(8)]


@dataclass
class Reference:
    """What the mixed (standard) server answered, collected before the PD cluster starts, so its engine's memory
    is given back before three more default-model servers load (the suite's run stays under 8 GB)."""

    #: (protocol, stream) -> (status, content type, normalized body)
    answers: dict[tuple[str, bool], tuple[int, str, Any]]
    #: the standard server's answer to GET /dresult
    dresult: str
    #: the normalized answers to the kill test's bodies
    kill_answers: list[Any]


def _reference(mixed: dict[str, Any]) -> Reference:
    with RunningServer(mixed) as server:
        answers = {}
        for protocol, (path, body, stream_path, stream_body) in CASES.items():
            for stream, (p, b) in ((False, (path, body)), (True, (stream_path, stream_body))):
                r = httpx.post(server.url + p, json=b, timeout=120)
                answers[(protocol, stream)] = (r.status_code, r.headers["content-type"].split(";")[0],
                                               normalize(r.text))
        dresult = httpx.get(server.url + "/dresult", timeout=30).text
        kill = [normalize(httpx.post(server.url + "/v1/chat/completions", json=b, timeout=120).text)
                for b in _kill_test_bodies()]
    return Reference(answers, dresult, kill)


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("pd")
    mixed, dmi = _configs(tmp)
    reference = _reference(mixed)
    cluster = Cluster(
        tmp, 3, server_config=dmi,
        coordinator={"digs_scheduler_config": {"deploy_mode": "pd_separate", "scheduler_type": "digs_scheduler",
                                               "algorithm_type": "load_balance"},
                     "exception_config": {"max_retry": 3, "first_token_timeout": 120, "infer_timeout": 120}},
        controller={"deploy_mode": "pd_separate", "default_p_rate": 1, "default_d_rate": 2,
                    "rank_table_detecting_seconds": 1, "check_role_wait_seconds": 1},
    )
    cluster.start(timeout=300)
    try:
        yield cluster, reference
    finally:
        cluster.stop()


def _roles(cluster: Cluster) -> dict[str, list[int]]:
    roles: dict[str, list[int]] = {"prefill": [], "decode": []}
    for k, srv in enumerate(cluster.servers):
        status = httpx.get(f"http://127.0.0.1:{srv['management_port']}/v1/status", timeout=5).json()
        role = status["service"]["currentRole"]
        if role in roles:
            roles[role].append(k)
    return roles


def test_controller_assigns_one_p_and_two_d(pd: Any) -> None:
    cluster, _ = pd
    roles = _roles(cluster)
    assert len(roles["prefill"]) == 1 and len(roles["decode"]) == 2, roles


@pytest.mark.parametrize("protocol", sorted(CASES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_identical_to_a_mixed_instance(pd: Any, protocol: str, stream: bool) -> None:
    cluster, reference = pd
    path, body = CASES[protocol][2:] if stream else CASES[protocol][:2]
    want_status, want_type, want = reference.answers[(protocol, stream)]
    got = httpx.post(cluster.url + path, json=body, timeout=120)
    assert want_status == 200, want
    assert got.status_code == 200, got.text
    assert normalize(got.text) == want
    assert got.headers["content-type"].split(";")[0] == want_type


def test_dmi_restrictions_are_refused(pd: Any) -> None:
    cluster, _ = pd
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 8, "stop": ["sea"]})
    assert r.status_code == 422 and "stop is not support in dmi mode" in r.text
    r = httpx.post(cluster.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "include_stop_str_in_output": True})
    assert r.status_code == 422 and "include_stop_str_in_output is not support in dmi mode" in r.text


def test_server_side_checks(pd: Any) -> None:
    cluster, reference = pd
    roles = _roles(cluster)
    p = cluster.servers[roles["prefill"][0]]
    d = cluster.servers[roles["decode"][0]]
    p_url, d_url = f"http://127.0.0.1:{p['port']}", f"http://127.0.0.1:{d['port']}"
    body = CASES["tgi"][1]
    r = httpx.post(p_url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and "must have req-type, req-id, d-target" in r.text
    r = httpx.post(p_url + "/generate", json=body, timeout=30,
                   headers={"req-id": "1", "req-type": "decode", "d-target": "127.0.0.1"})
    assert r.status_code == 400 and "req-type must be prefill but got decode" in r.text
    r = httpx.post(p_url + "/generate", json=body, timeout=30,
                   headers={"req-id": "1", "req-type": "prefill", "d-target": "somewhere"})
    assert r.status_code == 400 and "d-target must be an IPv4 address" in r.text
    r = httpx.post(d_url + "/generate", json=body, timeout=30,
                   headers={"req-id": "1", "req-type": "prefill", "d-target": "127.0.0.1"})
    assert r.status_code == 400 and "only to the prefill node" in r.text
    assert httpx.get(p_url + "/dresult", timeout=30).status_code == 400
    assert reference.dresult.count("Non DMI") == 1
    r = httpx.post(f"http://127.0.0.1:{p['management_port']}/v1/role/prefill", json={"local": {}}, timeout=30)
    assert r.status_code == 422 and "local.server_ip" in r.json()["error"]
    r = httpx.post(f"http://127.0.0.1:{p['management_port']}/v1/role/mixed", json={}, timeout=30)
    assert r.status_code == 400
    status = httpx.get(f"http://127.0.0.1:{d['management_port']}/v1/status", timeout=30).json()
    assert status["service"] == {"roleStatus": "RoleReady", "currentRole": "decode"}
    assert "peers" not in httpx.get(f"http://127.0.0.1:{p['management_port']}/v1/status", timeout=30).json()


def _held(cluster: Cluster, k: int) -> float:
    srv = cluster.servers[k]
    text = httpx.get(f"http://127.0.0.1:{srv['management_port']}/v1/status", timeout=10).json()
    return float(text["resource"]["availBlockNum"])


def test_killing_a_decode_instance_mid_load_loses_no_request(pd: Any) -> None:
    cluster, reference = pd
    roles = _roles(cluster)
    p_index = roles["prefill"][0]
    free_before = _held(cluster, p_index)
    bodies = _kill_test_bodies()
    want = reference.kill_answers
    victim = roles["decode"][0]

    def send(body: dict[str, Any]) -> tuple[int, str]:
        r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=180)
        return r.status_code, r.text

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(send, b) for b in bodies]
        time.sleep(1.5)
        os.kill(cluster.procs[f"server-{victim}"].pid, signal.SIGKILL)
        results = [f.result(timeout=240) for f in futures]
    for (status, text), expected in zip(results, want):
        assert status == 200, text
        assert normalize(text) == expected
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and _held(cluster, p_index) < free_before:
        time.sleep(0.5)
    assert _held(cluster, p_index) >= free_before  # P holds no KV block for anyone


def test_a_dmi_instance_without_a_role_answers_503_naming_it() -> None:
    """Before the controller assigns its role, a dmi server refuses inference with a 503 that says so (no model:
    the gate answers before the request reaches a protocol)."""
    async def never(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the request went past the PD gate")

    host = Host(config_from_dict(server_config(None, server={"inferMode": "dmi", "interCommTLSEnabled": False})))
    r = TestClient(PDGate(host, never)).post("/generate", json=CASES["tgi"][1],
                                             headers={"req-id": "1", "req-type": "prefill", "d-target": "127.0.0.1"})
    assert r.status_code == 503, r.text
    assert r.json()["error_type"] == "Service Unavailable"
    assert "no PD role yet (roleStatus RoleUnknown)" in r.json()["error"] and "POST /v1/role/" in r.json()["error"]
