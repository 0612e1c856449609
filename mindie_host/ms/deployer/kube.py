"""The Kubernetes target, through the official ``kubernetes`` client (objects: :mod:`.manifests`).

=========  ============================================================================================
create     POST the ConfigMap, the Deployment, the Service (an object that exists already: 400)
get        GET the Deployment (gone: no instances), LIST its pods: ``liveness`` is "the container runs",
           ``readiness`` the pod's Ready condition; ``model_info`` is ``/info`` of a ready pod (its IP and
           ``management_port``, over the deployer's ``client_mindie_tls_items`` when TLS is on)
update     POST the ConfigMap of the current config (kept if it exists), PATCH the Deployment's pod template
           (the ConfigMap's name and a ``restarted-at`` annotation, as ``kubectl rollout restart`` does): the
           Deployment controller rolls the pods by ``maxSurge``/``maxUnavailable``; then ConfigMaps older than
           the previous revision are deleted
delete     DELETE the Service (no new connections), the Deployment (its pods end gracefully), the ConfigMaps
restore    GET the Deployment of each server the status file lists
=========  ============================================================================================

The API server is ``https://{k8s_apiserver_ip}:{k8s_apiserver_port}`` (``http`` with ``client_k8s_tls_enable``
false) with ``client_k8s_tls_items`` as CA and client certificate. ``mindie_cross_node`` (one instance over
several nodes, which needs a rank table of the pods' devices) is refused with a 400.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import ssl
import tempfile
from pathlib import Path
from typing import Any

import httpx

from ..tls import TLSLink
from .config import DeployerConfig
from .manifests import deployment as deployment_manifest
from .manifests import labels, manifests
from .spec import InferServer, SpecError
from .target import NotFound, TargetError, check_against_config, read_server_config, uses_npu

log = logging.getLogger("mindie_host.ms.deployer")
DEFAULT_IMAGE = "mindie-host:latest"
KEEP_CONFIG_MAPS = 2  # the current revision's and the one before (its pods may still be running)


def api_client(config: DeployerConfig) -> Any:
    """A ``kubernetes.client.ApiClient`` for the API server ``ms_server.json`` names."""
    from kubernetes import client

    link = config.k8s_tls
    conf = client.Configuration()
    scheme = "https" if link is not None and link.enabled else "http"
    conf.host = f"{scheme}://{config.k8s_ip}:{config.k8s_port}"
    if link is not None and link.enabled:
        paths = {
            key: str(Path(link.base) / value) if value else ""
            for key, value in (
                ("ca", link.ca_cert),
                ("cert", link.tls_cert),
                ("key", link.tls_key),
            )
        }
        conf.ssl_ca_cert = paths["ca"] or None
        conf.cert_file = paths["cert"] or None
        conf.key_file = _plain_key(paths["key"], link.password()) if paths["key"] else None
        conf.verify_ssl = True
    return client.ApiClient(conf)


def _plain_key(key_path: str, password: str | None) -> str:
    """The client key for urllib3, which cannot take a password: an encrypted key is decrypted into a private
    file (mode 0600, removed at exit)."""
    if not password:
        return key_path
    import atexit

    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password.encode())
    fd, path = tempfile.mkstemp(prefix="mindie-deployer-k8s-", suffix=".key.pem")
    with os.fdopen(fd, "wb") as fh:
        fh.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    atexit.register(lambda: Path(path).unlink(missing_ok=True))
    return path


def _selector(spec: InferServer) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels(spec).items()))


class KubeTarget:
    """Servers as Deployments (see the module docstring)."""

    kind = "kubernetes"

    def __init__(self, api: Any, server_config: str | None, mindie_tls: TLSLink, *, image: str = DEFAULT_IMAGE) -> None:
        from kubernetes import client

        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.server_config = server_config
        self.mindie_tls = mindie_tls
        self.image = image
        verify: ssl.SSLContext | bool = mindie_tls.client_context() if mindie_tls.enabled else True
        self.http = httpx.AsyncClient(verify=verify, trust_env=False, timeout=httpx.Timeout(5, connect=2))

    def check(self, spec: InferServer) -> None:
        if not spec.single_node:
            raise SpecError(
                "server_type: 'mindie_cross_node' is not supported by this deployer (it needs a rank "
                "table of every node's devices); deploy 'mindie_single_node' servers"
            )

    async def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except ApiException as exc:
            if exc.status in (404, 409):
                raise
            raise TargetError(f"the Kubernetes API server refused to {what}: {exc.status} {exc.reason}") from None
        except Exception as exc:  # urllib3 connection errors and the like
            raise TargetError(f"cannot {what}: {type(exc).__name__}: {exc}") from None

    async def _delete(self, what: str, fn: Any, *args: Any, **kw: Any) -> None:
        """A DELETE whose answer is read but not deserialized: the API server answers it per kind (a Service
        with the deleted Service, a Deployment or a ConfigMap with a ``Status``, a collection with a list), and
        the client's models of these answers differ between its versions (37's pydantic models refuse a
        ``Status`` where they expect a ``V1Service``). A 4xx/5xx still raises as in :meth:`_call`."""

        def delete() -> None:
            resp = fn(*args, _preload_content=False, **kw)
            _ = resp.data  # read to the end: the connection goes back to the pool

        await self._call(what, delete)

    async def create(self, spec: InferServer) -> None:
        from kubernetes.client.exceptions import ApiException

        config = read_server_config(self.server_config)
        check_against_config(spec, config, self.mindie_tls)
        if not uses_npu(config):
            log.info(
                "%s: the servers run on CPU: no huawei.com/%s is requested", spec.server_name, spec.resources.npu_type
            )
        ns = spec.namespace
        calls = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Deployment": self.apps.create_namespaced_deployment,
            "Service": self.core.create_namespaced_service,
        }
        for obj in manifests(spec, config, self.image):
            try:
                await self._call(f"create {obj['kind']} {obj['metadata']['name']}", calls[obj["kind"]], ns, obj)
            except ApiException as exc:
                if exc.status == 409:
                    raise SpecError(
                        f"server_name: a {obj['kind']} named {obj['metadata']['name']!r} exists already "
                        f"in namespace {ns!r}"
                    ) from None
                raise TargetError(f"the namespace {ns!r} does not exist (create it first)") from None

    async def _deployment(self, spec: InferServer) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return await self._call(
                f"read Deployment {spec.server_name}",
                self.apps.read_namespaced_deployment,
                spec.server_name,
                spec.namespace,
            )
        except ApiException:
            return None

    async def restore(self, spec: InferServer) -> None:
        if await self._deployment(spec) is None:
            raise TargetError(f"Deployment {spec.namespace}/{spec.server_name} no longer exists")

    async def status(self, spec: InferServer) -> dict[str, Any]:
        if await self._deployment(spec) is None:
            return {"instances_status": [], "model_info": {}}
        pods = await self._call(
            "list pods", self.core.list_namespaced_pod, spec.namespace, label_selector=_selector(spec)
        )
        items = []
        ready_ips = []
        for pod in sorted(pods.items, key=lambda p: p.metadata.name):
            statuses = pod.status.container_statuses or []
            live = bool(statuses) and all(s.state is not None and s.state.running is not None for s in statuses)
            ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
            ready = ready and pod.metadata.deletion_timestamp is None
            items.append({"liveness": live, "pod_name": pod.metadata.name, "readiness": ready})
            if ready and pod.status.pod_ip:
                ready_ips.append(pod.status.pod_ip)
        return {"instances_status": items, "model_info": await self._model_info(spec, ready_ips)}

    async def _model_info(self, spec: InferServer, ips: list[str]) -> dict[str, Any]:
        scheme = "https" if spec.server.enable_tls else "http"
        for ip in ips:
            try:
                resp = await self.http.get(f"{scheme}://{ip}:{spec.server.management_port}/info")
                if resp.status_code == 200 and isinstance(resp.json(), dict):
                    return dict(resp.json())
            except (httpx.HTTPError, ValueError):
                continue
        return {}

    async def update(self, spec: InferServer) -> None:
        from kubernetes.client.exceptions import ApiException

        config = read_server_config(self.server_config)
        check_against_config(spec, config, self.mindie_tls)
        if await self._deployment(spec) is None:
            raise NotFound(spec.server_name)
        cmap = manifests(spec, config, self.image)[0]
        try:
            await self._call(
                f"create ConfigMap {cmap['metadata']['name']}",
                self.core.create_namespaced_config_map,
                spec.namespace,
                cmap,
            )
        except ApiException:  # 409: this config's map exists (a forced update with an unchanged config)
            pass
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        template = deployment_manifest(spec, config, self.image, restarted_at=now)["spec"]["template"]
        patch = {"spec": {"template": template}}
        try:
            await self._call(
                f"patch Deployment {spec.server_name}",
                self.apps.patch_namespaced_deployment,
                spec.server_name,
                spec.namespace,
                patch,
            )
        except ApiException:
            raise NotFound(spec.server_name) from None
        await self._prune_config_maps(spec, cmap["metadata"]["name"])

    async def _prune_config_maps(self, spec: InferServer, current: str) -> None:
        from kubernetes.client.exceptions import ApiException

        maps = await self._call(
            "list ConfigMaps", self.core.list_namespaced_config_map, spec.namespace, label_selector=_selector(spec)
        )
        by_age = sorted(
            maps.items,
            key=lambda m: (
                m.metadata.creation_timestamp or dt.datetime.min.replace(tzinfo=dt.timezone.utc),
                m.metadata.name,
            ),
            reverse=True,
        )
        keep = {current, *[m.metadata.name for m in by_age if m.metadata.name != current][: KEEP_CONFIG_MAPS - 1]}
        for item in by_age:
            if item.metadata.name not in keep:
                try:
                    await self._delete(
                        f"delete ConfigMap {item.metadata.name}",
                        self.core.delete_namespaced_config_map,
                        item.metadata.name,
                        spec.namespace,
                    )
                except ApiException:
                    pass

    async def delete(self, spec: InferServer) -> None:
        from kubernetes.client.exceptions import ApiException

        ns, name = spec.namespace, spec.server_name
        for what, fn in (
            ("Service", self.core.delete_namespaced_service),
            ("Deployment", self.apps.delete_namespaced_deployment),
        ):
            try:
                await self._delete(f"delete {what} {name}", fn, name, ns)
            except ApiException:  # 404: gone already
                pass
        await self._delete(
            "delete ConfigMaps", self.core.delete_collection_namespaced_config_map, ns, label_selector=_selector(spec)
        )

    async def close(self) -> None:
        await self.http.aclose()
        await asyncio.to_thread(self.api.close)
