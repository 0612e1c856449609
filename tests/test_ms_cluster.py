"""MindIE MS end to end: two real servers, a controller and a coordinator, each its own process.

The servers load the default model (SmolLM2-135M-Instruct, bfloat16, a small KV pool: about 1 GB per
server; the file takes about 100 s on an idle 2-core machine). Set ``MINDIE_HOST_MS_TEST_MODEL=tiny`` to
run it on a small random Llama with the default model's tokenizer and chat template instead (faster on a
loaded CPU). Tests run in file order; the last one
SIGKILLs a server and restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from mindie_host.distributed.cores import usable_cores
from mindie_host.ms.cluster import Cluster
from mindie_host.ms.coordinator.config import default_coordinator_dict
from mindie_host.ms.coordinator.instances import instance_id
from mindie_host.testing import free_port, make_tiny_llama, server_config

DEFAULT_MODEL = os.environ.get("MINDIE_HOST_MS_TEST_MODEL", "default") != "tiny"
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct" if DEFAULT_MODEL else "tiny"
SCHEDULE = {"maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxPrefillTokens": 2048, "maxIterTimes": 256}
DEPLOY = {"maxSeqLen": 512, "maxInputTokenLen": 384}


def servers_config(tmp: Path) -> dict:
    if DEFAULT_MODEL:
        return server_config(None, schedule=SCHEDULE, deploy=DEPLOY,
                             model={"dtype": "bfloat16", "maxKvBlocks": 160, "cpuMemSize": 1})
    return server_config(make_tiny_llama(tmp / "tiny-llama"), schedule=SCHEDULE, deploy=DEPLOY,
                         model={"maxKvBlocks": 160, "cpuMemSize": 1})


CHAT = {"model": MODEL, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("ms-cluster")
    c = Cluster(tmp, 2, server_config=servers_config(tmp),
                coordinator={"prometheus_metrics_config": {"reuse_time": 1},
                             # the sigkill test's survivors queue their answers on one server beside the other worker
                             "exception_config": {"max_retry": 3, "schedule_timeout": 600,
                                                  "first_token_timeout": 600, "infer_timeout": 900}},
                controller={"rank_table_detecting_seconds": 1})
    c.start(timeout=300)
    yield c
    c.stop()


def server_metric(cluster: Cluster, name: str) -> list[float]:
    """The metric ``name`` of each server, read from its own /metrics."""
    return [metric_value(httpx.get(f"http://127.0.0.1:{srv['metric_port']}/metrics", timeout=10).text, name)
            for srv in cluster.servers]


def received(cluster: Cluster) -> list[float]:
    """request_received_total of each server."""
    return server_metric(cluster, "request_received_total")


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


def served_by(cluster: Cluster, send) -> tuple[int, object]:
    """Run ``send()`` and say which server's request counter moved."""
    before = received(cluster)
    result = send()
    after = received(cluster)
    moved = [k for k in range(len(before)) if after[k] > before[k]]
    assert len(moved) == 1, (before, after)
    return moved[0], result


# -- the same greedy answers through the coordinator as direct ---------------------------------------------
def test_openai_client_same_output(cluster):
    from openai import OpenAI

    messages = [{"role": "user", "content": "Name a colour."}]
    direct = OpenAI(base_url=cluster.server_url(0) + "/v1", api_key="x").chat.completions.create(
        messages=messages, **CHAT)
    via = OpenAI(base_url=cluster.url + "/v1", api_key="x")
    for _ in range(2):  # both servers
        got = via.chat.completions.create(messages=messages, **CHAT)
        assert got.choices[0].message.content == direct.choices[0].message.content
    stream = via.chat.completions.create(messages=messages, stream=True, **CHAT)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == direct.choices[0].message.content


def test_text_generation_client_same_output(cluster):
    from text_generation import Client

    direct = Client(cluster.server_url(1), timeout=60).generate("The sky is", max_new_tokens=10)
    via = Client(cluster.url, timeout=60)
    for _ in range(2):
        assert via.generate("The sky is", max_new_tokens=10).generated_text == direct.generated_text
    streamed = "".join(r.token.text for r in via.generate_stream("The sky is", max_new_tokens=10))
    assert streamed == direct.generated_text


