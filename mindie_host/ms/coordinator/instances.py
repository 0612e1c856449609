"""The coordinator's view of the servers: what the controller pushed, and what routing learned.

``POST /v1/instances/refresh`` replaces the live set: ``ids`` lists every live instance and
``instances`` describes them (spec §4.3). An instance leaves rotation when it is put
``offline``, or when a request to it fails (connection refused, reset, a stream cut short);
a failed instance comes back on the first refresh that lists it at least
:data:`READMIT_AFTER` seconds after the failure (the controller lists only servers whose
latest ``/v1/status`` poll succeeded).

An instance that a refresh leaves out while it is ``offline`` or still has requests in flight is
kept aside (*departed*) with that state: ``/v1/instances/tasks`` still counts its requests, and a
later refresh that lists it again (a status poll that failed once under load) brings back the same
record, still offline, rather than a fresh one in rotation. Without that, one missed poll put a
draining instance back in rotation and hid its running requests from whoever waits for them to
end. A departed record is dropped once it is idle and online, or idle and away for
:data:`DEPARTED_KEEP` seconds (an address that comes back later is a new server, in rotation).

In pd_separate ``static_info.role`` says what an instance is (80 P, 68 D, 85 none) and the
optional ``static_info.inter_comm_port`` (1024..65535, a mindie-host addition from the server's
``/v1/config``) where a P reaches it as a D (the ``d-target`` header).
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from typing import Any

from ..bodies import BodyError

READMIT_AFTER = 2.0
DEPARTED_KEEP = 60.0
ROLE_PREFILL = 80
ROLE_DECODE = 68
ROLE_NONE = 85
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_NONE)


class RefreshError(BodyError):
    """A refresh body that does not follow the spec; the message names the field."""


def instance_id(ip: str, port: int) -> int:
    """A stable u64 id for a server: its IPv4 address and data port (``ip << 16 | port``)."""
    return int(ipaddress.IPv4Address(ip)) << 16 | int(port)


@dataclass
class Instance:
    """One server (instance) behind the coordinator."""

    id: int
    ip: str
    port: int
    metric_port: int
    model_name: str
    static: dict[str, Any] = field(default_factory=dict)
    dynamic: dict[str, Any] = field(default_factory=dict)
    offline: bool = False
    failed_at: float | None = None
    failure: str = ""
    active: int = 0
    allocated_blocks: int = 0
    departed_at: float = 0.0

    @property
    def available(self) -> bool:
        """In rotation: not offline and not failed."""
        return not self.offline and self.failed_at is None

    @property
    def total_slots(self) -> int:
        return int(self.static.get("total_slots_num") or 0)

    @property
    def total_blocks(self) -> int:
        return int(self.static.get("total_block_num") or 0)

    @property
    def block_size(self) -> int:
        return int(self.static.get("block_size") or 16)

    def free_slots(self) -> int:
        """Free slots: what the server last reported, less what was sent to it since."""
        reported = int(self.dynamic.get("avail_slots_num", self.total_slots) or 0)
        if self.total_slots:
            return max(0, min(reported, self.total_slots - self.active))
        return max(0, reported - self.active)

    def free_blocks(self) -> int:
        return max(0, int(self.dynamic.get("avail_block_num", self.total_blocks) or 0))

    def slots_ratio(self) -> float:
        return self.free_slots() / self.total_slots if self.total_slots else 1.0

    def blocks_ratio(self) -> float:
        return self.free_blocks() / self.total_blocks if self.total_blocks else 1.0

    @property
    def role(self) -> int:
        """``static_info.role``: 80 (P), 68 (D) or 85 (none, the single_node default)."""
        return int(self.static.get("role") or ROLE_NONE)

    @property
    def inter_comm_port(self) -> int:
        """``static_info.inter_comm_port``; 0 when not given."""
        return int(self.static.get("inter_comm_port") or 0)

    def mark_failed(self, reason: str) -> None:
        self.failed_at = time.monotonic()
        self.failure = reason

    @property
    def base_url(self) -> str:
        return f"{self.ip}:{self.port}"


def _int(obj: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = 2**64 - 1, *,
         required: bool = True) -> int | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        shown = value if not isinstance(value, (str, list, dict)) or len(value) <= 40 else type(value).__name__
        raise RefreshError(f"{where}.{key} must be an integer in [{lo}, {hi}], got {shown!r}")
    return value


def parse_refresh(body: Any) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """Check a refresh body; returns the live ids and each described instance's fields."""
    if not isinstance(body, dict):
        raise RefreshError("the body must be a JSON object with 'ids' and 'instances'")
    ids = body.get("ids")
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**64
                                        for i in ids):
        raise RefreshError("ids must be a list of unsigned 64-bit integers")
    items = body.get("instances")
    if not isinstance(items, list):
        raise RefreshError("instances must be a list of objects")
    described: dict[int, dict[str, Any]] = {}
    for n, item in enumerate(items):
        where = f"instances[{n}]"
        if not isinstance(item, dict):
            raise RefreshError(f"{where} must be an object")
        iid = _int(item, "id", where)
        ip = item.get("ip")
        try:
            ipaddress.IPv4Address(ip)
        except (ipaddress.AddressValueError, ValueError, TypeError):
            raise RefreshError(f"{where}.ip must be an IPv4 address, got {ip!r}") from None
        port = _int(item, "port", where, 1024, 65535)
        metric_port = _int(item, "metric_port", where, 1024, 65535, required=False) or port
        name = item.get("model_name", "")
        if not isinstance(name, str) or len(name) > 4096:
            raise RefreshError(f"{where}.model_name must be a string of at most 4096 characters")
        static = item.get("static_info", {})
        dynamic = item.get("dynamic_info", {})
        if not isinstance(static, dict) or not isinstance(dynamic, dict):
            raise RefreshError(f"{where}.static_info and dynamic_info must be objects")
        sw = f"{where}.static_info"
        max_seq = _int(static, "max_seq_len", sw, 1)
        assert max_seq is not None
        _int(static, "max_output_len", sw, 1, max(1, max_seq - 1))
        _int(static, "total_slots_num", sw, 1, 5000)
        _int(static, "total_block_num", sw, 1)
        _int(static, "block_size", sw, 1, 128)
        role = _int(static, "role", sw, 0, 255, required=False)
        if role is not None and role not in ROLES:
            raise RefreshError(f"{sw}.role must be 80 (P), 68 (D) or 85 (undefined), got {role}")
        _int(static, "inter_comm_port", sw, 1024, 65535, required=False)
        dw = f"{where}.dynamic_info"
        _int(dynamic, "avail_slots_num", dw, required=False)
        _int(dynamic, "avail_block_num", dw, required=False)
        peers = dynamic.get("peers", [])
        if not isinstance(peers, list) or any(isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < 2**64
                                              for p in peers):
            raise RefreshError(f"{dw}.peers must be a list of unsigned 64-bit instance ids")
        described[int(iid)] = {"ip": ip, "port": port, "metric_port": metric_port, "model_name": name,
                               "static": static, "dynamic": dynamic}
    unknown = [i for i in described if i not in ids]
    if unknown:
        raise RefreshError(f"instances describes ids not listed in ids: {unknown}")
    return ids, described


