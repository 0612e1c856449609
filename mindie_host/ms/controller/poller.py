"""The controller's loop: poll every server, push the live set to the coordinator, write the files.

Every ``cluster_synchronization_seconds``:

1. the rank table is re-read when ``rank_table_detecting_seconds`` have passed; a server that
   left it gets a ``delete_time`` and is dropped ``disappeared_server_waiting_seconds`` later (one
   that comes back is kept);
2. each server's management port is polled: ``/v1/config`` and ``/v1/status`` until it is
   initialized, then ``/v1/status``; a request is tried ``http_retries`` more times before the
   poll counts as failed (:mod:`.nodes` has the fault rules);
3. in ``pd_separate``, roles are decided and pushed (:mod:`.roles`);
4. ``POST /v1/instances/refresh`` sends the coordinator every live server (in ``pd_separate``: the
   servers with their role in place, and none while group 0 lacks a P or a D);
5. the process-manager and cluster-status files are written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from ..schema import ConfigError
from .config import ControllerConfig
from .files import cluster_status, load_process_status, process_status, write_json
from .nodes import Node
from .ranktable import Topology, read_topology
from .roles import STATUSES, RoleManager

log = logging.getLogger("mindie_host.ms.controller")


class Controller:
    """The cluster's state and the loop that keeps it current."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.nodes: dict[int, Node] = {}
        self.topology: Topology | None = None
        self.coordinator_healthy = False
        self.last_rank_table = 0.0
        self.started = False
        self.cycles = 0
        self.pd = config.deploy_mode == "pd_separate"
        timeout = httpx.Timeout(config.http_timeout_seconds)
        self.server_client = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                               verify=config.tls["request_server"].client_context())
        self.coordinator_client = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                                    verify=config.tls["request_coordinator"].client_context())
        self.roles = RoleManager(config, self.server_client) if self.pd else None
        if config.process_manager_to_file:
            for node in load_process_status(config.process_manager_path):
                if not self.pd:  # roles belong to pd_separate only
                    node.role, node.role_pushed, node.pushed_peers, node.peers = "", False, None, []
                self.nodes[node.id] = node
            if self.nodes:
                log.info("reloaded %d servers from %s", len(self.nodes), config.process_manager_path)

    async def close(self) -> None:
        """Stop the role pushes in flight and close the HTTP clients."""
        if self.roles is not None:
            await self.roles.close()
        await self.server_client.aclose()
        await self.coordinator_client.aclose()

    # -- rank table ---------------------------------------------------------------------------
    def reload_rank_table(self) -> None:
        """Re-read the rank table and reconcile the server set."""
        try:
            topology = read_topology(self.config)
        except ConfigError as exc:
            log.error("cannot use the rank table: %s", exc)
            return
        if not topology.ready:
            log.info("the rank table is still initializing")
            return
        self.topology = topology
        listed = {s.id: s for s in topology.servers}
        now = int(time.time())
        for sid, addr in listed.items():
            node = self.nodes.get(sid)
            if node is None:
                self.nodes[sid] = Node(addr)
                log.info("server %s:%d joined (id %d)", addr.ip, addr.port, sid)
            else:
                node.addr, node.delete_time = addr, 0
        for sid, node in list(self.nodes.items()):
            if sid in listed:
                continue
            if not node.delete_time:
                node.delete_time = now
                log.info("server %s:%d left the rank table; dropped in %d s", node.addr.ip, node.addr.port,
                         self.config.disappeared_server_waiting_seconds)
            elif now - node.delete_time >= self.config.disappeared_server_waiting_seconds:
                del self.nodes[sid]
                log.info("server %s:%d dropped", node.addr.ip, node.addr.port)

    # -- polling ------------------------------------------------------------------------------
    async def _get(self, node: Node, path: str) -> dict[str, Any] | None:
        scheme = self.config.tls["request_server"].scheme
        url = f"{scheme}://{node.addr.ip}:{node.addr.management_port}{path}"
        for _ in range(self.config.http_retries + 1):
            try:
                resp = await self.server_client.get(url)
            except httpx.HTTPError as exc:
                node.last_error = f"{type(exc).__name__}"
                continue
            if resp.status_code == 200:
                try:
                    body = resp.json()
                except ValueError:
                    body = None
                if not isinstance(body, dict):
                    node.last_error = f"{path} answered something other than a JSON object"
                    continue
                service = body.get("service", {})
                state = service.get("roleStatus") if isinstance(service, dict) else None
                if path == "/v1/status" and state != "RoleReady" and not (self.pd and state in STATUSES):
                    node.last_error = "the server is not ready (roleStatus is not RoleReady)"
                    return None
                return body
            node.last_error = f"{path} answered {resp.status_code}"
        return None

    async def poll(self, node: Node) -> None:
        """One poll of one server (see :mod:`.nodes` for the rules)."""
        now = time.monotonic()
        if not node.initialized:
            if now < node.next_try:
                return
            node.next_try = now + self.config.server_online_wait_seconds
            config = await self._get(node, "/v1/config")
            node.status_sent_at = time.monotonic()
            status = await self._get(node, "/v1/status") if config is not None else None
            if config is None or status is None:
                node.is_healthy = False
                node.attempts += 1
                if node.attempts >= self.config.server_online_attempt_times and not node.is_faulty:
                    node.is_faulty = True
                    log.error("[ServerRequestHandler]GetNodeStatus: send request failed, node id %d (%s:%d): %s; "
                              "marked faulty after %d attempts", node.id, node.addr.ip, node.addr.management_port,
                              node.last_error, node.attempts)
                return
            node.apply_config(config)
            node.apply_status(status)
            node.initialized, node.is_healthy, node.attempts = True, True, 0
            if node.is_faulty:
                log.info("faulty server %d answers again; taken back", node.id)
            node.is_faulty = False
            log.info("server %d (%s:%d, %s) initialized: %d slots, %d blocks", node.id, node.addr.ip, node.addr.port,
                     node.model_name, node.total_slots, node.total_blocks)
            return
        node.status_sent_at = time.monotonic()
        status = await self._get(node, "/v1/status")
        if status is None:
            if node.is_healthy:
                log.warning("[ServerRequestHandler]GetNodeStatus: send request failed, node id %d: %s",
                            node.id, node.last_error)
            node.is_healthy = False
            return
        if not node.is_healthy:
            log.info("server %d is healthy again", node.id)
        node.apply_status(status)
        node.is_healthy = True

    async def push(self) -> None:
        """Send the live set to the coordinator."""
        if self.topology is None or self.topology.coordinator is None:
            return
        if self.roles is not None:
            live = self.roles.live(self.nodes.values())
        else:
            live = [n for n in self.nodes.values() if n.live]
        body = {"ids": [n.id for n in live], "instances": [n.refresh_entry() for n in live]}
        ip, port = self.topology.coordinator
        scheme = self.config.tls["request_coordinator"].scheme
        try:
            resp = await self.coordinator_client.post(f"{scheme}://{ip}:{port}/v1/instances/refresh", json=body)
        except httpx.HTTPError as exc:
            if self.coordinator_healthy:
                log.warning("[HttpClient] Failed to send http request to the coordinator %s:%d: %s", ip, port,
                            type(exc).__name__)
            self.coordinator_healthy = False
            return
        if resp.status_code != 200:
            log.warning("the coordinator refused the refresh (%d): %s", resp.status_code, resp.text[:500])
        self.coordinator_healthy = resp.status_code == 200

    def write_files(self) -> None:
        """Write the process-manager backup and the cluster-status file (those switched on)."""
        nodes = sorted(self.nodes.values(), key=lambda n: n.id)
        try:
            if self.config.process_manager_to_file:
                write_json(self.config.process_manager_path, process_status(nodes))
            if self.config.cluster_status_to_file:
                coord = self.topology.coordinator if self.topology else None
                write_json(self.config.cluster_status_path, cluster_status(nodes, coord, self.coordinator_healthy))
        except OSError as exc:
            log.error("cannot write the controller's files: %s", exc)

    async def cycle(self) -> None:
        """One sync period's work."""
        now = time.monotonic()
        if self.topology is None or now - self.last_rank_table >= self.config.rank_table_detecting_seconds:
            self.last_rank_table = now
            self.reload_rank_table()
        await asyncio.gather(*(self.poll(n) for n in list(self.nodes.values()) if not n.delete_time or n.initialized))
        if self.roles is not None:
            self.roles.update(self.nodes)
        await self.push()
        self.write_files()
        self.cycles += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle until ``stop`` is set."""
        self.started = True
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.cycle()
            except Exception:  # the loop must go on; the log has the details
                log.exception("controller cycle failed")
            remaining = self.config.sync_seconds - (time.monotonic() - started)
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, remaining))
            except asyncio.TimeoutError:
                pass
        log.info("[Controller]Run: exit")
