"""Plugins across the engine-process boundary: engine commands, arrival hooks, per-request faults.

A test plugin (registered by object, so it is pickled to the engine process) answers
``mindie_host_engine_command`` with the pid of the process it runs in, refuses marked
requests in ``mindie_host_request_arrived``, and gives other marked requests a logits
constraint that raises. Each is checked in the default mode (the engine in its own process)
and, for the commands, with the engine on a thread of the server's process.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.api import EngineRequest, RequestError, hookimpl
from mindie_host.testing import RunningServer, make_tiny_llama, server_config

PLUGIN = "probe"


class _Boom:
    """A logits constraint that fails on its request's first sampled step."""

    def __call__(self, output_token_ids: list[int]) -> list[int]:
        raise RuntimeError("injected constraint fault")


class Probe:
    """Engine commands and arrival checks, as a plugin that keeps state beside the model would."""

    @hookimpl
    def mindie_host_engine_command(self, ctx: Any, target: str, command: str, payload: Any) -> Any:
        if target != PLUGIN:
            return None
        if command == "where":
            return {"pid": os.getpid(), "echo": payload}
        if command == "refuse":
            raise RequestError("payload.size must be in [1, 8]", status=422, field="payload.size")
        if command == "crash":
            raise ValueError("secret internal detail")
        return None  # unknown command: nobody answers

    @hookimpl
    def mindie_host_refine_request(self, ctx: Any, request: EngineRequest, body: dict[str, Any]) -> None:
        mark = body.get("user")
        if mark:
            request.extensions[PLUGIN] = mark
        if mark == "boom":
            request.logits_constraint = _Boom()

    @hookimpl
    def mindie_host_request_arrived(self, ctx: Any, request: EngineRequest) -> None:
        if request.extensions.get(PLUGIN) == "refuse-me":
            raise RequestError("probe refused this request in the engine", status=409)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-engine-plugins"))


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "in-process"])
def server(request: pytest.FixtureRequest, tiny_model: Path) -> Any:
    cfg = server_config(tiny_model, server={"engineProcess": request.param})
    with RunningServer(cfg, plugins=[(Probe(), PLUGIN)]) as srv:
        yield srv


def _command(srv: RunningServer, command: str, payload: Any = None) -> Any:
    return srv.call(srv.host.engine_command(PLUGIN, command, payload))


def test_an_engine_command_runs_where_the_engine_lives(server: RunningServer) -> None:
    (answer,) = _command(server, "where", {"n": [1, 2]})
    assert answer["echo"] == {"n": [1, 2]}
    in_process = not server.config.server.engineProcess
    assert (answer["pid"] == os.getpid()) == in_process
    if not in_process:
        assert answer["pid"] == server.host.engine.process.pid


def test_engine_command_refusals_reach_the_caller(server: RunningServer) -> None:
    with pytest.raises(RequestError) as refused:
        _command(server, "refuse")
    assert refused.value.status == 422 and refused.value.field == "payload.size"
    with pytest.raises(RequestError) as crashed:
        _command(server, "crash")
    assert crashed.value.status == 500 and "secret" not in crashed.value.message
    with pytest.raises(RequestError) as unknown:
        _command(server, "nothing")
    assert unknown.value.status == 404 and "nothing" in unknown.value.message
    with pytest.raises(RequestError) as nobody:
        server.call(server.host.engine_command("no_such_plugin", "where", None))
    assert nobody.value.status == 404
    assert _command(server, "where")[0]["echo"] is None  # the engine goes on


def _stream(url: str, results: list[dict[str, Any]]) -> None:
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        results.append({"status": resp.status_code, "text": resp.read().decode()})


def test_a_plugin_fault_for_one_request_fails_only_that_request(server: RunningServer) -> None:
    """An arrival refusal and a raising logits constraint end their own requests; a stream beside them finishes."""
    results: list[dict[str, Any]] = []
    healthy = threading.Thread(target=_stream, args=(server.url, results))
    healthy.start()
    url = server.url + "/v1/completions"
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 8}
    refused = httpx.post(url, json={**base, "user": "refuse-me"}, timeout=60)
    boom = httpx.post(url, json={**base, "user": "boom"}, timeout=60)
    healthy.join(120)
    assert refused.status_code == 409 and "probe refused this request" in refused.text
    assert boom.status_code == 500 and "injected" not in boom.text
    events = [json.loads(line[6:]) for line in results[0]["text"].splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.host.engine.dead is None
    again = httpx.post(url, json=base, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 8
