"""deploy/k8s: the manifests are valid Kubernetes objects, their config files load, and every probe targets a
route that the component's real app serves on the port it names."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from starlette.routing import Match

from mindie_host.config import config_from_dict
from mindie_host.ms.controller.app import controller_app
from mindie_host.ms.controller.config import controller_config_from_dict, default_controller_dict
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


def probe_routes(container: dict[str, Any], maps: dict[str, Any], tmp: Path) -> list[tuple[str, int, str]]:
    """(probe, port, path) of each exec probe of a container, resolved as ``mindie-host probe`` resolves them: its
    real argument parser, and its real config lookup on the container's env with the ConfigMap files."""
    from mindie_host.cli import parser
    from mindie_host.file_modes import write_file
    from mindie_host.tools.probe import probe_path, target_of

    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    for name, value in list(env.items()):
        if value.endswith(".json"):  # the config file the process reads: the ConfigMap's, as mounted
            env[name] = str(write_file(tmp / Path(value).name, json.dumps(maps[Path(value).name])))
    out = []
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(kind)
        if probe is None:
            continue
        command = probe["exec"]["command"]
        assert command[:2] == ["mindie-host", "probe"] and probe["timeoutSeconds"] >= 5, (kind, probe)
        args = parser().parse_args(command[1:])
        assert args.timeout < probe["timeoutSeconds"]  # the probe reports before the kubelet gives up on it
        target = target_of(args.component, env)
        path = probe_path(args.component, args.kind, timeout=args.timeout, inner_error=args.detect_inner_error)
        out.append((kind, target.port, path))
    return out


def test_every_probe_path_exists_on_its_component(apps, tmp_path):
    probes = 0
    maps = config_maps()
    for name, dep in by_kind("Deployment").items():
        for container in dep["spec"]["template"]["spec"]["containers"]:
            for kind, port, path in probe_routes(container, maps, tmp_path):
                app = apps[name].get(port)
                assert app is not None, f"{name} {kind}: nothing listens on port {port}"
                assert port in {p["containerPort"] for p in container["ports"]}
                assert _serves(app, path), f"{name} {kind}: {path} is not a route on port {port}"
                probes += 1
    assert probes == 8


# -- PD disaggregation and its heterogeneous form (spec §3.6) ------------------------------------------------------
PD = K8S / "pd"


