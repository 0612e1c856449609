"""The coordinator's D result channels: one long-lived ``GET /dresult`` per D instance (PD disaggregation).

For every D listed in the table the coordinator keeps one long-lived ``GET /dresult`` on the
D's business ``ip:port`` (same TLS link as the data requests). The D writes one JSON envelope per line; each is handed, by ``reqId``, to the request
waiting for it (an :class:`asyncio.Queue` per request, registered on that D's channel before the
request goes to P; envelopes for other ids are ignored). A broken channel (the D died, or closed
it) hands every request waiting on that D a :class:`DFailed` event, the D leaves rotation
(:meth:`~.instances.Instance.mark_failed`) and the channel reconnects with backoff (0.1 s doubling
to 2 s) for as long as the D is listed; it is closed when the D leaves the table (once the
requests still waiting on it are done). Only a D whose channel is connected is given requests.

:mod:`.pd` runs the requests that wait on these channels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl as ssl_module
from typing import Any

import aiohttp

from .config import CoordinatorConfig
from .instances import ROLE_DECODE, Instance, InstanceTable
from .limits import Scheduler

log = logging.getLogger("mindie_host.ms.coordinator")

MAX_BACKOFF = 2.0
MAX_LINE = 64 << 20


class DFailed:
    """The event a waiting request gets when its D's ``/dresult`` channel broke."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


Event = dict[str, Any] | DFailed


class DChannel:
    """The long-lived ``GET /dresult`` connection to one D instance, reconnected with backoff."""

    def __init__(self, hub: DResultHub, inst: Instance) -> None:
        self.hub = hub
        self.id = inst.id
        self.url = f"{hub.scheme}://{inst.ip}:{inst.port}/dresult"
        self.waiters: dict[str, asyncio.Queue[Event]] = {}
        self.connected = False
        self.leaving = False  # the D left the table: closed once its last waiting request is done
        self.last_failure = ""
        self.task: asyncio.Task[None] = asyncio.create_task(self._run())

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            reason = "the D closed its /dresult channel"
            try:
                async with self.hub.session.get(self.url) as resp:
                    if resp.status != 200:
                        raise ConnectionError(f"/dresult answered {resp.status}")
                    self.connected, backoff = True, 0.1
                    log.info("D result channel to %s open", self.url)
                    self.hub.on_connect()
                    await self._read(resp)
            except asyncio.CancelledError:
                self._fail_all("the D left the instance table")
                raise
            except Exception as exc:  # any failure breaks the channel; it is opened again
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if not isinstance(exc, (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError)):
                    log.exception("D result channel to %s failed", self.url)
            if self.connected:
                self.connected = False
                log.warning("D result channel to %s broke: %s", self.url, reason)
                inst = self.hub.table.get(self.id)
                if inst is not None:
                    inst.mark_failed(f"/dresult: {reason}")
            elif reason != self.last_failure:
                log.warning("cannot open the D result channel %s: %s; retrying", self.url, reason)
            self.last_failure = reason
            self._fail_all(reason)
            if self.leaving:
                self.hub.draining.discard(self)
                return
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF, backoff * 2)

    async def _read(self, resp: aiohttp.ClientResponse) -> None:
        buf = bytearray()
        async for chunk in resp.content.iter_any():
            start = len(buf)
            buf += chunk
            while True:
                end = buf.find(b"\n", start)
                if end < 0:
                    break
                self._line(bytes(buf[:end]))
                del buf[:end + 1]
                start = 0
            if len(buf) > MAX_LINE:
                raise ValueError(f"a /dresult line longer than {MAX_LINE} bytes")

    def _line(self, line: bytes) -> None:
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        if not line or line.startswith(b":"):
            return
        try:
            envelope = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            log.error("DResultNormalToken: a line from %s is not JSON: %r", self.url, line[:200])
            return
        if not isinstance(envelope, dict) or "reqId" not in envelope:
            log.error("DResultNormalToken: an envelope from %s without reqId: %r", self.url, line[:200])
            return
        queue = self.waiters.get(str(envelope["reqId"]))
        if queue is None:
            log.debug("DResultNormalToken: Get request id info failed (%s from %s)", envelope["reqId"], self.url)
            return
        queue.put_nowait(envelope)

    def _fail_all(self, reason: str) -> None:
        waiters, self.waiters = self.waiters, {}
        for queue in waiters.values():
            queue.put_nowait(DFailed(reason))

    def register(self, req_id: str) -> asyncio.Queue[Event]:
        """A queue that gets this D's envelopes for ``req_id`` (a :class:`DFailed` at once when not connected)."""
        queue: asyncio.Queue[Event] = asyncio.Queue()
        if self.connected:
            self.waiters[req_id] = queue
        else:
            queue.put_nowait(DFailed("the D's /dresult channel is not connected"))
        return queue

    def unregister(self, req_id: str, queue: asyncio.Queue[Event]) -> None:
        """Stop routing ``req_id`` to ``queue``; a leaving channel closes with its last waiter."""
        if self.waiters.get(req_id) is queue:
            del self.waiters[req_id]
        if self.leaving and not self.waiters:
            self.task.cancel()
            self.hub.draining.discard(self)


