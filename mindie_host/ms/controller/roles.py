"""PD roles (``deploy_mode: pd_separate``): which server is a prefill (P) and which a decode (D), and pushing it.

The flow, once per sync period, after the servers were polled (:mod:`.poller`):

1. **Members.** The servers that are initialized (``/v1/config`` answered, ``/v1/status`` said
   ``RoleUnknown``, ``RoleSwitching`` or ``RoleReady``), healthy, not faulty and still in the rank
   table. A server whose ``/v1/config`` says ``inferMode`` other than ``dmi`` cannot take a role:
   it is marked faulty with an error naming the key (and checked again after the check window).
2. **Decision** (:func:`decide_roles`). Members keep a role once they have one; members without
   one fill the side that is below its target (:func:`prefill_target`). With ``is_heterogeneous``
   the rank table's ``hardware_type`` decides instead: ``"800I A2(32G)"`` servers are P,
   ``"800I A2(64G)"`` servers D, and a server with neither is marked faulty (logged).
3. **Push** (:class:`RoleManager`). ``POST /v1/role/{prefill|decode}`` with the body of spec Table
   4-15: ``local`` is the server (its rank-table devices, or one device ``"0"`` at its IP) and
   ``peers`` the members of the other side (for a P its Ds, for a D its Ps). Each peer must have
   as many devices as the server; when the counts differ the push is not sent (an error is logged
   once) since the spec forbids it. The POST is tried ``init_role_attempt_times`` times; then the
   server's ``/v1/status`` must say ``RoleReady`` with that role within ``check_role_attempt_times``
   checks ``check_role_wait_seconds`` apart (a ``RoleUnknown`` answer meanwhile re-sends the POST
   while attempts are left). A server that fails is marked faulty and loses its role; it is taken
   back like any faulty server once it answers again (re-initialized after the check window), and
   then gets a role again. Pushes run in the background, one per server; a push whose target
   (role, peers) changed meanwhile is cancelled and started again.
4. **Peer changes.** When one side's member set changes (a D added, removed, faulty, unhealthy),
   every server of the other side is pushed its role again with the new peer list. A server that
   forgot its role (restarted: ``RoleUnknown``, or another role, in a status asked after the push)
   is pushed again.
5. **Group availability** (:meth:`RoleManager.live`). Only servers whose role was pushed and whose
   latest status says ``RoleReady`` with that role go to the coordinator. With fewer than 1 P and
   1 D among them, group 0 is unavailable: it is logged once per change and the coordinator gets
   an empty live set, so its readiness is 503 and requests get a clear 503.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpx

from .config import ControllerConfig
from .nodes import Node

log = logging.getLogger("mindie_host.ms.controller")

PREFILL = "prefill"
DECODE = "decode"
STATUSES = ("RoleUnknown", "RoleSwitching", "RoleReady")
#: ``is_heterogeneous``: the role each rank table ``hardware_type`` takes (spec §3.6: 32G nodes P, 64G nodes D)
HARDWARE_ROLES = {"800I A2(32G)": PREFILL, "800I A2(64G)": DECODE}


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def prefill_target(n: int, p_rate: int, d_rate: int, input_length: int, output_length: int) -> int:
    """How many of ``n`` servers should be P.

    The rule:

    * ``p_rate`` and ``d_rate`` both non-zero (``default_p_rate`` / ``default_d_rate``, or
      ``MINDIE_MS_P_RATE`` / ``MINDIE_MS_D_RATE``): the P share is ``p_rate / (p_rate + d_rate)``.
    * both 0 (automatic, a simple form of the spec's digs idea): prompt tokens are P's work and
      output tokens D's, so the P share is ``input_length / (input_length + output_length)``
      (``digs_request_summary_input_length`` / ``_output_length``).

    ``n_p = round(n * share)`` (halves round up), then bounded to ``[1, n - 1]`` when ``n >= 2``
    (at least one P and one D) and to ``[0, 1]`` when ``n == 1`` (the lone server takes the
    larger side; a group of one is unavailable anyway). ``n == 0`` gives 0.
    """
    if n <= 0:
        return 0
    if p_rate and d_rate:
        share = p_rate / (p_rate + d_rate)
    else:
        total = input_length + output_length
        share = input_length / total if total > 0 else 0.5
    n_p = _round_half_up(n * share)
    low, high = (1, n - 1) if n >= 2 else (0, 1)
    return max(low, min(high, n_p))


def decide_roles(servers: Sequence[int], current: Mapping[int, str], *, p_rate: int = 0, d_rate: int = 0,
                 input_length: int = 3000, output_length: int = 200) -> dict[int, str]:
    """The role (``"prefill"`` or ``"decode"``) of every id in ``servers``.

    Roles are stable: a server whose ``current`` role is ``prefill`` or ``decode`` keeps it. The
    others, in ascending id order, each join the side further below its target
    (:func:`prefill_target` of ``len(servers)`` for P, the rest for D; ties go to P). Since the
    targets add up to ``len(servers)``, a new server always finds a side below target. Kept roles
    are never switched, so a side that lost its servers stays short until new servers join.
    """
    n_p = prefill_target(len(servers), p_rate, d_rate, input_length, output_length)
    targets = {PREFILL: n_p, DECODE: len(servers) - n_p}
    roles = {sid: current[sid] for sid in servers if current.get(sid) in targets}
    have = {role: sum(1 for r in roles.values() if r == role) for role in targets}
    for sid in sorted(s for s in servers if s not in roles):
        role = PREFILL if targets[PREFILL] - have[PREFILL] >= targets[DECODE] - have[DECODE] else DECODE
        roles[sid] = role
        have[role] += 1
    return roles


def role_body(local: Node, peers: Iterable[Node]) -> dict[str, Any]:
    """The ``POST /v1/role/{role}`` body (spec Table 4-15) for ``local`` with ``peers``."""
    return {
        "local": {"server_ip": local.addr.ip, "device": local.addr.device_list()},
        "peers": [{"server_ip": p.addr.ip, "device": p.addr.device_list()} for p in peers],
    }


class RoleManager:
    """Decides the roles of the servers, pushes them, and says which servers are live (pd_separate)."""

    def __init__(self, config: ControllerConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.tasks: dict[int, tuple[tuple[str, tuple[int, ...]], asyncio.Task[None]]] = {}
        self.pushed_at: dict[int, float] = {}
        self.blocked: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.group_state: tuple[int, int] | None = None

    @property
    def check_window(self) -> float:
        """Seconds a server has to report ``RoleReady`` after its role was pushed."""
        return float(self.config.check_role_attempt_times * self.config.check_role_wait_seconds)

    # -- members and decision -------------------------------------------------------------------
    def members(self, nodes: Iterable[Node]) -> list[Node]:
        """The servers that take part in the role decision (see the module docstring)."""
        out = []
        for node in nodes:
            if not node.initialized or node.is_faulty or node.delete_time or not node.is_healthy:
                continue
            if node.infer_mode not in ("", "dmi"):
                log.error("[NodeScheduler] server %d (%s:%d) reports inferMode %r; pd_separate needs servers with "
                          "ServerConfig.inferMode 'dmi': marked faulty", node.id, node.addr.ip, node.addr.port,
                          node.infer_mode)
                self._set_aside(node, f"inferMode is {node.infer_mode!r}, not 'dmi'")
                continue
            if self.config.is_heterogeneous and node.addr.hardware_type not in HARDWARE_ROLES:
                log.error("[NodeScheduler] server %d (%s:%d) has hardware_type %r in the rank table; with "
                          "is_heterogeneous every server needs one of %s: marked faulty", node.id, node.addr.ip,
                          node.addr.port, node.addr.hardware_type, ", ".join(map(repr, HARDWARE_ROLES)))
                self._set_aside(node, f"hardware_type {node.addr.hardware_type!r} is not one of "
                                      f"{', '.join(HARDWARE_ROLES)}")
                continue
            out.append(node)
        return out

    def update(self, nodes: Mapping[int, Node]) -> None:
        """Assign roles to new members and (re)push every role whose target changed."""
        members = self.members(nodes.values())
        by_id = {n.id: n for n in members}
        for sid in [s for s, (_, t) in self.tasks.items() if t.done() and s not in by_id]:
            del self.tasks[sid]
        if self.config.is_heterogeneous:  # the hardware decides: 32G nodes prefill, 64G nodes decode
            decided = {sid: HARDWARE_ROLES[node.addr.hardware_type] for sid, node in by_id.items()}
        else:
            decided = decide_roles(sorted(by_id), {n.id: n.role for n in members if n.role},
                                   p_rate=self.config.p_rate, d_rate=self.config.d_rate,
                                   input_length=self.config.digs_input_length,
                                   output_length=self.config.digs_output_length)
        for sid, role in decided.items():
            node = by_id[sid]
            if node.role != role:
                node.role, node.role_pushed, node.pushed_peers = role, False, None
                log.info("[NodeScheduler] server %d (%s:%d) is assigned the role %s", sid, node.addr.ip,
                         node.addr.port, role)
        side = {PREFILL: sorted(s for s, r in decided.items() if r == PREFILL),
                DECODE: sorted(s for s, r in decided.items() if r == DECODE)}
        for sid, role in decided.items():
            node = by_id[sid]
            peers = tuple(side[DECODE if role == PREFILL else PREFILL])
            target = (role, peers)
            running = self.tasks.get(sid)
            if running is not None:
                if running[0] == target and not running[1].done():
                    continue
                running[1].cancel()
                del self.tasks[sid]
            lost = node.role_status == "RoleUnknown" or (node.role_status == "RoleReady" and node.current_role != role)
            if node.role_pushed and lost and node.status_sent_at > self.pushed_at.get(sid, 0.0):
                log.warning("[NodeScheduler] server %d (%s:%d) reports %s/%s after its role was pushed "
                            "(restarted?); pushing %s again", sid, node.addr.ip, node.addr.port, node.role_status,
                            node.current_role, role)
                node.role_pushed = False
            if node.role_pushed and node.pushed_peers == peers:
                continue
            peer_nodes = [by_id[p] for p in peers]
            local_count = len(node.addr.device_list())
            wrong = [p for p in peer_nodes if len(p.addr.device_list()) != local_count]
            if wrong:
                if self.blocked.get(sid) != target:
                    self.blocked[sid] = target
                    log.error("[NodeScheduler] cannot push the role %s to server %d (%s:%d): it has %d device(s) but "
                              "peer(s) %s have %s; P and D instances need the same device count", role, sid,
                              node.addr.ip, node.addr.port, local_count, [p.id for p in wrong],
                              [len(p.addr.device_list()) for p in wrong])
                continue
            self.blocked.pop(sid, None)
            task = asyncio.create_task(self._push(node, role, peer_nodes))
            self.tasks[sid] = (target, task)

    # -- pushing --------------------------------------------------------------------------------
    def _url(self, node: Node, path: str) -> str:
        scheme = self.config.tls["request_server"].scheme
        return f"{scheme}://{node.addr.ip}:{node.addr.management_port}{path}"

    async def _post(self, node: Node, role: str, body: dict[str, Any]) -> str:
        """One ``POST /v1/role``; returns "" on 200, else why it failed."""
        try:
            resp = await self.client.post(self._url(node, f"/v1/role/{role}"), json=body)
        except httpx.HTTPError as exc:
            return type(exc).__name__
        if resp.status_code == 200:
            return ""
        return f"answered {resp.status_code} {resp.text[:200]}"

    async def _status(self, node: Node) -> dict[str, Any] | None:
        try:
            resp = await self.client.get(self._url(node, "/v1/status"))
            body = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    async def _push(self, node: Node, role: str, peers: list[Node]) -> None:
        """Push ``role`` with ``peers`` to ``node`` and wait for ``RoleReady``; mark it faulty on failure."""
        cfg = self.config
        body = role_body(node, peers)
        peer_ids = tuple(p.id for p in peers)
        where = f"server {node.id} ({node.addr.ip}:{node.addr.management_port})"
        posts = 0
        why = "not sent"
        while posts < cfg.init_role_attempt_times:
            if posts:
                await asyncio.sleep(cfg.check_role_wait_seconds)
            why = await self._post(node, role, body)
            posts += 1
            if not why:
                break
            log.warning("[NodeScheduler]PostSingleRole: request failed, %s, role %s: %s (attempt %d of %d)", where,
                        role, why, posts, cfg.init_role_attempt_times)
        else:
            self._failed(node, role, f"POST /v1/role/{role} failed {posts} times: {why}")
            return
        last = "no answer"
        for check in range(cfg.check_role_attempt_times):
            if check:
                await asyncio.sleep(cfg.check_role_wait_seconds)
            status = await self._status(node)
            service = status.get("service", {}) if status else {}
            if not isinstance(service, dict):
                service = {}
            state, current = service.get("roleStatus"), service.get("currentRole")
            last = f"roleStatus {state}, currentRole {current}" if status else "no answer"
            if state == "RoleReady" and current == role:
                node.role_pushed, node.pushed_peers, node.peers = True, peer_ids, list(peer_ids)
                node.role_status, node.current_role = "RoleReady", role
                self.pushed_at[node.id] = time.monotonic()
                log.info("[NodeScheduler] %s is %s (RoleReady); peers %s", where, role, list(peer_ids))
                return
            if state == "RoleUnknown" and posts < cfg.init_role_attempt_times:
                why = await self._post(node, role, body)
                posts += 1
                if why:
                    log.warning("[NodeScheduler]PostSingleRole: request failed, %s, role %s: %s", where, role, why)
        self._failed(node, role, f"not RoleReady as {role} after {cfg.check_role_attempt_times} checks "
                                 f"{cfg.check_role_wait_seconds} s apart ({last})")

    def _failed(self, node: Node, role: str, why: str) -> None:
        log.error("[NodeScheduler]SendRole: server %d (%s:%d) failed to take the role %s: %s; marked faulty",
                  node.id, node.addr.ip, node.addr.management_port, role, why)
        self._set_aside(node, why)

    def _set_aside(self, node: Node, why: str) -> None:
        """Mark ``node`` faulty without a role; it is initialized again (and taken back) after the check window."""
        node.is_faulty, node.last_error = True, why
        node.role, node.role_pushed, node.pushed_peers, node.peers = "", False, None, []
        node.initialized, node.attempts = False, 0
        node.next_try = time.monotonic() + max(self.check_window, self.config.server_online_wait_seconds)

    # -- the live set ---------------------------------------------------------------------------
    def live(self, nodes: Iterable[Node]) -> list[Node]:
        """The servers to push to the coordinator: empty unless the group has at least 1 P and 1 D."""
        live = [n for n in nodes if n.pd_live and not n.delete_time]
        p = sum(1 for n in live if n.role == PREFILL)
        d = len(live) - p
        state = (p, d)
        ok = p >= 1 and d >= 1
        if state != self.group_state:
            if not ok:
                log.warning("[NodeScheduler] group 0 unavailable: needs at least 1 P and 1 D (has %d P, %d D)", p, d)
            elif self.group_state is None or min(self.group_state) < 1:
                log.info("[NodeScheduler] group 0 available: %d P, %d D", p, d)
            else:
                log.info("[NodeScheduler] group 0: %d P, %d D", p, d)
            self.group_state = state
        return live if ok else []

    async def close(self) -> None:
        """Cancel the pushes in flight."""
        tasks = [t for _, t in self.tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
