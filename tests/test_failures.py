"""Failure behaviour: client disconnects, a failing batch, request timeouts, SIGTERM drain.

After each failure the KV blocks in use, read from the Prometheus endpoint, return to zero.
Faults are injected by wrapping the real backend's ``execute``; the model itself is real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.testing import RunningServer, server_config

#: the engine on a thread of the server's process, where a test can wrap the backend's execute
IN_PROCESS = {"engineProcess": False}

MARKER_IDS = [1000, 2000, 3000, 1000, 2000, 3000]


def blocks_in_use(server: RunningServer | str) -> float:
    """``mindie_host_kv_blocks_used`` from /metrics."""
    url = server if isinstance(server, str) else server.metrics_url
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("mindie_host_kv_blocks_used{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("mindie_host_kv_blocks_used missing from /metrics")


def metric(server: RunningServer, name: str) -> float:
    for line in httpx.get(server.metrics_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def wait_blocks_free(server: RunningServer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while blocks_in_use(server) != 0 or server.host.stats().get("num_active_requests", 0):
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still in use: {blocks_in_use(server)}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[RunningServer]:
    # the engine in this process: these tests wrap the backend to inject faults
    with RunningServer(server_config(tiny_model, server=IN_PROCESS)) as srv:
        yield srv


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server: RunningServer) -> None:
    aborted_before = server.host.stats().get("finished_abort", 0)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions",
                           json={"model": "tiny", "prompt": "Once upon a time", "max_tokens": 500,
                                 "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got >= 3:
                    break
            assert blocks_in_use(server) > 0  # the request holds KV blocks while it runs
    # the connection is closed mid-stream: the request is aborted, not run to its 500 tokens
    deadline = time.monotonic() + 30
    while server.host.stats().get("finished_abort", 0) <= aborted_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.host.stats().get("finished_abort", 0) == aborted_before + 1
    wait_blocks_free(server)


def test_backend_exception_fails_only_that_batch(server: RunningServer) -> None:
    backend = server.host.backend
    assert backend is not None
    original = backend.execute
    fired = threading.Event()

    def faulty(batch: Any) -> Any:
        ids = list(batch.input_ids)
        marked = any(ids[i:i + len(MARKER_IDS)] == MARKER_IDS for i in range(len(ids) - len(MARKER_IDS) + 1))
        if marked and not fired.is_set():
            fired.set()
            raise RuntimeError("injected fault for the marked request")
        return original(batch)

    backend.execute = faulty  # type: ignore[method-assign]
    failed_before = metric(server, "request_failed_total")
    results: dict[str, Any] = {}

    def healthy_stream() -> None:
        chunks = []
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "A long healthy story", "max_tokens": 200,
                                "ignore_eos": True, "stream": True}) as r:
            results["healthy_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    results.setdefault("started", threading.Event()).set()
        results["healthy"] = chunks

    results["started"] = threading.Event()
    worker = threading.Thread(target=healthy_stream)
    try:
        worker.start()
        assert results["started"].wait(60)
        bad = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": MARKER_IDS, "max_tokens": 5},
                         timeout=60)
        worker.join(120)
    finally:
        backend.execute = original  # type: ignore[method-assign]
    assert fired.is_set()
    assert bad.status_code == 500
    assert "backend error" in bad.json()["error"]["message"]
    assert "injected" not in bad.json()["error"]["message"]  # the exception is logged, never sent (issue 15)
    assert results["healthy_status"] == 200
    healthy = results["healthy"]
    assert len(healthy) >= 100  # the stream in flight beside the failed batch ran to its end
    assert healthy[-1]["choices"][0]["finish_reason"] == "length"
    # the server keeps serving, the failure is counted, and no block leaks
    after = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Still there?",
                                                             "max_tokens": 3}, timeout=60)
    assert after.status_code == 200
    assert after.json()["usage"]["completion_tokens"] == 3
    assert metric(server, "request_failed_total") == failed_before + 1
    wait_blocks_free(server)


def test_request_timeout_cancels_and_frees(tiny_model: Path) -> None:
    cfg = server_config(tiny_model, server={"requestTimeoutSeconds": 0.5, **IN_PROCESS})
    with RunningServer(cfg) as srv:
        backend = srv.host.backend
        assert backend is not None
        original = backend.execute

        def slow(batch: Any) -> Any:
            time.sleep(0.02)  # a slow device: 400 tokens take far longer than the 0.5 s allowed
            return original(batch)

        backend.execute = slow  # type: ignore[method-assign]
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Tell me everything",
                                                          "max_tokens": 400, "ignore_eos": True}, timeout=60)
        assert r.status_code == 408
        assert "timed out after 0.5 s" in r.json()["error"]["message"]
        assert srv.host.stats().get("finished_timeout", 0) == 1
        wait_blocks_free(srv)
        backend.execute = original  # type: ignore[method-assign]
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "Quick", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200


def test_sigterm_drains_in_flight_requests_then_exits(tiny_model: Path, tmp_path: Path) -> None:
    cfg = server_config(tiny_model, schedule={"maxIterTimes": 1000}, deploy={"maxSeqLen": 2048,
                                                                              "maxInputTokenLen": 1024},
                        server={"shutdownDrainSeconds": 300})  # the 1000 tokens finish within it on a loaded machine
    cfg["LogConfig"]["logPath"] = str(tmp_path / "server.log")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    s = cfg["ServerConfig"]
    url, mgmt = f"http://127.0.0.1:{s['port']}", f"http://127.0.0.1:{s['managementPort']}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "serve", "--config", str(path)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "server died"
            try:
                if httpx.get(mgmt + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.2)
        chunks_after_term = 0
        finish = None
        sent = False
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": "Count slowly", "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
            assert r.status_code == 200
            done = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                if not sent:
                    proc.send_signal(signal.SIGTERM)
                    sent = True
                else:
                    chunks_after_term += 1
                finish = json.loads(line[6:])["choices"][0].get("finish_reason") or finish
        assert done
        assert finish == "length"
        assert chunks_after_term > 0  # the stream went on after SIGTERM
        assert proc.wait(60) == 0
        log_text = (tmp_path / "server.log").read_text()
        assert "draining" in log_text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_drain_timeout_ends_requests_that_do_not_finish(tiny_model: Path) -> None:
    """A stop waits at most shutdownDrainSeconds; what is still running then ends with a normal final event."""
    srv = RunningServer(server_config(tiny_model, server={"shutdownDrainSeconds": 0.5, **IN_PROCESS})).start()
    backend = srv.host.backend
    assert backend is not None
    original = backend.execute

    def slow(batch: Any) -> Any:
        time.sleep(0.05)  # 400 tokens need ~20 s, far beyond the 0.5 s drain
        return original(batch)

    backend.execute = slow  # type: ignore[method-assign]
    events: list[dict[str, Any]] = []
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Never ending", "max_tokens": 400, "ignore_eos": True,
                                "stream": True}) as r:
            assert r.status_code == 200
            stopper = None
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if stopper is None:
                        stopper = threading.Thread(target=srv.stop)
                        stopper.start()
        assert stopper is not None
        stopper.join(60)
        assert srv._thread is not None and not srv._thread.is_alive()
    finally:
        srv.stop()
    assert not [e for e in events if "error" in e]  # never a 500 / error event (issue 15, point 13)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(events) < 400
    assert srv.host.stats()["kv_blocks_used"] == 0
