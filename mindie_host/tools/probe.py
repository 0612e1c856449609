"""``mindie-host probe startup|liveness|readiness``: MindIE's probe tool (spec §6.3, ``probe.sh`` with
``http_client_ctl``), for Kubernetes ``exec`` probes. Exit status 0 means the probe passed, 1 that it failed
(the reason on stderr).

Which component this pod runs, as the spec decides it:

* ``MINDIE_SERVER_PROBE_ONLY=1``: a server (the server-only, PD-mixed deployment);
* else the group of ``POD_IP`` in the rank table at ``GLOBAL_RANK_TABLE_FILE_PATH`` (MS and PD
  deployments): group 0 the coordinator, 1 the controller, 2 a server;
* ``--component`` (an extension) says it outright, for pods that know what they run.

What each probe asks, on the component's management address (``POD_IP`` when set, else the address its
config binds) and port (the server's ``managementPort`` in ``config.json``; the controller's
``http_server.port``; the coordinator's ``manage_port``):

=============  ======================  ==============  ===================
probe          server                  controller      coordinator
=============  ======================  ==============  ===================
startup        ``/v2/health/ready``    ``/v1/startup``  ``/v1/startup``
liveness       ``/v2/health/live``     ``/v1/health``   ``/v1/health``
readiness      ``/v2/health/ready``    ``/v1/health``   ``/v1/readiness``
=============  ======================  ==============  ===================

``--detect-inner-error`` (the MS Deployer's ``detect_server_inner_error``) makes each of a server's probes run a
one-token generation through the whole pipeline instead (``/health/timed-TIMEOUT``, ``TIMEOUT`` the whole seconds
of ``--timeout``): it passes only when a token comes back in time. It applies to servers only.

A server's startup waits for the model (the spec's startup probe allows 500 s for it), its liveness asks
only whether the process is healthy: a server whose engine is restarting stays alive (it answers 503 on
readiness until the model is back) instead of being killed mid-recovery. A PD server (``inferMode: dmi``)
is probed as any server: a role is the controller's business, and a readiness that waited for one would
keep the controller from ever seeing the pod.

The probe's own config is ``http_client_ctl.json`` (``MINDIE_UTILS_HTTP_CLIENT_CTL_CONFIG_FILE_PATH``,
else ``$MIES_INSTALL_PATH/conf/http_client_ctl.json`` when it exists): ``tls_enable``, the client
certificate items of ``cert`` (``ca_cert``, ``tls_cert``, ``tls_key``, ``tls_passwd`` encrypted under
``kmc_ksf_master``/``kmc_ksf_standby``, ``tls_crl``) and ``log_info``. ``MINDIE_USE_HTTPS`` (true/false)
overrides ``tls_enable``; with neither, the component's own TLS setting decides. Every request times out
after ``--timeout`` seconds (the spec's 60 by default, [1, 600]) and is tried ``--retries`` more times
([0, 30]).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROBES = ("startup", "liveness", "readiness")
COMPONENTS = ("server", "controller", "coordinator")
GROUPS = {"0": "coordinator", "1": "controller", "2": "server"}
PATHS: dict[str, dict[str, str]] = {
    "server": {"startup": "/v2/health/ready", "liveness": "/v2/health/live", "readiness": "/v2/health/ready"},
    "controller": {"startup": "/v1/startup", "liveness": "/v1/health", "readiness": "/v1/health"},
    "coordinator": {"startup": "/v1/startup", "liveness": "/v1/health", "readiness": "/v1/readiness"},
}
TIMED_PATH = "/health/timed-{}"  # the server's probe that runs a one-token generation (spec §3.5)
ENV_PROBE_ONLY = "MINDIE_SERVER_PROBE_ONLY"
ENV_RANK_TABLE = "GLOBAL_RANK_TABLE_FILE_PATH"
ENV_CLIENT_CONFIG = "MINDIE_UTILS_HTTP_CLIENT_CTL_CONFIG_FILE_PATH"
ENV_USE_HTTPS = "MINDIE_USE_HTTPS"
DEFAULT_TIMEOUT = 60.0

log = logging.getLogger("mindie_host.ms.probe")


class ProbeError(RuntimeError):
    """The probe cannot be made (config, rank table, TLS material); the message says why."""


@dataclass(frozen=True)
class Target:
    """Where a component answers its probes."""

    component: str
    ip: str
    port: int
    tls: bool  # the component's own TLS setting on that port

    def url(self, scheme: str, path: str) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{scheme}://{host}:{self.port}{path}"


def component_of(env: Mapping[str, str], flag: str | None) -> str:
    """The component this pod runs (see the module docstring)."""
    if flag:
        return flag
    if env.get(ENV_PROBE_ONLY, "").strip() == "1":
        return "server"
    table_path = env.get(ENV_RANK_TABLE)
    if not table_path:
        raise ProbeError(
            f"cannot tell what to probe: set {ENV_PROBE_ONLY}=1 (a server-only deployment), or "
            f"{ENV_RANK_TABLE} and POD_IP (an MS or PD deployment), or pass --component"
        )
    pod_ip = env.get("POD_IP", "")
    if not pod_ip:
        raise ProbeError(f"{ENV_RANK_TABLE} is set but POD_IP is not: the pod's IP finds its group in the rank table")
    from ..ms.schema import ConfigError, read_json_file

    try:
        table = read_json_file(table_path)
    except ConfigError as exc:
        raise ProbeError(f"the rank table: {exc}") from None
    groups = table.get("server_group_list") if isinstance(table, dict) else None
    for group in groups if isinstance(groups, list) else []:
        if not isinstance(group, dict):
            continue
        for entry in group.get("server_list") or []:
            if isinstance(entry, dict) and entry.get("server_ip") == pod_ip and str(group.get("group_id")) in GROUPS:
                return GROUPS[str(group.get("group_id"))]
    status = table.get("status") if isinstance(table, dict) else None
    raise ProbeError(f"POD_IP {pod_ip} is in no group of the rank table {table_path} (status {status!r})")


def _conf(env: Mapping[str, str], variable: str, name: str) -> str | None:
    """The config file named by ``variable``, else ``$MIES_INSTALL_PATH/conf/<name>`` when it exists."""
    if env.get(variable):
        return env[variable]
    install = env.get("MIES_INSTALL_PATH")
    if install and (Path(install) / "conf" / name).is_file():
        return str(Path(install) / "conf" / name)
    return None


def _ms_config(env: Mapping[str, str], variable: str, name: str, load: Any, from_dict: Any, default: Any) -> Any:
    """An MS component's config: its file (see :func:`_conf`), else the defaults."""
    path = _conf(env, variable, name)
    return load(path, environ=env) if path else from_dict(default(), environ=env)


