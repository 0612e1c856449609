"""``ms_server.json`` (the deployer's config, spec §8.3.2.2 Table 8-18) and ``msctl.json`` (Table 3-5).

Both files, and the ``-f`` files ``msctl`` sends, are config files under the one file-mode rule of
:mod:`mindie_host.file_modes`: at most 0640 and owned by the user or root, unless
``MINDIE_CHECK_INPUTFILES_PERMISSION=0``; a failing file stops the command with the file, its mode and the fix.

``ms_server.json``: ``ip`` (``MINDIE_MS_SERVER_IP`` overrides it), ``port`` (default 9789), ``log_info``
(``log_level``, ``run_log_path``, ``operation_log_path``; ``MINDIE_LOG_LEVEL`` / ``MINDIEMS_LOG_LEVEL`` override
the level), ``ms_status_file``, ``server_tls_items`` (the REST API's certificate; with ``ca_cert`` set a
client must show a certificate with CN ``msclientuser`` and O ``msgroup``), ``client_mindie_server_tls_enable``
/ ``client_mindie_tls_items`` (calls to the servers), and for the Kubernetes target ``k8s_apiserver_ip``,
``k8s_apiserver_port`` (default 6443), ``client_k8s_tls_enable`` / ``client_k8s_tls_items``. As a mindie-host
extension ``server_tls_enable`` (default true) may be false, for a deployer on a loopback address only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..logs import LEVELS
from ..schema import ConfigError, Section, read_json_file
from ..tls import TLSLink, read_link, tls_base

ENV_SERVER_IP = "MINDIE_MS_SERVER_IP"
DEFAULT_PORT = 9789
DEFAULT_K8S_PORT = 6443
K8S_KEYS = ("k8s_apiserver_ip", "k8s_apiserver_port", "client_k8s_tls_enable", "client_k8s_tls_items")


@dataclass(frozen=True)
class DeployerConfig:
    """The checked ``ms_server.json``."""

    ip: str
    port: int
    log_level: str
    run_log_path: str
    operation_log_path: str
    status_file: str
    server_tls: TLSLink
    mindie_tls: TLSLink
    k8s_ip: str = ""
    k8s_port: int = DEFAULT_K8S_PORT
    k8s_tls: TLSLink | None = None
    source_path: str | None = None
    warnings: list[str] = field(default_factory=list)


def deployer_config_from_dict(
    data: Any, *, target: str = "local", source_path: str | None = None, environ: dict[str, str] | None = None
) -> DeployerConfig:
    """Check an ``ms_server.json`` for ``target`` (``local`` or ``kubernetes``)."""
    env = dict(os.environ if environ is None else environ)
    warnings: list[str] = []
    root = Section(data, "", warnings)
    ip = root.ip("ip")
    if env.get(ENV_SERVER_IP):
        ip = Section({ENV_SERVER_IP: env[ENV_SERVER_IP]}, "", warnings).ip(ENV_SERVER_IP)
    port = root.integer("port", 1024, 65535, required=False, default=DEFAULT_PORT)
    log = root.section("log_info")
    level = log.string("log_level", choices=LEVELS)
    run_log, op_log = log.string("run_log_path"), log.string("operation_log_path")
    log.finish()
    status_file = root.string("ms_status_file")
    base = tls_base(source_path)
    server_tls = (
        read_link(root, "server", base)
        if "server_tls_enable" in root.data
        else read_link(root, "server", base, enabled=True)
    )
    if not server_tls.enabled and not ip.startswith("127."):
        raise ConfigError("server_tls_enable", False, f"true: plain HTTP is allowed on a loopback ip only, not {ip}")
    mindie_tls = read_link(
        root, "mindie_client", base, enable_key="client_mindie_server_tls_enable", items_key="client_mindie_tls_items"
    )
    k8s: dict[str, Any] = {}
    if target == "kubernetes":
        k8s = {
            "k8s_ip": root.ip("k8s_apiserver_ip"),
            "k8s_port": root.integer("k8s_apiserver_port", 1024, 65535, required=False, default=DEFAULT_K8S_PORT),
            "k8s_tls": read_link(root, "client_k8s", base),
        }
    else:
        present = [key for key in K8S_KEYS if key in root.data]
        for key in present:
            root.raw(key)
        if present:
            warnings.append(f"{', '.join(present)}: no effect with the local target (they are the Kubernetes target's)")
    root.finish()
    return DeployerConfig(
        ip=ip,
        port=port,
        log_level=level,
        run_log_path=run_log,
        operation_log_path=op_log,
        status_file=status_file,
        server_tls=server_tls,
        mindie_tls=mindie_tls,
        **k8s,
        source_path=source_path,
        warnings=warnings,
    )


def load_deployer_config(path: str, *, target: str = "local", environ: dict[str, str] | None = None) -> DeployerConfig:
    """Read ``ms_server.json`` (a config file's mode rule) and check it."""
    data = read_json_file(path, environ)
    return deployer_config_from_dict(data, target=target, source_path=path, environ=environ)


@dataclass(frozen=True)
class MsctlConfig:
    """The checked ``~/.mindie_ms/msctl.json``."""

    ip: str
    port: int
    tls: TLSLink
    timeout: int
    log_level: str


def msctl_config_path(environ: dict[str, str] | None = None) -> Path:
    """``$HOME/.mindie_ms/msctl.json``."""
    env = os.environ if environ is None else environ
    return Path(env.get("HOME") or Path.home()) / ".mindie_ms" / "msctl.json"


def load_msctl_config(path: Path) -> MsctlConfig:
    """Read ``msctl.json`` (a config file's mode rule). ``http.tls_enable`` (default true) is a mindie-host extension."""
    warnings: list[str] = []
    root = Section(read_json_file(str(path)), "", warnings)
    http = root.section("http")
    ip = http.ip("dstIP")
    port = http.integer("dstPort", 1024, 65535)
    timeout = http.integer("timeout", 1, 60)
    enabled = http.boolean("tls_enable", required=False, default=True)
    values = {}
    for key in ("ca_cert", "tls_cert", "tls_key", "tls_crl"):
        value = http.raw(key, required=enabled, default="")
        if not isinstance(value, str):
            raise ConfigError(http.key(key), value, "a file path string")
        values[key] = value
    http.finish()
    level = root.string("log_level", choices=LEVELS)
    root.finish()
    if enabled and not (values["tls_cert"] and values["tls_key"] and values["ca_cert"]):
        raise ConfigError("http.tls_cert", values["tls_cert"], "ca_cert, tls_cert and tls_key all set (HTTPS)")
    tls = TLSLink("msctl", enabled, Path.cwd(), **values)  # relative paths: from where msctl runs, as the spec's
    return MsctlConfig(ip=ip, port=port, tls=tls, timeout=timeout, log_level=level)
