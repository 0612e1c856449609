"""What the deployer needs from a target (local processes or Kubernetes), and the checks both share.

A target turns a checked ``infer_server.json`` (:class:`~.spec.InferServer`) into running instances, reports
their state, replaces them in a rolling update and removes them. It raises :class:`~.spec.SpecError` (400)
for a request it cannot carry out as asked, :class:`NotFound` (404) for an unknown server, and
:class:`TargetError` (500) when its own machinery fails (the message says what, never a traceback).

The servers' ``config.json`` is the deployer's ``--server-config`` (built-in defaults without it), read again
at every create and update, so an update rolls out a changed config as Kubernetes rolls out a changed image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from ...config import ConfigError, config_from_dict, default_config_dict, load_config
from ..tls import TLSLink
from .spec import InferServer, SpecError

PROBE_PERIOD = 5  # seconds between liveness probes (spec: "live detection every 5 s")


class NotFound(LookupError):
    """No server of that name."""


class TargetError(RuntimeError):
    """The target's own machinery failed (a process did not start, the API server refused)."""


class Target(Protocol):
    """Where instances run. Every method is a coroutine except :meth:`check`."""

    kind: str

    def check(self, spec: InferServer) -> None:
        """Refuse (``SpecError``) what this target cannot do, before anything is created."""

    async def create(self, spec: InferServer) -> None:
        """Start creating the server's instances (the answer does not wait for them to be ready)."""

    async def restore(self, spec: InferServer) -> None:
        """Take a server listed in the status file back after a deployer restart."""

    async def status(self, spec: InferServer) -> dict[str, Any]:
        """``{"instances_status": [{"liveness", "pod_name", "readiness"}], "model_info": {...}}``."""

    async def update(self, spec: InferServer) -> None:
        """Start a rolling update to the current server config (one already running is superseded)."""

    async def delete(self, spec: InferServer) -> None:
        """Remove the server: it stops taking requests now; its instances drain and stop."""

    async def close(self) -> None:
        """The deployer is stopping."""


def read_server_config(path: str | None) -> dict[str, Any]:
    """The servers' config.json as a dict (checked by the server's own rules), or the defaults."""
    if not path:
        return default_config_dict()
    try:
        return load_config(path).to_dict()
    except (ConfigError, OSError, ValueError) as exc:
        raise TargetError(f"the servers' config {path} cannot be used: {exc}") from None


def config_digest(config: dict[str, Any]) -> str:
    """A short, stable digest of a config (labels a revision)."""
    import hashlib

    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def uses_npu(config: dict[str, Any]) -> bool:
    """Whether the servers run on Ascend NPUs (``device: "npu"``, or the NPU-only ``atb`` backend)."""
    models = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"]
    return any(m.get("device") == "npu" or m.get("backendType") == "atb" for m in models)


def npu_count(config: dict[str, Any]) -> int:
    """NPUs one server uses: every device id in ``npuDeviceIds``."""
    return sum(len(group) for group in config["BackendConfig"]["npuDeviceIds"])


def check_against_config(spec: InferServer, config: dict[str, Any], mindie_tls: TLSLink) -> None:
    """The request against the servers' config and the deployer's link to them (both targets)."""
    https = bool(config["ServerConfig"].get("httpsEnabled"))
    if spec.server.enable_tls != https:
        raise SpecError(
            f"mindie_server_config.enable_tls: {str(spec.server.enable_tls).lower()}, but the servers' "
            f"config.json has httpsEnabled {str(https).lower()}; they must agree"
        )
    if spec.server.enable_tls != mindie_tls.enabled:
        raise SpecError(
            f"mindie_server_config.enable_tls: {str(spec.server.enable_tls).lower()}, but ms_server.json "
            f"has client_mindie_server_tls_enable {str(mindie_tls.enabled).lower()}; they must agree"
        )
    if uses_npu(config):
        devices = config["BackendConfig"]["npuDeviceIds"]
        count = npu_count(config)
        if spec.resources.npu_chip_num != count:
            raise SpecError(
                f"resource_requests.npu_chip_num: {spec.resources.npu_chip_num}, but the servers' "
                f"config.json uses {count} NPU(s) (npuDeviceIds {devices}); they must agree"
            )
        ids = sorted(i for group in devices for i in group)
        if ids != list(range(count)):
            raise SpecError(
                f"resource_requests.npu_chip_num: the servers' npuDeviceIds {devices} must number the "
                f"pod's NPUs from 0 ({list(range(count))})"
            )


def server_tls_files(config: dict[str, Any], base: Path) -> dict[str, str]:
    """The business listener's certificate, key, password file (and the master-key files it is encrypted under)
    and first CA as TLS items, relative paths under ``base`` (the servers' ``MIES_INSTALL_PATH``)."""
    from ...server.tls import resolve

    s = config_from_dict(config).server
    ca = [name for name in s.tlsCaFile if name]
    return {
        "ca_cert": str(resolve(base, s.tlsCaPath, ca[0])) if ca else "",
        "tls_cert": str(resolve(base, s.tlsCert)),
        "tls_key": str(resolve(base, s.tlsPk)),
        "tls_passwd": str(resolve(base, s.tlsPkPwd)) if s.tlsPkPwd else "",
        "tls_crl": "",
        "kmcKsfMaster": str(resolve(base, s.kmcKsfMaster)) if s.kmcKsfMaster else "",
        "kmcKsfStandby": str(resolve(base, s.kmcKsfStandby)) if s.kmcKsfStandby else "",
    }


def link_items(link: TLSLink) -> dict[str, str]:
    """A link's TLS items with absolute paths, for another component's config file."""
    out = {}
    for key, name in (("ca_cert", "ca_cert"), ("tls_cert", "tls_cert"), ("tls_key", "tls_key"),
                      ("tls_passwd", "tls_passwd"), ("tls_crl", "tls_crl"), ("kmc_master", "kmcKsfMaster"),
                      ("kmc_standby", "kmcKsfStandby")):
        value = getattr(link, key)
        out[name] = str(Path(link.base) / value) if value else ""
    return out
