"""Multi-node inference: the rank table (``RANKTABLEFILE``) and this node's place in it.

With ``BackendConfig.multiNodesInferEnabled``, every node starts ``mindie-host serve`` with the
same config; the rank table (the HCCL format MindCluster writes) lists the nodes and their
devices, and ``MIES_CONTAINER_IP`` says which node this is::

    {"version": "1.0", "status": "completed", "server_count": "2",
     "server_list": [
       {"server_id": "10.0.0.1", "container_ip": "10.0.0.1",
        "device": [{"device_id": "0", "device_ip": "192.168.1.1", "rank_id": "0"}, ...]},
       {"server_id": "10.0.0.2", ...}]}

The world is every device of every node (``worldSize`` and ``npuDeviceIds`` are then taken from
here, as in MindIE). The **master** is the node of rank 0: it runs the HTTP front end and rank 0,
and hosts the rendezvous on ``<master ip>:multiNodesInferPort``. The other nodes run their ranks
and answer only health probes (:mod:`mindie_host.runtime.rank_node`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RankTableError(ValueError):
    """The rank table is missing, malformed, or does not match this node or the config."""


@dataclass(frozen=True)
class NodePlan:
    """The world as the rank table describes it, seen from this node."""

    world_size: int
    #: ``ip:port`` of the rendezvous (rank 0's node, ``multiNodesInferPort``)
    address: str
    #: this node's ranks and their device ids, by rank
    local: dict[int, int]
    node_ip: str
    master_ip: str
    nodes: int

    @property
    def is_master(self) -> bool:
        return 0 in self.local


def _node_ip(server: Mapping[str, Any]) -> str:
    return str(server.get("container_ip") or server.get("server_id") or "")


def load_plan(port: int, environ: Mapping[str, str] | None = None) -> NodePlan:
    """Read ``RANKTABLEFILE`` and find this node (``MIES_CONTAINER_IP``) in it."""
    env = os.environ if environ is None else environ
    path = env.get("RANKTABLEFILE", "")
    if not path:
        raise RankTableError("BackendConfig.multiNodesInferEnabled is true but the environment variable RANKTABLEFILE "
                             "is not set; allowed: the absolute path of the rank table JSON")
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RankTableError(f"RANKTABLEFILE {path!r} cannot be read as JSON ({exc})") from None
    me = env.get("MIES_CONTAINER_IP", "")
    if not me:
        raise RankTableError("BackendConfig.multiNodesInferEnabled is true but MIES_CONTAINER_IP is not set; "
                             "allowed: this node's IP as the rank table lists it")
    return plan_from_table(table, me, port, path)


def plan_from_table(table: Any, me: str, port: int, path: str = "RANKTABLEFILE") -> NodePlan:
    """The :class:`NodePlan` of node ``me`` in rank table ``table``."""
    servers = table.get("server_list") if isinstance(table, dict) else None
    if not isinstance(servers, list) or not servers:
        raise RankTableError(f"{path}: server_list must be a non-empty list of nodes")
    if str(table.get("server_count", len(servers))) != str(len(servers)):
        raise RankTableError(f"{path}: server_count is {table.get('server_count')!r} but server_list lists "
                             f"{len(servers)} node(s); allowed: {len(servers)}")
    ranks: dict[int, tuple[str, int]] = {}
    for i, server in enumerate(servers):
        ip = _node_ip(server) if isinstance(server, dict) else ""
        devices = server.get("device") if isinstance(server, dict) else None
        if not ip or not isinstance(devices, list) or not devices:
            raise RankTableError(f"{path}: server_list[{i}] needs server_id (or container_ip) and a non-empty device "
                                 "list")
        for j, device in enumerate(devices):
            try:
                rank, dev = int(device["rank_id"]), int(device["device_id"])
            except (KeyError, TypeError, ValueError):
                raise RankTableError(f"{path}: server_list[{i}].device[{j}] needs integer rank_id and device_id "
                                     "(as strings or numbers)") from None
            if rank in ranks:
                raise RankTableError(f"{path}: rank_id {rank} appears twice (server_list[{i}].device[{j}])")
            ranks[rank] = (ip, dev)
    world = len(ranks)
    if sorted(ranks) != list(range(world)):
        raise RankTableError(f"{path}: rank_id values must be 0..{world - 1}, each once; got {sorted(ranks)}")
    ips = [_node_ip(s) for s in servers]
    if me not in ips:
        raise RankTableError(f"MIES_CONTAINER_IP {me!r} is not a node of {path}; allowed: {', '.join(ips)}")
    master = ranks[0][0]
    return NodePlan(
        world_size=world, address=f"{master}:{port}", local={r: d for r, (ip, d) in ranks.items() if ip == me},
        node_ip=me, master_ip=master, nodes=len(servers),
    )
