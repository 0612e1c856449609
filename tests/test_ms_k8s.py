"""deploy/k8s: the manifests are valid Kubernetes objects, their config files load, and every probe targets a
route that the component's real app serves on the port it names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from starlette.routing import Match

from mindie_host.config import config_from_dict
from mindie_host.ms.controller.app import controller_app
from mindie_host.ms.controller.config import controller_config_from_dict
from mindie_host.ms.controller.poller import Controller
from mindie_host.ms.controller.ranktable import parse_topology
from mindie_host.ms.coordinator.app import Coordinator
from mindie_host.ms.coordinator.config import coordinator_config_from_dict

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.25.0"  # the newest version the spec lists (1.18-1.25)


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in documents() if d["kind"] == kind}


def test_every_manifest_validates_against_the_kubernetes_schema():
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_deployments_services_and_configmaps_fit_together():
    deployments, services, maps = by_kind("Deployment"), by_kind("Service"), by_kind("ConfigMap")
    assert set(deployments) == {"mindie-ms-controller", "mindie-ms-coordinator", "mindie-server"}
    for dep in deployments.values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pod = dep["spec"]["template"]["spec"]
        for volume in pod["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps
        named_ports = {p["name"] for c in pod["containers"] for p in c["ports"]}
        selecting = [s for s in services.values() if s["spec"]["selector"].items() <= labels.items()]
        assert selecting, dep["metadata"]["name"]
        for svc in selecting:
            for port in svc["spec"]["ports"]:
                assert port["targetPort"] in named_ports
    assert services["mindie-ms-coordinator"]["spec"]["ports"][0]["nodePort"] == 31015


def config_maps() -> dict[str, dict[str, Any]]:
    out = {}
    for cm in by_kind("ConfigMap").values():
        for key, text in cm["data"].items():
            out[key] = json.loads(text)
    return out


@pytest.fixture(scope="module")
def apps() -> dict[str, tuple[Any, dict[int, str]]]:
    """Each deployment's real app(s), keyed by the container port they listen on."""
    from mindie_host.host import Host
    from mindie_host.server.runner import build_app, plan_listeners

    files = config_maps()
    server_cfg = config_from_dict(files["config.json"])
    host = Host(server_cfg)
    host.plugins.enable_from_config(server_cfg)
    server_apps = {listener.port: build_app(host, listener.planes) for listener in plan_listeners(host)}
    coord_cfg = coordinator_config_from_dict(files["ms_coordinator.json"], environ={})
    coordinator = Coordinator(coord_cfg)
    ctl_cfg = controller_config_from_dict(files["ms_controller.json"], environ={})
    assert parse_topology(files["global_rank_table_file.json"], ctl_cfg).ready is False
    return {
        "mindie-server": server_apps,
        "mindie-ms-coordinator": {coord_cfg.predict_port: coordinator.user_app(),
                                  coord_cfg.manage_port: coordinator.manage_app()},
        "mindie-ms-controller": {ctl_cfg.http_port: controller_app(Controller(ctl_cfg))},
    }


def _serves(app: Any, path: str) -> bool:
    scope = {"type": "http", "path": path, "method": "GET", "root_path": "", "query_string": b"", "headers": []}
    return any(route.matches(scope)[0] == Match.FULL and "{path" not in getattr(route, "path", "")
               for route in app.routes)


def test_every_probe_path_exists_on_its_component(apps):
    probes = 0
    for name, dep in by_kind("Deployment").items():
        for container in dep["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(kind)
                if probe is None:
                    continue
                get = probe["httpGet"]
                port = ports.get(get["port"], get["port"])
                app = apps[name].get(port)
                assert app is not None, f"{name} {kind}: nothing listens on port {get['port']}"
                assert _serves(app, get["path"]), f"{name} {kind}: {get['path']} is not a route on port {port}"
                probes += 1
    assert probes == 8