def pd_documents(*folders: Path) -> list[dict[str, Any]]:
    docs = []
    for folder in folders:
        for path in sorted(folder.glob("*.yaml")):
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_pd_manifests_validate_and_their_configs_load():
    docs = pd_documents(PD, PD / "heterogeneous")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    maps = {d["metadata"]["name"]: d["data"] for d in pd_documents(PD) if d["kind"] == "ConfigMap"}
    server = config_from_dict(json.loads(maps["mindie-server-config"]["config.json"]))
    assert server.server.inferMode == "dmi" and not server.server.interCommTLSEnabled
    assert server.BackendConfig.npuDeviceIds == [[0]]
    coord = coordinator_config_from_dict(json.loads(maps["mindie-ms-coordinator-config"]["ms_coordinator.json"]),
                                         environ={})
    assert (coord.deploy_mode, coord.scheduler_type, coord.algorithm_type) == ("pd_separate", "digs_scheduler",
                                                                              "load_balance")
    ctl = controller_config_from_dict(json.loads(maps["mindie-ms-controller-config"]["ms_controller.json"]),
                                      environ={})
    assert ctl.deploy_mode == "pd_separate" and not ctl.is_heterogeneous
    (hetero,) = [d for d in pd_documents(PD / "heterogeneous") if d["kind"] == "ConfigMap"]
    assert hetero["metadata"]["name"] == "mindie-ms-controller-config"  # replaces the homogeneous one when applied
    assert controller_config_from_dict(json.loads(hetero["data"]["ms_controller.json"]), environ={}).is_heterogeneous
    # every P/D pod asks for one NPU, as many as its config's devices, and exposes the P-to-D port
    pd_server = next(d for d in pd_documents(PD) if d["kind"] == "Deployment")
    container = pd_server["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"huawei.com/Ascend910": "1"}
    assert {"name": "intercomm", "containerPort": server.server.interCommPort} in container["ports"]


def test_heterogeneous_servers_split_p_and_d_by_node_label():
    from mindie_host.ms.controller.roles import HARDWARE_ROLES

    deployments = {d["metadata"]["name"]: d for d in pd_documents(PD / "heterogeneous") if d["kind"] == "Deployment"}
    assert set(deployments) == {"mindie-server", "mindie-server-heterogeneous"}
    roles, selectors = {}, []
    for dep in deployments.values():
        template = dep["spec"]["template"]
        selector = dep["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items()
        selectors.append(selector)
        label = template["spec"]["nodeSelector"]["hardware-type"]
        assert " " not in label and label == selector["hardware-type"]
        roles[label] = HARDWARE_ROLES[template["metadata"]["annotations"]["mindie-host.io/hardware-type"]]
    assert roles == {"800IA2-32G": "prefill", "800IA2-64G": "decode"}
    assert selectors[0] != selectors[1]  # two Deployments never claim each other's pods


def test_gen_ranktable_writes_what_the_controller_reads(tmp_path):
    """gen_ranktable.sh against a stand-in kubectl that lists pods and keeps what ``apply`` receives."""
    kubectl = tmp_path / "kubectl"
    kubectl.write_text("""#!/usr/bin/env bash
case "$*" in
  *"get pods -l app=mindie-ms-coordinator"*) printf '10.0.0.2\\t\\n' ;;
  *"get pods -l app=mindie-ms-controller"*) printf '10.0.0.3\\t\\n' ;;
  *"get pods -l app=mindie-server"*) printf '10.0.1.1\\t800I A2(32G)\\n10.0.1.2\\t800I A2(64G)\\n10.0.1.3\\t\\n' ;;
  *"create configmap"*) for a in "$@"; do case "$a" in --from-literal=*) printf '%s' "${a#*=*.json=}" ;; esac; done ;;
  *"apply -f -"*) cat > "$OUT" ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac
""")
    kubectl.chmod(0o755)
    out = tmp_path / "table.json"
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(out)}
    subprocess.run(["bash", str(K8S / "gen_ranktable.sh")], env=env, check=True, timeout=60)
    table = json.loads(out.read_text())
    cfg = controller_config_from_dict(default_controller_dict(), environ={})
    topology = parse_topology(table, cfg)
    assert topology.ready and topology.coordinator == ("10.0.0.2", cfg.coordinator_port)
    assert [(s.ip, s.hardware_type) for s in topology.servers] == [
        ("10.0.1.1", "800I A2(32G)"), ("10.0.1.2", "800I A2(64G)"), ("10.0.1.3", "")]


def test_pd_probe_paths_exist_on_the_servers(apps, tmp_path):
    probes = 0
    maps = {key: json.loads(text) for d in pd_documents(PD) if d["kind"] == "ConfigMap" for key, text in d["data"].items()}
    for dep in (d for d in pd_documents(PD, PD / "heterogeneous") if d["kind"] == "Deployment"):
        for container in dep["spec"]["template"]["spec"]["containers"]:
            for kind, port, path in probe_routes(container, maps, tmp_path):
                app = apps["mindie-server"][port]
                assert _serves(app, path), f"{dep['metadata']['name']} {kind}: {path}"
                probes += 1
    assert probes == 9


def test_config_maps_mount_with_modes_the_file_check_accepts():
    """MINDIE_CHECK_INPUTFILES_PERMISSION (on by default) refuses configs above 0640; a ConfigMap's default is 0644."""
    mounts = 0
    deployments = [*by_kind("Deployment").values(),
                   *(d for d in pd_documents(PD, PD / "heterogeneous") if d["kind"] == "Deployment")]
    for dep in deployments:
        for volume in dep["spec"]["template"]["spec"]["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["defaultMode"] & ~0o640 == 0, volume
                mounts += 1
    assert mounts >= 7
