"""Multi-node inference on one machine: two "nodes" (127.0.0.1 and 127.0.0.2) form a world of 2.

Both run ``mindie-host serve`` with the same config (multiNodesInferEnabled, worldSize 1 each) and
the same rank table; ``MIES_CONTAINER_IP`` tells each which node it is. The master serves the API
and rank 0; the other node runs rank 1 and answers only health probes. Greedy output equals a
single rank's. Rank tables that do not match are refused, naming what is wrong.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from mindie_host.distributed.rank_table import RankTableError, plan_from_table
from mindie_host.testing import RunningServer, free_port, make_tiny_llama, server_config, wait_for


def _table(*nodes: tuple[str, list[int]]) -> dict[str, Any]:
    servers, rank = [], 0
    for ip, devices in nodes:
        entries = []
        for d in devices:
            entries.append({"device_id": str(d), "device_ip": f"192.168.0.{rank + 1}", "rank_id": str(rank)})
            rank += 1
        servers.append({"server_id": ip, "container_ip": ip, "device": entries})
    return {"version": "1.0", "status": "completed", "server_count": str(len(servers)), "server_list": servers}


def test_rank_table_gives_each_node_its_ranks() -> None:
    table = _table(("10.0.0.1", [0, 1]), ("10.0.0.2", [0, 1]))
    master = plan_from_table(table, "10.0.0.1", 1120)
    other = plan_from_table(table, "10.0.0.2", 1120)
    assert (master.world_size, master.local, master.address, master.is_master) == (4, {0: 0, 1: 1},
                                                                                   "10.0.0.1:1120", True)
    assert (other.local, other.is_master, other.address) == ({2: 0, 3: 1}, False, "10.0.0.1:1120")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update(server_count="3"), "server_count is '3' but server_list lists 2 node(s); allowed: 2"),
        (lambda t: t["server_list"][1]["device"][0].update(rank_id="0"), "rank_id 0 appears twice"),
        (lambda t: t["server_list"][1]["device"][0].update(rank_id="5"), "rank_id values must be 0..1"),
        (lambda t: t["server_list"][1].update(device=[]), "server_list[1] needs server_id"),
    ],
)
def test_rank_tables_that_do_not_match_are_refused(change: Any, message: str) -> None:
    table = _table(("10.0.0.1", [0]), ("10.0.0.2", [0]))
    change(table)
    with pytest.raises(RankTableError) as info:
        plan_from_table(table, "10.0.0.1", 1120)
    assert message in str(info.value)
    with pytest.raises(RankTableError, match=r"MIES_CONTAINER_IP '10.0.0.9' is not a node .* allowed: 10.0.0.1"):
        plan_from_table(_table(("10.0.0.1", [0]), ("10.0.0.2", [0])), "10.0.0.9", 1120)


@pytest.mark.slow  # three tiny-model loads, two of them in spawned server processes
def test_two_nodes_form_a_world_of_two(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", num_heads=4, num_kv_heads=2)
    prompts = ["the first node", "and the second one, with a longer prompt than the first"]
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with RunningServer(server_config(model, model={"dtype": "float32", "quantization": "none"})) as one:
        reference = [httpx.post(f"{one.url}/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                     for p in prompts]

    cfg = server_config(model, model={"dtype": "float32", "quantization": "none"},
                        server={"engineProcess": True, "engineRestartBackoffSeconds": 0.1})
    cfg["BackendConfig"].update({"multiNodesInferEnabled": True, "interNodeTLSEnabled": False,
                                 "multiNodesInferPort": free_port()})
    for key in ("ipAddress", "managementIpAddress"):
        cfg["ServerConfig"].pop(key)  # each node binds its own MIES_CONTAINER_IP
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "ranktable.json").write_text(json.dumps(_table(("127.0.0.1", [0]), ("127.0.0.2", [0]))))
    procs = []
    try:
        for ip in ("127.0.0.1", "127.0.0.2"):
            env = dict(os.environ, RANKTABLEFILE=str(tmp_path / "ranktable.json"), MIES_CONTAINER_IP=ip,
                       MIES_CONTAINER_MANAGEMENT_IP=ip)
            log = open(tmp_path / f"{ip}.log", "wb")  # noqa: SIM115 - lives as long as the process
            procs.append(subprocess.Popen([sys.executable, "-m", "mindie_host.cli", "serve", "--config",
                                           str(tmp_path / "config.json")], env=env, stdout=log, stderr=log))
        srv, mport = cfg["ServerConfig"], cfg["ServerConfig"]["managementPort"]

        def ready(ip: str) -> bool:
            for p in procs:
                assert p.poll() is None, p.args
            try:
                return httpx.get(f"http://{ip}:{mport}/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(lambda: ready("127.0.0.1") and ready("127.0.0.2"), 120, "both nodes ready")
        node = httpx.get(f"http://127.0.0.2:{mport}/v1/node").json()
        assert node == {"role": "rank node", "node": "127.0.0.2", "master": "127.0.0.1", "ranks": [1],
                        "world_size": 2, "ready": True, "restarts": 0}
        with pytest.raises(httpx.HTTPError):  # the other node serves no API
            httpx.post(f"http://127.0.0.2:{srv['port']}/v1/completions", json=body, timeout=2)
        got = [httpx.post(f"http://127.0.0.1:{srv['port']}/v1/completions", json={**body, "prompt": p},
                          timeout=60).json() for p in prompts]
        assert [g["choices"][0]["text"] for g in got] == [r["choices"][0]["text"] for r in reference]
        log_text = (tmp_path / "127.0.0.1.log").read_text()
        assert "tensor parallel: 2 ranks (gloo)" in log_text

        # rank 1 dies on the other node: the master's heartbeat finds it, its engine restarts, and the
        # other node starts rank 1 again, which joins the master's new world
        rank1 = [int(line.split()[-1].rstrip(")")) for line in (tmp_path / "127.0.0.2.log").read_text().splitlines()
                 if "rank 1 of 2 loaded" in line]
        os.kill(rank1[0], signal.SIGKILL)
        wait_for(lambda: not ready("127.0.0.1"), 20, "the master to notice")
        wait_for(lambda: ready("127.0.0.1") and ready("127.0.0.2"), 120, "both nodes ready again")
        assert httpx.get(f"http://127.0.0.2:{mport}/v1/node").json()["restarts"] == 1
        again = httpx.post(f"http://127.0.0.1:{srv['port']}/v1/completions", json={**body, "prompt": prompts[1]},
                           timeout=60).json()
        assert again["choices"][0]["text"] == reference[1]["choices"][0]["text"]
        assert "one of its tensor-parallel ranks died" in (tmp_path / "127.0.0.1.log").read_text()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
