"""The MS Deployer without servers: infer_server.json's rules, the REST API's answers, msctl, TLS with the spec's
client identity, and the Kubernetes target checked against the schema and a recorded API contract.

The Kubernetes target runs the official ``kubernetes`` client against :class:`kube_api_fake.FakeKubeAPI` (its
transport): no cluster was available. Local processes are tested in test_ms_deployer_local.py.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import functools
import json
import os
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import kubernetes_validate
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kube_api_fake import FakeKubeAPI

from mindie_host.config import default_config_dict
from mindie_host.ms.deployer.app import Deployer, serve_deployer
from mindie_host.ms.deployer.config import deployer_config_from_dict, load_deployer_config
from mindie_host.ms.deployer.kube import KubeTarget
from mindie_host.ms.deployer.manifests import manifests
from mindie_host.ms.deployer.spec import SpecError, parse_infer_server
from mindie_host.testing import free_port

K8S_VERSION = "1.25.0"  # the newest version the spec lists (1.18-1.25)

# The spec's single-node sample (§3.4.2 step 4) as printed: no comma after npu_fault_reschedule.
SEED_SAMPLE = """{
   "server_name": "mindie-server",
    "replicas": 1,
    "service_port": 31005,
    "cross_node_num":2,
    "service_type": "NodePort",
    "server_type":"mindie_single_node",
    "scheduler": "default",
    "init_delay": 180,
    "detect_server_inner_error": true,
    "liveness_timeout": 10,
    "liveness_failure_threshold": 1,
    "readiness_timeout": 10,
    "readiness_failure_threshold": 1,
    "resource_requests": {
        "memory":   500000,
        "cpu_core" : 32000,
        "npu_type": "Ascend910",
        "npu_chip_num": 8
    },
    "mindie_server_config": {
        "mies_install_path": "/usr/local/Ascend/mindie/latest/mindie-service",
        "infer_port" : 1025,
        "management_port":1026,
        "enable_tls":true
    },
    "npu_fault_reschedule": true
    "termination_grace_period_seconds": 30,
    "max_unavailable": "50%",
    "max_surge": "50%"
}"""


def body(**changes: Any) -> dict[str, Any]:
    """A valid single-node body (the spec's sample, corrected), with top-level changes."""
    out: dict[str, Any] = {
        "server_name": "mindie-server",
        "replicas": 2,
        "service_port": 31005,
        "service_type": "NodePort",
        "server_type": "mindie_single_node",
        "scheduler": "default",
        "init_delay": 180,
        "detect_server_inner_error": False,
        "liveness_timeout": 10,
        "liveness_failure_threshold": 1,
        "readiness_timeout": 10,
        "readiness_failure_threshold": 1,
        "resource_requests": {"memory": 256000, "cpu_core": 32000, "npu_type": "Ascend910", "npu_chip_num": 1},
        "mindie_server_config": {
            "mies_install_path": "/usr/local/Ascend/mindie/latest/mindie-service",
            "infer_port": 1025,
            "management_port": 1026,
            "enable_tls": False,
        },
        "termination_grace_period_seconds": 30,
        "max_unavailable": "50%",
        "max_surge": "50%",
    }
    out.update(changes)
    return out


def cross_body(**changes: Any) -> dict[str, Any]:
    """A valid multi-node body (Table 3-9: one replica over 2 nodes of 8 NPUs, no rolling-update keys)."""
    cross = {
        "server_type": "mindie_cross_node",
        "replicas": 1,
        "cross_node_num": 2,
        "resource_requests": {"cpu_core": 1000, "npu_type": "Ascend910", "npu_chip_num": 8},
    }
    out = body(**{**cross, **changes})
    for key in ("termination_grace_period_seconds", "max_unavailable", "max_surge"):
        del out[key]
    return out


def test_the_seeds_sample_is_refused_key_by_key():
    with pytest.raises(json.JSONDecodeError):
        json.loads(SEED_SAMPLE)
    sample = json.loads(SEED_SAMPLE.replace('"npu_fault_reschedule": true\n', '"npu_fault_reschedule": true,\n'))
    refusals = []
    for fix in ({}, {"cross_node_num": None}, {"memory": 256000}, {"npu_fault_reschedule": None}):
        for key, value in fix.items():
            if key == "memory":
                sample["resource_requests"]["memory"] = value
            else:
                del sample[key]
        try:
            spec = parse_infer_server(sample)
        except SpecError as exc:
            refusals.append(str(exc).split(":")[0])
    assert refusals == ["cross_node_num", "resource_requests.memory", "npu_fault_reschedule"]
    assert spec.replicas == 1 and spec.rolling_limits() == (1, 0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"server_name": "Mindie_Server"}, "server_name"),
        ({"server_name": "x" * 51}, "server_name"),
        ({"namespace": "-bad"}, "namespace"),
        ({"replicas": 0}, "replicas"),
        ({"replicas": 257}, "replicas"),
        ({"replicas": True}, "replicas"),
        ({"service_port": 29999}, "service_port"),
        ({"service_type": "ClusterIP"}, "service_type"),
        ({"server_type": "mindie"}, "server_type"),
        ({"scheduler": "kube"}, "scheduler"),
        ({"init_delay": 9}, "init_delay"),
        ({"detect_server_inner_error": 1}, "detect_server_inner_error"),
        ({"liveness_timeout": 601}, "liveness_timeout"),
        ({"liveness_failure_threshold": 11}, "liveness_failure_threshold"),
        ({"readiness_timeout": 0}, "readiness_timeout"),
        ({"readiness_failure_threshold": 0}, "readiness_failure_threshold"),
        (
            {"resource_requests": {"cpu_core": 999, "npu_type": "Ascend910", "npu_chip_num": 1}},
            "resource_requests.cpu_core",
        ),
        (
            {"resource_requests": {"cpu_core": 1000, "npu_type": "Ascend310", "npu_chip_num": 1}},
            "resource_requests.npu_type",
        ),
        (
            {"resource_requests": {"cpu_core": 1000, "npu_type": "Ascend910", "npu_chip_num": 9}},
            "resource_requests.npu_chip_num",
        ),
        (
            {"resource_requests": {"cpu_core": 1000, "npu_type": "Ascend910", "npu_chip_num": 1, "gpu": 1}},
            "resource_requests.gpu",
        ),
        (
            {
                "mindie_server_config": {
                    "mies_install_path": "relative",
                    "infer_port": 1025,
                    "management_port": 1026,
                    "enable_tls": False,
                }
            },
            "mindie_server_config.mies_install_path",
        ),
        (
            {
                "mindie_server_config": {
                    "mies_install_path": "/m",
                    "infer_port": 80,
                    "management_port": 1026,
                    "enable_tls": False,
                }
            },
            "mindie_server_config.infer_port",
        ),
        (
            {
                "mindie_server_config": {
                    "mies_install_path": "/m",
                    "infer_port": 1025,
                    "management_port": 1025,
                    "enable_tls": False,
                }
            },
            "mindie_server_config.management_port",
        ),
        (
            {"mindie_server_config": {"mies_install_path": "/m", "infer_port": 1025, "management_port": 1026}},
            "mindie_server_config.enable_tls",
        ),
        ({"npu_fault_reschedule": True}, "npu_fault_reschedule"),
        ({"termination_grace_period_seconds": 3601}, "termination_grace_period_seconds"),
        ({"max_surge": "50"}, "max_surge"),
        ({"max_unavailable": "101%"}, "max_unavailable"),
        ({"max_unavailable": "0%", "max_surge": "0%"}, "max_unavailable/max_surge"),
        ({"cross_node_num": 2}, "cross_node_num"),
        ({"image": "mindie:server"}, "image"),
    ],
)
def test_each_bad_value_is_refused_naming_its_key(change, named):
    with pytest.raises(SpecError) as err:
        parse_infer_server(body(**change))
    assert str(err.value).startswith(named + ":"), str(err.value)