def target_of(component: str, env: Mapping[str, str]) -> Target:
    """The component's management address and port from its config (defaults when it has no file)."""
    from ..config import ConfigError

    try:
        if component == "server":
            from ..config import config_from_dict, default_config_dict, load_config

            path = _conf(env, "MIES_CONFIG_JSON_PATH", "config.json")
            cfg = load_config(path, environ=env) if path else config_from_dict(default_config_dict(), environ=env)
            s = cfg.server
            ip, port, tls = s.managementIpAddress, s.managementPort, s.httpsEnabled
        elif component == "controller":
            from ..ms.controller import config as ctl_config

            ctl = _ms_config(
                env,
                ctl_config.ENV_PATH,
                "ms_controller.json",
                ctl_config.load_controller_config,
                ctl_config.controller_config_from_dict,
                ctl_config.default_controller_dict,
            )
            ip, port, tls = ctl.http_ip, ctl.http_port, ctl.tls["http_server"].enabled
        else:
            from ..ms.coordinator import config as coord_config

            coord = _ms_config(
                env,
                coord_config.ENV_PATH,
                "ms_coordinator.json",
                coord_config.load_coordinator_config,
                coord_config.coordinator_config_from_dict,
                coord_config.default_coordinator_dict,
            )
            ip, port, tls = coord.manage_ip, coord.manage_port, coord.tls["controller_server"].enabled
    except ConfigError as exc:
        raise ProbeError(f"the {component}'s config: {exc}") from None
    ip = env.get("POD_IP") or ip
    if ipaddress.ip_address(ip).is_unspecified:
        ip = "127.0.0.1"
    return Target(component, ip, port, tls)


@dataclass(frozen=True)
class ClientConfig:
    """``http_client_ctl.json``: whether to use HTTPS and with what."""

    tls: bool | None
    link: Any  # mindie_host.ms.tls.TLSLink, or None without TLS material
    log_info: Any


def client_config(env: Mapping[str, str]) -> ClientConfig:
    """The probe's client config (see the module docstring); a missing file means no TLS material."""
    from ..ms.logs import LEVELS, LogInfo
    from ..ms.schema import ConfigError, Section, read_json_file
    from ..ms.tls import TLSLink, tls_base

    override: bool | None = None
    if env.get(ENV_USE_HTTPS):
        value = env[ENV_USE_HTTPS].strip().lower()
        if value not in ("true", "false"):
            raise ProbeError(f"{ENV_USE_HTTPS}: got {env[ENV_USE_HTTPS]!r}; allowed true or false")
        override = value == "true"
    path = _conf(env, ENV_CLIENT_CONFIG, "http_client_ctl.json")
    if path is None:
        return ClientConfig(override, None, LogInfo(to_file=False, to_stdout=False))
    warnings: list[str] = []
    try:
        root = Section(read_json_file(path), "", warnings)
        enabled = root.boolean("tls_enable")
        cert = root.section("cert", required=enabled)
        items: dict[str, str] = {}
        for key in ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "kmc_ksf_master", "kmc_ksf_standby", "tls_crl"):
            items[key] = cert.string(key, required=enabled, default="")
        cert.finish()
        info = root.section("log_info", required=False)
        log_info = LogInfo(
            log_level=info.string("log_level", choices=LEVELS, required=False, default="INFO"),
            to_file=info.boolean("to_file", required=False, default=False),
            to_stdout=False,  # the probe prints its verdict; MINDIE_LOG_TO_STDOUT=1 adds the log lines
            run_log_path=info.string("run_log_path", required=False, default=""),
            operation_log_path=info.string("operation_log_path", required=False, default=""),
        )
        info.finish()
        root.finish()
    except ConfigError as exc:
        raise ProbeError(str(exc) if str(exc).startswith(path) else f"{path}: {exc}") from None
    for warning in warnings:
        log.warning("%s: %s", path, warning)
    link = (
        TLSLink(
            "http_client_ctl",
            True,
            tls_base(path),
            ca_cert=items["ca_cert"],
            tls_cert=items["tls_cert"],
            tls_key=items["tls_key"],
            tls_passwd=items["tls_passwd"],
            tls_crl=items["tls_crl"],
            kmc_master=items["kmc_ksf_master"],
            kmc_standby=items["kmc_ksf_standby"],
        )
        if items["tls_cert"] or items["ca_cert"]
        else None
    )
    return ClientConfig(enabled if override is None else override, link, log_info)


