"""MindIE MS pd_separate, coordinator side: the P/D join against small in-test fake dmi servers.

:class:`FakeServer` speaks the PD wire protocol (``/tmp/pd_wire.md``, mindie_host/server/pd.py) with
canned tokens: as a P it answers the envelope and tells the D named by ``d-target`` to produce the
rest; as a D it pushes those envelopes on ``GET /dresult``. Its management port has ``/v1/config``,
``/v1/status`` and ``/v1/role/{role}`` (used by test_ms_pd_roles.py). A request body
``{"n": tokens, "stream": bool}`` yields tokens ``t0`` .. ``t{n-1}``: a stream is ``data: tK`` events
and ``data: [DONE]``, a non-stream answer ``{"text": "t0 t1 ..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from aiohttp import web

from mindie_host.ms.coordinator.app import Coordinator
from mindie_host.ms.coordinator.config import coordinator_config_from_dict, default_coordinator_dict
from mindie_host.ms.coordinator.instances import instance_id
from mindie_host.testing import free_port

HOST = "127.0.0.1"
TIMEOUT = 20.0


class FakeCluster:
    """Knobs shared by the fake servers of one test."""

    def __init__(self) -> None:
        self.servers: list[FakeServer] = []
        self.unit_delay = 0.0
        self.die_after: int | None = None  # the first D to decode dies after publishing this unit
        self.died = False
        self.d_silent = False  # D never answers
        self.d_error: dict[str, Any] | None = None  # the first D decode ends with this error
        self.p_refuse: tuple[int, dict[str, Any]] | None = None

    def by_target(self, text: str) -> FakeServer:
        host, _, port = text.partition(":")
        for srv in self.servers:
            if srv.inter_comm_port == int(port) and host == HOST:
                return srv
        raise LookupError(text)


class FakeServer:
    """One fake dmi server: management API, P inference route, D ``/dresult``."""

    def __init__(self, cluster: FakeCluster, *, role: str = "none", infer_mode: str = "dmi",
                 refuse_role: bool = False, never_ready: bool = False) -> None:
        self.cluster = cluster
        self.port, self.mgmt_port, self.inter_comm_port = free_port(), free_port(), free_port()
        self.role = role
        self.role_status = "RoleReady" if role != "none" else "RoleUnknown"
        self.infer_mode = infer_mode
        self.refuse_role = refuse_role
        self.never_ready = never_ready
        self.pushes: list[tuple[str, dict[str, Any]]] = []
        self.seen: list[dict[str, str]] = []
        self.channels: set[asyncio.Queue[str | None]] = set()
        self.runners: list[web.AppRunner] = []
        cluster.servers.append(self)

    @property
    def id(self) -> int:
        return instance_id(HOST, self.port)

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> FakeServer:
        business = web.Application()
        business.router.add_get("/dresult", self.dresult)
        business.router.add_post("/{path:.*}", self.prefill)
        mgmt = web.Application()
        mgmt.router.add_get("/v1/config", self.config)
        mgmt.router.add_get("/v1/status", self.status)
        mgmt.router.add_post("/v1/role/{role}", self.set_role)
        for app, port in ((business, self.port), (mgmt, self.mgmt_port)):
            runner = web.AppRunner(app, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, HOST, port).start()
            self.runners.append(runner)
        return self

    async def stop(self) -> None:
        for q in list(self.channels):
            q.put_nowait(None)
        runners, self.runners = self.runners, []
        for runner in runners:
            await runner.cleanup()

    # -- management -----------------------------------------------------------------------------------
    async def config(self, request: web.Request) -> web.Response:
        return web.json_response({"modelName": "fake", "maxSeqLen": 1024, "maxOutputLen": 512, "cacheBlockSize": 16,
                                  "maxBatchSize": 8, "totalBlockNum": 100, "inferMode": self.infer_mode,
                                  "interCommPort": self.inter_comm_port})

    async def status(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {"service": {"roleStatus": self.role_status,
                                            "currentRole": self.role if self.role_status == "RoleReady" else "none"},
                                "resource": {"availSlotsNum": 8, "availBlockNum": 100}}
        return web.json_response(body)

    async def set_role(self, request: web.Request) -> web.Response:
        role = request.match_info["role"]
        body = await request.json()
        self.pushes.append((role, body))
        if self.refuse_role or self.infer_mode != "dmi":
            return web.json_response({"error": "no", "error_type": "Bad Request"}, status=400)
        if not self.never_ready:
            self.role, self.role_status = role, "RoleReady"
        return web.json_response({"result": "OK"})

    # -- P --------------------------------------------------------------------------------------------
    async def prefill(self, request: web.Request) -> web.Response:
        if self.role != "prefill":
            return web.json_response({"error": "DMI inference requests can be sent only to the prefill node."},
                                     status=400)
        self.seen.append(dict(request.headers))
        if self.cluster.p_refuse is not None:
            status, body = self.cluster.p_refuse
            return web.json_response(body, status=status)
        body = await request.json()
        n, stream = int(body.get("n", 3)), bool(body.get("stream"))
        tokens = [f"t{k}" for k in range(n)]
        req_id = request.headers["req-id"]
        ctype = "text/event-stream" if stream else "application/json"
        if n == 1:  # P finishes alone
            output = "data: t0\n\ndata: [DONE]\n\n" if stream else json.dumps({"text": "t0"})
            return web.json_response({"reqId": req_id, "isStream": stream, "output": output, "isLastResp": True,
                                      "contentType": ctype})
        decoder = self.cluster.by_target(request.headers["d-target"])
        asyncio.get_running_loop().create_task(decoder.decode(req_id, tokens, stream))
        envelope: dict[str, Any] = {"reqId": req_id, "isStream": stream, "isLastResp": False, "contentType": ctype}
        if stream:
            envelope["output"] = "data: t0\n\n"
        return web.json_response(envelope)

    # -- D --------------------------------------------------------------------------------------------
    def publish(self, envelope: dict[str, Any]) -> None:
        line = json.dumps(envelope) + "\n"
        for q in self.channels:
            q.put_nowait(line)

    async def decode(self, req_id: str, tokens: list[str], stream: bool) -> None:
        c = self.cluster
        if c.d_silent:
            return
        await asyncio.sleep(c.unit_delay)
        if c.die_after == 0 and not c.died:  # dies before producing anything
            c.died = True
            await self.stop()
            return
        if c.d_error is not None:
            error, c.d_error = c.d_error, None
            self.publish({"reqId": req_id, "isStream": stream, "isLastResp": True, "seq": 1,
                          "output": json.dumps({"error": error["message"]}), "error": error})
            return
        if not stream:
            self.publish({"reqId": req_id, "isStream": False, "isLastResp": True,
                          "output": json.dumps({"text": " ".join(tokens)})})
            return
        for k in range(1, len(tokens)):
            self.publish({"reqId": req_id, "isStream": True, "isLastResp": False, "seq": k,
                          "output": f"data: {tokens[k]}\n\n"})
            if c.die_after == k and not c.died:
                c.died = True
                await asyncio.sleep(0.05)  # the envelopes so far reach the coordinator
                await self.stop()
                return
            await asyncio.sleep(c.unit_delay)
        self.publish({"reqId": req_id, "isStream": True, "isLastResp": True, "seq": len(tokens),
                      "output": "data: [DONE]\n\n"})

    async def dresult(self, request: web.Request) -> web.StreamResponse:
        if self.role != "decode":
            return web.json_response({"error": f"Only the Decode node supports dresult but you send to {self.role}."},
                                     status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.channels.add(queue)
        try:
            while True:
                line = await queue.get()
                if line is None:
                    break
                await resp.write(line.encode())
        finally:
            self.channels.discard(queue)
        return resp

    def refresh_entry(self) -> dict[str, Any]:
        code = {"prefill": 80, "decode": 68}.get(self.role, 85)
        return {"id": self.id, "ip": HOST, "port": self.port, "metric_port": self.port, "model_name": "fake",
                "static_info": {"group_id": 0, "max_seq_len": 1024, "max_output_len": 512, "total_slots_num": 8,
                                "total_block_num": 100, "block_size": 16, "role": code,
                                "inter_comm_port": self.inter_comm_port},
                "dynamic_info": {"avail_slots_num": 8, "avail_block_num": 100}}


class _Quiet(uvicorn.Server):
    def capture_signals(self) -> Any:  # type: ignore[override]
        return contextlib.nullcontext()


class RunningCoordinator:
    """A real coordinator (pd_separate) served in the test's event loop."""

    def __init__(self, **exception_config: int) -> None:
        cfg = default_coordinator_dict()
        self.predict, self.manage = free_port(), free_port()
        cfg["http_config"].update(predict_port=str(self.predict), manage_port=str(self.manage))
        cfg["digs_scheduler_config"].update(deploy_mode="pd_separate", scheduler_type="digs_scheduler",
                                            algorithm_type="load_balance")
        cfg["exception_config"].update({"max_retry": 2, "first_token_timeout": 10, "infer_timeout": 15,
                                        **exception_config})
        self.config = coordinator_config_from_dict(cfg, environ={})
        self.coordinator = Coordinator(self.config)
        self.servers = [
            _Quiet(uvicorn.Config(self.coordinator.user_app(), host=HOST, port=self.predict, log_level="warning")),
            _Quiet(uvicorn.Config(self.coordinator.manage_app(), host=HOST, port=self.manage, log_level="warning")),
        ]
        self.tasks: list[asyncio.Task[Any]] = []
        self.url = f"http://{HOST}:{self.predict}"
        self.manage_url = f"http://{HOST}:{self.manage}"

    async def __aenter__(self) -> RunningCoordinator:
        self.tasks = [asyncio.create_task(s.serve()) for s in self.servers]
        for srv in self.servers:
            while not srv.started:
                await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for srv in self.servers:
            srv.should_exit = True
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.coordinator.close()

    async def refresh(self, servers: list[FakeServer]) -> None:
        body = {"ids": [s.id for s in servers], "instances": [s.refresh_entry() for s in servers]}
        async with httpx.AsyncClient() as c:
            assert (await c.post(self.manage_url + "/v1/instances/refresh", json=body)).status_code == 200

    async def wait_ready(self, ready: bool = True) -> None:
        async with httpx.AsyncClient() as c:
            for _ in range(200):
                if ((await c.get(self.manage_url + "/v1/readiness")).status_code == 200) == ready:
                    return
                await asyncio.sleep(0.025)
        raise AssertionError(f"readiness never became {ready}")