def test_cross_node_bodies_follow_table_3_9():
    rolling = {"termination_grace_period_seconds": 30, "max_unavailable": "50%", "max_surge": "50%"}
    cross = {**cross_body(cross_node_num=4), **rolling}
    for key in ("termination_grace_period_seconds", "max_unavailable", "max_surge"):
        with pytest.raises(SpecError, match=f"^{key}: not supported"):
            parse_infer_server(cross)
        del cross[key]
    spec = parse_infer_server(cross)
    assert spec.cross_node_num == 4 and not spec.single_node
    with pytest.raises(SpecError, match="^replicas:"):
        parse_infer_server({**cross, "replicas": 2})
    with pytest.raises(SpecError, match="^resource_requests.npu_chip_num:"):
        parse_infer_server(
            {**cross, "resource_requests": {"cpu_core": 1000, "npu_type": "Ascend910", "npu_chip_num": 4}}
        )


@pytest.mark.parametrize(
    ("replicas", "surge", "unavailable", "expected"),
    [
        (2, "50%", "50%", (1, 1)),
        (3, "50%", "0%", (2, 0)),  # surge rounds up
        (3, "0%", "50%", (0, 1)),  # unavailability rounds down
        (1, "0%", "50%", (0, 1)),  # floor(0.5) = 0 with no surge: the spec's forced update, one at a time
        (4, "25%", "25%", (1, 1)),
    ],
)
def test_rolling_limits_round_as_a_deployment_does(replicas, surge, unavailable, expected):
    spec = parse_infer_server(body(replicas=replicas, max_surge=surge, max_unavailable=unavailable))
    assert spec.rolling_limits() == expected


