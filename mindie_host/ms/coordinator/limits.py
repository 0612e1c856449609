"""Admission, per-instance caps and the queue of requests waiting for an instance.

* ``max_requests``: requests in the coordinator (queued or in flight) above it are refused at
  once with "Too many requests" (HTTP 429; the spec gives no code).
* ``single_node_max_requests``: an instance with that many requests in flight takes no more;
  when every instance is at its cap the request waits in a queue, served in
  ``reordering_type`` order (FCFS: arrival; SJF: smallest request first; LJF: largest first;
  size is the request body's length), until ``schedule_timeout`` ("Request schedule timeout").
* With no instance in rotation at all a request is refused with "MindIE-MS Coordinator is not
  ready" (503) rather than queued.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from .instances import Instance, InstanceTable
from .routing import RequestInfo, Router

TOO_MANY = "Too many requests"
NOT_READY = "MindIE-MS Coordinator is not ready"
SCHEDULE_TIMEOUT = "Request schedule timeout"


class Refused(Exception):
    """A request the coordinator will not forward; ``status`` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int, error_type: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type or {429: "Too Many Requests", 503: "Service Unavailable",
                                         504: "Timeout", 413: "Payload Too Large"}.get(status, "Bad Request")


@dataclass(order=True)
class _Waiter:
    rank: tuple[int, int]
    info: RequestInfo = field(compare=False)
    future: asyncio.Future[Instance] = field(compare=False)
    exclude: frozenset[int] = field(compare=False, default=frozenset())


class Scheduler:
    """Hands instances to requests within the caps; one per coordinator, on its event loop."""

    def __init__(self, table: InstanceTable, router: Router, *, max_requests: int, single_node_max_requests: int,
                 reordering: str = "FCFS", schedule_timeout: float = 60.0) -> None:
        self.table = table
        self.router = router
        self.max_requests = max_requests
        self.per_instance = single_node_max_requests
        self.reordering = reordering
        self.schedule_timeout = schedule_timeout
        self.in_coordinator = 0
        self.queue: list[_Waiter] = []
        self._seq = itertools.count()

    def admit(self) -> None:
        """Count a new request in, or refuse it (429) over ``max_requests``."""
        if self.in_coordinator >= self.max_requests:
            raise Refused(TOO_MANY, 429)
        self.in_coordinator += 1

    def leave(self) -> None:
        """A request admitted with :meth:`admit` is over."""
        self.in_coordinator -= 1

    def _eligible(self, exclude: frozenset[int]) -> list[Instance]:
        return [i for i in self.table.available() if i.active < self.per_instance and i.id not in exclude]

    def _rank(self, info: RequestInfo) -> tuple[int, int]:
        seq = next(self._seq)
        if self.reordering == "SJF":
            return (info.size, seq)
        if self.reordering == "LJF":
            return (-info.size, seq)
        return (0, seq)

    def _assign(self, inst: Instance, info: RequestInfo) -> Instance:
        inst.active += 1
        inst.allocated_blocks += max(1, -(-info.est_tokens // max(1, inst.block_size)))
        self.router.chosen(inst, info)
        return inst

    async def acquire(self, info: RequestInfo, exclude: frozenset[int] = frozenset()) -> Instance:
        """An instance for ``info`` (not one of ``exclude``), waiting in the queue when all are busy."""
        candidates = [i for i in self.table.available() if i.id not in exclude]
        if not candidates:
            raise Refused(NOT_READY, 503)
        eligible = self._eligible(exclude)
        if eligible and not self.queue:
            return self._assign(self.router.pick(eligible, info), info)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(self._rank(info), info, loop.create_future(), exclude)
        heapq.heappush(self.queue, waiter)
        self.dispatch()
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.schedule_timeout or None)
        except asyncio.TimeoutError:
            self._drop(waiter)
            raise Refused(SCHEDULE_TIMEOUT, 504) from None
        except asyncio.CancelledError:  # the client left while queued
            self._drop(waiter)
            raise

    def _drop(self, waiter: _Waiter) -> None:
        """Take a waiter out of the queue; an instance given to it at the last moment is handed back."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), waiter.info)
            return
        future.cancel()
        self.queue = [w for w in self.queue if w is not waiter]
        heapq.heapify(self.queue)

    def dispatch(self) -> None:
        """Give free instances to queued requests, in queue order."""
        while self.queue:
            head = self.queue[0]
            if head.future.done():
                heapq.heappop(self.queue)
                continue
            if not [i for i in self.table.available() if i.id not in head.exclude]:
                heapq.heappop(self.queue)
                head.future.set_exception(Refused(NOT_READY, 503))
                continue
            eligible = self._eligible(head.exclude)
            if not eligible:
                return
            heapq.heappop(self.queue)
            head.future.set_result(self._assign(self.router.pick(eligible, head.info), head.info))

    def release(self, inst: Instance, info: RequestInfo) -> None:
        """A request is done with ``inst``; wake the queue."""
        inst.active = max(0, inst.active - 1)
        inst.allocated_blocks = max(0, inst.allocated_blocks - max(1, -(-info.est_tokens // max(1, inst.block_size))))
        self.dispatch()
