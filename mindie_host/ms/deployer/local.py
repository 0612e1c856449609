"""The local target: each server is ``replicas`` server processes behind a coordinator and a controller.

Layout, per server, under ``<workdir>/<namespace>/<server_name>/`` (:class:`~mindie_host.ms.cluster.Cluster`):
one ``server-K.json`` and log per instance, the rank table, ``ms_controller.json``, ``ms_coordinator.json``.
The coordinator's user port is ``service_port`` (the NodePort's place) on the deployer's ``--service-ip``;
each instance gets free loopback ports of its own (``infer_port`` / ``management_port`` are the Kubernetes
target's: one machine cannot give every instance the same ports).

What each ``infer_server.json`` key does here:

* probes, as a kubelet would, every :data:`~.target.PROBE_PERIOD` seconds: readiness on the management port
  (``/v2/health/ready``, or ``/health/timed-{readiness_timeout}`` with ``detect_server_inner_error``, which
  runs a real one-token generation): an instance is in the coordinator's rotation only while it is ready
  (``readiness_failure_threshold`` failures in a row take it out, a success puts it back), as a Service's
  endpoints hold ready pods only; liveness (``/v2/health/live`` or the timed probe) from ``init_delay`` seconds
  after a start, ``liveness_failure_threshold`` failures take it out of rotation and restart it. An instance
  whose process exits is taken out of rotation and restarted (10 s back-off, doubling to 5 min), on the same
  ports;
* ``resource_requests.cpu_core`` sets each instance's threads (``OMP_NUM_THREADS`` = cores, at least 1);
  ``memory`` and the NPU keys are not enforced on this machine (reported at create);
* ``mies_install_path`` is each instance's ``MIES_INSTALL_PATH`` (an existing directory here);
* ``enable_tls``: the coordinator and controller reach the instances over HTTPS with the deployer's
  ``client_mindie_tls_items``, and the user port serves HTTPS with the servers' own certificate;
* ``max_surge`` / ``max_unavailable`` / ``termination_grace_period_seconds``: the rolling update
  (:meth:`LocalServer.rolling_update`), in the Deployment controller's arithmetic.

Rolling update: new instances start (at most ``replicas + surge`` at once); one counts as available once its
readiness probe passes and the coordinator has it. An old instance is retired only while at least
``replicas - unavailable`` instances stay available (:meth:`LocalServer.drain`): it leaves the rank table and
the coordinator's rotation (new requests go to the others; the coordinator must acknowledge it), the requests
it is serving finish (up to ``termination_grace_period_seconds``, counted by the coordinator), and only then
does it get SIGTERM, so no request reaches a stopping server. (Should one still do, the draining server answers
503 and the coordinator sends the request to another instance.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ...tools.probe import probe_path
from ..cluster import Cluster
from ..tls import TLSLink
from .spec import InferServer, SpecError
from .target import (
    PROBE_PERIOD,
    NotFound,
    TargetError,
    check_against_config,
    config_digest,
    link_items,
    read_server_config,
    server_tls_files,
    uses_npu,
)

log = logging.getLogger("mindie_host.ms.deployer")
BACKOFF_START, BACKOFF_MAX = 10.0, 300.0
READY_POLL = 1.0  # seconds between readiness probes of an instance that is not ready yet
RANK_TABLE_SECONDS = 1  # the controller's rank_table_detecting_seconds (it drops a server at once: waiting 0 s)
SETTLE = 2 * RANK_TABLE_SECONDS + 3.0  # by then the controller has dropped a server the rank table no longer lists


@dataclass
class LocalInstance:
    """One instance (server process) as the deployer sees it; ``k`` is its index in the cluster."""

    k: int
    pod_name: str
    revision: str
    started: float
    live: bool = True
    ready: bool = False
    live_failures: int = 0
    ready_failures: int = 0
    next_ready: float = 0.0
    next_live: float = 0.0
    restarts: int = 0
    exited_at: float = 0.0
    offline: bool = False
    draining: bool = False
    removed: bool = False

    @property
    def process(self) -> str:
        return f"server-{self.k}"


def _suffix() -> str:
    alphabet = "bcdfghjklmnpqrstvwxz2456789"  # as Kubernetes' generated names
    return "".join(secrets.choice(alphabet) for _ in range(5))


class LocalServer:
    """One deployed server: its cluster, its instances, the probe loop and the rolling update."""

    def __init__(self, spec: InferServer, cluster: Cluster, config: dict[str, Any], mindie_tls: TLSLink) -> None:
        self.spec = spec
        self.cluster = cluster
        self.config = config
        self.generation = 0
        self.revision = self._revision()
        self.instances: dict[int, LocalInstance] = {}
        self.scheme = "https" if spec.server.enable_tls else "http"
        verify: ssl.SSLContext | bool = mindie_tls.client_context() if spec.server.enable_tls else True
        self.server_client = httpx.AsyncClient(verify=verify, trust_env=False)
        self.ms_client = httpx.AsyncClient(trust_env=False, timeout=5)
        self.monitor_task: asyncio.Task[None] | None = None
        self.update_task: asyncio.Task[None] | None = None
        self.drains: set[asyncio.Task[None]] = set()

    def _revision(self) -> str:
        return config_digest({"config": self.config, "generation": self.generation})[:10]

    # -- instances ------------------------------------------------------------------------------
    def _adopt(self, k: int) -> LocalInstance:
        """Record a started server process as an instance (logged with its process id and config file)."""
        inst = LocalInstance(k, f"{self.spec.server_name}-{self.revision}-{_suffix()}", self.revision, time.monotonic())
        self.instances[k] = inst
        self._log_process(inst, "started")
        return inst

    def _log_process(self, inst: LocalInstance, what: str) -> None:
        proc = self.cluster.procs[inst.process]
        config = self.cluster.servers[inst.k]["config"]
        log.info("%s: %s %s (pid %d, %s)", self.spec.server_name, what, inst.pod_name, proc.pid, config)

    async def start(self) -> None:
        """Start the cluster (its ``replicas`` servers, controller and coordinator) without waiting for readiness."""
        self.cluster.start(wait=False)  # spawned from the loop's thread: children get SIGTERM when it dies
        for k in range(len(self.cluster.servers)):
            self._adopt(k)
        self.monitor_task = asyncio.create_task(self.monitor(), name=f"monitor {self.spec.server_name}")

    async def add_instance(self) -> LocalInstance:
        """One more instance of the current revision, listed in the rank table at once (the controller hands it
        to the coordinator when its ``/v1/status`` says it is ready)."""
        k = self.cluster.add_server(self.config)
        self.cluster.start_server(k)
        inst = self._adopt(k)
        self.cluster.write_rank_table(i.k for i in self.instances.values() if not i.removed)
        return inst

    def _id(self, inst: LocalInstance) -> int:
        return self.cluster.server_id(inst.k)

    # -- probes -----------------------------------------------------------------------------------
    async def _probe(self, inst: LocalInstance, kind: str, timeout: int) -> bool:
        """One probe as the probe tool asks it (``/health/timed-{timeout}`` with ``detect_server_inner_error``)."""
        path = probe_path("server", kind, timeout=timeout, inner_error=self.spec.detect_server_inner_error)
        srv = self.cluster.servers[inst.k]
        url = f"{self.scheme}://{srv['ip']}:{srv['management_port']}{path}"
        try:
            resp = await self.server_client.get(url, timeout=timeout)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def probe_ready(self, inst: LocalInstance) -> None:
        spec = self.spec
        ok = await self._probe(inst, "readiness", spec.readiness_timeout)
        if inst.draining or not inst.live:  # being drained, or stopped for a restart: it stays out of rotation
            return
        was = inst.ready
        if ok:
            inst.ready, inst.ready_failures = True, 0
            inst.next_ready = time.monotonic() + PROBE_PERIOD
        else:
            inst.ready_failures += 1
            if inst.ready_failures >= spec.readiness_failure_threshold:
                inst.ready = False
            inst.next_ready = time.monotonic() + (PROBE_PERIOD if was else READY_POLL)
        if not inst.ready and not inst.offline:  # kept out of rotation until ready, as Endpoints hold unready pods
            if was:
                log.warning(
                    "%s: %s is not ready (%d failed readiness probes): out of rotation",
                    spec.server_name,
                    inst.pod_name,
                    inst.ready_failures,
                )
            await self._out_of_rotation(inst)
        elif inst.ready and inst.offline:
            log.info("%s: %s is ready: in rotation", spec.server_name, inst.pod_name)
            inst.offline = await self._rotation(inst, "online") is not True

    async def probe_live(self, inst: LocalInstance) -> None:
        spec = self.spec
        ok = await self._probe(inst, "liveness", spec.liveness_timeout)
        inst.next_live = time.monotonic() + PROBE_PERIOD
        inst.live_failures = 0 if ok else inst.live_failures + 1
        inst.live = inst.live_failures < spec.liveness_failure_threshold
        if not inst.live and not inst.draining:
            log.warning(
                "%s: %s failed %d liveness probes: restarting it", spec.server_name, inst.pod_name, inst.live_failures
            )
            await self._out_of_rotation(inst)  # no new request goes to a server that is being stopped
            await asyncio.to_thread(self.cluster.stop_process, inst.process, spec.termination_grace_period_seconds)
            self.restart(inst)

    def restart(self, inst: LocalInstance) -> None:
        self.cluster.start_server(inst.k)
        inst.restarts += 1
        inst.started, inst.exited_at = time.monotonic(), 0.0
        inst.live, inst.ready, inst.live_failures, inst.ready_failures = True, False, 0, 0
        inst.next_ready = inst.next_live = 0.0
        self._log_process(inst, "restarted")

    async def _rotation(self, inst: LocalInstance, state: str) -> bool | None:
        """Put an instance ``offline`` or ``online`` at the coordinator: True when done, None when the coordinator
        does not know the instance (not handed to it yet, or gone), False when it did not answer."""
        try:
            resp = await self.ms_client.post(
                f"{self.cluster.manage_url}/v1/instances/{state}", json={"ids": [self._id(inst)]}
            )
        except httpx.HTTPError:
            return False
        if resp.status_code == 400:  # the body is always well formed: the id is unknown
            return None
        return resp.status_code == 200

    async def _out_of_rotation(self, inst: LocalInstance) -> None:
        if await self._rotation(inst, "offline") is True:
            inst.offline = True

    async def _tasks(self, inst: LocalInstance) -> int | None:
        """Requests the coordinator has in flight on ``inst`` (0 when it does not know it); None: no answer."""
        try:
            resp = await self.ms_client.get(
                f"{self.cluster.manage_url}/v1/instances/tasks", params={"id": self._id(inst)}
            )
        except httpx.HTTPError:
            return None
        if resp.status_code == 400:
            return 0
        try:
            return int(resp.json()["tasks"][0]) if resp.status_code == 200 else None
        except (ValueError, KeyError, IndexError, TypeError):
            return None

    async def routed(self) -> set[int]:
        """Ids the coordinator has in its table."""
        return set(await asyncio.to_thread(self.cluster.live_ids))

    async def tick(self) -> None:
        """One pass of the kubelet's work over every instance."""
        now = time.monotonic()
        probes = []
        for inst in list(self.instances.values()):
            if inst.draining:
                continue
            proc = self.cluster.procs.get(inst.process)
            if proc is not None and proc.poll() is not None:
                inst.live = inst.ready = False
                if not inst.exited_at:
                    inst.exited_at = now
                    log.warning(
                        "%s: %s exited with %s; restarting it", self.spec.server_name, inst.pod_name, proc.returncode
                    )
                    probes.append(self._out_of_rotation(inst))
                backoff = 0.0 if inst.restarts == 0 else min(BACKOFF_MAX, BACKOFF_START * 2 ** (inst.restarts - 1))
                if now - inst.exited_at >= backoff:
                    self.restart(inst)
                continue
            if now >= inst.next_ready:
                probes.append(self.probe_ready(inst))
            if now - inst.started >= self.spec.init_delay and now >= inst.next_live:
                probes.append(self.probe_live(inst))
        if probes:
            await asyncio.gather(*probes)

    async def monitor(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must go on; the log has the details
                log.exception("%s: monitor pass failed", self.spec.server_name)
            await asyncio.sleep(0.5)

    # -- rolling update -------------------------------------------------------------------------
    async def rolling_update(self) -> None:
        """Replace every instance of an older revision (see the module docstring)."""
        spec = self.spec
        surge, unavailable = spec.rolling_limits()
        want = spec.replicas
        log.info(
            "%s: rolling update to revision %s (%d instances, surge %d, unavailable %d)",
            spec.server_name,
            self.revision,
            want,
            surge,
            unavailable,
        )
        while True:
            current = [i for i in self.instances.values() if not i.draining]
            new = [i for i in current if i.revision == self.revision]
            old = [i for i in current if i.revision != self.revision]
            routed = await self.routed()
            available = {i.k for i in current if i.ready and self._id(i) in routed}
            if not old and len(new) >= want and all(i.k in available for i in new):
                break
            for _ in range(min(want - len(new), want + surge - len(current))):
                new.append(await self.add_instance())
            budget = len(available) - (want - unavailable)
            for inst in sorted(old, key=lambda i: i.k in available):  # unavailable ones go first, for free
                if inst.k in available:
                    if budget <= 0:
                        break
                    budget -= 1
                self.retire(inst)
            await asyncio.sleep(0.5)
        log.info("%s: rolling update to revision %s done", spec.server_name, self.revision)

    def retire(self, inst: LocalInstance) -> None:
        """Drain and stop one instance in the background."""
        task = asyncio.create_task(self.drain(inst), name=f"drain {inst.pod_name}")
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)

    async def drain(self, inst: LocalInstance) -> None:
        """Out of the rank table and of rotation, let its requests finish, then SIGTERM (SIGKILL at the deadline).

        The coordinator must have taken the instance out of rotation before it is stopped: either it acknowledged
        ``offline`` (it keeps that, and counts the instance's requests, even once the controller stops listing it),
        or it has not known the instance for :data:`SETTLE` seconds after the rank table dropped it (by then the
        controller has re-read the table and cannot hand it over any more). Only then do its requests in flight,
        counted by the coordinator, decide; a coordinator that does not answer is asked again, never taken for idle.
        """
        spec = self.spec
        inst.draining, inst.ready = True, False
        deadline = time.monotonic() + spec.termination_grace_period_seconds
        inst.removed = True
        self.cluster.write_rank_table(i.k for i in self.instances.values() if not i.removed)
        log.info("%s: draining %s", spec.server_name, inst.pod_name)
        acked, unknown_since = False, None
        while time.monotonic() < deadline:
            if not acked:  # asked even when it was put offline before: the coordinator's word is what counts
                state = await self._rotation(inst, "offline")
                acked = inst.offline = state is True
                unknown_since = (unknown_since or time.monotonic()) if state is None else None
            settled = unknown_since is not None and time.monotonic() - unknown_since >= SETTLE
            if (acked or settled) and await self._tasks(inst) == 0:
                break
            await asyncio.sleep(0.2)
        else:
            log.warning("%s: %s still had requests at the end of its grace period", spec.server_name, inst.pod_name)
        grace = max(1.0, deadline - time.monotonic())
        await asyncio.to_thread(self.cluster.stop_process, inst.process, grace)
        self.instances.pop(inst.k, None)
        log.info("%s: %s stopped", spec.server_name, inst.pod_name)

    async def update(self, config: dict[str, Any]) -> None:
        """Roll out ``config`` (a new revision even when unchanged: the spec's forced update)."""
        if self.update_task is not None and not self.update_task.done():
            self.update_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.update_task
        self.config = config
        self.generation += 1
        self.revision = self._revision()
        self.update_task = asyncio.create_task(self.rolling_update(), name=f"update {self.spec.server_name}")

    # -- state -------------------------------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        items = sorted(self.instances.values(), key=lambda i: i.k)
        model_info: dict[str, Any] = {}
        for inst in items:
            if inst.ready and not inst.draining:
                srv = self.cluster.servers[inst.k]
                try:
                    resp = await self.server_client.get(
                        f"{self.scheme}://{srv['ip']}:{srv['management_port']}/info", timeout=5
                    )
                    if resp.status_code == 200:
                        model_info = resp.json()
                        break
                except (httpx.HTTPError, ValueError):
                    continue
        return {
            "instances_status": [
                {"liveness": i.live, "pod_name": i.pod_name, "readiness": i.ready and not i.draining} for i in items
            ],
            "model_info": model_info,
        }

    async def stop(self) -> None:
        """Stop taking requests at once (coordinator and controller), then drain and stop the instances."""
        for task in (self.monitor_task, self.update_task, *self.drains):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        cluster = self.cluster
        for name in ("coordinator", "controller"):
            if name in cluster.procs:
                await asyncio.to_thread(cluster.stop_process, name, 10)
        await asyncio.to_thread(cluster.stop, float(self.spec.termination_grace_period_seconds))
        await self.server_client.aclose()
        await self.ms_client.aclose()


