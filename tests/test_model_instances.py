"""Several model instances in one server (BackendConfig.modelInstanceNumber = 2, npuDeviceIds [[0], [1]]).

Two engine processes behind one front end: concurrent requests are spread over both, greedy
output equals one instance's, and a SIGKILL of one instance leaves the other serving (readiness
stays 200) while the dead one restarts alone.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.testing import RunningServer, make_tiny_llama, server_config

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-instances"))


def _complete(url: str, prompt: str, max_tokens: int = 24) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow  # three tiny-model loads in spawned processes
def test_two_instances_share_the_load_and_fail_alone(tiny_model: Path) -> None:
    prompts = [f"request number {i}: tell me about the number {i * 7}" for i in range(8)]
    with RunningServer(server_config(tiny_model)) as one:
        reference = [_complete(one.url, p)["choices"][0]["text"] for p in prompts]

    cfg = server_config(tiny_model, server={"engineRestartBackoffSeconds": 0.1})
    cfg["BackendConfig"].update({"modelInstanceNumber": 2, "npuDeviceIds": [[0], [1]]})
    with RunningServer(cfg, timeout=180) as srv:
        instances = srv.host.engine
        assert len(instances.clients) == 2
        pids = [c.process.pid for c in instances.clients]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = [r["choices"][0]["text"] for r in pool.map(lambda p: _complete(srv.url, p), prompts)]
        assert texts == reference  # the same greedy output, whichever instance served it
        served = [c.engine_stats.get("requests_received", 0) for c in instances.clients]
        assert all(n > 0 for n in served) and sum(served) == 8, served  # both instances served requests
        assert srv.host.stats()["requests_received"] == 8  # /metrics sums the instances
        status = httpx.get(f"{srv.management_url}/v1/status").json()["resource"]
        assert status["availSlotsNum"] == 2 * cfg["BackendConfig"]["ScheduleConfig"]["maxBatchSize"]
        assert status["availBlockNum"] == sum(c.engine_stats["kv_blocks_free"] for c in instances.clients)

        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while instances.clients[0].up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not instances.clients[0].up
        assert httpx.get(f"{srv.management_url}/v2/health/ready").status_code == 200  # instance 1 still serves
        assert _complete(srv.url, prompts[0])["choices"][0]["text"] == reference[0]
        deadline = time.monotonic() + 60
        while not instances.clients[0].up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert instances.clients[0].up and instances.restarts == 1
        assert instances.clients[0].process.pid != pids[0]
