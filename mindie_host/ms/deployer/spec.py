"""``infer_server.json``: the body of ``POST /v1/servers`` (spec §3.4.2, Tables 3-6 and 3-9), checked key by key.

Every key is checked for its type and range; a bad value raises :class:`SpecError`, whose message names the
key and what is allowed (the deployer answers it with a 400). Keys the spec does not define are refused, and
so are keys the spec rules out for the chosen ``server_type`` (``cross_node_num`` in single-node; the rolling
update keys and ``termination_grace_period_seconds`` in multi-node). ``namespace`` (named by the spec's text,
missing from its sample) defaults to ``mindie``.

The spec's samples carry ``cross_node_num`` in a single-node body, ``memory`` 500000 (above its own range) and
lack a comma after ``npu_fault_reschedule``: each of those gets a 400 here (docs/compatibility.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

SINGLE_NODE = "mindie_single_node"
CROSS_NODE = "mindie_cross_node"
NPU_TYPES = ("Ascend910", "Ascend310P")
DEFAULT_NAMESPACE = "mindie"
DEFAULT_MEMORY_MB = 256000
MAX_NAME = 50  # leaves room for the "-config" suffix and the pods' generated suffixes within 63 characters
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PERCENT = re.compile(r"^(\d{1,3})%$")

TOP_KEYS = frozenset(
    {
        "server_name",
        "namespace",
        "replicas",
        "service_port",
        "cross_node_num",
        "service_type",
        "server_type",
        "scheduler",
        "init_delay",
        "detect_server_inner_error",
        "liveness_timeout",
        "liveness_failure_threshold",
        "readiness_timeout",
        "readiness_failure_threshold",
        "resource_requests",
        "mindie_server_config",
        "npu_fault_reschedule",
        "termination_grace_period_seconds",
        "max_unavailable",
        "max_surge",
    }
)
RESOURCE_KEYS = frozenset({"memory", "cpu_core", "npu_type", "npu_chip_num"})
SERVER_CONFIG_KEYS = frozenset({"mies_install_path", "infer_port", "management_port", "enable_tls"})
SINGLE_NODE_ONLY = ("termination_grace_period_seconds", "max_unavailable", "max_surge")


class SpecError(ValueError):
    """A request body (or a value in it) the deployer refuses; the message names the key."""


@dataclass(frozen=True)
class Resources:
    """``resource_requests``: memory in MB, CPU in millicores, the NPU type and chips per instance (per node)."""

    memory: int
    cpu_core: int
    npu_type: str
    npu_chip_num: int


@dataclass(frozen=True)
class MindieServerConfig:
    """``mindie_server_config``: where MindIE sits in the image, its two ports, and whether it speaks HTTPS."""

    mies_install_path: str
    infer_port: int
    management_port: int
    enable_tls: bool


@dataclass(frozen=True)
class InferServer:
    """A checked ``infer_server.json``; ``body`` is the JSON object it came from."""

    server_name: str
    namespace: str
    replicas: int
    service_port: int
    service_type: str
    server_type: str
    scheduler: str
    init_delay: int
    detect_server_inner_error: bool
    liveness_timeout: int
    liveness_failure_threshold: int
    readiness_timeout: int
    readiness_failure_threshold: int
    resources: Resources
    server: MindieServerConfig
    body: dict[str, Any]
    cross_node_num: int | None = None
    npu_fault_reschedule: bool | None = None
    termination_grace_period_seconds: int = 30
    max_unavailable: int = 0
    max_surge: int = 0

    @property
    def single_node(self) -> bool:
        return self.server_type == SINGLE_NODE

    def rolling_limits(self) -> tuple[int, int]:
        """``(surge, unavailable)`` in instances, as a Deployment resolves its percentages.

        Surge rounds up and unavailability down; when both come out 0 one instance may be unavailable at a
        time, which is the spec's "forced update" (Kubernetes resolves its fenceposts the same way).
        """
        surge = math.ceil(self.replicas * self.max_surge / 100)
        unavailable = self.replicas * self.max_unavailable // 100
        if surge == 0 and unavailable == 0:
            unavailable = 1
        return surge, unavailable


def _get(body: dict[str, Any], key: str, where: str = "") -> tuple[str, Any]:
    name = f"{where}.{key}" if where else key
    if key not in body:
        raise SpecError(f"{name}: the key is required")
    return name, body[key]


def _int(body: dict[str, Any], key: str, lo: int, hi: int, where: str = "") -> int:
    name, value = _get(body, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecError(f"{name}: must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _bool(body: dict[str, Any], key: str, where: str = "") -> bool:
    name, value = _get(body, key, where)
    if not isinstance(value, bool):
        raise SpecError(f"{name}: must be true or false, got {value!r}")
    return value


def _choice(body: dict[str, Any], key: str, choices: tuple[str, ...], where: str = "") -> str:
    name, value = _get(body, key, where)
    if value not in choices or not isinstance(value, str):
        raise SpecError(f"{name}: must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def _percent(body: dict[str, Any], key: str) -> int:
    name, value = _get(body, key)
    match = _PERCENT.match(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) > 100:
        raise SpecError(f'{name}: must be a percentage "N%" with N an integer in [0, 100], got {value!r}')
    return int(match.group(1))


def _object(body: dict[str, Any], key: str, allowed: frozenset[str]) -> dict[str, Any]:
    name, value = _get(body, key)
    if not isinstance(value, dict):
        raise SpecError(f"{name}: must be a JSON object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise SpecError(f"{name}.{unknown[0]}: unknown key; the keys are {', '.join(sorted(allowed))}")
    return value


def check_name(value: Any, key: str = "server_name") -> str:
    """A server name: a Kubernetes DNS label (lower-case letters, digits, '-'), at most 50 characters."""
    if not isinstance(value, str) or not _DNS_LABEL.match(value) or len(value) > MAX_NAME:
        raise SpecError(
            f"{key}: must be a name of at most {MAX_NAME} lower-case letters, digits and '-', "
            f"starting with a letter and ending with a letter or digit, got {value!r}"
        )
    return value


def parse_infer_server(body: Any) -> InferServer:
    """Check an ``infer_server.json`` body; raises :class:`SpecError` naming the first bad key."""
    if not isinstance(body, dict):
        raise SpecError("the body must be a JSON object (infer_server.json)")
    unknown = sorted(set(body) - TOP_KEYS)
    if unknown:
        raise SpecError(f"{unknown[0]}: unknown key; see infer_server.json's keys (spec Table 3-6)")
    name = check_name(_get(body, "server_name")[1])
    namespace = check_name(body.get("namespace", DEFAULT_NAMESPACE), "namespace")
    server_type = _choice(body, "server_type", (SINGLE_NODE, CROSS_NODE))
    single = server_type == SINGLE_NODE
    replicas = _int(body, "replicas", 1, 256 if single else 1)
    cross_node_num = None
    if single:
        if "cross_node_num" in body:
            raise SpecError("cross_node_num: not supported with server_type 'mindie_single_node' (multi-node only)")
    else:
        cross_node_num = _int(body, "cross_node_num", 2, 4)
        if cross_node_num == 3:
            raise SpecError("cross_node_num: must be 2 or 4, got 3")
        for key in SINGLE_NODE_ONLY:
            if key in body:
                raise SpecError(f"{key}: not supported with server_type 'mindie_cross_node' (single-node only)")
    scheduler = _choice(body, "scheduler", ("default", "volcano") if single else ("default",))
    res = _object(body, "resource_requests", RESOURCE_KEYS)
    resources = Resources(
        memory=_int(res, "memory", 1000, 256000, "resource_requests") if "memory" in res else DEFAULT_MEMORY_MB,
        cpu_core=_int(res, "cpu_core", 1000, 256000, "resource_requests"),
        npu_type=_choice(res, "npu_type", NPU_TYPES if single else ("Ascend910",), "resource_requests"),
        npu_chip_num=_int(res, "npu_chip_num", 1 if single else 8, 8, "resource_requests"),
    )
    srv = _object(body, "mindie_server_config", SERVER_CONFIG_KEYS)
    install = _get(srv, "mies_install_path", "mindie_server_config")[1]
    if not isinstance(install, str) or not install.startswith("/") or len(install) > 4096:
        raise SpecError(f"mindie_server_config.mies_install_path: must be an absolute path, got {install!r}")
    server = MindieServerConfig(
        mies_install_path=install,
        infer_port=_int(srv, "infer_port", 1024, 65535, "mindie_server_config"),
        management_port=_int(srv, "management_port", 1024, 65535, "mindie_server_config"),
        enable_tls=_bool(srv, "enable_tls", "mindie_server_config"),
    )
    if server.infer_port == server.management_port:
        raise SpecError(f"mindie_server_config.management_port: must differ from infer_port ({server.infer_port})")
    reschedule = None
    if "npu_fault_reschedule" in body:
        reschedule = _bool(body, "npu_fault_reschedule")
        if not single or scheduler != "volcano":
            raise SpecError(
                "npu_fault_reschedule: needs server_type 'mindie_single_node' and scheduler 'volcano' "
                "(NPU fault rescheduling is Volcano's); leave the key out otherwise"
            )
    rolling: dict[str, int] = {}
    if single:
        rolling = {
            "termination_grace_period_seconds": _int(body, "termination_grace_period_seconds", 0, 3600),
            "max_unavailable": _percent(body, "max_unavailable"),
            "max_surge": _percent(body, "max_surge"),
        }
        if rolling["max_unavailable"] == 0 and rolling["max_surge"] == 0:
            raise SpecError("max_unavailable/max_surge: cannot both be 0%")
    return InferServer(
        server_name=name,
        namespace=namespace,
        replicas=replicas,
        service_port=_int(body, "service_port", 30000, 32767),
        service_type=_choice(body, "service_type", ("NodePort",)),
        server_type=server_type,
        scheduler=scheduler,
        init_delay=_int(body, "init_delay", 10, 1800),
        detect_server_inner_error=_bool(body, "detect_server_inner_error"),
        liveness_timeout=_int(body, "liveness_timeout", 1, 600),
        liveness_failure_threshold=_int(body, "liveness_failure_threshold", 1, 10),
        readiness_timeout=_int(body, "readiness_timeout", 1, 600),
        readiness_failure_threshold=_int(body, "readiness_failure_threshold", 1, 10),
        resources=resources,
        server=server,
        body=dict(body),
        cross_node_num=cross_node_num,
        npu_fault_reschedule=reschedule,
        **rolling,
    )


def parse_update(body: Any, path_name: str) -> str:
    """The body of ``POST /v1/servers/{server_name}``: ``{"server_name": ...}`` naming the path's server."""
    if not isinstance(body, dict):
        raise SpecError('the body must be a JSON object {"server_name": ...} (update_server.json)')
    unknown = sorted(set(body) - {"server_name"})
    if unknown:
        raise SpecError(f"{unknown[0]}: unknown key; update_server.json has only server_name")
    name = check_name(_get(body, "server_name")[1])
    if name != path_name:
        raise SpecError(f"server_name: {name!r} does not match the server in the path ({path_name!r})")
    return name
