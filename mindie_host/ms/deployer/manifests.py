"""The Kubernetes objects the deployer makes for a single-node server: a ConfigMap, a Deployment, a Service.

* ConfigMap ``{server_name}-config-{digest}``: the servers' ``config.json`` with ``port`` = ``infer_port``,
  ``managementPort`` = ``management_port`` and ``shutdownDrainSeconds`` cut to fit inside
  ``termination_grace_period_seconds``. Its name carries the config's digest, so the pods of an older revision
  keep the file they started with while a rolling update runs.
* Deployment ``{server_name}``: ``replicas`` pods of ``--image`` running ``mindie-host serve``, each binding its
  pod IP (``MIES_CONTAINER_IP``/``MIES_CONTAINER_MANAGEMENT_IP``), with the config mounted at
  ``{mies_install_path}/conf/config.json`` (``MIES_CONFIG_JSON_PATH``, read by the server and its probes);
  strategy ``RollingUpdate`` with ``maxSurge``/``maxUnavailable`` as given (Kubernetes rounds them as the spec
  says); ``exec`` probes every 5 s with the probe tool (``mindie-host probe liveness|readiness --component
  server``, as deploy/k8s uses it: it reads the server's management address and TLS setting from the config, and
  with ``enable_tls`` the client certificate from ``$MIES_INSTALL_PATH/conf/http_client_ctl.json`` in the image),
  liveness from ``init_delay``, ``--detect-inner-error`` when ``detect_server_inner_error`` (each probe runs a
  real one-token generation), each probe's ``--timeout`` the request's ``liveness_timeout`` /
  ``readiness_timeout`` and its ``timeoutSeconds`` :data:`EXEC_SLACK` more for the command's own start;
  ``terminationGracePeriodSeconds``, with a 5 s preStop pause so the Service stops sending new
  connections before the server starts refusing; CPU and memory requests from ``resource_requests``, and
  ``huawei.com/{npu_type}`` requests and limits plus an ``accelerator: huawei-{npu_type}`` node selector when
  the servers run on NPUs; ``schedulerName: volcano`` and the ``fault-scheduling`` label
  (``grace``/``force``) for Volcano's NPU fault rescheduling.
* Service ``{server_name}``: ``NodePort`` ``service_port`` to the business port.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .spec import InferServer
from .target import PROBE_PERIOD, config_digest, uses_npu

MANAGED_BY = "mindie-host-deployer"
ANNOTATION_PREFIX = "deployer.mindie-host.io/"
PRESTOP_SECONDS = 5
EXEC_SLACK = 5  # seconds an exec probe's command gets beyond its own --timeout (Python's start, the config read)
CONTAINER = "mindie-server"


def labels(spec: InferServer) -> dict[str, str]:
    """Every object's labels; the selector is the same set."""
    return {"app": spec.server_name, "app.kubernetes.io/managed-by": MANAGED_BY}


def config_map_name(spec: InferServer, config: dict[str, Any]) -> str:
    return f"{spec.server_name}-config-{config_digest(config)}"


def pod_config(spec: InferServer, config: dict[str, Any]) -> dict[str, Any]:
    """The config.json every pod reads."""
    cfg = copy.deepcopy(config)
    s = cfg["ServerConfig"]
    s["port"] = spec.server.infer_port
    s["managementPort"] = spec.server.management_port
    drain = max(0, spec.termination_grace_period_seconds - PRESTOP_SECONDS - 2)
    s["shutdownDrainSeconds"] = min(float(s.get("shutdownDrainSeconds", 30.0)), float(drain))
    return cfg


def config_map(spec: InferServer, config: dict[str, Any]) -> dict[str, Any]:
    cfg = pod_config(spec, config)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(spec, cfg), "namespace": spec.namespace, "labels": labels(spec)},
        "data": {"config.json": json.dumps(cfg, indent=2)},
    }