def test_tritonclient_same_output_binary_tensors(cluster):
    import tritonclient.http as triton

    ids = httpx.post(cluster.url + "/v1/tokenizer", json={"inputs": "The capital of France is"}, timeout=30)
    assert ids.status_code == 200, ids.text
    direct_tok = httpx.post(cluster.server_url(0) + "/v1/tokenizer", json={"inputs": "The capital of France is"})
    assert ids.json() == direct_tok.json()

    def infer(url: str, binary: bool) -> list[int]:
        client = triton.InferenceServerClient(url=url.split("//", 1)[1])
        try:
            prompt = [504, 3575, 282, 4649, 314]
            inp = triton.InferInput("input0", [1, len(prompt)], "UINT32")
            inp.set_data_from_numpy(np.asarray([prompt], dtype=np.uint32), binary_data=binary)
            out = triton.InferRequestedOutput("output0", binary_data=binary)
            res = client.infer(MODEL, [inp], outputs=[out], parameters={"max_new_tokens": 8, "top_k": 1})
            return res.as_numpy("output0").tolist()
        finally:
            client.close()

    for binary in (False, True):
        assert infer(cluster.url, binary) == infer(cluster.server_url(1), binary)


def _without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created", "request_id")}


def test_vllm_and_native_same_output(cluster):
    for path, body in (("/generate", {"prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}),
                       ("/infer", {"inputs": "Hello, my name is", "stream": False,
                                   "parameters": {"max_new_tokens": 8}}),
                       ("/v2/models/" + MODEL + "/generate",
                        {"text_input": "Hello, my name is", "parameters": {"max_new_tokens": 8}})):
        direct = httpx.post(cluster.server_url(0) + path, json=body, timeout=60)
        via = httpx.post(cluster.url + path, json=body, timeout=60)
        assert via.status_code == direct.status_code == 200, (path, via.text)
        assert _without_ids(via.json()) == _without_ids(direct.json()), path
    with httpx.stream("POST", cluster.url + "/generate", json={"prompt": "Hi", "max_tokens": 5, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        parts = [p for p in r.read().split(b"\0") if p]
    assert parts and "text" in json.loads(parts[-1])


# -- management plane, metrics, controller -------------------------------------------------------------------
def test_management_probes_and_info(cluster):
    m = cluster.manage_url
    for path in ("/v1/startup", "/v1/health", "/v1/readiness", "/v2/health/live", "/v2/health/ready",
                 f"/v2/models/{MODEL}/ready"):
        r = httpx.get(m + path)
        assert r.status_code == 200 and r.content == b"", path
    assert httpx.get(m + "/v2/models/other/ready").status_code == 503
    ids = [cluster.server_id(0), cluster.server_id(1)]
    assert httpx.get(m + "/v1/instances/tasks", params=[("id", i) for i in ids]).json() == {"tasks": [0, 0]}
    assert httpx.post(m + "/v1/instances/query_tasks", json={"p_id": ids[0], "d_id": ids[1]}).json() == \
        {"is_end": True}
    info = httpx.get(m + "/v1/coordinator_info").json()
    assert sorted(e["id"] for e in info["schedule_info"]) == sorted(ids)
    assert set(info["request_length_info"]) == {"input_len", "output_len"}
    for path in ("/v1/startup", "/v1/health"):
        assert httpx.get(cluster.controller_url + path).json() == {"message": "", "status": "0"}


def test_metrics_sum_the_servers(cluster):
    time.sleep(1.1)  # past reuse_time
    per_server = []
    for srv in cluster.servers:
        text = httpx.get(f"http://127.0.0.1:{srv['metric_port']}/metrics").text
        per_server.append({n: metric_value(text, n) for n in ("request_success_total", "generation_tokens_total",
                                                               "e2e_request_latency_seconds_count")})
    text = httpx.get(cluster.manage_url + "/metrics").text
    for name in per_server[0]:
        assert metric_value(text, name) == sum(s[name] for s in per_server), name
    assert per_server[0]["request_success_total"] > 0 and per_server[1]["request_success_total"] > 0
    assert f'request_success_total{{model_name="{MODEL}"}}' in text
    assert 'e2e_request_latency_seconds_bucket{model_name="' + MODEL + '",le="+Inf"}' in text


def test_controller_files(cluster):
    status = json.loads((cluster.workdir / "logs/cluster_status_output.json").read_text())
    assert status["coordinator"] == [{"ip": "127.0.0.1", "is_healthy": True}]
    assert len(status["server"]) == 2
    for srv in status["server"]:
        assert srv["is_healthy"] and not srv["is_faulty"] and srv["model_name"] == MODEL
        assert srv["static_info"]["total_slots_num"] == 8 and srv["static_info"]["block_size"] == 16
        assert srv["static_info"]["total_block_num"] == 160 and srv["static_info"]["max_seq_len"] == 512
        assert set(srv["dynamic_info"]) == {"avail_block_num", "avail_slots_num"}
    backup = json.loads((cluster.workdir / "logs/controller_process_status.json").read_text())
    assert sorted(s["id"] for s in backup["server"]) == sorted([cluster.server_id(0), cluster.server_id(1)])
    for srv in backup["server"]:
        assert srv["is_initialized"] is False and srv["static_info"]["role"] == 85


def test_controller_restart_reloads_its_backup(cluster):
    cluster.kill("controller", signal.SIGTERM)
    assert cluster.procs["controller"].wait(timeout=20) == 0
    cluster._spawn("controller", ["controller", "--config", str(cluster.workdir / "ms_controller.json")])
    log = cluster.workdir / "logs/controller.log"
    deadline = time.monotonic() + 30
    while "reloaded 2 servers" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "reloaded 2 servers" in log.read_text()
    cluster.wait_instances(2, timeout=30)


# -- routing ---------------------------------------------------------------------------------------------------
def test_cache_affinity_keeps_each_conversation_on_one_server(cluster):
    conversations = [[{"role": "user", "content": f"Tell me about {topic}."}] for topic in ("cats", "rain", "tea")]
    servers: list[list[int]] = [[], [], []]
    for _turn in range(3):
        for n, messages in enumerate(conversations):
            def send(messages=messages):
                r = httpx.post(cluster.url + "/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=60)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]
            server, answer = served_by(cluster, send)
            servers[n].append(server)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    for n, seq in enumerate(servers):
        assert len(set(seq)) == 1, (n, servers)
    assert len({seq[0] for seq in servers}) == 2  # first turns were spread round robin


def test_offline_and_online(cluster):
    m = cluster.manage_url
    off = cluster.server_id(0)
    assert httpx.post(m + "/v1/instances/offline", json={"ids": "x"}).status_code == 400
    assert httpx.post(m + "/v1/instances/offline", json={"ids": [12345]}).status_code == 400
    assert httpx.post(m + "/v1/instances/offline", json={"ids": [off]}).status_code == 200
    body = {"inputs": "One", "parameters": {"max_new_tokens": 2}}
    try:
        for _ in range(3):
            server, r = served_by(cluster, lambda: httpx.post(cluster.url + "/generate", json=body, timeout=60))
            assert server == 1 and r.status_code == 200
    finally:
        assert httpx.post(m + "/v1/instances/online", json={"ids": [off]}).status_code == 200
    seen = {served_by(cluster, lambda: httpx.post(cluster.url + "/generate", json=body, timeout=60))[0]
            for _ in range(2)}
    assert seen == {0, 1}


# -- limits ----------------------------------------------------------------------------------------------------
class _Coordinator:
    """A second coordinator process with its own limits, given one instance by hand (no controller)."""

    def __init__(self, cluster: Cluster, tmp: Path, overrides: dict, env: dict[str, str],
                 instance: tuple[str, int] | None = None) -> None:
        cfg = default_coordinator_dict()
        for key, value in overrides.items():
            cfg[key].update(value)
        path = tmp / "limits_coordinator.json"
        path.write_text(json.dumps(cfg))
        self.port, self.manage = free_port(), free_port()
        # positional overrides replace the file's addresses
        args = [sys.executable, "-m", "mindie_host.cli", "coordinator", "--config", str(path), "127.0.0.1",
                str(self.port), "127.0.0.1", str(self.manage)]
        self.log = open(tmp / "limits_coordinator.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **env})
        self.url, self.manage_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.manage}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.manage_url + "/v1/startup").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert httpx.get(self.manage_url + "/v1/readiness").status_code == 503
        ip, port = instance or ("127.0.0.1", cluster.servers[1]["port"])
        iid = instance_id(ip, port)
        refresh = {"ids": [iid], "instances": [{
            "id": iid, "ip": ip, "port": port, "metric_port": port,
            "model_name": MODEL, "static_info": {"group_id": 0, "max_seq_len": 512, "max_output_len": 256,
                                                 "total_slots_num": 8, "total_block_num": 160, "block_size": 16},
            "dynamic_info": {"avail_slots_num": 8, "avail_block_num": 160}}]}
        assert httpx.post(self.manage_url + "/v1/instances/refresh", json={"ids": [1]}).status_code == 400
        assert httpx.post(self.manage_url + "/v1/instances/refresh", json=refresh).status_code == 200
        assert httpx.get(self.manage_url + "/v1/readiness").status_code == 200

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=20)
        self.log.close()


class _SlowInstance:
    """A deliberately slow HTTP peer on loopback, to drive the coordinator's deadlines and queue deterministically."""

    def __init__(self) -> None:
        import threading

        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        async def slow(request):  # a complete answer after 3 s
            await asyncio.sleep(3)
            return JSONResponse({"generated_text": "late"})

        async def late_first(request):  # headers at once, the first chunk after 3 s
            async def chunks():
                await asyncio.sleep(3)
                yield b"data: {}\n\n"
            return StreamingResponse(chunks(), media_type="text/event-stream")

        async def drip(request):  # a chunk every 0.3 s for 6 s
            async def chunks():
                for n in range(20):
                    yield f"data: {{\"n\": {n}}}\n\n".encode()
                    await asyncio.sleep(0.3)
            return StreamingResponse(chunks(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/slow", slow, methods=["POST"]), Route("/late_first", late_first,
                                                                                 methods=["POST"]),
                                Route("/drip", drip, methods=["POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_limits_refuse_as_configured(cluster, tmp_path):
    slow = _SlowInstance()
    coord = _Coordinator(cluster, tmp_path, {
        "request_limit": {"body_limit": 1, "single_node_max_requests": 1000},
        "exception_config": {"schedule_timeout": 1, "infer_timeout": 2, "first_token_timeout": 1},
    }, env={"MINDIE_MS_COORDINATOR_CONFIG_MAX_REQ": "3", "MINDIE_MS_COORDINATOR_CONFIG_SINGLE_NODE_MAX_REQ": "1"},
        instance=("127.0.0.1", slow.port))
    try:
        big = {"inputs": "x" * (1024 * 1024 + 10), "parameters": {"max_new_tokens": 1}}
        r = httpx.post(coord.url + "/generate", json=big, timeout=30)
        assert r.status_code == 413 and "body_limit" in r.json()["error"]

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.ensure_future(client.post(coord.url + "/slow", json={}))
                await asyncio.sleep(0.3)  # the instance (cap 1) is busy: the next two queue, the fourth is refused
                rest = [asyncio.ensure_future(client.post(coord.url + "/slow", json={})) for _ in range(3)]
                return list(await asyncio.gather(first, *rest))

        results = asyncio.run(burst())
        errors = [r.json()["error"] for r in results]
        assert results[0].status_code == 504 and errors[0] == "Request inference timeout", errors
        codes = sorted((r.status_code, e) for r, e in zip(results[1:], errors[1:]))
        assert codes == [(429, "Too many requests"), (504, "Request schedule timeout"),
                         (504, "Request schedule timeout")], codes
        r = httpx.post(coord.url + "/late_first", json={}, timeout=30)
        assert r.status_code == 504 and r.json()["error"] == "Request first token timeout"
        with httpx.stream("POST", coord.url + "/drip", json={}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert 3 < len(events) < 20 and json.loads(events[-1][5:])["error"] == "Request inference timeout"
    finally:
        coord.close()
        slow.close()


# -- faults ----------------------------------------------------------------------------------------------------
def test_sigkill_one_server_under_load(cluster):
    url = cluster.url + "/v1/chat/completions"
    # 64 tokens: the streams on the killed server are far from done when it dies (it is killed once all six have
    # their first token), and the survivor finishes the rest (10 requests at most, its batch is 8) in few steps
    tokens = 64
    body = {**CHAT, "max_tokens": tokens, "ignore_eos": True}
    started = 0

    async def stream(client: httpx.AsyncClient, n: int) -> tuple[str, int]:
        nonlocal started
        chunks = 0
        async with client.stream("POST", url, json={**body, "stream": True,
                                                    "messages": [{"role": "user", "content": f"Story {n}"}]}) as r:
            if r.status_code != 200:
                return f"http {r.status_code}", 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return "done", chunks
                event = json.loads(payload)
                if "error" in event:
                    assert "failed during the stream" in event["error"]["message"]
                    return "error-event", chunks
                chunks += 1
                if chunks == 1:
                    started += 1
        return "cut", chunks

    async def plain(client: httpx.AsyncClient, n: int) -> tuple[str, int]:
        r = await client.post(url, json={**body, "messages": [{"role": "user", "content": f"Poem {n}"}]})
        return ("done" if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens
                else f"http {r.status_code} {r.text[:200]}"), 0

    async def load() -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
        async with httpx.AsyncClient(timeout=300) as client:
            streams = [asyncio.ensure_future(stream(client, n)) for n in range(6)]
            deadline = time.monotonic() + 120
            while started < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert started == 6, started
            # the coordinator decides where each stream goes (cache affinity may put all six on one server): the
            # victim is a server that holds started streams, so the test never depends on the split or on timing
            busy = await asyncio.to_thread(server_metric, cluster, "num_requests_running")
            victim = max(range(2), key=lambda k: busy[k])
            assert busy[victim] >= 1, busy
            # plain requests that reach the victim have sent nothing yet: they are retried on the survivor
            plains = [asyncio.ensure_future(plain(client, n)) for n in range(4)]
            await asyncio.sleep(0.2)
            cluster.kill(f"server-{victim}")
            # the survivors finish their tokens on one server; the suite's other worker shares the CPU
            return (victim, await asyncio.wait_for(asyncio.gather(*streams), 300),
                    await asyncio.wait_for(asyncio.gather(*plains), 300))

    victim, streams, plains = asyncio.run(load())
    survivor = 1 - victim
    assert all(outcome == "done" for outcome, _ in plains), plains
    for outcome, chunks in streams:
        assert outcome in ("done", "error-event"), streams
        if outcome == "error-event":
            assert chunks >= 1  # only streams that had started fail
    assert any(outcome == "error-event" for outcome, _ in streams), streams
    r = httpx.post(url, json={**CHAT, "messages": [{"role": "user", "content": "Still there?"}]}, timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 20
    while cluster.live_ids() != [cluster.server_id(survivor)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.live_ids() == [cluster.server_id(survivor)]
    status = json.loads((cluster.workdir / "logs/cluster_status_output.json").read_text())
    assert sorted(s["is_healthy"] for s in status["server"]) == [False, True]
    # back in rotation once it is healthy again
    cluster.start_server(victim)
    cluster.wait_instances(2, timeout=120)
    seen = {served_by(cluster, lambda: httpx.post(cluster.url + "/generate", json={
        "inputs": "Back", "parameters": {"max_new_tokens": 2}}, timeout=60))[0] for _ in range(2)}
    assert seen == {0, 1}


def _process_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            pass
    return found


def test_each_server_gets_its_share_of_the_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = usable_cores()
    assert Cluster(tmp_path / "a", 3).server_threads() == max(1, cores // 3)
    assert Cluster(tmp_path / "b", 1).server_threads() == cores
    assert Cluster(tmp_path / "c", 2, env={"OMP_NUM_THREADS": "5"}).server_threads() is None  # the operator's own


def test_cluster_command_starts_everything_and_ctrl_c_stops_it(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny-llama")
    cfg_path = tmp_path / "server.json"
    cfg_path.write_text(json.dumps(server_config(model, schedule=SCHEDULE, deploy=DEPLOY)))
    port = free_port()
    # without OMP_NUM_THREADS of its own (the suite's workers set one), the command gives its server every core
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "cluster", "--servers", "1", "--server-config",
                             str(cfg_path), "--port", str(port), "--workdir", str(tmp_path / "work")],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("ready:"):
                break
        assert lines and lines[-1].startswith("ready:"), lines
        # keep reading stderr (no write can then block on a full pipe); its tail explains an exit that times out
        drain = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
        drain.start()
        r = httpx.post(f"http://127.0.0.1:{port}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                       timeout=60)
        assert r.status_code == 200
        if Path("/proc/self/environ").exists():  # the server's environment, where the OS shows it (Linux)
            servers = [pid for pid in _children(proc.pid)
                       if b" serve " in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")]
            assert len(servers) == 1, servers
            assert _process_env(servers[0]).get("OMP_NUM_THREADS") == str(usable_cores())
        ports = [port]
        for name in ("server-0.json", "ms_controller.json", "ms_coordinator.json"):
            data = json.loads((tmp_path / "work" / name).read_text())
            ports += [data["ServerConfig"]["port"], data["ServerConfig"]["managementPort"]] if "ServerConfig" in data \
                else [data["http_server"]["port"]] if "http_server" in data else [int(data["http_config"]["manage_port"])]
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=90) == 0, "".join(lines[-40:])
        for p in ports:  # every process is gone: nothing listens any more
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://127.0.0.1:{p}/", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