def _port_free(ip: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


class LocalTarget:
    """Servers as local process groups (see the module docstring)."""

    kind = "local"

    def __init__(
        self,
        workdir: str | Path,
        server_config: str | None,
        mindie_tls: TLSLink,
        *,
        service_ip: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.server_config = server_config
        self.mindie_tls = mindie_tls
        self.service_ip = service_ip
        self.env = dict(env or {})
        self.servers: dict[str, LocalServer] = {}
        self.stopping: set[asyncio.Task[None]] = set()

    def check(self, spec: InferServer) -> None:
        if not spec.single_node:
            raise SpecError(
                "server_type: 'mindie_cross_node' needs the kubernetes target (one instance over "
                "several nodes); the local target runs 'mindie_single_node'"
            )
        if spec.scheduler != "default":
            raise SpecError("scheduler: 'volcano' is a Kubernetes scheduler; the local target takes 'default'")
        if not Path(spec.server.mies_install_path).is_dir():
            raise SpecError(
                f"mindie_server_config.mies_install_path: {spec.server.mies_install_path} is not a "
                "directory on this machine (the local target runs the servers here)"
            )
        if spec.server_name not in self.servers and not _port_free(self.service_ip, spec.service_port):
            raise SpecError(f"service_port: {self.service_ip}:{spec.service_port} is in use on this machine")

    def _cluster(self, spec: InferServer, config: dict[str, Any]) -> Cluster:
        cores = max(1, spec.resources.cpu_core // 1000)
        env = {**self.env, "MIES_INSTALL_PATH": spec.server.mies_install_path, "OMP_NUM_THREADS": str(cores)}
        coordinator: dict[str, Any] = {
            "http_config": {"predict_ip": self.service_ip},
            "exception_config": {"max_retry": 5},
        }
        controller: dict[str, Any] = {
            "rank_table_detecting_seconds": RANK_TABLE_SECONDS,
            "disappeared_server_waiting_seconds": 0,
            "server_online_attempt_times": 65535,
            "http_timeout_seconds": 5,
        }
        if spec.server.enable_tls:
            client = link_items(self.mindie_tls)
            user = server_tls_files(config, Path(spec.server.mies_install_path))
            coordinator["tls_config"] = {
                "mindie_client_tls_enable": True,
                "mindie_client_tls_items": client,
                "mindie_mangment_tls_enable": True,
                "mindie_mangment_tls_items": client,
                "request_server_tls_enable": True,
                "request_server_tls_items": user,
            }
            controller["tls_config"] = {"request_server_tls_enable": True, "request_server_tls_items": client}
        workdir = self.workdir / spec.namespace / spec.server_name
        return Cluster(
            workdir,
            spec.replicas,
            server_config=config,
            predict_port=spec.service_port,
            coordinator=coordinator,
            controller=controller,
            env=env,
        )

    async def create(self, spec: InferServer) -> None:
        config = read_server_config(self.server_config)
        check_against_config(spec, config, self.mindie_tls)
        unused = ["resource_requests.memory"] + (
            ["resource_requests.npu_type", "resource_requests.npu_chip_num"] if not uses_npu(config) else []
        )
        log.info(
            "%s: %s not enforced by the local target (the Kubernetes target requests them)",
            spec.server_name,
            ", ".join(unused),
        )
        server = LocalServer(spec, self._cluster(spec, config), config, self.mindie_tls)
        self.servers[spec.server_name] = server
        try:
            await server.start()
        except Exception as exc:
            self.servers.pop(spec.server_name, None)
            await server.stop()
            raise TargetError(f"{spec.server_name}: could not start: {exc}") from exc
        log.info(
            "%s: creating %d instance(s); requests go to %s://%s:%d",
            spec.server_name,
            spec.replicas,
            "https" if spec.server.enable_tls else "http",
            self.service_ip,
            spec.service_port,
        )

    async def restore(self, spec: InferServer) -> None:
        """The instances died with the previous deployer (they never outlive it): start them again."""
        await self.create(spec)

    def _get(self, spec: InferServer) -> LocalServer:
        server = self.servers.get(spec.server_name)
        if server is None:
            raise NotFound(spec.server_name)
        return server

    async def status(self, spec: InferServer) -> dict[str, Any]:
        return await self._get(spec).status()

    async def update(self, spec: InferServer) -> None:
        server = self._get(spec)
        config = read_server_config(self.server_config)
        check_against_config(spec, config, self.mindie_tls)
        await server.update(config)

    async def delete(self, spec: InferServer) -> None:
        server = self.servers.pop(spec.server_name, None)
        if server is None:
            raise NotFound(spec.server_name)
        for task in (server.monitor_task, server.update_task):
            if task is not None:
                task.cancel()
        for name in ("coordinator", "controller"):  # no new requests from here on; the port is free again
            if name in server.cluster.procs:
                await asyncio.to_thread(server.cluster.stop_process, name, 10)
        task = asyncio.create_task(server.stop(), name=f"stop {spec.server_name}")
        self.stopping.add(task)
        task.add_done_callback(self.stopping.discard)

    async def close(self) -> None:
        servers = list(self.servers.values())
        self.servers.clear()
        await asyncio.gather(*(s.stop() for s in servers), *self.stopping, return_exceptions=True)

    def pids(self) -> dict[str, int]:
        """Process ids by pod name (tests and operators: ``kill`` one to see it restarted)."""
        out = {}
        for server in self.servers.values():
            for inst in server.instances.values():
                proc = server.cluster.procs.get(inst.process)
                if proc is not None:
                    out[inst.pod_name] = proc.pid
        return out