# -- the Kubernetes target against a recorded API contract -------------------------------------------------------
def npu_config() -> dict[str, Any]:
    cfg = default_config_dict()
    cfg["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(device="npu", worldSize=2)
    cfg["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    return cfg


def test_every_generated_manifest_validates_against_the_kubernetes_schema():
    variants = [
        (body(), default_config_dict()),
        (
            body(
                detect_server_inner_error=True,
                scheduler="volcano",
                npu_fault_reschedule=False,
                resource_requests={"cpu_core": 8000, "npu_type": "Ascend310P", "npu_chip_num": 2},
            ),
            npu_config(),
        ),
        (
            body(
                mindie_server_config={
                    "mies_install_path": "/opt/mindie/",
                    "infer_port": 2025,
                    "management_port": 2026,
                    "enable_tls": True,
                },
                termination_grace_period_seconds=0,
                max_surge="0%",
                max_unavailable="100%",
            ),
            default_config_dict(),
        ),
    ]
    for spec_body, cfg in variants:
        for obj in manifests(parse_infer_server(spec_body), cfg, "mindie-host:latest"):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@functools.cache
def management_app() -> Any:
    """A real server's management-plane app, built once (a Host is seconds of work): its routes do not depend on
    the rest of the config."""
    from mindie_host.config import config_from_dict
    from mindie_host.host import Host
    from mindie_host.server.runner import build_app

    host = Host(config_from_dict(default_config_dict()))
    host.plugins.enable_from_config(host.config)
    return build_app(host, ("management",))


def served_probe_routes(dep: dict[str, Any], cmap: dict[str, Any], tmp: Path) -> list[tuple[str, str]]:
    """(probe, path) of the Deployment's exec probes, resolved as ``mindie-host probe`` resolves them in the pod (its
    parser, its config lookup on the container's env with the ConfigMap's config.json), each checked to be on the
    container's ``management`` port and a route of a real server's management plane."""
    from test_ms_k8s import _serves, probe_routes

    container = dep["spec"]["template"]["spec"]["containers"][0]
    pod_cfg = json.loads(cmap["data"]["config.json"])
    management = next(p["containerPort"] for p in container["ports"] if p["name"] == "management")
    out = []
    for kind, port, path in probe_routes(container, {"config.json": pod_cfg}, tmp):
        assert port == management and _serves(management_app(), path), (kind, port, path)
        out.append((kind, path))
    return out


def test_npu_requests_probes_and_strategy(tmp_path: Path):
    spec = parse_infer_server(
        body(
            detect_server_inner_error=True,
            scheduler="volcano",
            npu_fault_reschedule=True,
            resource_requests={"cpu_core": 8000, "npu_type": "Ascend910", "npu_chip_num": 2, "memory": 64000},
        )
    )
    cmap, dep, svc = manifests(spec, npu_config(), "img:1")
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "8000m", "memory": "64000Mi", "huawei.com/Ascend910": "2"},
        "limits": {"huawei.com/Ascend910": "2"},
    }
    assert pod["nodeSelector"] == {"accelerator": "huawei-Ascend910"} and pod["schedulerName"] == "volcano"
    assert dep["spec"]["template"]["metadata"]["labels"]["fault-scheduling"] == "grace"
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": "50%", "maxUnavailable": "50%"},
    }
    # exec probes with the probe tool, as deploy/k8s has them: detect_server_inner_error runs a generation
    assert served_probe_routes(dep, cmap, tmp_path) == [
        ("livenessProbe", "/health/timed-10"),
        ("readinessProbe", "/health/timed-10"),
    ]
    assert container["livenessProbe"]["initialDelaySeconds"] == 180
    assert {e["name"]: e.get("value") for e in container["env"]}["OMP_NUM_THREADS"] == "8"
    served = json.loads(cmap["data"]["config.json"])["ServerConfig"]
    assert (served["port"], served["managementPort"], served["shutdownDrainSeconds"]) == (1025, 1026, 23.0)
    assert pod["volumes"][0]["configMap"]["name"] == cmap["metadata"]["name"]
    assert svc["spec"]["ports"][0] == {
        "name": "business",
        "protocol": "TCP",
        "port": 1025,
        "targetPort": "business",
        "nodePort": 31005,
    }
    # the same request for servers on CPU: no NPU is requested, no node is singled out
    cpu = manifests(spec, default_config_dict(), "img:1")[1]["spec"]["template"]["spec"]
    assert "huawei.com/Ascend910" not in cpu["containers"][0]["resources"]["requests"]
    assert "nodeSelector" not in cpu


def test_npu_chip_num_must_match_the_servers_devices():
    from mindie_host.ms.deployer.target import check_against_config
    from mindie_host.ms.tls import TLSLink

    plain = TLSLink("mindie_client", False, Path("."))
    with pytest.raises(SpecError, match="^resource_requests.npu_chip_num: 1, but the servers' config.json uses 2"):
        check_against_config(parse_infer_server(body()), npu_config(), plain)
    tls = parse_infer_server(
        body(
            mindie_server_config={
                "mies_install_path": "/m",
                "infer_port": 1025,
                "management_port": 1026,
                "enable_tls": True,
            }
        )
    )
    with pytest.raises(SpecError, match="^mindie_server_config.enable_tls: true, but the servers' config.json"):
        check_against_config(tls, default_config_dict(), plain)


class RunningDeployer:
    """``serve_deployer`` on its own event loop in a thread; ``url`` is its API."""

    def __init__(self, config: Any, target: Any) -> None:
        self.config, self.target = config, target
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.started = threading.Event()
        self.deployer: Deployer | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.stop_event = asyncio.Event()

        def started(deployer: Deployer) -> None:
            self.deployer = deployer
            self.started.set()

        try:
            await serve_deployer(self.config, self.target, self.stop_event, started=started)
        finally:
            self.started.set()

    def __enter__(self) -> RunningDeployer:
        self.thread.start()
        assert self.started.wait(30) and self.deployer is not None, "the deployer did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.stop_event is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)

    @property
    def url(self) -> str:
        scheme = "https" if self.config.server_tls.enabled else "http"
        return f"{scheme}://{self.config.ip}:{self.config.port}"


def ms_server_json(tmp: Path, **extra: Any) -> dict[str, Any]:
    return {
        "ip": "127.0.0.1",
        "port": free_port(),
        "k8s_apiserver_ip": "10.0.0.1",
        "k8s_apiserver_port": 6443,
        "log_info": {
            "log_level": "INFO",
            "run_log_path": str(tmp / "run.txt"),
            "operation_log_path": str(tmp / "operation.txt"),
        },
        "ms_status_file": str(tmp / "status.json"),
        "server_tls_enable": False,
        "client_k8s_tls_enable": False,
        "client_mindie_server_tls_enable": False,
        **extra,
    }


