"""The controller's two files (spec §4.2), written every sync period and read back on restart.

* process-manager backup (``process_manager.file_path``): ``{"server": [{"delete_time", "id",
  "ip", "is_faulty", "is_initialized", "peers", "static_info": {"group_id", "label", "role",
  "total_block_num", "total_slots_num"}}]}``. ``is_initialized`` means "role pushed", always
  false in single_node. On restart the controller reloads it: servers keep their fault marks,
  removal times and static info.
* cluster status (``cluster_status.file_path``): ``{"coordinator": [{"ip", "is_healthy"}],
  "server": [{"delete_time", "dynamic_info": {"avail_block_num", "avail_slots_num"}, "ip",
  "is_faulty", "is_healthy", "model_name", "peers", "static_info": {"block_size", "group_id",
  "label", "max_output_len", "max_seq_len", "role", "total_block_num", "total_slots_num"}}]}``.

Both carry, as mindie-host extensions, each server's ``port``, ``management_port`` and
``metric_port`` (servers may share an IP) and, in the backup, the static fields needed to
skip re-initialisation (``model_name``, ``max_seq_len``, ``max_output_len``, ``block_size``,
and for pd_separate ``infer_mode`` and ``inter_comm_port``).
Files are replaced atomically (written beside, then renamed).

In pd_separate ``static_info.role`` is 80 (P), 68 (D) or 85 (no role yet), ``is_initialized``
is true once the role was pushed and confirmed, and ``peers`` lists the other side's servers the
role was pushed with (ids in the backup, IPs in the cluster status). On restart a server keeps its
role and pushed peers; it is live again as soon as its status says ``RoleReady`` with that role.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .nodes import ROLE_CODES, ROLE_UNKNOWN, Node
from .ranktable import ServerAddress

log = logging.getLogger("mindie_host.ms.controller")
ROLE_NAMES = {code: name for name, code in ROLE_CODES.items()}


def _ports(node: Node) -> dict[str, Any]:
    return {"port": node.addr.port, "management_port": node.addr.management_port,
            "metric_port": node.addr.metric_port}


def process_status(nodes: list[Node]) -> dict[str, Any]:
    """The process-manager backup document."""
    out = []
    for n in nodes:
        static = n.static_info()
        out.append({
            "delete_time": n.delete_time, "id": n.id, "ip": n.addr.ip, "is_faulty": n.is_faulty,
            "is_initialized": n.role_pushed, "peers": list(n.peers),
            "static_info": {key: static[key] for key in ("group_id", "label", "role", "total_block_num",
                                                         "total_slots_num")},
            **_ports(n), "model_name": n.model_name, "max_seq_len": n.max_seq_len,
            "max_output_len": n.max_output_len, "block_size": n.block_size, "config_collected": n.initialized,
            "infer_mode": n.infer_mode, "inter_comm_port": n.inter_comm_port,
        })
    return {"server": out}


def cluster_status(nodes: list[Node], coordinator: tuple[str, int] | None, coordinator_healthy: bool) -> dict[str, Any]:
    """The cluster-status document."""
    coord = [{"ip": coordinator[0], "is_healthy": coordinator_healthy}] if coordinator else []
    ips = {n.id: n.addr.ip for n in nodes}
    servers = [{
        "delete_time": n.delete_time, "dynamic_info": {"avail_block_num": n.avail_blocks,
                                                       "avail_slots_num": n.avail_slots},
        "ip": n.addr.ip, "is_faulty": n.is_faulty, "is_healthy": n.is_healthy, "model_name": n.model_name,
        "peers": [ips[p] for p in n.peers if p in ips], "static_info": n.static_info(), **_ports(n), "id": n.id,
    } for n in nodes]
    return {"coordinator": coord, "server": servers}


def write_json(path: str, data: Any) -> None:
    """Replace ``path`` with ``data`` atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, target)


def load_process_status(path: str) -> list[Node]:
    """Nodes from a backup file; an unreadable or malformed file is logged and ignored."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("cannot read the process backup %s (%s); starting afresh", path, exc)
        return []
    nodes = []
    for entry in data.get("server", []) if isinstance(data, dict) else []:
        try:
            addr = ServerAddress(entry["ip"], int(entry["port"]), int(entry["management_port"]),
                                 int(entry["metric_port"]))
            static = entry.get("static_info", {})
            role = ROLE_NAMES.get(int(static.get("role", ROLE_UNKNOWN)), "")
            pushed = bool(entry.get("is_initialized")) and bool(role)
            peers = [int(p) for p in entry.get("peers", [])]
            node = Node(addr, model_name=str(entry.get("model_name", "")),
                        max_seq_len=int(entry.get("max_seq_len", 0)), max_output_len=int(entry.get("max_output_len", 0)),
                        block_size=int(entry.get("block_size", 0)), total_slots=int(static.get("total_slots_num", 0)),
                        total_blocks=int(static.get("total_block_num", 0)), is_faulty=bool(entry.get("is_faulty")),
                        delete_time=int(entry.get("delete_time", 0)),
                        initialized=bool(entry.get("config_collected")), infer_mode=str(entry.get("infer_mode", "")),
                        inter_comm_port=int(entry.get("inter_comm_port", 0) or 0), role=role, role_pushed=pushed,
                        pushed_peers=tuple(peers) if pushed else None, peers=peers if pushed else [])
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("process backup %s: skipping a malformed server entry (%s)", path, exc)
            continue
        nodes.append(node)
    return nodes