def probe_path(component: str, kind: str, *, timeout: float = DEFAULT_TIMEOUT, inner_error: bool = False) -> str:
    """The route a probe asks (see the module docstring); ``inner_error``: the generation probe (servers only)."""
    if not inner_error:
        return PATHS[component][kind]
    if component != "server":
        raise ProbeError(f"--detect-inner-error runs a generation on a server; the {component} has none")
    return TIMED_PATH.format(max(1, int(timeout)))


def probe(
    kind: str,
    target: Target,
    client: ClientConfig,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    retries: int = 0,
    inner_error: bool = False,
) -> tuple[bool, str]:
    """Ask ``target`` the question ``kind`` asks; ``(passed, what happened)``."""
    import httpx

    from ..ms.tls import TLSConfigError

    https = target.tls if client.tls is None else client.tls
    verify: Any = True
    if https:
        if client.link is None:
            raise ProbeError(
                f"the {target.component} serves HTTPS on port {target.port}: give the probe a CA and a "
                f"client certificate in http_client_ctl.json ({ENV_CLIENT_CONFIG})"
            )
        try:
            verify = client.link.client_context()
        except (TLSConfigError, OSError) as exc:
            raise ProbeError(f"http_client_ctl.json cert: {exc}") from None
    url = target.url("https" if https else "http", probe_path(target.component, kind, timeout=timeout,
                                                               inner_error=inner_error))
    what = ""
    for attempt in range(retries + 1):
        try:
            with httpx.Client(verify=verify, timeout=timeout, trust_env=False) as http:
                r = http.get(url)
            if r.status_code == 200:
                return True, f"GET {url} -> 200"
            body = r.text.strip()[:200]
            what = f"GET {url} -> {r.status_code}" + (f": {body}" if body else "")
        except httpx.HTTPError as exc:
            what = f"GET {url}: {type(exc).__name__}: {exc}"
        log.info("%s probe attempt %d of %d: %s", kind, attempt + 1, retries + 1, what)
        if attempt < retries:
            time.sleep(1)
    return False, what


def _bounded(kind: type, lo: float, hi: float) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside [{lo:g}, {hi:g}]")
        return value

    return parse


def add_probe_parser(sub: Any) -> None:
    """``mindie-host probe <startup|liveness|readiness>``."""
    p = sub.add_parser("probe", help="a Kubernetes exec probe: exit 0 when the component passes, else 1 (spec §6.3)")
    p.set_defaults(run=run)
    p.add_argument("kind", choices=PROBES)
    p.add_argument(
        "--component",
        choices=COMPONENTS,
        help=f"what this pod runs (default: {ENV_PROBE_ONLY}, else POD_IP's group in {ENV_RANK_TABLE})",
    )
    p.add_argument(
        "--timeout",
        type=_bounded(float, 1, 600),
        default=DEFAULT_TIMEOUT,
        help="seconds per request, [1, 600] (default 60)",
    )
    p.add_argument("--retries", type=_bounded(int, 0, 30), default=0, help="further tries, [0, 30] (default 0)")
    p.add_argument(
        "--detect-inner-error",
        action="store_true",
        help="a server's probe runs a one-token generation (/health/timed-TIMEOUT), as detect_server_inner_error asks",
    )


def run(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """Run the probe; 0 when it passed, 1 otherwise."""
    env = os.environ if env is None else env
    try:
        client = client_config(env)
        from ..ms.logs import setup_ms_logging

        setup_ms_logging(client.log_info, "probe", env)
        logging.getLogger("mindie_host.ms").addHandler(logging.NullHandler())  # no handler: nothing on stderr
        target = target_of(component_of(env, args.component), env)
        passed, what = probe(
            args.kind, target, client, timeout=args.timeout, retries=args.retries, inner_error=args.detect_inner_error
        )
    except ProbeError as exc:
        print(f"mindie-host probe {args.kind}: {exc}", file=sys.stderr)
        return 1
    message = json.dumps({"probe": args.kind, "component": target.component, "passed": passed, "detail": what})
    if passed:
        log.info("%s", message)
        print(f"{target.component} {args.kind}: ok ({what})")
        return 0
    log.warning("%s", message)
    print(f"{target.component} {args.kind}: failed ({what})", file=sys.stderr)
    return 1