@contextlib.asynccontextmanager
async def pd_setup(n_decode: int = 1, **exception_config: int) -> AsyncIterator[tuple[FakeCluster, list[FakeServer],
                                                                                       RunningCoordinator]]:
    """One P and ``n_decode`` Ds (roles already set), and a coordinator that knows them."""
    cluster = FakeCluster()
    servers = [await FakeServer(cluster, role="prefill").start()]
    for _ in range(n_decode):
        servers.append(await FakeServer(cluster, role="decode").start())
    try:
        async with RunningCoordinator(**exception_config) as coord:
            await coord.refresh(servers)
            await coord.wait_ready()
            yield cluster, servers, coord
    finally:
        for srv in servers:
            await srv.stop()


async def stream_text(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    async with client.stream("POST", url, json=body) as r:
        text = (await r.aread()).decode()
        return r.status_code, r.headers.get("content-type", ""), text


def events(n: int) -> str:
    return "".join(f"data: t{k}\n\n" for k in range(n)) + "data: [DONE]\n\n"


# -- the join ----------------------------------------------------------------------------------------------------
async def test_stream_and_non_stream_join():
    async with pd_setup() as (cluster, (p, d), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        r = await c.post(coord.url + "/v1/completions", json={"n": 4})
        assert r.status_code == 200 and r.json() == {"text": "t0 t1 t2 t3"}
        assert r.headers["content-type"].startswith("application/json")
        headers = p.seen[-1]
        assert headers["req-type"] == "prefill" and headers["req-id"].isdigit()
        assert headers["d-target"] == f"{HOST}:{d.inter_comm_port}" and "is-recompute" not in headers
        status, ctype, text = await asyncio.wait_for(stream_text(c, coord.url + "/v1/completions",
                                                                 {"n": 5, "stream": True}), TIMEOUT)
        assert status == 200 and ctype.startswith("text/event-stream") and text == events(5)
        assert p.seen[-1]["req-id"] != headers["req-id"]  # a fresh req-id per request

        # in flight: counted on both its P and its D
        cluster.unit_delay = 0.2
        async with c.stream("POST", coord.url + "/v1/completions", json={"n": 4, "stream": True}) as r:
            chunks = r.aiter_bytes()
            first = await chunks.__anext__()
            assert first.startswith(b"data: t0")
            tasks = (await c.get(coord.manage_url + "/v1/instances/tasks", params=[("id", p.id), ("id", d.id)])).json()
            assert tasks == {"tasks": [1, 1]}
            rest = b"".join([chunk async for chunk in chunks])
        assert (first + rest).decode() == events(4)
        tasks = (await c.get(coord.manage_url + "/v1/instances/tasks", params=[("id", p.id), ("id", d.id)])).json()
        assert tasks == {"tasks": [0, 0]}


async def test_in_flight_requests_finish_when_the_group_is_withdrawn():
    async with pd_setup() as (cluster, (p, d), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        cluster.unit_delay = 0.1
        async with c.stream("POST", coord.url + "/v1/completions", json={"n": 6, "stream": True}) as r:
            chunks = r.aiter_bytes()
            first = await chunks.__anext__()
            await coord.refresh([])  # the controller withdrew the group (e.g. the P failed)
            assert not coord.coordinator.hub.channels and len(coord.coordinator.hub.draining) == 1
            rest = b"".join([chunk async for chunk in chunks])
        assert (first + rest).decode() == events(6)
        assert not coord.coordinator.hub.draining
        r = await c.post(coord.url + "/v1/completions", json={"n": 2})
        assert r.status_code == 503


async def test_p_finishes_alone_and_p_refusal_passes_through():
    async with pd_setup() as (cluster, (p, d), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        r = await c.post(coord.url + "/generate", json={"n": 1})
        assert r.status_code == 200 and r.json() == {"text": "t0"}
        status, ctype, text = await stream_text(c, coord.url + "/v1/chat/completions", {"n": 1, "stream": True})
        assert status == 200 and ctype.startswith("text/event-stream") and text == events(1)
        cluster.p_refuse = (422, {"error": {"message": "max_tokens must be positive", "type": "invalid_request"}})
        r = await c.post(coord.url + "/v1/chat/completions", json={"n": 3})
        assert r.status_code == 422 and r.json() == {"error": {"message": "max_tokens must be positive",
                                                               "type": "invalid_request"}}
        assert r.headers["content-type"].startswith("application/json")


async def test_d_dies_mid_stream_recompute_on_the_other_d():
    async with pd_setup(n_decode=2) as (cluster, (p, d1, d2), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        cluster.die_after = 2  # the first D used publishes t1, t2, then dies
        status, _, text = await asyncio.wait_for(stream_text(c, coord.url + "/v1/completions",
                                                             {"n": 6, "stream": True}), TIMEOUT)
        assert status == 200 and cluster.died
        assert text == events(6)  # every unit once, in order
        first, second = p.seen[-2], p.seen[-1]
        assert first["req-id"] == second["req-id"] and second["is-recompute"] == "true"
        assert first["d-target"] != second["d-target"]
        # the dead D left rotation: the next requests go to the other one
        r = await c.post(coord.url + "/v1/completions", json={"n": 3})
        assert r.status_code == 200 and r.json() == {"text": "t0 t1 t2"}
        assert coord.coordinator.pd is not None and coord.coordinator.pd.recomputes == 1


async def test_d_dies_before_a_non_stream_answer():
    async with pd_setup(n_decode=2) as (cluster, (p, d1, d2), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        cluster.die_after = 0
        r = await asyncio.wait_for(c.post(coord.url + "/infer", json={"n": 4}), TIMEOUT)
        assert r.status_code == 200 and r.json() == {"text": "t0 t1 t2 t3"} and cluster.died
        assert p.seen[-1]["is-recompute"] == "true" and p.seen[-1]["req-id"] == p.seen[-2]["req-id"]


async def test_d_error_envelopes():
    async with pd_setup(n_decode=2) as (cluster, (p, d1, d2), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        # recompute false, status < 500: passed through
        cluster.d_error = {"status": 400, "message": "bad stop sequence", "recompute": False}
        r = await c.post(coord.url + "/v1/completions", json={"n": 3})
        assert r.status_code == 400 and r.json() == {"error": "bad stop sequence"}
        cluster.d_error = {"status": 400, "message": "bad stop sequence", "recompute": False}
        status, _, text = await stream_text(c, coord.url + "/v1/completions", {"n": 3, "stream": True})
        assert status == 200 and text == "data: t0\n\n" + json.dumps({"error": "bad stop sequence"})
        # recompute true: run again (another D), the client gets the whole answer
        cluster.d_error = {"status": 502, "message": "KV pull failed", "recompute": True}
        r = await c.post(coord.url + "/v1/completions", json={"n": 3})
        assert r.status_code == 200 and r.json() == {"text": "t0 t1 t2"}
        assert p.seen[-1]["is-recompute"] == "true" and p.seen[-1]["req-id"] == p.seen[-2]["req-id"]


async def test_no_d_is_a_clear_503():
    cluster = FakeCluster()
    p = await FakeServer(cluster, role="prefill").start()
    try:
        async with RunningCoordinator() as coord, httpx.AsyncClient(timeout=TIMEOUT) as c:
            await coord.refresh([p])
            assert (await c.get(coord.manage_url + "/v1/readiness")).status_code == 503
            r = await c.post(coord.url + "/v1/completions", json={"n": 3})
            assert r.status_code == 503
            assert "no decode (D) instance is available" in r.json()["error"]["message"]
            r = await c.post(coord.url + "/generate", json={"n": 3})
            assert r.status_code == 503 and "no decode (D) instance is available" in r.json()["error"]
            await coord.refresh([])
            r = await c.post(coord.url + "/v1/completions", json={"n": 3})
            assert r.status_code == 503 and "no prefill (P) instance is available" in r.json()["error"]["message"]
    finally:
        await p.stop()


async def test_d_dies_and_no_other_d_ends_with_an_error():
    async with pd_setup(n_decode=1) as (cluster, (p, d), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        cluster.die_after = 1
        status, _, text = await asyncio.wait_for(stream_text(c, coord.url + "/v1/completions",
                                                             {"n": 4, "stream": True}), TIMEOUT)
        assert status == 200 and text.startswith("data: t0\n\ndata: t1\n\ndata: {")
        assert "no decode (D) instance is available" in text and text.count("t1") == 1
        await coord.wait_ready(False)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_silent_d_never_hangs(stream: bool):
    async with pd_setup(infer_timeout=1) as (cluster, _, coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        cluster.d_silent = True
        if stream:
            status, _, text = await asyncio.wait_for(stream_text(c, coord.url + "/v1/completions",
                                                                 {"n": 3, "stream": True}), 10)
            assert status == 200 and text.startswith("data: t0\n\n") and "Request inference timeout" in text
        else:
            r = await asyncio.wait_for(c.post(coord.url + "/v1/completions", json={"n": 3}), 10)
            assert r.status_code == 504 and r.json()["error"]["message"] == "Request inference timeout"
        for inst in coord.coordinator.table.items.values():
            assert inst.active == 0
        assert coord.coordinator.scheduler.in_coordinator == 0


async def test_other_paths_go_to_any_instance():
    async with pd_setup() as (cluster, (p, d), coord), httpx.AsyncClient(timeout=TIMEOUT) as c:
        # GET is not an inference request: forwarded single-node style (the fakes have no GET route: 405)
        r = await c.get(coord.url + "/v1/models")
        assert r.status_code == 405
        assert not p.seen
