"""The engine core in its own process (ServerConfig.engineProcess): SIGKILL under load, restart, liveness.

One real server on a tiny random Llama. The engine process is killed with SIGKILL while
streaming and non-streaming requests run: each one is answered (completed, or ended with a
clear error), readiness goes 503 and back to 200, the restart counter says 1, and the service
answers again within a load time plus a few seconds. A second kill with the retry budget
(engineRestartMaxRetries=1) spent makes liveness fail.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.api import hookimpl
from mindie_host.engine import ipc
from mindie_host.engine.handle import EngineStartError
from mindie_host.engine.request import EngineRequest, RequestOutput, SamplingParams, TokenLogprob
from mindie_host.testing import RunningServer, make_tiny_llama, server_config, wait_for

CLIENT_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-engine-process"))


def test_requests_and_outputs_cross_the_wire_unchanged() -> None:
    """Plain fields go as msgpack; a callable constraint and a payload travel pickled beside them."""
    req = EngineRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], logit_bias={5: -100.0}),
                        payload={"image": b"\x00"}, span_keys=[(0, 2, b"key")],
                        logits_constraint=_Allow([7]))
    back = ipc.decode_request(ipc.encode_request(req))
    assert back.sampling == req.sampling and back.prompt_token_ids == [1, 2, 3]
    assert back.payload == {"image": b"\x00"} and back.span_keys == [(0, 2, b"key")]
    assert back.logits_constraint([1]) == [7]
    out = RequestOutput("r1", [4], "a", "a", [4], 3, finished=True, finish_reason="stop",
                        logprobs=[TokenLogprob(4, -0.5, [(4, -0.5), (9, -1.0)])])
    frames = ipc.encode(ipc.OUTPUTS, [out], {"num_running": 1.0})
    assert ipc.decode_outputs(frames[1]) == [out]


class _Allow:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self, output_token_ids: list[int]) -> list[int]:
        return self.ids


def _completion(url: str, stream: bool, results: list[dict[str, Any]]) -> None:
    body = {"model": "tiny", "prompt": "tell me a long story", "max_tokens": 900, "ignore_eos": True,
            "stream": stream}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as resp:
            text = resp.read().decode()
        results.append({"stream": stream, "status": resp.status_code, "text": text})
    except Exception as exc:  # a hang or a dropped connection: the test fails on it
        results.append({"stream": stream, "status": None, "text": repr(exc)})


def _outcome(result: dict[str, Any]) -> str:
    """``completed`` or ``failed`` (with a clear error); anything else is a bug."""
    text = result["text"]
    if not result["stream"]:
        body = json.loads(text)
        if result["status"] == 200:
            assert body["choices"][0]["finish_reason"] == "length"
            return "completed"
        assert result["status"] >= 500 and "engine process died" in json.dumps(body), result
        return "failed"
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert result["status"] == 200 and events, result
    last = events[-1] if events[-1] != "[DONE]" else events[-2]
    payload = json.loads(last)
    if "error" in payload:
        assert "engine process died" in json.dumps(payload["error"]), payload
        return "failed"
    assert payload["choices"][0]["finish_reason"] == "length", payload
    return "completed"


@pytest.mark.slow  # three model loads in spawned processes: about 80 s on 2 idle cores
def test_sigkill_under_load_restarts_the_engine_and_spent_budget_fails_liveness(tiny_model: Path) -> None:
    cfg = server_config(tiny_model, server={"engineProcess": True, "engineRestartMaxRetries": 1,
                                            "engineRestartBackoffSeconds": 0.1})
    started = time.monotonic()
    with RunningServer(cfg, timeout=180) as srv:
        load_seconds = time.monotonic() - started
        engine = srv.host.engine
        mgmt = srv.management_url
        assert engine.process.pid != os.getpid()
        assert httpx.get(f"{mgmt}/v2/health/ready").status_code == 200

        results: list[dict[str, Any]] = []
        threads = [threading.Thread(target=_completion, args=(srv.url, i % 2 == 0, results)) for i in range(6)]
        for t in threads:
            t.start()
        wait_for(lambda: engine.num_active == 6 and engine.engine_stats.get("num_running", 0) >= 1, 30,
              "six requests running")
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{mgmt}/v2/health/ready").status_code == 503, 2, "readiness 503")
        assert "restarting" in httpx.get(f"{mgmt}/v2/health/ready").text
        assert httpx.get(f"{mgmt}/v2/health/live").status_code == 200  # it may come back: no pod restart
        for t in threads:
            t.join(CLIENT_TIMEOUT + 5)
        assert len(results) == 6
        outcomes = [_outcome(r) for r in results]
        assert "failed" in outcomes  # the kill hit requests in flight, and each got a clear error

        back = wait_for(lambda: httpx.get(f"{mgmt}/v2/health/ready").status_code == 200, load_seconds + 30,
                     "readiness 200 after the restart")
        assert back < load_seconds + 30
        assert engine.restarts == 1
        metrics = httpx.get(f"{srv.metrics_url}/metrics").text
        assert 'mindie_host_engine_restarts_total{model_name="tiny"} 1' in metrics
        again = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                           timeout=CLIENT_TIMEOUT)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4

        # a second death in a row, with the budget of one restart spent: liveness fails for good
        os.kill(engine.process.pid, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{mgmt}/v2/health/live").status_code == 503, 10, "liveness 503")
        assert httpx.get(f"{mgmt}/v2/health/ready").status_code == 503
        assert "engineRestartMaxRetries" in (engine.dead or "")
        refused = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                             timeout=CLIENT_TIMEOUT)
        assert refused.status_code == 503


class HookPlaces:
    """Notes which process runs each hook; refuses to start where there is no model backend."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def _note(self, what: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"{what} {os.getpid()}\n")

    @hookimpl
    def mindie_host_kv_cache_manager(self, ctx: Any, num_blocks: int, block_size: int) -> None:
        self._note("kv")

    @hookimpl
    def mindie_host_startup(self, ctx: Any) -> None:
        host = ctx.host
        self._note(f"startup-backend={host.backend is not None}")
        if host.backend is None:
            raise RuntimeError("this plugin shares an object with the model backend")


def test_engine_hooks_run_in_the_engine_process_and_a_backend_bound_plugin_is_refused(
        tiny_model: Path, tmp_path: Path) -> None:
    notes = tmp_path / "hooks.txt"
    srv = RunningServer(server_config(tiny_model, server={"engineProcess": True}),
                        plugins=[(HookPlaces(notes), "hook-places")], timeout=180)
    with pytest.raises(EngineStartError, match="engineProcess false"):
        srv.start()
    srv.stop()
    engine = srv.host.engine
    assert engine.process.exitcode is not None  # the engine process did not outlive the refusal
    child = engine.process.pid
    lines = notes.read_text().splitlines()
    assert lines == [f"kv {child}", f"startup-backend=True {child}", f"startup-backend=False {os.getpid()}"]
