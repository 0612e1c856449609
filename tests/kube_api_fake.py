"""A fake Kubernetes API server behind the official client's transport, for contract tests.

:class:`FakeKubeAPI` replaces ``ApiClient.rest_client.pool_manager`` (urllib3's pool manager, the
client's only way out), so every call goes through the real client: its URL building, JSON
serialisation, content types and error handling. It records each call (method, path, query, body) and
answers as the API server does: 201 with the stored object for a create, 409 ``AlreadyExists`` and 404
``NotFound`` ``Status`` objects, a strategic merge for a PATCH (maps merged, lists of named items merged by
name), a DELETE answered per kind as the API server's registry does (a Service or a Pod, whose storage sets
``ReturnDeletedObject``, with the deleted object, which the generated client types as ``V1Service``; a
Deployment or a ConfigMap with a ``Status`` ``Success``; a collection with the list of what it deleted), lists
filtered by ``labelSelector``. Like the Deployment controller, it keeps ``replicas`` Running, Ready pods for
each Deployment's current pod template.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

KINDS = {"configmaps": "ConfigMap", "services": "Service", "pods": "Pod", "deployments": "Deployment"}
# the kinds whose registry answers a DELETE with the deleted object (``ReturnDeletedObject: true``)
RETURNS_DELETED_OBJECT = {"services", "pods"}


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: Any

    @property
    def route(self) -> str:
        return f"{self.method} {self.path}"


class FakeResponse:
    """What urllib3 would hand the client."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict"}.get(status, "Error")
        self.data = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}

    def getheaders(self) -> dict[str, str]:
        return self.headers

    def getheader(self, name: str, default: Any = None) -> Any:
        return self.headers.get(name.lower(), default)


def merge(target: Any, patch: Any) -> Any:
    """A strategic merge of ``patch`` into ``target``: maps key by key, lists of named maps by name."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for key, value in patch.items():
            out[key] = merge(target.get(key), value) if key in target else copy.deepcopy(value)
        return out
    if (
        isinstance(target, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in target + patch)
    ):
        by_name = {x["name"]: x for x in target}
        out = [merge(by_name[x["name"]], x) if x["name"] in by_name else copy.deepcopy(x) for x in patch]
        return out + [x for x in target if x["name"] not in {p["name"] for p in patch}]
    return copy.deepcopy(patch)


def _status(code: int, reason: str, message: str, kind: str = "", name: str = "") -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "details": {"name": name, "kind": kind},
        "code": code,
    }


@dataclass
class FakeKubeAPI:
    """The store, the call log and the pool-manager interface."""

    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    pod_ip: str = "127.0.0.1"
    _version: Any = field(default_factory=lambda: itertools.count(1))

    # -- the client's transport -----------------------------------------------------------------
    def request(self, method: str, url: str, fields: Any = None, body: Any = None, **_: Any) -> FakeResponse:
        parts = urlsplit(url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        if fields:
            query.update({k: str(v) for k, v in fields})
        data = json.loads(body) if body else None
        self.calls.append(Call(method, parts.path, query, data))
        return self.answer(method, parts.path, query, data)

    def clear(self) -> None:
        self.calls.clear()

    # -- the API server -------------------------------------------------------------------------------
    def answer(self, method: str, path: str, query: dict[str, str], body: Any) -> FakeResponse:
        segs = path.strip("/").split("/")
        ns_at = segs.index("namespaces")
        ns, plural = segs[ns_at + 1], segs[ns_at + 2]
        name = segs[ns_at + 3] if len(segs) > ns_at + 3 else None
        kind = KINDS[plural]
        key = (plural, ns, name or "")
        if name is None and method == "POST":
            name = body["metadata"]["name"]
            key = (plural, ns, name)
            if key in self.objects:
                return FakeResponse(
                    409, _status(409, "AlreadyExists", f'{plural} "{name}" already exists', plural, name)
                )
            obj = copy.deepcopy(body)
            obj["metadata"].update(
                uid=hashlib.md5(name.encode()).hexdigest(),
                namespace=ns,
                resourceVersion=str(next(self._version)),
                creationTimestamp=f"2025-01-01T00:00:{len(self.objects):02d}Z",
            )
            self.objects[key] = obj
            self._reconcile()
            return FakeResponse(201, obj)
        if name is None and method in ("GET", "DELETE"):
            items = [
                o
                for (p, n, _), o in self.objects.items()
                if p == plural and n == ns and _selected(o, query.get("labelSelector", ""))
            ]
            if method == "DELETE":
                for obj in items:
                    del self.objects[(plural, ns, obj["metadata"]["name"])]
                self._reconcile()
            return FakeResponse(200, {"kind": f"{kind}List", "apiVersion": "v1", "metadata": {}, "items": items})
        if key not in self.objects:
            return FakeResponse(404, _status(404, "NotFound", f'{plural} "{name}" not found', plural, name or ""))
        if method == "GET":
            return FakeResponse(200, self.objects[key])
        if method == "PATCH":
            obj = merge(self.objects[key], body)
            obj["metadata"]["resourceVersion"] = str(next(self._version))
            self.objects[key] = obj
            self._reconcile()
            return FakeResponse(200, obj)
        if method == "DELETE":
            obj = self.objects.pop(key)
            self._reconcile()
            if plural in RETURNS_DELETED_OBJECT:
                return FakeResponse(200, obj)
            return FakeResponse(200, _status(200, "", "", plural, name or ""))
        raise AssertionError(f"the fake does not answer {method} {path}")

    def _reconcile(self) -> None:
        """The Deployment controller's end state: ``replicas`` pods of the current template per Deployment."""
        for key in [k for k in self.objects if k[0] == "pods"]:
            del self.objects[key]
        for (plural, ns, name), dep in list(self.objects.items()):
            if plural != "deployments":
                continue
            template = dep["spec"]["template"]
            rs_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
            for n in range(dep["spec"]["replicas"]):
                pod_name = f"{name}-{rs_hash}-{n:05d}"
                self.objects[("pods", ns, pod_name)] = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pod_name, "namespace": ns, "labels": dict(template["metadata"]["labels"])},
                    "spec": copy.deepcopy(template["spec"]),
                    "status": {
                        "phase": "Running",
                        "podIP": self.pod_ip,
                        "conditions": [{"type": "Ready", "status": "True"}],
                        "containerStatuses": [
                            {
                                "name": c["name"],
                                "ready": True,
                                "restartCount": 0,
                                "image": c["image"],
                                "imageID": "",
                                "started": True,
                                "state": {"running": {"startedAt": "2025-01-01T00:00:00Z"}},
                            }
                            for c in template["spec"]["containers"]
                        ],
                    },
                }

    def of_kind(self, plural: str) -> dict[str, dict[str, Any]]:
        return {name: obj for (p, _, name), obj in self.objects.items() if p == plural}


def _selected(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True
