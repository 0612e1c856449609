"""Several model instances in one server (``BackendConfig.modelInstanceNumber`` > 1).

Each instance is an engine-core process (with its tensor-parallel ranks when ``worldSize`` > 1)
on its own device group, ``BackendConfig.npuDeviceIds[i]``, supervised on its own by an
:class:`~mindie_host.runtime.engine_client.EngineProcessClient`. :class:`EngineInstances` gives the
protocol modules the same interface as one engine and sends each new request to the live
instance with the fewest requests in flight (ties: the lowest index). The server is ready while
at least one instance is; an instance that dies fails only its own requests and restarts alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ..engine.request import EngineRequest, RequestError, RequestOutput

if TYPE_CHECKING:
    from ..host import Host
    from .engine_client import EngineProcessClient

log = logging.getLogger("mindie_host.engine.instances")


class EngineInstances:
    """The front end's handle on ``modelInstanceNumber`` engine instances, balanced by requests in flight."""

    def __init__(self, host: Host, clients: list[EngineProcessClient]) -> None:
        self.host = host
        self.clients = clients
        self._owner: dict[str, EngineProcessClient] = {}
        for client in clients:
            client.report_ready = self._ready_changed

    def _ready_changed(self, _up: bool) -> None:
        if not self.host.draining:
            self.host.ready = any(c.up for c in self.clients)

    # -- the engine interface ---------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        return sum(c.num_active for c in self.clients)

    @property
    def dead(self) -> str | None:
        """Set when no instance can come back (each one's restart budget is spent)."""
        if all(c.dead for c in self.clients):
            return "; ".join(f"instance {i}: {c.dead}" for i, c in enumerate(self.clients))
        return None

    @property
    def restarting(self) -> str | None:
        down = [f"instance {i}: {c.restarting}" for i, c in enumerate(self.clients) if c.restarting]
        return "; ".join(down) or None

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.clients)

    @property
    def engine_stats(self) -> dict[str, float]:
        """The instances' engine statistics, summed (counts, tokens, blocks)."""
        total: dict[str, float] = {}
        for c in self.clients:
            for key, value in c.engine_stats.items():
                total[key] = total.get(key, 0.0) + value
        return total

    @property
    def engine_plugin_metrics(self) -> dict[str, float]:
        """The engine-side plugin metrics of the instances: rates, ratios and percentages averaged, the rest summed."""
        total: dict[str, float] = {}
        seen: dict[str, int] = {}
        for c in self.clients:
            for key, value in c.engine_plugin_metrics.items():
                total[key] = total.get(key, 0.0) + value
                seen[key] = seen.get(key, 0) + 1
        return {k: v / seen[k] if k.endswith(("_rate", "_ratio", "_perc")) else v for k, v in total.items()}

    def pick(self) -> EngineProcessClient:
        """The live instance with the fewest requests in flight."""
        live = [c for c in self.clients if c.up]
        if not live:
            raise RequestError("The engine is restarting; retry the request shortly.", status=503)
        return min(live, key=lambda c: c.num_active)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        client = self.pick()
        self._owner[request.request_id] = client
        try:
            async for out in client.generate(request):
                yield out
        finally:
            self._owner.pop(request.request_id, None)

    def abort(self, request_id: str) -> bool:
        client = self._owner.get(request_id)
        return client.abort(request_id) if client is not None else False

    def release(self, request_id: str) -> None:
        """See :meth:`AsyncEngine.release` (dmi mode runs one instance)."""
        self.clients[0].release(request_id)

    def abort_all(self) -> int:
        return sum(c.abort_all() for c in self.clients)

    async def command(self, target: str, command: str, payload: Any = None) -> list[Any]:
        """Run a plugin's engine command in every instance (each holds its own copy of the plugin's state)."""
        down = [i for i, c in enumerate(self.clients) if not c.up]
        if down:
            raise RequestError(f"model instance(s) {down} are restarting; retry shortly", status=503)
        answers = await asyncio.gather(*(c.command(target, command, payload) for c in self.clients))
        return [a for one in answers for a in one]

    def call(self, fn: Callable[[Any], Any]) -> None:
        self.clients[0].call(fn)  # refuses: the engines live in other processes

    def start(self) -> None:
        for c in self.clients:
            c.start()

    def run_here(self) -> None:
        self.start()
        self.clients[0].run_here()

    def stop(self) -> None:
        for c in self.clients:
            c.stop()
