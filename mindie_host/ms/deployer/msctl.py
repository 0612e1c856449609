"""``mindie-host msctl``: the deployer's command-line client (spec §3.4.2, Table 3-7).

=============================================  =============================================
``msctl create infer_server -f infer_server.json``   ``POST /v1/servers``
``msctl get infer_server -n NAME``                    ``GET /v1/servers/NAME``
``msctl delete infer_server -n NAME``                 ``DELETE /v1/servers/NAME``
``msctl update infer_server -f update_server.json``   ``POST /v1/servers/NAME`` (NAME from the file)
=============================================  =============================================

Its config is ``~/.mindie_ms/msctl.json`` (mode at most 0640 unless ``MINDIE_CHECK_INPUTFILES_PERMISSION=0``, as
every ``-f`` file): the deployer's ``dstIP``/``dstPort``, the CA to trust, the client certificate and key (an
encrypted key's password is asked for on the terminal), a CRL, ``timeout`` (1-60 s) and ``log_level``. It prints
the deployer's answer as JSON and exits 0 when its ``status`` is ``"0"``, 1 otherwise.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import ssl
import sys
from pathlib import Path
from typing import Any

import httpx

from ..schema import ConfigError, read_json_file
from .config import MsctlConfig, load_msctl_config, msctl_config_path

log = logging.getLogger("mindie_host.ms.msctl")


def add_msctl_parser(sub: Any) -> None:
    """``msctl`` and its four commands on the main parser's subparsers."""
    p = sub.add_parser("msctl", help="the MS Deployer's client: create/get/delete/update infer_server")
    cmds = p.add_subparsers(dest="msctl_cmd", required=True)
    for name, flag, what in (
        ("create", "-f", "deploy the server described by infer_server.json"),
        ("get", "-n", "show a server's instances and model"),
        ("delete", "-n", "remove a server"),
        ("update", "-f", "rolling update of a server (update_server.json)"),
    ):
        c = cmds.add_parser(name, help=what)
        c.add_argument("resource", choices=["infer_server"])
        if flag == "-f":
            c.add_argument("-f", "--file", required=True, help="the JSON body (mode at most 0640 unless MINDIE_CHECK_INPUTFILES_PERMISSION=0)")
        else:
            c.add_argument("-n", "--name", required=True, help="server_name")


def _context(cfg: MsctlConfig) -> ssl.SSLContext | bool:
    if not cfg.tls.enabled:
        return True
    link = cfg.tls
    paths = {
        k: Path(link.base) / v if v else None
        for k, v in (("ca", link.ca_cert), ("cert", link.tls_cert), ("key", link.tls_key), ("crl", link.tls_crl))
    }
    ctx = ssl.create_default_context(cafile=str(paths["ca"]))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    assert paths["cert"] is not None and paths["key"] is not None
    ctx.load_cert_chain(
        str(paths["cert"]), str(paths["key"]), password=lambda: getpass.getpass(f"password of {paths['key']}: ")
    )
    if paths["crl"] is not None:
        ctx.load_verify_locations(cafile=str(paths["crl"]))
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def _body(path: str) -> Any:
    return read_json_file(path)  # a config file: the mode rule of mindie_host.file_modes


def run_msctl(args: argparse.Namespace) -> int:
    """Send one request and print the answer."""
    try:
        cfg = load_msctl_config(msctl_config_path())
        logging.basicConfig(level=cfg.log_level, format="msctl %(levelname)s %(message)s")
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
        if args.msctl_cmd == "create":
            method, path, body = "POST", "/v1/servers", _body(args.file)
        elif args.msctl_cmd == "update":
            body = _body(args.file)
            name = body.get("server_name") if isinstance(body, dict) else None
            if not isinstance(name, str) or not name or "/" in name:
                raise ConfigError(f"{args.file}: server_name", name, "the name of the server to update")
            method, path = "POST", f"/v1/servers/{name}"
        else:
            method, path, body = ("GET" if args.msctl_cmd == "get" else "DELETE"), f"/v1/servers/{args.name}", None
        verify = _context(cfg)
    except (ConfigError, OSError, ssl.SSLError) as exc:
        print(f"msctl: {exc}", file=sys.stderr)
        return 1
    scheme = "https" if cfg.tls.enabled else "http"
    url = f"{scheme}://{cfg.ip}:{cfg.port}{path}"
    log.debug("%s %s", method, url)
    try:
        with httpx.Client(verify=verify, timeout=cfg.timeout, trust_env=False) as client:
            resp = client.request(method, url, json=body)
    except httpx.HTTPError as exc:
        print(
            f"msctl: cannot reach the deployer at {scheme}://{cfg.ip}:{cfg.port}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    try:
        answer = resp.json()
    except ValueError:
        print(f"msctl: the deployer answered {resp.status_code} without JSON: {resp.text[:200]}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=4))
    return 0 if resp.status_code == 200 and isinstance(answer, dict) and answer.get("status") == "0" else 1