class DResultHub:
    """The ``/dresult`` channels of the D instances in the table."""

    def __init__(self, config: CoordinatorConfig, table: InstanceTable, scheduler: Scheduler,
                 ssl: ssl_module.SSLContext | bool, scheme: str) -> None:
        self.config = config
        self.table = table
        self.scheduler = scheduler
        self.ssl = ssl
        self.scheme = scheme
        self.channels: dict[int, DChannel] = {}
        self.draining: set[DChannel] = set()
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client for the channels (no read timeout: the channels are long-lived)."""
        if self._session is None:
            timeout = self.config.http_timeout_seconds or None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=self.ssl),
                timeout=aiohttp.ClientTimeout(total=None, connect=timeout, sock_connect=timeout, sock_read=None),
                headers={"user-agent": self.config.user_agent}, auto_decompress=False, trust_env=False)
        return self._session

    def on_connect(self) -> None:
        """A channel opened: requests queued for a D may go now."""
        self.scheduler.dispatch()

    def sync(self) -> None:
        """Open a channel to every D in the table; close those whose D left (or is no longer a D).

        A channel with requests still waiting on it is kept until they are done (a D that left the
        table, e.g. while the group lacks a P, may still be finishing them); it takes no new ones.
        """
        wanted = {iid: inst for iid, inst in self.table.items.items() if inst.role == ROLE_DECODE}
        for iid in [i for i in self.channels if i not in wanted]:
            channel = self.channels.pop(iid)
            if channel.waiters and channel.connected:
                channel.leaving = True
                self.draining.add(channel)
                log.info("instance %d left the table; its D result channel closes after %d request(s)", iid,
                         len(channel.waiters))
            else:
                channel.task.cancel()
                log.info("D result channel to instance %d closed (left the table)", iid)
        for iid, inst in wanted.items():
            if iid not in self.channels:
                self.channels[iid] = DChannel(self, inst)

    def connected(self, inst: Instance) -> bool:
        """Whether ``inst``'s channel is open."""
        channel = self.channels.get(inst.id)
        return channel is not None and channel.connected

    def register(self, inst: Instance, req_id: str) -> tuple[DChannel | None, asyncio.Queue[Event]]:
        """Wait for ``req_id``'s envelopes from D ``inst``: its channel and the queue they arrive on."""
        channel = self.channels.get(inst.id)
        if channel is None:
            queue: asyncio.Queue[Event] = asyncio.Queue()
            queue.put_nowait(DFailed("the D has no /dresult channel"))
            return None, queue
        return channel, channel.register(req_id)

    async def close(self) -> None:
        """Close every channel and the client."""
        tasks = [c.task for c in [*self.channels.values(), *self.draining]]
        self.channels.clear()
        self.draining.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