class InstanceTable:
    """The live instances, keyed by id, and the departed ones (see the module docstring)."""

    def __init__(self) -> None:
        self.items: dict[int, Instance] = {}
        self.departed: dict[int, Instance] = {}
        self.refreshed = False

    def apply_refresh(self, ids: list[int], described: dict[int, dict[str, Any]]) -> list[int]:
        """Make ``ids`` the live set; returns ids that could not be added (never described)."""
        now = time.monotonic()
        missing = []
        listed = set(ids)
        for iid, inst in list(self.departed.items()):
            if inst.active == 0 and (not inst.offline or now - inst.departed_at >= DEPARTED_KEEP):
                del self.departed[iid]
        for iid in list(self.items):
            if iid not in listed:
                inst = self.items.pop(iid)
                if inst.offline or inst.active:
                    inst.departed_at = now
                    self.departed[iid] = inst
        for iid in ids:
            info = described.get(iid)
            inst = self.items.get(iid)
            if inst is None and iid in self.departed:  # back in the live set: the same record, state and all
                inst = self.items[iid] = self.departed.pop(iid)
            if inst is None:
                if info is None:
                    missing.append(iid)
                    continue
                inst = self.items[iid] = Instance(iid, info["ip"], info["port"], info["metric_port"],
                                                  info["model_name"])
            if info is not None:
                inst.ip, inst.port, inst.metric_port = info["ip"], info["port"], info["metric_port"]
                inst.model_name = info["model_name"]
                inst.static, inst.dynamic = dict(info["static"]), dict(info["dynamic"])
            if inst.failed_at is not None and now - inst.failed_at >= READMIT_AFTER:
                inst.failed_at, inst.failure = None, ""
        self.refreshed = True
        return missing

    def available(self) -> list[Instance]:
        return [i for i in self.items.values() if i.available]

    def __contains__(self, iid: int) -> bool:
        """Known: live, or departed with its state (offline, requests in flight)."""
        return iid in self.items or iid in self.departed

    def get(self, iid: int) -> Instance | None:
        """A live or departed instance."""
        return self.items.get(iid) or self.departed.get(iid)
