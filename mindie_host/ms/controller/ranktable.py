"""Where the servers and the coordinator are: a ``global_ranktable.json`` or a plain list.

The rank table (spec §5.5): ``{"version", "status": "completed"|"initializing",
"server_group_list": [{"group_id": "0"|"1"|"2", "server_count", "server_list": [{"server_id",
"server_ip", "device": [...], "hardware_type"}]}]}``; group ``"0"`` is the coordinator, ``"1"``
the controller, ``"2"`` the servers. While ``status`` is ``initializing`` the table is not used.

Ports come from ``ms_controller.json`` (``mindie_server_port``, ``mindie_server_control_port``,
``mindie_server_metric_port``, ``mindie_ms_coordinator_port``). As a mindie-host extension an
entry may carry its own ``port``, ``management_port`` and ``metric_port`` (a coordinator entry:
``port``, its management port), so several servers can share one machine.

The plain list: a JSON array of servers, each ``{"ip", "port", "management_port", "metric_port"}``
(ports optional as above), or an object ``{"coordinator": {"ip", "port"}, "servers": [...]}``.
Without a coordinator entry the coordinator is ``127.0.0.1:mindie_ms_coordinator_port``.

A server entry's ``device`` list (rank table, or plain list as an extension) is kept for the PD
role push (``POST /v1/role``): each device's ``device_logical_id`` (else its ``device_id``, else its
position) and ``device_ip`` (else the server's IP).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from ..coordinator.instances import instance_id
from ..schema import ConfigError, read_json_file
from .config import ControllerConfig

MAX_SERVERS = 96


@dataclass(frozen=True)
class ServerAddress:
    """One server's addresses."""

    ip: str
    port: int
    management_port: int
    metric_port: int
    devices: tuple[tuple[str, str], ...] = ()
    hardware_type: str = ""

    @property
    def id(self) -> int:
        return instance_id(self.ip, self.port)

    def device_list(self) -> list[dict[str, str]]:
        """The devices as the role push carries them; one device ``"0"`` at the server's IP when none is listed."""
        devices = self.devices or (("0", self.ip),)
        return [{"device_logical_id": logical, "device_ip": ip} for logical, ip in devices]


@dataclass(frozen=True)
class Topology:
    """What the rank table says: the servers and the coordinator's management address."""

    servers: tuple[ServerAddress, ...]
    coordinator: tuple[str, int] | None
    ready: bool = True


def _ip(value: Any, where: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError, TypeError):
        raise ConfigError(where, value, "an IPv4 address") from None


def _port(entry: dict[str, Any], key: str, default: int, where: str) -> int:
    value = entry.get(key, default)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= 65535:
        raise ConfigError(f"{where}.{key}", value, "a port in [1024, 65535]")
    return value


def _devices(entry: dict[str, Any], server_ip: str) -> tuple[tuple[str, str], ...]:
    """``(device_logical_id, device_ip)`` of each listed device; lenient, single_node never reads them."""
    items = entry.get("device", [])
    out = []
    for n, dev in enumerate(items if isinstance(items, list) else []):
        if isinstance(dev, dict):
            logical = dev.get("device_logical_id", dev.get("device_id", n))
            out.append((str(logical), str(dev.get("device_ip") or server_ip)))
    return tuple(out)


def _hardware_type(entry: dict[str, Any], where: str) -> str:
    """``hardware_type`` (heterogeneous PD: ``"800I A2(32G)"`` or ``"800I A2(64G)"``); empty when absent."""
    value = entry.get("hardware_type", "")
    if not isinstance(value, str):
        raise ConfigError(f"{where}.hardware_type", value, "a string such as \"800I A2(32G)\"")
    return value


def _server(entry: Any, where: str, cfg: ControllerConfig, ip_key: str) -> ServerAddress:
    if isinstance(entry, str):
        entry = {"ip": entry.split(":")[0], "port": entry.split(":")[1]} if ":" in entry else {"ip": entry}
    if not isinstance(entry, dict):
        raise ConfigError(where, entry, "an object with the server's ip")
    ip = _ip(entry.get(ip_key), f"{where}.{ip_key}")
    return ServerAddress(
        ip=ip,
        port=_port(entry, "port", cfg.server_port, where),
        management_port=_port(entry, "management_port", cfg.server_control_port, where),
        metric_port=_port(entry, "metric_port", cfg.server_metric_port, where),
        devices=_devices(entry, ip),
        hardware_type=_hardware_type(entry, where),
    )


def _coordinator(entry: Any, where: str, cfg: ControllerConfig, ip_key: str) -> tuple[str, int]:
    if not isinstance(entry, dict):
        raise ConfigError(where, entry, "an object with the coordinator's ip")
    return _ip(entry.get(ip_key), f"{where}.{ip_key}"), _port(entry, "port", cfg.coordinator_port, where)


def parse_topology(data: Any, cfg: ControllerConfig, path: str = "rank table") -> Topology:
    """The servers and coordinator in ``data`` (a rank table or a plain list)."""
    if isinstance(data, list) or (isinstance(data, dict) and "servers" in data):
        items = data if isinstance(data, list) else data["servers"]
        if not isinstance(items, list):
            raise ConfigError(f"{path}.servers", items, "a list of servers")
        servers = tuple(_server(e, f"{path}[{n}]", cfg, "ip") for n, e in enumerate(items))
        coord = data.get("coordinator") if isinstance(data, dict) else None
        coordinator = _coordinator(coord, f"{path}.coordinator", cfg, "ip") if coord is not None else \
            ("127.0.0.1", cfg.coordinator_port)
        return _checked(Topology(servers, coordinator), path)
    if not isinstance(data, dict) or not isinstance(data.get("server_group_list"), list):
        raise ConfigError(path, type(data).__name__, "a global rank table with server_group_list, or a list of "
                          "servers")
    status = data.get("status", "completed")
    if status not in ("completed", "initializing"):
        raise ConfigError(f"{path}.status", status, "'completed' or 'initializing'")
    servers: list[ServerAddress] = []
    coordinator: tuple[str, int] | None = None
    for g, group in enumerate(data["server_group_list"]):
        where = f"{path}.server_group_list[{g}]"
        if not isinstance(group, dict) or str(group.get("group_id")) not in ("0", "1", "2"):
            raise ConfigError(f"{where}.group_id", group.get("group_id") if isinstance(group, dict) else group,
                              "'0' (coordinator), '1' (controller) or '2' (servers)")
        entries = group.get("server_list", [])
        if not isinstance(entries, list):
            raise ConfigError(f"{where}.server_list", entries, "a list")
        gid = str(group["group_id"])
        for n, entry in enumerate(entries):
            ew = f"{where}.server_list[{n}]"
            if gid == "2":
                servers.append(_server(entry, ew, cfg, "server_ip"))
            elif gid == "0":
                coordinator = _coordinator(entry, ew, cfg, "server_ip")
    return _checked(Topology(tuple(servers), coordinator, ready=status == "completed"), path)


def _checked(topology: Topology, path: str) -> Topology:
    if len(topology.servers) > MAX_SERVERS:
        raise ConfigError(path, len(topology.servers), f"at most {MAX_SERVERS} servers")
    ids = [s.id for s in topology.servers]
    if len(set(ids)) != len(ids):
        raise ConfigError(path, [f"{s.ip}:{s.port}" for s in topology.servers], "servers with distinct ip:port")
    return topology


def read_topology(cfg: ControllerConfig) -> Topology:
    """Read ``global_rank_table_file_path``."""
    return parse_topology(read_json_file(cfg.rank_table_path), cfg, cfg.rank_table_path)
