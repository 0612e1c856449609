"""``mindie-host probe`` (spec §6.3): a real server, coordinator and controller probed in the server-only mode
(MINDIE_SERVER_PROBE_ONLY) and the MS mode (POD_IP's group in the rank table), over HTTP and over mutual TLS with
an http_client_ctl.json whose client key password is encrypted."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_certs import encrypted_key, pem
from test_tls import issue, make_ca, write_pem

from mindie_host.file_modes import ENV_CHECK, write_file
from mindie_host.keystore import Keystore
from mindie_host.ms.controller.app import serve_controller
from mindie_host.ms.controller.config import default_controller_dict, load_controller_config
from mindie_host.ms.coordinator.app import serve_coordinator
from mindie_host.ms.coordinator.config import default_coordinator_dict, load_coordinator_config
from mindie_host.testing import RunningServer, free_port, server_config
from mindie_host.tools.probe import run

COORDINATOR_IP, CONTROLLER_IP, SERVER_IP = "127.0.0.3", "127.0.0.4", "127.0.0.1"


def probe(kind: str, env: dict[str, str], component: str | None = None, *, inner_error: bool = False) -> int:
    args = argparse.Namespace(kind=kind, component=component, timeout=10.0, retries=0, detect_inner_error=inner_error)
    return run(args, env)


class Background:
    """An MS component's ``serve_*`` coroutine on its own event loop thread."""

    def __init__(self, serve: Callable[..., Coroutine[Any, Any, None]], config: Any) -> None:
        self.loop, self.stop = asyncio.new_event_loop(), asyncio.Event()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(serve(config, self.stop),), daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=30)


def wait_listening(url: str, **kw: Any) -> None:
    for _ in range(200):
        try:
            httpx.get(url, timeout=2, **kw)
            return
        except httpx.ConnectError:
            threading.Event().wait(0.05)
    raise AssertionError(f"{url} never answered")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, tiny_server: RunningServer) -> Iterator[dict[str, Any]]:
    """A server (the suite's shared tiny one, on 127.0.0.1), a coordinator and a controller, each config in a file,
    and the rank table naming them."""
    root = tmp_path_factory.mktemp("probe")
    mp = pytest.MonkeyPatch()
    mp.delenv(ENV_CHECK, raising=False)
    cfg = tiny_server.config.to_dict()
    assert cfg["ServerConfig"]["managementIpAddress"] == SERVER_IP
    write_file(root / "config.json", json.dumps(cfg))
    coord = default_coordinator_dict()
    manage = free_port()
    coord["http_config"].update(predict_port=str(free_port()), manage_ip=COORDINATOR_IP, manage_port=str(manage))
    write_file(root / "ms_coordinator.json", json.dumps(coord))
    table = {
        "version": "1.0",
        "status": "completed",
        "server_group_list": [
            {"group_id": "0", "server_count": "1", "server_list": [{"server_id": "c", "server_ip": COORDINATOR_IP}]},
            {"group_id": "1", "server_count": "1", "server_list": [{"server_id": "m", "server_ip": CONTROLLER_IP}]},
            {
                "group_id": "2",
                "server_count": "1",
                "server_list": [
                    {
                        "server_id": "s",
                        "server_ip": SERVER_IP,
                        "port": cfg["ServerConfig"]["port"],
                        "management_port": cfg["ServerConfig"]["managementPort"],
                        "metric_port": cfg["ServerConfig"]["metricsPort"],
                    }
                ],
            },
        ],
    }
    write_file(root / "global_rank_table.json", json.dumps(table))
    ctl = default_controller_dict()
    ctl["http_server"].update(ip=CONTROLLER_IP, port=free_port())
    ctl["global_rank_table_file_path"] = str(root / "global_rank_table.json")
    ctl["mindie_ms_coordinator_port"] = manage
    for key in ("process_manager", "cluster_status"):
        ctl[key]["file_path"] = str(root / f"{key}.json")
    write_file(root / "ms_controller.json", json.dumps(ctl))
    env = {
        "PATH": os.environ["PATH"],
        "MIES_CONFIG_JSON_PATH": str(root / "config.json"),
        "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH": str(root / "ms_coordinator.json"),
        "MINDIE_MS_CONTROLLER_CONFIG_FILE_PATH": str(root / "ms_controller.json"),
        "GLOBAL_RANK_TABLE_FILE_PATH": str(root / "global_rank_table.json"),
    }
    coordinator = Background(serve_coordinator, load_coordinator_config(str(root / "ms_coordinator.json"), environ={}))
    controller = Background(serve_controller, load_controller_config(str(root / "ms_controller.json"), environ={}))
    try:
        wait_listening(f"http://{COORDINATOR_IP}:{manage}/v1/startup")
        wait_listening(f"http://{CONTROLLER_IP}:{ctl['http_server']['port']}/v1/startup")
        yield {"root": root, "env": env, "server": tiny_server, "manage": manage}
    finally:
        coordinator.close()
        controller.close()
        mp.undo()


