"""The controller's record of each server: static info, last status, health and fault marks.

Fault rules (spec §4.2, single_node): a server is *initialized* once its ``/v1/config`` has answered 200
and its ``/v1/status`` says ``RoleReady`` (the model is loaded). While it is not, it is tried every
``server_online_wait_seconds``; after ``server_online_attempt_times`` failed tries it is marked
*faulty* and left out of scheduling. *Healthy* means the latest poll succeeded. Only
initialized, healthy, non-faulty servers are pushed to the coordinator. A faulty server that
answers again later is taken back (logged), so a restarted server rejoins by itself.

In pd_separate a server whose ``/v1/status`` says ``RoleUnknown`` (loaded, waiting for a role) is
initialized too; it is pushed to the coordinator only once it has a role (:mod:`.roles`) and
reports ``RoleReady`` with that role (:attr:`Node.pd_live`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .ranktable import ServerAddress

ROLE_UNKNOWN = 85
ROLE_PREFILL = 80
ROLE_DECODE = 68
ROLE_CODES = {"prefill": ROLE_PREFILL, "decode": ROLE_DECODE}
LABEL_NONE = 0


@dataclass
class Node:
    """One server as the controller knows it."""

    addr: ServerAddress
    model_name: str = ""
    max_seq_len: int = 0
    max_output_len: int = 0
    block_size: int = 0
    total_slots: int = 0
    total_blocks: int = 0
    avail_slots: int = 0
    avail_blocks: int = 0
    initialized: bool = False
    is_healthy: bool = False
    is_faulty: bool = False
    attempts: int = 0
    next_try: float = 0.0
    delete_time: int = 0
    last_error: str = ""
    peers: list[int] = field(default_factory=list)
    infer_mode: str = ""
    inter_comm_port: int = 0
    role: str = ""
    role_pushed: bool = False
    pushed_peers: tuple[int, ...] | None = None
    role_status: str = ""
    current_role: str = "none"
    status_sent_at: float = 0.0

    @property
    def id(self) -> int:
        return self.addr.id

    @property
    def live(self) -> bool:
        """Pushed to the coordinator."""
        return self.initialized and self.is_healthy and not self.is_faulty

    @property
    def role_ready(self) -> bool:
        """The role was pushed and the server's latest status says ``RoleReady`` with that role."""
        return bool(self.role) and self.role_pushed and self.role_status == "RoleReady" and \
            self.current_role == self.role

    @property
    def pd_live(self) -> bool:
        """Pushed to the coordinator in pd_separate: live, with its role in place."""
        return self.live and self.role_ready

    @property
    def role_code(self) -> int:
        """``static_info.role``: 80 (P), 68 (D) or 85 (none)."""
        return ROLE_CODES.get(self.role, ROLE_UNKNOWN)

    def apply_config(self, body: dict[str, Any]) -> None:
        """Static info from ``/v1/config``."""
        self.model_name = str(body.get("modelName", ""))
        self.max_seq_len = int(body.get("maxSeqLen", 0) or 0)
        self.max_output_len = int(body.get("maxOutputLen", 0) or 0)
        self.block_size = int(body.get("cacheBlockSize", 0) or 0)
        self.total_slots = int(body.get("maxBatchSize", 0) or 0) or self.total_slots
        self.total_blocks = int(body.get("totalBlockNum", 0) or 0) or self.total_blocks
        self.infer_mode = str(body.get("inferMode", "") or "")
        port = body.get("interCommPort")
        self.inter_comm_port = port if isinstance(port, int) and not isinstance(port, bool) and \
            1024 <= port <= 65535 else 0

    def apply_status(self, body: dict[str, Any]) -> None:
        """Dynamic info from ``/v1/status``; totals fall back to the largest free counts seen."""
        resource = body.get("resource", {}) if isinstance(body, dict) else {}
        self.avail_slots = int(resource.get("availSlotsNum", 0) or 0)
        self.avail_blocks = int(resource.get("availBlockNum", 0) or 0)
        self.total_slots = max(self.total_slots, self.avail_slots)
        self.total_blocks = max(self.total_blocks, self.avail_blocks)
        service = body.get("service", {}) if isinstance(body, dict) else {}
        if isinstance(service, dict):
            self.role_status = str(service.get("roleStatus", ""))
            self.current_role = str(service.get("currentRole", "none"))

    def static_info(self) -> dict[str, Any]:
        """``static_info`` as the refresh body and the cluster-status file carry it."""
        max_seq = max(2, self.max_seq_len)
        info: dict[str, Any] = {
            "group_id": 0, "label": LABEL_NONE, "role": self.role_code,
            "max_seq_len": max_seq, "max_output_len": max(1, min(self.max_output_len or max_seq - 1, max_seq - 1)),
            "total_slots_num": max(1, min(self.total_slots, 5000)), "total_block_num": max(1, self.total_blocks),
            "block_size": max(1, min(self.block_size or 16, 128)),
        }
        if self.role and self.inter_comm_port:  # pd_separate only: where a P reaches this server as a D
            info["inter_comm_port"] = self.inter_comm_port
        return info

    def dynamic_info(self) -> dict[str, Any]:
        """``dynamic_info``: free slots and blocks; a D's peers (its P ids) in pd_separate."""
        info: dict[str, Any] = {"avail_slots_num": self.avail_slots, "avail_block_num": self.avail_blocks}
        if self.role == "decode":
            info["peers"] = list(self.peers)
        return info

    def refresh_entry(self) -> dict[str, Any]:
        """This server in a ``/v1/instances/refresh`` body."""
        return {"id": self.id, "ip": self.addr.ip, "port": self.addr.port, "metric_port": self.addr.metric_port,
                "model_name": self.model_name, "static_info": self.static_info(),
                "dynamic_info": self.dynamic_info()}