def kube_target(fake: FakeKubeAPI, server_config: str | None = None) -> KubeTarget:
    conf = kubernetes.client.Configuration()
    conf.host = "https://10.0.0.1:6443"
    api = kubernetes.client.ApiClient(conf)
    api.rest_client.pool_manager = fake
    from mindie_host.ms.tls import TLSLink

    return KubeTarget(api, server_config, TLSLink("mindie_client", False, Path(".")), image="mindie-host:test")


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[tuple[RunningDeployer, FakeKubeAPI, Path]]:
    fake = FakeKubeAPI()
    config = deployer_config_from_dict(ms_server_json(tmp_path), target="kubernetes", environ={})
    with RunningDeployer(config, kube_target(fake)) as running:
        yield running, fake, tmp_path


def routes(fake: FakeKubeAPI) -> list[str]:
    return [call.route for call in fake.calls]


def test_kubernetes_target_follows_the_api_contract(kube):
    running, fake, tmp = kube
    ns = "/api/v1/namespaces/mindie"
    apps = "/apis/apps/v1/namespaces/mindie"
    with httpx.Client(base_url=running.url, timeout=30) as http:
        resp = http.post("/v1/servers", json=body())
        assert (resp.status_code, resp.json()) == (200, {"message": "creating the server!", "status": "0"})
        assert routes(fake) == [f"POST {ns}/configmaps", f"POST {apps}/deployments", f"POST {ns}/services"]
        for call in fake.calls:
            kubernetes_validate.validate(call.body, K8S_VERSION, strict=True)
        assert fake.calls[1].body["spec"]["template"]["spec"]["containers"][0]["image"] == "mindie-host:test"
        assert served_probe_routes(fake.calls[1].body, fake.calls[0].body, tmp) == [
            ("livenessProbe", "/v2/health/live"),
            ("readinessProbe", "/v2/health/ready"),
        ]
        status = json.loads((tmp / "status.json").read_text())
        assert status["server_list"][0] == {
            "namespace": "mindie",
            "replicas": 2,
            "server_name": "mindie-server",
            "server_type": "mindie_single_node",
            "use_service": True,
            "infer_server": body(),
        }

        fake.clear()
        got = http.get("/v1/servers/mindie-server").json()
        assert routes(fake) == [f"GET {apps}/deployments/mindie-server", f"GET {ns}/pods"]
        assert fake.calls[1].query == {
            "labelSelector": "app=mindie-server,app.kubernetes.io/managed-by=mindie-host-deployer"
        }
        assert got["message"] == "success" and got["status"] == "0" and got["data"]["server_name"] == "mindie-server"
        first_pods = [i["pod_name"] for i in got["data"]["instances_status"]]
        assert len(first_pods) == 2 and all(i["liveness"] and i["readiness"] for i in got["data"]["instances_status"])
        assert got["data"]["model_info"] == {}  # the pods' IP answers nothing on management_port here

        fake.clear()
        resp = http.post("/v1/servers/mindie-server", json={"server_name": "mindie-server"})
        assert (resp.status_code, resp.json()) == (200, {"message": "update server success.", "status": "0"})
        assert routes(fake) == [
            f"GET {apps}/deployments/mindie-server",
            f"POST {ns}/configmaps",
            f"PATCH {apps}/deployments/mindie-server",
            f"GET {ns}/configmaps",
        ]
        patch = fake.calls[2].body["spec"]["template"]
        assert "deployer.mindie-host.io/restarted-at" in patch["metadata"]["annotations"]
        assert patch["spec"]["volumes"][0]["configMap"]["name"] == fake.calls[1].body["metadata"]["name"]
        new_pods = [i["pod_name"] for i in http.get("/v1/servers/mindie-server").json()["data"]["instances_status"]]
        assert len(new_pods) == 2 and not set(new_pods) & set(first_pods)  # the template changed: new pods

        fake.clear()
        resp = http.delete("/v1/servers/mindie-server")
        assert (resp.status_code, resp.json()) == (200, {"message": "succeed to clear resources", "status": "0"})
        assert routes(fake) == [
            f"DELETE {ns}/services/mindie-server",
            f"DELETE {apps}/deployments/mindie-server",
            f"DELETE {ns}/configmaps",
        ]
        assert fake.objects == {}
        assert json.loads((tmp / "status.json").read_text()) == {"server_list": []}


def test_the_fakes_delete_answers_are_what_the_client_expects():
    """The fake answers each DELETE the deployer makes as the API server does, in the shape the installed
    client's own models take (kubernetes 37's pydantic models refuse a ``Status`` for a Service)."""
    target = kube_target(FakeKubeAPI())
    core, apps = target.core, target.apps
    meta = {"name": "x", "labels": {"app": "x"}}
    core.create_namespaced_service("ns", {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {}})
    core.create_namespaced_config_map("ns", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta})
    pod = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta}
    apps.create_namespaced_deployment("ns", {**dep, "spec": {"replicas": 1, "selector": {}, "template": pod}})
    service = core.delete_namespaced_service("x", "ns")
    assert isinstance(service, kubernetes.client.V1Service) and service.metadata.name == "x"
    for answer in (apps.delete_namespaced_deployment("x", "ns"), core.delete_namespaced_config_map("x", "ns")):
        status = answer if isinstance(answer, dict) else answer.to_dict()  # 37 types these "object", 35 V1Status
        assert status["status"] == "Success"
    assert core.delete_collection_namespaced_config_map("ns", label_selector="app=x") is not None
    asyncio.run(target.close())


