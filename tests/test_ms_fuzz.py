"""The coordinator and the controller under hostile input, as tests/test_fuzz.py does for the server.

A real cluster on the tiny model (one server, a controller, a coordinator, each its own process) is
sent hypothesis bodies on every route of the coordinator's management port, its user port and the
controller's HTTP server. Every answer is below 500 (bar the spec's 503s of readiness and
``/metrics``), every refusal names its problem, and afterwards both processes still serve: the
controller's next refresh puts the server back in rotation and a chat request goes through.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz import HOSTILE, PLAUSIBLE, RAW, bodies, json_values

from mindie_host.ms.cluster import Cluster
from mindie_host.ms.controller.app import controller_app
from mindie_host.ms.controller.config import controller_config_from_dict, default_controller_dict
from mindie_host.ms.controller.poller import Controller
from mindie_host.ms.coordinator.app import Coordinator
from mindie_host.ms.coordinator.config import coordinator_config_from_dict, default_coordinator_dict
from mindie_host.testing import server_config

MODEL = "tiny"
DEEP = b"[" * 50_000 + b"]" * 50_000
#: statuses the spec gives a route besides 2xx/4xx (readiness answers 503 with an empty body)
SPEC_503 = {
    "/v1/readiness",
    "/v2/health/ready",
    "/v2/models/{model}/ready",
    "/metrics",
    "/v1/instances/offline",
    "/v1/instances/online",
}
EMPTY_503 = {"/v1/readiness", "/v2/health/ready", "/v2/models/{model}/ready"}


def routes(app: Any) -> list[tuple[str, str]]:
    return [(method, r.path) for r in app.routes if hasattr(r, "methods") for method in sorted(r.methods - {"HEAD"})]


def _coordinator_routes() -> list[tuple[str, str]]:
    coordinator = Coordinator(coordinator_config_from_dict(default_coordinator_dict(), environ={}))
    try:
        return routes(coordinator.manage_app())
    finally:
        asyncio.run(coordinator.close())


MANAGE_ROUTES = _coordinator_routes()
CONTROLLER_ROUTES = routes(
    controller_app(Controller(controller_config_from_dict(default_controller_dict(), environ={})))
)
USER_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/infer",
    "/v2/models/{model}/generate",
    "/v1/tokenizer",
    "/{any}",
]

INSTANCE = {
    "id": 2130706433 << 16 | 1030,
    "ip": "127.0.0.1",
    "port": 1030,
    "metric_port": 1030,
    "model_name": MODEL,
    "static_info": {
        "group_id": 0,
        "max_seq_len": 1024,
        "max_output_len": 512,
        "total_slots_num": 8,
        "total_block_num": 100,
        "block_size": 16,
        "role": 85,
    },
    "dynamic_info": {"avail_slots_num": 8, "avail_block_num": 100, "peers": []},
}
SEEDS = {
    "/v1/instances/refresh": {"ids": [INSTANCE["id"]], "instances": [INSTANCE]},
    "/v1/instances/offline": {"ids": [7, 8]},
    "/v1/instances/online": {"ids": [7]},
    "/v1/instances/query_tasks": {"p_id": 7, "d_id": 8},
}
REFRESH_FIELDS = [
    "ids",
    "instances",
    "id",
    "ip",
    "port",
    "metric_port",
    "model_name",
    "static_info",
    "dynamic_info",
    "group_id",
    "max_seq_len",
    "max_output_len",
    "total_slots_num",
    "total_block_num",
    "block_size",
    "role",
    "inter_comm_port",
    "avail_slots_num",
    "avail_block_num",
    "peers",
    "p_id",
    "d_id",
]
U64ISH = st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**64, -1, 10**30, "7", "²", "0x10", "9" * 5000, 1.5, None, True])


@st.composite
def management_body(draw: st.DrawFn, path: str) -> Any:
    """A seed body for the route with a few of its fields, at any depth, replaced by hostile values."""
    body = json.loads(json.dumps(SEEDS.get(path, {"ids": [1]})))
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        target = body
        while draw(st.booleans()):  # walk down into a nested object or list
            children = [
                v
                for v in (target.values() if isinstance(target, dict) else target)
                if isinstance(v, (dict, list)) and v
            ]
            if not children:
                break
            target = draw(st.sampled_from(children))
        value = draw(U64ISH | PLAUSIBLE | HOSTILE)
        if isinstance(target, list):
            target[draw(st.integers(0, len(target) - 1))] = value
        elif draw(st.integers(0, 4)) == 0 and target:
            target.pop(draw(st.sampled_from(sorted(target))))
        else:
            target[draw(st.sampled_from(REFRESH_FIELDS) if draw(st.booleans()) else st.text(max_size=8))] = value
    return body


def fill(path: str, value: str) -> str:
    return path.replace("{model}", value).replace("{any}", value)


def check(client: httpx.Client, method: str, template: str, url: str, **kwargs: Any) -> None:
    with client.stream(method, url, **kwargs) as r:
        body = r.read()
    sent = {k: (v[:200] if isinstance(v, bytes) else v) for k, v in kwargs.items()}
    assert r.status_code != 500, f"{method} {url} -> 500: {body[:300]!r} (sent {sent})"
    if r.status_code >= 500:
        assert r.status_code == 503 and template in SPEC_503, f"{method} {url} -> {r.status_code}: {body[:300]!r}"
    if r.status_code >= 400 and not (r.status_code == 503 and template in EMPTY_503):
        assert body.strip(), f"{method} {url} -> {r.status_code} with an empty body (sent {sent})"
        assert len(body) < 5000, f"{method} {url} echoed a large body back ({len(body)} bytes)"


def fuzz_route(base: str, method: str, template: str, body_strategy: st.SearchStrategy[Any], examples: int) -> None:
    client = httpx.Client(timeout=60)

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        body=body_strategy,
        raw=RAW | st.just(DEEP),
        path_value=st.sampled_from([MODEL, "nope", "x" * 300, "-"]),
        query=st.lists(st.sampled_from(["7", "", "²", "9" * 30, "-1", "a"]), max_size=3),
        use_raw=st.integers(0, 4),
    )
    def run(body: Any, raw: bytes, path_value: str, query: list[str], use_raw: int) -> None:
        url = base + fill(template, path_value)
        params = [("id", q) for q in query]
        if use_raw == 0:
            check(
                client, method, template, url, params=params, content=raw, headers={"content-type": "application/json"}
            )
        elif method in ("POST", "PUT", "PATCH", "DELETE") or use_raw == 1:
            check(client, method, template, url, params=params, content=json.dumps(body, ensure_ascii=False).encode())
        else:
            check(client, method, template, url, params=params)

    try:
        run()
    finally:
        client.close()


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("ms-fuzz")
    cfg = server_config(
        tiny_model,
        schedule={"maxIterTimes": 4, "maxBatchSize": 8, "maxPrefillBatchSize": 8},
        model={"modelName": MODEL},
        server={"engineProcess": False},  # the server is the coordinator's target here: one process less to start
    )
    c = Cluster(
        tmp,
        1,
        server_config=cfg,
        controller={"rank_table_detecting_seconds": 1},
        coordinator={"exception_config": {"max_retry": 1}},
        env={"MINDIE_HOST_CPU_KERNELS": "0"},
    )  # the server's speed is not the point: no kernel build
    c.start(timeout=300)
    yield c
    c.stop()


def chat_works(cluster: Cluster, timeout: float = 30) -> None:
    """The coordinator routes a chat request to the server again (after the controller's next refresh)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text


def test_deep_json_is_a_400_that_names_it(cluster: Cluster) -> None:
    for path in ("/v1/instances/refresh", "/v1/instances/offline", "/v1/instances/query_tasks"):
        r = httpx.post(cluster.manage_url + path, content=DEEP, timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert "nested too deeply" in r.json()["error"]
    r = httpx.post(cluster.manage_url + "/v1/instances/refresh", json={"ids": [1], "instances": [{"id": 1}]})
    assert r.status_code == 400 and r.json() == {"error": "instances[0].ip must be an IPv4 address, got None"}
    r = httpx.post(cluster.url + "/v1/chat/completions", content=DEEP, timeout=30)  # routed; the server's 4xx
    assert 400 <= r.status_code < 500, r.text
    assert "nested too deeply" in r.text
    chat_works(cluster)


def test_fuzz_user_port(cluster: Cluster) -> None:
    for path in USER_PATHS:
        fuzz_route(
            cluster.url,
            "POST",
            path,
            bodies(path if path != "/{any}" else "/v1/completions"),
            12 if path == "/v1/chat/completions" else 4,  # the bodies themselves: tests/test_fuzz.py, on the server
        )
    chat_works(cluster)


@pytest.mark.parametrize(("method", "path"), MANAGE_ROUTES, ids=[f"{m} {p}" for m, p in MANAGE_ROUTES])
def test_fuzz_coordinator_management(cluster: Cluster, method: str, path: str) -> None:
    strategy = (
        management_body(path) | json_values | st.dictionaries(st.sampled_from(REFRESH_FIELDS), json_values, max_size=4)
    )
    fuzz_route(cluster.manage_url, method, path, strategy, 40 if method == "POST" else 8)
    assert httpx.get(cluster.manage_url + "/v1/health").status_code == 200


@pytest.mark.parametrize(("method", "path"), CONTROLLER_ROUTES, ids=[f"{m} {p}" for m, p in CONTROLLER_ROUTES])
def test_fuzz_controller(cluster: Cluster, method: str, path: str) -> None:
    for other in ("POST", "PUT", "DELETE"):
        fuzz_route(cluster.controller_url, other, path, json_values, 3)
    fuzz_route(cluster.controller_url, method, path, json_values, 8)
    fuzz_route(cluster.controller_url, "GET", "/{any}", json_values, 5)
    r = httpx.get(cluster.controller_url + "/v1/health")
    assert r.status_code == 200 and r.json() == {"message": "", "status": "0"}


def test_both_still_serve(cluster: Cluster) -> None:
    assert all(p.poll() is None for p in cluster.procs.values())
    chat_works(cluster)
    assert httpx.get(cluster.manage_url + "/v1/readiness").status_code == 200
