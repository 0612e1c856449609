"""Admission, per-instance caps and the queue of requests waiting for an instance.

* ``max_requests``: requests in the coordinator (queued or in flight) above it are refused at
  once with "Too many requests" (HTTP 429; the spec gives no code).
* ``single_node_max_requests``: an instance with that many requests in flight takes no more;
  when every instance is at its cap the request waits in a queue, served in
  ``reordering_type`` order (FCFS: arrival; SJF: smallest request first; LJF: largest first;
  size is the request body's length), until ``schedule_timeout`` ("Request schedule timeout").
* With no instance in rotation at all a request is refused with "MindIE-MS Coordinator is not
  ready" (503) rather than queued.

:meth:`Scheduler.acquire` can be narrowed to some instances (``accept``, e.g. the P instances in
pd_separate) with its own refusal message (``missing``) when none of them is in rotation. Each
``accept`` has its own queue (same order rule), so a request that holds a P while it waits for a
D is never stuck behind one that waits for a P.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
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
    accept: Callable[[Instance], bool] | None = field(compare=False, default=None)
    missing: str = field(compare=False, default=NOT_READY)


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
        self.queues: dict[Callable[[Instance], bool] | None, list[_Waiter]] = {None: []}
        self._seq = itertools.count()

    @property
    def queue(self) -> list[_Waiter]:
        """The queue of requests that may take any instance (the only one in single_node)."""
        return self.queues[None]

    def admit(self) -> None:
        """Count a new request in, or refuse it (429) over ``max_requests``."""
        if self.in_coordinator >= self.max_requests:
            raise Refused(TOO_MANY, 429)
        self.in_coordinator += 1

    def leave(self) -> None:
        """A request admitted with :meth:`admit` is over."""
        self.in_coordinator -= 1

    def _candidates(self, exclude: frozenset[int], accept: Callable[[Instance], bool] | None) -> list[Instance]:
        return [i for i in self.table.available() if i.id not in exclude and (accept is None or accept(i))]

    def _eligible(self, exclude: frozenset[int], accept: Callable[[Instance], bool] | None = None) -> list[Instance]:
        return [i for i in self._candidates(exclude, accept) if i.active < self.per_instance]

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

    async def acquire(self, info: RequestInfo, exclude: frozenset[int] = frozenset(),
                      accept: Callable[[Instance], bool] | None = None, missing: str = NOT_READY) -> Instance:
        """An instance for ``info`` (not one of ``exclude``), waiting in the queue when all are busy.

        ``accept`` narrows the instances considered; when none of them is in rotation the request is
        refused (503) with ``missing``.
        """
        if not self._candidates(exclude, accept):
            raise Refused(missing, 503)
        eligible = self._eligible(exclude, accept)
        queue = self.queues.setdefault(accept, [])
        if eligible and not queue:
            return self._assign(self.router.pick(eligible, info), info)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(self._rank(info), info, loop.create_future(), exclude, accept, missing)
        heapq.heappush(queue, waiter)
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
        queue = [w for w in self.queues.get(waiter.accept, []) if w is not waiter]
        heapq.heapify(queue)
        self.queues[waiter.accept] = queue

    def dispatch(self) -> None:
        """Give free instances to queued requests, each queue in its order."""
        for queue in self.queues.values():
            self._dispatch(queue)

    def _dispatch(self, queue: list[_Waiter]) -> None:
        while queue:
            head = queue[0]
            if head.future.done():
                heapq.heappop(queue)
                continue
            if not self._candidates(head.exclude, head.accept):
                heapq.heappop(queue)
                head.future.set_exception(Refused(head.missing, 503))
                continue
            eligible = self._eligible(head.exclude, head.accept)
            if not eligible:
                return
            heapq.heappop(queue)
            head.future.set_result(self._assign(self.router.pick(eligible, head.info), head.info))

    def release(self, inst: Instance, info: RequestInfo) -> None:
        """A request is done with ``inst``; wake the queue."""
        inst.active = max(0, inst.active - 1)
        inst.allocated_blocks = max(0, inst.allocated_blocks - max(1, -(-info.est_tokens // max(1, inst.block_size))))
        self.dispatch()