def test_server_only_deployment(deployment: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    env = {**deployment["env"], "MINDIE_SERVER_PROBE_ONLY": "1"}
    del env["GLOBAL_RANK_TABLE_FILE_PATH"]
    assert [probe(k, env) for k in ("startup", "liveness", "readiness")] == [0, 0, 0]
    # detect_server_inner_error (the deployer's pods): each probe is a one-token generation, bounded by --timeout
    assert [probe(k, env, inner_error=True) for k in ("startup", "liveness", "readiness")] == [0, 0, 0]
    management = deployment["server"].config.server.managementPort
    assert capsys.readouterr().out.count(f"GET http://127.0.0.1:{management}/health/timed-10 -> 200") == 3
    done = subprocess.run(
        [sys.executable, "-m", "mindie_host.cli", "probe", "readiness"],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0 and "server readiness: ok (GET http://127.0.0.1:" in done.stdout, done.stderr


def test_ms_deployment_finds_each_pod_in_the_rank_table(
    deployment: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    env = deployment["env"]
    for ip in (SERVER_IP, CONTROLLER_IP):
        assert [probe(k, {**env, "POD_IP": ip}) for k in ("startup", "liveness", "readiness")] == [0, 0, 0]
    coordinator = {**env, "POD_IP": COORDINATOR_IP}
    assert [probe(k, coordinator) for k in ("startup", "liveness")] == [0, 0]
    deadline = time.monotonic() + 60
    while probe("readiness", coordinator) != 0:  # ready once the controller has pushed it the server
        assert time.monotonic() < deadline, capsys.readouterr().err
        time.sleep(0.5)
    assert probe("liveness", {**env, "POD_IP": CONTROLLER_IP}, inner_error=True) == 1
    assert "--detect-inner-error runs a generation on a server; the controller has none" in capsys.readouterr().err
    assert probe("readiness", {**env, "POD_IP": "10.9.9.9"}) == 1
    assert "POD_IP 10.9.9.9 is in no group of the rank table" in capsys.readouterr().err
    assert probe("readiness", {k: v for k, v in env.items() if k != "GLOBAL_RANK_TABLE_FILE_PATH"}) == 1
    assert "cannot tell what to probe" in capsys.readouterr().err


def test_a_stopped_component_fails_every_probe(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = server_config(tiny_model)
    write_file(tmp_path / "config.json", json.dumps(cfg))
    env = {"MIES_CONFIG_JSON_PATH": str(tmp_path / "config.json")}
    assert [probe(k, env, "server") for k in ("startup", "liveness", "readiness")] == [1, 1, 1]
    assert "ConnectError" in capsys.readouterr().err


def test_mutual_tls_with_an_encrypted_client_key(
    deployment: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """http_client_ctl.json: the coordinator's management port on mutual TLS; the probe's key under a password
    that only the master key decrypts."""
    monkeypatch.delenv(ENV_CHECK, raising=False)
    ca = make_ca("probe root")
    write_file(tmp_path / "ca.pem", pem(ca.cert), 0o600)
    write_pem(tmp_path, "coordinator", issue(ca, "coordinator", server_ips=(COORDINATOR_IP,)))
    client = issue(ca, "probe client")
    write_file(tmp_path / "client.pem", pem(client.cert), 0o600)
    write_file(tmp_path / "client.key.pem", encrypted_key(client.key, "probe pw"), 0o600)
    kmc = (tmp_path / "ksfa", tmp_path / "ksfb")
    write_file(tmp_path / "client_pwd.txt", Keystore.create(*kmc).encrypt("probe pw"), 0o600)
    coord = default_coordinator_dict()
    manage = free_port()
    coord["http_config"].update(predict_port=str(free_port()), manage_ip=COORDINATOR_IP, manage_port=str(manage))
    coord["tls_config"].update(
        controller_server_tls_enable=True,
        controller_server_tls_items={
            "ca_cert": str(tmp_path / "ca.pem"),
            "tls_cert": str(tmp_path / "coordinator.pem"),
            "tls_key": str(tmp_path / "coordinator.key.pem"),
            "tls_passwd": "",
            "tls_crl": "",
        },
    )
    write_file(tmp_path / "ms_coordinator.json", json.dumps(coord))
    ctl_json = {
        "tls_enable": True,
        "cert": {
            "ca_cert": str(tmp_path / "ca.pem"),
            "tls_cert": str(tmp_path / "client.pem"),
            "tls_key": str(tmp_path / "client.key.pem"),
            "tls_passwd": str(tmp_path / "client_pwd.txt"),
            "kmc_ksf_master": str(kmc[0]),
            "kmc_ksf_standby": str(kmc[1]),
            "tls_crl": "",
        },
        "log_info": {
            "log_level": "INFO",
            "to_file": True,
            "run_log_path": str(tmp_path / "probe.log"),
            "operation_log_path": str(tmp_path / "op.log"),
        },
    }
    ctl_path = write_file(tmp_path / "http_client_ctl.json", json.dumps(ctl_json))
    env = {
        "MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH": str(tmp_path / "ms_coordinator.json"),
        "MINDIE_UTILS_HTTP_CLIENT_CTL_CONFIG_FILE_PATH": str(ctl_path),
    }
    coordinator = Background(
        serve_coordinator, load_coordinator_config(str(tmp_path / "ms_coordinator.json"), environ={})
    )
    try:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        ctx.load_cert_chain(str(tmp_path / "coordinator.pem"), str(tmp_path / "coordinator.key.pem"))
        wait_listening(f"https://{COORDINATOR_IP}:{manage}/v1/startup", verify=ctx)
        assert probe("liveness", env, "coordinator") == 0
        assert "coordinator liveness: ok (GET https://" in capsys.readouterr().out
        assert probe("readiness", env, "coordinator") == 1  # started and alive, but no instance: not ready
        assert f"coordinator readiness: failed (GET https://{COORDINATOR_IP}:{manage}/v1/readiness -> 503)" in (
            capsys.readouterr().err
        )
        assert '"passed": true' in (tmp_path / "probe.log").read_text()  # log_info.to_file
        assert probe("liveness", {**env, "MINDIE_USE_HTTPS": "false"}, "coordinator") == 1  # plain HTTP: refused
        assert probe("liveness", {**env, "MINDIE_USE_HTTPS": "maybe"}, "coordinator") == 1
        assert "allowed true or false" in capsys.readouterr().err
        no_cert = {**ctl_json, "cert": {**ctl_json["cert"], "tls_cert": "", "tls_key": "", "tls_passwd": ""}}
        write_file(ctl_path, json.dumps(no_cert))
        assert probe("liveness", env, "coordinator") == 1  # the server asks for a client certificate
        write_file(ctl_path, json.dumps(ctl_json), 0o644)
        assert probe("liveness", env, "coordinator") == 1
        assert f"probe liveness: {ctl_path}: got 'mode 0644'" in capsys.readouterr().err
        monkeypatch.setenv(ENV_CHECK, "0")
        assert probe("liveness", env, "coordinator") == 0
        monkeypatch.delenv(ENV_CHECK)
        without_file = {k: v for k, v in env.items() if "HTTP_CLIENT" not in k}
        assert probe("liveness", without_file, "coordinator") == 1
        assert "give the probe a CA and a client certificate in http_client_ctl.json" in capsys.readouterr().err
    finally:
        coordinator.close()