def test_an_update_with_a_changed_config_rolls_a_new_config_map(tmp_path: Path):
    fake = FakeKubeAPI()
    server_cfg = tmp_path / "config.json"
    server_cfg.write_text(json.dumps(default_config_dict()))
    config = deployer_config_from_dict(ms_server_json(tmp_path), target="kubernetes", environ={})
    with (
        RunningDeployer(config, kube_target(fake, str(server_cfg))) as running,
        httpx.Client(base_url=running.url, timeout=30) as http,
    ):
        assert http.post("/v1/servers", json=body()).status_code == 200
        first_map = next(iter(fake.of_kind("configmaps")))
        for n in range(3):  # three updates, each with its own config: two ConfigMaps stay (current and previous)
            cfg = default_config_dict()
            cfg["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = 100 + n
            server_cfg.write_text(json.dumps(cfg))
            assert http.post("/v1/servers/mindie-server", json={"server_name": "mindie-server"}).status_code == 200
        maps = fake.of_kind("configmaps")
        assert first_map not in maps and len(maps) == 2
        dep = fake.of_kind("deployments")["mindie-server"]
        current = dep["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
        assert (
            json.loads(maps[current]["data"]["config.json"])["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == 102
        )
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_rest_api_refusals(kube):
    running, fake, _ = kube
    with httpx.Client(base_url=running.url, timeout=30) as http:

        def refused(method: str, path: str, status: int, **kw: Any) -> str:
            resp = http.request(method, path, **kw)
            assert resp.status_code == status, resp.text
            assert resp.json()["status"] == "1"
            return resp.json()["message"]

        assert refused("POST", "/v1/servers", 400, content=b"{nope").startswith("the body is not valid JSON")
        assert refused("POST", "/v1/servers", 400, content=b"[" * 50000 + b"]" * 50000).startswith("the body is")
        assert refused("POST", "/v1/servers", 400, json=body(replicas=0)).startswith(
            "replicas: must be an integer in [1, 256]"
        )
        assert refused("POST", "/v1/servers", 400, json=body(max_surge=None)).startswith("max_surge: must be a")
        cross = cross_body()
        assert refused("POST", "/v1/servers", 400, json=cross).startswith("server_type: 'mindie_cross_node' is not")
        assert refused("GET", "/v1/servers/nothing-here", 404) == "server 'nothing-here' not found"
        assert refused("GET", "/v1/servers/Bad_Name", 400).startswith("server_name: must be a name")
        assert refused("PUT", "/v1/servers/x", 405).startswith("PUT is not allowed")
        assert refused("GET", "/v2/servers", 404) == "no such path: /v2/servers"
        assert fake.calls == []
        assert http.post("/v1/servers", json=body()).status_code == 200
        assert refused("POST", "/v1/servers", 400, json=body(server_name="other")).startswith(
            "server_name: server 'mindie-server' is deployed"
        )
        assert refused("POST", "/v1/servers/mindie-server", 400, json={"server_name": "other"}).startswith(
            "server_name: 'other' does not match"
        )
        assert refused("POST", "/v1/servers/mindie-server", 400, json={"name": "x"}).startswith("name: unknown key")
    ops = Path(running.config.operation_log_path).read_text().splitlines()
    assert any("POST /v1/servers -> 200" in line for line in ops) and any("-> 405" in line for line in ops)


def test_a_restarted_deployer_takes_its_servers_back(tmp_path: Path):
    fake = FakeKubeAPI()
    config = deployer_config_from_dict(ms_server_json(tmp_path), target="kubernetes", environ={})
    with RunningDeployer(config, kube_target(fake)) as running:
        assert httpx.post(f"{running.url}/v1/servers", json=body()).status_code == 200
    with RunningDeployer(config, kube_target(fake)) as running:
        got = httpx.get(f"{running.url}/v1/servers/mindie-server")
        assert got.status_code == 200 and len(got.json()["data"]["instances_status"]) == 2
    fake.objects.clear()  # someone deleted it behind the deployer's back: dropped at the next start
    with RunningDeployer(config, kube_target(fake)) as running:
        assert httpx.get(f"{running.url}/v1/servers/mindie-server").status_code == 404
    assert json.loads((tmp_path / "status.json").read_text()) == {"server_list": []}


# -- ms_server.json, msctl.json and TLS ---------------------------------------------------------------------------
def test_ms_server_json_rules(tmp_path: Path):
    path = tmp_path / "ms_server.json"
    path.write_text(json.dumps(ms_server_json(tmp_path)))
    path.chmod(0o644)
    with pytest.raises(Exception, match=r"got 'mode 0644'; allowed a config file with mode at most 0640"):
        load_deployer_config(str(path))
    # the one file-mode rule (mindie_host.file_modes), with its switch
    assert load_deployer_config(str(path), environ={"MINDIE_CHECK_INPUTFILES_PERMISSION": "0"}).ip == "127.0.0.1"
    path.chmod(0o600)
    local = load_deployer_config(str(path), environ={"MINDIE_MS_SERVER_IP": "127.0.0.2"})
    assert local.ip == "127.0.0.2" and local.k8s_tls is None
    assert any("no effect with the local target" in w for w in local.warnings)
    assert load_deployer_config(str(path), target="kubernetes").k8s_port == 6443
    for change, key in (
        ({"port": 80}, "port"),
        ({"ip": "::1"}, "ip"),
        ({"server_tls_enable": False, "ip": "10.1.1.1"}, "server_tls_enable"),
        ({"log_info": {"log_level": "LOUD", "run_log_path": "a", "operation_log_path": "b"}}, "log_info.log_level"),
        ({"client_mindie_server_tls_enable": True}, "client_mindie_tls_items"),
    ):
        with pytest.raises(Exception, match=f"^{key}"):
            deployer_config_from_dict(ms_server_json(tmp_path, **change), environ={})
    no_tls_flag = {k: v for k, v in ms_server_json(tmp_path).items() if k != "server_tls_enable"}
    with pytest.raises(Exception, match="^server_tls_items"):  # the spec's default: HTTPS, its items required
        deployer_config_from_dict(no_tls_flag, environ={})


NOW = dt.datetime.now(dt.timezone.utc)


def _cert(
    cn: str, org: str | None, issuer: tuple[x509.Name, Any] | None, ip: str | None = None, ca: bool = False
) -> tuple[x509.Certificate, Any]:
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    name = x509.Name(attrs)
    issuer_name, issuer_key = issuer or (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip:
        import ipaddress

        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256()), key


def _write(directory: Path, name: str, cert: x509.Certificate, key: Any) -> None:
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (directory / f"{name}.key.pem").chmod(0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root, an intermediate CA (CN mindiems, O msgroup), the deployer's certificate and two client certificates."""
    root = tmp_path_factory.mktemp("deployer-pki")
    ca_cert, ca_key = _cert("kubernetes", None, None, ca=True)
    mid_cert, mid_key = _cert("mindiems", "msgroup", (ca_cert.subject, ca_key), ca=True)
    (root / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server, server_key = _cert("msserver", "msgroup", (mid_cert.subject, mid_key), ip="127.0.0.1")
    _write(root, "msserver", server, server_key)
    for name, cn in (("msclientuser", "msclientuser"), ("stranger", "someone")):
        cert, key = _cert(cn, "msgroup", (mid_cert.subject, mid_key))
        _write(root, name, cert, key)
    for name in ("msserver", "msclientuser", "stranger"):  # each chain carries the intermediate
        with open(root / f"{name}.pem", "ab") as fh:
            fh.write(mid_cert.public_bytes(serialization.Encoding.PEM))
    return root


def msctl(home: Path, *args: str, cwd: Path, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), **environ}
    return subprocess.run(
        [sys.executable, "-m", "mindie_host.cli", "msctl", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
    )


def test_msctl_over_tls_with_the_specs_client_identity(tmp_path: Path, pki: Path):
    items = {
        "ca_cert": str(pki / "ca.pem"),
        "tls_cert": str(pki / "msserver.pem"),
        "tls_key": str(pki / "msserver.key.pem"),
        "tls_passwd": "",
        "kmcKsfMaster": "",
        "kmcKsfStandby": "",
        "tls_crl": "",
    }
    cfg = ms_server_json(tmp_path, server_tls_items=items)
    del cfg["server_tls_enable"]
    config = deployer_config_from_dict(cfg, target="kubernetes", environ={})
    home = tmp_path / "home"
    (home / ".mindie_ms").mkdir(parents=True)
    msctl_json = home / ".mindie_ms" / "msctl.json"
    msctl_json.write_text(
        json.dumps(
            {
                "http": {
                    "dstPort": config.port,
                    "dstIP": "127.0.0.1",
                    "ca_cert": "ca.pem",
                    "tls_cert": "msclientuser.pem",
                    "tls_key": "msclientuser.key.pem",
                    "tls_crl": "",
                    "timeout": 60,
                },
                "log_level": "INFO",
            }
        )
    )
    msctl_json.chmod(0o640)
    request = tmp_path / "infer_server.json"
    request.write_text(json.dumps(body()))
    request.chmod(0o644)
    update = tmp_path / "update_server.json"
    update.write_text(json.dumps({"server_name": "mindie-server"}))
    update.chmod(0o600)
    fake = FakeKubeAPI()
    with RunningDeployer(config, kube_target(fake)):
        out = msctl(home, "create", "infer_server", "-f", str(request), cwd=pki)
        assert out.returncode == 1 and "got 'mode 0644'; allowed a config file with mode at most 0640" in out.stderr
        assert fake.calls == []
        request.chmod(0o640)
        out = msctl(home, "create", "infer_server", "-f", str(request), cwd=pki)
        assert (out.returncode, json.loads(out.stdout)) == (0, {"message": "creating the server!", "status": "0"})
        out = msctl(home, "get", "infer_server", "-n", "mindie-server", cwd=pki)
        assert out.returncode == 0 and json.loads(out.stdout)["data"]["server_name"] == "mindie-server"
        out = msctl(home, "update", "infer_server", "-f", str(update), cwd=pki)
        assert (out.returncode, json.loads(out.stdout)["message"]) == (0, "update server success.")
        out = msctl(home, "get", "infer_server", "-n", "other", cwd=pki)
        assert out.returncode == 1 and json.loads(out.stdout) == {"message": "server 'other' not found", "status": "1"}
        out = msctl(home, "delete", "infer_server", "-n", "mindie-server", cwd=pki)
        assert (out.returncode, json.loads(out.stdout)["message"]) == (0, "succeed to clear resources")

        url = f"https://127.0.0.1:{config.port}/v1/servers/mindie-server"
        stranger = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        stranger.load_cert_chain(str(pki / "stranger.pem"), str(pki / "stranger.key.pem"))
        resp = httpx.get(url, verify=stranger)
        assert resp.status_code == 403 and "CN=msclientuser, O=msgroup" in resp.json()["message"]
        anonymous = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
            httpx.get(url, verify=anonymous)
        msctl_json.chmod(0o644)
        out = msctl(home, "get", "infer_server", "-n", "mindie-server", cwd=pki)
        assert out.returncode == 1 and f"{msctl_json}: got 'mode 0644'" in out.stderr
        out = msctl(home, "get", "infer_server", "-n", "other", cwd=pki, MINDIE_CHECK_INPUTFILES_PERMISSION="0")
        assert out.returncode == 1 and json.loads(out.stdout)["message"] == "server 'other' not found"


def test_deployer_command_refuses_a_bad_config_with_one_line(tmp_path: Path):
    path = tmp_path / "ms_server.json"
    cfg = copy.deepcopy(ms_server_json(tmp_path))
    cfg["port"] = 99999
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    out = subprocess.run(
        [sys.executable, "-m", "mindie_host.cli", "deployer", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "mindie-host deployer: port: got 99999; allowed an integer in [1024, 65535]"


# -- hostile input and the local target's own refusals -------------------------------------------------------------
def test_hostile_bodies_get_a_4xx_that_names_the_problem(kube):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_fuzz import HOSTILE, RAW, json_values

    running, fake, _ = kube
    keys = sorted(body()) + ["namespace", "cross_node_num", "npu_fault_reschedule", "image", ""]
    nested = {
        "resource_requests": ["memory", "cpu_core", "npu_type", "npu_chip_num", "gpu"],
        "mindie_server_config": ["mies_install_path", "infer_port", "management_port", "enable_tls", "x"],
    }

    @st.composite
    def mutated(draw: st.DrawFn) -> Any:
        out = body()
        for _ in range(draw(st.integers(1, 3))):
            key = draw(st.sampled_from(keys))
            if key in nested and draw(st.booleans()):
                out[key] = dict(out[key]) if isinstance(out[key], dict) else {}
                out[key][draw(st.sampled_from(nested[key]))] = draw(HOSTILE)
            elif draw(st.integers(0, 4)) == 0:
                out.pop(key, None)
            else:
                out[key] = draw(HOSTILE)
        return out

    client = httpx.Client(base_url=running.url, timeout=30)

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        payload=st.one_of(mutated(), mutated(), json_values),
        raw=RAW,
        use_raw=st.integers(0, 5),
        name=st.sampled_from(["mindie-server", "x" * 300, "A", "-", "%2e%2e"]),
    )
    def run(payload: Any, raw: bytes, use_raw: int, name: str) -> None:
        content = raw if use_raw == 0 else json.dumps(payload, ensure_ascii=False).encode()
        for method, path in (("POST", "/v1/servers"), ("POST", f"/v1/servers/{name}"), ("GET", f"/v1/servers/{name}")):
            resp = client.request(method, path, content=content if method == "POST" else None)
            assert resp.status_code in (200, 400, 404), (method, path, payload, resp.text)
            answer = resp.json()
            assert answer["status"] == ("0" if resp.status_code == 200 else "1") and answer["message"]
            if method == "POST" and path == "/v1/servers" and resp.status_code == 200:  # a valid one: clear it again
                assert client.delete(f"/v1/servers/{payload['server_name']}").status_code == 200

    try:
        run()
    finally:
        client.close()
    assert httpx.get(f"{running.url}/v1/servers/none").status_code == 404  # still serving


def test_local_target_refuses_what_it_cannot_run(tmp_path: Path):
    import socket

    from mindie_host.ms.deployer.local import LocalTarget
    from mindie_host.ms.tls import TLSLink

    target = LocalTarget(tmp_path / "work", None, TLSLink("mindie_client", False, tmp_path))
    here = {"mies_install_path": str(tmp_path), "infer_port": 1025, "management_port": 1026, "enable_tls": False}
    with pytest.raises(SpecError, match="^scheduler: 'volcano' is a Kubernetes scheduler"):
        target.check(parse_infer_server(body(scheduler="volcano", mindie_server_config=here)))
    with pytest.raises(SpecError, match="^mindie_server_config.mies_install_path: .* is not a directory"):
        target.check(parse_infer_server(body(mindie_server_config={**here, "mies_install_path": "/no/such/dir"})))
    cross = cross_body(mindie_server_config=here)
    with pytest.raises(SpecError, match="^server_type: 'mindie_cross_node' needs the kubernetes target"):
        target.check(parse_infer_server(cross))
    with socket.socket() as busy:  # a service_port something else holds
        for port in range(30000 + free_port() % 2000, 32767):
            try:
                busy.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        busy.listen()
        with pytest.raises(SpecError, match=f"^service_port: 127.0.0.1:{port} is in use"):
            target.check(parse_infer_server(body(service_port=port, mindie_server_config=here)))
    target.check(parse_infer_server(body(service_port=port, mindie_server_config=here)))


def test_local_target_with_tls_wires_every_link(tmp_path: Path, pki: Path):
    """enable_tls: the coordinator and controller reach the servers with client_mindie_tls_items, and the user
    port serves the servers' own certificate (the configs load and their TLS contexts build)."""
    from mindie_host.ms.controller.config import load_controller_config
    from mindie_host.ms.coordinator.app import Coordinator
    from mindie_host.ms.coordinator.config import load_coordinator_config
    from mindie_host.ms.deployer.local import LocalTarget
    from mindie_host.ms.tls import TLSLink

    server_cfg = default_config_dict()
    server_cfg["ServerConfig"].update(
        httpsEnabled=True,
        tlsCaPath=".",
        tlsCaFile=["ca.pem"],
        tlsCert="msserver.pem",
        tlsPk="msserver.key.pem",
        tlsPkPwd="",
    )
    client = TLSLink(
        "mindie_client", True, pki, ca_cert="ca.pem", tls_cert="msclientuser.pem", tls_key="msclientuser.key.pem"
    )
    target = LocalTarget(tmp_path / "work", None, client)
    spec = parse_infer_server(
        body(
            mindie_server_config={
                "mies_install_path": str(pki),
                "infer_port": 1025,
                "management_port": 1026,
                "enable_tls": True,
            }
        )
    )
    cluster = target._cluster(spec, server_cfg)
    cluster.write_configs()
    coord = load_coordinator_config(str(cluster.workdir / "ms_coordinator.json"), environ={})
    assert all(coord.tls[link].enabled for link in ("mindie_client", "mindie_mangment", "request_server"))
    assert coord.tls["request_server"].tls_cert == str(pki / "msserver.pem")
    assert coord.tls["mindie_client"].tls_cert == str(pki / "msclientuser.pem")
    assert coord.tls["request_server"].server_context() is not None
    assert (coord.predict_ip, coord.predict_port) == ("127.0.0.1", 31005)
    Coordinator(coord)  # builds its HTTPS clients to the servers from those files
    ctl = load_controller_config(str(cluster.workdir / "ms_controller.json"), environ={})
    assert ctl.tls["request_server"].enabled and isinstance(ctl.tls["request_server"].client_context(), ssl.SSLContext)
    assert all(s["scheme"] == "https" for s in cluster.servers)


def test_kubernetes_client_takes_the_api_servers_tls_items(tmp_path: Path, pki: Path, caplog: pytest.LogCaptureFixture):
    """Every link of ms_server.json reads tls_passwd as the coordinator and the controller do: a token encrypted under
    the kmcKsfMaster/kmcKsfStandby keystore, or plain text with a warning."""
    from kubernetes.client import ApiClient

    from mindie_host.keystore import Keystore
    from mindie_host.ms.deployer.kube import api_client

    key = serialization.load_pem_private_key((pki / "msclientuser.key.pem").read_bytes(), None)
    (tmp_path / "kube.key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"s3cret"),
        )
    )
    (tmp_path / "kube.key.pem").chmod(0o600)
    store = Keystore.create(tmp_path / "ksfa", tmp_path / "ksfb")
    (tmp_path / "pwd.txt").write_text(store.encrypt("s3cret") + "\n")
    (tmp_path / "pwd.txt").chmod(0o600)
    items = {
        "ca_cert": str(pki / "ca.pem"),
        "tls_cert": str(pki / "msclientuser.pem"),
        "tls_key": str(tmp_path / "kube.key.pem"),
        "tls_passwd": str(tmp_path / "pwd.txt"),
        "kmcKsfMaster": str(tmp_path / "ksfa"),
        "kmcKsfStandby": str(tmp_path / "ksfb"),
        "tls_crl": "",
    }
    config = deployer_config_from_dict(
        ms_server_json(
            tmp_path,
            client_k8s_tls_enable=True,
            client_k8s_tls_items=items,
            client_mindie_server_tls_enable=True,
            client_mindie_tls_items=items,
            server_tls_enable=True,
            server_tls_items=items,
        ),
        target="kubernetes",
        environ={},
    )
    api = api_client(config)
    assert isinstance(api, ApiClient)
    conf = api.configuration
    assert (conf.host, conf.ssl_ca_cert, conf.cert_file) == (
        "https://10.0.0.1:6443",
        items["ca_cert"],
        items["tls_cert"],
    )
    # urllib3 cannot take a key password: the key is handed over decrypted, in a private file
    assert conf.key_file != items["tls_key"] and os.stat(conf.key_file).st_mode & 0o077 == 0
    assert serialization.load_pem_private_key(Path(conf.key_file).read_bytes(), None).public_key() == key.public_key()
    api.close()
    # the calls to the servers and the deployer's own HTTPS listener load the same key with the decrypted password
    assert isinstance(config.mindie_tls.client_context(), ssl.SSLContext)
    assert isinstance(config.server_tls.server_context(), ssl.SSLContext)
    assert not [r for r in caplog.records if "plain text" in r.getMessage()]
    (tmp_path / "pwd.txt").write_text("s3cret\n")  # plain text: still read, with the warning
    assert config.k8s_tls is not None and config.k8s_tls.password() == "s3cret"
    assert any(f"{tmp_path / 'pwd.txt'} holds a secret in plain text" in r.getMessage() for r in caplog.records)
