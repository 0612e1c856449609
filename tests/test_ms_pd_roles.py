"""MindIE MS pd_separate, controller side: the role decision, the config pairings, and the controller against
fake dmi servers (test_ms_pd_coordinator.FakeServer) with a real coordinator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_ms_pd_coordinator import HOST, FakeCluster, FakeServer, RunningCoordinator

from mindie_host.config import ConfigError
from mindie_host.ms.controller.config import ControllerConfig, controller_config_from_dict, default_controller_dict
from mindie_host.ms.controller.poller import Controller
from mindie_host.ms.controller.roles import decide_roles, prefill_target
from mindie_host.ms.coordinator.config import coordinator_config_from_dict, default_coordinator_dict
from mindie_host.ms.coordinator.instances import RefreshError, parse_refresh

P, D = "prefill", "decode"


# -- the decision -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "p_rate", "d_rate", "expected"), [
    (2, 1, 1, 1), (4, 1, 1, 2), (3, 1, 1, 2), (5, 2, 3, 2), (4, 1, 3, 1), (8, 1, 3, 2), (2, 1, 5, 1), (6, 1, 5, 1),
    (12, 1, 5, 2), (16, 15, 1, 15), (2, 15, 1, 1), (1, 1, 1, 1), (1, 1, 3, 0), (0, 1, 1, 0),
])
def test_prefill_target_from_the_rates(n, p_rate, d_rate, expected):
    assert prefill_target(n, p_rate, d_rate, 3000, 200) == expected


@pytest.mark.parametrize(("n", "inp", "out", "expected"), [
    (2, 3000, 200, 1), (4, 3000, 200, 3), (10, 3000, 200, 9), (4, 100, 300, 1), (8, 100, 300, 2),
    (8, 1000, 1000, 4), (3, 1, 1000, 1), (1, 3000, 200, 1), (1, 200, 3000, 0),
])
def test_prefill_target_automatic(n, inp, out, expected):
    assert prefill_target(n, 0, 0, inp, out) == expected


def test_decide_roles_fills_and_keeps():
    assert decide_roles([7, 3], {}, p_rate=1, d_rate=1) == {3: P, 7: D}  # ascending ids, ties go to P
    # each new server joins the side further below its target: 1 P : 3 D interleaves
    assert decide_roles([1, 2, 3, 4], {}, p_rate=1, d_rate=3) == {1: D, 2: D, 3: P, 4: D}
    # stable: kept roles are never switched, even against the target
    assert decide_roles([1, 2], {1: D, 2: P}, p_rate=1, d_rate=1) == {1: D, 2: P}
    assert decide_roles([1, 2], {1: P, 2: P}, p_rate=1, d_rate=1) == {1: P, 2: P}
    # new servers fill the side below its target
    assert decide_roles([1, 2, 3], {1: P, 2: P}, p_rate=1, d_rate=1) == {1: P, 2: P, 3: D}
    assert decide_roles([1, 2, 3, 4], {4: D}, p_rate=1, d_rate=3) == {1: D, 2: P, 3: D, 4: D}
    assert decide_roles([1, 2, 3, 4], {4: D, 3: D, 2: D}, p_rate=1, d_rate=3) == {1: P, 2: D, 3: D, 4: D}
    # servers join one at a time and end where a batch decision would
    current: dict[int, str] = {}
    for n in range(1, 9):
        current = decide_roles(list(range(1, n + 1)), current, input_length=3000, output_length=1000)
        assert sum(r == P for r in current.values()) == prefill_target(n, 0, 0, 3000, 1000)
    # unknown roles in ``current`` count as none; ids not in ``servers`` are ignored
    assert decide_roles([5, 6], {5: "none", 9: P}, p_rate=2, d_rate=1) == {5: P, 6: D}


# -- config -------------------------------------------------------------------------------------------------------
def test_controller_accepts_pd_separate_and_the_rates():
    data = default_controller_dict()
    data.update(deploy_mode="pd_separate", default_p_rate=2, default_d_rate=3, check_role_attempt_times=4)
    cfg = controller_config_from_dict(data, environ={})
    assert (cfg.deploy_mode, cfg.p_rate, cfg.d_rate, cfg.check_role_attempt_times) == ("pd_separate", 2, 3, 4)
    assert (cfg.digs_input_length, cfg.digs_output_length) == (3000, 200)
    cfg = controller_config_from_dict(data, environ={"MINDIE_MS_P_RATE": "1", "MINDIE_MS_D_RATE": "5"})
    assert (cfg.p_rate, cfg.d_rate) == (1, 5)
    with pytest.raises(ConfigError, match="both 0"):
        controller_config_from_dict(data, environ={"MINDIE_MS_P_RATE": "0"})


def test_coordinator_pd_separate_pairing():
    def digs(**kw: str) -> dict[str, Any]:
        data = default_coordinator_dict()
        data["digs_scheduler_config"].update(kw)
        return data

    cfg = coordinator_config_from_dict(digs(deploy_mode="pd_separate", scheduler_type="digs_scheduler",
                                            algorithm_type="load_balance"), environ={})
    assert (cfg.deploy_mode, cfg.scheduler_type, cfg.algorithm_type) == ("pd_separate", "digs_scheduler",
                                                                         "load_balance")
    for kw, key, allowed in (
        ({"scheduler_type": "default_scheduler", "algorithm_type": "load_balance"}, "scheduler_type",
         "'digs_scheduler'"),
        ({"scheduler_type": "digs_scheduler", "algorithm_type": "cache_affinity"}, "algorithm_type",
         "'load_balance'"),
        ({"scheduler_type": "digs_scheduler", "algorithm_type": "round_robin"}, "algorithm_type", "'load_balance'"),
    ):
        with pytest.raises(ConfigError) as info:
            coordinator_config_from_dict(digs(deploy_mode="pd_separate", **kw), environ={})
        assert info.value.key == f"digs_scheduler_config.{key}" and allowed in str(info.value)
    with pytest.raises(ConfigError) as info:  # single_node is as before
        coordinator_config_from_dict(digs(scheduler_type="digs_scheduler"), environ={})
    assert "'default_scheduler'" in str(info.value)


def test_refresh_keeps_role_and_inter_comm_port():
    entry = {"id": 5, "ip": HOST, "port": 2000, "static_info": {
        "group_id": 0, "max_seq_len": 100, "max_output_len": 50, "total_slots_num": 8, "total_block_num": 10,
        "block_size": 16, "role": 68, "inter_comm_port": 3000}}
    ids, described = parse_refresh({"ids": [5], "instances": [entry]})
    assert described[5]["static"]["inter_comm_port"] == 3000 and described[5]["static"]["role"] == 68
    entry["static_info"]["inter_comm_port"] = 80
    with pytest.raises(RefreshError, match="inter_comm_port"):
        parse_refresh({"ids": [5], "instances": [entry]})


# -- the controller against fake servers --------------------------------------------------------------------------
def controller_config(tmp: Path, **over: Any) -> ControllerConfig:
    data = default_controller_dict()
    data.update(deploy_mode="pd_separate", global_rank_table_file_path=str(tmp / "ranktable.json"),
                check_role_attempt_times=2, check_role_wait_seconds=1, init_role_attempt_times=2, http_retries=0,
                http_timeout_seconds=5, server_online_wait_seconds=1, server_online_attempt_times=3,
                disappeared_server_waiting_seconds=0)
    data["process_manager"] = {"to_file": True, "file_path": str(tmp / "process.json")}
    data["cluster_status"] = {"to_file": True, "file_path": str(tmp / "cluster.json")}
    data.update(over)
    return controller_config_from_dict(data, environ={})


def write_rank_table(tmp: Path, coord: RunningCoordinator, servers: list[FakeServer],
                     devices: dict[int, list[dict[str, str]]] | None = None) -> None:
    entries = []
    for n, s in enumerate(servers):
        entry: dict[str, Any] = {"ip": HOST, "port": s.port, "management_port": s.mgmt_port, "metric_port": s.port}
        if devices and n in devices:
            entry["device"] = devices[n]
        entries.append(entry)
    (tmp / "ranktable.json").write_text(json.dumps({"coordinator": {"ip": HOST, "port": coord.manage},
                                                    "servers": entries}))


async def cycle_until(controller: Controller, done: Callable[[], bool], timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        await controller.cycle()
        if done():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the condition was not reached in time")


@contextlib.asynccontextmanager
async def pd_cluster(tmp: Path, count: int, *, devices: dict[int, list[dict[str, str]]] | None = None,
                     controller: dict[str, Any] | None = None,
                     **kinds: Any) -> AsyncIterator[tuple[list[FakeServer], RunningCoordinator, Controller]]:
    """``count`` fake servers without roles, a real coordinator and a controller (cycled by the test)."""
    cluster = FakeCluster()
    servers = [await FakeServer(cluster, **kinds.get(f"s{n}", {})).start() for n in range(count)]
    ctl: Controller | None = None
    try:
        async with RunningCoordinator() as coord:
            write_rank_table(tmp, coord, servers, devices)
            ctl = Controller(controller_config(tmp, **(controller or {})))
            yield servers, coord, ctl
    finally:
        if ctl is not None:
            await ctl.close()
        for s in servers:
            await s.stop()


def one_device() -> list[dict[str, str]]:
    return [{"device_logical_id": "0", "device_ip": HOST}]


async def readiness(coord: RunningCoordinator) -> int:
    async with httpx.AsyncClient() as c:
        return (await c.get(coord.manage_url + "/v1/readiness")).status_code


async def test_two_servers_become_1p_1d(tmp_path):
    async with pd_cluster(tmp_path, 2) as (servers, coord, ctl):
        await cycle_until(ctl, lambda: coord.coordinator.ready)
        by_role = {s.role: s for s in servers}
        p, d = by_role[P], by_role[D]
        assert p.id < d.id  # ties go to P, in id order
        assert p.pushes == [(P, {"local": {"server_ip": HOST, "device": one_device()},
                                 "peers": [{"server_ip": HOST, "device": one_device()}]})]
        assert [role for role, _ in d.pushes] == [D] and len(d.pushes[0][1]["peers"]) == 1
        table = coord.coordinator.table.items
        assert table[p.id].role == 80 and table[d.id].role == 68
        assert table[d.id].inter_comm_port == d.inter_comm_port
        assert table[d.id].dynamic["peers"] == [p.id]
        # the whole path: coordinator -> P -> D -> /dresult -> coordinator
        async with httpx.AsyncClient(timeout=20) as c:
            r = await c.post(coord.url + "/v1/completions", json={"n": 3})
        assert r.status_code == 200 and r.json() == {"text": "t0 t1 t2"}
        ctl.write_files()
        status = json.loads((tmp_path / "cluster.json").read_text())
        roles = {s["port"]: s["static_info"]["role"] for s in status["server"]}
        assert roles == {p.port: 80, d.port: 68}
        assert {s["port"]: s["peers"] for s in status["server"]} == {p.port: [HOST], d.port: [HOST]}
        process = json.loads((tmp_path / "process.json").read_text())
        assert all(s["is_initialized"] for s in process["server"])
        assert {s["port"]: s["peers"] for s in process["server"]} == {p.port: [d.id], d.port: [p.id]}


async def test_peers_are_pushed_again_when_a_side_changes(tmp_path):
    cluster = FakeCluster()
    extra = await FakeServer(cluster).start()
    try:
        async with pd_cluster(tmp_path, 2) as (servers, coord, ctl):
            await cycle_until(ctl, lambda: coord.coordinator.ready)
            p, d = sorted(servers, key=lambda s: s.role != P)
            write_rank_table(tmp_path, coord, [*servers, extra])
            ctl.last_rank_table = 0  # re-read the rank table now
            # 3 servers, 3000 in / 200 out: 2 P, 1 D; the new one is a P and the D learns both
            await cycle_until(ctl, lambda: len(coord.coordinator.table.items) == 3)
            assert extra.role == P and [ps["server_ip"] for ps in extra.pushes[-1][1]["peers"]] == [HOST]
            assert len(d.pushes) == 2 and len(d.pushes[-1][1]["peers"]) == 2
            assert coord.coordinator.table.items[d.id].dynamic["peers"] == sorted([p.id, extra.id])
            assert len(p.pushes) == 1  # its D set did not change
            write_rank_table(tmp_path, coord, servers)  # the new P leaves
            ctl.last_rank_table = 0
            await cycle_until(ctl, lambda: len(coord.coordinator.table.items) == 2)
            assert len(d.pushes) == 3 and len(d.pushes[-1][1]["peers"]) == 1
    finally:
        await extra.stop()


async def test_rates_and_a_restarted_server(tmp_path):
    async with pd_cluster(tmp_path, 3, controller={"default_p_rate": 1, "default_d_rate": 2}) as (servers, coord, ctl):
        await cycle_until(ctl, lambda: coord.coordinator.ready and len(coord.coordinator.table.items) == 3)
        assert sorted(s.role for s in servers) == [D, D, P]
        p = next(s for s in servers if s.role == P)
        assert len(p.pushes[-1][1]["peers"]) == 2
        # the P restarts: RoleUnknown again; it is pushed its role again
        p.role, p.role_status = "none", "RoleUnknown"
        await cycle_until(ctl, lambda: len(p.pushes) == 2 and coord.coordinator.ready)
        assert p.role == P


async def test_one_server_group_unavailable(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mindie_host.ms.controller")
    async with pd_cluster(tmp_path, 1) as (servers, coord, ctl):
        await cycle_until(ctl, lambda: servers[0].role == P and ctl.nodes[servers[0].id].role_pushed)
        for _ in range(3):
            await ctl.cycle()
        assert coord.coordinator.table.refreshed and not coord.coordinator.table.items
        assert await readiness(coord) == 503
        lines = [r.getMessage() for r in caplog.records if "group 0 unavailable" in r.getMessage()]
        assert lines[-1] == "[NodeScheduler] group 0 unavailable: needs at least 1 P and 1 D (has 1 P, 0 D)"
        assert len(lines) == 2  # (0 P, 0 D) before the push, then (1 P, 0 D): once per change
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(coord.url + "/v1/completions", json={"n": 2})
        assert r.status_code == 503 and "no prefill (P) instance is available" in r.json()["error"]["message"]


async def test_role_push_failures_mark_faulty_then_recover(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mindie_host.ms.controller")
    kinds = {"s1": {"refuse_role": True}}
    async with pd_cluster(tmp_path, 2, **kinds) as (servers, coord, ctl):
        good, bad = servers
        await cycle_until(ctl, lambda: ctl.nodes[bad.id].is_faulty)
        assert len(bad.pushes) == 2  # init_role_attempt_times
        assert any("[NodeScheduler]SendRole" in r.getMessage() for r in caplog.records)
        assert ctl.nodes[bad.id].role == "" and not coord.coordinator.ready
        ctl.write_files()
        status = {s["port"]: s for s in json.loads((tmp_path / "cluster.json").read_text())["server"]}
        assert status[bad.port]["is_faulty"] and not status[good.port]["is_faulty"]
        bad.refuse_role = False  # taken back after the check window, given its role again
        await cycle_until(ctl, lambda: coord.coordinator.ready)
        assert {good.role, bad.role} == {P, D}


async def test_never_ready_is_faulty_after_the_check_window(tmp_path):
    async with pd_cluster(tmp_path, 2, s0={"never_ready": True}) as (servers, coord, ctl):
        slow = servers[0]
        loop = asyncio.get_running_loop()
        started = loop.time()
        await cycle_until(ctl, lambda: ctl.nodes[slow.id].is_faulty)
        assert loop.time() - started >= 1.0  # two checks one second apart
        assert slow.role_status == "RoleUnknown" and len(slow.pushes) == 2  # re-sent once while RoleUnknown
        assert not coord.coordinator.ready


async def test_device_lists_and_mismatch(tmp_path, caplog):
    two = [{"device_id": "0", "device_ip": "10.0.0.1"}, {"device_id": "1", "device_ip": "10.0.0.2"}]
    async with pd_cluster(tmp_path, 2, devices={0: two, 1: two[:1]}) as (servers, coord, ctl):
        for _ in range(3):
            await ctl.cycle()
        assert not servers[0].pushes and not servers[1].pushes
        assert any("P and D instances need the same device count" in r.getMessage() for r in caplog.records)
    async with pd_cluster(tmp_path, 2, devices={0: two, 1: two}) as (servers, coord, ctl):
        await cycle_until(ctl, lambda: coord.coordinator.ready)
        body = servers[0].pushes[0][1]
        assert body["local"]["device"] == [{"device_logical_id": "0", "device_ip": "10.0.0.1"},
                                           {"device_logical_id": "1", "device_ip": "10.0.0.2"}]
        assert body["peers"][0]["device"] == body["local"]["device"]


async def test_standard_mode_server_is_refused(tmp_path, caplog):
    async with pd_cluster(tmp_path, 2, s1={"infer_mode": "standard"}) as (servers, coord, ctl):
        await cycle_until(ctl, lambda: ctl.nodes[servers[1].id].is_faulty)
        assert not servers[1].pushes
        assert any("inferMode 'standard'" in r.getMessage() for r in caplog.records)


async def test_heterogeneous_roles_follow_the_hardware(tmp_path, caplog):
    async with pd_cluster(tmp_path, 3, controller={"is_heterogeneous": True}) as (servers, coord, ctl):
        hardware = ["800I A2(64G)", "800I A2(32G)", "800I A2(16G)"]
        entries = [{"ip": HOST, "port": s.port, "management_port": s.mgmt_port, "metric_port": s.port,
                    "hardware_type": hw} for s, hw in zip(servers, hardware)]
        (tmp_path / "ranktable.json").write_text(json.dumps({"coordinator": {"ip": HOST, "port": coord.manage},
                                                             "servers": entries}))
        await cycle_until(ctl, lambda: coord.coordinator.ready and ctl.nodes[servers[2].id].is_faulty)
        assert (servers[0].role, servers[1].role) == (D, P)  # 64G decodes, 32G prefills, whatever the ids
        assert not servers[2].pushes
        assert any("hardware_type '800I A2(16G)'" in r.getMessage() for r in caplog.records)
