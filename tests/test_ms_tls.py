"""The coordinator with TLS on all four links: its user and management ports, and towards a real HTTPS server's
business and metrics ports (mutual TLS everywhere, certificates made with ``cryptography``)."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from test_tls import issue, make_ca, write_pem

from mindie_host.ms.coordinator.app import serve_coordinator
from mindie_host.ms.coordinator.config import coordinator_config_from_dict, default_coordinator_dict
from mindie_host.ms.coordinator.instances import instance_id
from mindie_host.testing import RunningServer, free_port, server_config


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ms-tls")
    ca = make_ca("ms test root")
    (root / "ca.pem").write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    write_pem(root, "server", issue(ca, "server", server_ips=("127.0.0.1",)))
    write_pem(root, "coordinator", issue(ca, "coordinator", server_ips=("127.0.0.1",)))
    write_pem(root, "client", issue(ca, "client"))
    return root


def items(root: Path, name: str) -> dict[str, str]:
    return {"ca_cert": str(root / "ca.pem"), "tls_cert": str(root / f"{name}.pem"),
            "tls_key": str(root / f"{name}.key.pem"), "tls_passwd": "", "kmcKsfMaster": "", "kmcKsfStandby": "",
            "tls_crl": ""}


def client(root: Path, name: str | None = "client") -> httpx.Client:
    ctx = ssl.create_default_context(cafile=str(root / "ca.pem"))
    if name:
        ctx.load_cert_chain(str(root / f"{name}.pem"), str(root / f"{name}.key.pem"))
    return httpx.Client(verify=ctx, timeout=60)


def test_coordinator_tls_on_every_link(tiny_model: Path, certs: Path) -> None:
    server_cfg = server_config(tiny_model, server={
        "httpsEnabled": True, "tlsCaPath": str(certs), "tlsCaFile": ["ca.pem"], "tlsCert": str(certs / "server.pem"),
        "tlsPk": str(certs / "server.key.pem"), "tlsPkPwd": "", "tlsCrlPath": str(certs), "tlsCrlFiles": ["none.pem"]})
    cfg = default_coordinator_dict()
    predict, manage = free_port(), free_port()
    cfg["http_config"].update(predict_port=str(predict), manage_port=str(manage))
    cfg["tls_config"] = {}
    for link, name in (("controller_server", "coordinator"), ("request_server", "coordinator"),
                       ("mindie_client", "client"), ("mindie_mangment", "client")):
        cfg["tls_config"][f"{link}_tls_enable"] = True
        cfg["tls_config"][f"{link}_tls_items"] = items(certs, name)
    config = coordinator_config_from_dict(cfg, environ={})
    with RunningServer(server_cfg) as server:
        s = server.config.server
        loop = asyncio.new_event_loop()
        stop = asyncio.Event()
        thread = threading.Thread(target=loop.run_until_complete, args=(serve_coordinator(config, stop),),
                                  daemon=True)
        thread.start()
        try:
            with client(certs) as c:
                for _ in range(100):
                    try:
                        c.get(f"https://127.0.0.1:{manage}/v1/startup")
                        break
                    except httpx.ConnectError:
                        threading.Event().wait(0.1)
                iid = instance_id("127.0.0.1", s.port)
                refresh = {"ids": [iid], "instances": [{
                    "id": iid, "ip": "127.0.0.1", "port": s.port, "metric_port": s.metricsPort, "model_name": "tiny",
                    "static_info": {"group_id": 0, "max_seq_len": 1024, "max_output_len": 512, "total_slots_num": 32,
                                    "total_block_num": 100, "block_size": 16},
                    "dynamic_info": {"avail_slots_num": 32, "avail_block_num": 100}}]}
                assert c.post(f"https://127.0.0.1:{manage}/v1/instances/refresh", json=refresh).status_code == 200
                body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
                via = c.post(f"https://127.0.0.1:{predict}/generate", json=body)
                direct = c.post(f"{server.url}/generate", json=body)
                assert via.status_code == 200 and via.json() == direct.json()
                metrics = c.get(f"https://127.0.0.1:{manage}/metrics")
                assert metrics.status_code == 200 and 'request_success_total{model_name="tiny"}' in metrics.text
            with client(certs, None) as anonymous, pytest.raises((httpx.ReadError, httpx.ConnectError,
                                                                   httpx.RemoteProtocolError)):
                anonymous.post(f"https://127.0.0.1:{predict}/generate", json=body)  # no client certificate
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{manage}/v1/startup", timeout=5)  # plain HTTP is not served
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(timeout=30)
    assert json.loads(via.text)