def _probe(spec: InferServer, kind: str, timeout: int, threshold: int, delay: int = 0) -> dict[str, Any]:
    """An ``exec`` probe running the probe tool (:mod:`mindie_host.tools.probe`) on the server of the pod."""
    command = ["mindie-host", "probe", kind, "--component", "server", "--timeout", str(timeout)]
    if spec.detect_server_inner_error:
        command.append("--detect-inner-error")
    probe: dict[str, Any] = {
        "exec": {"command": command},
        "periodSeconds": PROBE_PERIOD,
        "timeoutSeconds": timeout + EXEC_SLACK,
        "failureThreshold": threshold,
    }
    if delay:
        probe["initialDelaySeconds"] = delay
    return probe


def _resources(spec: InferServer, config: dict[str, Any]) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": f"{res.cpu_core}m", "memory": f"{res.memory}Mi"}
    out: dict[str, Any] = {"requests": requests}
    if uses_npu(config):
        npu = f"huawei.com/{res.npu_type}"
        requests[npu] = str(res.npu_chip_num)
        out["limits"] = {npu: str(res.npu_chip_num)}  # an extended resource's limit must equal its request
    return out


def deployment(spec: InferServer, config: dict[str, Any], image: str, *, restarted_at: str = "") -> dict[str, Any]:
    """The Deployment; ``restarted_at`` (an update's time) changes the pod template, which starts a rollout."""
    install = spec.server.mies_install_path.rstrip("/") or "/"
    cfg = pod_config(spec, config)
    pod_labels = labels(spec)
    if spec.npu_fault_reschedule is not None:
        pod_labels = {**pod_labels, "fault-scheduling": "grace" if spec.npu_fault_reschedule else "force"}
    annotations = {f"{ANNOTATION_PREFIX}config-digest": config_digest(cfg)}
    if restarted_at:
        annotations[f"{ANNOTATION_PREFIX}restarted-at"] = restarted_at
    pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "imagePullPolicy": "Always",
        "command": ["mindie-host", "serve"],
        "env": [
            {"name": "MIES_CONFIG_JSON_PATH", "value": f"{install}/conf/config.json"},
            {"name": "MIES_CONTAINER_IP", **pod_ip},
            {"name": "MIES_CONTAINER_MANAGEMENT_IP", **pod_ip},
            {"name": "MIES_INSTALL_PATH", "value": install},
            {"name": "OMP_NUM_THREADS", "value": str(max(1, spec.resources.cpu_core // 1000))},
        ],
        "ports": [
            {"name": "business", "containerPort": spec.server.infer_port, "protocol": "TCP"},
            {"name": "management", "containerPort": spec.server.management_port, "protocol": "TCP"},
        ],
        "livenessProbe": _probe(
            spec, "liveness", spec.liveness_timeout, spec.liveness_failure_threshold, spec.init_delay
        ),
        "readinessProbe": _probe(spec, "readiness", spec.readiness_timeout, spec.readiness_failure_threshold),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "resources": _resources(spec, config),
        "volumeMounts": [
            {"name": "config", "mountPath": f"{install}/conf/config.json", "subPath": "config.json", "readOnly": True}
        ],
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": config_map_name(spec, cfg), "defaultMode": 0o440}}],
    }
    if spec.scheduler == "volcano":
        pod["schedulerName"] = "volcano"
    if uses_npu(config):
        pod["nodeSelector"] = {"accelerator": f"huawei-{spec.resources.npu_type}"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": spec.server_name, "namespace": spec.namespace, "labels": labels(spec)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": labels(spec)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": f"{spec.max_surge}%", "maxUnavailable": f"{spec.max_unavailable}%"},
            },
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod},
        },
    }


def service(spec: InferServer) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.server_name, "namespace": spec.namespace, "labels": labels(spec)},
        "spec": {
            "type": spec.service_type,
            "selector": labels(spec),
            "ports": [
                {
                    "name": "business",
                    "protocol": "TCP",
                    "port": spec.server.infer_port,
                    "targetPort": "business",
                    "nodePort": spec.service_port,
                }
            ],
        },
    }


def manifests(spec: InferServer, config: dict[str, Any], image: str) -> list[dict[str, Any]]:
    """Every object of a server, in the order they are created."""
    return [config_map(spec, config), deployment(spec, config, image), service(spec)]
